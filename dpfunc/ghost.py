"""Ghost clipping: per-example norms and the clipped sum without per-example gradients.

The vmap path materialises every example's gradient, ``B x P`` numbers. For a
layer whose weight gradient is a product of its input and its output gradient
(``grad_i = G_i^T A_i`` for ``nn.Linear``), the norm of each example's gradient
follows from ``A_i`` and ``G_i`` alone (Goodfellow 2015; Li et al. 2022,
"ghost clipping"), and so does the clipped sum ``sum_i c_i grad_i = (c * G)^T A``
(book-keeping, Bu et al. 2023, "Differentially private optimization on large
model at small cost"): one backward pass gives every ``A_i`` and ``G_i`` and no
second backward is needed.

How it works with an opaque ``loss_fn(params, example)``:

1. Forward hooks on the covered modules of ``model`` (inactive unless a ghost
   pass is running) record each module's input ``A_i`` and return
   ``output + probe``, where ``probe`` is a zero tensor shaped like one
   example's output of that module.
2. ``vmap(grad_and_value(f, argnums=(probes, other_params)))`` runs the loss with
   the covered modules' parameters passed as constants: the gradient with
   respect to a probe is the module's output gradient ``G_i``; the parameters of
   every module without a ghost rule get ordinary per-example gradients from the
   same pass.
3. Per-example squared norms come from ``(A_i, G_i)`` (rank-one, Gram-matrix or
   direct form, whichever is cheaper); the clip factors come from the total;
   the clipped sum of a covered parameter is one contraction of ``c * G`` with
   ``A``. The norm and the sum are computed from the same ``(A_i, G_i)``, so the
   contribution whose norm is bounded is exactly the one that is summed.

Covered: ``nn.Linear`` (any number of leading positions), ``nn.Embedding``
(without ``max_norm``, ``scale_grad_by_freq`` or ``sparse``), ``nn.Conv1d`` and
``nn.Conv2d`` (any stride, padding, padding mode, dilation and groups, via
``unfold``), the affine parameters of ``nn.LayerNorm`` and ``nn.GroupNorm``, and
``nn.RNN`` / ``nn.GRU`` / ``nn.LSTM`` without ``proj_size`` (run unrolled in the
ghost pass, with a probe on every gate: :mod:`dpfunc.recurrent`).

The norms are upper bounds that include the rounding of the norm and of the
clipped sum (:func:`linear_weight_norms`), so the contribution that is summed
never exceeds the clip bound; where TF32 could round past those bounds on CUDA,
the module falls back (:func:`tf32_risk`). An example whose activations
overflow a Gram matrix gets a non-finite norm and is dropped.

Which modules can be ghosted is decided once per batch structure by an analysis
pass (:func:`analyse`): the loss runs on one real example with hooks and a
``TorchFunctionMode`` that records every use of every trainable parameter. A
covered module is ghosted only if it is called exactly once per example, not
inside a nested ``torch.func`` transform, with exactly its own registered
parameters, which are used nowhere else (tied or shared weights, a weight used
directly as ``MultiheadAttention.out_proj`` is, weight decay inside the loss all
disqualify), and its input is not modified in place afterwards. Everything else
falls back to per-example gradients from ``vmap``; the step says so once.
"""

from __future__ import annotations

import math
import time
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import grad_and_value
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves as _torch_tree_leaves

from . import recurrent
from .clipping import clip_factors, clipped_sum, groups_by_module, per_sample_norms
from .per_sample import per_sample_grads_and_losses, vmap_over_examples
from .tree import Params, PyTree

__all__ = [
    "GhostPlan",
    "GhostClipper",
    "analyse",
    "covered_kind",
    "ghost_clip",
    "ghost_is_cheaper",
    "install_hooks",
    "linear_weight_norms",
    "remove_hooks",
    "tf32_risk",
]

_F64 = torch.float64


# --- which modules have a ghost rule ------------------------------------------------


def covered_kind(module: nn.Module) -> tuple[str | None, str]:
    """``(kind, "")`` if ``module`` has a ghost rule, else ``(None, reason)``.

    ``kind`` is one of ``"linear"``, ``"embedding"``, ``"conv"``,
    ``"layer_norm"``, ``"group_norm"``. A subclass is covered only if it keeps
    the base class's ``forward`` (``MultiheadAttention.out_proj`` does; it is
    covered but never called, so it falls back).
    """
    parametrizations = getattr(module, "parametrizations", None)
    if isinstance(parametrizations, nn.ModuleDict) and len(parametrizations):
        return None, "has parametrizations"
    if "forward" in module.__dict__:
        return None, "its forward is replaced on the instance"
    cls = recurrent.torch_class(type(module))  # the class behind dpfunc's dispatching one
    if cls in (nn.RNN, nn.GRU, nn.LSTM):
        if module.proj_size:
            return None, "LSTM with proj_size has no ghost rule"
        if not set(_attrs(module)) <= set(module._flat_weights_names):
            return None, f"{cls.__name__} with parameters of its own has no ghost rule"
        return "recurrent", ""
    if isinstance(module, nn.Linear) and cls.forward is nn.Linear.forward:
        return "linear", ""
    if isinstance(module, nn.Embedding) and cls.forward is nn.Embedding.forward:
        if module.max_norm is not None:
            return None, "Embedding with max_norm renormalises its weight in place"
        if module.scale_grad_by_freq:
            return None, "Embedding with scale_grad_by_freq has no ghost rule"
        if module.sparse:
            return None, "sparse Embedding has no ghost rule"
        return "embedding", ""
    for conv in (nn.Conv1d, nn.Conv2d):
        if (
            isinstance(module, conv)
            and cls.forward is conv.forward
            and cls._conv_forward is conv._conv_forward
        ):
            return "conv", ""
    if isinstance(module, nn.LayerNorm) and cls.forward is nn.LayerNorm.forward:
        return "layer_norm", ""
    if isinstance(module, nn.GroupNorm) and cls.forward is nn.GroupNorm.forward:
        return "group_norm", ""
    return None, f"{cls.__name__} has no ghost rule"


