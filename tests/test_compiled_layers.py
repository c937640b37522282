"""Compiled private steps equal eager ones over the layer families the ghost path covers.

Each case is one layer (or a small stack) with its options: Linear over 2 to 4
input dims, Conv1d/2d/3d with groups, stride, dilation, "same"/"valid" and
reflect/circular/replicate padding, Embedding with ``padding_idx``,
LayerNorm (with and without bias), RMSNorm, GroupNorm, InstanceNorm,
MultiheadAttention with ``add_bias_kv``, ``add_zero_attn`` and ``kdim``/``vdim``,
and RNN/GRU/LSTM stacked and bidirectional. A float32 step without noise,
clipped at the median per-example norm (so some examples are clipped and
some are not), runs eagerly, then compiled whole by
:func:`dpfunc._compiling.compile_fullgraph` (Inductor) from the same state: the two
updates agree to float32 rounding, on ``method="ghost"`` and ``"auto"``.

A few cases run by default (``slow``); the whole matrix is ``heavy``
(``pytest -m heavy``), and ``bench/compiled_layers.py`` reports it.
A step with recurrent layers that a user compiles without Dynamo's
``allow_rnn`` fails with a message that names the setting.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import dpfunc
from dpfunc._compiling import compile_fullgraph

B = 6  # examples per batch
RTOL = 1e-4  # compiled against eager: max |difference| / max |eager update|, per parameter


class Case(NamedTuple):
    name: str
    model: Callable[[], nn.Module]
    example: Callable[[torch.Generator], tuple]  # a batch: a tuple of [B, ...] tensors


class Attention(nn.Module):
    """``nn.MultiheadAttention`` called on (query, key/value source), both outputs used."""

    def __init__(self, **kw: Any):
        super().__init__()
        self.kdim = kw.get("kdim")
        self.attn = nn.MultiheadAttention(6, 2, batch_first=True, **kw)

    def forward(self, x, memory):
        key = memory[..., : self.kdim] if self.kdim else memory
        out, weights = self.attn(x, key, memory)
        return out.tanh().sum(-1) + 0.3 * weights.sum()


class Recurrent(nn.Module):
    """A recurrent layer, batch first, its output sequence and final state both used."""

    def __init__(self, cls: type[nn.RNNBase], **kw: Any):
        super().__init__()
        self.rnn = cls(3, 4, batch_first=True, **kw)

    def forward(self, x):
        out, state = self.rnn(x)
        return out, state


class WeightedBag(nn.Module):
    """``nn.EmbeddingBag`` in sum mode with per-sample weights (one bag per example)."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 3, mode="sum")

    def forward(self, x, w):
        return self.bag(x, per_sample_weights=w)


def randn(*shape):
    return lambda g: (torch.randn(B, *shape, generator=g),)


def tokens(g):
    t = torch.randint(0, 10, (B, 5), generator=g)
    t[1, :2] = 0  # the padding index in some examples
    return (t,)


def attention(kv=6):
    return lambda g: (torch.randn(B, 4, 6, generator=g), torch.randn(B, 5, kv, generator=g))


def conv(cls, *args, **kw):
    return lambda: cls(*args, **kw)


