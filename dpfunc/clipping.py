"""Clipping: per-example norms, clip factors and the clipped sum.

Flat clipping (Abadi et al. 2016) bounds the L2 norm of each example's whole
gradient, all parameters stacked into one vector, by ``clip_norm``.
Per-group clipping (McMahan et al. 2018) bounds each group of parameters
(a layer, say) separately; with thresholds ``C_k`` the whole gradient is
bounded by ``sqrt(sum C_k**2)``. Normalised ("automatic") clipping (Bu et
al. 2022) scales every example by ``clip_norm / (norm + gamma)``, so each
contribution has norm below ``clip_norm`` and small gradients are not lost.

In every mode an example whose norm is not finite (NaN or inf anywhere in
its gradient) gets factor 0: it is dropped from the sum rather than spread
into it.

The mode is decided in one place, :class:`ClippingPolicy`: given the
per-example norms (flat, or per group) it returns the factors, the weights of
the clipped sum and the stats a step reports. The vmap path and the ghost path
(:mod:`dpfunc.ghost`, which gets the norms without materialising gradients)
both call it, so one mode means one rule on either path.

Rounding is part of the bound. The norm is computed with rounding error, the
factor is rounded to the gradients' dtype, multiplied and summed with the other
rows, and the micro-batch sums are added across micro-batches and ranks. Each
step can only make a contribution larger by a factor that Higham's ``gamma_n``
bounds ("Accuracy and Stability of Numerical Algorithms", 2002, sections 3.1
and 4.2), so :func:`clip_factors` divides by the product of those factors (a
relative margin of about 3e-5 for 256 float32 rows, 1e-10 in float64; see
:func:`clip_margin`): every example's contribution to the sum, as computed,
has norm at most its clip bound. The margin depends only on public
quantities (the dtype, the physical rows of a micro-batch, the number of
coordinates, and the fixed counts ``FLOAT32_SUMS`` and ``ACCUMULATED_SUMS`` of
micro-batch sums and ranks it covers), never on the data or the realised batch
size. The sum of a micro-batch runs in its :func:`accumulation_dtype` (float32
for bf16, fp16 and float32 gradients, float64 for float64), never in half
precision; so does the running sum of a logical batch within ``FLOAT32_SUMS``.

Adaptive clipping (Andrew, Thakkar, McMahan and Ramaswamy 2021, "Differentially
private learning with adaptive clipping") moves the clip norm towards a
target quantile of the per-example norms: each step counts the examples the
clip left unscaled (:func:`unclipped_count`, sensitivity 1), releases that
count with Gaussian noise, and updates the norm geometrically
(:func:`adaptive_clip_norm`). As a mechanism with state (:data:`ClipMechanism`,
from :func:`adaptive_clipping` or :func:`fixed_clipping`; an ``(init, update)``
pair like an optimizer, whose input is the :class:`UnclippedCount`) the clip
norm lives in the train state (``TrainState.clip_state``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import optree
import torch
from torch import Tensor

from ._checks import check_choice, check_int, check_number
from .optim import GradientTransformation
from .tree import Params, PyTree, leaves_in_any_order, tree_leaves, tree_map

Groups = Mapping[str, Sequence[str]]

F64 = torch.float64
HALF = (torch.bfloat16, torch.float16)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype :func:`clipped_sum` sums gradients of ``dtype`` in.

    float64 for float64 gradients, float32 for every other floating dtype (a
    bf16 or fp16 value is exactly a float32 value, so the upcast is exact,
    and 256 rows summed in bf16 could lose every digit).

    >>> accumulation_dtype(torch.bfloat16), accumulation_dtype(torch.float64)
    (torch.float32, torch.float64)
    """
    return F64 if dtype == F64 else torch.float32


def per_sample_norms(grads: PyTree, groups: Groups | None = None) -> Tensor | dict[str, Tensor]:
    """L2 norm of each example's gradient.

    Args:
        grads: per-example gradients, every leaf shaped ``[B, ...]``.
        groups: ``None`` for the flat norm over all leaves, or
            ``{group: [param names]}`` naming every key of ``grads`` exactly
            once, for one norm per group (see :func:`groups_by_module`).

    Returns:
        ``Tensor[B]`` (flat) or ``{group: Tensor[B]}``, float64. A float64
        gradient, or any gradient inside ``torch.compile`` (where the upcast
        fuses into the reduction), is accumulated in float64 throughout.
        Eagerly, a float32 (or half) leaf is reduced in float32 over runs of
        ``NORM_CHUNK`` entries, whose norms are then combined in float64: no
        float64 copy of the gradients, and a relative error of about 1e-8
        typically, at most ``gamma_{NORM_CHUNK + 2}`` of float32 (4e-6) on
        the squared norm, plus squares below float32's smallest normal
        number (entries under about 1e-19) that may be lost, at most
        ``size * 2**-125`` in all: :func:`clip_margin` covers both. A leaf
        whose runs overflow (entries beyond about 1e18) or hold NaN or inf is
        recomputed in float64, so a float32 gradient with entries near the
        float32 maximum still has a finite norm, and a NaN or inf entry gives
        a NaN or inf norm. That check costs one host sync eagerly.
    """
    if groups is None:
        return _root_sum(_squared_norms(tree_leaves(grads)))
    _check_groups(groups, grads)
    names = list(grads)
    return norms_from_squares(dict(zip(names, _squared_norms([grads[n] for n in names]))), groups)