def _config(kind: str, module: nn.Module) -> tuple:
    """The static facts a rule needs, as a hashable tuple."""
    if kind == "linear":
        return (module.in_features, module.out_features)
    if kind == "embedding":
        return (module.num_embeddings, module.embedding_dim, module.padding_idx)
    if kind == "conv":
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        return (
            len(module.kernel_size),
            module.in_channels,
            module.out_channels,
            tuple(module.kernel_size),
            tuple(module.stride),
            tuple(module.dilation),
            module.groups,
            tuple(module._reversed_padding_repeated_twice),
            mode,
        )
    if kind == "layer_norm":
        return (tuple(module.normalized_shape), module.eps)
    if kind == "group_norm":
        return (module.num_groups, module.num_channels, module.eps)
    if kind == "recurrent":
        return (module.mode, module.hidden_size, tuple(recurrent.sites(module)))
    raise AssertionError(kind)


def _attrs(module: nn.Module) -> list[str]:
    """The module's own parameter attributes (``weight``, ``bias``, ``weight_ih_l0``, ...)."""
    return [attr for attr, p in module._parameters.items() if isinstance(p, Tensor)]


# --- hooks --------------------------------------------------------------------------


class GhostHooks:
    """The forward hooks dpfunc keeps on a model; inert while ``ctx`` is ``None``."""

    def __init__(self, model: nn.Module):
        self.ctx: Any = None
        self.modules: dict[str, nn.Module] = {}
        self.handles = []
        self.ids: dict[str, int] = {}  # path -> id of dpfunc's hook on that module
        for path, module in model.named_modules():
            kind, _ = covered_kind(module)
            if kind is None:
                continue
            self.modules[path] = module
            handle = module.register_forward_hook(
                _ForwardHook(self, path), prepend=True, with_kwargs=True
            )
            self.handles.append(handle)
            self.ids[path] = handle.id
            if kind == "recurrent":  # the fused kernel cannot expose its gate gradients
                recurrent.attach(module, self, path)


class _ForwardHook:
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
            recurrent.detach(module, hooks)


def _module_input(args: tuple, kwargs: dict) -> Any:
    if args:
        return args[0]
    return kwargs.get("input")


# --- the plan -----------------------------------------------------------------------


@dataclass(frozen=True)
class GhostModule:
    path: str
    kind: str
    config: tuple
    attrs: tuple[tuple[str, str], ...]  # (attribute, parameter name), trainable only
    out_shape: tuple[int, ...]  # one example's output of the module
    out_dtype: torch.dtype


@dataclass(frozen=True)
class GhostPlan:
    """Which modules the ghost path handles for one batch structure, and why not the rest."""

    modules: tuple[GhostModule, ...]
    reasons: tuple[str, ...]  # one line per module or parameter left to vmap
    covered: tuple[str, ...] = ()  # the parameters the modules' rules handle