CASES = [
    Case("linear_2d", lambda: nn.Linear(5, 3), randn(5)),
    Case("linear_3d", lambda: nn.Linear(5, 4), randn(3, 5)),
    Case("linear_4d_no_bias", lambda: nn.Linear(3, 2, bias=False), randn(2, 2, 3)),
    Case("conv1d_stride", conv(nn.Conv1d, 3, 4, 3, stride=2, padding=1), randn(3, 9)),
    Case("conv1d_same_groups", conv(nn.Conv1d, 4, 2, 4, padding="same", groups=2), randn(4, 7)),
    Case("conv1d_valid_dilation", conv(nn.Conv1d, 2, 3, 3, dilation=2), randn(2, 9)),
    Case(
        "conv1d_reflect", conv(nn.Conv1d, 2, 3, 3, padding=1, padding_mode="reflect"), randn(2, 6)
    ),  # fmt: skip
    Case(
        "conv1d_circular", conv(nn.Conv1d, 2, 3, 3, padding=2, padding_mode="circular"), randn(2, 6)
    ),  # fmt: skip
    Case(
        "conv2d_groups_stride",
        conv(nn.Conv2d, 4, 6, (2, 3), stride=(2, 1), groups=2),
        randn(4, 5, 5),
    ),  # fmt: skip
    Case(
        "conv2d_same_dilation",
        conv(nn.Conv2d, 2, 4, 3, padding="same", dilation=2, groups=2),
        randn(2, 6, 6),
    ),  # fmt: skip
    Case(
        "conv2d_reflect_groups",
        conv(nn.Conv2d, 4, 6, 3, groups=2, padding=1, padding_mode="reflect"),
        randn(4, 5, 5),
    ),  # fmt: skip
    Case(
        "conv2d_replicate",
        conv(nn.Conv2d, 2, 3, 3, padding=1, padding_mode="replicate"),
        randn(2, 5, 4),
    ),  # fmt: skip
    Case(
        "conv2d_circular",
        conv(nn.Conv2d, 2, 3, 2, padding=1, padding_mode="circular"),
        randn(2, 4, 4),
    ),  # fmt: skip
    Case(
        "conv3d_groups_stride", conv(nn.Conv3d, 2, 4, 2, stride=2, groups=2), randn(2, 4, 4, 4)
    ),  # fmt: skip
    Case("conv3d_same", conv(nn.Conv3d, 2, 2, 3, padding="same"), randn(2, 3, 4, 3)),
    Case(
        "conv3d_replicate",
        conv(nn.Conv3d, 1, 2, 2, padding=1, padding_mode="replicate"),
        randn(1, 3, 3, 3),
    ),  # fmt: skip
    Case("embedding", lambda: nn.Embedding(10, 3), tokens),
    Case("embedding_padding_idx", lambda: nn.Embedding(10, 4, padding_idx=0), tokens),
    Case("embedding_bag_sum", lambda: nn.EmbeddingBag(10, 3, mode="sum"), tokens),
    Case(
        "embedding_bag_mean_padding_idx",
        lambda: nn.EmbeddingBag(10, 4, mode="mean", padding_idx=0),
        tokens,
    ),  # fmt: skip
    Case("embedding_bag_max", lambda: nn.EmbeddingBag(10, 3, mode="max"), tokens),
    Case(
        "embedding_bag_weighted",
        WeightedBag,
        lambda g: (tokens(g)[0], torch.rand(B, 5, generator=g)),
    ),  # fmt: skip
    Case("layernorm", lambda: nn.LayerNorm(6), randn(3, 6)),
    Case("layernorm_no_bias", lambda: nn.LayerNorm((2, 3), bias=False), randn(4, 2, 3)),
    Case("rmsnorm", lambda: nn.RMSNorm(6), randn(3, 6)),
    Case("groupnorm", lambda: nn.GroupNorm(2, 4), randn(4, 5)),
    Case("instancenorm1d", lambda: nn.InstanceNorm1d(3, affine=True), randn(3, 5)),
    Case("instancenorm2d", lambda: nn.InstanceNorm2d(2, affine=True), randn(2, 3, 4)),
    Case("mha", lambda: Attention(), attention()),
    Case("mha_bias_kv", lambda: Attention(add_bias_kv=True), attention()),
    Case("mha_zero_attn", lambda: Attention(add_zero_attn=True), attention()),
    Case("mha_kdim_vdim", lambda: Attention(kdim=3, vdim=5), attention(5)),
    Case(
        "rnn_stacked_bidirectional",
        lambda: Recurrent(nn.RNN, num_layers=2, bidirectional=True),
        randn(5, 3),
    ),  # fmt: skip
    Case(
        "gru_stacked_bidirectional",
        lambda: Recurrent(nn.GRU, num_layers=2, bidirectional=True),
        randn(5, 3),
    ),  # fmt: skip
    Case(
        "lstm_stacked_bidirectional",
        lambda: Recurrent(nn.LSTM, num_layers=2, bidirectional=True),
        randn(5, 3),
    ),  # fmt: skip
]
BY_NAME = {case.name: case for case in CASES}
# layers the ghost path has no rule for (their parameters fall back to vmap, with a warning):
# the matrix still compiles them, on the fallback
FALLBACK = {"conv3d_groups_stride", "conv3d_same", "conv3d_replicate", "instancenorm1d",
            "instancenorm2d", "mha_bias_kv"}  # fmt: skip
