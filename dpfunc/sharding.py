"""Sharded data-parallel DP-SGD: the parameters, optimizer state and noise history split over ranks.

Data-parallel training (:mod:`dpfunc.distributed`) keeps the whole model, the
whole optimizer state and (with ``bands > 1``) the whole noise history on every
rank. Sharded training keeps ``1/W`` of each on each of ``W`` ranks, in the
layout of FSDP2 (``torch.distributed.fsdp.fully_shard``): every parameter is
cut along dim 0 as ``torch.chunk`` cuts it, and rank ``r`` holds chunk ``r``.
A step gathers the whole parameters once, clips each example on the rank that
holds it, reduce-scatters the clipped sums, and each rank adds the noise to,
and updates, its own rows.

Main names: :class:`Sharding` (one rank's layout: its rows, shards, gathers and
reduce-scatters), :func:`check_elementwise` (an optimizer must act element by
element, as all of :mod:`dpfunc.optim` does), :class:`DrawnNoise` (noise drawn
for this rank's rows of one step), and :func:`shard_module` (a module sharded
with FSDP2 for :class:`dpfunc.PrivateGradients`). Build a run with
``dpfunc.distributed.make_train_step(..., shard=True)``,
``Trainer(..., shard=True)`` or ``PrivateGradients(..., shard=True)``.

Privacy: the mechanism is the single-process one. Each example's norm and clip
factor are computed whole, on the one rank that holds the example; rank ``r``
draws exactly its rows of the single-process noise tree
(:func:`dpfunc.standard_normal_like` with ``rows=``), so the noise is added once
per coordinate and the accounting is unchanged. A step refuses noise drawn
without ``rows`` or for another step, which would add the same noise twice.

The layout, the step on ``W`` ranks, why the norms need no collective, what a
rank holds and at what memory cost: see docs/sharded.md, "One step on W ranks"
and "What each rank holds".
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from . import optim
from .tree import Params, PyTree, tree_leaves, tree_structure

__all__ = [
    "DrawnNoise",
    "Sharding",
    "as_dtensors",
    "check_elementwise",
    "dtensor_class",
    "from_dtensors",
    "fsdp_hooks_off",
    "require_fsdp2",
    "reshard",
    "shard_module",
    "state_dims",
]


def dtensor_class() -> type | None:
    """torch's public ``DTensor`` class, or ``None`` on a torch that has none (before 2.5).

    Unsharded code asks it whether a tensor is a ``DTensor``: on such a torch, none is.
    """
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def require_fsdp2(what: str) -> None:
    """Raises ``RuntimeError`` naming ``what`` and the version if this torch lacks FSDP2.

    Sharded steps use FSDP2's public ``torch.distributed.fsdp.fully_shard`` and
    ``DTensor`` (``torch.distributed.tensor``), public since torch 2.6.
    """
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: F401
        from torch.distributed.tensor import DTensor, Shard  # noqa: F401
    except ImportError as error:
        raise RuntimeError(
            f"{what} shards with FSDP2 (torch.distributed.fsdp.fully_shard and the public "
            f"DTensor), which this torch {torch.__version__} does not have: use torch >= 2.6, "
            "or train data-parallel (shard=False)"
        ) from error


#: A parameter of this many bytes or more is gathered by its own all-gather, into the
#: tensor the step uses (no copy out of a shared buffer), and its clipped sum reduced by
#: its own reduce-scatter, from the sum itself; smaller ones share one of each, through
#: copies. 1 MiB: a model's matrices alone, its biases and norms together.
GATHER_ALONE_BYTES = 2**20

# flat-tensor collectives: their newer names where this torch has them
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_NATIVE_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _reduce_scatter(out: Tensor, send: Tensor) -> None:
    """``out`` = this rank's chunk of ``send`` summed over the ranks.

    gloo has no native reduce-scatter: torch emulates it, 3.3x the time of
    an all-reduce of the same buffer here (150 MB of float64 on 2 ranks:
    0.42 s against 0.13 s), so on gloo the buffer is all-reduced and this
    rank's chunk copied out. NCCL's reduce-scatter moves half the bytes of
    its all-reduce.
    """
    if dist.get_backend() == "gloo":
        dist.all_reduce(send)
        out.copy_(send.view(dist.get_world_size(), -1)[dist.get_rank()])
    else:
        _NATIVE_REDUCE_SCATTER(out, send)


class Sharding:
    """The dim-0 layout of a parameter tree over ``world_size`` ranks, and its collectives.

    Built from the whole parameters (their shapes, dtypes and devices).
    ``shard`` cuts a whole tree into this rank's rows, ``unshard`` gathers
    every rank's rows into whole leaves, ``reduce_scatter`` sums whole
    trees over the ranks and leaves this rank its rows of the sum.

    Args:
        params: the whole parameters (any tree of tensors).
        rank, world_size: this rank and the number of ranks.
    """

    def __init__(self, params: Params, rank: int, world_size: int):
        leaves = tree_leaves(params)
        self.treedef = tree_structure(params)
        self.shapes = [tuple(x.shape) for x in leaves]  # the whole leaves'
        self.rank, self.world_size = rank, world_size
        # each leaf as rows: a 0-d leaf is one row
        self.row_counts = [shape[0] if shape else 1 for shape in self.shapes]
        self.row_sizes = [math.prod(shape[1:]) for shape in self.shapes]
        self.chunks = [math.ceil(rows / world_size) for rows in self.row_counts]

    def rows(self, leaf: int, rank: int | None = None) -> tuple[int, int]:
        """``(start, stop)``: the rows of leaf ``leaf`` that ``rank`` (default: this one) holds."""
        rank = self.rank if rank is None else rank
        rows, chunk = self.row_counts[leaf], self.chunks[leaf]
        return min(rank * chunk, rows), min((rank + 1) * chunk, rows)

    def local_shape(self, leaf: int, rank: int | None = None) -> tuple[int, ...]:
        """The shape of this rank's (or ``rank``'s) rows of leaf ``leaf``."""
        start, stop = self.rows(leaf, rank)
        return (stop - start, *self.shapes[leaf][1:])

    def noise_rows(self) -> list[tuple[tuple[int, ...], int, int]]:
        """For :func:`dpfunc.standard_normal_like`'s ``rows``: each leaf's whole shape and rows."""
        return [
            ((self.row_counts[i], *shape[1:]), *self.rows(i)) for i, shape in enumerate(self.shapes)
        ]

    def shard(self, params: Params) -> Params:
        """This rank's rows of the whole ``params`` (copies: the whole tree may then be freed)."""
        self.check(params, whole=True)
        shards = []
        for i, leaf in enumerate(tree_leaves(params)):
            start, stop = self.rows(i)
            shards.append(leaf.reshape(self.row_counts[i], *leaf.shape[1:])[start:stop].clone())
        return self.treedef.unflatten(shards)

    def check(self, tree: PyTree, *, whole: bool, what: str = "params") -> None:
        """Raises ``ValueError`` unless ``tree`` has this layout's leaves, whole or this rank's."""
        leaves = tree_leaves(tree)
        expected = self.shapes if whole else [self.local_shape(i) for i in range(len(self.shapes))]
        got = [tuple(x.shape) for x in leaves]
        if tree_structure(tree) != self.treedef or got != expected:
            kind = "the whole parameters" if whole else f"rank {self.rank}'s shards"
            raise ValueError(
                f"{what} must be {kind}, shaped {expected}, got shapes {got}: a sharded step "
                "holds each rank's rows of every parameter (step.init cuts them), and gathers "
                "the whole ones itself (step.full_params(state))"
            )

    def unshard(self, shards: Params) -> Params:
        """The whole parameters from every rank's rows, each as one tensor (no second copy).

        A leaf of :data:`GATHER_ALONE_BYTES` or more is all-gathered on its
        own, straight into the tensor it is returned as; the smaller ones
        share one all-gather per (dtype, device) and are copied out of it.
        Collective (raw: :mod:`dpfunc.distributed` names its failures). The
        result is the same on every rank, bit for bit.
        """
        self.check(shards, whole=False)
        leaves = tree_leaves(shards)
        whole: list[Tensor | None] = [None] * len(leaves)
        for positions in self._gathers(leaves):
            sizes = [self.chunks[i] * self.row_sizes[i] for i in positions]
            mine = leaves[positions[0]]
            if len(positions) == 1 and mine.is_contiguous() and mine.numel() == sizes[0]:
                send = mine.view(-1)  # this rank's rows as they are (all-gather only reads them)
            else:
                send = mine.new_zeros(sum(sizes))  # this rank's rows, zero-padded
                offset = 0
                for i, size in zip(positions, sizes):
                    send[offset : offset + leaves[i].numel()] = leaves[i].reshape(-1)
                    offset += size
            out = send.new_empty(self.world_size * send.numel())
            _ALL_GATHER(out, send)
            by_rank = out.view(self.world_size, -1)
            offset = 0
            for i, size in zip(positions, sizes):
                rows = by_rank[:, offset : offset + size].reshape(-1)
                whole[i] = rows[: self.row_counts[i] * self.row_sizes[i]].view(self.shapes[i])
                offset += size
        return self.treedef.unflatten(whole)

    def reduce_scatter(self, summed: Params) -> Params:
        """This rank's rows of ``summed`` summed over the ranks.

        Grouped as :meth:`unshard` gathers: a leaf of
        :data:`GATHER_ALONE_BYTES` or more is reduced on its own, and when
        its rows are whole chunks it is sent as it is (its rows are already
        rank by rank), with no second copy of the sum; the smaller leaves
        share one zero-padded buffer per (dtype, device). On gloo the send
        buffer is all-reduced in place (:func:`_reduce_scatter`), so
        ``summed`` is the caller's to give up: the step passes its own sum.

        Collective (raw, as :meth:`unshard`); ``summed`` is each rank's whole
        tree (a clipped sum, float32 within FLOAT32_SUMS).
        """
        self.check(summed, whole=True, what="summed")
        leaves = tree_leaves(summed)
        mine: list[Tensor | None] = [None] * len(leaves)
        for positions in self._gathers(leaves):
            sizes = [self.chunks[i] * self.row_sizes[i] for i in positions]
            first = leaves[positions[0]]
            if (
                len(positions) == 1
                and first.is_contiguous()
                and first.numel() == self.world_size * sizes[0]
            ):
                send = first.view(-1)  # rank r's rows are its chunk already
            else:
                # rank r's chunk of the buffer: its rows of every leaf, zero-padded
                send = first.new_zeros(self.world_size, sum(sizes))
                offset = 0
                for i, size in zip(positions, sizes):
                    as_rows = leaves[i].reshape(self.row_counts[i], -1)
                    for rank in range(self.world_size):
                        start, stop = self.rows(i, rank)
                        width = (stop - start) * self.row_sizes[i]
                        send[rank, offset : offset + width] = as_rows[start:stop].reshape(-1)
                    offset += size
            out = send.new_empty(sum(sizes))
            _reduce_scatter(out, send.view(-1))
            del send
            offset = 0
            for i, size in zip(positions, sizes):
                shape = self.local_shape(i)
                mine[i] = out[offset : offset + math.prod(shape)].view(shape)
                offset += size
        return self.treedef.unflatten(mine)

    def _gathers(self, leaves: list[Tensor]) -> list[list[int]]:
        """The leaves one collective of :meth:`unshard` or :meth:`reduce_scatter` moves: each
        large one alone, the rest together by (dtype, device)."""
        gathers = []
        for positions in _buckets(leaves).values():
            small = []
            for i in positions:
                whole = self.world_size * self.chunks[i] * self.row_sizes[i]
                if whole * leaves[i].element_size() >= GATHER_ALONE_BYTES:
                    gathers.append([i])
                else:
                    small.append(i)
            if small:
                gathers.append(small)
        return gathers


