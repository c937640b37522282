"""Ghost clipping against the vmap path: same norms, same clipped sums, same steps."""

import math
import warnings
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounter
from torch.func import functional_call, jacrev

import dpfunc
from dpfunc.ghost import (
    GhostClipper,
    analyse,
    bounds,
    linear_weight_norms,
    remove_hooks,
    rule_for,
    tf32_risk,
)
from dpfunc.ghost.registry import Outer
from dpfunc.per_sample import batch_size
from dpfunc.tree import tree_map

B = 6


def projected(out):
    """A scalar that depends on every output coordinate differently."""
    weights = torch.linspace(-1.0, 2.0, out.numel(), dtype=out.dtype).reshape(out.shape)
    return (out * weights).sum() + 0.5 * out.pow(2).sum()


def on_unsqueezed(call, x):
    return projected(call(x.unsqueeze(0)))


def problem(model, forward=on_unsqueezed):
    """``(params, loss_fn)`` for ``forward(call, example)`` in float64."""
    model.double()
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        return forward(lambda *a: functional_call(model, (p, buffers), a), example)

    return params, loss_fn


def steps(model, loss_fn, **kwargs):
    """The same step by vmap and by ghost clipping."""
    args = dict(clip_norm=0.7, noise_multiplier=0.0, expected_batch_size=B)
    args.update(kwargs)
    opt = dpfunc.optim.sgd(lr=1.0)
    vmap_step = dpfunc.make_train_step(loss_fn, opt, method="vmap", **args)
    ghost_step = dpfunc.make_train_step(loss_fn, opt, model=model, method="ghost", **args)
    return vmap_step, ghost_step


def classifier_step(model, optimizer, **kwargs):
    """``(params, step)``: a cross-entropy loss on ``model`` and its ghost-capable step."""
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        x, y = example
        out = functional_call(model, (p, buffers), (x.unsqueeze(0),))
        return F.cross_entropy(out, y.unsqueeze(0))

    args = dict(clip_norm=0.5, noise_multiplier=1.0, model=model, **kwargs)
    return params, dpfunc.make_train_step(loss_fn, optimizer, **args)


def assert_ghost_equals_vmap(model, batch, forward=on_unsqueezed, *, ghosted, mask=None, **kw):
    """Clipped sums and norms agree, and exactly the modules ``ghosted`` used the ghost rules."""
    params, loss_fn = problem(model, forward)
    batch = tree_map(lambda t: t.double() if t.is_floating_point() else t, batch)
    plan = GhostClipper(model, loss_fn, "ghost").plan(params, batch)
    assert [m.path for m in plan.modules] == ghosted
    mask = torch.ones(batch_size(batch)) if mask is None else mask
    if "clip_norm" not in kw:  # between the middle norms: some examples are clipped, some not
        probe, _ = steps(model, loss_fn, clip_norm=math.inf)
        norms = probe.clip(params, batch, mask)[1].norm[mask.bool()].sort().values
        kw["clip_norm"] = norms[len(norms) // 2 - 1 : len(norms) // 2 + 1].mean().item()
    vmap_step, ghost_step = steps(model, loss_fn, **kw)
    want, want_stats = vmap_step.clip(params, batch, mask)
    got, got_stats = ghost_step.clip(params, batch, mask)
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-8, atol=1e-12, msg=k)
    torch.testing.assert_close(got_stats.norm, want_stats.norm, rtol=1e-8, atol=1e-12)
    assert torch.equal(got_stats.scaled, want_stats.scaled)
    torch.testing.assert_close(got_stats.loss, want_stats.loss)
    assert want_stats.scaled.any()  # clipping is exercised ...
    if kw.get("clipping", "flat") != "per_layer":
        assert not want_stats.scaled[mask.bool()].all()  # ... and so is no clipping
    return plan


def tokens_with_repeats():
    return torch.tensor([[1, 1, 2], [0, 3, 3], [9, 9, 9], [4, 0, 5], [0, 0, 0], [2, 7, 2]])


