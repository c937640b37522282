"""From an ``nn.Module`` to a pytree of parameters.

``functionalize(model)`` splits a module's state into the trainable parameters
(the pytree DP-SGD differentiates, clips and noises) and everything else the
forward pass reads (buffers and frozen parameters). The loss then calls the
module with ``torch.func.functional_call(model, (params, buffers), args)``.

It also checks that the module has a per-example gradient at all: BatchNorm
normalises with statistics of the whole batch, so one example's output
depends on the others and no per-example gradient exists.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .ghost.dispatch import torch_class
from .tree import Params

_BATCH_NORMS = (nn.modules.batchnorm._BatchNorm,)


def functionalize(module: nn.Module) -> tuple[Params, dict[str, Tensor]]:
    """Splits ``module`` into ``(params, buffers)`` detached dicts.

    Args:
        module: any ``nn.Module`` that treats examples independently.

    Returns:
        ``params``: ``{name: tensor}`` for every parameter with
        ``requires_grad=True``, in ``named_parameters()`` order. A parameter
        shared by two modules (tied weights) appears once, under its first
        name, and ``functional_call`` ties it back.
        ``buffers``: every buffer, plus the frozen parameters
        (``requires_grad=False``), which the loss still uses but DP-SGD does
        not train.
        All tensors are detached and share storage with the module; dpfunc
        never writes into them.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: a submodule mixes examples (BatchNorm of any dimension);
            the message names its path and offers :func:`replace_batchnorm`.

    ``nn.RNN``, ``nn.GRU`` and ``nn.LSTM`` get a forward pre-hook that, when the caller
    passes no initial hidden state, passes zeros laid out like the input.
    This is exactly the module's own default, but built from the input so
    that ``vmap`` sees it as batched: torch 2.13 otherwise writes a batched
    result into an unbatched hidden state and fails under ``vmap``
    (for GRU and RNN always, for LSTM with more than one layer).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    check_per_example(module)
    for sub in module.modules():
        if torch_class(type(sub)) in (nn.RNN, nn.GRU, nn.LSTM) and not getattr(
            sub, "_dpfunc_hidden_hook", False
        ):
            sub.register_forward_pre_hook(_zero_hidden_state, with_kwargs=True)
            sub._dpfunc_hidden_hook = True
    params, buffers = {}, {}
    for name, p in module.named_parameters():
        (params if p.requires_grad else buffers)[name] = p.detach()
    for name, b in module.named_buffers():
        buffers[name] = b.detach()
    return params, buffers


def check_per_example(module: nn.Module) -> None:
    """Raises ``ValueError`` if a submodule of ``module`` mixes examples of a batch."""
    for path, sub in module.named_modules():
        if isinstance(sub, _BATCH_NORMS):
            where = f"module {path!r}" if path else "the root module"
            raise ValueError(
                f"{where} is {type(sub).__name__}, which normalises over the batch, so "
                "one example's gradient depends on the others and DP-SGD cannot bound "
                "it. Call dpfunc.replace_batchnorm(model) to swap in GroupNorm."
            )


def replace_batchnorm(module: nn.Module, max_groups: int = 32) -> nn.Module:
    """Replaces every BatchNorm in ``module`` with a GroupNorm on the same channels.

    Each ``BatchNorm*d(C)`` becomes ``GroupNorm(gcd(max_groups, C), C)`` with
    the same ``eps`` and ``affine`` (Wu & He 2018; the usual substitute in
    DP-SGD). Submodules are replaced in place; the (possibly new) root is
    returned, so use ``model = replace_batchnorm(model)``.
    """
    if max_groups < 1:
        raise ValueError(f"max_groups must be >= 1, got max_groups={max_groups!r}")
    if isinstance(module, _BATCH_NORMS):
        return _group_norm_for(module, max_groups)
    for name, child in module.named_children():
        setattr(module, name, replace_batchnorm(child, max_groups))
    return module


def _group_norm_for(bn: nn.Module, max_groups: int) -> nn.GroupNorm:
    channels = bn.num_features
    return nn.GroupNorm(math.gcd(max_groups, channels), channels, eps=bn.eps, affine=bn.affine)


def _zero_hidden_state(module: nn.RNNBase, args: tuple, kwargs: dict):
    x = args[0] if args else kwargs.get("input")
    hx = args[1] if len(args) > 1 else kwargs.get("hx")
    if len(args) > 2 or hx is not None or not isinstance(x, Tensor):
        return None  # the caller chose the hidden state, or passed a PackedSequence
    layers = module.num_layers * (2 if module.bidirectional else 1)
    if x.dim() == 3:
        batch_dim = 0 if module.batch_first else 1
        zeros = torch.zeros_like(x.detach().select(1 - batch_dim, 0)[..., :1])  # [N, 1]
        shape = (layers, x.shape[batch_dim])
        zeros = zeros.unsqueeze(0)
    else:
        zeros = torch.zeros_like(x.detach()[0, :1])  # [1]
        shape = (layers,)
    if isinstance(module, nn.LSTM):
        h_size = module.proj_size or module.hidden_size
        hx = (
            zeros.expand(*shape, h_size).contiguous(),
            zeros.expand(*shape, module.hidden_size).contiguous(),
        )
    else:
        hx = zeros.expand(*shape, module.hidden_size).contiguous()
    kwargs = {k: v for k, v in kwargs.items() if k not in ("input", "hx")}
    return (x, hx), kwargs
