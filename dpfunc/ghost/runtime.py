"""The ghost pass: hooks that probe every planned layer call, one vmap, the clipped sum.

Forward hooks on every module that has a rule (inactive unless a pass is
running) record each call's input ``x`` and return ``output + probe``, where
``probe`` is a zero tensor shaped like one example's output of that call.
``vmap(grad_and_value(loss, argnums=(probes, other_params)))`` then gives,
in one backward pass, the output gradient ``g`` of every planned call (the
gradient with respect to its probe) and ordinary per-example gradients of
every parameter left to vmap. The rules turn each call's ``(x, g)`` into
per-example gradient forms; the runtime joins the forms of a parameter used
at several sites, takes norms (rounding bounds included) and clip factors,
and sums. The norm and the sum come from the same forms, so the contribution
whose norm is bounded is exactly the one that is summed. Forms of half
precision (bf16, fp16) are widened to float32 before any product or sum
(:func:`dpfunc.ghost.bounds.widen_form`): the norms and the clipped sum
accumulate in float32, and the sum of half parameters is returned in float32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.func import grad_and_value

from ..clipping import clip_factors, groups_by_module, rounding_scope
from ..per_sample import vmap_over_examples
from ..tree import Params, PyTree
from . import dispatch
from .bounds import combine, form_norms, form_sum, formed_norms, weighted_sum, widen_form
from .registry import Rule, rule_for

if TYPE_CHECKING:
    from .planner import GhostModule, GhostPlan

__all__ = ["GhostHooks", "ghost_clip", "install_hooks", "remove_hooks"]


class GhostHooks:
    """The forward hooks dpfunc keeps on a model; inert while ``ctx`` is ``None``."""

    def __init__(self, model: nn.Module):
        self.ctx: Any = None
        self.modules: dict[str, nn.Module] = {}
        self.rules: dict[str, Rule] = {}
        self.handles = []
        self.ids: dict[str, int] = {}  # path -> id of dpfunc's hook on that module
        for path, module in model.named_modules():
            rule, _ = rule_for(module)
            if rule is None:
                continue
            self.modules[path] = module
            self.rules[path] = rule
            handle = module.register_forward_hook(
                ForwardHook(self, path), prepend=True, with_kwargs=True
            )
            self.handles.append(handle)
            self.ids[path] = handle.id
            if rule.unrolled:  # a fused kernel hides the gradients its rule needs
                dispatch.attach(module, self, path)


class ForwardHook:
    def __init__(self, hooks: GhostHooks, path: str):
        self.hooks = hooks
        self.path = path

    def __call__(self, module, args, kwargs, output):
        ctx = self.hooks.ctx
        if ctx is None:
            return None
        return ctx.after_forward(self.path, module, args, kwargs, output)


def install_hooks(model: nn.Module) -> GhostHooks:
    """Registers (once per model) the ghost hooks on every covered submodule."""
    hooks = model.__dict__.get("_dpfunc_ghost_hooks")
    if hooks is None:
        hooks = GhostHooks(model)
        model.__dict__["_dpfunc_ghost_hooks"] = hooks
    return hooks


def remove_hooks(model: nn.Module) -> None:
    """Removes dpfunc's ghost hooks from ``model`` (e.g. before ``torch.jit.script``).

    Steps built on ``model`` with ghost clipping must not be used afterwards.
    """
    hooks = model.__dict__.pop("_dpfunc_ghost_hooks", None)
    if hooks is not None:
        for handle in hooks.handles:
            handle.remove()
        for module in hooks.modules.values():
            dispatch.detach(module, hooks)


def module_input(args: tuple, kwargs: dict) -> Any:
    """A layer call's first input, positional or by keyword."""
    if args:
        return args[0]
    if "input" in kwargs:
        return kwargs["input"]
    return next(iter(kwargs.values()), None)


