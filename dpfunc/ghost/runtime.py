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

from typing import Any

import torch
from torch import Tensor
from torch.func import grad, grad_and_value

from ..clipping import (
    Clipped,
    ClippingPolicy,
    norms_from_squares,
    rounding_scope,
    weights_by_parameter,
)
from ..losses import check_losses
from ..per_sample import batch_size, vmap_over_examples
from ..tree import Params, PyTree, tree_map
from ..users import UserGroups
from .bounds import (
    combine,
    form_norms,
    form_sum,
    formed_norms,
    formed_where_cheaper,
    group,
    weighted_sum,
    widen_form,
)
from .hooks import GhostHooks, attribute, install_hooks, module_input, parameters, remove_hooks
from .planner import GhostModule, GhostPlan
from .registry import Rule

# the hooks live in dpfunc.ghost.hooks; their names stay importable from here
__all__ = ["GhostHooks", "ghost_clip", "install_hooks", "remove_hooks"]


def _probes(m: GhostModule, device: torch.device) -> tuple:
    """Zeros added to each call's output (for a recurrent module: to every gate)."""
    return tuple(
        {site: torch.zeros(s, dtype=m.dtype, device=device) for site, s in shape}
        if shape and isinstance(shape[0], tuple)  # (site, shape) pairs
        else torch.zeros(shape, dtype=m.dtype, device=device)
        for shape in m.probes
    )


class _Run:
    """Hook context of the ghost pass: adds the probes, records the inputs."""

    def __init__(self, probes: dict[str, tuple], rules: dict[str, Rule], batched: bool = False):
        self.probes = probes
        self.rules = rules
        self.batched = batched  # the batched pass: probes are [B, ...], outputs may broadcast
        self.inputs: dict[str, list] = {}
        self.forward_done = False  # later calls are activation checkpointing's recomputation
        self.without_grad: list[str] = []  # calls that ran with autograd off

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
        x = module_input(args, kwargs)
        if self.forward_done:  # activation checkpointing recomputes the call in the backward
            return self._recomputed(path, x, output)
        if not torch.is_grad_enabled():  # inside the model's own no_grad (reentrant checkpoint)
            self.without_grad.append(path)
        probe = probes[self._next_call(path)]
        shared = self.batched and output.shape[0] == 1 and output.shape[1:] == probe.shape[1:]
        if shared:
            # one output shared by the whole batch (position embeddings of position ids
            # [1, T]): each example's copy gets its own probe, and its own copy of the input
            output = output.expand(probe.shape)
            if isinstance(x, Tensor) and x.dim() and x.shape[0] == 1:
                x = x.expand(probe.shape[0], *x.shape[1:])
        if output.shape != probe.shape:
            raise RuntimeError(
                f"dpfunc ghost clipping: module {path!r} returned shape {tuple(output.shape)} "
                f"{'for the batch' if self.batched else 'per example'}, but the plan was made "
                f"for {tuple(probe.shape)}"
            )
        self.inputs[path].append(x)
        return output + probe

    def _recomputed(self, path: str, x: Any, output: Tensor) -> Tensor:
        """The call again, as activation checkpointing recomputes it: the same probe added.

        The gradient flows through the forward's own graph; the recomputation
        only refills the tensors it saved, so it must run the same operations
        (``output + probe``) and record nothing. The call is the one whose
        recorded input equals ``x`` (the recomputation replays the forward
        exactly, dropout included); calls with equal inputs give the same
        per-example gradient in either order.
        """
        calls = self.inputs.get(path, [])
        for k, seen in enumerate(calls):
            same = isinstance(seen, Tensor) and isinstance(x, Tensor) and seen.shape == x.shape
            if same and torch.equal(seen, x):
                return output + self.probes[path][k]
        raise RuntimeError(
            f"dpfunc ghost clipping: module {path!r} was recomputed (activation checkpointing) "
            "with an input that none of its calls in the forward had; use method='vmap' "
            "without checkpointing for this model"
        )

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


