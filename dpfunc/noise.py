"""The Gaussian mechanism: noise on the clipped sum, then the average.

DP-SGD adds ``N(0, (noise_multiplier * clip_norm)**2)`` independently to
every coordinate of the clipped sum (Abadi et al. 2016), then divides by the
EXPECTED batch size ``sample_rate * num_examples``. Dividing by the realised
(Poisson) batch size would make the denominator depend on the data and break
the sensitivity argument the accountant relies on.

Randomness enters as an explicit standard-normal tree drawn outside the
compiled step from a generator keyed by ``(seed, step)``: the step stays a
pure function, compiles once, and a run is reproducible and resumable from
its step count alone. What the step adds is the noise mechanism's output
(:class:`NoiseMechanism`): the draw itself for DP-SGD
(:func:`independent_noise`), a correlated one for banded noise
(:func:`dpfunc.matrix_factorization.banded_noise`).

The seed is a secret. Whoever knows it can regenerate every noise draw and
subtract it from the released update, which leaves the exact clipped sum:
no privacy at all, whatever epsilon is printed. :func:`secret_seed` draws one
from the operating system's CSPRNG. A fixed seed makes a run reproducible
(research on public data, tests) and must never key a run whose privacy
matters.

Two draws, both deterministic in ``(seed, step)``:

* the default: torch's generator from :func:`keyed_generator`, in each
  leaf's dtype. On the CPU its whole Mersenne Twister state (19,968 bits)
  comes from ``SHAKE-256(seed, step)``; ``manual_seed`` would keep only 32
  bits of any seed, so each step's noise would be one of ``2**32`` trees,
  few enough for someone who sees an update to try them all and subtract
  the right one. On CUDA, Philox takes a 64-bit key from the same hash.
  Fast and statistically sound, but not a cryptographic generator, and its
  float samples are exposed to the floating-point attack below.
* ``secure=True``: a ChaCha20 keystream (Bernstein 2008, through the
  ``cryptography`` package) keyed by ``SHA-256(seed, step)``; one 64-bit
  keystream word per uniform, on the grid ``(k + 1/2) * 2**-52`` of the open
  interval (0, 1), and Box-Muller in float64. The fixed all-zero nonce is
  safe because every step has its own key, so no (key, nonce) pair repeats.

**The floating-point attack** (Mironov 2012, for Laplace noise; Holohan and
Braghin 2021, "Secure Random Sampling in Differential Privacy", for the
Gaussian): floating-point noise takes values on a sparse, irregular set,
and so does ``value + noise`` after rounding, so the low bits of a released
number can reveal which value it came from. dpfunc's defence: the secure
tree is float64 whatever the parameters' dtype, :func:`add_noise` forms
``summed + std * noise`` at that precision (the step's running sum is
float64 too), and the step rounds the result once to the parameters' dtype,
after the average. For float32, float16 and bfloat16 parameters the noise is
about ``2**29`` times finer than the output's spacing, so every output value
has (up to a relative error of about ``2**-29``) the Gaussian mass of its
rounding interval: the release is a rounding, i.e. a post-processing, of the
continuous Gaussian mechanism, and its low bits carry nothing about the
clipped sum. For float64 parameters no finer type exists; each value is then
the sum of four independent normals from four different Box-Muller pairs
(so four radii; a leaf of one value has only two pairs) divided by two, Holohan and
Braghin's summation (also what Opacus' former secure mode did), which makes
the output set far denser but does not provably close the leak.

Limits of the argument. The uniforms are fixed point (spacing ``2**-52``),
so the radius ``r = sqrt(-2 ln u1)`` is finely spaced in the bulk but coarse
in the far tail, where ``u1`` is tiny: for float32 outputs the margin is
about ``2**29 * u1 * r**2``, some ``2**8`` at ``r = 6`` (probability
``e**-18 ~ 1.5e-8``) and about 1 at ``r = 7`` (probability ``2e-11``).
The smallest uniform is ``2**-53``, so one Box-Muller normal never exceeds
``sqrt(106 ln 2) ~ 8.57`` (the four-term sum: twice that); the Gaussian
mass cut off, about ``1e-17`` per coordinate, is not in the accountant's
delta. Out of scope: exact (discrete) sampling (Canonne, Kamath and Steinke
2020), and the floating-point arithmetic of everything before the noise.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from .checks import check_choice, check_number
from .tree import Params, PyTree, check_same_structure, tree_leaves, tree_map, tree_normal_like

SECRET_BITS = 256


def check_seed(seed: object) -> None:
    """Raises ``ValueError`` unless ``seed`` is an int >= 0, without ever showing its value.

    A seed may be a secret passed the wrong way (a string read from a file,
    a negated int); an error message must not put it in a log.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        shown = (
            "a negative int"
            if isinstance(seed, int) and not isinstance(seed, bool)
            else (f"a {type(seed).__name__}")
        )
        raise ValueError(
            f"seed must be an int >= 0 (see dpfunc.secret_seed()), got {shown}; "
            "seeds are secrets and are never printed"
        )


