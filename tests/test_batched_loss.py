"""Batched losses: the ghost pass runs the model on the whole batch, and equals the vmap pass.

Every layer family of the compiled-layers matrix gives, through a batched
loss, the clipped sum and norms of the one-example loss to float64 rounding
(``rtol`` 1e-9) and of a batch-size-1 autograd loop; layers the batched pass
cannot take (attention and EmbeddingBag, whose rules run the layer themselves) keep the vmap
pass with a warning and the same result. Losses that mix examples (a mean over
the batch, in-batch negatives, BatchNorm) are refused before anything is
released, naming the cause. The Hugging Face families and the helpers of
:mod:`dpfunc.losses` are in ``tests/test_hf.py``.
"""

from __future__ import annotations

import math
import os
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import dpfunc
from dpfunc._compiling import compile_fullgraph

sys.path.insert(0, os.path.dirname(__file__))
from test_compiled_layers import CASES, B, projected  # noqa: E402

RUNS_ITSELF = ("mha", "embedding_bag")  # rules that run the layer themselves: the vmap pass
# the recurrent cases return their final state [layers, B, H], examples on axis 1: a batched
# loss over it is the user's to write; their rules run the layer themselves, as attention's
LAYERS = [c for c in CASES if not c.name.startswith(("rnn", "gru", "lstm"))]


def projected_rows(out) -> torch.Tensor:
    """:func:`projected` of each example's rows: ``Tensor[B]``, the same weights per example."""
    total = 0.0
    for t in torch.utils._pytree.tree_leaves(out):
        row = t.shape[1:]
        weights = torch.linspace(-1.0, 2.0, math.prod(row), dtype=t.dtype).reshape(1, *row)
        total = total + (t * weights).flatten(1).sum(1) + 0.5 * t.pow(2).flatten(1).sum(1)
    return total


def steps(model, params, buffers, clip_norm, method="ghost"):
    @dpfunc.batched_loss
    def losses(p, batch):
        return projected_rows(functional_call(model, (p, buffers), tuple(batch)))

    def one(p, example):
        args = tuple(t.unsqueeze(0) for t in example)
        return projected(functional_call(model, (p, buffers), args))

    def make(loss):
        return dpfunc.make_train_step(
            loss, dpfunc.optim.sgd(lr=1.0), clip_norm=clip_norm, noise_multiplier=0.0,
            expected_batch_size=B, model=model, method=method,
        )  # fmt: skip

    return make(losses), make(one)


@pytest.mark.parametrize("case", LAYERS, ids=[c.name for c in LAYERS])
def test_every_layer_family_equals_the_one_example_loss(case):
    torch.manual_seed(0)
    model = case.model().double()
    params, buffers = dpfunc.functionalize(model)
    batch = tuple(t.double() if t.is_floating_point() else t
                  for t in case.example(torch.Generator().manual_seed(0)))  # fmt: skip
    mask = torch.ones(B, dtype=torch.bool)
    mask[-1] = False
    batched, one = steps(model, params, buffers, clip_norm=1.0)
    norms = one.clip(params, batch, mask)[1].norm
    clip_norm = float(norms[:-1].median())  # some clipped, some not
    batched, one = steps(model, params, buffers, clip_norm)
    runs_itself = case.name.startswith(RUNS_ITSELF)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, got_stats = batched.clip(params, batch, mask)
    want, want_stats = one.clip(params, batch, mask)
    fell_back = [w for w in caught if "runs one example at a time" in str(w.message)]
    ghosted = set(batched.explain(params, batch).values()) == {"ghost"}
    assert [p.batched for p in batched.clip.ghost.plans.values()] == [ghosted and not runs_itself]
    assert bool(fell_back) == (ghosted and runs_itself)
    torch.testing.assert_close(got_stats.loss, want_stats.loss, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got_stats.norm, want_stats.norm, rtol=1e-9, atol=1e-12)
    for name in params:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12, msg=name)
    # against a batch-size-1 autograd loop (the module itself, no dpfunc)
    trainable = dict(model.named_parameters())
    for i in range(B - 1):
        loss = projected(model(*(t[i : i + 1] for t in batch)))
        grads = torch.autograd.grad(loss, [trainable[n] for n in params], allow_unused=True)
        norm = torch.sqrt(sum(g.square().sum() for g in grads if g is not None))
        torch.testing.assert_close(got_stats.norm[i], norm, rtol=1e-7, atol=1e-12)


class Encoder(nn.Module):
    def __init__(self, norm=None):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), *([norm] if norm else []))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.body(x))


def mixing_step(losses_of, model=None):
    model = Encoder() if model is None else model
    params = {n: p.detach() for n, p in model.named_parameters()}  # functionalize refuses
    buffers = {n: b.detach() for n, b in model.named_buffers()}  # BatchNorm: not the check

    @dpfunc.batched_loss
    def losses(p, batch):
        x, y = batch
        return losses_of(functional_call(model, (p, buffers), (x,)), y)

    step = dpfunc.make_train_step(
        losses, dpfunc.optim.sgd(lr=0.1), clip_norm=1.0, noise_multiplier=1.0,
        expected_batch_size=8, model=model, method="ghost",
    )  # fmt: skip
    return step, params


def over_the_mean(logits, y):  # each loss over the batch's mean loss
    each = F.cross_entropy(logits, y, reduction="none")
    return each / each.mean()


