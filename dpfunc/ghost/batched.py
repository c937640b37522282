"""Whether a batched loss's ghost pass may run the model on the whole batch.

A loss marked with :func:`dpfunc.batched_loss` returns one loss per example
for a whole batch; the ghost pass can then take every planned layer's
inputs and output gradients from one ordinary forward and backward
(:func:`dpfunc.ghost.runtime.batched_pass`) instead of a ``vmap`` over the
examples. That is exact only when two things hold, and
:func:`batched_plan` decides both once per batch structure, when the plan is
made (eagerly, also when a step is being compiled), before any step
releases anything:

* **Layout**: every planned layer keeps the examples on its first axis, so
  the rows of its inputs and output gradients are the examples. A plan with
  parameters left to vmap, a layer whose rule runs the layer itself
  (``nn.MultiheadAttention``, recurrent layers) or a layer that does not see
  a leading batch of one in the one-example form keeps the ``vmap`` pass,
  with a warning that says why: slower, and still exact.
* **Independence**: example ``i``'s loss reads example ``i`` alone. On the
  batch the plan is made from, with the model in eval mode (dropout off;
  BatchNorm is refused when the step is built), the batched pass's losses and per-example
  gradient norms must equal those of the ghost pass under ``vmap`` with the
  one-example loss (the batched loss on a batch of one), example by example,
  to float rounding. A mean over the
  batch, in-batch negatives or any other mixing changes them, and the step
  raises, naming the example and the likely causes. Then, in the mode the
  steps run in (a layer may mix the examples only while training), the
  batched losses with example 0 replaced by another must leave every other
  example's loss as it was. A batch of one row cannot show mixing, so it
  keeps the ``vmap`` pass.
"""

from __future__ import annotations

import dataclasses
import random
import warnings

import numpy as np
import optree
import torch
from torch import nn

from ..clipping import ClippingPolicy
from ..per_sample import batch_size
from ..tree import Params, PyTree
from .hooks import GhostHooks
from .planner import GhostPlan
from .runtime import ghost_clip

__all__ = ["batched_plan", "layout_problem"]