def secret_seed() -> int:
    """A fresh secret seed: a uniform ``SECRET_BITS``-bit int from the OS CSPRNG.

    Key the noise (:func:`standard_normal_like`) and the Poisson sample
    (:func:`dpfunc.data.poisson_sample`) of a private run with it, keep it
    as private as the data (it lives in memory and in checkpoints), and never
    log or publish it. Its 256 bits match the keys derived from it
    (SHA-256 for ChaCha20, SHAKE-256 for torch's generators).
    :class:`dpfunc.Trainer` draws one when ``seed=None``.

    >>> secret_seed() != secret_seed()
    True
    """
    return secrets.randbits(SECRET_BITS)


STREAMS = ("noise", "count")
"""Independent streams of one seed: the gradient noise, adaptive clipping's count noise."""


def standard_normal_like(
    params: PyTree, seed: int, step: int, *, secure: bool = False, stream: str = "noise"
) -> PyTree:
    """Independent ``N(0, 1)`` draws shaped like ``params``, fixed by ``(seed, step)``.

    Leaves are drawn in optree's leaf order (dict keys sorted), each on its
    leaf's device, so the tree does not depend on dict insertion order. The
    same ``(seed, step, secure)`` always gives the same tree; distinct
    ``(seed, step)`` pairs give independent streams (the key is a SHA-256
    hash of both, domain-separated from the Poisson sample's). ``seed`` is
    the run's secret (:func:`secret_seed`); any size of int is hashed whole.

    Args:
        params: the tree to match (shapes, devices; dtypes unless ``secure``).
        seed: a non-negative int, the secret.
        step: a non-negative int, the step count.
        secure: draw from ChaCha20 with the floating-point defences of the
            module docstring. The stream: key
            ``SHA-256("dpfunc.secure-{stream}:{seed}:{step}")``, nonce 16 zero
            bytes, the keystream read as little-endian 64-bit words and used
            leaf after leaf in leaf order. A leaf of ``n`` values takes
            ``n + n % 2`` words (``4 n`` for a float64 leaf): the first half
            are the ``u1`` and the second half the ``u2`` of Box-Muller,
            which gives the sine normals then the cosine normals, and an
            odd ``n`` drops the last one. The leaves are float64 whatever
            the parameters' dtype, so that :func:`add_noise` forms the noisy
            sum at double precision and rounds it once; float64 parameters
            get the four-term sum ``(z1 + z2 + z3 + z4) / 2`` of the ``4 n``
            normals' four rows, the sine rows as they are and the cosine rows
            rolled by one, so that the four terms come from four different
            pairs. Needs the ``cryptography`` package
            (``pip install "dpfunc[secure]"``). About 1.2x the time of
            ``torch.randn`` on a CPU for float32 leaves, 5x for float64
            ones (``bench/noise.py``); CUDA leaves are drawn on the CPU and
            copied over.
        stream: ``"noise"`` (the gradient noise) or ``"count"`` (adaptive
            clipping's count noise): independent draws from one seed and
            step, by domain separation of the key.

    Returns:
        A tree like ``params``: leaves in their own dtype by default (float32
        for bfloat16 and float16 ones), float64 with ``secure=True``; an empty
        tree gives an empty tree.

    Raises:
        ValueError: ``seed`` or ``step`` is not a non-negative int,
            ``secure`` is not a bool, a leaf is complex (``torch.randn``
            would give each real coordinate variance 1/2), a leaf is on the
            ``meta`` device, or (default draw) the leaves span several devices.
        ImportError: ``secure=True`` without ``cryptography``.

    >>> params = {"w": torch.zeros(2, 3, dtype=torch.bfloat16), "b": torch.zeros(3)}
    >>> z = standard_normal_like(params, seed=secret_seed(), step=0, secure=True)
    >>> {k: (v.dtype, tuple(v.shape)) for k, v in z.items()}
    {'w': (torch.float64, (2, 3)), 'b': (torch.float64, (3,))}
    >>> secret = secret_seed()
    >>> a = standard_normal_like(params, secret, step=5, secure=True)
    >>> torch.equal(a["w"], standard_normal_like(params, secret, step=5, secure=True)["w"])
    True
    >>> torch.equal(a["w"], standard_normal_like(params, secret, step=6, secure=True)["w"])
    False
    """
    check_seed(seed)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got step={step!r}")
    if not isinstance(secure, bool):
        raise ValueError(f"secure must be a bool, got secure={secure!r}")
    check_choice("stream", stream, STREAMS)
    complex_leaves = [x.dtype for x in tree_leaves(params) if x.is_complex()]
    if complex_leaves:  # torch.randn splits the variance over the real and imaginary parts
        raise ValueError(
            f"params must be real tensors, got dtype {complex_leaves[0]}: the Gaussian mechanism "
            "needs N(0, 1) on every real coordinate; view complex parameters as real ones "
            "(torch.view_as_real) in the loss instead"
        )
    leaves = tree_leaves(params)
    devices = sorted({str(x.device) for x in leaves})
    if "meta" in devices:
        raise ValueError(
            "params are on the meta device, which holds shapes but no values; materialise "
            "the model (model.to_empty(device=...) and load its weights) first"
        )
    if secure:
        return _secure_normal_like(params, seed, step, stream)
    if len(devices) > 1:  # one keyed generator draws every leaf, on one device
        raise ValueError(
            f"params span the devices {devices}, and the default noise draws every leaf from "
            "one generator on one device; use secure=True (Trainer(secure_noise=True)), which "
            "draws on the CPU and copies each leaf to its own device"
        )
    device = leaves[0].device if leaves else torch.device("cpu")
    return tree_normal_like(params, keyed_generator(f"dpfunc.{stream}", seed, step, device))