def batched_pass(loss_fn, hooks: GhostHooks, plan: GhostPlan, params: Params, batch: PyTree):
    """The probes' gradients, the losses and the recorded inputs of a batched loss's pass.

    ``loss_fn.batched(params, batch)`` runs once on the whole batch with a probe
    ``[B, *shape[1:]]`` on every planned call (``shape``, one example's output in
    the plan, starts with the batch of one that the one-example form adds), and
    ``grad`` of the sum of the losses gives each call's output gradient: row ``i``
    is example ``i``'s own, since its loss reads only example ``i``
    (:func:`dpfunc.ghost.batched.batched_plan` checked that). Inputs and output
    gradients come back with an axis of 1 after the examples' axis, the layout the
    vmap pass gives the rules. Returns ``((out_grads, {}), losses[B], inputs)``.
    """
    rows = batch_size(batch)
    device = next(iter(params.values())).device
    eager = not torch.compiler.is_compiling()

    def probe(m: GhostModule, shape: tuple) -> Tensor:
        shape = (rows, *shape[1:])
        if eager:  # a zero of stride 0: nothing to fill; its gradient comes back dense
            return torch.zeros((), dtype=m.dtype, device=device).expand(shape).requires_grad_()
        return torch.zeros(shape, dtype=m.dtype, device=device)

    probes = {m.path: tuple(probe(m, s) for s in m.probes) for m in plan.modules}

    def total(probes):
        run = _Run(probes, hooks.rules, batched=True)
        hooks.ctx = run
        try:
            losses = loss_fn.batched(params, batch)
        finally:
            hooks.ctx = None
        check_losses(losses, rows)
        _check_all_ran(run, probes)
        return losses.sum(), (losses, run.inputs)

    if eager:  # plain autograd: no functorch wrapping of every operation
        # Activation checkpointing recomputes a block in the backward, after the loss's
        # functional_call has put the module's own parameters back: leaves that require
        # grad here, like those, make the forward save what the recomputation saves.
        # Only the probes' gradients are asked for; nothing accumulates into these leaves.
        leaves = {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in params.items()}
        run = _Run(probes, hooks.rules, batched=True)
        hooks.ctx = run  # through the backward too: activation checkpointing recomputes calls
        try:
            with torch.enable_grad():
                losses = loss_fn.batched(leaves, batch)
                check_losses(losses, rows)
                _check_all_ran(run, probes)
                _check_grad_enabled(run)
                run.forward_done = True
                flat = [p for calls in probes.values() for p in calls]
                grads = iter(torch.autograd.grad(losses.sum(), flat, allow_unused=True))
        finally:
            hooks.ctx = None
        with torch.no_grad():
            out_grads = {
                path: tuple(_probe_gradient(p, g) for p, g in zip(calls, grads))
                for path, calls in probes.items()
            }
        losses = losses.detach()
        inputs = tree_map(lambda t: t.detach(), run.inputs)  # the graph is no longer needed
    else:
        out_grads, (losses, inputs) = grad(total, has_aux=True)(probes)
    example_axis = lambda tree: tree_map(lambda t: t.unsqueeze(1), tree)  # noqa: E731
    return (example_axis(out_grads), {}), losses.detach(), example_axis(inputs)


def _forms(
    hooks: GhostHooks, plan: GhostPlan, params: Params, covered: Params, inputs: dict,
    out_grads: dict,
) -> dict[str, Any]:  # fmt: skip
    """Each covered parameter's per-example form: its rules' forms at every call, joined."""
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
    return {name: combine(parts, params[name].shape) for name, parts in forms.items()}


def _probe_gradient(probe: Tensor, grad: Tensor | None) -> Tensor:
    """A probe's output gradient (zeros where the loss does not depend on the call)."""
    return (
        torch.zeros(probe.shape, dtype=probe.dtype, device=probe.device) if grad is None else grad
    )


def _check_grad_enabled(run: _Run) -> None:
    """Refuses planned calls that ran with autograd off inside the model.

    Reentrant activation checkpointing (``use_reentrant=True``, transformers 4.x's
    default) runs each block without a graph and backpropagates through its
    recomputation on its own, out of reach of the probes' gradients: those
    layers' per-example gradients would be lost without a word.
    """
    if run.without_grad:
        paths = sorted(set(run.without_grad))
        raise RuntimeError(
            f"dpfunc ghost clipping: modules {paths[:3]}{'...' if len(paths) > 3 else ''} ran "
            "with autograd off inside the model, as reentrant activation checkpointing "
            "(use_reentrant=True, transformers 4.x's default) or a torch.no_grad() block runs "
            "them; their per-example gradients cannot be taken. Checkpoint without reentrancy: "
            "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
            "{'use_reentrant': False}), or TrainingArguments(gradient_checkpointing_kwargs="
            "{'use_reentrant': False})"
        )


def _check_all_ran(run: _Run, probes: dict) -> None:
    short = [p for p in probes if len(run.inputs.get(p, ())) != len(probes[p])]
    if short:
        raise RuntimeError(
            f"dpfunc ghost clipping: modules {short} ran fewer times in this pass than in "
            "the analysis pass; use method='vmap' for this loss"
        )