class _Analysis:
    """Hook context of the analysis pass: what each covered module saw."""

    def __init__(self, params: Params):
        self.names = {id(t): name for name, t in params.items()}
        self.stack: list[str] = []
        self.calls: Counter = Counter()
        self.outputs: dict[str, Any] = {}
        self.inputs: dict[str, Any] = {}
        self.bound: dict[str, dict[str, str | None]] = {}  # path -> attr -> param name
        self.nested: set[str] = set()
        self.uses: dict[str, set] = defaultdict(set)  # param name -> paths (None: outside)
        self.level = torch._C._functorch.maybe_current_level()  # transforms around the loss

    def before_forward(self, path, module, args, kwargs):
        self.stack.append(path)
        self.calls[path] += 1
        self.bound[path] = {
            attr: self.names.get(id(getattr(module, attr, None)))
            for attr in _attrs(module)
            if isinstance(getattr(module, attr, None), Tensor)
        }
        if torch._C._functorch.maybe_current_level() != self.level:
            self.nested.add(path)

    def after_forward(self, path, module, args, kwargs, output):
        if self.stack and self.stack[-1] == path:
            self.stack.pop()
        x = _module_input(args, kwargs)
        self.inputs[path] = (x, x._version) if isinstance(x, Tensor) else (None, None)
        self.outputs[path] = output
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

    ``method="auto"`` also leaves to vmap every module for which ghost clipping
    would cost more than materialising its per-example gradient (see
    :func:`ghost_is_cheaper`); ``"ghost"`` ghosts every module it can.

    A covered module (see :func:`covered_kind`) with trainable parameters is
    ghosted only if, during this one call, it ran exactly once through its
    ``__call__``, outside any nested ``torch.func`` transform, with exactly its
    own registered parameters taken from ``params``, those parameters were used
    by no other torch call (tied weights, direct use, weight decay inside the
    loss), its input was a tensor not modified in place afterwards and its
    output a tensor. Global RNG state is restored afterwards.
    """
    params = {
        k: v.detach().requires_grad_(v.is_floating_point() or v.is_complex())
        for k, v in params.items()
    }
    analysis = _Analysis(params)
    pre_handles = [
        module.register_forward_pre_hook(
            lambda mod, args, kwargs, path=path: analysis.before_forward(path, mod, args, kwargs),
            with_kwargs=True,
        )
        for path, module in hooks.modules.items()
    ]
    devices = sorted({t.device.index for t in params.values() if t.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices), _UseTracker(analysis):
            hooks.ctx = analysis
            try:
                loss_fn(params, example)
            finally:
                hooks.ctx = None
    finally:
        for handle in pre_handles:
            handle.remove()

    shared = _shared_parameters(model)
    modules, reasons, ghosted, left = [], [], set(), []  # left: paths left to vmap
    for path, module in hooks.modules.items():
        kind, _ = covered_kind(module)
        wanted = [(attr, f"{path}.{attr}" if path else attr) for attr in _attrs(module)]
        wanted = [(attr, name) for attr, name in wanted if name in params]
        if not wanted:
            continue  # nothing trainable under this module's own names
        why = _disqualify(path, module, wanted, analysis, shared, hooks.ids[path])
        if why:
            reasons.append(f"{path!r}: {why}")
            left.append(path)
            continue
        output = analysis.outputs[path]
        if method == "auto" and not ghost_is_cheaper(
            kind, module, analysis.inputs[path][0], output
        ):
            left.append(path)  # a cost choice, not a fallback: no reason to report
            continue
        modules.append(
            GhostModule(
                path=path,
                kind=kind,
                config=_config(kind, module),
                attrs=tuple(wanted),
                out_shape=(
                    recurrent.sequence_layout(module, analysis.inputs[path][0])
                    if kind == "recurrent"
                    else tuple(output.shape)
                ),
                out_dtype=output[0].dtype if kind == "recurrent" else output.dtype,
            )
        )
        ghosted.update(name for _, name in wanted)
    explained = {name for path in left for name in _own_names(path, hooks.modules[path])}
    no_rule: dict[str, list[str]] = {}
    for name in params:
        if name not in ghosted and name not in explained:
            no_rule.setdefault(name.rpartition(".")[0], []).append(name)
    for owner, names in no_rule.items():
        try:
            _, why = covered_kind(model.get_submodule(owner))
        except AttributeError:
            why = "not a module's parameter"
        reasons.append(f"{owner!r}: {why} (parameters {names})")
    covered = tuple(name for m in modules for _, name in m.attrs)
    return GhostPlan(tuple(modules), tuple(reasons), covered)


def ghost_is_cheaper(kind: str, module: nn.Module, x: Tensor, output: Tensor) -> bool:
    """Whether ghost norms beat materialising the per-example weight gradient.

    ``x`` and ``output`` are one example's input and output of ``module``. A
    weight gradient that is a sum over ``T`` positions of ``d_out x d_in``
    outer products gets its norm without being formed when ``T = 1`` (the
    rank-one form) or ``T^2 < d_in * d_out`` (the ``T x T`` Gram matrices are
    smaller than the gradient): the rule :func:`linear_weight_norms` uses to
    pick its form, so ``True`` means the ``outer`` or ``gram`` form, ``False``
    the ``direct`` one, which forms the gradient anyway. For a convolution
    the positions are the output pixels and ``d_in`` one unfolded patch.

    An embedding's Gram form costs ``T^2 * dim`` multiply-adds against about
    three passes over the ``num_embeddings x dim`` gradient (write, norm,
    weighted sum), and a float moved through memory costs several
    multiply-adds on a CPU: ghost when ``T^2 < 16 * num_embeddings``. (With
    1000 rows, ghosting was faster and leaner at ``T = 32`` and ``T = 64``:
    24 against 29 ms and 53 against 120 MB for the LSTM benchmark step, 52
    against 59 ms for the transformer one, eager.) Recurrent layers have no
    cheap per-example gradient at all (the fused kernel runs example by
    example under vmap), and normalisation layers' affine gradients are tiny
    either way: always ghost.
    """
    if kind == "linear":
        d_in, d_out = module.in_features, module.out_features
        t = x.numel() // d_in
    elif kind == "conv":
        d_in = module.in_channels // module.groups * math.prod(module.kernel_size)
        d_out = module.out_channels // module.groups
        t = output.numel() // module.out_channels  # output positions (of every image)
    elif kind == "embedding":
        return x.numel() ** 2 < 16 * module.num_embeddings
    else:
        return True
    return t == 1 or t * t < d_in * d_out


def tf32_risk(kind: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``kind``'s ghost products may run in TF32 on ``device`` for ``dtype``.

    The norm bounds of :func:`linear_weight_norms` assume IEEE rounding of
    ``dtype``; TF32 keeps 10 mantissa bits of float32's 23, so a cancelling
    example could pass the bound hundreds of times over. Matmuls (Linear,
    Embedding and recurrent Gram and sums) use it when
    ``torch.backends.cuda.matmul.allow_tf32`` (off by default), convolutions
    (the weight-gradient sum) when ``torch.backends.cudnn.allow_tf32`` (on by
    default). Normalisation layers form their per-example gradients exactly.
    """
    if device.type != "cuda" or dtype != torch.float32:
        return False
    if kind in ("linear", "embedding", "recurrent", "conv") and (
        torch.get_float32_matmul_precision() != "highest"
    ):
        return True
    return kind == "conv" and torch.backends.cudnn.allow_tf32


