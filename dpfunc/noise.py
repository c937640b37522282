"""The Gaussian mechanism: noise on the clipped sum, then the average.

DP-SGD adds ``N(0, (noise_multiplier * clip_norm)**2)`` independently to
every coordinate of the clipped sum (Abadi et al. 2016), then divides by the
EXPECTED batch size ``sample_rate * num_examples``. Dividing by the realised
(Poisson) batch size would make the denominator depend on the data and break
the sensitivity argument the accountant relies on.

Randomness enters as an explicit standard-normal tree drawn outside the
compiled step, a function of ``(seed, step)`` (:func:`standard_normal_like`):
the step stays a pure function, compiles once, and a run is reproducible and
resumable from its step count alone. What the step adds is the noise
mechanism's output (:data:`NoiseMechanism`): the draw itself for DP-SGD
(:func:`independent_noise`), a correlated one for banded noise
(:func:`dpfunc.matrix_factorization.banded_noise`).

Privacy: the seed is a secret. Whoever knows it can regenerate every noise
draw and subtract it from the released update, which leaves the exact
clipped sum: no privacy at all, whatever epsilon is printed.
:func:`secret_seed` draws one from the operating system's CSPRNG. A fixed
seed makes a run reproducible (research on public data, tests) and must
never key a run whose privacy matters.

Rounding: the default draw (torch's generators, keyed with the whole seed)
is fast but exposed to the floating-point attack on the low bits of
released values (Mironov 2012; Holohan and Braghin 2021). With
``secure=True`` (ChaCha20) the noise is float64, :func:`add_noise` and the
step form ``summed + std * noise`` at that precision and round once to the
parameters' dtype: a float32, float16 or bfloat16 release is then a
rounding of the continuous Gaussian mechanism; float64 parameters get a
four-term sum that is denser but not provably safe.

The generators' specification (keys, blocks, streams, rows, the secure
draw, timings) and the defence's argument and limits: see
docs/privacy-and-randomness.md, "How the noise is drawn".
"""

from __future__ import annotations

import hashlib
import math
import numbers
import secrets
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from ._checks import check_choice, check_number
from .optim import GradientTransformation
from .tree import Params, PyTree, check_same_structure, tree_leaves, tree_map, tree_structure

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


NOISE_BLOCK = 2**18
"""Values per block of a leaf's noise; each block is drawn from its own key.

Leaf ``i`` (optree leaf order) of shape ``S``, flattened row-major, is cut
into blocks of ``NOISE_BLOCK`` values: block ``k`` holds values
``[k * NOISE_BLOCK, min((k + 1) * NOISE_BLOCK, numel))``. A block's values
depend only on ``(seed, step, stream, i, k)``, the block's length and the
leaf's dtype, so any range of rows is drawn without drawing what comes
before it (:func:`standard_normal_like` with ``rows``). ``2**18`` keeps the keying
of a block (about 12 us on a CPU) near 2% of its draw (``torch.randn`` of
``2**18`` values: about 650 us on one thread).
"""


