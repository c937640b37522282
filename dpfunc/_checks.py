"""Argument checks shared by the public functions, in one message style.

Every public function validates its arguments at its boundary, once, with
these helpers, so that a bad value always reads the same way::

    ValueError: sample_rate must be a number in (0, 1], got sample_rate=1.5

Booleans are refused where a number is expected (``True`` is an ``int`` in
Python, never a sample rate). Each helper returns the value in its
canonical Python type. Seeds have their own check
(:func:`dpfunc.noise.check_seed`), which never prints the value.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import optree
import torch

from .tree import leaves_in_any_order


def _fail(name: str, requirement: str, value: Any) -> ValueError:
    return ValueError(f"{name} must be {requirement}, got {name}={value!r}")


def check_number(
    name: str,
    value: Any,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    note: str = "",
) -> float:
    """``float(value)`` if it is a real number (not a bool) within the bounds.

    ``low`` and ``high`` are included unless ``low_open`` / ``high_open``;
    an infinite bound is always open unless the bound is included on
    purpose (``high=math.inf, high_open=False`` admits ``inf``). NaN is
    never within bounds. ``note`` is appended to the requirement, e.g.
    ``"(inf disables clipping)"``.

    >>> check_number("delta", 1e-5, low=0, high=1, low_open=True, high_open=True)
    1e-05
    >>> check_number("delta", 1.0, low=0, high=1, low_open=True, high_open=True)
    Traceback (most recent call last):
    ...
    ValueError: delta must be a number in (0, 1), got delta=1.0
    """
    requirement = _interval(low, high, low_open, high_open) + (f" {note}" if note else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(name, requirement, value)
    x = float(value)
    above = x > low if low_open else x >= low
    below = x < high if high_open else x <= high
    if not (above and below):
        raise _fail(name, requirement, value)
    return x


def _interval(low: float, high: float, low_open: bool, high_open: bool) -> str:
    if math.isinf(high) and high_open and math.isinf(low):
        return "a finite number"
    if math.isinf(high) and high_open:
        return f"a finite number {'>' if low_open else '>='} {_show(low)}"
    if math.isinf(high):
        return f"a number {'>' if low_open else '>='} {_show(low)}"
    if math.isinf(low):
        return f"a number {'<' if high_open else '<='} {_show(high)}"
    left, right = "(" if low_open else "[", ")" if high_open else "]"
    return f"a number in {left}{_show(low)}, {_show(high)}{right}"


def _show(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else repr(bound)


def check_int(name: str, value: Any, *, minimum: int = 0) -> int:
    """``int(value)`` if it is an integer (not a bool) ``>= minimum``.

    >>> check_int("steps", 3)
    3
    >>> check_int("physical_batch_size", 0, minimum=1)
    Traceback (most recent call last):
    ...
    ValueError: physical_batch_size must be an int >= 1, got physical_batch_size=0
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise _fail(name, f"an int >= {minimum}", value)
    return int(value)


