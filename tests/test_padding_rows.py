"""An eager step leaves a micro-batch's padding rows out of the forward and backward: the
clipped sum is the one of all rows (padding contributes 0), the rounding margin counts the
physical rows, and the padding rows' stats are zero."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import dpfunc
from dpfunc.ghost import remove_hooks

B = 12


def _problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        x, y = example
        return F.cross_entropy(functional_call(model, (p, buffers), (x[None],)), y[None])

    x, y = torch.randn(B, 5, dtype=torch.float64), torch.randint(3, (B,))
    return model, params, loss_fn, (x, y)


def _step(model, loss_fn, method):
    return dpfunc.make_train_step(
        loss_fn, dpfunc.optim.sgd(lr=0.1), clip_norm=0.3, noise_multiplier=1.0,
        expected_batch_size=B, model=model, method=method,
    )  # fmt: skip


@pytest.mark.parametrize("method", ["vmap", "ghost"])
@pytest.mark.parametrize("real", [[1] * 7 + [0] * 5, [0, 1] * 6, [0] * B])
def test_accumulate_skips_padding_with_the_sum_and_margin_of_all_rows(monkeypatch, method, real):
    model, params, loss_fn, batch = _problem()
    mask = torch.tensor(real, dtype=torch.bool)
    step = _step(model, loss_fn, method)
    scopes, rows = [], []
    call = dpfunc.clipping.ClippingPolicy.__call__

    def spy(self, norms, clip_norm, mask=None, **scope):
        scopes.append(scope)
        rows.append(len(mask))
        return call(self, norms, clip_norm, mask, **scope)

    monkeypatch.setattr(dpfunc.clipping.ClippingPolicy, "__call__", spy)
    summed_over = []  # the ghost norms' bound on the sum's rounding: rows it counts
    bound = dpfunc.ghost.bounds.linear_weight_norms

    def spy_bound(a, g, form=None, summed_over_=None, **kw):
        summed_over.append(kw.get("summed_over", summed_over_))
        return bound(a, g, form, **kw)

    monkeypatch.setattr(dpfunc.ghost.bounds, "linear_weight_norms", spy_bound)
    want, want_stats = step.clip(params, batch, mask)  # every row, padding too
    got, stats = step.clip(params, batch, mask, skip_padding=True)
    if mask.any():
        assert rows == [B, int(mask.sum())]  # the padding rows were not differentiated
        assert scopes[0] == scopes[1] == dpfunc.clipping.rounding_scope(params, B)
        assert set(summed_over) == ({B} if method == "ghost" else set())  # Linear: 1 position
    for name in params:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-15)
    assert torch.equal(stats.mask, mask)
    for field in ("loss", "norm", "scaled"):
        mine, full = getattr(stats, field), getattr(want_stats, field)
        assert mine.shape == (B,)
        torch.testing.assert_close(mine[mask], full[mask], rtol=1e-12, atol=0)
        assert not mine[~mask].any()  # padding: loss 0, norm 0, not scaled
    remove_hooks(model)


def test_a_compiled_trace_keeps_the_padded_shape(monkeypatch):
    """Under torch.compile the row selection (data-dependent shapes) is not taken."""
    model, params, loss_fn, batch = _problem()
    step = _step(model, loss_fn, "vmap")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    seen = []
    rows = step.clip._rows

    def spy(params, batch, mask, clip, n):
        seen.append((len(mask), n))
        return rows(params, batch, mask, clip, n)

    monkeypatch.setattr(step.clip, "_rows", spy)
    mask = torch.tensor([1] * 7 + [0] * 5, dtype=torch.bool)
    step.clip(params, batch, mask, skip_padding=True)
    assert seen == [(B, B)]


@pytest.mark.parametrize("real", [[1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
def test_tied_embeddings_on_the_ghost_path_skip_padding_too(tied_language_model, real):
    # tied weights are summed over their sites (a Gram form): its size is the real rows'
    model = tied_language_model.double()
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, tokens):
        out = functional_call(model, (p, buffers), (tokens[None],))
        return out.sum() + 0.5 * out.pow(2).sum()

    tokens = torch.tensor([[1, 1, 2], [0, 3, 3], [6, 6, 6], [4, 0, 5], [0, 0, 0], [2, 5, 2]])
    mask = torch.tensor(real, dtype=torch.bool)
    step = dpfunc.make_train_step(
        loss_fn, dpfunc.optim.sgd(lr=1.0), clip_norm=0.7, noise_multiplier=0.0,
        expected_batch_size=6, model=model, method="ghost",
    )  # fmt: skip
    assert step.explain(params, tokens) == {"embed.weight": "ghost"}
    want, _ = step.clip(params, tokens, mask)
    got, stats = step.clip(params, tokens, mask, skip_padding=True)
    torch.testing.assert_close(got["embed.weight"], want["embed.weight"])
    assert stats.norm.shape == (6,) and bool((stats.norm[~mask] == 0).all())
    remove_hooks(model)
