"""Batched losses: one loss per example for a whole batch, and the common ones written out.

dpfunc's loss sees ONE example and returns its scalar loss; every path
(vmap, ghost clipping) is built on that contract, and it is the default. A
loss written for a batch, ``losses(params, batch) -> Tensor[B]`` with
``losses[i]`` the loss of example ``i`` alone, lets the ghost pass run the
model batched, without ``vmap``, as hook-based libraries do: the per-layer
inputs and output gradients of the whole batch come from one ordinary
forward and backward. :func:`batched_loss` marks such a function. The marked
loss is still a one-example loss (:class:`BatchedLoss` called on one example
runs it on a batch of one), so everything that takes a loss takes it, and
the vmap path, the planner and ``per_sample_grads`` see exactly that.

A batched loss is only right if example ``i``'s loss depends on example
``i`` alone: a mean over the batch, in-batch negatives or BatchNorm in
training mode mix examples, and a gradient computed from them is not any
example's gradient, so the clip bound would not bound it. This is Opacus'
``loss_reduction`` trap. dpfunc checks it on the first batch of each batch
structure, before anything is released (:mod:`dpfunc.ghost.batched`): the
losses and the per-example gradient norms of the batched pass must equal
those of the one-example loss on every example, or the step raises, naming
the cause.

The helpers below turn a model's outputs into per-example losses for the
usual heads, so a Hugging Face user writes no reduction by hand:
:func:`classification` (cross-entropy per example), :func:`causal_lm`
(next-token cross-entropy, each example's mean over its own labelled
tokens, ``-100`` ignored) and :func:`masked_lm` (the same without the
shift). Each takes ``logits`` shaped ``[B, ...]`` and returns ``Tensor[B]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .tree import Params, PyTree, tree_map

__all__ = [
    "IGNORE_INDEX",
    "BatchedLoss",
    "batched_loss",
    "causal_lm",
    "classification",
    "masked_lm",
]

IGNORE_INDEX = -100  # the label of a token without a loss (padding, a prompt), as transformers


class BatchedLoss:
    """A loss written for a batch, ``fn(params, batch) -> Tensor[B]``; build it with
    :func:`batched_loss`.

    Called as a one-example loss, ``loss(params, example)``, it runs ``fn`` on
    a batch of one (every tensor leaf of ``example`` given a leading
    dimension of 1) and returns that example's 0-d loss: the vmap path and
    the planner use it so. ``fn`` itself (``loss.batched``) is what the
    ghost pass runs on a whole batch.
    """

    def __init__(self, fn: Callable[[Params, PyTree], Tensor]):
        if not callable(fn):
            raise TypeError(f"batched_loss needs a callable fn(params, batch), got {fn!r}")
        self.batched = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, params: Params, example: PyTree) -> Tensor:
        one = tree_map(lambda t: t.unsqueeze(0) if isinstance(t, Tensor) else t, example)
        losses = self.batched(params, one)
        check_losses(losses, 1)
        return losses[0]

    def __repr__(self) -> str:
        return f"batched_loss({self.__name__})"


def batched_loss(fn: Callable[[Params, PyTree], Tensor]) -> BatchedLoss:
    """Marks ``fn(params, batch) -> Tensor[B]`` as a loss with one value per example.

    Use it as a decorator on a loss that calls the model on the whole batch
    and returns one loss per example, with no reduction over the batch.
    Ghost clipping then runs the model batched (no ``vmap``); elsewhere the
    loss is used one example at a time. The first batch of each structure is
    checked: example ``i``'s loss and gradient must be those of example ``i``
    alone (see the module docstring).

    >>> import torch, dpfunc
    >>> from torch.func import functional_call
    >>> model = torch.nn.Linear(3, 2)
    >>> params, buffers = dpfunc.functionalize(model)
    >>> @dpfunc.batched_loss
    ... def losses(p, batch):
    ...     x, y = batch
    ...     return dpfunc.losses.classification(functional_call(model, (p, buffers), (x,)), y)
    >>> x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    >>> losses(params, (x[0], y[0])).shape  # one example: a 0-d loss
    torch.Size([])
    """
    return fn if isinstance(fn, BatchedLoss) else BatchedLoss(fn)


def check_losses(losses: Any, rows: int) -> None:
    """Raises ``ValueError`` unless ``losses`` is a floating ``Tensor[rows]``."""
    if isinstance(losses, Tensor) and losses.shape == (rows,) and losses.is_floating_point():
        return
    got = (
        f"a {losses.dtype} tensor of shape {tuple(losses.shape)}"
        if isinstance(losses, Tensor)
        else f"a {type(losses).__name__}"
    )
    hint = (
        ": a 0-d loss is a reduction over the batch (a mean or a sum), which mixes examples; "
        "return the unreduced per-example losses (reduction='none', or dpfunc.losses' helpers)"
        if isinstance(losses, Tensor) and losses.dim() == 0
        else ""
    )
    raise ValueError(
        f"a batched loss must return one floating loss per example, shape ({rows},), got {got}"
        + hint
    )


def classification(logits: Tensor, labels: Tensor, *, label_smoothing: float = 0.0) -> Tensor:
    """Cross-entropy of each example: ``logits [B, K]``, ``labels [B]`` -> ``Tensor[B]``.

    >>> classification(torch.zeros(2, 4), torch.tensor([0, 3]))
    tensor([1.3863, 1.3863])
    """
    return F.cross_entropy(logits, labels, reduction="none", label_smoothing=label_smoothing)


def masked_lm(logits: Tensor, labels: Tensor, *, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Each example's mean cross-entropy over its labelled tokens (no shift).

    ``logits [B, T, V]``, ``labels [B, T]`` with ``ignore_index`` where a
    token has no loss. An example without any labelled token has loss 0 and
    gradient 0 (transformers' own mean over a batch of one gives NaN there).

    >>> labels = torch.tensor([[1, -100], [-100, -100]])
    >>> masked_lm(torch.zeros(2, 2, 4), labels)
    tensor([1.3863, 0.0000])
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} need labels of shape "
            f"{tuple(logits.shape[:-1])}, got labels of shape {tuple(labels.shape)}"
        )
    flat = logits.flatten(0, -2)
    if flat.dtype in (torch.bfloat16, torch.float16):  # as transformers: the loss in float32
        flat = flat.float()
    tokens = F.cross_entropy(flat, labels.flatten(), reduction="none", ignore_index=ignore_index)
    tokens = tokens.view(labels.shape)
    counted = (labels != ignore_index).sum(-1)
    return tokens.sum(-1) / counted.clamp(min=1)


def causal_lm(logits: Tensor, labels: Tensor, *, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Each example's mean next-token cross-entropy: token ``t`` predicts label ``t + 1``.

    The shift transformers' causal LM heads apply to ``labels=``: pass the
    labels aligned with the inputs (``input_ids`` with ``ignore_index`` on
    padding and on tokens without a loss), ``logits [B, T, V]``, ``labels
    [B, T]``. Equal, example by example, to ``model(..., labels=labels).loss``
    on a batch of one.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} need labels of shape "
            f"{tuple(logits.shape[:-1])}, got labels of shape {tuple(labels.shape)}"
        )
    return masked_lm(logits[:, :-1], labels[:, 1:], ignore_index=ignore_index)
