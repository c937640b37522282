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
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["compile_fullgraph", "dynamo_settings"]

F = TypeVar("F", bound=Callable[..., Any])

# logging.Logger methods whose calls a compiled step leaves out (those that exist when called:
# transformers adds the *_once and advice methods to logging.Logger when it is imported)
QUIET_LOGGER_METHODS = ("debug", "info", "warning", "warning_once", "info_once", "warning_advice")


def dynamo_settings() -> dict[str, Any]:
    """The Dynamo settings dpfunc compiles under (see the module docstring)."""
    methods = {getattr(logging.Logger, name, None) for name in QUIET_LOGGER_METHODS}
    methods.discard(None)
    return {"allow_rnn": True, "ignore_logger_methods": methods}


def compile_fullgraph(fn: F) -> F:
    """``torch.compile(fn, fullgraph=True)``, called under :func:`dynamo_settings` only.

    The returned function compiles ``fn`` on its first call (and recompiles
    as torch decides) with the settings applied for the duration of each
    call; outside it, Dynamo's configuration is the caller's.
    """
    compiled = torch.compile(fn, fullgraph=True)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(**dynamo_settings()):
            return compiled(*args, **kwargs)

    return call  # type: ignore[return-value]
