"""The ghost path of one step: its plans by batch structure, and ``method="auto"``'s choice.

:class:`GhostClipper` is what a step keeps: the model's hooks
(:mod:`~dpfunc.ghost.hooks`) and one :class:`~dpfunc.ghost.planner.GhostPlan`
per batch structure, made by the planner's analysis pass on the first batch
of that structure and a constant under ``torch.compile``. Eagerly,
``method="auto"`` then chooses between the planned ghost pass
(:mod:`~dpfunc.ghost.runtime`) and plain vmap: from a cost model of shapes
where it is decisive (a ``memory_budget`` that vmap's per-example gradients
exceed: ghost; every example's gradient together small, ``SMALL_GRADIENTS``:
vmap; a model of dense ``Linear`` layers with one position per example:
ghost), and otherwise from ``TIMED_RUNS`` alternating timings of each, by
their minima. The fallbacks a plan makes are warned about once per step.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves as _torch_tree_leaves

from .. import memory
from .._activation_checkpointing import activation_checkpointing
from .._checks import check_devices, check_per_example
from ..clipping import ClippingPolicy, clipped_sum, per_sample_norms
from ..losses import BatchedLoss
from ..per_sample import per_sample_grads_and_losses
from ..tree import Params, PyTree
from .batched import batched_plan, mixed_precision
from .hooks import install_hooks
from .planner import GhostPlan, analyse, matmul_precision
from .runtime import ghost_clip

__all__ = ["GhostClipper"]

TIMED_RUNS = 3
"""Timed calls of each path, after one warm-up each, where the cost model is not decisive."""
MEASURED = (
    "vmap: plain vmap measured faster for this batch shape (the fastest of "
    f"{TIMED_RUNS} calls of each, method='auto')"
)
SMALL_GRADIENTS = 2**22
"""Batch rows times trainable entries up to which eager ``method="auto"`` keeps plain vmap
untimed: materialising that many per-example gradient entries (16 MiB in float32) costs
less than the ghost pass's fixed costs and the timing's extra passes. Measured on
CPU, 2 threads: the digits GroupNorm CNN (10,026 entries, batch 153: 1.5M) and Opacus'
MNIST SampleConvNet (26,010, batch 88: 2.3M) run their ghost pass 1.6x to 3x slower than
vmap, and the first step paid 0.2 to 0.6 s for the timing. No count of entries above it
makes ghost clipping decisive by itself: eagerly, the bench's transformer (batch 128, 48M
entries) and digits CNN (batch 4096, 39M) still ran vmap 1.6x to 1.7x faster, while the
CNN (batch 256, 15M) ran ghost 2.9x faster; the rules' arithmetic does not see the
ghost pass's fixed costs, so those cases are timed."""
SMALL = (
    "vmap: every example's gradient together is small (batch x parameters <= "
    "SMALL_GRADIENTS), plain vmap kept untimed (method='auto')"
)


# batch skeletons: the structure of a batch without its tensors, so that the plan
# can be a compile-time constant


def _skeleton(tree: PyTree, leaves: list) -> Any:
    if isinstance(tree, Tensor):
        leaves.append(tree)
        return None
    if isinstance(tree, dict):
        return (dict, tuple((k, _skeleton(v, leaves)) for k, v in tree.items()))
    if isinstance(tree, (tuple, list)):
        return (type(tree), tuple(_skeleton(v, leaves) for v in tree))
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return ("const", tree)
    raise TypeError(f"ghost clipping supports batches of tuples, lists and dicts, got {tree!r}")


def _rebuild(skeleton: Any, leaves) -> PyTree:
    if skeleton is None:
        return next(leaves)
    kind, body = skeleton
    if kind == "const":
        return body
    if kind is dict:
        return {k: _rebuild(v, leaves) for k, v in body}
    children = [_rebuild(v, leaves) for v in body]
    if kind in (tuple, list):
        return kind(children)
    return kind(*children)  # a NamedTuple


class GhostClipper:
    """Per-step state of the ghost path: the hooks, the plans by batch structure, warnings."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn,
        method: str,
        *,
        memory_budget: int | None = None,
        vmap_sum: Callable[[Params, PyTree, Tensor], Any] | None = None,
    ):
        """``memory_budget``: as for :func:`dpfunc.make_train_step` (bytes or ``None``);
        ``vmap_sum(params, batch, mask)``: the step's own vmap path, which ``method="auto"``
        times (``None``: plain unchunked vmap)."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(loss_fn, BatchedLoss):  # BatchNorm mixes the examples of a batch
            check_per_example(model)
        self.model = model
        self.loss_fn = loss_fn
        self.method = method
        self.memory_budget = memory.check_memory_budget(memory_budget)
        self.vmap_sum = vmap_sum
        self.hooks = install_hooks(model)
        self.plans: dict[Any, GhostPlan] = {}
        self.warned = False

    def plan(self, params: Params, batch: PyTree, rows: int | None = None) -> GhostPlan:
        """The plan for this batch structure (computed once; a constant under compile).

        ``rows``: the physical (padded) rows of the micro-batch ``batch`` was taken from,
        which eager ``method="auto"``'s cost model reads (``None``: ``batch``'s own rows).
        A step that leaves padding rows out passes it: the count of real examples is
        private and must not choose the path.
        """
        check_devices(params, batch)  # before the analysis pass, which would fail on it
        leaves: list = []
        try:
            skeleton = _skeleton(batch, leaves)
        except TypeError as error:
            return _plan_for(self, ("unsupported", str(error)), tuple(params), None)
        if torch.compiler.is_compiling():
            rows = None  # the compiled plan does not read it (no cost model, no timing)
        return _plan_for(self, skeleton, tuple(params), rows, *params.values(), *leaves)