SUBSET = [  # the default run (recurrent layers: the compiled Trainer test below)
    ("conv2d_reflect_groups", "ghost"),
    ("embedding_padding_idx", "auto"),
]


def projected(out: Any) -> torch.Tensor:
    """A scalar that depends on every output coordinate differently."""
    total = 0.0
    for t in torch.utils._pytree.tree_leaves(out):
        weights = torch.linspace(-1.0, 2.0, t.numel(), dtype=t.dtype).reshape(t.shape)
        total = total + (t * weights).sum() + 0.5 * t.pow(2).sum()
    return total


def build(case: Case, method: str, seed: int = 0):
    """``(params, step, batch, clip_norm)`` for ``case``, clipped at the median norm."""
    torch.manual_seed(seed)
    model = case.model()
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        args = tuple(t.unsqueeze(0) for t in example)
        return projected(functional_call(model, (p, buffers), args))

    batch = case.example(torch.Generator().manual_seed(seed))
    norms = dpfunc.per_sample_norms(dpfunc.per_sample_grads(loss_fn, params, batch))
    clip_norm = float(norms.median())  # some examples clipped, some not
    step = dpfunc.make_train_step(
        loss_fn, dpfunc.optim.sgd(lr=1.0), clip_norm=clip_norm, noise_multiplier=0.0,
        expected_batch_size=B, model=model, method=method,
    )  # fmt: skip
    return params, step, batch, clip_norm


def compiled_against_eager(case: Case, method: str) -> tuple[float, float]:
    """``(max relative difference, seconds of the first compiled call)`` of one case.

    The relative difference of a parameter is the largest absolute difference
    between the compiled and the eager update over the eager update's largest
    entry; the maximum over parameters is returned.
    """
    torch._dynamo.reset()  # each case compiles afresh (no recompile limit across cases)
    params, step, batch, _ = build(case, method)
    mask = torch.ones(B)
    mask[-1] = 0.0  # one padding row
    noise = dpfunc.standard_normal_like(params, seed=0, step=0)
    state = step.init(params)
    eager, _ = step(state, batch, mask, noise)
    compiled_step = compile_fullgraph(step)  # the whole step, one graph
    counters = torch._dynamo.utils.counters
    counters.clear()
    start = time.perf_counter()
    compiled, _ = compiled_step(state, batch, mask, noise)
    seconds = time.perf_counter() - start
    if not counters["stats"]["unique_graphs"]:  # the comparison is with a compiled graph
        raise AssertionError(f"{case.name}: the compiled step traced no graph")
    worst = 0.0
    for k, p in params.items():
        want, got = eager.params[k] - p, compiled.params[k] - p
        scale = want.abs().max().clamp_min(torch.finfo(p.dtype).tiny)
        worst = max(worst, float((got - want).abs().max() / scale))
    torch._dynamo.reset()
    return worst, seconds


@pytest.mark.slow
@pytest.mark.parametrize("name, method", SUBSET)
def test_compiled_step_equals_eager_on_a_subset(name, method):
    worst, _ = compiled_against_eager(BY_NAME[name], method)
    assert worst <= RTOL


@pytest.mark.heavy
@pytest.mark.parametrize("method", ["ghost", "auto"])
@pytest.mark.parametrize("name", list(BY_NAME))
def test_compiled_step_equals_eager_on_every_layer(name, method):
    worst, _ = compiled_against_eager(BY_NAME[name], method)
    assert worst <= RTOL