@pytest.mark.parametrize(
    "model, batch, scale",
    [
        (nn.Linear(5, 3), torch.randn(B, 5), 1.0),
        (nn.Linear(8, 6), torch.randn(B, 2, 8), 1.0),  # T (d_in + d_out) = 28 < 48: Gram
        (nn.Linear(5, 4), torch.randn(B, 3, 5), 1.0),  # 27 > 20: direct form (T^2 = 9 < 20)
        (nn.Linear(5, 3), torch.randn(B, 6, 5), 1.0),  # 48 > 15: direct form
        (nn.Linear(3, 2, bias=False), torch.randn(B, 2, 2, 3), 1.0),  # two position dims
        (nn.Embedding(10, 4, padding_idx=0), tokens_with_repeats(), 0.3),
        (nn.Embedding(10, 3), tokens_with_repeats(), 0.3),
        (nn.Conv1d(3, 4, 3, stride=2, padding=1), torch.randn(B, 3, 9), 1.0),
        (nn.Conv1d(4, 2, 4, padding="same", groups=2), torch.randn(B, 4, 7), 1.0),  # pads 1, 2
        (nn.Conv2d(2, 4, 3, stride=2, padding=1, dilation=1), torch.randn(B, 2, 7, 6), 0.3),
        (nn.Conv2d(2, 4, 3, padding="same", dilation=2, groups=2), torch.randn(B, 2, 6, 6), 0.3),
        (
            nn.Conv2d(4, 6, (2, 3), stride=(2, 1), groups=2, padding_mode="reflect", padding=1),
            torch.randn(B, 4, 5, 5),
            0.3,
        ),
        (nn.LayerNorm(6), torch.randn(B, 3, 6), 1.0),
        (nn.LayerNorm((2, 3), bias=False), torch.randn(B, 4, 2, 3), 1.0),
        (nn.GroupNorm(2, 4), torch.randn(B, 4, 5), 1.0),
        (nn.GroupNorm(3, 6), torch.randn(B, 6, 3, 3), 1.0),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else "",
)
def test_each_covered_layer_matches_vmap(model, batch, scale):
    forward = lambda call, x: scale * on_unsqueezed(call, x)  # noqa: E731
    assert_ghost_equals_vmap(model, batch, forward, ghosted=[""])


def test_conv_on_unbatched_and_multi_image_examples_and_frozen_weight():
    as_is = lambda call, x: projected(call(x))  # noqa: E731
    conv = nn.Conv2d(3, 2, 2)
    assert_ghost_equals_vmap(conv, torch.randn(B, 3, 4, 4), as_is, ghosted=[""])
    conv = nn.Conv2d(2, 4, 3, padding=1, groups=2)  # each example is 3 images
    assert_ghost_equals_vmap(conv, torch.randn(B, 3, 2, 4, 4), as_is, ghosted=[""])
    lin = nn.Linear(4, 3)
    lin.weight.requires_grad_(False)  # only the bias is trained
    plan = assert_ghost_equals_vmap(lin, torch.randn(B, 4), ghosted=[""])
    assert plan.covered == ("bias",)


@pytest.mark.parametrize("form", ["gram", "direct"])
@pytest.mark.parametrize("positions", [1, 4, 9])
def test_linear_norm_forms_equal_the_materialised_gradient(form, positions):
    a = torch.randn(5, positions, 6, dtype=torch.float64)
    g = torch.randn(5, positions, 4, dtype=torch.float64)
    want = torch.einsum("bto,bti->boi", g, a).pow(2).sum((1, 2))
    torch.testing.assert_close(linear_weight_norms(a, g, form), want, rtol=1e-12, atol=0)
    torch.testing.assert_close(linear_weight_norms(a, g), want, rtol=1e-12, atol=0)
    if positions == 1:
        torch.testing.assert_close(linear_weight_norms(a, g, "outer"), want, rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    "positions, d_in, d_out, formed",
    [
        (1, 6, 4, False),  # rank one
        (2, 12, 12, False),  # d_in d_out = 144 > 2 T (d_in + d_out) = 96: rows kept
        (2, 8, 6, True),  # Gram norm by the norm rule, but formed: 48 <= 56
        (2, 8, 8, True),  # the band's edge: 64 <= 64
        (2, 9, 8, False),  # just past it: 72 > 68
        (3, 5, 4, True),  # direct by the norm rule
        (6, 5, 3, True),
        (4, 6, 6, True),
    ],
)
def test_layers_are_formed_once_for_norm_and_sum_where_cheaper(positions, d_in, d_out, formed):
    """Where forming is cheaper (at most twice the rows' floats), the gradients are formed
    and serve both the norm and the sum; other dense forms and the rank-one form are left
    as rows. Both give the materialised oracle."""
    a = torch.randn(5, positions, d_in, dtype=torch.float64)
    g = torch.randn(5, positions, d_out, dtype=torch.float64)
    w = torch.tensor([0.5, 0.0, 1.0, 0.25, 2.0], dtype=torch.float64)
    shape = torch.Size([d_out, d_in])
    want = torch.einsum("bto,bti->boi", g, a)
    form = bounds.formed_where_cheaper(Outer(g, a), shape)
    assert isinstance(form, torch.Tensor) is formed
    assert formed is bounds.forming_is_cheaper(positions, d_in, d_out)
    if formed:  # memory: at most twice the floats of the rows it replaces
        assert form.numel() <= 2 * (a.numel() + g.numel())
        torch.testing.assert_close(form, want, rtol=1e-12, atol=0)
    norms = bounds.form_norms(form)
    exact = want.square().sum((1, 2))
    if not formed:  # a bound on the rows' product (formed: the vmap path's norm, which the
        assert (norms >= exact).all()  # clip margin covers)
    torch.testing.assert_close(norms, exact, rtol=1e-6, atol=0)
    for finite in (True, False):
        summed = bounds.form_sum(form, w, shape, finite)
        torch.testing.assert_close(summed, torch.einsum("b,boi->oi", w, want), rtol=1e-12, atol=0)
    index = Outer(torch.tensor([[1, 1, 2]]), torch.randn(1, 3, 4))  # an embedding: rows kept
    assert bounds.formed_where_cheaper(index, torch.Size([3, 4])) is index


def cancelling_problem(kind, dtype, big):
    """One example whose positions nearly cancel: huge inputs and output gradients, a
    small weight gradient. A Gram norm computed naively rounds to about 0 here."""
    s = 1e3 if dtype == torch.float32 else 1e6
    if kind == "embedding":  # the same token twice
        model = nn.Embedding(100, 2)
        batch = (
            torch.tensor([[7, 7]]),
            torch.tensor([[s * big, s]], dtype=dtype),
            torch.tensor([[-s * big, 0.0]], dtype=dtype),
        )

        def forward(call, example):
            tokens, u, v = example
            out = call(tokens)
            return (out[0] * u).sum() + (out[1] * v).sum()

        return model.to(dtype), batch, forward
    if kind == "conv":  # a 1-wide kernel on two pixels: a Linear over two positions
        model = nn.Conv1d(3, 3, 1, bias=False)
        x = torch.tensor([[[big, big], [1.0, 0.0], [0.0, 0.0]]], dtype=dtype)
    else:  # Linear(3, 3) takes the Gram form, Linear(3, 1) the direct one
        model = nn.Linear(3, 3 if kind == "gram" else 1, bias=False)
        x = torch.tensor([[[big, 1.0, 0.0], [big, 0.0, 0.0]]], dtype=dtype)

    def forward(call, example):
        xi, scale = example
        out = call(xi)
        first, second = (out[:, 0], out[:, 1]) if kind == "conv" else (out[0], out[1])
        return scale * (first - second).sum()

    return model.to(dtype), (x, torch.tensor([s], dtype=dtype)), forward


@pytest.mark.parametrize("dtype, big", [(torch.float64, 1e8), (torch.float32, 1e4)])
@pytest.mark.parametrize("kind", ["gram", "direct", "conv", "embedding"])
def test_cancelling_positions_cannot_pass_the_clip_bound(kind, dtype, big):
    model, batch, forward = cancelling_problem(kind, dtype, big)
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        return forward(lambda *a: functional_call(model, (p, buffers), a), example)

    args = dict(clip_norm=1.0, noise_multiplier=0.0, expected_batch_size=1)
    mask = torch.ones(1)
    for method in ("vmap", "ghost"):
        step = dpfunc.make_train_step(
            loss_fn, dpfunc.optim.sgd(lr=1.0), model=model, method=method, **args
        )
        summed, stats = step.clip(params, batch, mask)
        if method == "ghost":
            assert step.clip.ghost.plans and all(p.modules for p in step.clip.ghost.plans.values())
        total = torch.stack([v.double().square().sum() for v in summed.values()]).sum().sqrt()
        assert total <= 1.0 + 1e-6, (method, float(total), float(stats.norm[0]))


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.conv2 = nn.Conv2d(4, 4, 3, stride=2, groups=2)
        self.fc = nn.Linear(4 * 3 * 3, 3)

    def forward(self, x):
        x = torch.tanh(self.norm(self.conv1(x)))
        return self.fc(torch.relu(self.conv2(x)).flatten(1))


def classify(call, example):
    x, y = example
    return F.cross_entropy(call(x.unsqueeze(0)), y.unsqueeze(0))


@pytest.mark.parametrize(
    "cell, batch_first, bidirectional, layers",
    [
        (nn.LSTM, True, False, 1),
        (nn.LSTM, False, True, 2),
        (nn.GRU, True, True, 1),
        (nn.GRU, False, False, 2),
        (nn.RNN, True, True, 2),
        (partial(nn.LSTM, proj_size=2), True, True, 2),
    ],
)
def test_recurrent_layers_match_vmap(cell, batch_first, bidirectional, layers):
    model = cell(3, 4, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first)
    cell = type(model)
    dim = 0 if batch_first else 1
    assert_ghost_equals_vmap(
        model,
        torch.randn(B, 5, 3),
        lambda call, x: 0.3 * projected(call(x.unsqueeze(dim))[0]),
        ghosted=[""],
    )
    assert type(model) is not cell  # dispatches to the unrolled layer in a ghost pass
    remove_hooks(model)
    assert type(model) is cell and "_dpfunc_ghost_sites" not in model.__dict__


def test_recurrent_layer_with_initial_state_unbatched_and_without_bias():
    gru = nn.GRU(3, 4, bias=False)  # an unbatched [T, D] call with its own h0
    batch = (torch.randn(B, 5, 3), torch.randn(B, 1, 4))
    forward = lambda call, ex: projected(call(ex[0], ex[1])[0])  # noqa: E731
    assert_ghost_equals_vmap(gru, batch, forward, ghosted=[""])
    lstm = nn.LSTM(3, 4, proj_size=2, bias=False)  # and an LSTM with (h0, c0) and a projection
    batch = (torch.randn(B, 5, 3), torch.randn(B, 1, 2), torch.randn(B, 1, 4))
    forward = lambda call, ex: projected(call(ex[0], (ex[1], ex[2]))[0])  # noqa: E731
    assert_ghost_equals_vmap(lstm, batch, forward, ghosted=[""])


def test_a_recurrent_module_shared_by_two_models_serves_both():
    shared = nn.GRU(3, 4, batch_first=True)
    first, second = nn.Sequential(shared), nn.Sequential(shared)
    forward = lambda call, x: projected(call(x.unsqueeze(0))[0])  # noqa: E731
    x = torch.randn(B, 5, 3)
    for model in (first, second):  # both install hooks on the same GRU
        GhostClipper(model, lambda p, e: 0.0, "ghost")
    for model in (first, second):
        assert_ghost_equals_vmap(model, x, forward, ghosted=["0"])
    remove_hooks(second)
    assert_ghost_equals_vmap(first, x, forward, ghosted=["0"])  # still served
    remove_hooks(first)
    assert type(shared) is nn.GRU


def test_recurrent_module_with_a_parameter_of_its_own_falls_back():
    lstm = nn.LSTM(3, 4)
    lstm.register_parameter("h0", nn.Parameter(torch.zeros(1, 4)))
    params, loss_fn = problem(lstm, lambda call, x: projected(call(x)[0]))
    with pytest.warns(UserWarning, match="LSTM with parameters of its own has no ghost rule"):
        plan = GhostClipper(lstm, loss_fn, "ghost").plan(params, torch.randn(B, 5, 3).double())
    assert not plan.modules
    remove_hooks(lstm)


def test_recurrent_dropout_in_training_falls_back():
    model = nn.LSTM(3, 4, num_layers=2, dropout=0.5).double()
    params, loss_fn = problem(model, lambda call, x: projected(call(x)[0]))
    x = torch.randn(B, 5, 3, dtype=torch.float64)
    with pytest.warns(UserWarning, match="dropout between its layers"):
        plan = GhostClipper(model, loss_fn, "auto").plan(params, x)
    assert not plan.modules
    remove_hooks(model)


class LSTMClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 4)
        self.lstm = nn.LSTM(4, 6, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, tokens):
        _, (h, _) = self.lstm(self.embed(tokens))
        return self.head(h[-1])


