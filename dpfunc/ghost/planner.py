"""The planner: which parameters the ghost pass handles for a batch structure, and why not.

An analysis pass runs the loss on one real example, eagerly, with pre- and
post-forward hooks on every module that has a rule and a
``TorchFunctionMode`` that records every use of every trainable parameter.
A parameter is ghosted only if every use of it is a call of a module with a
rule, through that module's own attribute (a module called twice, or tied
input and output embeddings, give several sites whose forms the runtime
joins), and each of those calls is clean: outside any nested ``torch.func``
transform, with no foreign forward hook before dpfunc's, a tensor input not
modified in place afterwards, and whatever the rule's own check asks.
Everything else gets per-example gradients from vmap in the same pass.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves as _torch_tree_leaves
from torch.utils._pytree import tree_map as _torch_tree_map

from ..clipping import accumulation_dtype
from ..tree import Params, PyTree
from .hooks import ForwardHook, GhostHooks, attribute, module_input, parameters
from .registry import rule_for

__all__ = ["GhostModule", "GhostPlan", "analyse", "matmul_precision", "tf32_risk"]

COST_CHOICE = "vmap: cheaper than ghost clipping for this layer's shapes (method='auto')"


@dataclass(frozen=True)
class GhostModule:
    """One module the ghost path handles: its path, its parameters and its probes' shapes."""

    path: str
    attrs: tuple[tuple[str, str], ...]  # (attribute, parameter name), ghosted only
    bound: tuple[tuple[str, str], ...]  # (attribute, parameter name), every trainable one
    probes: tuple[Any, ...]  # per call: one example's output shape (recurrent: (site, shape)s)
    dtype: torch.dtype  # of the probes


@dataclass(frozen=True)
class GhostPlan:
    """Which modules the ghost path handles for one batch structure, and why not the rest."""

    modules: tuple[GhostModule, ...]
    reasons: tuple[str, ...]  # the fallbacks worth a warning, one line per module or owner
    vmapped: tuple[tuple[str, str], ...] = ()  # (parameter, "vmap: why")
    # a batched loss's ghost pass runs the model on the whole batch (dpfunc.ghost.batched)
    batched: bool = False
    covered: tuple[str, ...] = field(init=False)  # the parameters the rules handle

    def __post_init__(self):
        names = dict.fromkeys(name for m in self.modules for _, name in m.attrs)
        object.__setattr__(self, "covered", tuple(names))

    def explain(self, names) -> dict[str, str]:
        """``{name: "ghost" or "vmap: why"}`` for every parameter in ``names``."""
        why = dict(self.vmapped)
        covered = set(self.covered)
        return {
            n: "ghost" if n in covered else why.get(n, "vmap: not seen in the analysis pass")
            for n in names
        }


@dataclass
class _Call:
    bound: dict[str, str | None]  # attribute -> parameter name at call time
    nested: bool
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    x: Any = None
    version: int | None = None
    output: Any = None


class _Analysis:
    """Hook context of the analysis pass: what each covered module saw."""

    def __init__(self, params: Params, hooks: GhostHooks):
        self.hooks = hooks
        self.names = {id(t): name for name, t in params.items()}
        self.stack: list[str] = []
        self.calls: dict[str, list[_Call]] = defaultdict(list)
        self.uses: dict[str, set] = defaultdict(set)  # param name -> paths (None: outside)
        self.level = torch._C._functorch.maybe_current_level()  # transforms around the loss

    def before_forward(self, path, module, args, kwargs):
        self.stack.append(path)
        attrs = parameters(module, self.hooks.rules[path])
        bound = {attr: self.names.get(id(attribute(module, attr))) for attr in attrs}
        nested = torch._C._functorch.maybe_current_level() != self.level
        self.calls[path].append(_Call(bound, nested, args, kwargs))
        for a in _torch_tree_leaves((args, kwargs)):  # a parameter as an input: its gradient
            if isinstance(a, Tensor) and id(a) in self.names:  # also flows through the input
                self.uses[self.names[id(a)]].add(None)

    def after_forward(self, path, module, args, kwargs, output):
        if self.stack and self.stack[-1] == path:
            self.stack.pop()
        call = self.calls[path][-1]
        x = module_input(args, kwargs)
        # an inference tensor has no version counter, and outside inference mode (where
        # the analysis runs) it cannot be modified in place: nothing to track
        call.x = x if isinstance(x, Tensor) else None
        call.version = x._version if call.x is not None and not x.is_inference() else None
        call.output = output
        return None

    def use(self, tensor: Tensor) -> None:
        name = self.names.get(id(tensor))
        if name is not None:
            self.uses[name].add(self.stack[-1] if self.stack else None)