def _own_names(path: str, module: nn.Module) -> list[str]:
    return [f"{path}.{a}" if path else a for a in _attrs(module)]


def _shared_parameters(model: nn.Module) -> set[int]:
    seen: Counter = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return {key for key, count in seen.items() if count > 1}


def _disqualify(path, module, wanted, analysis: _Analysis, shared: set[int], hook_id: int) -> str:
    # dpfunc's hook must see the module's own output: the probe's gradient is then
    # the gradient with respect to it, which the ghost rules assume
    if nn.modules.module._global_forward_hooks:
        return "a global forward hook may change its output before dpfunc's hook sees it"
    for key, hook in module._forward_hooks.items():
        if key == hook_id:
            break
        if not isinstance(hook, _ForwardHook):  # another model's dpfunc hook is inert
            return "another forward hook runs before dpfunc's and may change its output"
    calls = analysis.calls[path]
    if calls == 0 or path not in analysis.outputs:
        return "never called through its forward (its parameters are used some other way)"
    if calls > 1:
        return f"called {calls} times per example"
    if path in analysis.nested:
        return "called inside a nested torch.func transform (e.g. an input derivative)"
    for attr, _ in wanted:
        if id(module._parameters[attr]) in shared:
            return f"its {attr} is shared with another module (tied weights)"
    bound = analysis.bound.get(path, {})
    for attr, name in wanted:
        if bound.get(attr) != name:
            return f"its {attr} at call time is not params[{name!r}]"
    for _, name in wanted:
        outside = analysis.uses[name] - {path}
        if outside:
            where = sorted(repr(p) if p else "outside any covered module" for p in outside)
            return f"params[{name!r}] is also used {', '.join(where)}"
    for other_attr, name in bound.items():
        if name is not None and (other_attr, name) not in wanted:
            return f"its {other_attr} is another module's parameter {name!r}"
    x, version = analysis.inputs.get(path, (None, None))
    if x is None:
        return "its input is not a tensor"
    if x._version != version:
        return "its input is modified in place after the call"
    kind, _ = covered_kind(module)
    output = analysis.outputs[path]
    out = output[0] if kind == "recurrent" and isinstance(output, tuple) else output
    if isinstance(out, Tensor) and tf32_risk(kind, out.device, out.dtype):
        return (
            "TF32 rounds its products more than the ghost norm bound covers; set "
            "torch.backends.cuda.matmul.allow_tf32 = False (and torch.backends.cudnn."
            "allow_tf32 = False for convolutions) to ghost it"
        )
    if kind == "recurrent":
        if x.dim() not in (2, 3):
            return f"input of rank {x.dim()}"
        if module.dropout and module.training:
            return "dropout between its layers: the unrolled layer's masks are not torch's"
        return ""
    if not isinstance(analysis.outputs[path], Tensor):
        return "its output is not a tensor"
    if kind == "conv" and x.dim() not in (module.weight.dim() - 1, module.weight.dim()):
        return f"input of rank {x.dim()}"
    if kind == "group_norm" and x.dim() < 2:
        return f"input of rank {x.dim()}"
    if kind == "embedding" and (x.is_floating_point() or x.is_complex()):
        return "input is not an integer tensor"
    return ""


# --- batch skeletons (so the plan can be a compile-time constant) ---------------------


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
        leaves: list = []
        try:
            skeleton = _skeleton(batch, leaves)
        except TypeError as error:
            return _plan_for(self, ("unsupported", str(error)), ())
        return _plan_for(self, skeleton, tuple(params), *params.values(), *leaves)


@torch.compiler.assume_constant_result
def _plan_for(clipper: GhostClipper, skeleton, names, *tensors) -> GhostPlan:
    # Runs eagerly, also when the step is being compiled: Dynamo calls it with the
    # real tensors and bakes the returned plan into the graph as a constant. The
    # cache key is computed here, from those real tensors, because under automatic
    # dynamic shapes (a second model or batch size in one process) the traced
    # shapes are symbolic and cannot be passed in as constants. A plan baked into
    # a graph that is later reused for other per-example shapes is caught by the
    # shape check in ``_Run.after_forward``.
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
        )
    plan = clipper.plans.get(key)
    if plan is not None:
        return plan
    if key[0] == "unsupported":
        plan = GhostPlan((), (key[1],))
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
            plan = GhostPlan((), (f"the analysis pass failed: {type(error).__name__}: {error}",))
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
            + "; ".join(plan.reasons),
            UserWarning,
            stacklevel=4,
        )
    return plan