class DrawnNoise:
    """The noise trees a sharded step drew for its rows, so that no other noise is added.

    ``standard_normal_like(state.params, ...)`` without ``rows`` gives every
    rank with equally shaped rows the SAME noise, so the difference of two
    ranks' released rows would be the difference of the clipped sums,
    without noise; a tree drawn for another step adds the same noise twice,
    so the difference of two releases holds none. :meth:`record` remembers
    the last few trees ``step.draw_noise`` drew (by identity, weakly; a
    worker thread may draw ahead) and :meth:`check` refuses any other.
    """

    def __init__(self, kept: int = 4):
        self._drawn: deque[tuple[int, dict[int, weakref.ref]]] = deque(maxlen=kept)
        self._lock = threading.Lock()  # NoiseAhead draws on a worker thread

    def record(self, noise: PyTree, step: int) -> None:
        """Remembers ``noise`` as this rank's draw for ``step``."""
        drawn = {id(z): weakref.ref(z) for z in tree_leaves(noise)}
        with self._lock:
            self._drawn.append((int(step), drawn))

    def check(self, noise: PyTree, step: int | Tensor) -> None:
        """Raises ``ValueError`` unless every leaf of ``noise`` was drawn for ``step`` here."""
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "a sharded step checks its noise eagerly, before the compiled pieces run: "
                "compile it with step.compile(), not torch.compile"
            )
        with self._lock:
            drawn = list(self._drawn)
        t = int(step)
        for z in tree_leaves(noise):
            if not any(at == t and d.get(id(z)) is not None and d[id(z)]() is z for at, d in drawn):
                raise ValueError(
                    f"a sharded step takes the noise of step {t} from step.draw_noise("
                    f"state.params, seed=..., step={t}), which draws this rank's rows of the noise "
                    "tree for that step; noise drawn otherwise (standard_normal_like("
                    "state.params, ...) draws the first rows on every rank) or for another step "
                    "would add the same noise twice and release differences of clipped sums "
                    "without noise"
                )


