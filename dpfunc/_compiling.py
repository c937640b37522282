"""How dpfunc compiles a step's pieces: ``torch.compile(fullgraph=True)`` in a scoped setting.

Two Dynamo settings that a private step of an ordinary model needs are off by
default, and dpfunc turns them on in a scope that ends with each compiled
call (``torch._dynamo.config.patch``), never globally, so a user's own
settings stay as they were:

* ``allow_rnn``: without it Dynamo refuses ``nn.RNN``, ``nn.GRU`` and
  ``nn.LSTM`` ("Attempted to wrap RNN, GRU, or LSTM").
* ``ignore_logger_methods``: without it Dynamo refuses, under
  ``fullgraph=True``, every call of a ``logging.Logger`` method in traced code.
  Hugging Face transformers log from inside the forward (a GPT-2 called with
  ``labels=`` reaches ``logger.warning_once`` in its ``loss_function``).
  Inside the compiled call the ``debug``, ``info`` and ``warning`` methods of
  every logger (and transformers' ``warning_once``, ``info_once`` and
  ``warning_advice``, when transformers is imported) are left out of the
  graph: the messages they would print are not printed by the compiled
  step, and nothing they do reaches the result. ``error`` and ``critical``
  are kept, so Dynamo still refuses code that logs an error.

The settings are read when Dynamo traces (the first call, and any
recompilation); applying them at every call keeps one setting for both.

The compiled function receives 0-d float64 CPU tensors (adaptive
clipping's clip norm, count and count noise, which the pieces take as
arguments) as 1-element views, and views them back to 0-d inside. Dynamo
gives every such input a symbolic float for its value (``FakeTensor.item_memo``),
and torch 2.13, unable to turn the symbol back into a tensor when the graph
does not read it through ``.item()``, specialises it at the end of tracing
(AOTAutograd's ``tensorify_python_scalars`` pass) and traces the whole
function again: 25 s of the 103 s first call of a tiny BERT's compiled step,
7 s of the MLP's 32 s. A 1-d tensor gets no such symbol. The values, the
aliasing and the results are the same. The train state holds its clip norm
1-element for the same reason (:class:`dpfunc.clipping.ClipState`), so a plain
``torch.compile(step)`` traces the step once too.

A user who compiles a step with recurrent layers themselves
(``torch.compile(step, fullgraph=True)``) without ``allow_rnn`` gets, from
:func:`check_allow_rnn` in the traced step, a message that names the layers
and the setting, instead of Dynamo's own refusal. Dynamo reports an
exception raised in traced code as its ``Unsupported`` error ("Observed
exception"), with this message in its text and the raising line.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.utils._pytree as pytree

F = TypeVar("F", bound=Callable[..., Any])

# logging.Logger methods whose calls a compiled step leaves out (those that exist when called:
# transformers adds the *_once and advice methods to logging.Logger when it is imported)
QUIET_LOGGER_METHODS = ("debug", "info", "warning", "warning_once", "info_once", "warning_advice")


def dynamo_settings() -> dict[str, Any]:
    """The Dynamo settings dpfunc compiles under (see the module docstring)."""
    methods = {getattr(logging.Logger, name, None) for name in QUIET_LOGGER_METHODS}
    methods.discard(None)
    if not hasattr(torch._dynamo.config, "ignore_logger_methods"):  # an older torch
        return {"allow_rnn": True}
    return {"allow_rnn": True, "ignore_logger_methods": methods}


def recurrent_paths(model: torch.nn.Module | None) -> tuple[str, ...]:
    """The paths of ``model``'s recurrent modules (``nn.RNN``, ``nn.GRU``, ``nn.LSTM``).

    ``()`` for ``model=None`` or a model without any; the root is ``""``.
    """
    if model is None:
        return ()
    return tuple(name for name, m in model.named_modules() if isinstance(m, torch.nn.RNNBase))


def check_allow_rnn(paths: tuple[str, ...]) -> None:
    """Raises while Dynamo traces recurrent layers that it would refuse.

    Args:
        paths: the recurrent modules' paths (:func:`recurrent_paths`).

    Raises:
        RuntimeError: ``paths`` is not empty, this runs inside
            ``torch.compile`` and ``torch._dynamo.config.allow_rnn`` is off.
            The message names the layers and the two ways out. Eagerly, and
            under :func:`compile_fullgraph`, it returns.
    """
    if paths and torch.compiler.is_compiling() and not torch._dynamo.config.allow_rnn:
        named = ", ".join(repr(p) for p in paths)
        raise RuntimeError(
            f"the model's recurrent layers ({named}) compile only with Dynamo's RNN support, "
            "off in this torch.compile call: compile the step with step.compile() (or "
            "Trainer(compile=True)), which turn it on for their calls only, or set "
            "torch._dynamo.config.allow_rnn = True before torch.compile(step, fullgraph=True)"
        )


def _float64_scalar(x: Any) -> bool:
    return (
        isinstance(x, torch.Tensor)
        and x.dim() == 0
        and x.dtype == torch.float64
        and x.device.type == "cpu"
    )


def _with_scalars(fn: Callable, spec: Any, lifted: tuple[bool, ...], *leaves: Any) -> Any:
    """``fn(*args, **kwargs)`` from the leaves of ``(args, kwargs)``, the ``lifted`` ones
    (0-d tensors passed in as 1-element views) viewed back to 0-d."""
    leaves = tuple(x.view(()) if up else x for x, up in zip(leaves, lifted))
    args, kwargs = pytree.tree_unflatten(list(leaves), spec)
    return fn(*args, **kwargs)


def compile_fullgraph(fn: F) -> F:
    """``torch.compile(fn, fullgraph=True)``, called under :func:`dynamo_settings` only.

    The returned function compiles ``fn`` on its first call (and recompiles
    as torch decides) with the settings applied for the duration of each
    call; outside it, Dynamo's configuration is the caller's. 0-d float64
    CPU tensors among the arguments reach the graph as 1-element views (see
    the module docstring); ``fn`` sees them 0-d, as passed.
    A ``ValueError`` or ``TypeError`` raised by code that Dynamo runs while
    it traces (dpfunc's ghost planner and its checks) is raised as itself,
    not wrapped in Dynamo's internal error.
    """
    compiled: dict[tuple, Callable] = {}  # by the arguments' structure

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        lifted = tuple(_float64_scalar(x) for x in leaves)
        key = (spec, lifted)
        if key not in compiled:
            compiled[key] = torch.compile(
                functools.partial(_with_scalars, fn, spec, lifted), fullgraph=True
            )
        leaves = [x.view(1) if up else x for x, up in zip(leaves, lifted)]
        with torch._dynamo.config.patch(**dynamo_settings()):
            try:
                return compiled[key](*leaves)
            except torch._dynamo.exc.InternalTorchDynamoError as error:
                # a ValueError or TypeError raised by code Dynamo runs while it traces (the ghost
                # planner's checks, such as a batched loss that mixes examples) reaches the
                # caller as itself, as it would eagerly
                if isinstance(error.__context__, (ValueError, TypeError)):
                    raise error.__context__ from None
                raise

    return call  # type: ignore[return-value]