def _faster_of(clipper: GhostClipper, plan: GhostPlan, params: Params, batch) -> GhostPlan:
    """``method="auto"`` eagerly: ``plan``, or plain vmap if that measured faster.

    The cost model of :func:`ghost_is_cheaper` counts arithmetic; on small
    models the ghost pass's fixed costs (hooks, a second backward) can
    dominate. So the first eager step of each batch shape times both ways
    to the clipped sum once, after one warm-up call each, on the real
    batch, and keeps the faster (vmap on a tie). Compiled steps keep the
    cost model: their times differ from eager ones. The global RNG state is
    restored, so the timing leaves dropout draws as they were.
    """
    size = _torch_tree_leaves(batch)[0].shape[0]
    device = next(iter(params.values())).device
    mask = torch.ones(size, dtype=torch.bool, device=device)

    def ghost() -> None:
        ghost_clip(clipper.loss_fn, clipper.hooks, plan, params, batch, mask,
                   clipping="flat", clip_norm=1.0)  # fmt: skip

    def plain() -> None:
        grads, _ = per_sample_grads_and_losses(clipper.loss_fn, params, batch)
        clipped_sum(grads, clip_factors(per_sample_norms(grads), 1.0), mask)

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
    return plan if ghost_s < vmap_s else GhostPlan((), ())


# --- the ghost pass -------------------------------------------------------------------


class _Run:
    """Hook context of the ghost pass: adds the probes, records the inputs."""

    def __init__(self, probes: dict[str, Tensor]):
        self.probes = probes
        self.inputs: dict[str, Tensor] = {}

    def after_forward(self, path, module, args, kwargs, output):
        probe = self.probes.get(path)
        if probe is None or isinstance(probe, dict):  # dict: run_recurrent did the work
            return None
        if path in self.inputs:
            raise RuntimeError(
                f"dpfunc ghost clipping: module {path!r} ran twice in one example, but only "
                "once in the analysis pass; use method='vmap' for this loss"
            )
        if output.shape != probe.shape:
            raise RuntimeError(
                f"dpfunc ghost clipping: module {path!r} returned shape {tuple(output.shape)} "
                f"per example, but the plan was made for {tuple(probe.shape)}"
            )
        self.inputs[path] = _module_input(args, kwargs)
        return output + probe

    def run_recurrent(self, path, module, x, hx):
        """A planned recurrent module's call: unrolled, with probes on every gate."""
        if path in self.inputs:
            raise RuntimeError(
                f"dpfunc ghost clipping: module {path!r} ran twice in one example, but only "
                "once in the analysis pass; use method='vmap' for this loss"
            )
        layout = recurrent.sequence_layout(module, x)
        shape = next(iter(self.probes[path].values())).shape[:2]
        if layout != shape:
            raise RuntimeError(
                f"dpfunc ghost clipping: module {path!r} got (steps, batch) {layout} per "
                f"example, but the plan was made for {tuple(shape)}"
            )
        record: dict[str, Tensor] = {}
        out = recurrent.unrolled(module, x, hx, self.probes[path], record)
        self.inputs[path] = record
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
    clip_norm: float,
    chunk_size: int | None = None,
) -> tuple[Params, Tensor, Tensor, Tensor]:
    """The clipped sum of one micro-batch by ghost clipping and book-keeping.

    Args:
        loss_fn, params, batch: as for :func:`dpfunc.per_sample_grads`.
        hooks, plan: from :class:`GhostClipper` (``plan.modules`` not empty).
        mask: ``Tensor[B]`` bool, ``False`` for padding rows.
        clipping: ``"flat"``, ``"normalized"`` or ``"per_layer"`` (groups
            by owning module, as :func:`dpfunc.groups_by_module`).
        clip_norm: ``C``.
        chunk_size: passed to ``vmap``.

    Returns:
        ``(summed, losses[B], norms[B] float64, scaled[B] bool)``: ``summed``
        equals ``clipped_sum(per_sample_grads(...), factors, mask)`` of the
        vmap path. A padding row or an example with a non-finite norm
        contributes exactly 0, even with NaN in its activations or gradients.
    """
    covered_names = plan.covered
    covered = {k: v for k, v in params.items() if k in covered_names}
    other = {k: v for k, v in params.items() if k not in covered_names}
    device = next(iter(params.values())).device
    probes = {m.path: _probe(m, device) for m in plan.modules}
    names = list(params)

    def example_loss(probes, other, covered, example):
        merged = {k: other[k] if k in other else covered[k] for k in names}
        run = _Run(probes)
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
        missing = [path for path in probes if path not in run.inputs]
        if missing:
            raise RuntimeError(
                f"dpfunc ghost clipping: modules {missing} ran in the analysis pass but not "
                "in this one; use method='vmap' for this loss"
            )
        return loss, (loss, run.inputs)

    per_example = vmap_over_examples(
        grad_and_value(example_loss, argnums=(0, 1), has_aux=True),
        in_dims=(None, None, None, 0),
        chunk_size=chunk_size,
    )
    (out_grads, other_grads), (_, (losses, inputs)) = per_example(probes, other, covered, batch)

    squared: dict[str, Tensor] = {}
    states: dict[str, Any] = {}
    for m in plan.modules:
        states[m.path] = _RULES[m.kind].prepare(m, inputs[m.path], out_grads[m.path])
        for name, sq in _RULES[m.kind].norms(m, states[m.path]).items():
            squared[name] = sq
    for name, g in other_grads.items():
        squared[name] = _sq(g)

    mask = mask.to(torch.bool)
    if clipping == "per_layer":
        groups = groups_by_module(params)
        group_norms = {
            group: torch.stack([squared[n] for n in members]).sum(0).sqrt()
            for group, members in groups.items()
        }
        factors = clip_factors(group_norms, clip_norm)
        total = torch.stack([n.square() for n in group_norms.values()]).sum(0).sqrt()
        scaled = torch.stack([f < 1 for f in factors.values()]).any(0)
        weights = {
            n: torch.where(mask, factors[group], torch.zeros_like(factors[group]))
            for group, members in groups.items()
            for n in members
        }
    else:
        total = torch.stack([squared[n] for n in names]).sum(0).sqrt()
        factor = clip_factors(total, clip_norm, normalize=clipping == "normalized")
        scaled = factor < 1
        factor = torch.where(mask, factor, torch.zeros_like(factor))
        weights = dict.fromkeys(names, factor)

    summed: dict[str, Tensor] = {}
    for m in plan.modules:
        w = {attr: weights[name] for attr, name in m.attrs}
        for attr, value in _RULES[m.kind].sums(m, states[m.path], w).items():
            summed[dict(m.attrs)[attr]] = value
    for name, g in other_grads.items():
        summed[name] = _weighted_sum(g, weights[name])
    summed = {k: summed[k] for k in names}
    return summed, losses, total, scaled