def test_recurrent_ghost_step_compiles_with_allow_rnn():
    torch.manual_seed(3)
    params, step = classifier_step(
        LSTMClassifier(), dpfunc.optim.sgd(lr=0.5), expected_batch_size=B
    )
    batch = (torch.randint(0, 20, (B, 7)), torch.randint(0, 3, (B,)))
    mask, noise = torch.ones(B), dpfunc.standard_normal_like(params, seed=0, step=0)
    state = step.init(params)
    counter = CompileCounter()
    with torch._dynamo.config.patch(allow_rnn=True):  # Dynamo refuses nn.LSTM otherwise
        got, _ = torch.compile(step, backend=counter, fullgraph=True)(state, batch, mask, noise)
    want, _ = step(state, batch, mask, noise)
    assert counter.frame_count == 1
    for k in params:
        torch.testing.assert_close(got.params[k], want.params[k])
    assert [m.path for m in step.clip.ghost.plans[next(iter(step.clip.ghost.plans))].modules] == [
        "embed",
        "lstm",
        "head",
    ]


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_recurrent_classifier_matches_vmap(clipping):
    batch = (torch.randint(0, 20, (B, 7)), torch.randint(0, 3, (B,)))
    mask = torch.tensor([1, 1, 0, 1, 1, 1.0])
    assert_ghost_equals_vmap(
        LSTMClassifier(),
        batch,
        classify,
        ghosted=["embed", "lstm", "head"],
        mask=mask,
        clipping=clipping,
    )


