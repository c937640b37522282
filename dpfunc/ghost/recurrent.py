"""``nn.RNN``, ``nn.GRU``, ``nn.LSTM`` (``proj_size`` too): unrolled into their cell operations.

``nn.RNN``, ``nn.GRU`` and ``nn.LSTM`` run one fused kernel over the whole
sequence. torch has no vmap batching rule for it, so the vmap path runs it
example by example and its backward forms every time step's per-example
weight gradient separately. Ghost clipping needs something else: each gate
pre-activation's gradient ``G`` and the input ``A`` that multiplies each
weight, over all time steps, so that a weight's per-example gradient
``sum_t G_t^T A_t`` is a Linear layer's over ``T`` positions (see
:mod:`dpfunc.ghost.linear`). :func:`unrolled` computes the layer's output step by
step with the same equations as torch's kernels, adding a zero ``probe`` to
every gate pre-activation (its gradient is ``G``) and recording ``A``:

* ``ih_l{k}[_reverse]``: the layer's input sequence times ``weight_ih``;
* ``hh_l{k}[_reverse]``: the previous hidden state times ``weight_hh``;
* ``hr_l{k}[_reverse]`` (an LSTM with ``proj_size``): the unprojected hidden
  state times ``weight_hr``.

Each key names the weight and bias it feeds: ``weight_ih_l0`` and
``bias_ih_l0`` belong to site ``ih_l0``. Probes and records are laid out
``[T, N, features]`` in processing order (reversed for the backward
direction; a sum over time does not care).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .linear import positions
from .registry import Outer, Rule, register_unrolled, torch_class

GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}


def sites(module: nn.RNNBase) -> list[str]:
    """The probe sites of ``module``, one per weight matrix, in parameter order."""
    directions = ("", "_reverse") if module.bidirectional else ("",)
    kinds = ("ih", "hh", "hr") if module.proj_size else ("ih", "hh")
    return [
        f"{kind}_l{layer}{direction}"
        for layer in range(module.num_layers)
        for direction in directions
        for kind in kinds
    ]


def site_of(attr: str) -> str:
    """``"weight_ih_l0_reverse" -> "ih_l0_reverse"``."""
    return attr.split("_", 1)[1]


def sequence_layout(module: nn.RNNBase, x: Tensor) -> tuple[int, int]:
    """``(T, N)`` of one call's input ``x`` (``N = 1`` for an unbatched input)."""
    if x.dim() == 2:
        return x.shape[0], 1
    return (x.shape[1], x.shape[0]) if module.batch_first else (x.shape[0], x.shape[1])


def unrolled(
    module: nn.RNNBase,
    x: Tensor,
    hx: Tensor | tuple[Tensor, Tensor] | None,
    probes: dict[str, Tensor],
    record: dict[str, Tensor],
):
    """``module(x, hx)`` computed step by step, with ``probes`` added and inputs recorded.

    Args:
        module: an ``nn.RNN``, ``nn.GRU`` or ``nn.LSTM``.
        x: its input, ``[T, D]`` (unbatched), ``[T, N, D]`` or, with
            ``batch_first``, ``[N, T, D]``.
        hx: the initial state as the module takes it, or ``None`` for zeros.
        probes: site -> zeros ``[T, N, gates * hidden_size]`` (see :func:`sites`).
        record: filled with site -> the input ``A`` of that site's weight.

    Returns:
        What ``module(x, hx)`` returns, up to float rounding.
    """
    mode, hidden = module.mode, module.hidden_size
    batched = x.dim() == 3
    seq = x if not batched else (x.transpose(0, 1) if module.batch_first else x)
    seq = seq if batched else seq.unsqueeze(1)  # [T, N, D]
    lstm = mode == "LSTM"
    h0, c0 = (hx if lstm else (hx, None)) if hx is not None else (None, None)
    count = module.num_layers * (2 if module.bidirectional else 1)
    projected = module.proj_size > 0  # LSTM only: h_t = W_hr (o_t * tanh(c_t))
    if h0 is None:
        h0 = seq.new_zeros(count, seq.shape[1], module.proj_size if projected else hidden)
    elif not batched:
        h0 = h0.unsqueeze(1)
    if lstm and c0 is None:
        c0 = seq.new_zeros(count, seq.shape[1], hidden)
    elif lstm and not batched:
        c0 = c0.unsqueeze(1)

    last_h, last_c = [], []
    for layer in range(module.num_layers):
        outputs = []
        for direction in ("", "_reverse") if module.bidirectional else ("",):
            k = len(last_h)
            suffix = f"_l{layer}{direction}"
            w_ih, w_hh = (
                getattr(module, "weight_ih" + suffix),
                getattr(module, "weight_hh" + suffix),
            )
            b_ih = getattr(module, "bias_ih" + suffix) if module.bias else None
            b_hh = getattr(module, "bias_hh" + suffix) if module.bias else None
            inputs = seq.flip(0) if direction else seq
            record["ih" + suffix] = inputs
            gates_x = F.linear(inputs, w_ih, b_ih) + probes["ih" + suffix]  # all steps at once
            # unbind, not [t]: its backward stacks the steps' gradients once, where indexing
            # would add a zero-padded [T, ...] gradient per step
            steps = zip(gates_x.unbind(0), probes["hh" + suffix].unbind(0))
            if projected:
                w_hr = getattr(module, "weight_hr" + suffix)
                steps = zip(*zip(*steps), probes["hr" + suffix].unbind(0))
            h, c, hs, unprojected = h0[k], c0[k] if lstm else None, [], []
            for gates_x_t, probe_t, *probe_hr in steps:
                gates_h = F.linear(h, w_hh, b_hh) + probe_t
                h, c = _cell(mode, gates_x_t, gates_h, h, c)
                if projected:
                    unprojected.append(h)
                    h = F.linear(h, w_hr) + probe_hr[0]
                hs.append(h)
            out = torch.stack(hs)  # [T, N, H] in processing order
            if projected:
                record["hr" + suffix] = torch.stack(unprojected)
            record["hh" + suffix] = torch.cat([h0[k].unsqueeze(0), out[:-1]])  # h_{t-1}
            outputs.append(out.flip(0) if direction else out)
            last_h.append(h)
            last_c.append(c)
        seq = torch.cat(outputs, -1) if len(outputs) > 1 else outputs[0]
        if module.dropout and module.training and layer < module.num_layers - 1:
            seq = F.dropout(seq, module.dropout, training=True)

    h_n = torch.stack(last_h)
    output = seq if not batched else (seq.transpose(0, 1) if module.batch_first else seq)
    if not batched:
        output, h_n = output.squeeze(1), h_n.squeeze(1)
    if lstm:
        c_n = torch.stack(last_c)
        return output, (h_n, c_n if batched else c_n.squeeze(1))
    return output, h_n


