"""``nn.EmbeddingBag``: ``grad W_i[v] = sum_b sum_{t in b, idx_t = v} w_t G_i[b]``, mean ``/ |b|``.

Each bag ``b`` of example ``i`` reduces the rows of its indices to one
output row; the loss's gradient ``G_i[b]`` with respect to that row goes
back to every position ``t`` of the bag, scaled by its per-sample weight
``w_t`` (``sum`` mode) or by ``1 / |b|`` (``mean``). The weight's gradient is
therefore an :class:`~dpfunc.ghost.registry.Outer` form with index rows:
``left`` = the indices ``idx_t``, ``right[t]`` = ``scale_t * G_i[bag_t]``,
one position per index, whose norm and sum the runtime bounds as for
``nn.Embedding`` (:mod:`dpfunc.ghost.bounds`).

The form needs the bags (``offsets``) and ``per_sample_weights``, not just
the first input, so the layer runs itself in a ghost pass
(:mod:`dpfunc.ghost.dispatch`): it gathers the rows with ``F.embedding`` and
reduces each bag with a product by its 0/1 membership matrix, operations
that ``vmap`` batches (torch's fused ``embedding_bag`` kernel has no batching
rule), records each position's index, bag and scale, and adds the probe to
the ``[bags, dim]`` output. The loss sees one example, so an example is the
bag list of one call made per example: a 2-D input ``[bags, L]`` (fixed-size
bags; ``x.unsqueeze(0)`` for one bag), or a 1-D input with ``offsets``
(``[bags]``, or ``[bags + 1]`` with ``include_last_offset``), batched to
``[B, N]`` and ``[B, bags]`` by padding every example to the same number of
indices and bags.

``max`` mode sends each coordinate ``j`` of a bag's gradient to the row of
the first position attaining the maximum, as torch's kernels do (ties between
rows included): ``right[t, j] = G_i[b, j]`` where ``t`` is that position, 0
elsewhere, the same index-row form, exact.

Covered: ``sum`` (with or without ``per_sample_weights``), ``mean`` and
``max``, ``padding_idx`` (those positions are left out of the bag, of its
size and of the gradient, as torch does), empty bags (a zero row). Left to
per-example gradients, with the reason: ``max_norm`` (renormalises the weight
in place), ``scale_grad_by_freq``, ``sparse=True``, a module called more than
once per example. The ``max`` forward holds a ``[bags, N, dim]`` mask per
example (N: the indices of the call), so it suits few bags per call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import embedding
from .registry import Outer, Rule, register_unrolled


def _inputs(args: tuple, kwargs: dict) -> tuple:
    names = ("input", "offsets", "per_sample_weights")
    return tuple(args[i] if i < len(args) else kwargs.get(n) for i, n in enumerate(names))


def _bags(module: nn.EmbeddingBag, idx: Tensor, offsets: Tensor | None) -> int:
    if idx.dim() == 2:
        return idx.shape[0]
    if offsets is None:
        raise ValueError("EmbeddingBag with a 1-D input needs offsets, got offsets=None")
    return offsets.shape[0] - (1 if module.include_last_offset else 0)


def probe_shapes(module: nn.EmbeddingBag, args: tuple, kwargs: dict) -> dict:
    """``{"out": (bags, dim)}``: one example's output."""
    idx, offsets, _ = _inputs(args, kwargs)
    return {"out": (_bags(module, idx, offsets), module.embedding_dim)}


def positions(module: nn.EmbeddingBag, idx: Tensor, offsets, weights) -> tuple:
    """``(idx [N], bag [N], member [bags, N], coef [bags, N])`` of one example's call.

    ``member`` is 1 where position ``t`` belongs to bag ``b`` and is not padding;
    ``coef`` is ``member`` times the per-sample weight, divided by the bag's size
    in ``mean`` mode (an empty bag has no member and gives a zero row).
    """
    bags = _bags(module, idx, offsets)
    if idx.dim() == 2:
        length = idx.shape[1]
        bag = torch.arange(bags, device=idx.device)[:, None].expand(bags, length).reshape(-1)
        idx = idx.reshape(-1)
        weights = None if weights is None else weights.reshape(-1)
    else:
        starts = offsets[:bags]
        at = torch.arange(idx.shape[0], device=idx.device)
        bag = (starts[None, :] <= at[:, None]).sum(1) - 1  # the last bag starting at or before t
        if module.include_last_offset:  # positions from the last offset on are in no bag
            bag = torch.where(at < offsets[bags], bag, -1)
    member = bag[None, :] == torch.arange(bags, device=idx.device)[:, None]
    if module.padding_idx is not None:
        member = member & (idx != module.padding_idx)[None, :]
    dtype = module.weight.dtype
    coef = member.to(dtype)
    if weights is not None:
        coef = coef * weights.to(dtype)[None, :]
    if module.mode == "mean":
        coef = coef / member.sum(1, keepdim=True).clamp(min=1).to(dtype)
    return idx, bag, member, coef


def _max(member: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
    """``(out [bags, dim], first [bags, N, dim])``: each bag's coordinate-wise maximum (0 for
    an empty bag) and, per coordinate, the first member position that attains it, the row
    torch's kernels (CPU and CUDA) send that coordinate's gradient to."""
    inside = member[:, :, None]
    values = torch.where(inside, rows[None], float("-inf"))
    out = values.amax(1)
    hit = inside & (values == out[:, None, :])
    first = hit & (hit.cumsum(1) == 1)
    return torch.where(member.any(1, keepdim=True), out, 0.0), first


def run(module: nn.EmbeddingBag, probes: dict, record: dict, input, offsets=None,
        per_sample_weights=None):  # fmt: skip
    """The module's forward for one example, with a probe on its output; ``record`` gets
    each position's index and bag and its coefficient in its bag (``max``: the first
    position attaining each coordinate's maximum)."""
    idx, bag, member, coef = positions(module, input, offsets, per_sample_weights)
    rows = F.embedding(idx, module.weight)  # [N, dim]
    record["idx"] = idx
    if module.mode == "max":
        out, record["first"] = _max(member, rows)
        return out + probes["out"]
    record["bag"] = bag.clamp(min=0)
    record["scale"] = coef.sum(0)  # a position is in one bag at most
    return coef @ rows + probes["out"]


def embedding_bag(module: nn.EmbeddingBag, inputs: dict, grads: dict, weights: dict) -> dict:
    g = grads["out"]  # [B, bags, dim]
    if "first" in inputs:  # max: one (bag, position) term per coordinate, the rest exact zeros
        right = (inputs["first"].to(g.dtype) * g[:, :, None, :]).sum(1)
        return {"weight": Outer(inputs["idx"], right)}
    bag = inputs["bag"][..., None].expand(-1, -1, g.shape[-1])
    right = torch.gather(g, 1, bag) * inputs["scale"][..., None].to(g.dtype)  # [B, N, dim]
    return {"weight": Outer(inputs["idx"], right)}


def check(module: nn.EmbeddingBag, idx, output) -> str:
    why = embedding.check(module, idx, output)  # max_norm, scale_grad_by_freq, sparse, dtype
    if why:
        return why
    if idx.dim() not in (1, 2):
        return f"input has {idx.dim()} dimensions per example (EmbeddingBag takes 1 or 2)"
    return ""


register_unrolled(
    nn.EmbeddingBag,
    Rule(embedding_bag, check=check, cheaper=embedding.cheaper, run=run, probe_shapes=probe_shapes),
)