@pytest.mark.parametrize("clipping", ["flat", "normalized", "per_layer"])
def test_mixed_models_match_vmap(clipping):
    mlp = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    batch = (torch.randn(B, 6) * 3, torch.randint(0, 3, (B,)))
    mask = torch.tensor([1, 1, 0, 1, 1, 1.0])
    kw = dict(clipping=clipping)
    assert_ghost_equals_vmap(mlp, batch, classify, ghosted=["0", "2", "4"], mask=mask, **kw)
    batch = (torch.randn(B, 1, 7, 7) * 3, torch.randint(0, 3, (B,)))
    assert_ghost_equals_vmap(
        SmallCNN(), batch, classify, ghosted=["conv1", "norm", "conv2", "fc"], mask=mask, **kw
    )


def test_transformer_layer_is_fully_ghosted():
    torch.manual_seed(1)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    batch = torch.randn(B, 5, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message="There is a performance drop")
        plan = assert_ghost_equals_vmap(
            layer,
            batch,
            lambda c, x: 0.2 * on_unsqueezed(c, x),
            ghosted=["self_attn", "linear1", "linear2", "norm1", "norm2"],
        )
    assert set(plan.covered) == {name for name, _ in layer.named_parameters()}


class Attend(nn.Module):
    """Attention with a key padding mask from the example, as a model calls it."""

    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        kw = dict(kdim=3, vdim=5) if mode == "kdim" else {}
        self.attn = nn.MultiheadAttention(
            6, 2, batch_first=mode != "seq_first", bias=mode != "no_bias", **kw
        )

    def forward(self, x, memory, pad):
        if self.mode == "seq_first":
            x, memory = x.transpose(0, 1), memory.transpose(0, 1)
        if self.mode == "kdim":
            key, value = memory[..., :3], torch.cat([memory[..., :3], memory[..., :2]], -1)
        elif self.mode in ("self", "seq_first"):
            key = value = x if self.mode == "self" else memory
        else:
            key = value = memory
        query = x
        if self.mode == "self":
            key = value = query
        out, weights = self.attn(query, key, value, key_padding_mask=pad,
                                 need_weights=self.mode != "no_weights")  # fmt: skip
        if self.mode == "seq_first":
            out = out.transpose(0, 1)
        extra = 0.0 if weights is None else 0.3 * weights.sum()
        return out.tanh().sum(-1) + extra


@pytest.mark.parametrize("mode", ["self", "cross", "seq_first", "kdim", "no_bias", "no_weights"])
def test_multihead_attention_matches_vmap(mode):
    torch.manual_seed(2)
    model = Attend(mode)
    x, memory = torch.randn(B, 1, 4, 6), torch.randn(B, 1, 5, 6)
    if mode == "self":
        memory = x
    pad = torch.zeros(B, 1, x.shape[2] if mode == "self" else 5, dtype=torch.bool)
    pad[1, 0, -2:] = True  # padding in some examples
    pad[4, 0, -1:] = True
    forward = lambda call, ex: projected(call(*ex))  # noqa: E731
    assert_ghost_equals_vmap(model, (x, memory, pad), forward, ghosted=["attn"])


def test_multihead_attention_with_bias_kv_falls_back():
    model = nn.MultiheadAttention(6, 2, add_bias_kv=True, batch_first=True)
    forward = lambda call, x: projected(call(x, x, x)[0])  # noqa: E731
    with pytest.warns(UserWarning, match="add_bias_kv has no ghost rule"):
        assert_ghost_equals_vmap(model, torch.randn(B, 1, 4, 6), forward, ghosted=[])


