"""What the per-example gradients of the vmap path cost in memory, and the chunk a budget allows.

The vmap path (:func:`dpfunc.per_sample_grads`) materialises every example's
gradient: ``rows x trainable entries`` numbers of the parameters' dtypes at
once, on top of what the non-private step holds. Those bytes are what a
``memory_budget`` bounds: with one, the step computes the clipped sum of a
micro-batch in chunks of rows (:func:`chunk_for_budget`), so that at most one
chunk's gradients are held at a time. The sum is the same up to the order of
float additions, which the clip margin covers (see
:meth:`dpfunc.clipper.Clipper.__call__`).

Everything here reads shapes and dtypes only, never values: the choices it
makes are public.
"""

from __future__ import annotations

import math
from typing import Any

from ._checks import check_int
from .tree import Params, tree_leaves

__all__ = [
    "GRADIENT_COPIES",
    "check_memory_budget",
    "chunk_for_budget",
    "example_gradient_bytes",
    "fits",
    "gradient_entries",
    "vmap_gradient_bytes",
]

GRADIENT_COPIES = 5
"""Bytes the vmap path holds per row, in units of one example's gradient bytes (measured).

Each row of a chunk holds its per-example gradient (1x) and what vmap keeps for its
backward: activations and output gradients, which depend on the model, not on its
parameter count. Measured on CPU (VmHWM, float32) from the peak's growth with the chunk
size: the MLP 784-512-256-10 1.0x, the bench's transformer 2.2x to 2.6x, its CNN (60,362
parameters, 32x32 images: activations larger than the parameters) 4.5x to 4.75x. The
largest, rounded up, so that a budget holds for such models too; dense models then use a
fifth of the budget. Not counted: what does not grow with the chunk (the parameters, one
float64 clipped sum, the noise; 14 MiB for the MLP)."""


def gradient_entries(params: Params) -> int:
    """The numbers in one example's gradient: the entries of every trainable parameter."""
    return sum(p.numel() for p in tree_leaves(params))


def example_gradient_bytes(params: Params) -> int:
    """Bytes of one example's gradient: each parameter's entries times its dtype's itemsize.

    >>> import torch
    >>> example_gradient_bytes({"w": torch.zeros(3, 2), "b": torch.zeros(3, dtype=torch.float64)})
    48
    """
    return sum(p.numel() * p.element_size() for p in tree_leaves(params))


def vmap_gradient_bytes(params: Params, rows: int) -> int:
    """Bytes the vmap path holds for ``rows`` rows of per-example gradients, with their
    temporaries: ``rows x example_gradient_bytes(params) x GRADIENT_COPIES``."""
    return math.ceil(rows * example_gradient_bytes(params) * GRADIENT_COPIES)


def check_memory_budget(memory_budget: Any) -> int | None:
    """``memory_budget`` as an int of bytes ``> 0``, or ``None`` (no budget).

    Raises:
        ValueError: anything else (a bool, a float, 0 or less), naming the value.
    """
    if memory_budget is None:
        return None
    try:
        return check_int("memory_budget", memory_budget, minimum=1)
    except ValueError:
        raise ValueError(
            "memory_budget must be an int of bytes > 0 (e.g. 2**30 for 1 GiB) or None for no "
            f"budget, got memory_budget={memory_budget!r}"
        ) from None


def chunk_for_budget(params: Params, rows: int, memory_budget: int | None) -> int | None:
    """The rows per chunk whose per-example gradients fit ``memory_budget`` bytes.

    ``None`` when there is no budget or all ``rows`` fit at once (no chunking
    needed); otherwise ``memory_budget // (example_gradient_bytes(params) x
    GRADIENT_COPIES)``, at least 1 (a budget below one example's gradient
    cannot be met by chunking; :func:`fits` says whether it is).

    >>> import torch
    >>> p = {"w": torch.zeros(1000)}          # 4,000 bytes an example, 20,000 held per row
    >>> chunk_for_budget(p, 64, 200_000), chunk_for_budget(p, 8, 200_000), chunk_for_budget(p, 8, 1)
    (10, None, 1)
    """
    if memory_budget is None or vmap_gradient_bytes(params, rows) <= memory_budget:
        return None
    per_row = example_gradient_bytes(params) * GRADIENT_COPIES
    return max(1, int(memory_budget // per_row))


def fits(params: Params, chunk_size: int, memory_budget: int | None) -> bool:
    """Whether ``chunk_size`` rows of per-example gradients fit ``memory_budget`` (or no budget)."""
    return memory_budget is None or vmap_gradient_bytes(params, chunk_size) <= memory_budget