def ghost_clip(
    loss_fn,
    hooks: GhostHooks,
    plan: GhostPlan,
    params: Params,
    batch: PyTree,
    mask: Tensor,
    *,
    clipping: ClippingPolicy | str,
    clip_norm: float | Tensor,
    chunk_size: int | None = None,
    rows: int | None = None,
    users: UserGroups | None = None,
) -> tuple[Params, Tensor, Clipped]:
    """The clipped sum of one micro-batch by ghost clipping and book-keeping.

    Args:
        loss_fn, params, batch: as for :func:`dpfunc.per_sample_grads`.
        hooks, plan: from :class:`dpfunc.ghost.GhostClipper` (``plan.modules``
            not empty).
        mask: ``Tensor[B]`` bool, ``False`` for padding rows.
        clipping: the :class:`dpfunc.clipping.ClippingPolicy` (or its mode,
            ``"flat"``, ``"normalized"`` or ``"per_layer"``), the one the
            vmap path applies: it turns the ghost norms into clip factors.
        clip_norm: ``C``, a float or adaptive clipping's 0-d tensor.
        chunk_size: passed to ``vmap``.
        rows: the physical (padded) rows of the micro-batch this batch was
            taken from, which the rounding bounds of the norms and the
            margin count; ``None``: ``B``. A caller that leaves padding rows
            out passes the padded count: no bound may depend on the number
            of real examples.
        users: user-level privacy (:mod:`dpfunc.users`): the rows are slots
            of ``users.size`` rows, and each user's forms are joined
            (:func:`dpfunc.ghost.bounds.group`) before the norms; the norms
            and the weights of the sum are the joined forms' times ``1 / n``,
            so the norms, factors, losses and ``clipped`` are per user ``[U]``.

    Returns:
        ``(summed, losses[B], clipped)``: ``summed`` equals
        ``clipped_sum(per_sample_grads(...), clipped.weights, groups=...)`` of
        the vmap path; it is float32 for bf16 and fp16 parameters
        (accumulated in float32), else in the parameters' dtype.
        ``clipped`` is the policy's :class:`~dpfunc.clipping.Clipped`, whose
        ``norm`` bounds the norm of each example's contribution to
        ``summed``, rounding included. A padding row or an example with a
        non-finite norm contributes exactly 0, even with NaN in its
        activations or gradients.
    """
    policy = clipping if isinstance(clipping, ClippingPolicy) else ClippingPolicy(clipping)
    covered_names = set(plan.covered)
    covered = {k: v for k, v in params.items() if k in covered_names}
    other = {k: v for k, v in params.items() if k not in covered_names}
    device = next(iter(params.values())).device
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
        _check_all_ran(run, probes)
        return loss, (loss, run.inputs)

    if plan.batched:  # the model run once on the whole batch (dpfunc.ghost.batched checked it)
        (out_grads, other_grads), losses, inputs = batched_pass(loss_fn, hooks, plan, params, batch)
    else:
        probes = {m.path: _probes(m, device) for m in plan.modules}
        per_example = vmap_over_examples(
            grad_and_value(example_loss, argnums=(0, 1), has_aux=True),
            in_dims=(None, None, None, 0),
            chunk_size=chunk_size,
        )
        (out_grads, other_grads), (_, (losses, inputs)) = per_example(probes, other, covered, batch)

    joined = _forms(hooks, plan, params, covered, inputs, out_grads)
    del inputs, out_grads  # the forms hold what is left of them
    rows = mask.shape[0] if rows is None else rows
    if users is not None:  # one form per user: its examples' joined, weighted by 1 / n
        joined = {name: group(form, users.rows, users.size) for name, form in joined.items()}
        other_grads = {name: users.join(g) for name, g in other_grads.items()}
        losses, mask, rows = users.mean(losses), users.mask, rows // users.size
    for name in joined:  # one at a time, so that each layer's rows go before the next forms
        joined[name] = formed_where_cheaper(joined[name], params[name].shape)
    formed = {name: f for name, f in joined.items() if isinstance(f, Tensor)} | other_grads
    squared = dict(zip(formed, formed_norms(list(formed.values()))))  # one host sync
    squared |= {name: form_norms(form, rows) for name, form in joined.items() if name not in formed}

    # the vmap path's norms, factors and margin (public: rows, dtypes, sizes); the margin
    # also covers the float64 additions of micro-batch sums that follow, and the bounds
    # above cover this sum's rounding
    groups = policy.groups(params)
    norms = norms_from_squares({n: squared[n] for n in names}, groups)
    if users is not None:  # a user's update is its sum times 1 / n
        norms = users.scaled(norms)
    clipped = policy(norms, clip_norm, mask.to(torch.bool), **rounding_scope(params, rows))
    weights = weights_by_parameter(clipped.weights, names, groups)
    if users is not None:
        weights = users.scaled(weights)

    # eagerly on a CPU, one check spares the NaN-safe masking of every form (form_sum); a
    # compiled step fuses that masking into the products, and on a GPU it costs less than
    # the synchronisation the check would
    finite = (
        device.type == "cpu"
        and not torch.compiler.is_compiling()
        and bool(torch.isfinite(torch.stack(list(squared.values()))).all())
    )
    summed = {name: form_sum(form, weights[name], params[name].shape, finite)
              for name, form in joined.items()}  # fmt: skip
    for name, g in other_grads.items():
        summed[name] = weighted_sum(g, weights[name], finite)
    summed = {k: summed[k] for k in names}
    return summed, losses, clipped
