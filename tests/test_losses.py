"""Losses that read one example's values: explained errors, and rewrites that work.

Each hostile pattern must fail with a message that names its cause and its
fix; each rewrite must give the per-example gradients of a float64
batch-size-1 autograd loop over the hostile version (which plain PyTorch runs
fine one example at a time); unrelated errors must pass through untouched.
"""

import linecache
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.nn.utils.rnn import pack_padded_sequence

import dpfunc
from dpfunc.per_sample import explain_loss_errors

B, T, D, K = 5, 4, 3, 3  # examples, padded length, features, classes
DOC = Path(__file__).resolve().parents[1] / "docs" / "writing-a-loss.md"


class Packed(nn.Module):
    """A GRU classifier that packs each sequence by its length."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(D, 6, batch_first=True)
        self.head = nn.Linear(6, K)

    def forward(self, xs, length):
        packed = pack_padded_sequence(xs, length.cpu(), batch_first=True, enforce_sorted=False)
        _, state = self.rnn(packed)
        return self.head(state[-1])


class Padded(Packed):
    """The same classifier on the padded sequence, read at the last real position."""

    def forward(self, xs, length):
        out, _ = self.rnn(xs)
        last = (length - 1).reshape(1, 1, 1).expand(1, 1, out.shape[-1])
        return self.head(out.gather(1, last)[:, 0])


class Table(nn.Module):
    """A linear layer plus a row of a parameter table picked by the label."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(K, K))
        self.linear = nn.Linear(D, K)

    def forward(self, x, y):
        return self.linear(x) + self.table[y]


class TableRows(Table):
    """The same lookup with a 1-d index."""

    def forward(self, x, y):
        return self.linear(x) + self.table[y[None]]


def data():
    torch.manual_seed(0)
    return {
        "x": torch.randn(B, D, dtype=torch.float64),
        "y": torch.tensor([0, 2, 1, 2, 0]),
        "seq": torch.randn(B, T, D, dtype=torch.float64),
        "tags": torch.randint(0, K, (B, T)),
        "n": torch.tensor([4, 1, 3, 2, 4]),
        "w": torch.rand(B, dtype=torch.float64),
        "t": 2 * torch.randn(B, dtype=torch.float64),
    }


def mlp():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(D, 6), nn.Tanh(), nn.Linear(6, K)).double()


def per_example(loss, model, batch):
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        return loss(lambda *a: functional_call(model, (p, buffers), a), example)

    return list(dpfunc.per_sample_grads(loss_fn, params, batch).values())


def one_at_a_time(loss, model, batch):
    rows = []
    for i in range(len(batch[0])):
        example = tuple(t[i] for t in batch)
        rows.append(torch.autograd.grad(loss(model, example), list(model.parameters())))
    return [torch.stack(g) for g in zip(*rows)]


# hostile losses: fine in plain PyTorch for one example, failing under vmap


def label_indexed(call, ex):
    xi, yi = ex
    return -call(xi[None])[0].log_softmax(-1)[yi]


def table_loss(call, ex):
    xi, yi = ex
    return call(xi[None], yi).square().sum()


def penalty_indexed(call, ex):
    xi, yi = ex
    slope = torch.func.grad(lambda z: call(z[None])[0][yi])(xi)
    return F.cross_entropy(call(xi[None]), yi[None]) + 0.1 * slope.square().sum()


def penalty_by_autograd(model, ex):
    xi, yi = ex
    xi = xi.clone().requires_grad_(True)
    logits = model(xi[None])
    (slope,) = torch.autograd.grad(logits[0, yi], xi, create_graph=True)
    return F.cross_entropy(logits, yi[None]) + 0.1 * slope.square().sum()


def length_sliced(call, ex):
    xi, ti, n = ex
    return F.cross_entropy(call(xi[:n]), ti[:n], reduction="sum")


def item_weighted(call, ex):
    xi, yi, wi = ex
    return F.cross_entropy(call(xi[None]), yi[None]) * wi.item()


def float_weighted(call, ex):
    xi, yi, wi = ex
    return F.cross_entropy(call(xi[None]), yi[None]) * float(wi)


def int_weighted(call, ex):
    xi, yi, wi = ex
    return F.cross_entropy(call(xi[None]), yi[None]) * int(yi)


def if_huber(call, ex):
    xi, ti = ex
    error = call(xi[None])[0, 0] - ti
    if error.abs() < 1:
        return 0.5 * error**2
    return error.abs() - 0.5


def while_doubling(call, ex):
    xi, yi = ex
    loss = call(xi[None]).square().sum()
    k = yi
    while k > 0:
        loss, k = 2 * loss, k - 1
    return loss