def _assume_constant_result(fn):
    """``torch.compiler.assume_constant_result(fn)``, without importing Dynamo to apply it.

    Importing ``torch._dynamo`` costs about 0.9 s, a third of ``import dpfunc``, and an eager
    run never needs it. The decorator only marks ``fn`` (the attribute Dynamo reads when it
    traces a call); it is applied through Dynamo when Dynamo is loaded, and otherwise the
    same mark is set here (tests/test_ghost.py checks that they agree).
    """
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def _plan_for(clipper: GhostClipper, skeleton, names, rows, *tensors) -> GhostPlan:
    # Runs eagerly, also when the step is being compiled: Dynamo calls it with the
    # real tensors and bakes the returned plan into the graph as a constant. The
    # cache key is computed here, from those real tensors, because under automatic
    # dynamic shapes (a second model or batch size in one process) the traced
    # shapes are symbolic and cannot be passed in as constants. A plan baked into
    # a graph that is later reused for other per-example shapes is caught by the
    # shape check in the runtime's hooks.
    timed = clipper.method == "auto" and not torch.compiler.is_compiling()
    if isinstance(skeleton, tuple) and skeleton[0] == "unsupported":
        key = skeleton
    else:
        params, leaves = tensors[: len(names)], tensors[len(names) :]
        key = (
            tuple((k, tuple(v.shape), v.dtype) for k, v in zip(names, params)),
            skeleton,
            tuple((tuple(x.shape[1:]), x.dtype) for x in leaves),
            timed,
            matmul_precision(),  # eagerly, a plan made before TF32 was turned on is not reused
        )
    plan = clipper.plans.get(key)
    if plan is not None:
        return plan
    if key[0] == "unsupported":
        plan = _all_vmap(names, key[1])
    else:
        example = _rebuild(skeleton, iter(t[0] for t in leaves))
        batch = _rebuild(skeleton, iter(leaves))
        plan = _analysed_plan(clipper, dict(zip(names, params)), example, batch)
        if plan.batched and (
            mixed_precision(plan, dict(zip(names, params)))
            or activation_checkpointing(clipper.model)
        ):
            pass  # autocast, checkpointing: the vmap path fails there, the batched pass runs
        elif plan.batched and clipper.method == "auto" and not timed:  # compiled: shapes only
            rows = _torch_tree_leaves(batch)[0].shape[0]
            plan = _cost_model(clipper, plan, dict(zip(names, params)), rows) or plan
        elif timed and plan.modules:
            params = dict(zip(names, params))
            plan = _faster_of(clipper, plan, params, batch, rows)
    clipper.plans[key] = plan
    if plan.reasons and not clipper.warned:
        clipper.warned = True
        scope = (
            "the whole step uses per-example gradients (vmap)"
            if not plan.modules
            else "these parameters get per-example gradients (vmap), the rest ghost clipping"
        )
        warnings.warn(
            f"dpfunc ghost clipping (method={clipper.method!r}): {scope}: "
            + "; ".join(plan.reasons)
            + ". step.explain(params, batch) (a Trainer's: trainer.step_fn.explain) lists "
            "every parameter's path.",
            UserWarning,
            stacklevel=4,
        )
    return plan


def _analysed_plan(clipper: GhostClipper, params: Params, example, batch) -> GhostPlan:
    """The analysis pass's plan. A batched loss's ghosts every layer it can (a layer left
    to vmap would cost the batch a vmap pass) and runs batched where that is exact
    (:func:`~dpfunc.ghost.batched.batched_plan`); where it cannot, ``method="auto"``
    plans again by the layers' costs. ``method="auto"`` then chooses between this plan
    and plain vmap as for a one-example loss: eagerly by the cost model and timings,
    compiled by the cost model (:func:`_cost_model`)."""
    if not isinstance(clipper.loss_fn, BatchedLoss):
        return _analysed(clipper, params, example, clipper.method)
    plan = _analysed(clipper, params, example, "ghost")
    if plan.modules:
        plan = batched_plan(clipper.model, clipper.hooks, plan, clipper.loss_fn, params, batch)
    if not plan.batched and clipper.method == "auto":
        plan = _analysed(clipper, params, example, "auto")
    return plan


