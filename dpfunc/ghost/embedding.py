"""``nn.Embedding``: ``grad W_i[v] = sum_{t: idx_t = v} G_i[t]``, except the ``padding_idx`` row.

The gradient is ``onehot(idx)^T G``, an outer-product form whose one-hot
side is exact, so its Gram matrix is the equality of token indices.
"""

from __future__ import annotations

from torch import Tensor, nn

from .registry import Outer, register_rule, torch_class


def embedding(module: nn.Embedding, idx: Tensor, g: Tensor, weights: dict) -> dict:
    b = g.shape[0]
    idx = idx.reshape(b, -1)
    g = g.reshape(b, -1, module.embedding_dim)
    if module.padding_idx is not None:  # the padding row gets no gradient
        g = g.masked_fill((idx == module.padding_idx)[..., None], 0)
    return {"weight": Outer(idx, g)}


def check(module: nn.Embedding | nn.EmbeddingBag, idx: Tensor, output) -> str:
    """Why a call cannot be ghosted (``""`` when it can); ``nn.EmbeddingBag`` shares it."""
    name = torch_class(type(module)).__name__  # a ghosted EmbeddingBag is a dpfunc subclass
    if module.max_norm is not None:
        return f"{name} with max_norm renormalises its weight in place"
    if module.scale_grad_by_freq:
        return f"{name} with scale_grad_by_freq has no ghost rule"
    if module.sparse:
        return f"sparse {name} has no ghost rule"
    if not isinstance(idx, Tensor) or idx.is_floating_point() or idx.is_complex():
        return "input is not an integer tensor"
    return ""


def cheaper(module: nn.Embedding | nn.EmbeddingBag, idx: Tensor, output) -> bool:
    """The Gram form costs ``T^2 * dim`` multiply-adds against about three passes over
    the ``num_embeddings x dim`` gradient (write, norm, weighted sum), and a float moved
    through memory costs several multiply-adds on a CPU: ghost when ``T^2 < 16 *
    num_embeddings``. (With 1000 rows, ghosting was faster and leaner at ``T = 32`` and
    ``T = 64``: 24 against 29 ms and 53 against 120 MB for the LSTM benchmark step, 52
    against 59 ms for the transformer one, eager.) ``nn.EmbeddingBag`` shares it, ``T``
    counting the positions of every bag."""
    return idx.numel() ** 2 < 16 * module.num_embeddings


register_rule(nn.Embedding, embedding, check=check, cheaper=cheaper)