def packed_loss(call, ex):
    xi, n, yi = ex
    return F.cross_entropy(call(xi[None], n[None]), yi[None])


def positive_part(call, ex):
    xi, _ = ex
    out = call(xi[None])
    return out[out > 0].sum()


HOSTILE = {
    # name: (loss, model, batch keys, words the message must hold)
    "logits[y]": (label_indexed, mlp, "x y", ["indexes a tensor", "gather", "cross_entropy"]),
    "table[y]": (table_loss, Table, "x y", ["indexes a tensor", "table[y[None]]"]),
    "penalty logits[y]": (penalty_indexed, mlp, "x y", ["indexes a tensor", "gather"]),
    "x[:n]": (length_sliced, mlp, "seq tags n", ["slices a tensor by a length", "mask"]),
    ".item()": (item_weighted, mlp, "x y w", ["`.item()`", "keep it a tensor"]),
    "float(t)": (float_weighted, mlp, "x y w", ["`float(t)`", "keep it a tensor"]),
    "int(t)": (int_weighted, mlp, "x y w", ["`int(t)`", "keep it a tensor"]),
    "if": (if_huber, mlp, "x t", ["branches on a value of one example", "torch.where"]),
    "while": (while_doubling, mlp, "x y", ["branches on a value of one example", "mask"]),
    "pack_padded_sequence": (
        packed_loss,
        Packed,
        "seq n y",
        ["pack_padded_sequence", "run the model on the padded sequence and mask"],
    ),
    "x[x > 0]": (positive_part, mlp, "x y", ["shape depends on the example's values", "where"]),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_each_hostile_pattern_names_its_cause_and_fix(name):
    loss, build, keys, words = HOSTILE[name]
    batch = tuple(data()[k] for k in keys.split())
    with pytest.raises(RuntimeError) as caught:
        per_example(loss, build().double(), batch)
    message, original = str(caught.value), caught.value.__cause__
    for word in words:
        assert word in message, message
    assert "The usual causes" not in message  # the cause is named, not guessed among all
    assert f"{Path(__file__).name}:" in message  # the failing line
    assert isinstance(original, RuntimeError) and str(original) in message
    assert "data-dependent" in str(original) or "vmap" in str(original) or "stack" in str(original)


def test_source_unavailable_lists_every_cause():
    source = "def loss(call, ex):\n    return call(ex[0][None])[0][ex[1]]\n"
    namespace: dict = {}
    exec(compile(source, "<no source>", "exec"), namespace)
    with pytest.raises(RuntimeError, match="The usual causes") as caught:
        per_example(namespace["loss"], mlp(), (data()["x"], data()["y"]))
    for word in ("gather", "torch.where", "keep it a tensor", "mask"):
        assert word in str(caught.value)


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_train_steps_explain_too(method):
    model = mlp()
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, ex):
        return label_indexed(lambda *a: functional_call(model, (p, buffers), a), ex)

    step = dpfunc.make_train_step(
        loss_fn,
        dpfunc.optim.sgd(lr=0.1),
        clip_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=B,
        model=model,
        method=method,
    )
    d = data()
    with pytest.raises(RuntimeError, match="indexes a tensor") as caught:
        step.clip(params, (d["x"], d["y"]), torch.ones(B))
    assert "gather" in str(caught.value)


# the rewrites


def label_gathered(call, ex):
    xi, yi = ex
    return -call(xi[None])[0].log_softmax(-1).gather(-1, yi[None]).squeeze(-1)


def label_cross_entropy(call, ex):
    xi, yi = ex
    return F.cross_entropy(call(xi[None]), yi[None])


def label_one_hot(call, ex):
    xi, yi = ex
    return -(call(xi[None])[0].log_softmax(-1) * (torch.arange(K) == yi)).sum()


def penalty_gathered(call, ex):
    xi, yi = ex
    slope = torch.func.grad(lambda z: call(z[None])[0].gather(-1, yi[None]).squeeze(-1))(xi)
    return F.cross_entropy(call(xi[None]), yi[None]) + 0.1 * slope.square().sum()


def length_masked(call, ex):
    xi, ti, n = ex
    valid = torch.arange(xi.shape[0]) < n
    return (F.cross_entropy(call(xi), ti, reduction="none") * valid).sum()


def tensor_weighted(call, ex):
    xi, yi, wi = ex
    return F.cross_entropy(call(xi[None]), yi[None]) * wi