def _analysed(clipper: GhostClipper, params: Params, example, method: str) -> GhostPlan:
    """:func:`~dpfunc.ghost.planner.analyse`, or plain vmap where the analysis pass fails."""
    try:
        return analyse(clipper.model, clipper.hooks, clipper.loss_fn, params, example, method)
    except Exception as error:  # the loss could not run under the analysis
        own = _own_failure(clipper.loss_fn, params, example)
        if own is not None:  # nor without it: the loss's own error, which the step explains
            raise own from None
        return _all_vmap(list(params), f"the analysis pass failed: {type(error).__name__}: {error}")


def _own_failure(loss_fn, params: Params, example) -> Exception | None:
    """The error ``loss_fn(params, example)`` raises plainly (no hooks, no tracking), if any.

    An analysis pass that fails where the plain loss fails too says nothing about
    ghost clipping: the loss cannot run on this example at all (data of the wrong
    dtype, a label out of range), and a warning about falling back to vmap would
    only precede the same error from the vmap path. Global RNG state is restored.
    """
    devices = sorted({t.device.index for t in params.values() if t.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices):
            loss_fn({k: v.detach() for k, v in params.items()}, example)
    except Exception as error:
        return error
    return None


def _all_vmap(names, why: str) -> GhostPlan:
    return GhostPlan((), (why,), tuple((n, f"vmap: {why}") for n in names))


def _faster_of(
    clipper: GhostClipper, plan: GhostPlan, params: Params, batch, rows: int | None = None
) -> GhostPlan:
    """``method="auto"`` eagerly: ``plan``, or plain vmap; the cost model first, then timings.

    The cost model (:func:`_cost_model`, shapes only: public) decides where it
    is decisive. Otherwise the first eager step of each batch shape times both
    ways to the clipped sum on the real batch: one warm-up call each, then
    ``TIMED_RUNS`` calls of each, alternately, and keeps the one whose fastest
    call is faster (vmap on a tie). Load on the machine only ever slows a call,
    so the minimum is the statistic it disturbs least, and alternating spreads
    a burst of load over both. The vmap side is timed as the step runs it
    (chunked where a ``memory_budget`` asks). Compiled steps keep the rules'
    cost models: their times differ from eager ones. The global RNG state is
    restored, so the timing leaves dropout draws as they were.
    """
    size = _torch_tree_leaves(batch)[0].shape[0]
    decided = _cost_model(clipper, plan, params, size if rows is None else rows)
    if decided is not None:
        return decided
    device = next(iter(params.values())).device
    mask = torch.ones(size, dtype=torch.bool, device=device)
    policy = ClippingPolicy("flat")

    def ghost() -> None:
        ghost_clip(clipper.loss_fn, clipper.hooks, plan, params, batch, mask,
                   clipping=policy, clip_norm=1.0)  # fmt: skip

    def plain() -> None:
        if clipper.vmap_sum is not None:
            clipper.vmap_sum(params, batch, mask)
            return
        grads, _ = per_sample_grads_and_losses(clipper.loss_fn, params, batch)
        clipped_sum(grads, policy(per_sample_norms(grads), 1.0, mask).weights)

    def seconds(run) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - started

    devices = [device.index] if device.type == "cuda" else []
    ghost_s, vmap_s = [], []
    with torch.random.fork_rng(devices=devices):
        ghost(), plain()  # warm-up: first-call costs are not what a step pays
        for _ in range(TIMED_RUNS):
            ghost_s.append(seconds(ghost))
            vmap_s.append(seconds(plain))
    if min(ghost_s) < min(vmap_s):
        return plan
    return GhostPlan((), (), tuple((n, MEASURED) for n in params))


def _cost_model(clipper: GhostClipper, plan: GhostPlan, params: Params, rows: int):
    """The eager ``auto`` choice from shapes alone where that is decisive; ``None`` otherwise.

    In order: (1) with a ``memory_budget`` that the vmap path's full-batch
    per-example gradients (:func:`dpfunc.memory.vmap_gradient_bytes`) exceed,
    ghost clipping, provided the gradients it still leaves to vmap fit the
    budget; (2) plain vmap when ``rows x trainable entries <=
    SMALL_GRADIENTS``; (3) ghost clipping when the plan covers every
    parameter and every ghosted layer is a ``Linear`` that sees one position
    per example (``DENSE``); otherwise ``None``: time both.
    """
    budget = clipper.memory_budget
    if budget is not None and memory.vmap_gradient_bytes(params, rows) > budget:
        left = {n: p for n, p in params.items() if n not in set(plan.covered)}
        if memory.vmap_gradient_bytes(left, rows) <= budget:
            return plan
    if rows * memory.gradient_entries(params) <= SMALL_GRADIENTS:
        return GhostPlan((), (), tuple((n, SMALL) for n in params))
    if len(plan.covered) == len(params) and all(
        type(clipper.hooks.modules[m.path]) is nn.Linear
        and all(math.prod(shape[:-1]) == 1 for shape in m.probes)
        for m in plan.modules
    ):
        return plan
    return None