def _buckets(leaves: list[Tensor]) -> dict[tuple[torch.dtype, torch.device], list[int]]:
    buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for position, leaf in enumerate(leaves):
        buckets.setdefault((leaf.dtype, leaf.device), []).append(position)
    return buckets


def check_elementwise(
    optimizer: optim.GradientTransformation, params: Params, world_size: int
) -> None:
    """Refuses an optimizer whose update of rows differs from its update of whole leaves.

    A sharded step updates each rank's rows alone, which is right only for
    an optimizer that acts element by element. This checks it on a probe:
    every leaf of ``params`` with ``2 * world_size + 1`` rows and its own
    trailing dims (each at most :data:`PROBE_DIM` when they hold more than
    ``PROBE_DIM**2`` values), three updates, once whole and once cut in
    ``world_size`` row chunks; the updates must agree to float rounding. A
    check, not a proof: an optimizer that reads a whole leaf only beyond
    the probe's sizes or steps passes it.

    Raises:
        ValueError: the updates differ (the optimizer reads a leaf as a whole).
    """
    generator = torch.Generator().manual_seed(0)  # a public probe, no data
    rows = 2 * world_size + 1

    def probe_like(x: Tensor) -> Tensor:
        trailing = list(x.shape[1:])
        if math.prod(trailing) > PROBE_DIM**2:
            trailing = [min(s, PROBE_DIM) for s in trailing]
        return torch.randn(rows, *trailing, generator=generator, dtype=torch.float32)

    treedef = tree_structure(params)
    probe = treedef.unflatten([probe_like(x) for x in tree_leaves(params)])
    grads = treedef.unflatten(
        [torch.linspace(-1, 1, x.numel()).view(x.shape) + 0.5 for x in tree_leaves(probe)]
    )
    layout = Sharding(probe, 0, world_size)
    whole = _updates(optimizer, probe, grads)
    pieces = []
    for rank in range(world_size):
        layout.rank = rank
        pieces.append(tree_leaves(_updates(optimizer, layout.shard(probe), layout.shard(grads))))
    for i, leaf in enumerate(tree_leaves(whole)):
        joined = torch.cat([piece[i] for piece in pieces])
        if not torch.allclose(joined, leaf, rtol=1e-5, atol=1e-7):
            raise ValueError(
                "optimizer updates a parameter's rows differently from the whole parameter, so "
                "a sharded step (each rank updates its rows alone) would not equal one process: "
                "use an element-wise optimizer (any of dpfunc.optim), or shard=False"
            )