def where_huber(call, ex):
    xi, ti = ex
    error = call(xi[None])[0, 0] - ti
    return torch.where(error.abs() < 1, 0.5 * error**2, error.abs() - 0.5)


def masked_doubling(call, ex):
    xi, yi = ex
    loss = call(xi[None]).square().sum()
    return loss * 2.0 ** yi.clamp(0, K).to(loss.dtype)  # the loop, unrolled to a power


def positive_part_where(call, ex):
    xi, _ = ex
    out = call(xi[None])
    return torch.where(out > 0, out, 0).sum()


REWRITES = {
    # name: (rewrite, hostile oracle, dpfunc model, oracle model, batch keys)
    "gather": (label_gathered, label_indexed, mlp, None, "x y"),
    "cross_entropy": (label_cross_entropy, label_indexed, mlp, None, "x y"),
    "one_hot": (label_one_hot, label_indexed, mlp, None, "x y"),
    "table[y[None]]": (table_loss, table_loss, TableRows, Table, "x y"),
    "penalty gather": (penalty_gathered, penalty_by_autograd, mlp, None, "x y"),
    "length mask": (length_masked, length_sliced, mlp, None, "seq tags n"),
    "tensor weight": (tensor_weighted, item_weighted, mlp, None, "x y w"),
    "torch.where": (where_huber, if_huber, mlp, None, "x t"),
    "loop as tensor": (masked_doubling, while_doubling, mlp, None, "x y"),
    "masked instead of boolean index": (positive_part_where, positive_part, mlp, None, "x y"),
    "padded instead of packed": (packed_loss, packed_loss, Padded, Packed, "seq n y"),
}


@pytest.mark.parametrize("name", list(REWRITES))
def test_rewrite_matches_a_batch_size_one_loop(name):
    rewrite, hostile, build, build_oracle, keys = REWRITES[name]
    batch = tuple(data()[k] for k in keys.split())
    model = build().double()
    oracle = model
    if build_oracle is not None:
        oracle = build_oracle().double()
        oracle.load_state_dict(model.state_dict())
    got = per_example(rewrite, model, batch)
    expected = one_at_a_time(hostile, oracle, batch)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-10)
    assert any(bool(g.abs().sum() > 0) for g in got)


# errors that are not vmap's pass through untouched


def shape_mismatch(call, ex):
    xi, _ = ex
    return (call(xi[None]) + torch.ones(K + 1, dtype=xi.dtype)).sum()


def own_value_error(call, ex):
    raise ValueError("labels must be in [0, 3)")


def own_unequal_stack(call, ex):
    xi, _ = ex
    return torch.stack([xi, xi[:1]]).sum() + call(xi[None]).sum()


@pytest.mark.parametrize("loss", [shape_mismatch, own_value_error, own_unequal_stack])
def test_unrelated_errors_pass_through_unchanged(loss):
    batch = (data()["x"], data()["y"])
    model = mlp()
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        return loss(lambda *a: functional_call(model, (p, buffers), a), example)

    with pytest.raises(Exception) as raw:  # torch.func itself, without dpfunc
        torch.func.vmap(torch.func.grad(loss_fn), in_dims=(None, 0))(params, batch)
    with pytest.raises(Exception) as caught:
        dpfunc.per_sample_grads(loss_fn, params, batch)
    assert type(caught.value) is type(raw.value)
    assert str(caught.value) == str(raw.value)
    assert caught.value.__cause__ is None


def test_explain_loss_errors_keeps_the_exception_type_and_passes_others():
    class Custom(RuntimeError):
        pass

    def read_one_value(x):
        if x.sum() > 0:  # data-dependent control flow under vmap
            return x
        return -x

    with pytest.raises(RuntimeError) as caught, explain_loss_errors():
        torch.func.vmap(read_one_value)(torch.randn(3, 2))
    assert "branches on a value of one example" in str(caught.value)
    with pytest.raises(Custom) as caught, explain_loss_errors():
        raise Custom("a Tensor in some data-dependent control flow")
    assert "torch's message: a Tensor in some data-dependent" in str(caught.value)
    assert isinstance(caught.value.__cause__, Custom)
    with pytest.raises(Custom, match="^untouched$"), explain_loss_errors():
        raise Custom("untouched")


def test_writing_a_loss_doc_runs():
    """Every python block of docs/writing-a-loss.md runs, in order, in one namespace."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 6
    namespace: dict = {}
    for i, block in enumerate(blocks):
        name = f"{DOC}, block {i}"
        linecache.cache[name] = (len(block), None, block.splitlines(True), name)
        exec(compile(block, name, "exec"), namespace)
