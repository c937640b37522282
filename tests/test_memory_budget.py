"""memory_budget: validated everywhere it is taken, the vmap path's chunk it picks, a result it
does not change (against an unchunked step and a float64 batch-size-1 loop), an explicit
chunk_size that wins (with a warning when over the budget), and method="auto" choosing ghost
clipping untimed when vmap's per-example gradients would not fit."""

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad

import dpfunc
from dpfunc import clipper as step_clipper
from dpfunc import memory
from dpfunc.ghost import clipper as clipper_module
from dpfunc.ghost import remove_hooks

WIDTH, CLASSES, ROWS = 6, 3, 10
ENTRIES = WIDTH * WIDTH + WIDTH + CLASSES * WIDTH + CLASSES  # two Linear layers, counted by hand


def _problem(dtype=torch.float64):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, CLASSES)).to(dtype)
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        x, y = example
        return F.cross_entropy(functional_call(model, (p, buffers), (x[None],)), y[None])

    x = torch.randn(ROWS, WIDTH, dtype=dtype) * 3
    y = torch.randint(CLASSES, (ROWS,))
    return model, params, loss_fn, (x, y)


def _step(loss_fn, clipping="flat", clip_norm=0.7, **kwargs):
    return dpfunc.make_train_step(
        loss_fn, dpfunc.optim.sgd(lr=0.1), clip_norm=clip_norm, noise_multiplier=1.0,
        expected_batch_size=ROWS, clipping=clipping, **kwargs,
    )  # fmt: skip


def _budget(rows: int) -> int:
    """The bytes that hold ``rows`` rows of the float64 problem, by hand."""
    return rows * ENTRIES * 8 * memory.GRADIENT_COPIES


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1G", 2.0**20])
def test_memory_budget_is_validated_everywhere(bad):
    model, params, loss_fn, batch = _problem()
    data = torch.utils.data.TensorDataset(*batch)
    builders = {
        "make_train_step": lambda: _step(loss_fn, memory_budget=bad),
        "TrainStep": lambda: dpfunc.TrainStep(
            loss_fn, dpfunc.optim.sgd(lr=0.1), clip_norm=1.0, noise_multiplier=1.0,
            expected_batch_size=ROWS, memory_budget=bad,
        ),
        "Trainer": lambda: dpfunc.Trainer(
            loss_fn, params, data, optimizer=dpfunc.optim.sgd(lr=0.1), expected_batch_size=4,
            clip_norm=1.0, noise_multiplier=1.0, epochs=1, progress=False, memory_budget=bad,
        ),
        "PrivateGradients": lambda: dpfunc.PrivateGradients(
            model, loss_fn, data, expected_batch_size=4, clip_norm=1.0, noise_multiplier=1.0,
            memory_budget=bad,
        ),
    }  # fmt: skip
    for build in builders.values():
        with pytest.raises(ValueError, match=re.escape(f"memory_budget={bad!r}")):
            build()
    remove_hooks(model)


def test_the_budget_reaches_every_step():
    model, params, loss_fn, batch = _problem()
    data = torch.utils.data.TensorDataset(*batch)
    trainer = dpfunc.Trainer(
        loss_fn, params, data, optimizer=dpfunc.optim.sgd(lr=0.1), expected_batch_size=4,
        clip_norm=1.0, noise_multiplier=1.0, epochs=1, progress=False, memory_budget=12345,
    )  # fmt: skip
    private = dpfunc.PrivateGradients(
        model, loss_fn, data, expected_batch_size=4, clip_norm=1.0, noise_multiplier=1.0,
        memory_budget=12345,
    )  # fmt: skip
    assert trainer.step_fn.clip.memory_budget == private.step_fn.clip.memory_budget == 12345
    assert _step(loss_fn).clip.memory_budget is None
    remove_hooks(model)


@pytest.mark.parametrize("rows, expected", [(1, 1), (3, 3), (4, 4), (ROWS, None)])
def test_the_chunk_is_the_budget_over_one_rows_bytes(rows, expected):
    _, params, loss_fn, _ = _problem()
    assert memory.gradient_entries(params) == ENTRIES
    step = _step(loss_fn, memory_budget=_budget(rows) + 7)  # + 7: less than one more row
    assert step.clip.chunk_for(params, ROWS) == expected
    assert _step(loss_fn, memory_budget=1).clip.chunk_for(params, ROWS) == 1  # never below one row