def _probes(m: GhostModule, device: torch.device) -> tuple:
    """Zeros added to each call's output (for a recurrent module: to every gate)."""
    return tuple(
        {site: torch.zeros(s, dtype=m.dtype, device=device) for site, s in shape}
        if shape and isinstance(shape[0], tuple)  # (site, shape) pairs
        else torch.zeros(shape, dtype=m.dtype, device=device)
        for shape in m.probes
    )


def attribute(module: nn.Module, dotted: str) -> Any:
    """``module.out_proj.weight`` for ``"out_proj.weight"``: whatever is bound there now."""
    for part in dotted.split("."):
        module = getattr(module, part, None)
    return module


def parameters(module: nn.Module, rule: Rule) -> list[str]:
    """The parameters a rule covers: the module's own, and submodules' it uses itself."""
    own = [attr for attr, p in module._parameters.items() if isinstance(p, Tensor)]
    return own + [attr for attr in rule.owns if isinstance(attribute(module, attr), Tensor)]


class _Run:
    """Hook context of the ghost pass: adds the probes, records the inputs."""

    def __init__(self, probes: dict[str, tuple], rules: dict[str, Rule]):
        self.probes = probes
        self.rules = rules
        self.inputs: dict[str, list] = {}

    def _next_call(self, path: str) -> int:
        calls = self.inputs.setdefault(path, [])
        if len(calls) == len(self.probes[path]):
            raise RuntimeError(
                f"dpfunc ghost clipping: module {path!r} ran more than the "
                f"{len(calls)} time(s) per example seen in the analysis pass; use "
                "method='vmap' for this loss"
            )
        return len(calls)

    def after_forward(self, path, module, args, kwargs, output):
        probes = self.probes.get(path)
        if probes is None or isinstance(probes[0], dict):  # dict: run_unrolled did the work
            return None
        probe = probes[self._next_call(path)]
        if output.shape != probe.shape:
            raise RuntimeError(
                f"dpfunc ghost clipping: module {path!r} returned shape {tuple(output.shape)} "
                f"per example, but the plan was made for {tuple(probe.shape)}"
            )
        self.inputs[path].append(module_input(args, kwargs))
        return output + probe

    def run_unrolled(self, path, module, args, kwargs):
        """A planned module that runs itself: its rule's forward, with a probe at every site."""
        probes = self.probes[path][self._next_call(path)]
        rule = self.rules[path]
        shapes = rule.probe_shapes(module, args, kwargs)
        planned = {site: tuple(p.shape) for site, p in probes.items()}
        if {site: tuple(s) for site, s in shapes.items()} != planned:
            raise RuntimeError(
                f"dpfunc ghost clipping: module {path!r} got per-example probe shapes "
                f"{shapes}, but the plan was made for {planned}"
            )
        record: dict[str, Tensor] = {}
        out = rule.run(module, probes, record, *args, **kwargs)
        self.inputs[path].append(record)
        return out


