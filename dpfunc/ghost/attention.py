"""``nn.MultiheadAttention``: its input projections and its output projection, as Linear maps.

The module computes ``q = query W_q^T + b_q`` (likewise ``k``, ``v``; the
three weights are the blocks of ``in_proj_weight``, or ``q_proj_weight``,
... when ``kdim``/``vdim`` differ), attends, and projects the result ``o``
with ``out_proj``. Each projection is a Linear layer over the positions, so
its per-example gradient is ``G^T A``. The module runs all of this in one
function, so in a ghost pass it runs itself (:mod:`dpfunc.ghost.dispatch`):
it projects ``q``, ``k`` and ``v`` with a probe on each, hands them to
torch's own ``F.multi_head_attention_forward`` with identity projections
(exact: a product by 1 and a sum with zeros), which keeps every mask,
dropout and weighting option as torch has it, and applies ``out_proj``
with a probe on its output.

Self-attention (``query is key is value``) stacks the three gradients
beside each other (``[G_q, G_k, G_v]^T x``); otherwise each block of
``in_proj_weight`` gets its own positions. Not covered: ``add_bias_kv``
(the appended key and value biases have no rule).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .linear import positions
from .registry import Outer, Rule, register_unrolled

SITES = ("q", "k", "v")


def _inputs(module: nn.MultiheadAttention, args: tuple, kwargs: dict):
    names = ("query", "key", "value")
    query, key, value = (args[i] if i < len(args) else kwargs[n] for i, n in enumerate(names))
    return query, key, value


def probe_shapes(module: nn.MultiheadAttention, args: tuple, kwargs: dict) -> dict:
    """site -> one example's probe shape, in the ``[L, N, E]`` layout the projections use."""
    query, key, _ = _inputs(module, args, kwargs)
    e = module.embed_dim

    def layout(x: Tensor) -> tuple[int, ...]:
        if x.dim() == 2:
            return (x.shape[0], e)
        return (x.shape[1], x.shape[0], e) if module.batch_first else (x.shape[0], x.shape[1], e)

    return {"q": layout(query), "k": layout(key), "v": layout(key), "out": layout(query)}


def run(module: nn.MultiheadAttention, probes: dict, record: dict, query, key, value,
        key_padding_mask=None, need_weights=True, attn_mask=None, average_attn_weights=True,
        is_causal=False):  # fmt: skip
    """The module's forward with a probe on each projection; ``record`` gets their inputs."""
    batched = query.dim() == 3
    if module.batch_first and batched:
        query, key, value = (x.transpose(0, 1) for x in (query, key, value))
    if module._qkv_same_embed_dim:
        w_q, w_k, w_v = module.in_proj_weight.chunk(3)
    else:
        w_q, w_k, w_v = module.q_proj_weight, module.k_proj_weight, module.v_proj_weight
    b_q = b_k = b_v = None
    if module.in_proj_bias is not None:
        b_q, b_k, b_v = module.in_proj_bias.chunk(3)
    shared = query is key and key is value  # self-attention: one input, recorded once
    projected = []
    for site, x, w, b in zip(SITES, (query, key, value), (w_q, w_k, w_v), (b_q, b_k, b_v)):
        if site == "q" or not shared:
            record[site] = x
        projected.append(F.linear(x, w, b) + probes[site])
    e = module.embed_dim
    eye = torch.eye(e, dtype=projected[0].dtype, device=projected[0].device)
    attended, weights = F.multi_head_attention_forward(
        *projected, e, module.num_heads, None, None, None, None, module.add_zero_attn,
        module.dropout, eye, None, training=module.training,
        key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask,
        use_separate_proj_weight=True, q_proj_weight=eye, k_proj_weight=eye,
        v_proj_weight=eye, average_attn_weights=average_attn_weights, is_causal=is_causal,
    )  # fmt: skip
    record["out"] = attended
    out = F.linear(attended, module.out_proj.weight, module.out_proj.bias) + probes["out"]
    if module.batch_first and batched:
        out = out.transpose(0, 1)
    return out, weights


def attention(module: nn.MultiheadAttention, inputs: dict, grads: dict, weights: dict) -> dict:
    shared = "k" not in inputs  # self-attention: q, k and v projected one input
    a, g = {}, {}
    for site in (*SITES, "out"):
        a[site], g[site] = positions(inputs["q" if shared else site], grads[site])
    out = {"out_proj.weight": Outer(g["out"], a["out"]), "out_proj.bias": g["out"].sum(1)}
    if "in_proj_bias" in weights:
        out["in_proj_bias"] = torch.cat([g[s].sum(1) for s in SITES], -1)
    if not module._qkv_same_embed_dim:
        for s in SITES:
            out[f"{s}_proj_weight"] = Outer(g[s], a[s])
    elif shared:
        out["in_proj_weight"] = Outer(torch.cat([g[s] for s in SITES], -1), a["q"])
    else:  # each block of rows over its own positions: [G_q, 0, 0], [0, G_k, 0], [0, 0, G_v]
        blocks = [
            torch.cat([g[s] if s == t else torch.zeros_like(g[s]) for t in SITES], -1)
            for s in SITES
        ]
        out["in_proj_weight"] = Outer(torch.cat(blocks, 1), torch.cat([a[s] for s in SITES], 1))
    return out


def check(module: nn.MultiheadAttention, x, output) -> str:
    if module.bias_k is not None or module.bias_v is not None:
        return "MultiheadAttention with add_bias_kv has no ghost rule"
    if not isinstance(x, Tensor) or x.dim() not in (2, 3):
        return "its query is not a tensor of rank 2 or 3"
    return ""


register_unrolled(
    nn.MultiheadAttention,
    Rule(
        attention,
        check=check,
        run=run,
        probe_shapes=probe_shapes,
        owns=("out_proj.weight", "out_proj.bias"),
    ),  # fmt: skip
)
