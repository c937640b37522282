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
from the operating system's CSPRNG. A fixed seed makes a run reproducible
(research on public data, tests) and must never key a run whose privacy
matters.

Two draws, both deterministic in ``(seed, step)``:

* the default: torch's generator (Mersenne Twister on the CPU, Philox on
  CUDA) seeded with 64 bits of ``SHA-256(seed, step)``, in each leaf's dtype.
  Fast and statistically sound, but not a cryptographic generator, and its
  float samples are exposed to the floating-point attack below.
* ``secure=True``: a ChaCha20 keystream (Bernstein 2008, through the
  ``cryptography`` package) keyed by ``SHA-256(seed, step)``; 52 bits of the
  keystream per uniform in (0, 1], and Box-Muller in float64. The fixed
  all-zero nonce is safe because every step has its own key.

**The floating-point attack** (Mironov 2012, for Laplace noise; Holohan and
Braghin 2021, "Secure Random Sampling in Differential Privacy", for the
Gaussian): floating-point noise takes values on a sparse, irregular set,
and so does ``value + noise`` after rounding, so the low bits of a released
number can reveal which value it came from. dpfunc's defence: the secure
tree is float64 whatever the parameters' dtype, and :func:`add_noise` forms
``summed + std * noise`` at that precision and rounds it once to the
parameters' dtype. For float32, float16 and bfloat16 parameters the noise is
about ``2**29`` times finer than the output's spacing, so every output value
has (up to a relative error of about ``2**-29``) the Gaussian mass of its
rounding interval: the release is a rounding, i.e. a post-processing, of the
continuous Gaussian mechanism, and its low bits carry nothing about the
clipped sum. For float64 parameters no finer type exists; each value is then
the sum of four independent Box-Muller normals divided by two, Holohan and
Braghin's summation (also what Opacus' former secure mode did), which makes
the output set far denser but does not provably close the leak. Out of scope:
exact (discrete) sampling, and the floating-point arithmetic of everything
before the noise.
"""

from __future__ import annotations

import hashlib
import math
import secrets

import numpy as np
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


def standard_normal_like(params: PyTree, seed: int, step: int, *, secure: bool = False) -> PyTree:
    """Independent ``N(0, 1)`` draws shaped like ``params``, fixed by ``(seed, step)``.

    Leaves are drawn in optree's leaf order (dict keys sorted), each on its
    leaf's device. The same ``(seed, step, secure)`` always gives the same
    tree; distinct ``(seed, step)`` pairs give independent streams (the key
    is a SHA-256 hash of both). ``seed`` is the run's secret
    (:func:`secret_seed`).

    Args:
        params: the tree to match (shapes, devices; dtypes unless ``secure``).
        seed: a non-negative int, the secret.
        step: a non-negative int, the step count.
        secure: draw from ChaCha20 with the floating-point defences of the
            module docstring. The leaves are then float64 whatever the
            parameters' dtype (so that :func:`add_noise` rounds the noisy
            sum once), and float64 parameters get the four-term sum. Needs
            the ``cryptography`` package (``pip install "dpfunc[secure]"``).
            About 1.4x the time of ``torch.randn`` on a CPU for float32
            leaves, 6x for float64 ones (``bench/noise.py``).

    Raises:
        ValueError: ``seed`` or ``step`` is not a non-negative int, or
            ``secure`` is not a bool.
        ImportError: ``secure=True`` without ``cryptography``.

    >>> z = standard_normal_like({"w": torch.zeros(3)}, seed=secret_seed(), step=0, secure=True)
    >>> z["w"].dtype, z["w"].shape
    (torch.float64, torch.Size([3]))
    """
    for name, value in (("seed", seed), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {name}={value!r}")
    if not isinstance(secure, bool):
        raise ValueError(f"secure must be a bool, got secure={secure!r}")
    if secure:
        return _secure_normal_like(params, seed, step)
    digest = hashlib.sha256(f"dpfunc.noise:{seed}:{step}".encode()).digest()
    leaves = tree_leaves(params)
    device = leaves[0].device if leaves else torch.device("cpu")
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest[:8], "little"))
    return tree_normal_like(params, generator)


def _secure_normal_like(params: PyTree, seed: int, step: int) -> PyTree:
    try:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
    except ImportError as error:
        raise ImportError(
            "secure=True needs the 'cryptography' package: pip install \"dpfunc[secure]\""
        ) from error
    key = hashlib.sha256(f"dpfunc.secure-noise:{seed}:{step}".encode()).digest()
    keystream = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()

    def draw(leaf: Tensor) -> Tensor:
        terms = 4 if leaf.dtype == torch.float64 else 1
        count = leaf.numel() * terms
        words = torch.empty(count + count % 2, dtype=torch.int64)
        out = words.numpy().view(np.uint8)
        for start in range(0, out.size, _CHUNK):  # zeros XOR keystream = keystream
            piece = out[start : start + _CHUNK]
            keystream.update_into(_ZEROS[: piece.size], piece)
        z = _box_muller_(words)[:count]
        if terms > 1:
            z = z.view(terms, -1).sum(0).mul_(1 / math.sqrt(terms))
        return z.view(leaf.shape).to(leaf.device)

    return tree_map(draw, params)


_CHUNK = 1 << 20  # keystream bytes per call
_ZEROS = bytes(_CHUNK)


def _box_muller_(words: Tensor) -> Tensor:
    """Standard normals from an even number of uniformly random int64 words, in place.

    Each word's low 52 bits become the mantissa of a float64 ``x`` in
    ``[1, 2)``, and ``u = 2 - x`` is uniform on the grid ``k / 2**52`` of
    ``(0, 1]`` (never 0, so the logarithm is finite). Each pair ``(u1, u2)``
    of the two halves gives ``sqrt(-2 ln u1) * (sin, cos)(2 pi u2)`` (Box and
    Muller 1958). Returns the float64 normals in the words' memory.
    """
    words.bitwise_and_((1 << 52) - 1).bitwise_or_(0x3FF0000000000000)  # exponent of 1.0
    u = words.view(torch.float64).neg_().add_(2.0)
    u1, u2 = u.view(2, -1)
    radius = u1.log_().mul_(-2.0).sqrt_()
    angle = u2.mul_(2 * math.pi)
    sine = torch.sin(angle)
    angle.cos_().mul_(radius)
    radius.mul_(sine)
    return u


def add_noise(summed: Params, noise: Params, std: float | Tensor) -> Params:
    """``summed + std * noise`` leaf by leaf, in ``summed``'s dtype.

    The sum is formed at the precision of ``noise`` and rounded once to the
    dtype of ``summed``: a float64 (secure) noise tree on float32 parameters
    gives float32 results whose low bits are those of a rounded continuous
    Gaussian mechanism (see the module docstring). With noise in the
    parameters' dtype (the default draw) the rounding is the identity.

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
    return tree_map(lambda s, z: (s + std * z).to(s.dtype), summed, noise)


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
