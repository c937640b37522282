"""``nn.Conv1d`` and ``nn.Conv2d``: a Linear map over the ``unfold``-ed input patches, per group.

Any stride, padding, padding mode, dilation and groups. The output pixels of
an example (of every image, when one example holds several) are the
positions; ``d_in`` is one unfolded patch of a group.
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor, nn

from .bounds import widen
from .linear import cheaper as linear_cheaper
from .registry import Outer, register_rule


def convolution(module: nn.Conv1d | nn.Conv2d, x: Tensor, g: Tensor, weights: dict) -> dict:
    nd = len(module.kernel_size)
    c_in, c_out, groups = module.in_channels, module.out_channels, module.groups
    b = g.shape[0]
    x = widen(x.reshape(-1, c_in, *x.shape[x.dim() - nd :]).to(g.dtype))  # [B * N, C_in, ...]
    g = widen(g.reshape(x.shape[0], c_out, -1))  # [B * N, C_out, L]; half: float32 sums
    padding = module._reversed_padding_repeated_twice
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    if any(padding):
        x = F.pad(x, padding, mode=mode)
    kernel, dilation, stride = module.kernel_size, module.dilation, module.stride
    if nd == 1:
        x, kernel, dilation, stride = x.unsqueeze(-2), (1, *kernel), (1, *dilation), (1, *stride)
    u = F.unfold(x, kernel, dilation=dilation, stride=stride)  # [B * N, C_in * k, L]
    length = u.shape[-1]
    d_in, d_out = c_in // groups * math.prod(module.kernel_size), c_out // groups
    # [B, groups, N * L, d]
    u = u.reshape(b, -1, groups, d_in, length).permute(0, 2, 1, 4, 3).reshape(b, groups, -1, d_in)
    g_t = g.reshape(b, -1, groups, d_out, length).permute(0, 2, 1, 4, 3)
    g_t = g_t.reshape(b, groups, -1, d_out)
    return {"weight": Outer(g_t, u), "bias": g_t.sum(2).reshape(b, c_out)}


def check(module: nn.Conv1d | nn.Conv2d, x: Tensor, output: Tensor) -> str:
    rank = module.weight.dim()
    return "" if x.dim() in (rank - 1, rank) else f"input of rank {x.dim()}"


def cheaper(module: nn.Conv1d | nn.Conv2d, x: Tensor, output: Tensor) -> bool:
    d_in = module.in_channels // module.groups * math.prod(module.kernel_size)
    d_out = module.out_channels // module.groups
    return linear_cheaper(d_in, d_out, output.numel() // module.out_channels)


register_rule(nn.Conv1d, convolution, check=check, cheaper=cheaper)
register_rule(nn.Conv2d, convolution, check=check, cheaper=cheaper)