def standard_normal_like(
    params: PyTree,
    seed: int,
    step: int,
    *,
    secure: bool = False,
    stream: str = "noise",
    rows: Sequence[Any] | None = None,
) -> PyTree:
    """Independent ``N(0, 1)`` draws shaped like ``params``, fixed by ``(seed, step)``.

    The same arguments give the same tree, bit for bit; each leaf is drawn
    on its own device, in blocks of :data:`NOISE_BLOCK` values keyed apart.
    The keys, blocks, streams, rows and both draws, with their costs: see
    docs/privacy-and-randomness.md, "How the noise is drawn".

    Args:
        params: the tree to match (shapes, devices; dtypes unless ``secure``).
        seed: the run's secret (:func:`secret_seed`), an int >= 0 of any size.
        step: the step count, an int >= 0.
        secure: draw from ChaCha20 in float64, with the floating-point defence
            (``pip install "dpfunc[secure]"``); else torch's keyed generators.
        stream: ``"noise"`` (the gradient noise) or ``"count"`` (adaptive
            clipping's count noise): independent draws of one seed and step.
        rows: ``None``, or per leaf ``None`` or ``(full_shape, start, stop)``:
            the leaf is rows ``[start, stop)`` of one of shape ``full_shape``.

    Returns:
        A tree like ``params``, in each leaf's dtype (float32 for half ones),
        float64 with ``secure=True``.

    Raises:
        ValueError: an invalid argument, a complex leaf (``torch.randn`` gives
            each real coordinate variance 1/2), a leaf on the ``meta`` device,
            or (default draw) leaves on several devices.
        ImportError: ``secure=True`` without ``cryptography``.

    >>> params = {"w": torch.zeros(2, 3, dtype=torch.bfloat16), "b": torch.zeros(3)}
    >>> z = standard_normal_like(params, secret_seed(), step=5, secure=True)
    >>> {k: (v.dtype, tuple(v.shape)) for k, v in z.items()}
    {'w': (torch.float64, (2, 3)), 'b': (torch.float64, (3,))}
    """
    check_seed(seed)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got step={step!r}")
    if not isinstance(secure, bool):
        raise ValueError(f"secure must be a bool, got secure={secure!r}")
    check_choice("stream", stream, STREAMS)
    leaves = tree_leaves(params)
    complex_leaves = [x.dtype for x in leaves if x.is_complex()]
    if complex_leaves:  # torch.randn splits the variance over the real and imaginary parts
        raise ValueError(
            f"params must be real tensors, got dtype {complex_leaves[0]}: the Gaussian mechanism "
            "needs N(0, 1) on every real coordinate; view complex parameters as real ones "
            "(torch.view_as_real) in the loss instead"
        )
    devices = sorted({str(x.device) for x in leaves})
    if "meta" in devices:
        raise ValueError(
            "params are on the meta device, which holds shapes but no values; materialise "
            "the model (model.to_empty(device=...) and load its weights) first"
        )
    spans = _leaf_spans(rows, leaves)
    if secure:
        filler = _chacha20_filler(seed, step, stream)
    elif len(devices) > 1:
        raise ValueError(
            f"params span the devices {devices}, and the default noise draws every leaf "
            "on one device; use secure=True (Trainer(secure_noise=True)), which "
            "draws on the CPU and copies each leaf to its own device"
        )
    else:
        filler = _torch_filler(seed, step, stream)
    drawn = [
        _draw_leaf(leaf, span, filler(i, leaf), secure)
        for i, (leaf, span) in enumerate(zip(leaves, spans, strict=True))
    ]
    return tree_structure(params).unflatten(drawn)


class _Span(NamedTuple):
    """The part of a leaf's full draw that a call wants: flat values ``[low, high)``."""

    shape: tuple[int, ...]  # the drawn leaf's shape
    numel: int  # values of the full leaf (blocks are cut from 0 to numel)
    low: int
    high: int


def _leaf_spans(rows: Any, leaves: list[Tensor]) -> list[_Span]:
    """Checks ``rows`` against the leaves and returns each leaf's span of its full draw."""
    if rows is None:
        return [_Span(tuple(x.shape), x.numel(), 0, x.numel()) for x in leaves]
    if isinstance(rows, str | bytes) or not isinstance(rows, Sequence):
        raise ValueError(
            "rows must be None or a sequence with one entry per leaf of params "
            f"({len(leaves)} leaves, in leaf order), got rows={rows!r}"
        )
    if len(rows) != len(leaves):
        raise ValueError(
            f"rows must have one entry per leaf of params, in leaf order: {len(leaves)} "
            f"entries, got {len(rows)}"
        )
    return [_leaf_span(i, leaf, entry) for i, (leaf, entry) in enumerate(zip(leaves, rows))]


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _leaf_span(i: int, leaf: Tensor, entry: Any) -> _Span:
    """One entry of ``rows``, checked: the span of leaf ``i``'s full draw it names."""
    shape = tuple(leaf.shape)
    if entry is None:
        return _Span(shape, leaf.numel(), 0, leaf.numel())
    where = f"rows[{i}] (leaf {i} in leaf order)"
    if not (isinstance(entry, tuple | list) and len(entry) == 3):
        raise ValueError(
            f"{where} must be None (the whole leaf) or a tuple (full_shape, start, stop): "
            f"rows [start, stop) along dim 0 of a tensor of shape full_shape, got {entry!r}"
        )
    full, start, stop = entry
    sizes_ok = isinstance(full, tuple | list) and all(_is_int(d) and d >= 0 for d in full)
    if not (sizes_ok and len(full) > 0):
        raise ValueError(
            f"{where}: full_shape must be a tuple of ints >= 0 with at least one dimension "
            f"(rows are cut along dim 0), got full_shape={full!r}"
        )
    full = tuple(int(d) for d in full)
    if not (_is_int(start) and _is_int(stop) and 0 <= start <= stop <= full[0]):
        raise ValueError(
            f"{where}: start and stop must be ints with 0 <= start <= stop <= full_shape[0] = "
            f"{full[0]}, got start={start!r}, stop={stop!r}"
        )
    expected = (int(stop) - int(start), *full[1:])
    if shape != expected:
        raise ValueError(
            f"{where}: the leaf's shape must be (stop - start, *full_shape[1:]) = {expected}, "
            f"got a leaf of shape {shape}"
        )
    row = math.prod(full[1:])
    return _Span(expected, math.prod(full), int(start) * row, int(stop) * row)