_MT_WORDS = 624  # 32-bit words of the Mersenne Twister state
_MT_OFFSET = 24  # bytes before the state words in torch's CPU generator state


def keyed_generator(domain: str, seed: int, step: int, device: torch.device) -> torch.Generator:
    """A torch generator on ``device`` whose whole state comes from ``(domain, seed, step)``.

    ``torch.Generator.manual_seed`` keeps only the low 32 bits of its
    argument on the CPU (the Mersenne Twister's seeding), so a secret seed
    passed through it would leave ``2**32`` possible streams per step. Here
    the CPU generator's 624 state words (19,968 bits) are the first bytes of
    ``SHAKE-256("{domain}:{seed}:{step}")``, set with ``set_state``; a CUDA
    (Philox) generator takes 64 bits of the same hash as its seed. Distinct
    domains (noise, Poisson sample) give independent streams.

    Raises:
        RuntimeError: this torch's CPU generator state has a layout dpfunc
            does not know (checked once), so the state cannot be keyed;
            ``secure=True`` still works.
    """
    material = hashlib.shake_256(f"{domain}:{seed}:{step}".encode()).digest(4 * _MT_WORDS)
    generator = torch.Generator(device=device)
    if torch.device(device).type != "cpu":
        generator.manual_seed(int.from_bytes(material[:8], "little"))
        return generator
    state = _cpu_state_template().clone()
    words = np.frombuffer(material, dtype="<u4").astype("<u8")
    view = state.numpy()
    view[_MT_OFFSET : _MT_OFFSET + 8 * _MT_WORDS] = words.view(np.uint8)
    generator.set_state(state)
    return generator


_TEMPLATE: list[Tensor] = []


def _cpu_state_template() -> Tensor:
    """A freshly seeded CPU state, after checking the layout keyed_generator writes into."""
    if not _TEMPLATE:
        probe = torch.Generator().manual_seed(0x5EED1234)
        state = probe.get_state()
        raw = bytes(state.numpy())
        header = np.frombuffer(raw[:_MT_OFFSET], dtype="<u8")
        words = np.frombuffer(raw[_MT_OFFSET : _MT_OFFSET + 8 * _MT_WORDS], dtype="<u8")
        if not (header[0] == 0x5EED1234 and words[0] == 0x5EED1234 and words.max() < 2**32):
            raise RuntimeError(
                f"torch {torch.__version__} stores its CPU generator state in a layout dpfunc "
                "does not know, so the default noise cannot be keyed with the whole secret; "
                "use standard_normal_like(..., secure=True) (Trainer(secure_noise=True))"
            )
        _TEMPLATE.append(state)
    return _TEMPLATE[0]


def _secure_normal_like(params: PyTree, seed: int, step: int, stream: str) -> PyTree:
    try:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
    except ImportError as error:
        raise ImportError(
            "secure=True needs the 'cryptography' package: pip install \"dpfunc[secure]\""
        ) from error
    key = hashlib.sha256(f"dpfunc.secure-{stream}:{seed}:{step}".encode()).digest()
    keystream = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()

    def draw(leaf: Tensor) -> Tensor:
        terms = 4 if leaf.dtype == torch.float64 else 1
        count = leaf.numel() * terms
        words = torch.empty(count + count % 2, dtype=torch.int64)
        out = words.numpy().view(np.uint8)
        for start in range(0, out.size, _CHUNK):  # zeros XOR keystream = keystream
            piece = out[start : start + _CHUNK]
            keystream.update_into(_ZEROS[: piece.size], piece)  # no zeroing pass over out
        z = _box_muller_(words)[:count]
        if terms > 1:  # sines of pairs j, n + j; cosines of pairs j + 1, n + j + 1 (mod n)
            rows = z.view(terms, -1)
            z = (rows[0] + rows[1] + rows[2].roll(-1) + rows[3].roll(-1)).mul_(0.5)
        return z.view(leaf.shape).to(leaf.device)

    return tree_map(draw, params)