def test_the_cases_clip_some_examples_and_ghost_every_layer():
    # the matrix tests what it says: the ghost path covers each layer outside FALLBACK, and
    # the median clip scales some rows
    for case in CASES:
        params, step, batch, clip_norm = build(case, "ghost")
        norms = dpfunc.per_sample_norms(dpfunc.per_sample_grads(step.loss_fn, params, batch))
        assert 0 < int((norms > clip_norm).sum()) < B, case.name
        with warnings.catch_warnings(record=True):
            plan = step.explain(params, batch)
        ghosted = {v == "ghost" for v in plan.values()}
        assert ghosted == ({False} if case.name in FALLBACK else {True}), (case.name, plan)


class Recurrents(nn.Module):
    """RNN, GRU and LSTM, stacked and bidirectional, into a classifier."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.RNN(3, 4, num_layers=2, bidirectional=True, batch_first=True)
        self.gru = nn.GRU(8, 3, num_layers=2, bidirectional=True, batch_first=True)
        self.lstm = nn.LSTM(6, 4, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        out, _ = self.lstm(self.gru(self.rnn(x)[0])[0])
        return self.head(out[:, -1])


def recurrent_trainer(compile: bool):
    torch.manual_seed(0)
    model = Recurrents()
    params, buffers = dpfunc.functionalize(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 4, 3, generator=g), torch.randint(0, 3, (16,), generator=g)

    def loss_fn(p, example):
        xi, yi = example
        return F.cross_entropy(functional_call(model, (p, buffers), (xi[None],)), yi[None])

    trainer = dpfunc.Trainer(
        loss_fn, params, (x, y), optimizer=dpfunc.optim.sgd(lr=0.5), epochs=1,
        expected_batch_size=8, clip_norm=0.5, noise_multiplier=1.0, delta=1e-4,
        progress=False, model=model, method="ghost", compile=compile,
        seed=1234,  # a fixed seed: both runs draw the same samples and noise (testing only)
    )  # fmt: skip
    return trainer, params


@pytest.mark.slow
def test_compiled_trainer_with_recurrent_layers_equals_eager():
    torch._dynamo.reset()
    assert torch._dynamo.config.allow_rnn is False  # dpfunc turns it on for its calls only
    compiled, params = recurrent_trainer(compile=True)
    eager, _ = recurrent_trainer(compile=False)
    for _ in range(2):
        compiled.train_step()
        eager.train_step()
    for k in params:
        torch.testing.assert_close(compiled.params[k], eager.params[k], rtol=1e-4, atol=1e-5)
        assert not torch.equal(compiled.params[k], params[k]), k  # it trained
    assert torch._dynamo.config.allow_rnn is False
    torch._dynamo.reset()


def test_a_step_compiled_without_allow_rnn_names_the_setting():
    torch._dynamo.reset()
    case = BY_NAME["lstm_stacked_bidirectional"]
    params, step, batch, _ = build(case, "ghost")
    noise = dpfunc.standard_normal_like(params, seed=0, step=0)
    state = step.init(params)
    compiled = torch.compile(step, fullgraph=True, backend="eager")  # refused while tracing
    with pytest.raises(RuntimeError) as error:
        compiled(state, batch, torch.ones(B), noise)
    assert "torch._dynamo.config.allow_rnn = True" in str(error.value)
    assert "step.compile()" in str(error.value)
    assert "'rnn'" in str(error.value)  # the layer, by its path
    assert "Attempted to wrap RNN" not in str(error.value)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(allow_rnn=True):  # the setting the message names
        got, _ = compiled(state, batch, torch.ones(B), noise)
    want, _ = step(state, batch, torch.ones(B), noise)
    for k in params:
        torch.testing.assert_close(got.params[k], want.params[k], rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


def test_check_allow_rnn_is_silent_eagerly_and_without_recurrent_layers():
    from dpfunc._compiling import check_allow_rnn, recurrent_paths

    model = nn.Sequential(nn.Linear(2, 2), Recurrent(nn.GRU))
    assert recurrent_paths(model) == ("1.rnn",)
    assert recurrent_paths(None) == recurrent_paths(nn.Linear(2, 2)) == ()
    check_allow_rnn(("1.rnn",))  # eager: nothing to refuse
    traced = torch.compile(lambda x: check_allow_rnn(()) or x + 1, fullgraph=True, backend="eager")
    assert torch.equal(traced(torch.zeros(1)), torch.ones(1))
    torch._dynamo.reset()