@pytest.mark.parametrize("clipping", ["flat", "normalized"])
def test_private_step_equals_vmap_step(clipping):
    torch.manual_seed(2)
    model = nn.Sequential(nn.Embedding(12, 4, padding_idx=0), nn.Flatten(), nn.Linear(12, 3))
    params, loss_fn = problem(model, classify)
    tokens, labels = torch.randint(0, 12, (B, 3)), torch.randint(0, 3, (B,))
    mask = torch.tensor([1, 0, 1, 1, 1, 1.0])
    vmap_step, ghost_step = steps(
        model,
        loss_fn,
        clipping=clipping,
        clip_norm=0.5,
        noise_multiplier=1.3,
        expected_batch_size=5.0,
    )
    noise = dpfunc.standard_normal_like(params, seed=4, step=0)
    want, want_metrics = vmap_step(vmap_step.init(params), (tokens, labels), mask, noise)
    got, got_metrics = ghost_step(ghost_step.init(params), (tokens, labels), mask, noise)
    for k in params:
        torch.testing.assert_close(got.params[k], want.params[k], rtol=1e-10, atol=1e-12)
        assert not torch.equal(got.params[k], params[k])
    for k in want_metrics:
        torch.testing.assert_close(got_metrics[k], want_metrics[k], equal_nan=True)


def test_each_examples_contribution_is_bounded_and_chunking_is_invisible():
    model = nn.Sequential(nn.Conv1d(2, 3, 3), nn.Flatten(), nn.Linear(12, 2))
    params, loss_fn = problem(model, lambda call, ex: ex[1] * on_unsqueezed(call, ex[0]))
    batch = (torch.randn(B, 2, 6, dtype=torch.float64), torch.logspace(-4, 2, B).double())
    _, ghost = steps(model, loss_fn, clip_norm=0.5)
    _, chunked = steps(model, loss_fn, clip_norm=0.5, chunk_size=4)
    whole, _ = ghost.clip(params, batch, torch.ones(B))
    parts, _ = chunked.clip(params, batch, torch.ones(B))
    for k in params:
        torch.testing.assert_close(parts[k], whole[k], rtol=1e-12, atol=1e-14)
    norms = []
    for i in range(B):
        one, _ = ghost.clip(params, batch, torch.eye(B)[i])
        norms.append(dpfunc.tree.global_norm(one))
    norms = torch.stack(norms)
    assert norms.max() <= 0.5 * (1 + 1e-9)
    assert norms.min() < 0.1 and norms.max() > 0.49  # small ones kept, large ones clipped


def test_nonfinite_and_padding_rows_contribute_exactly_zero():
    model = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Linear(5, 2))
    params, loss_fn = problem(model)
    x = torch.randn(B, 4, dtype=torch.float64)
    x[1, 0] = math.nan  # NaN in the activations and the output gradients of example 1
    x[3] = math.inf
    x[4] = math.nan  # a padding row full of NaN
    mask = torch.tensor([1, 1, 1, 1, 0, 1.0])
    _, ghost = steps(model, loss_fn)
    summed, stats = ghost.clip(params, x, mask)
    keep = [0, 2, 5]
    clean, _ = ghost.clip(params, x[keep], torch.ones(3))
    for k in params:
        assert torch.isfinite(summed[k]).all()
        torch.testing.assert_close(summed[k], clean[k], rtol=1e-12, atol=1e-14)
    assert not torch.isfinite(stats.norm[[1, 3]]).any()


def test_finite_batch_sums_without_masking_and_padding_adds_exactly_zero(monkeypatch):
    # eagerly on a CPU a batch whose norms are all finite skips the NaN-safe masking of the
    # forms; a padding row (finite, weight 0) must still add exactly nothing
    from dpfunc.ghost import bounds

    def refuse(*args):
        raise AssertionError("the NaN-safe masking ran on an all-finite batch")

    monkeypatch.setattr(bounds, "keep", refuse)
    monkeypatch.setattr(bounds, "scaled", refuse)
    model = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Linear(5, 2))
    params, loss_fn = problem(model)
    x = torch.randn(B, 4, dtype=torch.float64)
    x[4] = 1e3  # a padding row with large, finite values
    mask = torch.tensor([1, 1, 1, 1, 0, 1.0])
    _, ghost = steps(model, loss_fn)
    summed, _ = ghost.clip(params, x, mask)
    keep = [0, 1, 2, 3, 5]
    clean, _ = ghost.clip(params, x[keep], torch.ones(5))
    for k in params:
        torch.testing.assert_close(summed[k], clean[k], rtol=1e-12, atol=1e-14)


def pinn_loss_problem():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(call, example):
        xi, fi = example

        def u(z):
            return call(z).squeeze()

        return (torch.trace(jacrev(jacrev(u))(xi)) - fi) ** 2

    return model, forward, (torch.rand(B, 2), torch.randn(B))