PROBE_DIM = 256
"""The largest trailing dim :func:`check_elementwise` probes when a leaf's are large."""


def _updates(optimizer: optim.GradientTransformation, params: Params, grads: Params) -> Params:
    state = optimizer.init(params)
    total = None
    for _ in range(3):
        updates, state = optimizer.update(grads, state, params)
        total = (
            updates
            if total is None
            else tree_structure(params).unflatten(
                [a + b for a, b in zip(tree_leaves(total), tree_leaves(updates))]
            )
        )
    return total


# --------------------------------------------------------------------------- checkpoints


def state_dims(init: Any, layout: Sharding) -> list[tuple[tuple[int, ...], int] | None]:
    """Which leaves of ``init(rows)`` are cut with the parameters: ``(whole shape, dim)`` each.

    ``init`` builds a state from parameter rows (``optimizer.init``, the
    noise mechanism's ``init``). It runs twice on ``meta`` tensors, once on
    the whole parameters (as rows) and once with one row more in each: a
    leaf whose size changes along one dim is cut along it; ``None`` marks a
    leaf every rank holds whole (a step count).
    """

    def rows(extra: int) -> Params:
        leaves = [
            torch.empty(layout.row_counts[i] + extra, *shape[1:], device="meta")
            for i, shape in enumerate(layout.shapes)
        ]
        return layout.treedef.unflatten(leaves)

    dims: list[tuple[tuple[int, ...], int] | None] = []
    for a, b in zip(tree_leaves(init(rows(0))), tree_leaves(init(rows(1))), strict=True):
        changed = [d for d, (m, n) in enumerate(zip(a.shape, b.shape)) if m != n]
        dims.append((tuple(a.shape), changed[0]) if changed else None)
    return dims