def neighbours_gradient(logits, y):  # the values of each loss alone, not its gradient
    each = F.cross_entropy(logits, y, reduction="none")
    return each + (each.roll(1) - each.roll(1).detach()) * each.detach()


def cancelled(logits, y):  # each loss minus itself through the batch's mean: gradient 0 either way
    each = F.cross_entropy(logits, y, reduction="none")
    return each - each.mean() + each.detach().mean()


def in_batch_negatives(logits, y):  # a contrastive loss over the batch's other rows
    sim = logits @ logits.T
    return F.cross_entropy(sim, torch.arange(len(y)), reduction="none")


@pytest.mark.parametrize("losses_of, what", [
    (over_the_mean, "loss"), (neighbours_gradient, "gradient norm"), (in_batch_negatives, "loss"),
])  # fmt: skip
def test_a_loss_that_mixes_examples_is_refused_before_release(losses_of, what):
    step, params = mixing_step(losses_of)
    state = step.init(params)
    x, y = torch.randn(8, 4), torch.randint(3, (8,))
    noise = dpfunc.standard_normal_like(params, seed=0, step=0)
    with pytest.raises(ValueError, match=f"mixes the examples of a batch: example \\d+'s {what}"):
        step(state, (x, y), torch.ones(8), noise)
    if losses_of is over_the_mean:  # compiled: refused alike, before the graph is made
        with pytest.raises(ValueError, match="mixes the examples"):
            compile_fullgraph(step)(state, (x, y), torch.ones(8), noise)


def test_a_gradient_that_cancels_in_both_passes_is_not_mixing():
    step, params = mixing_step(cancelled)
    summed, stats = step.clip(params, (torch.randn(8, 4), torch.randint(3, (8,))), None)
    assert [p.batched for p in step.clip.ghost.plans.values()] == [True]
    assert float(stats.norm.max()) < 1e-6


def test_a_mean_over_the_batch_and_batchnorm_are_refused():
    step, params = mixing_step(lambda logits, y: F.cross_entropy(logits, y))
    batch = (torch.randn(8, 4), torch.randint(3, (8,)))
    with pytest.raises(ValueError, match="got .* shape \\(\\): a 0-d loss is a reduction over"):
        step.clip(params, batch, None)
    with pytest.raises(ValueError, match="shape \\(1,\\), got"):  # the one-example form too
        dpfunc.per_sample_grads(step.loss_fn, params, batch)
    with pytest.raises(ValueError, match="BatchNorm1d, which normalises over the batch"):
        mixing_step(  # when the step is built: in the check's eval mode it would not show
            lambda logits, y: F.cross_entropy(logits, y, reduction="none"),
            Encoder(norm=nn.BatchNorm1d(8)),
        )


def test_dropout_trains_batched_and_the_check_sees_it_off():
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))
    step, params = mixing_step(lambda logits, y: F.cross_entropy(logits, y, reduction="none"),
                               model)  # fmt: skip
    batch = (torch.randn(8, 4), torch.randint(3, (8,)))
    summed, stats = step.clip(params, batch, None)
    assert [p.batched for p in step.clip.ghost.plans.values()] == [True]
    assert model.training and model[2].training  # modes restored after the check
    assert torch.isfinite(stats.norm).all()


def test_a_batch_of_one_keeps_the_vmap_pass():
    step, params = mixing_step(over_the_mean)
    summed, _ = step.clip(params, (torch.randn(1, 4), torch.randint(3, (1,))), None)
    assert [p.batched for p in step.clip.ghost.plans.values()] == [False]


@pytest.mark.slow
def test_compiled_batched_step_equals_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(),
                          nn.Flatten(), nn.Linear(4 * 6 * 6, 5))  # fmt: skip
    step, params = mixing_step(lambda logits, y: F.cross_entropy(logits, y, reduction="none"),
                               model)  # fmt: skip
    x, y = torch.randn(8, 3, 6, 6), torch.randint(5, (8,))
    mask = torch.ones(8, dtype=torch.bool)
    mask[-2:] = False
    state = step.init(params)
    noise = dpfunc.standard_normal_like(params, seed=0, step=0)
    eager, _ = step(state, (x, y), mask, noise)
    compiled, _ = compile_fullgraph(step)(state, (x, y), mask, noise)
    assert all(p.batched for p in step.clip.ghost.plans.values())
    for name in params:
        torch.testing.assert_close(compiled.params[name], eager.params[name], rtol=1e-5,
                                   atol=1e-6, msg=name)  # fmt: skip


def test_layers_followed_by_in_place_activations():
    """``nn.ReLU(inplace=True)`` changes a planned layer's output after it ran: the batched
    pass differentiates a probe added to that output, not the output itself."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=True), nn.Linear(8, 8),
                          nn.ReLU(inplace=True), nn.Linear(8, 3)).double()  # fmt: skip
    step, params = mixing_step(lambda logits, y: F.cross_entropy(logits, y, reduction="none"),
                               model)  # fmt: skip
    batch = (torch.randn(8, 6, dtype=torch.float64), torch.randint(3, (8,)))
    got, got_stats = step.clip(params, batch, None)
    assert [p.batched for p in step.clip.ghost.plans.values()] == [True]
    grads = dpfunc.per_sample_grads(step.loss_fn, params, batch)
    torch.testing.assert_close(got_stats.norm, dpfunc.per_sample_norms(grads), rtol=1e-9, atol=0)