def _probe(m: GhostModule, device: torch.device) -> Tensor | dict[str, Tensor]:
    """Zeros added to the module's output (for a recurrent module: to every gate)."""
    if m.kind != "recurrent":
        return torch.zeros(m.out_shape, dtype=m.out_dtype, device=device)
    mode, hidden, sites = m.config
    shape = (*m.out_shape, recurrent.GATES[mode] * hidden)
    return {site: torch.zeros(shape, dtype=m.out_dtype, device=device) for site in sites}


# --- rules: squared norms and clipped sums from (A, G) ---------------------------------


def _sq(t: Tensor) -> Tensor:
    """Each example's squared L2 norm, accumulated in float64: ``[B, ...] -> [B]``."""
    flat = t.reshape(t.shape[0], math.prod(t.shape[1:]))
    return torch.linalg.vector_norm(flat, dim=1, dtype=_F64).square()


def _expand(w: Tensor, like: Tensor) -> Tensor:
    return w.reshape(-1, *([1] * (like.dim() - 1)))


def _keep(t: Tensor, w: Tensor) -> Tensor:
    """``t`` with the rows of weight-0 examples set to exactly 0 (NaN-safe)."""
    return torch.where(_expand(w != 0, t), t, t.new_zeros(()))


def _scaled(t: Tensor, w: Tensor) -> Tensor:
    """``w_i * t_i`` with rows of weight-0 examples exactly 0 (NaN-safe)."""
    w = _expand(w, t)
    return torch.where(w != 0, t * w.to(t.dtype), t.new_zeros(()))


def _weighted_sum(g: Tensor, w: Tensor) -> Tensor:
    return _scaled(g, w).sum(0)