def _cell(mode: str, gates_x: Tensor, gates_h: Tensor, h: Tensor, c: Tensor | None):
    """One time step from the two gate pre-activations: ``(h, c)``, ``c`` for LSTM only."""
    if mode == "LSTM":
        i, f, g, o = (gates_x + gates_h).chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c
    if mode == "GRU":
        x_r, x_z, x_n = gates_x.chunk(3, -1)
        h_r, h_z, h_n = gates_h.chunk(3, -1)
        r, z = torch.sigmoid(x_r + h_r), torch.sigmoid(x_z + h_z)
        n = torch.tanh(x_n + r * h_n)
        return n + z * (h - n), None
    pre = gates_x + gates_h
    return (torch.tanh(pre) if mode == "RNN_TANH" else torch.relu(pre)), None


# --- the rule -------------------------------------------------------------------------


def recurrent(module: nn.RNNBase, inputs: dict, grads: dict, weights: dict) -> dict:
    """Each weight matrix is a Linear over the ``T x N`` (step, sequence) positions of one
    example; each bias gradient is the sum of its gate gradients, formed per example."""
    out = {}
    for attr in weights:
        a, g = positions(inputs[site_of(attr)], grads[site_of(attr)])
        out[attr] = Outer(g, a) if attr.startswith("weight") else g.sum(1)
    return out


def check(module: nn.RNNBase, x, output) -> str:
    cls = torch_class(type(module)).__name__
    own = {attr for attr, p in module._parameters.items() if p is not None}
    if not own <= set(module._flat_weights_names):
        return f"{cls} with parameters of its own has no ghost rule"
    if not isinstance(x, Tensor) or x.dim() not in (2, 3):
        return f"input of rank {x.dim()}" if isinstance(x, Tensor) else "its input is not a tensor"
    if module.dropout and module.training:
        return "dropout between its layers: the unrolled layer's masks are not torch's"
    return ""


def probe_shapes(module: nn.RNNBase, args: tuple, kwargs: dict) -> dict[str, tuple[int, ...]]:
    """site -> the shape of one example's probe on that site's gate pre-activations."""
    x = args[0] if args else kwargs["input"]
    layout = sequence_layout(module, x)
    gates = (*layout, GATES[module.mode] * module.hidden_size)
    return {s: (*layout, module.proj_size) if s.startswith("hr") else gates for s in sites(module)}


def run(module: nn.RNNBase, probes: dict, record: dict, input, hx=None):  # noqa: A002
    """The layer's call in a ghost pass: unrolled, with a probe on every gate."""
    return unrolled(module, input, hx, probes, record)


RULE = Rule(recurrent, check=check, run=run, probe_shapes=probe_shapes)
for _cls in (nn.RNN, nn.GRU, nn.LSTM):
    register_unrolled(_cls, RULE)
