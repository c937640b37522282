"""Normalisation layers: ``grad weight_i = sum xhat_i * G_i``, ``grad bias_i = sum G_i``.

``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.RMSNorm`` and transformers'
``LlamaRMSNorm``. Their affine gradients are small, so they are formed per
example, from ``xhat`` recomputed exactly as the layer computes it (in
float32 for a half layer, as torch's kernels do inside), and summed in
float32 for half (see :mod:`dpfunc.ghost.bounds`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .bounds import widen
from .registry import register_rule


def layer_norm(module: nn.LayerNorm, x: Tensor, g: Tensor, weights: dict) -> dict:
    shape = tuple(module.normalized_shape)
    b = g.shape[0]
    x = widen(x.to(g.dtype))  # the layer's input as it computed (autocast casts it)
    g = widen(g.reshape(b, -1, *shape))
    xhat = F.layer_norm(x, shape, eps=module.eps).reshape(g.shape)
    return {"weight": (xhat * g).sum(1), "bias": g.sum(1)}


def group_norm(module: nn.GroupNorm, x: Tensor, g: Tensor, weights: dict) -> dict:
    channels = module.num_channels
    b = g.shape[0]
    x = widen(x.to(g.dtype))
    g = widen(g.reshape(b, -1, channels, math.prod(g.shape[3:]) if g.dim() > 3 else 1))
    x = x.reshape(-1, channels, g.shape[-1])
    xhat = F.group_norm(x, module.num_groups, eps=module.eps).reshape(g.shape)
    return {"weight": (xhat * g).sum((1, 3)), "bias": g.sum((1, 3))}


def rms_norm(module: nn.RMSNorm, x: Tensor, g: Tensor, weights: dict) -> dict:
    shape = tuple(module.normalized_shape)
    x = widen(x.to(g.dtype))
    g = widen(g.reshape(g.shape[0], -1, *shape))
    xhat = F.rms_norm(x, shape, eps=module.eps).reshape(g.shape)
    return {"weight": (xhat * g).sum(1)}


def llama_rms_norm(module: nn.Module, x: Tensor, g: Tensor, weights: dict) -> dict:
    """``weight * (x / rms(x))``, the normalisation in float32 then cast back, as Llama does."""
    h = x.to(torch.float32)
    xhat = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)).to(x.dtype)
    dim = module.weight.shape[-1]
    return {"weight": (widen(xhat.to(g.dtype)) * widen(g)).reshape(g.shape[0], -1, dim).sum(1)}


def _group_norm_check(module: nn.GroupNorm, x: Tensor, output: Tensor) -> str:
    return "" if x.dim() >= 2 else f"input of rank {x.dim()}"


register_rule(nn.LayerNorm, layer_norm)
register_rule(nn.GroupNorm, group_norm, check=_group_norm_check)
register_rule(nn.RMSNorm, rms_norm)
register_rule("transformers.models.llama.modeling_llama.LlamaRMSNorm", llama_rms_norm)