@pytest.mark.parametrize("case", ["pinn", "weight_decay_in_loss"])
def test_whole_step_falls_back_with_one_warning(case):
    if case == "pinn":
        model, forward, batch = pinn_loss_problem()
        reason = "nested torch.func transform"
    else:
        model, forward = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), on_unsqueezed
        batch = torch.randn(B, 3)
        reason = "also used outside any covered module"
    params, loss_fn = problem(model, forward)
    if case == "weight_decay_in_loss":
        plain = loss_fn

        def loss_fn(p, example):  # reads every parameter outside the module calls
            return plain(p, example) + 0.1 * sum(v.pow(2).sum() for v in p.values())

    batch = tree_map(lambda t: t.double() if t.is_floating_point() else t, batch)
    vmap_step, ghost_step = steps(model, loss_fn)
    mask = torch.ones(B)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [ghost_step.clip(params, batch, mask) for _ in range(2)]
        if case == "pinn":  # a new batch structure is analysed again, but not warned again
            ghost_step.clip(params, list(batch), mask)
            assert len(ghost_step.clip.ghost.plans) == 2
    ours = [w for w in caught if "dpfunc ghost" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert "the whole step uses per-example gradients" in str(ours[0].message)
    assert reason in str(ours[0].message)
    want, _ = vmap_step.clip(params, batch, mask)
    for k in params:
        torch.testing.assert_close(got[1][0][k], want[k], rtol=1e-10, atol=1e-12)


def test_a_forward_hook_before_dpfuncs_makes_its_module_fall_back():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    params, loss_fn = problem(model)  # installs nothing yet
    dpfunc.make_train_step(
        loss_fn, dpfunc.optim.sgd(lr=0.1), clip_norm=1.0, noise_multiplier=0.0,
        expected_batch_size=B, model=model,
    )  # fmt: skip
    handle = model[2].register_forward_hook(lambda m, a, out: 3 * out, prepend=True)
    try:
        with pytest.warns(UserWarning, match="'2': another forward hook runs before"):
            assert_ghost_equals_vmap(model, torch.randn(B, 4) * 2, ghosted=["0"])
    finally:
        handle.remove()


def test_tied_embeddings_are_ghosted_with_their_cross_terms(tied_language_model):
    """The input embedding and the output projection share one weight: its per-example
    gradient is the sum of both uses, and its norm needs the cross terms between them."""
    batch = torch.tensor([[1, 1, 2], [0, 3, 3], [6, 6, 6], [4, 0, 5], [0, 0, 0], [2, 5, 2]])
    plan = assert_ghost_equals_vmap(tied_language_model, batch, ghosted=["embed", "out"])
    assert plan.covered == ("embed.weight",) and not plan.reasons


def test_module_called_twice_is_ghosted_over_both_calls():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 2)

        def forward(self, x):
            return self.b(self.a(torch.tanh(self.a(x))))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = assert_ghost_equals_vmap(Twice(), torch.randn(B, 4) * 2, ghosted=["a", "b"])
    (a, _) = plan.modules
    assert len(a.probes) == 2  # one probe per call


def test_auto_ghosts_only_where_it_is_cheaper():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 4, 3)  # 36 output positions: 36^2 > 18 * 4, materialise
            self.seq = nn.Linear(16, 16)  # 4 positions: 4 * 32 < 16 * 16, Gram form
            self.head = nn.Linear(64, 3)  # one position: rank-one form

        def forward(self, x):
            h = F.avg_pool2d(torch.tanh(self.conv(x)), 3)  # [N, 4, 2, 2]
            h = torch.tanh(self.seq(h.flatten(2).repeat(1, 1, 4)))  # [N, 4, 16]
            return self.head(h.flatten(1))

    model = Mixed().double()
    params, loss_fn = problem(model, classify)
    batch = (torch.randn(B, 2, 8, 8, dtype=torch.float64), torch.randint(0, 3, (B,)))
    clipper = GhostClipper(model, loss_fn, "auto")
    example = tuple(t[0] for t in batch)
    auto = analyse(model, clipper.hooks, loss_fn, params, example, "auto")  # the cost model
    assert [m.path for m in auto.modules] == ["seq", "head"] and not auto.reasons
    ghost = GhostClipper(model, loss_fn, "ghost").plan(params, batch)
    assert [m.path for m in ghost.modules] == ["conv", "seq", "head"]
    args = dict(clip_norm=0.3, noise_multiplier=0.0, expected_batch_size=B)
    mask = torch.ones(B)
    want, _ = dpfunc.make_train_step(loss_fn, dpfunc.optim.sgd(lr=1.0), **args).clip(
        params, batch, mask
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a cost choice is not a fallback: nothing to warn
        step = dpfunc.make_train_step(loss_fn, dpfunc.optim.sgd(lr=1.0), model=model, **args)
        got, _ = step.clip(params, batch, mask)
    for k in params:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12)
    # nothing worth ghosting: the plain vmap path, no warning
    conv_only = nn.Sequential(nn.Conv2d(2, 4, 3), nn.Flatten())
    params, loss_fn = problem(conv_only)
    x = torch.randn(B, 2, 8, 8, dtype=torch.float64)
    assert not GhostClipper(conv_only, loss_fn, "auto").plan(params, x).modules


@pytest.mark.parametrize("ghost_s, vmap_s, ghosted", [(1.0, 2.0, ["0", "1"]), (2.0, 1.0, [])])
def test_auto_keeps_the_path_measured_faster_at_plan_time(monkeypatch, ghost_s, vmap_s, ghosted):
    """Eagerly, method="auto" times the ghost pass and plain vmap and keeps the faster."""
    monkeypatch.setattr(dpfunc.ghost.clipper, "SMALL_GRADIENTS", 0)  # time even this tiny model
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4)).double()  # not Linear alone: timed
    params, loss_fn = problem(model)
    runs = dpfunc.ghost.clipper.TIMED_RUNS  # start and end of each timed call, alternately
    ticks = iter([t for _ in range(runs) for t in (0.0, ghost_s, 10.0, 10.0 + vmap_s)])

    class Clock:
        @staticmethod
        def perf_counter():
            return next(ticks)

    monkeypatch.setattr(dpfunc.ghost.clipper, "time", Clock)
    plan = GhostClipper(model, loss_fn, "auto").plan(params, torch.randn(B, 3).double())
    assert [m.path for m in plan.modules] == ghosted and not plan.reasons
    remove_hooks(model)


