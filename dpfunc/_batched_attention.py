"""Scaled dot-product attention under ``vmap``: torch's math kernel, where its memory is small.

``torch.func.vmap`` has no batching rule for the fused attention kernels
(on a CPU, ``_scaled_dot_product_flash_attention_for_cpu`` and its
backward). It falls back to a loop over the examples, one kernel call each,
and ``torch.compile`` unrolls that loop into the graph: a tiny BERT's
compiled private step held 64 attention calls and 64 backward calls per
step, two per example, against two in the non-private step. The math kernel
(``SDPBackend.MATH``) is made of matrix products and a softmax, which vmap
batches and Inductor fuses.

The math kernel holds the attention scores of every example at once (the
scores, the probabilities kept for the backward, their gradients), where
the fallback holds one example's. :func:`batched_attention` therefore
chooses it only for calls whose scores over all mapped examples have at
most :data:`MATH_SCORES` entries, and leaves larger ones (long sequences)
to the fallback. Either kernel computes the same attention; they round
differently.

Only compiled steps switch (:func:`dpfunc.per_sample.vmap_over_examples`):
eagerly the fallback loop was as fast as the math kernel or faster (tiny
BERT, batch 32, one thread: ghost step 165 ms either way, vmap step 149 ms
against 165 ms).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

MATH_SCORES = 2**24
"""Attention scores (rows x heads x queries x keys) up to which a call under vmap runs the
math kernel: 64 MiB per float32 copy, of which the kernel holds about four."""


class _MathWhenSmall(TorchFunctionMode):
    """Runs each small ``F.scaled_dot_product_attention`` call with the math kernel."""

    def __init__(self, rows: int):
        super().__init__()
        self.rows = rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and len(args) >= 2:
            query, key = args[0], args[1]
            scores = self.rows * query.shape[:-1].numel() * key.shape[-2]
            if scores <= MATH_SCORES:
                with sdpa_kernel(SDPBackend.MATH):
                    return func(*args, **kwargs)
        return func(*args, **kwargs)


@contextmanager
def batched_attention(rows: int) -> Iterator[None]:
    """Within: attention calls of one example, mapped over ``rows`` examples by vmap, run the
    math kernel when their scores over all rows have at most :data:`MATH_SCORES` entries.

    ``rows``: the examples vmap maps at once (the batch, or its chunk size). Shapes
    only are read (public), never values. Dynamo traces the mode, so it works under
    ``torch.compile`` (and eagerly).
    """
    with _MathWhenSmall(rows):
        yield
