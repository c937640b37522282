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

Adaptive clipping (Andrew, Thakkar, McMahan and Ramaswamy 2021, "Differentially
private learning with adaptive clipping") moves the clip norm towards a
target quantile of the per-example norms: each step counts the examples the
clip left unscaled (:func:`unclipped_count`, sensitivity 1), releases that
count with Gaussian noise, and updates the norm geometrically
(:func:`adaptive_clip_norm`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import optree
import torch
from torch import Tensor

from .checks import check_number
from .tree import Params, PyTree, tree_leaves, tree_map

Groups = Mapping[str, Sequence[str]]


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
        Eagerly, a float32 (or half) leaf is reduced in its own dtype over
        runs of ``NORM_CHUNK`` entries, whose norms are then combined in
        float64: no float64 copy of the gradients, and a relative error of
        about 1e-8 typically, 1e-6 at worst (float32 over 128 terms). A leaf
        whose runs overflow (entries beyond about 1e18) or hold NaN or inf is
        recomputed in float64, so a float32 gradient with entries near the
        float32 maximum still has a finite norm, and a NaN or inf entry gives
        a NaN or inf norm. That check costs one host sync eagerly.
    """
    if groups is None:
        return torch.stack(_squared_norms(tree_leaves(grads))).sum(0).sqrt()
    _check_groups(groups, grads)
    names = list(grads)
    squares = dict(zip(names, _squared_norms([grads[name] for name in names])))
    return {
        group: torch.stack([squares[name] for name in members]).sum(0).sqrt()
        for group, members in groups.items()
    }


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
    parts = [torch.linalg.vector_norm(runs, dim=2)]
    if whole < size:
        parts.append(torch.linalg.vector_norm(flat[:, whole:], dim=1, keepdim=True))
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


def clip_factors(
    norms: Tensor | Mapping[str, Tensor],
    clip_norm: float | Mapping[str, float],
    *,
    normalize: bool = False,
    gamma: float = 0.01,
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

    Returns:
        Factors like ``norms``, in ``[0, 1]`` for clipping, in ``[0, C/gamma)``
        for normalisation, so that ``factor * norm <= C`` always.
        Flat clipping gives ``min(1, C / norm)``, computed as
        ``clamp(C / (norm + tiny), max=1)`` so a zero gradient gets 1 and
        ``C = inf`` gives 1. A non-finite norm gives 0.

    >>> clip_factors(torch.tensor([0.5, 2.0, float("nan")]), clip_norm=1.0)
    tensor([1.0000, 0.5000, 0.0000])
    """
    if isinstance(norms, Mapping):
        thresholds = _group_thresholds(clip_norm, list(norms))
        return {
            g: clip_factors(n, thresholds[g], normalize=normalize, gamma=gamma)
            for g, n in norms.items()
        }
    if not isinstance(clip_norm, Tensor):  # a tensor: adaptive clipping's current norm, > 0
        _check_clip_norm(clip_norm)
    if normalize:
        if not isinstance(clip_norm, Tensor) and math.isinf(clip_norm):
            raise ValueError("normalized clipping needs a finite clip_norm, got clip_norm=inf")
        check_number("gamma", gamma, low=0, low_open=True, high_open=True)
        factors = clip_norm / (norms + gamma)
    else:
        tiny = torch.finfo(norms.dtype).tiny
        factors = torch.clamp(clip_norm / (norms + tiny), max=1.0)
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
        A tree like one example's gradient. An example with weight 0
        (masked, or dropped for a non-finite norm) contributes exactly 0,
        even if its gradient holds NaN or inf. With ``B = 0`` the sum is 0.
    """
    weights = factors if mask is None else _apply_mask(factors, mask)
    if isinstance(weights, Mapping):
        if groups is None:
            raise ValueError("grouped factors need groups= to map groups to parameter names")
        _check_groups(groups, grads)
        per_param = {name: weights[g] for g, names in groups.items() for name in names}
        leaf_weights = {name: per_param[name] for name in grads}
    else:
        leaf_weights = tree_map(lambda g: weights, grads)
    leaves, spec = optree.tree_flatten(grads)
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


def unclipped_count(norms: Tensor, clip_norm: float | Tensor, mask: Tensor | None = None) -> Tensor:
    """``sum_i mask_i * [norm_i <= clip_norm]``: the examples the clip left unscaled.

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