def test_reduced_precision_matmuls_make_their_modules_fall_back():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    precision, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = True  # torch's default: the ghost sums use no cuDNN
        assert not tf32_risk(cuda, torch.float32) and not tf32_risk(cpu, torch.float32)
        torch.set_float32_matmul_precision("high")  # TF32 matmuls on CUDA and oneDNN
        assert tf32_risk(cuda, torch.float32) and tf32_risk(cpu, torch.float32)
        assert not tf32_risk(cuda, torch.float64)
        torch.set_float32_matmul_precision("highest")
        # a step that planned under full precision plans again once bf16 matmuls are on
        model = nn.Sequential(nn.Linear(3, 4))
        params, buffers = dpfunc.functionalize(model)

        def loss_fn(p, x):
            return functional_call(model, (p, buffers), (x[None],)).square().sum()

        step = dpfunc.make_train_step(
            loss_fn, dpfunc.optim.sgd(lr=0.1), clip_norm=1.0, noise_multiplier=0.0,
            expected_batch_size=B, model=model, method="ghost",
        )  # fmt: skip
        x = torch.randn(B, 3)
        assert step.explain(params, x)["0.weight"] == "ghost"
        torch.set_float32_matmul_precision("medium")  # oneDNN: bf16
        with pytest.warns(UserWarning, match="reduced-precision float32 matmuls"):
            assert step.explain(params, x)["0.weight"].startswith("vmap: ")
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = cudnn


def test_a_parameter_passed_as_its_own_layers_input_falls_back():
    class SelfInput(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return self.lin(self.lin.weight) + self.lin(x)

    model = SelfInput()
    with pytest.warns(UserWarning, match="also used outside any covered module"):
        plan = assert_ghost_equals_vmap(model, torch.randn(B, 3), ghosted=["lin"])
    assert plan.covered == ("lin.bias",)


def test_tied_embeddings_with_int32_tokens(tied_language_model):
    batch = torch.tensor([[1, 1, 2], [0, 3, 3], [6, 6, 6], [4, 0, 5], [0, 0, 0], [2, 5, 2]])
    assert_ghost_equals_vmap(tied_language_model, batch.int(), ghosted=["embed", "out"])


def test_construction_checks():
    model = nn.Linear(3, 1)
    params, loss_fn = problem(model)
    args = dict(clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)
    with pytest.raises(ValueError, match="method='ghost' needs model="):
        dpfunc.make_train_step(loss_fn, dpfunc.optim.sgd(lr=0.1), method="ghost", **args)
    with pytest.raises(ValueError, match="method='fast'"):
        dpfunc.make_train_step(loss_fn, dpfunc.optim.sgd(lr=0.1), method="fast", **args)
    with pytest.raises(TypeError, match="model must be"):
        dpfunc.make_train_step(loss_fn, dpfunc.optim.sgd(lr=0.1), model=params, **args)
    dpfunc.make_train_step(loss_fn, dpfunc.optim.sgd(lr=0.1), method="vmap", model=model, **args)
    assert "_dpfunc_ghost_hooks" not in model.__dict__  # vmap installs nothing
    auto = dpfunc.make_train_step(loss_fn, dpfunc.optim.sgd(lr=0.1), model=model, **args)
    assert "_dpfunc_ghost_hooks" in model.__dict__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auto.clip(params, torch.randn(4, 3, dtype=torch.float64), None)
    # hooks are inert outside a step: the module still computes its plain output
    x = torch.randn(2, 3, dtype=torch.float64)
    torch.testing.assert_close(model(x), F.linear(x, model.weight, model.bias))
    assert len(model._forward_hooks) == 1
    remove_hooks(model)
    assert len(model._forward_hooks) == 0 and "_dpfunc_ghost_hooks" not in model.__dict__


@pytest.mark.slow
def test_compiled_ghost_step_equals_eager_with_one_graph():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))
    params, step = classifier_step(
        model, dpfunc.optim.adam(lr=0.01), expected_batch_size=7.5, method="ghost"
    )
    counter = CompileCounter()
    counted = torch.compile(step, backend=counter, fullgraph=True)  # compiled before eager ran
    inductor = torch.compile(step, fullgraph=True)
    eager_state = counted_state = inductor_state = step.init(params)
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        batch = (torch.randn(8, 6, generator=g) * 3, torch.randint(0, 3, (8,), generator=g))
        mask = (torch.arange(8) % (i + 2) != 0).float()
        noise = dpfunc.standard_normal_like(params, seed=0, step=i)
        counted_state, _ = counted(counted_state, batch, mask, noise)
        inductor_state, metrics = inductor(inductor_state, batch, mask, noise)
        eager_state, eager_metrics = step(eager_state, batch, mask, noise)
        torch.testing.assert_close(metrics["loss"], eager_metrics["loss"])
        for k in params:
            torch.testing.assert_close(counted_state.params[k], eager_state.params[k])
            torch.testing.assert_close(
                inductor_state.params[k], eager_state.params[k], rtol=1e-5, atol=1e-6
            )
    assert counter.frame_count == 1
    (plan,) = step.clip.ghost.plans.values()
    assert [m.path for m in plan.modules] == ["0", "1", "3"]
    # A second model of other shapes in the same process: Dynamo recompiles the step's
    # code with automatic dynamic shapes, so the parameter shapes are symbolic while
    # tracing; the planner must still find the plan (from the real tensors).
    other = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    other_params, other_step = classifier_step(
        other, dpfunc.optim.sgd(lr=0.1), expected_batch_size=8, method="ghost"
    )
    noise = dpfunc.standard_normal_like(other_params, seed=0, step=0)
    state = other_step.init(other_params)
    got, _ = torch.compile(other_step, backend=CompileCounter(), fullgraph=True)(
        state, batch, mask, noise
    )
    want, _ = other_step(state, batch, mask, noise)
    for k in other_params:
        torch.testing.assert_close(got.params[k], want.params[k])