def ghost_clip(
    loss_fn,
    hooks: GhostHooks,
    plan: GhostPlan,
    params: Params,
    batch: PyTree,
    mask: Tensor,
    *,
    clipping: str,
    clip_norm: float | Tensor,
    chunk_size: int | None = None,
) -> tuple[Params, Tensor, Tensor, Tensor]:
    """The clipped sum of one micro-batch by ghost clipping and book-keeping.

    Args:
        loss_fn, params, batch: as for :func:`dpfunc.per_sample_grads`.
        hooks, plan: from :class:`dpfunc.ghost.GhostClipper` (``plan.modules``
            not empty).
        mask: ``Tensor[B]`` bool, ``False`` for padding rows.
        clipping: ``"flat"``, ``"normalized"`` or ``"per_layer"`` (groups
            by owning module, as :func:`dpfunc.groups_by_module`).
        clip_norm: ``C``.
        chunk_size: passed to ``vmap``.

    Returns:
        ``(summed, losses[B], norms[B] float64, scaled[B] bool)``: ``summed``
        equals ``clipped_sum(per_sample_grads(...), factors, mask)`` of the
        vmap path; it is float32 for bf16 and fp16 parameters (accumulated in
        float32), else in the parameters' dtype. ``norms`` bound the norm of
        each example's contribution to ``summed``, rounding included. A
        padding row or an example with a non-finite norm contributes exactly
        0, even with NaN in its activations or gradients.
    """
    covered_names = set(plan.covered)
    covered = {k: v for k, v in params.items() if k in covered_names}
    other = {k: v for k, v in params.items() if k not in covered_names}
    device = next(iter(params.values())).device
    probes = {m.path: _probes(m, device) for m in plan.modules}
    names = list(params)

    def example_loss(probes, other, covered, example):
        merged = {k: other[k] if k in other else covered[k] for k in names}
        run = _Run(probes, hooks.rules)
        hooks.ctx = run
        try:
            loss = loss_fn(merged, example)
        finally:
            hooks.ctx = None
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(
                "loss_fn must return one example's loss as a 0-d tensor, got "
                f"{shape}; loss_fn sees a single example without a batch dimension"
            )
        short = [p for p in probes if len(run.inputs.get(p, ())) != len(probes[p])]
        if short:
            raise RuntimeError(
                f"dpfunc ghost clipping: modules {short} ran fewer times in this pass than in "
                "the analysis pass; use method='vmap' for this loss"
            )
        return loss, (loss, run.inputs)

    per_example = vmap_over_examples(
        grad_and_value(example_loss, argnums=(0, 1), has_aux=True),
        in_dims=(None, None, None, 0),
        chunk_size=chunk_size,
    )
    (out_grads, other_grads), (_, (losses, inputs)) = per_example(probes, other, covered, batch)

    forms: dict[str, list] = {name: [] for name in covered}
    for m in plan.modules:
        module = hooks.modules[m.path]
        used = dict(m.bound)
        weights = {attr: params[used[attr]] if attr in used else attribute(module, attr)
                   for attr in parameters(module, hooks.rules[m.path])}  # fmt: skip
        for x, g in zip(inputs[m.path], out_grads[m.path]):
            got = hooks.rules[m.path].gradients(module, x, g, weights)
            for attr, name in m.attrs:
                if attr not in got:
                    raise RuntimeError(
                        f"dpfunc ghost clipping: the rule for {type(module).__name__} returned "
                        f"no gradient for {attr!r} (it returned {sorted(got)})"
                    )
                forms[name].append(widen_form(got[attr]))  # half: float32 from here on
    joined = {name: combine(parts, params[name].shape) for name, parts in forms.items()}
    squared = {name: form_norms(form) for name, form in joined.items()}
    for name, g in other_grads.items():
        squared[name] = formed_norms(g)

    mask = mask.to(torch.bool)
    # the vmap path's margin (public: rows, dtypes, sizes): it also covers the float64
    # additions of micro-batch sums that follow; the bounds above cover this sum's rounding
    margin = rounding_scope(params, mask.shape[0])
    if clipping == "per_layer":
        groups = groups_by_module(params)
        group_norms = {
            group: torch.stack([squared[n] for n in members]).sum(0).sqrt()
            for group, members in groups.items()
        }
        factors = clip_factors(group_norms, clip_norm, **margin)
        total = torch.stack([n.square() for n in group_norms.values()]).sum(0).sqrt()
        scaled = torch.stack([f < 1 for f in factors.values()]).any(0)
        weights = {
            n: torch.where(mask, factors[group], torch.zeros_like(factors[group]))
            for group, members in groups.items()
            for n in members
        }
    else:
        total = torch.stack([squared[n] for n in names]).sum(0).sqrt()
        factor = clip_factors(total, clip_norm, normalize=clipping == "normalized", **margin)
        scaled = factor < 1
        factor = torch.where(mask, factor, torch.zeros_like(factor))
        weights = dict.fromkeys(names, factor)

    summed = {name: form_sum(form, weights[name], params[name].shape)
              for name, form in joined.items()}  # fmt: skip
    for name, g in other_grads.items():
        summed[name] = weighted_sum(g, weights[name])
    summed = {k: summed[k] for k in names}
    return summed, losses, total, scaled