def norms_from_squares(
    squares: Mapping[str, Tensor], groups: Groups | None = None
) -> Tensor | dict[str, Tensor]:
    """Per-example norms from each parameter's per-example squared norms.

    The last step of :func:`per_sample_norms`, for a path that gets the
    squares another way (ghost clipping, :mod:`dpfunc.ghost`): the flat norm
    ``sqrt(sum_k squares[k])`` over every parameter, in the order of
    ``squares``, or with ``groups`` one such norm per group.

    Args:
        squares: ``{param name: Tensor[B]}``, float64.
        groups: ``None``, or ``{group: [param names]}`` (as for
            :func:`per_sample_norms`; every name must be a key of ``squares``).

    Returns:
        ``Tensor[B]`` or ``{group: Tensor[B]}``, like :func:`per_sample_norms`.

    >>> norms_from_squares({"w": torch.tensor([9.0]), "b": torch.tensor([16.0])})
    tensor([5.])
    """
    if groups is None:
        return _root_sum(list(squares.values()))
    return {group: _root_sum([squares[n] for n in members]) for group, members in groups.items()}


def _root_sum(squares: list[Tensor]) -> Tensor:
    return torch.stack(squares).sum(0).sqrt()


NORM_CHUNK = 128
"""Entries per float32 partial norm in the eager norms (see :func:`per_sample_norms`)."""


def _squared_norms(leaves: list[Tensor]) -> list[Tensor]:
    """Each leaf's per-row squared L2 norms, float64 ``[B]``."""
    flats = [g.reshape(g.shape[0], math.prod(g.shape[1:])) for g in leaves]
    if torch.compiler.is_compiling():
        return [_float64_squares(flat) for flat in flats]
    squares = [
        _float64_squares(flat) if flat.dtype == torch.float64 else _chunked_squares(flat)
        for flat in flats
    ]
    if squares and not bool(torch.isfinite(torch.stack(squares)).all()):
        squares = [  # one host sync; float64 only where a run overflowed or holds NaN / inf
            sq if bool(torch.isfinite(sq).all()) else _float64_squares(flat)
            for sq, flat in zip(squares, flats)
        ]
    return squares


def _float64_squares(flat: Tensor) -> Tensor:
    return torch.linalg.vector_norm(flat, dim=1, dtype=torch.float64).square()