class _UseTracker(TorchFunctionMode):
    """Records every torch call that takes a trainable parameter and returns a tensor."""

    def __init__(self, analysis: _Analysis):
        super().__init__()
        self.analysis = analysis

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if any(isinstance(o, Tensor) for o in _torch_tree_leaves(out)):
            for a in _torch_tree_leaves((args, kwargs)):
                if isinstance(a, Tensor):
                    self.analysis.use(a)
        return out


def analyse(
    model: nn.Module,
    hooks: GhostHooks,
    loss_fn,
    params: Params,
    example: PyTree,
    method: str = "ghost",
) -> GhostPlan:
    """Runs ``loss_fn(params, example)`` once, eagerly, and decides what to ghost.

    ``method="auto"`` also leaves to vmap every parameter that a layer's
    rule says is cheaper materialised (its ``cheaper``); ``"ghost"`` ghosts
    every parameter it can. Global RNG state is restored afterwards.
    """
    params, example = _outside_inference(params, example)
    analysis = _record(loss_fn, hooks, params, example)

    # which calls are clean, module by module
    unclean: dict[str, str] = {}
    sites: dict[str, list[str]] = defaultdict(list)  # param name -> paths binding it
    costly: set[str] = set()
    for path, calls in analysis.calls.items():
        module = hooks.modules[path]
        why = _disqualify(module, calls, hooks.ids[path])
        if why:
            unclean[path] = why
            continue
        if method == "auto":
            rule = hooks.rules[path]
            if rule.cheaper is not None and not all(
                rule.cheaper(module, c.x, c.output) for c in calls
            ):
                costly.add(path)
        for name in dict.fromkeys(n for n in calls[0].bound.values() if n is not None):
            sites[name].append(path)

    vmapped: dict[str, str] = {}
    fallbacks: dict[str, list[str]] = defaultdict(list)  # warning line -> parameters
    for name in params:
        why, cost = _why_not(name, model, hooks, analysis, unclean, sites.get(name, [])), False
        if not why and costly & set(sites[name]):
            why, cost = COST_CHOICE, True
        if why:
            vmapped[name] = why if cost else f"vmap: {why}"
            if not cost:
                fallbacks[why].append(name)

    modules = []
    for path in hooks.modules:
        calls = analysis.calls.get(path)
        if not calls or path in unclean:
            continue
        attrs = tuple((a, n) for a, n in calls[0].bound.items() if n in params and n not in vmapped)
        if not attrs:
            continue
        module = hooks.modules[path]
        rule = hooks.rules[path]
        if rule.unrolled:
            shapes = tuple(
                tuple(rule.probe_shapes(module, c.args, c.kwargs).items()) for c in calls
            )
            out = calls[0].output  # a tuple (MultiheadAttention, recurrent) or a tensor
            dtype = (out[0] if isinstance(out, tuple) else out).dtype
        else:
            shapes = tuple(tuple(c.output.shape) for c in calls)
            dtype = calls[0].output.dtype
        bound = tuple((a, n) for a, n in calls[0].bound.items() if n in params)
        modules.append(GhostModule(path, attrs, bound, shapes, dtype))
    reasons = tuple(f"{why} (parameters {names})" for why, names in fallbacks.items())
    return GhostPlan(tuple(modules), reasons, tuple(vmapped.items()))


def _record(loss_fn: Any, hooks: GhostHooks, params: Params, example: PyTree) -> _Analysis:
    """Runs the loss once under the analysis: every hooked module's calls and every use."""
    analysis = _Analysis(params, hooks)
    pre_handles = [
        module.register_forward_pre_hook(
            lambda mod, args, kwargs, path=path: analysis.before_forward(path, mod, args, kwargs),
            with_kwargs=True,
        )
        for path, module in hooks.modules.items()
    ]
    devices = sorted({t.device.index for t in params.values() if t.device.type == "cuda"})
    try:  # outside a caller's inference mode: its tensors keep no version counters
        with (
            torch.random.fork_rng(devices=devices),
            torch.inference_mode(False),
            _UseTracker(analysis),
        ):
            hooks.ctx = analysis
            try:
                loss_fn(params, example)
            finally:
                hooks.ctx = None
    finally:
        for handle in pre_handles:
            handle.remove()
    return analysis


def _why_not(name, model, hooks, analysis, unclean, paths) -> str:
    """Why parameter ``name`` cannot be ghosted (``""`` when it can)."""
    uses = analysis.uses.get(name, set())
    if uses and set(paths) >= uses:
        return ""
    owner = name.rpartition(".")[0]
    try:
        owner_module = model.get_submodule(owner)
    except AttributeError:
        owner_module = None
    if owner in unclean:
        return f"{owner!r}: {unclean[owner]}"
    if owner in hooks.modules and owner not in analysis.calls:
        return f"{owner!r}: never called through its forward (its parameters are used otherwise)"
    if not uses:
        if owner_module is not None and owner not in hooks.modules:
            return f"{owner!r}: {rule_for(owner_module)[1]}"
        return "never used in the analysis pass"
    outside = uses - set(paths)
    for path in sorted(p for p in outside if p in unclean):
        return f"{path!r}: {unclean[path]}"
    if outside:
        if owner_module is not None and owner not in hooks.modules:
            return f"{owner!r}: {rule_for(owner_module)[1]}"
        where = sorted(repr(p) if p else "outside any covered module" for p in outside)
        return f"params[{name!r}] is also used {', '.join(where)}"
    return ""


