"""Linear maps: ``nn.Linear`` and transformers' ``Conv1D`` (GPT-2's projections).

Over the positions ``T`` between the first and the last dimension, a Linear
layer's weight gradient is ``G^T A`` and its bias gradient ``sum_t G_t``
(Goodfellow 2015). ``Conv1D`` is the same map with the weight stored
transposed (``[d_in, d_out]``), so its gradient is ``A^T G``.
"""

from __future__ import annotations

from torch import Tensor, nn

from .bounds import gram_is_cheaper, widen
from .registry import Outer, register_rule


def positions(x: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """``(A [B, T, d_in], G [B, T, d_out])``: every leading position of one example as a row.

    ``x`` is first rounded to the dtype of ``g`` (the layer's output: autocast
    rounds a float32 input to bf16 before the product, part of the forward),
    then both are widened to float32 if half, so the bias sum is float32's.
    """
    b = g.shape[0]
    g = g.reshape(b, -1, g.shape[-1])
    return widen(x.reshape(b, -1, x.shape[-1]).to(g.dtype)), widen(g)


def cheaper(d_in: int, d_out: int, t: int) -> bool:
    """Whether the norm of ``sum_t g_t a_t^T`` is cheaper from Gram matrices than formed.

    True for one position (the rank-one form) or ``T (d_in + d_out) < d_in
    d_out``: the two ``T x T`` Gram matrices cost ``T^2 (d_in + d_out)``
    multiply-adds an example, the formed gradient ``T d_in d_out``
    (:func:`dpfunc.ghost.bounds.gram_is_cheaper`, the choice
    :func:`dpfunc.ghost.bounds.linear_weight_norms` makes). ``False`` means
    the direct form, which forms the gradient anyway.
    """
    return gram_is_cheaper(t, d_in, d_out)


def linear(module: nn.Linear, x: Tensor, g: Tensor, weights: dict) -> dict:
    a, g = positions(x, g)
    return {"weight": Outer(g, a), "bias": g.sum(1)}


def conv1d(module: nn.Module, x: Tensor, g: Tensor, weights: dict) -> dict:
    a, g = positions(x, g)
    return {"weight": Outer(a, g), "bias": g.sum(1)}


def _linear_cheaper(module: nn.Linear, x: Tensor, output: Tensor) -> bool:
    return cheaper(module.in_features, module.out_features, x.numel() // module.in_features)


def _conv1d_cheaper(module: nn.Module, x: Tensor, output: Tensor) -> bool:
    d_in, d_out = module.weight.shape
    return cheaper(d_in, d_out, x.numel() // d_in)


register_rule(nn.Linear, linear, cheaper=_linear_cheaper)
register_rule("transformers.pytorch_utils.Conv1D", conv1d, cheaper=_conv1d_cheaper)
