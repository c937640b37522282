"""Per-example gradients: ``vmap`` of ``grad`` over the batch.

The loss function sees ONE example, without a batch dimension, and returns
that example's scalar loss. ``vmap`` maps it over the leading dimension of the
batch, so each row of the result is exactly that example's own gradient:
there is no batch-size rescaling and no ``loss_reduction`` to get wrong.
Because the loss is any function ``torch.func`` can differentiate, losses
that contain their own derivatives (a Laplacian, a Hessian trace, a gradient
penalty) compose.

Under ``vmap`` the loss runs once for all examples, so Python code inside it
cannot branch on one example's values (``if mask.all():``, ``.item()``).
:func:`vmap_over_examples` says so in plain words when that happens, and
tells Hugging Face transformers that it is being traced: transformers checks
``padding_mask.all()`` to skip building an attention mask unless its
``is_tracing()`` says dynamo, jit or fx is tracing, and it knows nothing of
vmap. Its tracing path builds the mask always, which gives the same outputs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.func import grad_and_value, vmap

from .checks import check_int
from .tree import Params, PyTree, tree_leaves

LossFn = Callable[[Params, PyTree], Any]


def per_sample_grads(
    loss_fn: LossFn,
    params: Params,
    batch: PyTree,
    *,
    chunk_size: int | None = None,
    has_aux: bool = False,
):
    """Each example's gradient of ``loss_fn`` with respect to ``params``.

    Args:
        loss_fn: ``loss_fn(params, example) -> loss`` (or ``(loss, aux)`` with
            ``has_aux``) where ``example`` is one row of ``batch`` (every
            tensor leaf without its leading dimension) and ``loss`` is a
            0-d tensor.
        params: the pytree to differentiate (e.g. from ``functionalize``).
        batch: a pytree whose tensor leaves share a leading dimension ``B``.
        chunk_size: evaluate at most this many examples at once, bounding
            memory at the cost of speed; ``None`` does all ``B`` together.
            The result does not depend on it.
        has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` is batched too.

    Returns:
        ``grads`` (a tree like ``params`` whose leaves have shape
        ``[B, *param.shape]``), or ``(grads, aux)`` with ``has_aux``.
        ``grads[k][i]`` equals the gradient a batch-size-1 backward of
        ``loss_fn(params, example_i)`` gives, so ``grads[k].mean(0)`` is the
        gradient of the mean loss:

        >>> import torch
        >>> w = {"w": torch.tensor([1.0, 2.0])}
        >>> x = torch.tensor([[1.0, 0.0], [0.0, 3.0]])
        >>> per_sample_grads(lambda p, xi: (p["w"] * xi).sum() ** 2 / 2, w, x)["w"]
        tensor([[ 1.,  0.],
                [ 0., 18.]])

    Random operations in the loss (dropout) draw independently per example.

    Raises:
        ValueError: leading dimensions of ``batch`` disagree, ``batch`` has no
            tensor leaf, ``chunk_size`` < 1, or the loss is not a scalar.
    """
    grads, _, aux = _grads_and_losses(loss_fn, params, batch, chunk_size, has_aux)
    return (grads, aux) if has_aux else grads


def per_sample_grads_and_losses(
    loss_fn: LossFn, params: Params, batch: PyTree, *, chunk_size: int | None = None
) -> tuple[Params, Tensor]:
    """Like :func:`per_sample_grads`, also returning each example's loss ``[B]``."""
    grads, losses, _ = _grads_and_losses(loss_fn, params, batch, chunk_size, False)
    return grads, losses


def batch_size(batch: PyTree, name: str = "batch") -> int:
    """The shared leading dimension of the tensor leaves of ``batch``.

    Raises ``ValueError`` when there is no tensor leaf with a leading
    dimension or the leading dimensions disagree.
    """
    sizes = [x.shape[0] if x.dim() else None for x in tree_leaves(batch) if isinstance(x, Tensor)]
    if not sizes or None in sizes:
        raise ValueError(
            f"every tensor in {name} needs a leading batch dimension; got leaf "
            f"shapes {[tuple(x.shape) for x in tree_leaves(batch) if isinstance(x, Tensor)]}"
        )
    if len(set(sizes)) != 1:
        raise ValueError(f"{name}'s tensors must share one leading dimension, got sizes {sizes}")
    return sizes[0]


def _grads_and_losses(loss_fn, params, batch, chunk_size, has_aux):
    batch_size(batch)
    if chunk_size is not None:
        check_int("chunk_size", chunk_size, minimum=1)

    def example_loss(p, example):
        out = loss_fn(p, example)
        loss, aux = out if has_aux else (out, None)
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(
                "loss_fn must return one example's loss as a 0-d tensor, got "
                f"{shape}; loss_fn sees a single example without a batch dimension"
            )
        return (loss, aux) if has_aux else loss

    per_example = vmap_over_examples(
        grad_and_value(example_loss, has_aux=has_aux), in_dims=(None, 0), chunk_size=chunk_size
    )
    grads, value = per_example(params, batch)
    losses, aux = value if has_aux else (value, None)
    return grads, losses, aux


def vmap_over_examples(fn: Callable, *, in_dims: tuple, chunk_size: int | None) -> Callable:
    """``vmap(fn)`` over the examples, as every dpfunc path runs the user's loss.

    Random operations draw independently per example (``randomness=
    "different"``). While it runs eagerly, Hugging Face transformers' tracing
    guard answers yes (see the module docstring), so its models take their
    trace-safe path with padding masks. vmap's error for a branch on an
    example's value becomes a ``RuntimeError`` that names the cause and the
    way out.
    """
    mapped = vmap(fn, in_dims=in_dims, chunk_size=chunk_size, randomness="different")

    def run(*args):
        if torch.compiler.is_compiling():  # dynamo traces the loss: libraries see that
            return mapped(*args)
        with _libraries_see_tracing():
            try:
                return mapped(*args)
            except RuntimeError as error:
                if "data-dependent control flow" not in str(error):
                    raise
                raise RuntimeError(DATA_DEPENDENT) from error

    return run


DATA_DEPENDENT = (
    "loss_fn branches on a value of one example (a Python `if`, `bool()`, `.item()` or "
    "`.tolist()` on a tensor that comes from the example, e.g. `if mask.all():`). dpfunc "
    "runs loss_fn on all examples at once with torch.func.vmap, where one Python branch "
    "cannot follow each example's values. Write the branch as tensor code (torch.where, "
    "a multiplication by a mask, torch.cond), or decide it outside loss_fn and pass the "
    "result in with the example. (Hugging Face transformers' own mask checks are handled "
    "by dpfunc.) vmap's message follows in the cause above."
)


def _trace_safe() -> bool:
    return True


@contextmanager
def _libraries_see_tracing() -> Iterator[None]:
    """Hugging Face transformers' ``is_tracing()`` answers ``True`` inside this context.

    ``is_tracing`` is imported by name into every transformers module, so its
    global ``is_jit_tracing`` (which only ``is_tracing`` calls) is swapped in
    the one module that defines it, and restored on exit.
    """
    utils = sys.modules.get("transformers.utils.import_utils")
    original = getattr(utils, "is_jit_tracing", None)
    if original is None:
        yield
        return
    utils.is_jit_tracing = _trace_safe
    try:
        yield
    finally:
        utils.is_jit_tracing = original


__all__ = ["per_sample_grads", "per_sample_grads_and_losses", "batch_size", "vmap_over_examples"]
