"""The rule registry: which layer types ghost clipping covers, and how.

A rule turns one call of a layer into its parameters' per-example
gradients, given the layer's input ``x``, the gradient ``g`` of the loss
with respect to its output, both with a leading batch dimension ``B``, and
``weights``, the layer's parameters as the step used them (in a functional
step the module itself keeps its initial values: a rule reads ``weights``,
never ``module.weight``). It returns, for each parameter attribute, one of two forms:

* :class:`Outer` ``(left, right)``: the gradient of example ``i`` is
  ``left[i]^T right[i]``, a sum over positions of outer products (a Linear
  layer's weight: ``left = g``, ``right = x``). Its norm comes from Gram
  matrices without forming it, and the runtime bounds its rounding
  (:mod:`dpfunc.ghost.bounds`). This is the form that makes ghost clipping
  cheap.
* a tensor ``[B, *param.shape]``: the per-example gradient itself, formed
  (a bias, a normalisation layer's affine weight).

The runtime does everything else: norms, rounding bounds, the clipped sum,
and the combination of several calls or several layers that use one
parameter (tied weights). A rule sees only tensors, never a step or a mask.

User layers register the same way as dpfunc's own (see :func:`register_rule`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from torch import Tensor, nn

__all__ = ["Outer", "Rule", "register_rule", "rule_for", "torch_class"]


class Outer(NamedTuple):
    """Each example's gradient as ``left[i]^T right[i]``, summed over positions ``T``.

    ``left``: ``[B, T, p]``, or ``[B, T]`` integer indices standing for one-hot
    rows (an embedding: ``p`` is the parameter's first dimension). ``right``:
    ``[B, T, q]``. Either may carry a groups dimension after ``B`` (``[B, G, T,
    p]``, a grouped convolution); the gradient is then the ``G`` blocks
    ``[G * p, q]`` stacked. The result is reshaped to the parameter's shape.
    """

    left: Tensor
    right: Tensor


Gradients = Callable[[nn.Module, Any, Any, dict[str, Tensor]], dict[str, "Outer | Tensor"]]


@dataclass(frozen=True)
class Rule:
    """A layer type's rule: ``gradients`` and the optional checks that gate it.

    ``check(module, x, output) -> str``: why this call cannot be ghosted
    (``""`` when it can). ``cheaper(module, x, output) -> bool``: whether
    ghosting beats materialising the per-example gradient (only
    ``method="auto"`` asks). ``x`` and ``output`` are one example's.
    """

    gradients: Gradients
    check: Callable[[nn.Module, Any, Any], str] | None = None
    cheaper: Callable[[nn.Module, Any, Any], bool] | None = None
    # dpfunc's layers that run themselves in a ghost pass (:mod:`dpfunc.ghost.dispatch`):
    # run(module, probes, record, *args, **kwargs) -> output, probes and record keyed by
    # site; probe_shapes(module, args, kwargs) -> site -> one example's probe shape
    run: Callable | None = None
    probe_shapes: Callable | None = None
    owns: tuple[str, ...] = ()  # parameters of submodules the layer uses itself

    @property
    def unrolled(self) -> bool:
        return self.run is not None


_RULES: dict[type | str, Rule] = {}
UNDERLYING: dict[type, type] = {}  # a class dpfunc swaps in -> the class it stands for


def torch_class(cls: type) -> type:
    """The class ``cls`` stands for: ``nn.LSTM`` for the class dpfunc swaps into an LSTM.

    While ghost hooks are on a layer that runs itself in a ghost pass
    (``nn.LSTM``, ``nn.MultiheadAttention``, ...), its class is a subclass
    dpfunc made (:mod:`dpfunc.ghost.dispatch`); this maps it back. Any other
    class is returned as it is.

    >>> torch_class(nn.Linear) is nn.Linear
    True
    """
    return UNDERLYING.get(cls, cls)


def register_rule(
    module_type: type | str,
    gradients: Gradients,
    *,
    check: Callable[[nn.Module, Any, Any], str] | None = None,
    cheaper: Callable[[nn.Module, Any, Any], bool] | None = None,
) -> None:
    """Registers how ghost clipping handles ``module_type`` (replacing any rule it had).

    Args:
        module_type: an ``nn.Module`` subclass, or its qualified name as a
            string (``"transformers.pytorch_utils.Conv1D"``) so that its
            library need not be imported. Subclasses are covered while they
            keep this class's ``forward``.
        gradients: ``gradients(module, x, g, weights) -> {attr: Outer |
            Tensor}`` for one call: ``x`` is the layer's first input and
            ``g`` the loss's gradient with respect to its output, each with
            a leading batch dimension ``B``; ``weights`` maps each parameter
            attribute to the tensor the step used (read it, not the
            module's attribute, which a functional step does not update).
            It must return a form for every trainable
            parameter attribute of the module (``"weight"``, ``"bias"``),
            each equal to that example's gradient through this call.
        check: ``check(module, x, output) -> str``, called once per plan on
            one example's input and output: a non-empty reason sends the
            module's parameters to the vmap path.
        cheaper: ``cheaper(module, x, output) -> bool`` for
            ``method="auto"``; ``False`` leaves the module to vmap. Default:
            always ghost.

    The rule is trusted: a wrong one breaks the privacy guarantee. Test it as
    dpfunc's own are tested, against ``method="vmap"`` (same clipped sum and
    norms) on examples that get clipped and examples that do not.

    Raises:
        TypeError: ``module_type`` is neither an ``nn.Module`` subclass nor a
            string, or ``gradients`` is not callable.
    """
    if not (isinstance(module_type, str) or
            (isinstance(module_type, type) and issubclass(module_type, nn.Module))):  # fmt: skip
        raise TypeError(
            "module_type must be an nn.Module subclass or its qualified name, got "
            f"module_type={module_type!r}"
        )
    if not callable(gradients):
        raise TypeError(f"gradients must be callable, got {type(gradients).__name__}")
    _RULES[module_type] = Rule(gradients, check, cheaper)


def register_unrolled(module_type: type, rule: Rule) -> None:
    """dpfunc's own layers that run themselves in a ghost pass (recurrent, attention)."""
    _RULES[module_type] = rule


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def rule_for(module: nn.Module) -> tuple[Rule | None, str]:
    """``(rule, "")`` for a module ghost clipping covers, else ``(None, reason)``."""
    parametrizations = getattr(module, "parametrizations", None)
    if isinstance(parametrizations, nn.ModuleDict) and len(parametrizations):
        return None, "has parametrizations"
    if "forward" in module.__dict__:
        return None, "its forward is replaced on the instance"
    cls = torch_class(type(module))
    for base in cls.__mro__:
        rule = _RULES.get(base) or _RULES.get(_qualified(base))
        if rule is None:
            continue
        if rule.unrolled and base is not cls:
            return None, f"{cls.__name__} is a subclass of {base.__name__}"
        for method in ("forward", "_conv_forward"):
            if getattr(cls, method, None) is not getattr(base, method, None):
                return None, f"{cls.__name__} overrides {base.__name__}.{method}"
        return rule, ""
    return None, f"{cls.__name__} has no ghost rule"