def _chunked_squares(flat: Tensor) -> Tensor:
    rows, size = flat.shape
    whole = size // NORM_CHUNK * NORM_CHUNK
    runs = flat[:, :whole].reshape(rows, whole // NORM_CHUNK, NORM_CHUNK)
    # float32 results: a half result would round each run's norm to 8 or 11 bits
    dtype = torch.float32
    parts = [torch.linalg.vector_norm(runs, dim=2, dtype=dtype)]
    if whole < size:
        parts.append(torch.linalg.vector_norm(flat[:, whole:], dim=1, keepdim=True, dtype=dtype))
    # a float32 value squared is exact in float64 (24 + 24 bits)
    return torch.cat(parts, dim=1).double().square().sum(1)


def groups_by_module(params: Params) -> dict[str, list[str]]:
    """Groups parameter names by the module that owns them.

    ``{"fc1.weight", "fc1.bias", "fc2.weight"}`` gives
    ``{"fc1": ["fc1.weight", "fc1.bias"], "fc2": ["fc2.weight"]}``; a
    parameter of the root module is its own group.
    """
    groups: dict[str, list[str]] = {}
    for name in params:
        groups.setdefault(name.rpartition(".")[0] or name, []).append(name)
    return groups


def _check_groups(groups: Groups, grads: PyTree) -> None:
    if not isinstance(grads, Mapping):
        raise TypeError(f"groups need grads keyed by parameter name, got {type(grads).__name__}")
    named = [name for names in groups.values() for name in names]
    missing = sorted(set(grads) - set(named))
    unknown = sorted(set(named) - set(grads))
    repeated = sorted({n for n in named if named.count(n) > 1})
    if missing or unknown or repeated:
        raise ValueError(
            "groups must name every parameter exactly once; "
            f"missing={missing}, unknown={unknown}, repeated={repeated}"
        )


ACCUMULATED_SUMS = 2**20
"""Micro-batch sums plus ranks whose float64 additions :func:`clip_margin` covers.

A float64 running sum (float64 parameters, or a float32 one past
``FLOAT32_SUMS``) adds micro-batch
sums and then the ranks' sums in float64; each addition can round every
contribution by ``2**-53``. The number of micro-batches follows the realised
Poisson batch, so the margin uses this fixed public count instead: about a
million micro-batches and ranks together, a relative ``1.2e-10``.
The Trainer's plan (:class:`dpfunc._plan.RunPlan`) refuses a physical batch size that could
split a logical batch into more.
"""

FLOAT32_SUMS = 2**7
"""Micro-batch sums plus ranks whose float32 additions :func:`clip_margin` covers.

The running clipped sum of a logical batch of float32 (or half-precision)
parameters is float32 (:meth:`dpfunc.TrainStep.logical_step`): each addition
of a micro-batch sum, and of a rank's sum in the all-reduce, can round every
contribution by ``2**-24``. The float32 margin covers this many such
additions together, a relative ``gamma_128 = 7.6e-6`` on top of the
``gamma_{rows + 2}`` of the micro-batch's own sum (for 256 rows the margin
grows from ``1.9e-5`` to ``2.7e-5``). A rank whose logical batch holds more
than ``FLOAT32_SUMS - world_size`` micro-batches adds the rest in float64
(``ACCUMULATED_SUMS`` of them) and rounds the total once to float32 before
the all-reduce: one more float32 rounding, counted in the same budget. With
``world_size >= FLOAT32_SUMS`` the running sum is float64 throughout.
"""

MAX_SIZE = 2**40
"""The coordinates of one example's gradient that ``size=None`` assumes (4 TB in float32)."""


class ClipMargin(NamedTuple):
    """The rounding margin of :func:`clip_factors`: factors ``C / (scale * (norm + floor))``."""

    scale: float  # > 1: the relative growth a contribution can get from rounding
    floor: float  # >= 0: an absolute bound on the norm lost to underflow


def _gamma(n: int, dtype: torch.dtype) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``: the relative error of ``n`` roundings."""
    nu = n * torch.finfo(dtype).eps / 2
    return nu / (1 - nu) if nu < 1 else math.inf


def clip_margin(
    rows: int, dtype: torch.dtype = torch.float32, size: int | None = None
) -> ClipMargin:
    """The margin that makes ``factor * norm <= C`` hold for the contribution as computed.

    :func:`clip_factors` divides by ``scale * (norm + floor)`` rather than by
    the computed norm: ``scale`` covers the relative rounding of the norm, of
    the factor, of the micro-batch's clipped sum and of the running sum over
    micro-batches and ranks (for the fixed counts ``FLOAT32_SUMS`` and
    ``ACCUMULATED_SUMS``), ``floor`` the squares that underflow.

    Args:
        rows: the rows the clipped sum adds in one micro-batch, padding
            included (the physical batch size: public, fixed).
        dtype: the gradients' dtype (the lowest precision among them): float64
            is normed and summed in float64, any other dtype normed in float32
            runs and summed in float32 (:func:`accumulation_dtype`).
        size: the coordinates of one example's gradient (all parameters,
            or the largest group); ``None`` assumes up to ``MAX_SIZE``.

    Returns:
        :class:`ClipMargin` ``(scale, floor)``, Python floats: ``scale`` is
        about ``1 + 2.7e-5`` for 256 float32 rows (``1 + 1.2e-5`` for 16) and
        ``1 + 1.2e-10`` in float64, growing with ``rows`` and slightly with
        ``size`` (``size=None`` adds up to ``1.2e-4``).

    Rounding: with these factors every example's contribution to the sum the
    noise is added to, as computed, has norm at most ``C``; the margin reads
    only public sizes. Products that underflow to subnormal float32 numbers
    escape (``2**-150`` a coordinate: clip norms under ``sqrt(size) * 1e-44``).
    The bound term by term: see docs/precision.md, "The clip margin, term by
    term".

    Raises:
        ValueError: ``rows`` or ``size`` is not an int >= 0 / >= 1, ``dtype``
            is not a floating-point dtype, or they are too large for a bound.

    >>> m = clip_margin(256, torch.float32, size=10**6)
    >>> bool(1e-5 < m.scale - 1 < 3e-5), bool(m.floor < 1e-15)
    (True, True)
    """
    check_int("rows", rows, minimum=0)
    if size is None:
        size = MAX_SIZE
    check_int("size", size, minimum=1)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got dtype={dtype!r}")
    u64 = torch.finfo(F64).eps / 2
    acc = accumulation_dtype(dtype)
    float64_norm = _gamma(2 * size + 8, F64)
    if acc == F64:
        e_norm, floor = float64_norm, math.sqrt(size * 2.0**-1021)
        summed = _gamma(rows + 2 + ACCUMULATED_SUMS, F64)
    else:
        e_norm = 1 - (1 - _gamma(NORM_CHUNK + 2, torch.float32)) * (1 - float64_norm)
        floor = math.sqrt(size * 2.0**-125)
        # float32 additions: the micro-batch's rows, then up to FLOAT32_SUMS running-sum and
        # all-reduce additions; past those, float64 ones (see FLOAT32_SUMS)
        summed = (1 + _gamma(rows + 2 + FLOAT32_SUMS, acc)) * (1 + _gamma(ACCUMULATED_SUMS, F64))
        summed -= 1
    if e_norm >= 1 or summed == math.inf:  # not math.isinf: rows may be symbolic when compiled
        raise ValueError(
            f"rows={rows!r} and size={size!r} are too large for a rounding bound in {acc}"
        )
    scale = (1 + summed) / (math.sqrt(1 - e_norm) * (1 - u64)) * (1 + _gamma(16, F64))
    return ClipMargin(scale, floor)


def rounding_scope(params: PyTree, rows: int) -> dict[str, object]:
    """The keyword arguments of :func:`clip_factors` for a micro-batch of ``rows`` rows.

    ``{"rows": rows, "dtype": ..., "size": ...}``: ``dtype`` is float64 if
    every parameter is float64, else float32 (what the other dtypes are normed
    and summed in); ``size`` is the number of coordinates of one example's
    gradient (all of ``params``). Shapes and dtypes only: nothing here reads
    the data, and ``rows`` must be the physical (padded) rows, never the
    count of real examples.

    >>> rounding_scope({"w": torch.zeros(3, 2), "b": torch.zeros(3)}, rows=8)
    {'rows': 8, 'dtype': torch.float32, 'size': 9}
    """
    leaves = leaves_in_any_order(params)
    wide = bool(leaves) and all(p.dtype == F64 for p in leaves)
    size = max(1, sum(p.numel() for p in leaves))
    return {"rows": int(rows), "dtype": F64 if wide else torch.float32, "size": int(size)}


def clip_factors(
    norms: Tensor | Mapping[str, Tensor],
    clip_norm: float | Mapping[str, float],
    *,
    normalize: bool = False,
    gamma: float = 0.01,
    rows: int | None = None,
    dtype: torch.dtype = torch.float32,
    size: int | None = None,
) -> Tensor | dict[str, Tensor]:
    """The factor each example's gradient is multiplied by.

    Args:
        norms: ``Tensor[B]`` from flat :func:`per_sample_norms`, or
            ``{group: Tensor[B]}`` from grouped norms.
        clip_norm: the bound ``C > 0`` (``inf`` disables clipping), or a
            0-d tensor (adaptive clipping's current norm, flat only). With
            grouped norms, either ``{group: C_k}`` or one float ``C``, split
            equally as ``C / sqrt(num_groups)`` so the whole gradient is still
            bounded by ``C`` (see :func:`total_clip_norm`).
        normalize: automatic clipping (Bu et al. 2022): factor
            ``C / (norm + gamma)`` for every example, not only large ones.
        gamma: the stabiliser of automatic clipping, > 0.
        rows, dtype, size: what the rounding margin covers (see
            :func:`clip_margin`): the rows :func:`clipped_sum` adds in one
            micro-batch (``None``: ``B``, the length of ``norms``), the
            gradients' dtype (float32 by default, which also covers float64
            and half gradients), and the coordinates of one example's
            gradient (``None``: up to ``MAX_SIZE``, a margin of 1.2e-4).
            These are public (shapes and dtypes), never the data.

    Returns:
        Factors like ``norms`` (float64), so that each example's contribution to
        :func:`clipped_sum`, rounding included, has norm at most ``C``
        (its group's ``C_k``). With ``(scale, floor) = clip_margin(rows,
        dtype, size)``: flat clipping gives ``min(1, C / (scale * (norm +
        floor)))``, in ``[0, 1]``, so a zero gradient and ``C = inf`` get 1 and
        a gradient a little below ``C`` (within the margin) is scaled a little;
        normalisation gives ``C / (scale * (norm + floor) + gamma)``, in ``[0,
        C/gamma)``. A non-finite norm gives 0.

    The default margin (float32 rows, any size) is visible in the fourth digit; the
    margin of a small float64 problem only in the tenth:

    >>> norms = torch.tensor([0.5, 2.0, float("nan")], dtype=torch.float64)
    >>> clip_factors(norms, clip_norm=1.0)
    tensor([1.0000, 0.4999, 0.0000], dtype=torch.float64)
    >>> f = clip_factors(norms, 1.0, rows=3, dtype=torch.float64, size=10)
    >>> bool(0.5 - 1e-9 < f[1] < 0.5)
    True
    """
    if rows is None:
        first = next(iter(norms.values()), None) if isinstance(norms, Mapping) else norms
        rows = 0 if first is None else int(first.shape[0])
    margin = clip_margin(rows, dtype, size)
    if isinstance(norms, Mapping):
        thresholds = _group_thresholds(clip_norm, list(norms))
        return {g: _factors(n, thresholds[g], normalize, gamma, margin) for g, n in norms.items()}
    if not isinstance(clip_norm, Tensor):  # a tensor: adaptive clipping's current norm, > 0
        _check_clip_norm(clip_norm)
    return _factors(norms, clip_norm, normalize, gamma, margin)


def _factors(norms: Tensor, clip_norm, normalize: bool, gamma: float, margin: ClipMargin):
    norms = norms.to(torch.promote_types(norms.dtype, F64))  # the margin covers float64 roundings
    bound = (norms + margin.floor) * margin.scale  # at least the norm the sum can reach
    if normalize:
        if not isinstance(clip_norm, Tensor) and math.isinf(clip_norm):
            raise ValueError("normalized clipping needs a finite clip_norm, got clip_norm=inf")
        check_number("gamma", gamma, low=0, low_open=True, high_open=True)
        factors = clip_norm / (bound + gamma)
    else:
        factors = torch.clamp(clip_norm / bound, max=1.0)
    return torch.where(torch.isfinite(norms), factors, torch.zeros_like(factors))


def total_clip_norm(clip_norm: float | Mapping[str, float]) -> float:
    """The flat sensitivity of (grouped) clipping: ``C`` or ``sqrt(sum C_k**2)``."""
    if isinstance(clip_norm, Mapping):
        for g, c in clip_norm.items():
            _check_clip_norm(c, f"clip_norm[{g!r}]")
        return math.sqrt(sum(c * c for c in clip_norm.values()))
    _check_clip_norm(clip_norm)
    return float(clip_norm)


def _group_thresholds(clip_norm, groups: list[str]) -> dict[str, float]:
    if isinstance(clip_norm, Mapping):
        if set(clip_norm) != set(groups):
            raise ValueError(
                f"clip_norm must give one threshold per group {sorted(groups)}, "
                f"got thresholds for {sorted(clip_norm)}"
            )
        return dict(clip_norm)
    _check_clip_norm(clip_norm)
    return {g: clip_norm / math.sqrt(len(groups)) for g in groups}


def _check_clip_norm(clip_norm, name: str = "clip_norm") -> float:
    return check_number(name, clip_norm, low=0, low_open=True, note="(inf disables clipping)")


def clipped_sum(
    grads: PyTree,
    factors: Tensor | Mapping[str, Tensor],
    mask: Tensor | None = None,
    groups: Groups | None = None,
) -> PyTree:
    """``sum_i mask_i * factor_i * grad_i``: the sum DP-SGD adds noise to.

    Args:
        grads: per-example gradients, leaves ``[B, ...]``.
        factors: ``Tensor[B]`` from flat :func:`clip_factors`, or
            ``{group: Tensor[B]}`` from grouped ones (then ``groups`` maps
            each group to its parameter names).
        mask: ``Tensor[B]`` of 0/1 (or bool); 0 marks padding, which
            contributes exactly nothing. ``None`` keeps every row.
        groups: the grouping the factors were computed with.

    Returns:
        A tree like one example's gradient, each leaf in the
        :func:`accumulation_dtype` of its gradient: float32 for bf16, fp16
        and float32, float64 for float64. Half gradients are upcast (exactly)
        before the weights multiply them, so the rows are never summed in
        half precision; the weights are rounded once to that dtype, which
        :func:`clip_margin` covers. An example with weight 0
        (masked, or dropped for a non-finite norm) contributes exactly 0,
        even if its gradient holds NaN or inf. With ``B = 0`` the sum is 0.
    """
    weights = factors if mask is None else _apply_mask(factors, mask)
    if isinstance(weights, Mapping):
        if groups is not None:
            _check_groups(groups, grads)
        leaf_weights = weights_by_parameter(weights, list(grads), groups)
    else:
        leaf_weights = tree_map(lambda g: weights, grads)
    leaves, spec = optree.tree_flatten(grads)
    leaves = [g.to(accumulation_dtype(g.dtype)) for g in leaves]
    ws = [w.to(g.dtype) for w, g in zip(optree.tree_leaves(leaf_weights), leaves)]
    if torch.compiler.is_compiling():  # inductor fuses the masked sum into one reduction
        return optree.tree_unflatten(spec, [_masked_sum(w, g) for w, g in zip(ws, leaves)])
    sums = [_contract(w, g) for w, g in zip(ws, leaves)]
    if sums and not bool(torch.stack([torch.isfinite(s).all() for s in sums]).all()):
        sums = [  # one host sync; the slow path only where a zero-weight row is NaN or inf
            s if bool(torch.isfinite(s).all()) else _masked_sum(w, g)
            for s, w, g in zip(sums, ws, leaves)
        ]
    return optree.tree_unflatten(spec, sums)


def _apply_mask(factors, mask: Tensor):
    if isinstance(factors, Mapping):
        return {g: f * mask.to(f.dtype) for g, f in factors.items()}
    return factors * mask.to(factors.dtype)


def _contract(w: Tensor, g: Tensor) -> Tensor:
    """``sum_i w_i g_i`` as one matrix-vector product: no per-example temporary."""
    flat = g.reshape(g.shape[0], math.prod(g.shape[1:]))
    return (w @ flat).reshape(g.shape[1:])


def _masked_sum(w: Tensor, g: Tensor) -> Tensor:
    """The sum with weight-0 rows left out entirely, so a NaN or inf there cannot leak in.

    A product would give ``0 * nan = nan``. Eagerly this costs full-size
    temporaries and runs only when the contraction came out non-finite;
    compiled, inductor fuses it into one reduction.
    """
    w = w.reshape(-1, *([1] * (g.dim() - 1)))
    return torch.where(w != 0, g * w, torch.zeros_like(g)).sum(0)


def weights_by_parameter(
    weights: Tensor | Mapping[str, Tensor], names: Sequence[str], groups: Groups | None = None
) -> dict[str, Tensor]:
    """``{name: Tensor[B]}``: the weight of each parameter's per-example gradients.

    Flat ``weights`` (``Tensor[B]``) weigh every parameter alike; grouped ones
    (``{group: Tensor[B]}``) weigh each parameter by its group's, with
    ``groups`` mapping each group to its parameter names.

    Raises:
        ValueError: grouped ``weights`` without ``groups``, or a name in no group.

    >>> w = weights_by_parameter({"fc": torch.tensor([0.5])}, ["fc.w"], {"fc": ["fc.w"]})
    >>> w
    {'fc.w': tensor([0.5000])}
    """
    if not isinstance(weights, Mapping):
        return dict.fromkeys(names, weights)
    if groups is None:
        raise ValueError("grouped factors need groups= to map groups to parameter names")
    owner = {name: group for group, members in groups.items() for name in members}
    stray = [name for name in names if owner.get(name) not in weights]
    if stray:
        raise ValueError(f"parameters {stray} belong to no group of the factors {sorted(weights)}")
    return {name: weights[owner[name]] for name in names}


CLIPPING_MODES = ("flat", "per_layer", "normalized")


class Clipped(NamedTuple):
    """What a :class:`ClippingPolicy` decided for one micro-batch."""

    factors: Tensor | dict[str, Tensor]  # [B] float64 (per_layer: {group: [B]}), clip_factors'
    weights: Tensor | dict[str, Tensor]  # like factors, 0 for padding: the clipped sum's weights
    norm: Tensor  # [B] float64, each example's whole gradient norm before clipping
    scaled: Tensor  # [B] bool, scaled down or dropped (per_layer: in any group)


class ClippingPolicy(NamedTuple):
    """The clipping mode: per-example norms in, clip factors and their stats out.

    DP-SGD's per-example clipping function (Abadi et al. 2016), flat, per
    group (McMahan et al. 2018) or normalised (Bu et al. 2022), in one place
    for every way to the clipped sum: the vmap path hands it the
    :func:`per_sample_norms` of materialised gradients, the ghost path
    (:func:`dpfunc.ghost.ghost_clip`) the norms it gets without them. Both
    take the groups from :meth:`groups` and weigh the sum by ``weights``, so
    the same norms give the same factors on either path.

    Args:
        mode: ``"flat"`` (all parameters as one vector), ``"per_layer"``
            (one norm per owning module, :func:`groups_by_module`, each
            bounded by ``C / sqrt(num_groups)`` or its own ``C_k``) or
            ``"normalized"`` (automatic clipping, factor ``C / (norm +
            gamma)``).
        gamma: the stabiliser of normalised clipping, > 0.

    >>> policy = ClippingPolicy("flat")
    >>> norms = torch.tensor([0.5, 2.0, 3.0], dtype=torch.float64)
    >>> clipped = policy(norms, 1.0, mask=torch.tensor([True, True, False]))
    >>> clipped.weights, clipped.scaled
    (tensor([1.0000, 0.4999, 0.0000], dtype=torch.float64), tensor([False,  True,  True]))
    """

    mode: str = "flat"
    gamma: float = 0.01

    def groups(self, params: Params | Sequence[str]) -> dict[str, list[str]] | None:
        """The groups the norms are taken over: by module with ``"per_layer"``, else ``None``."""
        self._check()
        return groups_by_module(params) if self.mode == "per_layer" else None

    def __call__(
        self,
        norms: Tensor | Mapping[str, Tensor],
        clip_norm: float | Tensor | Mapping[str, float],
        mask: Tensor | None = None,
        *,
        rows: int | None = None,
        dtype: torch.dtype = torch.float32,
        size: int | None = None,
    ) -> Clipped:
        """The clip factors of ``norms`` and what the step reports of them.

        Args:
            norms: ``Tensor[B]`` (``"flat"``, ``"normalized"``) or ``{group:
                Tensor[B]}`` over :meth:`groups` (``"per_layer"``).
            clip_norm: ``C`` as for :func:`clip_factors`: a float, a 0-d
                tensor (adaptive clipping's current norm; not per group),
                or per group ``{group: C_k}``.
            mask: ``Tensor[B]`` of 0/1 or bool, 0 for padding; ``None``
                keeps every row. Only ``weights`` read it.
            rows, dtype, size: the public rounding scope
                (:func:`rounding_scope`), as for :func:`clip_factors`.

        Returns:
            :class:`Clipped` ``(factors, weights, norm, scaled)``: the
            :func:`clip_factors`; the factors with padding rows set to 0,
            the weights of :func:`clipped_sum`; each example's whole norm
            (per group: ``sqrt(sum_k norm_k**2)``); and whether its factor
            (any group's) is below 1. An example with a non-finite norm gets
            factor 0 and counts as scaled.

        Raises:
            ValueError: an unknown ``mode``, ``gamma <= 0``, or grouped
                norms in a flat mode (or flat ones with ``"per_layer"``); and
                what :func:`clip_factors` raises.
        """
        self._check()
        grouped = isinstance(norms, Mapping)
        if grouped != (self.mode == "per_layer"):
            want = "{group: Tensor[B]}" if self.mode == "per_layer" else "one Tensor[B]"
            raise ValueError(
                f"clipping mode {self.mode!r} takes norms as {want} (see ClippingPolicy.groups), "
                f"got norms of type {type(norms).__name__}"
            )
        normalize = self.mode == "normalized"
        scope = {"rows": rows, "dtype": dtype, "size": size}
        factors = clip_factors(norms, clip_norm, normalize=normalize, gamma=self.gamma, **scope)
        if grouped:
            norm = _root_sum([n.square() for n in norms.values()])
            scaled = torch.stack([f < 1 for f in factors.values()]).any(0)
        else:
            norm, scaled = norms, factors < 1
        weights = factors if mask is None else _apply_mask(factors, mask)
        return Clipped(factors, weights, norm, scaled)

    def _check(self) -> None:
        check_choice("mode", self.mode, CLIPPING_MODES)
        check_number("gamma", self.gamma, low=0, low_open=True, high_open=True)


def unclipped_count(norms: Tensor, clip_norm: float | Tensor, mask: Tensor | None = None) -> Tensor:
    """``sum_i mask_i * [norm_i <= clip_norm]``: the examples whose norm is within the clip.

    (:func:`clip_factors` also scales, by its rounding margin, the few whose
    norm is within about 1e-5 of ``clip_norm``; they count here as unclipped.)

    The statistic of adaptive clipping (Andrew et al. 2021, Algorithm 1).
    Adding or removing one example changes it by at most 1, so Gaussian
    noise of standard deviation ``count_noise_multiplier`` makes it private
    with noise multiplier ``count_noise_multiplier``. A non-finite norm
    counts as clipped (its example is dropped from the sum); a padding row
    (mask 0) counts as absent.

    Args:
        norms: ``Tensor[B]``, flat per-example norms (:func:`per_sample_norms`).
        clip_norm: the current ``C``, a float or a 0-d tensor.
        mask: ``Tensor[B]`` of 0/1 or bool; ``None`` keeps every row.

    Returns:
        A float64 0-d tensor.

    >>> unclipped_count(torch.tensor([0.5, 1.0, 2.0, float("nan")]), 1.0)
    tensor(2., dtype=torch.float64)
    """
    below = (norms <= clip_norm).to(torch.float64)  # NaN compares False: clipped
    if mask is not None:
        below = below * mask.to(torch.float64)
    return below.sum()


def adaptive_clip_norm(
    clip_norm: float | Tensor,
    noisy_count: Tensor,
    expected_batch_size: float,
    target_quantile: float,
    learning_rate: float,
) -> Tensor:
    """The geometric update ``C * exp(-learning_rate * (noisy_count / m - target_quantile))``.

    ``m`` is the expected batch size, so ``noisy_count / m`` estimates the
    fraction of examples whose norm is at most ``C``; when it exceeds the
    target quantile the norm shrinks, otherwise it grows (Andrew et al.
    2021, the geometric update of Algorithm 1). A post-processing of the
    noisy count: it reads no data.

    Args:
        clip_norm: the current ``C > 0``, a float or a 0-d tensor.
        noisy_count: the released count, :func:`unclipped_count` plus noise.
        expected_batch_size: ``m = sample_rate * num_examples``.
        target_quantile: ``gamma`` in ``(0, 1)``.
        learning_rate: ``eta > 0``.

    Returns:
        The new clip norm, a 0-d tensor in the dtype of ``noisy_count``.

    >>> adaptive_clip_norm(1.0, torch.tensor(5.0), 10.0, 0.5, 0.2)
    tensor(1.)
    """
    check_number("expected_batch_size", expected_batch_size, low=0, low_open=True, high_open=True)
    check_number("target_quantile", target_quantile, low=0, high=1, low_open=True, high_open=True)
    check_number("learning_rate", learning_rate, low=0, low_open=True, high_open=True)
    fraction = noisy_count / expected_batch_size
    return clip_norm * torch.exp(-learning_rate * (fraction - target_quantile))


class ClipState(NamedTuple):
    """A clip mechanism's state between steps (held in ``TrainState.clip_state``).

    ``clip_norm`` (shape (), float64) is the clip norm of the next step, read
    from ``norm``, the tensor the state holds, of shape ``(1,)`` (``ClipState(norm)``
    takes a 0-d one too). Not 0-d because ``torch.compile`` gives every 0-d float64
    CPU input a symbolic float for its value, and torch 2.13 specialises it after
    tracing and traces the whole step again (a 1-d tensor gets no symbol);
    checkpoints store the clip norm 0-d, as before.
    """

    norm: Tensor  # shape (1,), float64

    @property
    def clip_norm(self) -> Tensor:
        """Shape (), float64: the clip norm of the next step (a view of ``norm``)."""
        return self.norm.view(())

    def __repr__(self) -> str:
        return f"ClipState(clip_norm={self.clip_norm!r})"


class UnclippedCount(NamedTuple):
    """What a step gives adaptive clipping about its logical batch: the count and its draw.

    The input of a clip mechanism's ``update``, as the gradient is an
    optimizer's. ``count`` is :func:`unclipped_count` of the whole logical
    batch (sensitivity 1); ``noise`` is the standard normal the step drew
    for it from its own stream (``StepNoise.count``); the mechanism releases
    ``count + count_noise_multiplier * noise``. A step with a fixed clip norm
    gives ``None`` instead: it counts nothing and releases nothing.
    """

    count: Tensor  # shape (), float64: the examples the clip left unscaled
    noise: Tensor  # shape (), float64: the count's standard-normal draw


#: The clip norm of each step: a :class:`dpfunc.optim.GradientTransformation`, the
#: protocol of the optimizers and of the noise mechanisms
#: (:data:`dpfunc.noise.NoiseMechanism`). ``init(params) -> ClipState`` is the state
#: before the first step (``params`` are not read). ``update(count, state, params=None)
#: -> (clip_norm, state)`` takes what the step releases about its logical batch, an
#: :class:`UnclippedCount` (``None`` where the mechanism reads none,
#: :func:`fixed_clipping`), and returns the clip norm of the next step (0-d float64,
#: ``state.clip_norm`` of the state it returns) and that state. Made by
#: :func:`fixed_clipping` and :func:`adaptive_clipping`;
#: :meth:`dpfunc.DPConfig.clip_mechanism` picks the one a config releases.
ClipMechanism = GradientTransformation


def fixed_clipping(clip_norm: float) -> ClipMechanism:
    """A clip norm that never moves: ``update`` returns the state it gets, reading nothing.

    Raises:
        ValueError: ``clip_norm`` is not > 0 (``inf`` disables clipping).

    >>> mechanism = fixed_clipping(1.5)
    >>> state = mechanism.init({"w": torch.zeros(3)})
    >>> state
    ClipState(clip_norm=tensor(1.5000, dtype=torch.float64))
    >>> clip_norm, after = mechanism.update(None, state)
    >>> after is state, clip_norm
    (True, tensor(1.5000, dtype=torch.float64))
    """
    clip_norm = _check_clip_norm(clip_norm)

    def init(params: PyTree) -> ClipState:
        return ClipState(torch.tensor([clip_norm], dtype=F64))

    def update(
        count: UnclippedCount | None, state: ClipState, params: PyTree = None
    ) -> tuple[Tensor, ClipState]:
        return state.clip_norm, state

    return ClipMechanism(init, update)


def adaptive_clipping(
    clip_norm: float,
    expected_batch_size: float,
    target_quantile: float,
    learning_rate: float,
    count_noise_multiplier: float,
) -> ClipMechanism:
    """Adaptive clipping (Andrew et al. 2021) as a mechanism: the noisy count moves the norm.

    A :data:`ClipMechanism`. ``init(params)`` starts at ``clip_norm``
    (``params`` are not read). ``update(count, state, params=None)``, with
    ``count`` an :class:`UnclippedCount`, releases ``noisy_count =
    count.count + count_noise_multiplier * count.noise`` (the Gaussian
    mechanism on a statistic of sensitivity 1, noise multiplier
    ``count_noise_multiplier``) and returns :func:`adaptive_clip_norm` of it,
    the next step's clip norm, with the state that holds it. Pure; compiles
    with ``fullgraph=True``.

    Args:
        clip_norm: the starting ``C``, finite and > 0.
        expected_batch_size: ``m``, the denominator of the fraction.
        target_quantile: ``gamma`` in ``(0, 1)``.
        learning_rate: ``eta > 0`` of the geometric update.
        count_noise_multiplier: the std of the count's noise, > 0.

    Raises:
        ValueError: a setting is out of range (named with its value); from
            ``update``, a ``count`` of ``None``.

    >>> mechanism = adaptive_clipping(1.0, 10.0, 0.5, 0.2, 1.0)
    >>> count = UnclippedCount(torch.tensor(5.0, dtype=torch.float64),
    ...                        torch.tensor(0.0, dtype=torch.float64))
    >>> mechanism.update(count, mechanism.init({"w": torch.zeros(3)}))
    (tensor(1., dtype=torch.float64), ClipState(clip_norm=tensor(1., dtype=torch.float64)))
    """
    start = check_number("clip_norm", clip_norm, low=0, low_open=True, high_open=True,
                         note="(adaptive clipping starts from a finite norm)")  # fmt: skip
    check_number("expected_batch_size", expected_batch_size, low=0, low_open=True, high_open=True)
    check_number("target_quantile", target_quantile, low=0, high=1, low_open=True, high_open=True)
    check_number("learning_rate", learning_rate, low=0, low_open=True, high_open=True)
    check_number("count_noise_multiplier", count_noise_multiplier, low=0, low_open=True,
                 high_open=True)  # fmt: skip

    def init(params: PyTree) -> ClipState:
        return ClipState(torch.tensor([start], dtype=F64))

    def update(
        count: UnclippedCount | None, state: ClipState, params: PyTree = None
    ) -> tuple[Tensor, ClipState]:
        if count is None or count.count is None or count.noise is None:
            raise ValueError(
                "adaptive clipping releases the unclipped count with its own noise: pass "
                "UnclippedCount(count, noise), count the logical batch's "
                "dpfunc.clipping.unclipped_count and noise a standard normal; "
                f"got count={count!r}"
            )
        noisy_count = count.count + count_noise_multiplier * count.noise
        moved = adaptive_clip_norm(
            state.clip_norm, noisy_count, expected_batch_size, target_quantile, learning_rate
        )
        state = ClipState(moved.view(1))
        return state.clip_norm, state

    return ClipMechanism(init, update)
