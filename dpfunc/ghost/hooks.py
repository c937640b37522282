"""The forward hooks dpfunc keeps on a model, and what a hook reads of a layer call.

:func:`install_hooks` puts one forward hook on every submodule that has a
rule (:mod:`~dpfunc.ghost.registry`), once per model. A hook is inert until a
pass sets ``GhostHooks.ctx``: the planner's analysis pass
(:mod:`~dpfunc.ghost.planner`) records each call there, the ghost pass
(:mod:`~dpfunc.ghost.runtime`) adds its probes. A module whose rule runs the
layer itself is attached to :mod:`~dpfunc.ghost.dispatch` as well.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from . import dispatch
from .registry import Rule, rule_for

__all__ = [
    "ForwardHook",
    "GhostHooks",
    "attribute",
    "install_hooks",
    "module_input",
    "parameters",
    "remove_hooks",
]


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
    """dpfunc's hook on one module: hands each call to the running pass, if any."""

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


def attribute(module: nn.Module, dotted: str) -> Any:
    """``module.out_proj.weight`` for ``"out_proj.weight"``: whatever is bound there now."""
    for part in dotted.split("."):
        module = getattr(module, part, None)
    return module


def parameters(module: nn.Module, rule: Rule) -> list[str]:
    """The parameters a rule covers: the module's own, and submodules' it uses itself."""
    own = [attr for attr, p in module._parameters.items() if isinstance(p, Tensor)]
    return own + [attr for attr in rule.owns if isinstance(attribute(module, attr), Tensor)]