def as_dtensors(tree: PyTree, dims: list, device: torch.device) -> dict[str, Tensor]:
    """``tree``'s leaves by position, the cut ones as ``DTensor`` shards over every rank.

    The ``DTensor`` s (``Shard(dim)`` on a 1-D mesh of the world, ``torch.chunk``
    rows) are what ``torch.distributed.checkpoint`` saves and re-cuts for
    another number of ranks; the leaves whole on every rank stay tensors.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    out: dict[str, Tensor] = {}
    for i, (leaf, dim) in enumerate(zip(tree_leaves(tree), dims, strict=True)):
        if dim is None:
            out[str(i)] = leaf
            continue
        shape, axis = dim
        stride = torch.empty(shape, device="meta").stride()
        out[str(i)] = DTensor.from_local(
            leaf.contiguous(),
            mesh,
            [Shard(axis)],
            run_check=False,
            shape=torch.Size(shape),
            stride=stride,
        )
    return out


def from_dtensors(tree: PyTree, loaded: dict[str, Tensor]) -> PyTree:
    """``tree`` with its leaves replaced by ``loaded``'s (this rank's rows of the cut ones)."""
    from torch.distributed.tensor import DTensor

    leaves = [
        loaded[str(i)].to_local() if isinstance(loaded[str(i)], DTensor) else loaded[str(i)]
        for i in range(len(tree_leaves(tree)))
    ]
    return tree_structure(tree).unflatten(leaves)


# --------------------------------------------------------------------------- FSDP2 modules


def shard_module(model: torch.nn.Module) -> None:
    """Shards ``model`` with FSDP2's ``fully_shard`` (unless it is already), then checks it.

    Every parameter becomes a ``DTensor`` of this rank's dim-0 rows (FSDP2's
    default ``Shard(0)``; frozen ones too, gathered for dpfunc's pass by
    :class:`fsdp_hooks_off`), so a ``torch.optim`` optimizer built on
    ``model.parameters()`` keeps its state for those rows only, the model's
    own forward gathers what it needs (FSDP2's hooks), and
    ``model.state_dict()`` is a sharded state dict for
    ``torch.distributed.checkpoint``.

    Raises:
        ValueError: a trainable parameter is not sharded along dim 0 (a
            ``shard_placement_fn`` that chose another dim), or is 0-d, or
            ``fully_shard`` grouped modules (``fully_shard([a, b])``), whose
            forward hooks :func:`fsdp_hooks_off` cannot lift.
    """
    require_fsdp2("shard=True")
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor, Shard

    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        fully_shard(model)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if not isinstance(p, DTensor) or tuple(p.placements) != (Shard(0),) or p.dim() == 0:
            raise ValueError(
                f"model parameter {name!r} must be sharded along dim 0 by fully_shard (a "
                f"DTensor placed Shard(0), at least 1-d) for shard=True, got "
                f"{getattr(p, 'placements', 'a plain tensor')} of shape {tuple(p.shape)}; apply "
                "fully_shard to every module that holds trainable parameters, with the "
                "default placement"
            )
    _fsdp_hook_ids(model)  # refuses grouped hooks now, not at the first backward


def _fsdp_hook_ids(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int, int]]:
    """``(module, pre-hook id, hook id)`` of each FSDP2 state's forward hooks."""
    from torch.distributed.fsdp import FSDPModule

    found = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        pre = getattr(state, "_pre_forward_hook_handle", None)
        post = getattr(state, "_post_forward_hook_handle", None)
        modules = getattr(state, "_modules", (module,))
        if pre is None or post is None or len(modules) != 1 or pre is post:
            raise ValueError(
                "a sharded PrivateGradients runs the model through torch.func with FSDP2's "
                "forward hooks lifted, and cannot find them on this model (grouped "
                "fully_shard([a, b]), or a torch whose FSDP2 keeps them elsewhere); shard "
                "each module on its own, or use dpfunc.Trainer(shard=True)"
            )
        found.append((module, pre.id, post.id))
    return found


def reshard(model: torch.nn.Module) -> None:
    """Puts every FSDP2 module of ``model`` back to its rows (after the model's own forward).

    FSDP2 leaves the root module's parameters gathered after a forward (its
    default for the root); dpfunc reads the rows, the parameters a
    ``torch.optim`` optimizer holds.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class fsdp_hooks_off:  # noqa: N801 (a context manager, named as one)
    """Within the block, ``model`` is as dpfunc's pass needs it: no FSDP2 forward hooks.

    dpfunc's pass calls the model through ``torch.func.functional_call``
    with the whole trainable parameters it gathered itself; FSDP2's forward
    hooks would swap in their own (and cannot run under ``vmap``). The
    module's hook tables are replaced by copies without FSDP2's entries, and
    each frozen sharded parameter (which the loss reads from the model) by
    its whole tensor, gathered on entering (collective); all are put back,
    the same objects, on exit.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.hooks = _fsdp_hook_ids(model)
        self.saved: list[tuple[torch.nn.Module, Any, Any]] = []
        self.frozen: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []

    def __enter__(self) -> None:
        from torch.distributed.tensor import DTensor

        if self.saved or self.frozen:
            raise RuntimeError("fsdp_hooks_off is already active; enter a new one instead")
        sharded_frozen = [
            (module, name, p)
            for module in self.model.modules()
            for name, p in module._parameters.items()
            if p is not None and not p.requires_grad and isinstance(p, DTensor)
        ]
        whole: dict[int, torch.nn.Parameter] = {}
        for _, _, p in sharded_frozen:  # every rank in module order: the same collectives
            if id(p) not in whole:  # a tied parameter is gathered once
                whole[id(p)] = torch.nn.Parameter(p.full_tensor(), requires_grad=False)
        for module, name, p in sharded_frozen:
            module._parameters[name] = whole[id(p)]
            self.frozen.append((module, name, p))
        for module, pre, post in self.hooks:
            self.saved.append((module, module._forward_pre_hooks, module._forward_hooks))
            module._forward_pre_hooks = type(module._forward_pre_hooks)(
                (k, v) for k, v in module._forward_pre_hooks.items() if k != pre
            )
            module._forward_hooks = type(module._forward_hooks)(
                (k, v) for k, v in module._forward_hooks.items() if k != post
            )

    def __exit__(self, *exc: Any) -> None:
        for module, pre_hooks, hooks in self.saved:
            module._forward_pre_hooks, module._forward_hooks = pre_hooks, hooks
        for module, name, p in self.frozen:
            module._parameters[name] = p
        self.saved.clear()
        self.frozen.clear()