def _gamma(n: int, dtype: torch.dtype) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``: the relative error bound of ``n`` roundings."""
    nu = n * torch.finfo(dtype).eps / 2
    return nu / (1 - nu) if nu < 1 else math.inf


def _position_norm_sum(a: Tensor, g: Tensor) -> Tensor:
    """``S_i = sum_t |a_it| |g_it|``, float64 ``[N]``: bounds every rounding error below."""
    a_norms = torch.linalg.vector_norm(a, dim=-1, dtype=_F64)
    g_norms = torch.linalg.vector_norm(g, dim=-1, dtype=_F64)
    return (a_norms * g_norms).sum(1)


def linear_weight_norms(
    a: Tensor, g: Tensor, form: str | None = None, summed_over: int = 1
) -> Tensor:
    """An upper bound on ``||g_i^T a_i||_F^2`` for ``a [N, T, d_in]``, ``g [N, T, d_out]``.

    Returns float64 ``[N]``. ``form``: ``"outer"`` (``T == 1``: ``|a|^2
    |g|^2``), ``"gram"`` (``sum((a a^T) * (g g^T))``, ``T x T`` per example)
    or ``"direct"`` (forms the ``d_out x d_in`` gradient); ``None`` picks
    ``outer`` for ``T == 1``, else ``gram`` when ``T^2 < d_in * d_out``, else
    ``direct``.

    Why a bound and not the value: the clipped sum is computed by other float
    operations than the norm (one product over all ``summed_over`` rows of the
    batch), so the norm must cover the rounding of both, or an example whose
    positions cancel (huge ``a`` and ``g``, a small gradient) could have a tiny
    computed norm and a large summed contribution. Every rounding error is at
    most ``gamma * S_i`` with ``S_i = sum_t |a_it| |g_it|`` (Higham's bounds for
    dot products and sums), so the returned norm is the computed one plus
    those bounds: ``gram`` adds ``(3 gamma_{d+1} + 2 gamma_{T^2}(float64)) S^2``
    to the squared norm, ``direct`` adds ``gamma_T S`` to the norm, and every
    form adds ``gamma_{summed_over} S`` for the sum. Measured in float32, the
    bound exceeds the exact norm by a relative 1.5e-5 with one position and
    256 rows, and by 1e-4 to 2e-4 with 32 to 64 positions; it is loose only
    for examples whose positions cancel.
    """
    t, d_in, d_out = a.shape[1], a.shape[2], g.shape[2]
    dtype = torch.promote_types(a.dtype, g.dtype)
    if form is None:
        form = "outer" if t == 1 else ("gram" if t * t < d_in * d_out else "direct")
    s = _position_norm_sum(a, g)
    if form == "outer":
        if t != 1:
            raise ValueError(f"form='outer' needs one position per example, got {t}")
        norm = s  # |a| |g|, from float64 norms: no cancellation, no overflow of |a|^2
    elif form == "gram":
        gram = (torch.bmm(a, a.mT) * torch.bmm(g, g.mT)).sum((1, 2), dtype=_F64)
        error = 3 * _gamma(max(d_in, d_out) + 1, dtype) + 2 * _gamma(t * t, _F64)
        norm = (gram.clamp(min=0) + error * s.square()).sqrt()
    elif form == "direct":
        norm = torch.linalg.vector_norm(torch.bmm(g.mT, a).flatten(1), dim=1, dtype=_F64)
        norm = norm + _gamma(t, dtype) * s
    else:
        raise ValueError(f"form must be 'outer', 'gram', 'direct' or None, got form={form!r}")
    return (norm + _gamma(summed_over, dtype) * s).square()


def _linear_state(a: Tensor, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(A [B, T, d_in], G [B, T, d_out], bias gradients [B, d_out])`` of a linear map
    over the positions between the first and the last dimension."""
    b = g.shape[0]
    g = g.reshape(b, -1, g.shape[-1])
    return a.reshape(b, -1, a.shape[-1]).to(g.dtype), g, g.sum(1)  # bias: summed as normed


def _linear_norm(state, weight: bool) -> Tensor:
    a, g, bias = state
    return linear_weight_norms(a, g, summed_over=a.shape[0] * a.shape[1]) if weight else _sq(bias)


def _linear_sum(state, w: Tensor, weight: bool) -> Tensor:
    a, g, bias = state
    if not weight:
        return _weighted_sum(bias, w)
    return _scaled(g, w).flatten(0, 1).mT @ _keep(a, w).flatten(0, 1)


class _Linear:
    """``grad W_i = G_i^T A_i`` over the positions ``T``; ``grad b_i = sum_t G_i``."""

    @staticmethod
    def prepare(m: GhostModule, a: Tensor, g: Tensor):
        return _linear_state(a, g)

    @staticmethod
    def norms(m, state):
        return {name: _linear_norm(state, attr == "weight") for attr, name in m.attrs}

    @staticmethod
    def sums(m, state, w):
        return {attr: _linear_sum(state, weight, attr == "weight") for attr, weight in w.items()}


class _Embedding:
    """``grad W_i[v] = sum_{t: idx_t = v} G_i[t]``, except the ``padding_idx`` row."""

    @staticmethod
    def prepare(m, idx, g):
        _, dim, padding_idx = m.config
        b = g.shape[0]
        idx = idx.reshape(b, -1)
        g = g.reshape(b, -1, dim)
        if padding_idx is not None:  # the padding row gets no gradient
            g = torch.where((idx != padding_idx)[..., None], g, g.new_zeros(()))
        return idx, g

    @staticmethod
    def norms(m, state):
        # An upper bound, as in linear_weight_norms (a one-hot a_t has |a_t| = 1).
        idx, g = state
        t, dim = g.shape[1], g.shape[2]
        same = idx[:, :, None] == idx[:, None, :]
        gram = torch.where(same, torch.bmm(g, g.mT), g.new_zeros(())).sum((1, 2), dtype=_F64)
        s = torch.linalg.vector_norm(g, dim=-1, dtype=_F64).sum(1)
        error = 2 * _gamma(dim + 1, g.dtype) + 2 * _gamma(t * t, _F64)
        norm = (gram.clamp(min=0) + error * s.square()).sqrt()
        norm = norm + _gamma(g.shape[0] * t, g.dtype) * s  # the index_add over the batch
        ((_, name),) = m.attrs
        return {name: norm.square()}

    @staticmethod
    def sums(m, state, w):
        idx, g = state
        num, dim, _ = m.config
        rows = _scaled(g, w["weight"]).reshape(-1, dim)
        zeros = torch.zeros(num, dim, dtype=g.dtype, device=g.device)
        return {"weight": zeros.index_add(0, idx.reshape(-1), rows)}


