"""Layers that run themselves in a ghost pass: a fused kernel hides the gradients a rule needs.

``nn.LSTM`` runs one fused kernel over the sequence, and
``nn.MultiheadAttention`` one function from its input to its output
projection: a probe on the layer's output alone gives neither the gate nor
the projection gradients. While ghost hooks are on such a module, its class
is swapped for a subclass whose ``forward``, in a ghost pass that planned
the module, runs the rule's own equivalent forward with a probe at every
site; elsewhere (the analysis pass, ordinary calls) it is the module's own.

A class, not an instance attribute, so that copies (``deepcopy``, DataParallel
replicas) dispatch on themselves. The ``(hooks, path)`` sites of every model
sharing the module are kept in its ``__dict__``.
"""

from __future__ import annotations

from torch import nn

from .registry import UNDERLYING, torch_class

__all__ = ["attach", "detach"]


class _Dispatching:
    def forward(self, *args, **kwargs):
        for hooks, path in self.__dict__.get("_dpfunc_ghost_sites", ()):
            run = getattr(hooks.ctx, "run_unrolled", None)
            if run is not None and path in hooks.ctx.probes:
                return run(path, self, args, kwargs)
        return super().forward(*args, **kwargs)


_DISPATCHING: dict[type, type] = {}


def attach(module: nn.Module, hooks, path: str) -> None:
    """Makes ``module`` run its rule's forward in ghost passes of ``hooks`` that plan it."""
    cls = torch_class(type(module))
    if cls not in _DISPATCHING:
        ours = type(f"_Dispatching{cls.__name__}", (_Dispatching, cls), {"__module__": __name__})
        _DISPATCHING[cls] = ours
        UNDERLYING[ours] = cls
    module.__class__ = _DISPATCHING[cls]
    module.__dict__.setdefault("_dpfunc_ghost_sites", []).append((hooks, path))


def detach(module: nn.Module, hooks) -> None:
    """Undoes :func:`attach` for ``hooks``; the module's own class once none is left."""
    sites = module.__dict__.get("_dpfunc_ghost_sites")
    if sites is None:
        return
    sites[:] = [(h, p) for h, p in sites if h is not hooks]
    if not sites:
        del module.__dict__["_dpfunc_ghost_sites"]
        module.__class__ = torch_class(type(module))
