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

import warnings

import torch
from torch import Tensor, nn

from ._checks import BATCH_NORMS, check_int, check_per_example  # noqa: F401 (check_per_example: public here)
from .ghost import torch_class
from .tree import Params


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


def replace_batchnorm(module: nn.Module, max_groups: int = 32) -> nn.Module:
    """Replaces every BatchNorm in ``module`` with a GroupNorm on the same channels.

    GroupNorm (Wu & He 2018) normalises each example on its own, the usual
    substitute in DP-SGD. Each ``BatchNorm*d(C)`` becomes ``GroupNorm(G, C)``
    where ``G`` is the largest divisor of ``C`` with ``G <= max_groups`` and at
    least two channels per group (``C // G >= 2``): with one channel per group
    a ``BatchNorm1d`` input of shape ``[N, C]`` would be normalised over a
    single value, and every output would be its bias alone. ``eps`` is kept;
    the affine weight and bias are copied (``requires_grad`` included), and
    ``affine=False`` stays ``affine=False``. Running statistics are dropped:
    GroupNorm has none. Dtype and device follow the BatchNorm's.

    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     [replace_batchnorm(nn.BatchNorm1d(c)).num_groups for c in (2, 3, 6, 32, 96)]
    [1, 1, 3, 16, 32]

    Submodules are replaced in place; the (possibly new) root is returned, so
    use ``model = replace_batchnorm(model)``. One ``UserWarning`` lists every
    replacement, e.g. ``"1.0: BatchNorm2d(32) -> GroupNorm(16, 32)"``; nothing
    is warned when there is no BatchNorm.

    Raises:
        ValueError: ``max_groups`` is not an int >= 1; a BatchNorm has one
            channel (no group of two channels exists: one channel alone
            normalises each example over its positions only, and over a
            single value for ``[N, 1]`` inputs, so pick a replacement by hand,
            e.g. ``nn.Identity()``, or ``nn.GroupNorm(1, 1)`` where the input
            has positions to normalise over); a lazy BatchNorm has not yet
            seen an input. The message names the module; nothing is replaced
            when any module is refused.
    """
    max_groups = check_int("max_groups", max_groups, minimum=1)
    found = [
        (path, sub)
        for path, sub in module.named_modules(remove_duplicate=False)
        if isinstance(sub, BATCH_NORMS)
    ]
    norms = {}  # id(BatchNorm) -> its GroupNorm, so that a shared BatchNorm stays shared
    for path, bn in found:
        norms.setdefault(id(bn), _group_norm_for(path, bn, max_groups))
    if not found:
        return module
    warnings.warn(
        f"replace_batchnorm replaced {len(found)} BatchNorm module(s): "
        + "; ".join(
            f"{path or '(root)'}: {type(bn).__name__}({bn.num_features}) -> "
            f"GroupNorm({norms[id(bn)].num_groups}, {bn.num_features})"
            for path, bn in found
        ),
        UserWarning,
        stacklevel=2,
    )
    if found[0][0] == "":
        return norms[id(module)]
    for path, bn in found:
        parent, _, name = path.rpartition(".")
        setattr(module.get_submodule(parent), name, norms[id(bn)])
    return module


def _group_norm_for(path: str, bn: nn.Module, max_groups: int) -> nn.GroupNorm:
    where = f"module {path!r}" if path else "the root module"
    if isinstance(bn, nn.modules.lazy.LazyModuleMixin) and bn.has_uninitialized_params():
        raise ValueError(
            f"{where} is {type(bn).__name__} and has not seen an input yet, so its number "
            "of channels is unknown; run one forward pass before replace_batchnorm"
        )
    channels = bn.num_features
    groups = [g for g in range(1, min(max_groups, channels // 2) + 1) if channels % g == 0]
    if not groups:
        raise ValueError(
            f"{where} is {type(bn).__name__}({channels}); GroupNorm needs at least two "
            "channels per group to normalise one example ([N, 1] inputs would be normalised "
            "over a single value). Replace it by hand: nn.Identity(), or nn.GroupNorm(1, 1) "
            "if its input has positions (length, height, width) to normalise over"
        )
    like = bn.weight if bn.affine else bn.running_mean
    factory = {} if like is None else {"device": like.device, "dtype": like.dtype}
    norm = nn.GroupNorm(groups[-1], channels, eps=bn.eps, affine=bn.affine, **factory)
    if bn.affine:
        with torch.no_grad():
            norm.weight.copy_(bn.weight)
            norm.bias.copy_(bn.bias)
        norm.weight.requires_grad_(bn.weight.requires_grad)
        norm.bias.requires_grad_(bn.bias.requires_grad)
    norm.train(bn.training)
    return norm


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