class _Conv:
    """A convolution is a Linear over the ``unfold``-ed input patches, per group."""

    @staticmethod
    def prepare(m, a, g):
        nd, c_in, c_out, kernel, stride, dilation, groups, padding, mode = m.config
        b = g.shape[0]
        x = a.reshape(-1, c_in, *a.shape[a.dim() - nd :]).to(g.dtype)  # [B * N, C_in, ...]
        g = g.reshape(x.shape[0], c_out, *g.shape[g.dim() - nd :])  # [B * N, C_out, ...]
        symmetric = all(padding[i] == padding[i + 1] for i in range(0, len(padding), 2))
        if mode == "constant" and symmetric:  # F.unfold pads with zeros itself
            pad = tuple(padding[::-2])
        else:
            x, pad = F.pad(x, padding, mode=mode), (0,) * nd
        if nd == 1:
            args = dict(kernel_size=(1, *kernel), dilation=(1, *dilation), stride=(1, *stride))
            u = F.unfold(x.unsqueeze(-2), padding=(0, *pad), **args)
        else:
            u = F.unfold(x, kernel, dilation=dilation, padding=pad, stride=stride)
        length = u.shape[-1]  # output positions, L
        d_in, d_out = c_in // groups * math.prod(kernel), c_out // groups
        # [B, groups, N * L, d] as views when N == 1 (one image per example)
        u_t = u.reshape(b, -1, groups, d_in, length).permute(0, 2, 1, 4, 3)
        g_t = g.reshape(b, -1, groups, d_out, length).permute(0, 2, 1, 4, 3)
        u_t = u_t.reshape(b, groups, -1, d_in)
        g_t = g_t.reshape(b, groups, -1, d_out)
        return x, pad, u_t, g, g_t, g_t.sum(2)  # the bias gradients, formed

    @staticmethod
    def norms(m, state):
        _, _, u, _, g, bias = state
        b, groups, rows = u.shape[:3]
        out = {}
        for attr, name in m.attrs:
            if attr == "weight":  # the sum is one weight gradient over all b * rows positions
                sq = linear_weight_norms(u.flatten(0, 1), g.flatten(0, 1), summed_over=b * rows)
                out[name] = sq.reshape(b, groups).sum(1)
            else:
                out[name] = _sq(bias)
        return out

    @staticmethod
    def sums(m, state, w):
        x, pad, _, g, g_t, bias = state
        nd, c_in, c_out, kernel, stride, dilation, groups, _, _ = m.config
        out = {}
        if "weight" in w:  # the ordinary weight gradient of the scaled output gradients
            per_image = w["weight"].repeat_interleave(x.shape[0] // g_t.shape[0])
            weight_grad = torch.nn.grad.conv1d_weight if nd == 1 else torch.nn.grad.conv2d_weight
            out["weight"] = weight_grad(
                _keep(x, per_image),
                (c_out, c_in // groups, *kernel),
                _scaled(g, per_image),
                stride=stride,
                padding=pad,
                dilation=dilation,
                groups=groups,
            )
        if "bias" in w:
            out["bias"] = _weighted_sum(bias, w["bias"]).reshape(c_out)
        return out


class _Norm:
    """LayerNorm and GroupNorm: ``grad weight_i = sum xhat_i * G_i``, ``grad bias_i = sum G_i``
    (small, so formed per example)."""

    @staticmethod
    def norms(m, grads):
        return {name: _sq(grads[attr]) for attr, name in m.attrs}

    @staticmethod
    def sums(m, grads, w):
        return {attr: _weighted_sum(grads[attr], w[attr]) for attr in w}


class _LayerNorm(_Norm):
    @staticmethod
    def prepare(m, a, g):
        shape, eps = m.config
        b = g.shape[0]
        g = g.reshape(b, -1, *shape)
        xhat = F.layer_norm(a.to(g.dtype), shape, eps=eps).reshape(g.shape)
        return {"weight": (xhat * g).sum(1), "bias": g.sum(1)}


class _GroupNorm(_Norm):
    @staticmethod
    def prepare(m, a, g):
        groups, channels, eps = m.config
        b = g.shape[0]
        g = g.reshape(b, -1, channels, math.prod(g.shape[3:]) if g.dim() > 3 else 1)
        x = a.to(g.dtype).reshape(-1, channels, g.shape[-1])
        xhat = F.group_norm(x, groups, eps=eps).reshape(g.shape)
        return {"weight": (xhat * g).sum((1, 3)), "bias": g.sum((1, 3))}


class _Recurrent:
    """RNN, GRU, LSTM: each weight matrix is a Linear over the ``T x N`` (step, sequence)
    positions of one example, from the unrolled forward (:mod:`dpfunc.recurrent`); each
    bias gradient is the sum of its gate gradients, formed per example."""

    @staticmethod
    def prepare(m, inputs, grads):
        sites = {recurrent.site_of(attr) for attr, _ in m.attrs}
        return {site: _linear_state(inputs[site], grads[site]) for site in sites}

    @staticmethod
    def norms(m, state):
        return {
            name: _linear_norm(state[recurrent.site_of(attr)], attr.startswith("weight"))
            for attr, name in m.attrs
        }

    @staticmethod
    def sums(m, state, w):
        return {
            attr: _linear_sum(state[recurrent.site_of(attr)], weight, attr.startswith("weight"))
            for attr, weight in w.items()
        }


_RULES = {
    "recurrent": _Recurrent,
    "linear": _Linear,
    "embedding": _Embedding,
    "conv": _Conv,
    "layer_norm": _LayerNorm,
    "group_norm": _GroupNorm,
}
