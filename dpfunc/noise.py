"""The Gaussian mechanism: noise on the clipped sum, then the average.

DP-SGD adds ``N(0, (noise_multiplier * clip_norm)**2)`` independently to
every coordinate of the clipped sum (Abadi et al. 2016), then divides by the
EXPECTED batch size ``sample_rate * num_examples``. Dividing by the realised
(Poisson) batch size would make the denominator depend on the data and break
the sensitivity argument the accountant relies on.

Randomness enters as an explicit standard-normal tree drawn outside the
compiled step from a generator keyed by ``(seed, step)``: the step stays a
pure function, compiles once, and a run is reproducible and resumable from
its step count alone.

The seed is a secret. Whoever knows it can regenerate every noise draw and
subtract it from the released update, which leaves the exact clipped sum:
no privacy at all, whatever epsilon is printed. :func:`secret_seed` draws one
from the operating system's CSPRNG; a small fixed seed (``seed=0``) is for
reproducible research only and must never key a run whose privacy matters.
"""

from __future__ import annotations

import hashlib
import secrets

import torch
from torch import Tensor

from .tree import Params, PyTree, check_same_structure, tree_leaves, tree_map, tree_normal_like


SECRET_BITS = 256


def secret_seed() -> int:
    """A fresh secret seed: a uniform ``SECRET_BITS``-bit int from the OS CSPRNG.

    Key the noise (:func:`standard_normal_like`) and the Poisson sample
    (:func:`dpfunc.data.poisson_sample`) of a private run with it, keep it
    as private as the data (it lives in memory and in checkpoints), and never
    log or publish it. Its 256 bits match the SHA-256 and ChaCha20 keys
    derived from it. :class:`dpfunc.Trainer` draws one when ``seed=None``.

    >>> secret_seed() != secret_seed()
    True
    """
    return secrets.randbits(SECRET_BITS)


def standard_normal_like(params: PyTree, seed: int, step: int) -> PyTree:
    """Independent ``N(0, 1)`` draws shaped like ``params``, fixed by ``(seed, step)``.

    Leaves are drawn in optree's leaf order (dict keys sorted), each in its
    leaf's dtype and on its device. The same ``(seed, step)`` always gives
    the same tree; distinct pairs give independent streams (the generator
    seed is a SHA-256 hash of both).

    Raises:
        ValueError: ``seed`` or ``step`` is not a non-negative int.
    """
    for name, value in (("seed", seed), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {name}={value!r}")
    digest = hashlib.sha256(f"dpfunc.noise:{seed}:{step}".encode()).digest()
    leaves = tree_leaves(params)
    device = leaves[0].device if leaves else torch.device("cpu")
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest[:8], "little"))
    return tree_normal_like(params, generator)


def add_noise(summed: Params, noise: Params, std: float | Tensor) -> Params:
    """``summed + std * noise`` leaf by leaf.

    Args:
        summed: the clipped sum.
        noise: standard-normal draws with the same structure and shapes.
        std: the noise standard deviation, ``noise_multiplier * clip_norm``
            (``0`` adds nothing, even if ``clip_norm`` is inf).

    Raises:
        ValueError: the trees do not match, or ``std`` is negative or not finite.
    """
    check_same_structure(noise, summed, "noise", "the clipped sum")
    if not isinstance(std, Tensor) and not (0 <= std < float("inf")):
        raise ValueError(f"std must be finite and >= 0, got std={std!r}")
    return tree_map(lambda s, z: s + std * z, summed, noise)


def average(x: Params, expected_batch_size: float) -> Params:
    """Divides by the expected batch size ``sample_rate * num_examples``.

    Never pass the realised batch size: it depends on the data.

    Raises:
        ValueError: ``expected_batch_size`` is not > 0.
    """
    _check_expected_batch_size(expected_batch_size)
    return tree_map(lambda leaf: leaf / expected_batch_size, x)


def _check_expected_batch_size(expected_batch_size) -> None:
    if (
        isinstance(expected_batch_size, bool)
        or not isinstance(expected_batch_size, (int, float))
        or not 0 < expected_batch_size < float("inf")
    ):
        raise ValueError(
            "expected_batch_size must be a finite number > 0 (sample_rate * num_examples), "
            f"got expected_batch_size={expected_batch_size!r}"
        )