# relative agreement asked of the batched pass, by the dtype the model computes in: both passes
# carry the same rounding bounds and differ only in the order of float sums and in the
# blocking of their products (under 1e-5 in float32 on the tested models; under 2e-3 in bf16,
# autocast or bf16 parameters, on GPT-2 and Llama of widths 128 to 768, tests/test_bf16.py).
# A loss that mixes examples moves them by far more: a mean over the batch, or in-batch
# negatives, change a loss by its spread over the batch
TOLERANCE = {torch.float64: 1e-7, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def layout_problem(plan: GhostPlan, hooks: GhostHooks) -> str:
    """Why ``plan`` cannot run batched (``""``: it can); see the module docstring."""
    if plan.vmapped:
        names = ", ".join(name for name, _ in plan.vmapped)
        return f"parameters {names} get per-example gradients (vmap) in this plan"
    for m in plan.modules:
        module = hooks.modules[m.path]
        if hooks.rules[m.path].unrolled:
            return f"module {m.path!r} ({type(module).__name__}) runs itself in the ghost pass"
        for shape in m.probes:
            if not shape or shape[0] != 1:
                return (
                    f"module {m.path!r} ({type(module).__name__}) gives one example an output "
                    f"of shape {tuple(shape)}, not a batch of one in front"
                )
    return ""


def batched_plan(
    model: nn.Module, hooks: GhostHooks, plan: GhostPlan, loss_fn, params: Params, batch: PyTree
) -> GhostPlan:
    """``plan`` with ``batched=True`` where the batched pass is exact, else ``plan``.

    Raises:
        ValueError: the batched loss mixes the examples of ``batch``; the
            message names the example, both values and the causes.
    """
    why = layout_problem(plan, hooks)
    if why or batch_size(batch) < 2:
        if why:
            warnings.warn(
                f"dpfunc: the batched loss {loss_fn!r} runs one example at a time in the ghost "
                f"pass (vmap), since {why}; the result is the same, only slower",
                UserWarning,
                stacklevel=6,
            )
        return plan
    batched = dataclasses.replace(plan, batched=True)
    devices = sorted({t.device.index for t in params.values() if t.device.type == "cuda"})
    training = {m: m.training for m in model.modules()}
    try:
        model.eval()  # dropout off: both passes must see the same function
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            _compare(loss_fn, model, hooks, batched, params, batch)
    finally:
        for module, mode in training.items():
            module.training = mode
    rtol = TOLERANCE.get(compute_dtype(batched, params, model), TOLERANCE[torch.bfloat16])
    _check_training_mode(loss_fn, model, params, batch, devices, rtol)
    return batched


def _check_training_mode(
    loss_fn, model: nn.Module, params: Params, batch: PyTree, devices: list, rtol: float
) -> None:
    """Raises if, in the mode the steps run in, one example's rows move another's loss.

    The comparison above runs in eval mode, where a layer that mixes the examples
    only while training (batch statistics written by hand, not an ``nn`` BatchNorm)
    does nothing. Here the batched loss runs twice in the model's own mode, with the
    generators at the same state (the same dropout masks: the two batches have one
    shape): on the batch, and on the batch with row 0 replaced by the first row
    that differs from it. Every other example's loss must stay as it was.
    """
    rows = batch_size(batch)
    leaves = [t for t in optree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
    batched = [t for t in leaves if t.dim() and t.shape[0] == rows]
    other = next((j for j in range(1, rows) if any(not torch.equal(t[0], t[j]) for t in batched)),
                 None)  # fmt: skip
    if other is None or not any(m.training for m in model.modules()):
        return  # every row alike (nothing can show), or no module trains: eval mode was checked

    states = random.getstate(), np.random.get_state()

    def losses(rows_of: PyTree) -> torch.Tensor:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(0)  # the same draws in every pass; none of them leaves the check
            random.setstate(states[0])  # Python's and numpy's global generators too
            np.random.set_state(states[1])
            try:
                return loss_fn.batched(params, rows_of).detach().double()
            finally:
                random.setstate(states[0])
                np.random.set_state(states[1])

    replaced = optree.tree_map(
        lambda t: torch.cat([t[other : other + 1], t[1:]])
        if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == rows else t,
        batch,
    )  # fmt: skip
    before = losses(batch)
    if bool(_differ(losses(batch)[1:], before[1:], rtol).any()):
        warnings.warn(
            f"dpfunc: the batched loss {loss_fn!r} draws random numbers from a generator "
            "of its own (a torch.Generator or numpy Generator it keeps, not the global ones), "
            "so whether it mixes the examples only in "
            "training mode could not be checked (the eval-mode check passed). A layer that "
            "uses batch statistics while training would void the clip bound",
            UserWarning,
            stacklevel=6,
        )
        return
    after = losses(replaced)
    off = _differ(after[1:], before[1:], rtol)
    if bool(off.any()):
        i = int(off.nonzero()[0]) + 1
        raise ValueError(
            f"the batched loss {loss_fn!r} mixes the examples of a batch in training mode: "
            f"replacing example 0 by another moves example {i}'s loss from "
            f"{float(before[i]):.6g} to {float(after[i]):.6g} ({int(off.sum())} of "
            f"{rows - 1} examples moved), while in eval mode each loss reads its own "
            "example. A layer that uses batch statistics while training (a normalisation "
            "over the batch written by hand, a running mean, an nn BatchNorm hidden in a "
            "custom module) mixes the examples: no per-example gradient exists. Normalise "
            "over each example's own features (LayerNorm, GroupNorm) instead"
        )


def compute_dtype(plan: GhostPlan, params: Params, model: nn.Module | None = None) -> torch.dtype:
    """The least precise dtype the model computes in: its layers' outputs' or its parameters'.

    Under ``torch.autocast`` a float32 model's linear layers compute in bf16 (their
    outputs, the probes' dtype, say so); float32 adapters on a bf16 model (PEFT's
    default) compute the rest of the model in bf16 (the frozen parameters say so).
    """
    tensors = list(params.values()) + ([] if model is None else list(model.parameters()))
    dtypes = [t.dtype for t in tensors if t.is_floating_point()] + [m.dtype for m in plan.modules]
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def mixed_precision(plan: GhostPlan, params: Params) -> bool:
    """Whether planned layers compute in a less precise dtype than the parameters (autocast).

    ``method="auto"`` then keeps a batched ghost plan, untimed: under autocast the
    vmap path fails in torch 2.13 (``LayerNorm``'s backward batching rule meets a
    bf16 gradient for its float32 input: "expected scalar type BFloat16 but found
    Float"), while the batched pass runs the model as it is. The autocast may be
    entered inside the model's forward (accelerate wraps it so for
    ``transformers.Trainer``'s ``bf16=True``), where only the layers' outputs show it.
    """
    widest = min((t.dtype for t in params.values()), key=lambda d: torch.finfo(d).eps)
    return compute_dtype(plan, params) != widest


def _compare(
    loss_fn, model: nn.Module, hooks: GhostHooks, plan: GhostPlan, params: Params, batch: PyTree
) -> None:
    rows = batch_size(batch)
    device = next(iter(params.values())).device
    mask = torch.ones(rows, dtype=torch.bool, device=device)
    policy = ClippingPolicy("flat")
    _, losses, clipped = ghost_clip(
        loss_fn, hooks, plan, params, batch, mask, clipping=policy, clip_norm=1.0
    )
    # the vmap pass of the same plan: the same rules and rounding bounds, each example's
    # output gradients from its own loss alone
    one = dataclasses.replace(plan, batched=False)
    _, alone, by_one = ghost_clip(
        loss_fn, hooks, one, params, batch, mask, clipping=policy, clip_norm=1.0
    )
    norms = by_one.norm
    dtype = compute_dtype(plan, params, model)
    rtol = TOLERANCE.get(dtype, TOLERANCE[torch.bfloat16])
    for what, got, want in (("loss", losses, alone), ("gradient norm", clipped.norm, norms)):
        got, want = got.detach().double(), want.detach().double()
        # a floor of a few units in the last place of 1: a gradient that cancels to 0 in both
        # (each loss minus itself, say) differs only by rounding
        finite = want[torch.isfinite(want)]
        floor = (rtol * 1e-3 * float(finite.abs().max()) if finite.numel() else 0.0) + 16 * (
            torch.finfo(dtype).eps
        )
        off = (got - want).abs() > rtol * want.abs() + floor
        off |= torch.isfinite(got) != torch.isfinite(want)
        if bool(off.any()):
            _check_deterministic(loss_fn, hooks, plan, params, batch, mask, losses, rtol)
            i = int(off.nonzero()[0])
            raise ValueError(
                f"the batched loss {loss_fn!r} mixes the examples of a batch: example {i}'s "
                f"{what} is {float(got[i]):.6g} in the batch and {float(want[i]):.6g} alone "
                f"({int(off.sum())} of {rows} examples differ). Each example's loss must read "
                "that example only: no mean or sum over the batch (return the unreduced "
                "losses, e.g. reduction='none' or dpfunc.losses' helpers), no in-batch "
                "negatives or other terms across examples, no layer that mixes examples. "
                "A one-example loss (without dpfunc.batched_loss) cannot mix them"
            )


def _differ(got: torch.Tensor, want: torch.Tensor, rtol: float) -> torch.Tensor:
    """Where ``got`` is off ``want`` by more than rounding (a change of finiteness counts)."""
    finite = want[torch.isfinite(want)]
    floor = rtol * 1e-3 * float(finite.abs().max()) if finite.numel() else 0.0
    off = (got - want).abs() > rtol * want.abs() + floor
    return off | (torch.isfinite(got) != torch.isfinite(want))


def _check_deterministic(loss_fn, hooks, plan, params, batch, mask, losses, rtol) -> None:
    """Raises if a second batched pass, with the generators moved on, gives other losses.

    A loss that draws random numbers (an augmentation, noise) differs between
    the batched and the one-example pass for that reason alone, and the
    comparison cannot tell it from mixing.
    """
    policy = ClippingPolicy("flat")
    _, again, _ = ghost_clip(
        loss_fn, hooks, plan, params, batch, mask, clipping=policy, clip_norm=1.0
    )
    again, losses = again.detach().double(), losses.detach().double()
    if bool(_differ(again, losses, rtol).any()):
        raise ValueError(
            f"the batched loss {loss_fn!r} draws random numbers (a per-example augmentation "
            "or noise inside the loss: two calls on the same batch give other losses), so "
            "the check that each example's loss reads that example only cannot run: the "
            "batched and the one-example passes draw differently. Augment in the dataset "
            "instead (a Dataset whose __getitem__ transforms the item, or a random collator "
            "with dpfunc.datasets.Collated: read afresh at every step), or use a "
            "one-example loss_fn (without dpfunc.batched_loss), whose vmap draws each "
            "example's randomness on its own"
        )
