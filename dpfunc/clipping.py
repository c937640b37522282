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
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

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
        ``Tensor[B]`` (flat) or ``{group: Tensor[B]}``. Norms are accumulated
        in float64, so a float32 gradient with entries near the float32
        maximum still has a finite norm. A NaN or inf entry gives a NaN or
        inf norm.
    """
    if groups is None:
        squares = [_squared_norms(g) for g in tree_leaves(grads)]
        return torch.stack(squares).sum(0).sqrt()
    _check_groups(groups, grads)
    return {
        group: torch.stack([_squared_norms(grads[name]) for name in names]).sum(0).sqrt()
        for group, names in groups.items()
    }


def _squared_norms(g: Tensor) -> Tensor:
    per_example = g.reshape(g.shape[0], math.prod(g.shape[1:]))
    return torch.linalg.vector_norm(per_example, dim=1, dtype=torch.float64).square()


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
        clip_norm: the bound ``C > 0`` (``inf`` disables clipping). With
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
    _check_clip_norm(clip_norm)
    if normalize:
        if math.isinf(clip_norm):
            raise ValueError("normalized clipping needs a finite clip_norm, got clip_norm=inf")
        if not gamma > 0:
            raise ValueError(f"gamma must be > 0, got gamma={gamma!r}")
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


def _check_clip_norm(clip_norm, name: str = "clip_norm") -> None:
    if isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float)) or not clip_norm > 0:
        raise ValueError(f"{name} must be a number > 0 (inf disables clipping), got {clip_norm!r}")


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
        return {name: _weighted_sum(g, per_param[name]) for name, g in grads.items()}
    return tree_map(lambda g: _weighted_sum(g, weights), grads)


def _apply_mask(factors, mask: Tensor):
    if isinstance(factors, Mapping):
        return {g: f * mask.to(f.dtype) for g, f in factors.items()}
    return factors * mask.to(factors.dtype)


def _weighted_sum(g: Tensor, weights: Tensor) -> Tensor:
    w = weights.to(g.dtype).reshape(-1, *([1] * (g.dim() - 1)))
    return torch.where(w != 0, g * w, torch.zeros_like(g)).sum(0)