def check_choice(name: str, value: Any, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices``.

    >>> check_choice("clipping", "flat", ("flat", "per_layer"))
    'flat'
    """
    if not isinstance(value, str) or value not in choices:
        raise _fail(name, "one of " + ", ".join(repr(c) for c in choices), value)
    return value


def check_params(params: Any) -> None:
    """Refuses a parameter dict that DP-SGD cannot train.

    ``params`` must be a non-empty dict of floating-point tensors, as
    :func:`dpfunc.functionalize` returns for a module with trainable
    parameters (frozen ones are left out there).

    >>> import torch
    >>> check_params({"w": torch.zeros(2, dtype=torch.int64)})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: params['w'] has dtype torch.int64; only floating-point tensors have gradients...
    """
    if not isinstance(params, dict):
        raise TypeError(
            "params must be a dict of name -> tensor, as dpfunc.functionalize(model)[0] "
            f"returns, got {type(params).__name__}"
        )
    if not params:
        raise ValueError(
            "params holds no trainable parameters (is every parameter frozen with "
            "requires_grad=False?); unfreeze at least one"
        )
    for name, value in params.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"params[{name!r}] must be a tensor, got {type(value).__name__}")
        if not value.dtype.is_floating_point:
            raise TypeError(
                f"params[{name!r}] has dtype {value.dtype}; only floating-point tensors have "
                "gradients (keep integer state in buffers)"
            )


def check_devices(params: Any, batch: Any, name: str = "batch") -> None:
    """Refuses a batch that is not on the parameters' device, and parameters on ``meta``.

    Where every parameter lives on one device, every tensor leaf of
    ``batch`` must live there too: torch would otherwise fail deep inside
    the per-example pass (or, on the ghost path, only after falling back to
    vmap), with a message that names neither the batch nor the fix.
    Parameters spread over several devices (a model split across GPUs) are
    not checked: such a model moves its activations itself. Devices are
    static, so this check is free inside a compiled function.

    Raises:
        ValueError: a parameter is on the ``meta`` device (shapes without
            values: nothing can be trained), or a tensor leaf of ``batch`` is
            on another device than the parameters; the message names the leaf.

    >>> import torch
    >>> check_devices({"w": torch.zeros(2)}, torch.zeros(3, 2, device="meta"))
    Traceback (most recent call last):
    ...
    ValueError: batch leaf <root> (shape (3, 2)) is on device meta but the parameters are on cpu...
    """
    leaves = leaves_in_any_order(params)  # one cheap walk each while Dynamo traces
    if not leaves:
        return
    if any(leaf.device.type == "meta" for leaf in leaves):
        raise ValueError(
            "the parameters are on the meta device, which holds shapes but no values; "
            "materialise the model (model.to_empty(device=...) and load its weights) "
            "before dpfunc.functionalize(model)"
        )
    device = leaves[0].device
    if any(leaf.device != device for leaf in leaves):
        return  # spread over several devices: the model moves activations itself
    tensors = [x for x in leaves_in_any_order(batch) if isinstance(x, torch.Tensor)]
    if all(x.device == device for x in tensors):
        return
    for path, leaf in zip(optree.tree_paths(batch), optree.tree_leaves(batch)):
        if isinstance(leaf, torch.Tensor) and leaf.device != device:
            where = "".join(f"[{key!r}]" for key in path) or "<root>"
            raise ValueError(
                f"{name} leaf {where} (shape {tuple(leaf.shape)}) is on device {leaf.device} "
                f"but the parameters are on {device}; move the data to the parameters' device: "
                "the Trainer gathers rows where a tensor dataset lives (pass the dataset "
                "after .to(device)), a hand-written loop moves each micro-batch with "
                ".to(device) (docs/devices.md)"
            )


BATCH_NORMS = (torch.nn.modules.batchnorm._BatchNorm,)  # normalise over the batch


def check_per_example(module: torch.nn.Module) -> None:
    """Raises ``ValueError`` if a submodule of ``module`` mixes examples or keeps what it reads.

    Refused, each with its path and what to use instead:

    - BatchNorm of any dimension (affine or not, in any mode): it
      normalises over the batch, so one example's gradient depends on the
      others and DP-SGD cannot bound it;
    - InstanceNorm with ``track_running_stats=True``: in training mode its
      forward writes running statistics of the data into its buffers,
      which no noise covers and ``state_dict`` ships;
    - ``Embedding`` and ``EmbeddingBag`` with ``max_norm``: the forward
      renormalises the rows the batch looks up, in place, so the weights
      move with the data outside the private gradient.

    Cheap (one walk over the modules): the private runs call it at every
    step, so a module added after a run was built is refused too.
    """
    for path, sub in module.named_modules():
        where = f"module {path!r}" if path else "the root module"
        if isinstance(sub, BATCH_NORMS):
            raise ValueError(
                f"{where} is {type(sub).__name__}, which normalises over the batch, so "
                "one example's gradient depends on the others and DP-SGD cannot bound "
                "it. Call dpfunc.replace_batchnorm(model) to swap in GroupNorm."
            )
        if isinstance(sub, torch.nn.modules.instancenorm._InstanceNorm) and (
            sub.track_running_stats
        ):
            raise ValueError(
                f"{where} is {type(sub).__name__}(track_running_stats=True): in training mode "
                "its forward writes running statistics of the data into its buffers, which "
                "no noise covers and the model's state_dict ships. Use "
                "track_running_stats=False (the default), which normalises each example "
                "by its own statistics in every mode"
            )
        if isinstance(sub, torch.nn.Embedding | torch.nn.EmbeddingBag) and (
            sub.max_norm is not None
        ):
            raise ValueError(
                f"{where} is {type(sub).__name__}(max_norm={sub.max_norm!r}): its forward "
                "renormalises the rows a batch looks up, in place, so the weights move "
                "with the data outside the private gradient (clipped and noised). Leave "
                "max_norm out (None); to bound the embeddings, clip or project them after "
                "each optimizer step, which reads only the released weights"
            )