@pytest.mark.parametrize("clipping", ["flat", "per_layer", "normalized"])
def test_a_budget_changes_nothing_but_memory(monkeypatch, clipping):
    """Chunked (3 + 3 + 3 + 1 rows, one of them padding) against unchunked, float64."""
    _, params, loss_fn, batch = _problem()
    mask = torch.ones(ROWS, dtype=torch.bool)
    mask[4] = False
    noise = dpfunc.standard_normal_like(params, seed=0, step=0)
    seen = []
    real = step_clipper.per_sample_grads_and_losses

    def spy(loss_fn, params, batch, **kwargs):
        seen.append(len(batch[0]))
        return real(loss_fn, params, batch, **kwargs)

    monkeypatch.setattr(step_clipper, "per_sample_grads_and_losses", spy)
    results = []
    for budget in (None, _budget(3)):
        step = _step(loss_fn, clipping=clipping, memory_budget=budget)
        seen.clear()
        results.append(step(step.init(params), batch, mask, noise))
        chunks = seen.copy()
    assert chunks == [3, 3, 3]  # the 9 real rows: eagerly, padding rows are left out
    (plain, plain_metrics), (chunked, chunked_metrics) = results
    for name in params:
        torch.testing.assert_close(chunked.params[name], plain.params[name], rtol=1e-13, atol=0)
    for key in plain_metrics:
        torch.testing.assert_close(chunked_metrics[key], plain_metrics[key], rtol=1e-13, atol=0)


def test_the_chunked_sum_is_the_clipped_sum_of_a_batch_size_one_loop():
    _, params, loss_fn, batch = _problem()
    grads = [grad(loss_fn)(params, (batch[0][i], batch[1][i])) for i in range(ROWS)]
    norms = torch.stack([torch.sqrt(sum(v.square().sum() for v in g.values())) for g in grads])
    clip = float(norms.median())  # some examples clipped, some not
    step = _step(loss_fn, clip_norm=clip, memory_budget=_budget(2))
    summed, stats = step.clip(params, batch, None)
    expected = {n: torch.zeros_like(p) for n, p in params.items()}
    for g, norm in zip(grads, norms):
        for n in params:
            expected[n] += min(1.0, clip / float(norm)) * g[n]
    torch.testing.assert_close(stats.norm, norms, rtol=1e-12, atol=0)
    assert bool(stats.scaled.any()) and not bool(stats.scaled.all())  # both cases are exercised
    for n in params:
        # the clip margin scales factors by 1 + 1.2e-10 in float64 (dpfunc.clipping.clip_margin)
        torch.testing.assert_close(summed[n], expected[n], rtol=1e-8, atol=1e-9 * clip)


def test_an_explicit_chunk_size_wins_and_is_warned_about_over_the_budget():
    _, params, loss_fn, batch = _problem()
    over = _step(loss_fn, chunk_size=5, memory_budget=_budget(2))
    with pytest.warns(UserWarning, match="chunk_size=5 .* over memory_budget"):
        assert over.clip.chunk_for(params, ROWS) == 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert over.clip.chunk_for(params, ROWS) == 5  # once
        assert (
            _step(loss_fn, chunk_size=2, memory_budget=_budget(2)).clip.chunk_for(params, ROWS) == 2
        )
        assert _step(loss_fn, chunk_size=5).clip.chunk_for(params, ROWS) == 5


@pytest.mark.parametrize("fits", [False, True])
def test_auto_ghosts_untimed_where_vmap_would_exceed_the_budget(monkeypatch, auto_timings, fits):
    """A LayerNorm keeps the model off the cost model's dense case; the small-gradient case is
    turned off, so without the budget's case the choice would be timed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 1))
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, x):
        return functional_call(model, (p, buffers), (x[None],)).square().sum()

    monkeypatch.setattr(clipper_module, "SMALL_GRADIENTS", 0)
    calls = auto_timings
    entries = memory.gradient_entries(params)
    need = ROWS * entries * 4 * memory.GRADIENT_COPIES  # float32
    step = _step(loss_fn, model=model, memory_budget=need if fits else need - 1)
    plan = step.explain(params, torch.randn(ROWS, WIDTH))
    if fits:
        assert calls  # timed: the budget does not decide
    else:
        assert not calls and set(plan.values()) == {"ghost"}
    remove_hooks(model)


def test_init_warns_of_a_chunk_size_over_the_budget():
    _, params, loss_fn, _ = _problem()
    with pytest.warns(UserWarning, match="chunk_size=5 .* over memory_budget"):
        _step(loss_fn, chunk_size=5, memory_budget=_budget(2)).init(params)


def test_the_compiled_chunked_step_equals_the_eager_unchunked_one():
    """fullgraph on Dynamo's eager backend: the chunk loop traces (Inductor is not needed)."""
    _, params, loss_fn, batch = _problem()
    mask = torch.ones(ROWS, dtype=torch.bool)
    mask[4] = False
    noise = dpfunc.standard_normal_like(params, seed=0, step=0)
    plain = _step(loss_fn)
    want, _ = plain(plain.init(params), batch, mask, noise)
    chunked = _step(loss_fn, memory_budget=_budget(3))
    compiled = torch.compile(chunked, fullgraph=True, backend="eager")
    got, _ = compiled(chunked.init(params), batch, mask, noise)
    for name in params:
        torch.testing.assert_close(got.params[name], want.params[name], rtol=1e-13, atol=0)