def test_register_rule_checks_its_arguments_and_subclasses_keep_the_base_forward():
    from dpfunc.ghost import register_rule

    with pytest.raises(TypeError, match="module_type must be an nn.Module subclass"):
        register_rule(int, lambda m, x, g, w: {})
    with pytest.raises(TypeError, match="gradients must be callable"):
        register_rule(nn.Linear, None)

    class Plain(nn.Linear):
        pass

    class Custom(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    assert rule_for(Plain(2, 2))[0] is rule_for(nn.Linear(2, 2))[0]
    assert rule_for(Custom(2, 2)) == (None, "Custom overrides Linear.forward")
    assert rule_for(nn.Bilinear(2, 2, 2)) == (None, "Bilinear has no ghost rule")


def test_a_rule_reads_the_step_parameters_not_the_module_attributes():
    """In a functional step the module keeps its initial parameters; a rule that needs
    one parameter to form another's gradient gets the step's values in ``weights``."""
    from dpfunc.ghost import Outer, register_rule

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(3, 4))
            self.scale = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return (x @ self.weight.T) * self.scale

    def rule(module, x, g, weights):
        b = g.shape[0]
        x, g = x.reshape(b, -1, x.shape[-1]), g.reshape(b, -1, g.shape[-1])
        return {
            "weight": Outer(g * weights["scale"], x),
            "scale": (g * (x @ weights["weight"].T)).sum(1),
        }

    register_rule(Scaled, rule)
    model = Scaled()
    params, loss_fn = problem(model)
    params = {k: v + 0.5 for k, v in params.items()}  # the step's values, not the module's
    batch = torch.randn(B, 4, dtype=torch.float64)
    vmap_step, ghost_step = steps(model, loss_fn, clip_norm=0.5)
    assert set(ghost_step.explain(params, batch).values()) == {"ghost"}
    mask = torch.ones(B)
    got, got_stats = ghost_step.clip(params, batch, mask)
    want, want_stats = vmap_step.clip(params, batch, mask)
    torch.testing.assert_close(got_stats.norm, want_stats.norm, rtol=1e-8, atol=1e-12)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("mode", ["flat", "per_layer", "normalized", "adaptive"])
def test_both_paths_clip_through_one_policy(monkeypatch, mode):
    """vmap and ghost hand their norms to the same ClippingPolicy; it decides as the oracle's."""
    model = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, 3))
    params, loss_fn = problem(model)
    x = torch.randn(B, 4, dtype=torch.float64) * torch.logspace(-1, 1, B).double()[:, None]
    mask = torch.tensor([1, 1, 0, 1, 1, 1.0])

    def example_grads(example):  # the oracle: one example's gradient by plain autograd
        p = {k: v.detach().requires_grad_() for k, v in params.items()}
        return dict(zip(p, torch.autograd.grad(loss_fn(p, example), list(p.values()))))

    loop = [example_grads(x[i]) for i in range(B)]
    groups = dpfunc.groups_by_module(params) if mode == "per_layer" else None
    members = groups or {"all": list(params)}
    oracle = {
        g: torch.stack([sum(e[n].square().sum() for n in names).sqrt() for e in loop])
        for g, names in members.items()
    }
    flat = torch.stack(list(oracle.values())).square().sum(0).sqrt()
    clip = flat[mask.bool()].median().item()  # some real rows clipped, some not
    calls = []
    call = dpfunc.clipping.ClippingPolicy.__call__

    def spy(self, norms, clip_norm, mask=None, **scope):
        out = call(self, norms, clip_norm, mask, **scope)
        calls.append((self, norms, clip_norm, scope, out))
        return out

    monkeypatch.setattr(dpfunc.clipping.ClippingPolicy, "__call__", spy)
    kwargs = {"clipping": "flat" if mode == "adaptive" else mode, "clip_norm": clip}
    state_clip = None
    if mode == "adaptive":  # the step clips at the state's norm, a tensor
        kwargs.update(target_quantile=0.5, count_noise_multiplier=2.0)
        state_clip = torch.tensor(0.8 * clip, dtype=torch.float64)
    stats = [step.clip(params, x, mask, state_clip)[1] for step in steps(model, loss_fn, **kwargs)]

    assert len(calls) == 2  # once per path, per micro-batch
    (policy, _, _, scope, _), _ = calls
    assert policy == dpfunc.clipping.ClippingPolicy(kwargs["clipping"])
    assert scope == dpfunc.clipping.rounding_scope(params, B)
    used = clip if state_clip is None else state_clip
    want_norms = oracle["all"] if groups is None else oracle
    want = dpfunc.clip_factors(want_norms, used, normalize=mode == "normalized", **scope)
    for (got_policy, norms, clip_norm, got_scope, out), stat in zip(calls, stats):
        assert (got_policy, got_scope) == (policy, scope)
        assert clip_norm is used
        torch.testing.assert_close(norms, want_norms, rtol=1e-10, atol=0)
        torch.testing.assert_close(out.factors, want, rtol=1e-10, atol=0)
        torch.testing.assert_close(out.norm, flat, rtol=1e-10, atol=0)
        assert torch.equal(stat.norm, out.norm) and torch.equal(stat.scaled, out.scaled)
        weights = out.weights.values() if groups else [out.weights]
        assert all(torch.equal(w[mask == 0], torch.zeros(1, dtype=w.dtype)) for w in weights)
    _, _, _, _, vmap_out = calls[0]
    assert torch.equal(calls[1][4].scaled, vmap_out.scaled) and vmap_out.scaled[mask.bool()].any()
    if mode != "per_layer":
        assert not vmap_out.scaled[mask.bool()].all()