_Fill = Callable[[int, Tensor], None]  # fill(k, out): block k's values into the 1-D out


def _draw_leaf(leaf: Tensor, span: _Span, fill: _Fill, secure: bool) -> Tensor:
    """The values ``[span.low, span.high)`` of a leaf's full draw, shaped ``span.shape``.

    Only the blocks that overlap the span are drawn; a block wholly inside it
    is drawn straight into the output, a block cut by an end of the span into
    a buffer of its own length (its values depend on that length).
    """
    if secure:
        dtype, device = torch.float64, torch.device("cpu")
    else:
        dtype, device = torch.promote_types(leaf.dtype, torch.float32), leaf.device
    low, high, block = span.low, span.high, NOISE_BLOCK
    flat = torch.empty(high - low, dtype=dtype, device=device)
    for k in range(low // block, -(-high // block) if high > low else 0):
        first, last = k * block, min((k + 1) * block, span.numel)
        if low <= first and last <= high:
            fill(k, flat[first - low : last - low])
            continue
        buffer = torch.empty(last - first, dtype=dtype, device=device)
        fill(k, buffer)
        begin, end = max(first, low), min(last, high)
        flat[begin - low : end - low].copy_(buffer[begin - first : end - first])
    return flat.view(span.shape).to(leaf.device)


def _torch_filler(seed: int, step: int, stream: str) -> Callable[[int, Tensor], _Fill]:
    """``filler(i, leaf)``: fills block ``k`` of leaf ``i`` from its own keyed torch generator."""

    def filler(i: int, leaf: Tensor) -> _Fill:
        def fill(k: int, out: Tensor) -> None:
            generator = keyed_generator(f"dpfunc.{stream}", seed, step, out.device, part=(i, k))
            torch.randn(out.numel(), generator=generator, out=out)

        return fill

    return filler


_MT_WORDS = 624  # 32-bit words of the Mersenne Twister state
_MT_OFFSET = 24  # bytes before the state words in torch's CPU generator state


def keyed_generator(
    domain: str,
    seed: int,
    step: int,
    device: torch.device,
    *,
    part: tuple[int, int] | None = None,
) -> torch.Generator:
    """A torch generator on ``device`` whose whole state comes from ``(domain, seed, step)``.

    ``torch.Generator.manual_seed`` keeps only the low 32 bits of its
    argument on the CPU (the Mersenne Twister's seeding), so a secret seed
    passed through it would leave ``2**32`` possible streams per step. Here
    the CPU generator's 624 state words (19,968 bits) are the first bytes of
    ``SHAKE-256("{domain}:{seed}:{step}")``, set with ``set_state``; a CUDA
    (Philox) generator takes 64 bits of the same hash as its seed. Distinct
    domains (noise, Poisson sample) give independent streams. ``part=(i, k)``
    hashes ``"{domain}:{seed}:{step}:{i}:{k}"`` instead: one generator per
    block ``k`` of leaf ``i`` of the noise (:data:`NOISE_BLOCK`); ``None``
    keeps the key above (the Poisson sample and the partition use it).

    Raises:
        RuntimeError: this torch's CPU generator state has a layout dpfunc
            does not know (checked once), so the state cannot be keyed;
            ``secure=True`` still works.
    """
    text = f"{domain}:{seed}:{step}"
    if part is not None:
        text += f":{part[0]}:{part[1]}"
    material = hashlib.shake_256(text.encode()).digest(4 * _MT_WORDS)
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


def _chacha20_filler(seed: int, step: int, stream: str) -> Callable[[int, Tensor], _Fill]:
    """``filler(i, leaf)``: fills block ``k`` of leaf ``i`` from ChaCha20 (float64, CPU)."""
    try:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
    except ImportError as error:
        raise ImportError(
            "secure=True needs the 'cryptography' package: pip install \"dpfunc[secure]\""
        ) from error
    key = hashlib.sha256(f"dpfunc.secure-{stream}:{seed}:{step}".encode()).digest()

    def filler(i: int, leaf: Tensor) -> _Fill:
        if i >= 2**32:  # the nonce holds 4 bytes of leaf index
            raise ValueError(f"secure noise takes at most 2**32 leaves, got leaf index {i}")
        terms = 4 if leaf.dtype == torch.float64 else 1

        def fill(k: int, out: Tensor) -> None:
            nonce = bytes(4) + i.to_bytes(4, "little") + k.to_bytes(8, "little")
            keystream = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor()
            n = out.numel()
            count = n * terms
            if terms == 1 and n % 2 == 0:  # the normals land where the words were: no copy
                words = out.view(torch.int64)
            else:
                words = torch.empty(count + count % 2, dtype=torch.int64)
            raw = words.numpy().view(np.uint8)
            for start in range(0, raw.size, _CHUNK):  # zeros XOR keystream = keystream
                piece = raw[start : start + _CHUNK]
                keystream.update_into(_ZEROS[: piece.size], piece)  # no zeroing pass
            z = _box_muller_(words)
            if terms == 1:
                if words.data_ptr() != out.data_ptr():
                    out.copy_(z[:n])
                return
            # sines of pairs j, n + j; cosines of pairs j + 1, n + j + 1 (mod n), in the block
            rows = z[:count].view(terms, n)
            torch.add(rows[0], rows[1], out=out)
            for row in rows[2:]:
                out[:-1].add_(row[1:])
                out[-1:].add_(row[:1])
            out.mul_(0.5)

        return fill

    return filler


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
    Gaussian mechanism (docs/privacy-and-randomness.md, "The floating-point
    attack and the defence"). With noise in the
    parameters' dtype (the default draw) and a float ``std`` it is
    ``torch.add(summed, noise, alpha=std)``, the operation the step runs, so
    ``average(add_noise(...), B)`` equals the step's noisy average bit for bit.

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

    def leaf(s: Tensor, z: Tensor) -> Tensor:
        if s.dtype != torch.float64 and z.dtype != torch.float64 and _fused_add(std):
            # the one operation noisy_average's float32 pass runs: the same bits
            return torch.add(s, z, alpha=std).to(s.dtype)
        return (s + std * z).to(s.dtype)

    return tree_map(leaf, summed, noise)


def average(x: Params, expected_batch_size: float) -> Params:
    """Divides by the expected batch size ``sample_rate * num_examples``.

    Never pass the realised batch size: it depends on the data.

    Raises:
        ValueError: ``expected_batch_size`` is not > 0.
    """
    check_expected_batch_size(expected_batch_size)
    return tree_map(lambda leaf: leaf / expected_batch_size, x)


def _fused_add(std: float | Tensor) -> bool:
    """Whether ``summed + std * noise`` runs as one ``torch.add(summed, noise, alpha=std)``.

    Eagerly, for a float ``std``: one kernel instead of two. Never in a compiled graph:
    inductor (torch 2.13) compiled the ghost-clipped step of a Linear weight followed by
    ``torch.add(summed, noise, alpha=std)`` into one that added the noise twice (held by
    tests/test_ghost.py's compiled-equals-eager test), while ``summed + std * noise``
    compiles right and fuses all the same.
    """
    return not isinstance(std, Tensor) and not torch.compiler.is_compiling()


def noisy_average(
    summed: Params, noise: Params, std: float | Tensor, expected_batch_size: float, params: Params
) -> Params:
    """``average(add_noise(summed, noise, std), expected_batch_size)`` in one pass per leaf.

    The step's fused form of :func:`add_noise`, :func:`average` and the cast
    to each parameter's accumulation dtype (float32 for half-precision
    parameters): the same noise, added once to the clipped sum, and the same
    division by the expected batch size; it reads nothing but its arguments.

    * A float32 ``summed`` (the running sum of float32 or half parameters)
      with float32 noise is noised and averaged in float32:
      ``(summed + std * noise) / expected_batch_size``, equal to
      :func:`add_noise` then :func:`average` bit for bit with a float
      ``std`` (the same ``torch.add(summed, noise, alpha=std)``), to float32
      rounding with a tensor one.
    * A float64 ``summed`` (float64 parameters), or float64 noise (the
      secure draw), is
      noised and averaged in float64 exactly as :func:`add_noise` and
      :func:`average` define it on a float64 sum (``std * noise`` at the
      noise's precision, the sum and the quotient rounded in float64) and
      rounded only then, once, to the parameter's accumulation dtype: the
      floating-point defence of the secure draw (module docstring,
      "Rounding") holds.

    Eagerly the float64 form writes one float64 temporary and the output (no
    float64 copy of the sum or noise); compiled, inductor fuses either form
    into one kernel.

    Args:
        summed: the clipped sum of the logical batch, reduced over the ranks.
        noise: the noise tree (standard normal, or the mechanism's draw).
        std: ``noise_multiplier * clip_norm``, a float or a 0-d tensor.
        expected_batch_size: the denominator, > 0.
        params: the parameters (their dtypes only).
    """
    return _noisy_average(summed, noise, std, expected_batch_size, params, in_place=False)


def noisy_average_(
    summed: Params, noise: Params, std: float | Tensor, expected_batch_size: float, params: Params
) -> Params:
    """:func:`noisy_average` written into ``summed``, for a caller that owns the sum.

    The same operations and bits; eagerly, each leaf of ``summed`` that
    already has the result's dtype holds the result (no second copy of the
    sum), and the others, and every leaf in a compiled graph, get new
    tensors as :func:`noisy_average` gives them. ``summed`` must be read
    by nothing else afterwards: the step passes its own clipped sum.
    """
    in_place = not torch.compiler.is_compiling()
    return _noisy_average(summed, noise, std, expected_batch_size, params, in_place=in_place)


def _noisy_average(
    summed: Params,
    noise: Params,
    std: float | Tensor,
    expected_batch_size: float,
    params: Params,
    *,
    in_place: bool,
) -> Params:
    check_expected_batch_size(expected_batch_size)
    compiling = torch.compiler.is_compiling()

    def leaf(s: Tensor, z: Tensor, p: Tensor) -> Tensor:
        out = torch.float64 if p.dtype == torch.float64 else torch.float32
        into = in_place and s.dtype == out  # in place where no cast follows (and none precedes)
        if s.dtype != torch.float64 and z.dtype != torch.float64:  # float32 throughout
            if _fused_add(std):
                noised = s.add_(z, alpha=std) if into else torch.add(s, z, alpha=std)
                return noised.div_(expected_batch_size).to(out)
            if into:
                return s.add_(std * z).div_(expected_batch_size)
            return ((s + std * z) / expected_batch_size).to(out)
        if compiling:
            return ((s + std * z) / expected_batch_size).to(out)
        # std * z at z's precision (as add_noise), widened exactly; then s + w and / B in float64
        w = torch.mul(z, std, out=torch.empty(z.shape, dtype=torch.float64, device=z.device))
        if into and s.dtype == torch.float64:  # s + w is w + s: the same rounding, in float64
            return s.add_(w).div_(expected_batch_size)
        w.add_(s)
        if out == torch.float64:
            return w.div_(expected_batch_size)
        return torch.div(w, expected_batch_size, out=torch.empty_like(w, dtype=out))

    return tree_map(leaf, summed, noise, params)


class NoiseState(NamedTuple):
    """A noise mechanism's state between steps (held in ``TrainState.noise_state``)."""

    # correlated noise (bands b > 1): each leaf [b - 1, *param.shape], the last b - 1
    # correlated draws, newest first (dpfunc.matrix_factorization); {} for independent noise
    history: Params = {}  # noqa: RUF012 (never mutated: states are replaced, not changed)


#: How a step's standard-normal tree ``z_t`` becomes the noise it adds, ``w_t``: a
#: :class:`dpfunc.optim.GradientTransformation`, the protocol of the optimizers and of
#: the clip mechanisms (:data:`dpfunc.clipping.ClipMechanism`). ``init(params) ->
#: NoiseState`` is the state before the first step (``params`` give the shapes);
#: ``update(z_t, state, params=None) -> (w_t, state)`` maps the draw to the noise and
#: the next state, reading no data. The step adds ``noise_std * w_t`` to the clipped
#: sum. Made by :func:`independent_noise` and
#: :func:`dpfunc.matrix_factorization.banded_noise`; :meth:`dpfunc.DPConfig.noise_mechanism`
#: picks the one a config releases.
NoiseMechanism = GradientTransformation


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

    def update(
        noise: Params, state: NoiseState, params: Params | None = None
    ) -> tuple[Params, NoiseState]:
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
