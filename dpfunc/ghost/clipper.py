"""The ghost path of one step: its plans by batch structure, and ``method="auto"``'s choice.

:class:`GhostClipper` is what a step keeps: the model's hooks
(:mod:`~dpfunc.ghost.hooks`) and one :class:`~dpfunc.ghost.planner.GhostPlan`
per batch structure, made by the planner's analysis pass on the first batch
of that structure and a constant under ``torch.compile``. Eagerly,
``method="auto"`` also times the planned ghost pass (:mod:`~dpfunc.ghost.runtime`)
against plain vmap once and keeps the faster, unless every example's gradient
together is small (``SMALL_GRADIENTS``): then plain vmap is kept without the
timing, which would cost more than it could save. The fallbacks a plan makes are
warned about once per step.
"""

from __future__ import annotations

import sys
import time
import warnings
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves as _torch_tree_leaves

from ..checks import check_devices
from ..clipping import ClippingPolicy, clipped_sum, per_sample_norms
from ..per_sample import per_sample_grads_and_losses
from ..tree import Params, PyTree
from .hooks import install_hooks
from .planner import GhostPlan, analyse, matmul_precision
from .runtime import ghost_clip

__all__ = ["GhostClipper"]

MEASURED = "vmap: plain vmap measured faster for this batch shape (method='auto')"
SMALL_GRADIENTS = 2**22
"""Batch rows times trainable entries up to which eager ``method="auto"`` keeps plain vmap
untimed: materialising that many per-example gradient entries (16 MiB in float32) costs
less than the ghost pass's fixed costs and the timing's four extra passes. Measured on
CPU, 2 threads: the digits GroupNorm CNN (10,026 entries, batch 153: 1.5M) and Opacus'
MNIST SampleConvNet (26,010, batch 88: 2.3M) run their ghost pass 1.6x to 3x slower than
vmap, and the first step paid 0.2 to 0.6 s for the timing."""
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

    def __init__(self, model: nn.Module, loss_fn, method: str):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.loss_fn = loss_fn
        self.method = method
        self.hooks = install_hooks(model)
        self.plans: dict[Any, GhostPlan] = {}
        self.warned = False

    def plan(self, params: Params, batch: PyTree) -> GhostPlan:
        """The plan for this batch structure (computed once; a constant under compile)."""
        check_devices(params, batch)  # before the analysis pass, which would fail on it
        leaves: list = []
        try:
            skeleton = _skeleton(batch, leaves)
        except TypeError as error:
            return _plan_for(self, ("unsupported", str(error)), tuple(params))
        return _plan_for(self, skeleton, tuple(params), *params.values(), *leaves)


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
def _plan_for(clipper: GhostClipper, skeleton, names, *tensors) -> GhostPlan:
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
        try:
            plan = analyse(
                clipper.model,
                clipper.hooks,
                clipper.loss_fn,
                dict(zip(names, params)),
                example,
                clipper.method,
            )
        except Exception as error:  # the loss could not run under the analysis
            plan = _all_vmap(names, f"the analysis pass failed: {type(error).__name__}: {error}")
        if timed and plan.modules:
            params = dict(zip(names, params))
            plan = _faster_of(clipper, plan, params, _rebuild(skeleton, iter(leaves)))
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


def _all_vmap(names, why: str) -> GhostPlan:
    return GhostPlan((), (why,), tuple((n, f"vmap: {why}") for n in names))


def _faster_of(clipper: GhostClipper, plan: GhostPlan, params: Params, batch) -> GhostPlan:
    """``method="auto"`` eagerly: ``plan``, or plain vmap if that measured faster.

    The rules' cost models count arithmetic; on small models the ghost pass's
    fixed costs (hooks, a second backward) can dominate. So the first eager
    step of each batch shape times both ways to the clipped sum once, after
    one warm-up call each, on the real batch, and keeps the faster (vmap on
    a tie). Compiled steps keep the cost model: their times differ from eager
    ones. The global RNG state is restored, so the timing leaves dropout
    draws as they were. When the batch's per-example gradients hold at most
    ``SMALL_GRADIENTS`` entries in all, plain vmap is kept without timing
    (shapes only: public).
    """
    size = _torch_tree_leaves(batch)[0].shape[0]
    if size * sum(p.numel() for p in params.values()) <= SMALL_GRADIENTS:
        return GhostPlan((), (), tuple((n, SMALL) for n in params))
    device = next(iter(params.values())).device
    mask = torch.ones(size, dtype=torch.bool, device=device)

    policy = ClippingPolicy("flat")

    def ghost() -> None:
        ghost_clip(clipper.loss_fn, clipper.hooks, plan, params, batch, mask,
                   clipping=policy, clip_norm=1.0)  # fmt: skip

    def plain() -> None:
        grads, _ = per_sample_grads_and_losses(clipper.loss_fn, params, batch)
        clipped_sum(grads, policy(per_sample_norms(grads), 1.0, mask).weights)

    def seconds(run) -> float:
        run()  # warm-up: first-call costs are not what a step pays
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - started

    devices = [device.index] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        ghost_s, vmap_s = seconds(ghost), seconds(plain)
    if ghost_s < vmap_s:
        return plan
    return GhostPlan((), (), tuple((n, MEASURED) for n in params))