def matmul_precision() -> tuple[str, str, str]:
    """The float32 matmul precision flags: torch's global one, CUDA's and oneDNN's (CPU)."""
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:  # torch refuses the legacy getter once a backend flag was set
        legacy = "mixed"
    # an older torch has no per-backend flags: its global one then rules oneDNN too
    fallback = "ieee" if legacy == "highest" else legacy
    cuda = getattr(torch.backends.cuda, "matmul", None)
    cpu = getattr(torch.backends.mkldnn, "matmul", None)
    return (
        legacy,
        getattr(cuda, "fp32_precision", "none"),
        getattr(cpu, "fp32_precision", fallback),
    )


def tf32_risk(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the ghost products (matmuls) may round float32 more coarsely than IEEE float32.

    The norm bounds of :func:`dpfunc.ghost.bounds.linear_weight_norms` assume
    IEEE rounding of ``dtype``; TF32 keeps 10 mantissa bits of float32's 23
    (bf16 7), so a cancelling example could pass the bound hundreds of times
    over. On CUDA, matmuls use TF32 when ``torch.get_float32_matmul_precision()``
    is not ``"highest"`` (``torch.backends.cuda.matmul.allow_tf32``); on a CPU
    with bf16 or AMX units, oneDNN may use bf16 or TF32 when its
    ``torch.backends.mkldnn.matmul.fp32_precision`` asks for it (``"medium"``
    sets bf16). Any such flag counts, whether or not this CPU has the units.
    The convolution rule sums through matmuls too, so cuDNN's own TF32 flag
    does not matter. ``dtype`` is the layer's output dtype: bf16 and fp16
    layers are at risk too, since their products run in float32
    (:func:`dpfunc.clipping.accumulation_dtype`).
    """
    if accumulation_dtype(dtype) != torch.float32:
        return False
    legacy, cuda, cpu = matmul_precision()
    exact = ("none", "ieee")
    if device.type == "cuda":
        return legacy != "highest" or cuda not in exact
    return cpu not in exact


def _outside_inference(params: Params, example: PyTree) -> tuple[Params, PyTree]:
    """The analysis pass's inputs: detached parameters that require grad, and the example.

    A tensor made in inference mode (under a caller's ``torch.inference_mode()``)
    cannot join autograd and keeps no version counter: such a parameter or example
    leaf is copied, outside inference mode, into an ordinary tensor.
    """

    def normal(value: Any) -> Any:
        return value.clone() if isinstance(value, Tensor) and value.is_inference() else value

    with torch.inference_mode(False):
        params = {
            k: normal(v).detach().requires_grad_(v.is_floating_point() or v.is_complex())
            for k, v in params.items()
        }
        return params, _torch_tree_map(normal, example)


def _disqualify(module: nn.Module, calls: list[_Call], hook_id: int) -> str:
    # dpfunc's hook must see the module's own output: the probe's gradient is then
    # the gradient with respect to it, which the rules assume
    if nn.modules.module._global_forward_hooks:
        return "a global forward hook may change its output before dpfunc's hook sees it"
    for key, hook in module._forward_hooks.items():
        if key == hook_id:
            break
        if not isinstance(hook, ForwardHook):  # another model's dpfunc hook is inert
            return "another forward hook runs before dpfunc's and may change its output"
    rule, why = rule_for(module)
    if rule is None:
        return why
    if rule.unrolled and len(calls) > 1:
        return f"called {len(calls)} times per example"
    if any(c.bound != calls[0].bound for c in calls):
        return "its parameters differ between its calls"
    for c in calls:
        if c.output is None and c.x is None:
            return "never returned from its forward"
        if c.nested:
            return "called inside a nested torch.func transform (e.g. an input derivative)"
        if c.x is None:
            return "its input is not a tensor"
        if c.version is not None and c.x._version != c.version:
            return "its input is modified in place after the call"
        out = c.output[0] if rule.unrolled and isinstance(c.output, tuple) else c.output
        if not isinstance(out, Tensor):
            return "its output is not a tensor"
        if tf32_risk(out.device, out.dtype):
            return (
                "reduced-precision float32 matmuls (TF32 or bf16) round its products more than "
                "the ghost norm bound covers; torch.set_float32_matmul_precision('highest') "
                "before the first step ghosts it"
            )
        if rule.check is not None:
            why = rule.check(module, c.x, c.output)
            if why:
                return why
    return ""
