"""Ghost clipping: per-example norms and the clipped sum without per-example gradients.

The vmap path materialises every example's gradient, ``B x P`` numbers. For a
layer whose weight gradient is a product of its input and its output gradient
(``grad_i = G_i^T A_i`` for ``nn.Linear``), the norm of each example's gradient
follows from ``A_i`` and ``G_i`` alone (Goodfellow 2015; Li et al. 2022,
"ghost clipping"), and so does the clipped sum ``sum_i c_i grad_i = (c * G)^T A``
(book-keeping, Bu et al. 2023, "Differentially private optimization on large
model at small cost"): one backward pass gives every ``A_i`` and ``G_i`` and no
second backward is needed.

Where each piece lives:

* :mod:`~dpfunc.ghost.registry`: the rules by layer type, :func:`register_rule`
  for a user's own layer, and :class:`Outer`, the form a rule returns;
* :mod:`~dpfunc.ghost.bounds`: norms that bound the rounding of the sum; bf16
  and fp16 forms are widened to float32 first, so the norms, their bounds and
  the clipped sum (float32 for half parameters) are float32's, as in the
  vmap path (see ``docs/precision.md``).
* one module per kind of layer: :mod:`~dpfunc.ghost.linear` (``nn.Linear``,
  transformers' ``Conv1D``), :mod:`~dpfunc.ghost.embedding`,
  :mod:`~dpfunc.ghost.convolution` (``nn.Conv1d``, ``nn.Conv2d``),
  :mod:`~dpfunc.ghost.normalization` (``nn.LayerNorm``, ``nn.GroupNorm``),
  :mod:`~dpfunc.ghost.recurrent` (``nn.RNN``, ``nn.GRU``, ``nn.LSTM``, unrolled),
  :mod:`~dpfunc.ghost.attention` (``nn.MultiheadAttention``'s projections);
  the last two run themselves in a ghost pass (:mod:`~dpfunc.ghost.dispatch`);
* :mod:`~dpfunc.ghost.hooks`: the forward hooks dpfunc keeps on a model's
  covered layers, inert outside a pass;
* :mod:`~dpfunc.ghost.planner`: the analysis pass that decides, parameter by
  parameter, what is ghosted (a parameter used at several sites, such as tied
  input and output embeddings or a layer called twice, is ghosted when every
  site is);
* :mod:`~dpfunc.ghost.runtime`: the ghost pass, whose norms go through the
  same :class:`~dpfunc.clipping.ClippingPolicy` as the vmap path's;
* :mod:`~dpfunc.ghost.clipper`: :class:`GhostClipper`, what a step keeps: the
  plans by batch structure and ``method="auto"``'s timing;

Each module imports only modules listed above it, so none imports another in
a circle; the rest of dpfunc uses what this package exports.

The contract every rule keeps: each example's norm is an upper bound on the
norm of the contribution actually summed, rounding included. Where TF32
could round past those bounds on CUDA, the module falls back. Everything a
rule does not cover falls back to per-example gradients from ``vmap`` in the
same pass; ``TrainStep.explain`` says which parameters and why.
"""

from . import (  # registers the rules
    attention,
    convolution,
    embedding,
    embedding_bag,
    linear,
    normalization,
    recurrent,
)
from .bounds import linear_weight_norms
from .clipper import GhostClipper
from .hooks import install_hooks, remove_hooks
from .planner import GhostModule, GhostPlan, analyse, tf32_risk
from .registry import Outer, Rule, register_rule, rule_for, torch_class
from .runtime import ghost_clip

__all__ = [
    "GhostClipper",
    "GhostModule",
    "GhostPlan",
    "Outer",
    "Rule",
    "analyse",
    "attention",
    "convolution",
    "embedding",
    "embedding_bag",
    "ghost_clip",
    "install_hooks",
    "linear",
    "linear_weight_norms",
    "normalization",
    "recurrent",
    "register_rule",
    "remove_hooks",
    "rule_for",
    "tf32_risk",
    "torch_class",
]