_CHUNK = 1 << 20  # keystream bytes per call
_ZEROS = memoryview(bytes(_CHUNK))  # sliced without a copy


def _uniform_(words: Tensor) -> Tensor:
    """Uniforms in the open interval (0, 1) from uniformly random int64 words, in place.

    The low 52 bits ``k`` of each word give ``u = (k + 1/2) * 2**-52``: the
    midpoints of a grid of ``2**52`` equal cells, symmetric about 1/2, from
    ``2**-53`` to ``1 - 2**-53``, so never 0 (a finite logarithm) and never 1.
    Every such ``u`` is exact in float64 (53-bit significand); with 53 bits
    the midpoints above 1/2 would not be, and the top one would round to 1.
    Masking the low bits needs no shift (int64 ``>>`` is arithmetic).
    ``k`` becomes the mantissa of ``x = 1 + k * 2**-52`` in [1, 2), and
    ``x - (1 - 2**-53)`` is exact. Returns the float64 uniforms in the
    words' memory.
    """
    words.bitwise_and_((1 << 52) - 1).bitwise_or_(0x3FF0000000000000)  # exponent of 1.0
    return words.view(torch.float64).sub_(1 - 2**-53)


def _box_muller_(words: Tensor) -> Tensor:
    """Standard normals from an even number of uniformly random int64 words, in place.

    The words become uniforms (:func:`_uniform_`); the first half ``u1`` and
    the second half ``u2`` pair up, and each pair gives
    ``sqrt(-2 ln u1) * (sin, cos)(2 pi u2)`` (Box and Muller 1958): the sines
    in the first half, the cosines in the second. Returns the float64
    normals in the words' memory.
    """
    u1, u2 = _uniform_(words).view(2, -1)
    radius = u1.log_().mul_(-2.0).sqrt_()
    angle = u2.mul_(2 * math.pi)
    sine = torch.sin(angle)
    angle.cos_().mul_(radius)
    radius.mul_(sine)
    return words.view(torch.float64)


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
    check_expected_batch_size(expected_batch_size)
    return tree_map(lambda leaf: leaf / expected_batch_size, x)


class NoiseState(NamedTuple):
    """A noise mechanism's state between steps (held in ``TrainState.noise_state``)."""

    # correlated noise (bands b > 1): each leaf [b - 1, *param.shape], the last b - 1
    # correlated draws, newest first (dpfunc.matrix_factorization); {} for independent noise
    history: Params = {}  # noqa: RUF012 (never mutated: states are replaced, not changed)


class NoiseMechanism(NamedTuple):
    """How a step's standard-normal tree ``z_t`` becomes the noise it adds, ``w_t``.

    Two pure functions, in the style of :mod:`dpfunc.optim`: ``init(params)
    -> NoiseState``, the state before the first step, and ``update(z_t,
    state) -> (w_t, state)``. The step adds ``noise_std * w_t`` to the
    clipped sum. Made by :func:`independent_noise` and
    :func:`dpfunc.matrix_factorization.banded_noise`;
    :meth:`dpfunc.DPConfig.noise_mechanism` picks the one a config releases.
    """

    init: Callable[[Params], NoiseState]
    update: Callable[[Params, NoiseState], tuple[Params, NoiseState]]


def independent_noise() -> NoiseMechanism:
    """DP-SGD's Gaussian noise: every step adds its own draw, ``w_t = z_t``; no state.

    >>> mechanism = independent_noise()
    >>> state = mechanism.init({"w": torch.zeros(3)})
    >>> state
    NoiseState(history={})
    >>> z = {"w": torch.ones(3)}
    >>> mechanism.update(z, state)[0] is z
    True
    """

    def init(params: Params) -> NoiseState:
        return NoiseState({})

    def update(noise: Params, state: NoiseState) -> tuple[Params, NoiseState]:
        return noise, state

    return NoiseMechanism(init, update)


def check_expected_batch_size(expected_batch_size: Any) -> float:
    """The denominator of the private average: a finite number > 0."""
    return check_number(
        "expected_batch_size",
        expected_batch_size,
        low=0,
        low_open=True,
        high_open=True,
        note="(sample_rate * num_examples)",
    )
