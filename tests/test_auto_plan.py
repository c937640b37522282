"""method="auto"'s eager choice: the cost model (small per-example gradients: vmap; dense Linear
layers: ghost) without timing, otherwise alternating timings compared by their minima; and the
plan function's compile-time constant mark set without importing Dynamo."""

import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import dpfunc
from dpfunc.ghost import GhostClipper, remove_hooks
from dpfunc.ghost import clipper as clipper_module


def _problem(width: int, dense: bool = False):
    """A small model; ``dense``: Linear layers only (the cost model ghosts those untimed)."""
    norm = nn.Identity() if dense else nn.LayerNorm(width)
    model = nn.Sequential(nn.Linear(width, width), norm, nn.Tanh(), nn.Linear(width, 3))
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, x):
        return functional_call(model, (p, buffers), (x[None],)).square().sum()

    return model, params, loss_fn


@pytest.mark.parametrize("threshold, timed", [(10**9, False), (0, True)])
def test_auto_keeps_vmap_untimed_for_small_gradients(monkeypatch, auto_timings, threshold, timed):
    model, params, loss_fn = _problem(8)
    monkeypatch.setattr(clipper_module, "SMALL_GRADIENTS", threshold)
    calls = auto_timings
    plan = GhostClipper(model, loss_fn, "auto").plan(params, torch.randn(16, 8))
    assert bool(calls) == timed
    if not timed:
        assert not plan.modules and not plan.reasons  # no warning: a choice, not a fallback
        assert dict(plan.vmapped) == {n: clipper_module.SMALL for n in params}
    remove_hooks(model)


def test_small_gradients_bound_counts_rows_times_parameters(monkeypatch):
    model, params, loss_fn = _problem(8)
    entries = 16 * sum(p.numel() for p in params.values())
    for threshold, untimed in [(entries, True), (entries - 1, False)]:
        monkeypatch.setattr(clipper_module, "SMALL_GRADIENTS", threshold)
        plan = GhostClipper(model, loss_fn, "auto").plan(params, torch.randn(16, 8))
        assert (dict(plan.vmapped) == {n: clipper_module.SMALL for n in params}) == untimed
        remove_hooks(model)


def test_the_auto_step_equals_the_vmap_step_when_kept_untimed():
    model, params, loss_fn = _problem(8)
    x, mask = torch.randn(16, 8), torch.ones(16, dtype=torch.bool)
    noise = dpfunc.standard_normal_like(params, seed=0, step=0)
    results = []
    for method in ("auto", "vmap"):
        step = dpfunc.make_train_step(
            loss_fn, dpfunc.optim.sgd(lr=0.1), clip_norm=0.5, noise_multiplier=1.0,
            expected_batch_size=16, model=model, method=method,
        )  # fmt: skip
        results.append(step(step.init(params), x, mask, noise)[0].params)
        if method == "auto":
            assert set(step.explain(params, x).values()) == {clipper_module.SMALL}
    for name in params:
        torch.testing.assert_close(results[0][name], results[1][name], rtol=0, atol=0)
    remove_hooks(model)


def test_the_plan_mark_is_dynamos_own():
    """The mark set without importing Dynamo is what torch.compiler's decorator sets."""
    code = (
        "import sys, dpfunc\n"
        "from dpfunc.ghost import clipper\n"
        "assert 'torch._dynamo' not in sys.modules, 'import dpfunc loaded Dynamo'\n"
        "ours = dict(vars(clipper._plan_for))\n"
        "import torch\n"
        "def f(): pass\n"
        "torch.compiler.assume_constant_result(f)\n"
        "assert ours == dict(vars(f)), (ours, vars(f))\n"
        "assert clipper._assume_constant_result(lambda: 0)._dynamo_marked_constant\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _fake_clock(monkeypatch, durations):
    """perf_counter returning start/stop pairs ``durations`` apart, in call order."""
    ticks = []
    now = 0.0
    for d in durations:
        ticks += [now, now + d]
        now += d + 1.0

    class Clock:
        @staticmethod
        def perf_counter():
            return ticks.pop(0)

    monkeypatch.setattr(clipper_module, "time", Clock)
    return ticks


@pytest.mark.parametrize(
    "ghost, vmap, ghosted",
    [
        ([5.0, 1.0, 5.0], [2.0, 2.0, 2.0], True),  # a slower mean, a faster minimum: ghost
        ([2.0, 2.0, 2.0], [5.0, 1.0, 5.0], False),
        ([1.0, 3.0, 3.0], [3.0, 1.0, 3.0], False),  # a tie keeps vmap
    ],
)
def test_auto_times_alternately_and_compares_the_minima(monkeypatch, ghost, vmap, ghosted):
    model, params, loss_fn = _problem(8)
    monkeypatch.setattr(clipper_module, "SMALL_GRADIENTS", 0)  # the cost model is not decisive
    assert len(ghost) == clipper_module.TIMED_RUNS
    ticks = _fake_clock(monkeypatch, [t for pair in zip(ghost, vmap) for t in pair])
    x = torch.randn(16, 8)
    before = torch.random.get_rng_state()
    plan = GhostClipper(model, loss_fn, "auto").plan(params, x)
    assert not ticks  # every timing was read, and no more
    assert torch.equal(torch.random.get_rng_state(), before)  # the timing leaves the RNG as it was
    assert bool(plan.modules) == ghosted
    if not ghosted:
        assert dict(plan.vmapped) == {n: clipper_module.MEASURED for n in params}
    remove_hooks(model)


def test_auto_ghosts_dense_linear_models_untimed(monkeypatch, auto_timings):
    """Linear layers with one position per example, over SMALL_GRADIENTS: ghost, untimed."""
    model, params, loss_fn = _problem(8, dense=True)
    calls = auto_timings
    entries = 16 * sum(p.numel() for p in params.values())
    monkeypatch.setattr(clipper_module, "SMALL_GRADIENTS", entries - 1)
    plan = GhostClipper(model, loss_fn, "auto").plan(params, torch.randn(16, 8))
    assert not calls and set(plan.explain(params).values()) == {"ghost"}
    remove_hooks(model)
    # a sequence of tokens (several positions per example) is timed instead
    seq_model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    seq_params, buffers = dpfunc.functionalize(seq_model)

    def seq_loss(p, x):
        return functional_call(seq_model, (p, buffers), (x,)).square().sum()  # x: [2, 8]

    monkeypatch.setattr(clipper_module, "SMALL_GRADIENTS", 0)  # 2 positions: Gram is cheaper
    GhostClipper(seq_model, seq_loss, "auto").plan(seq_params, torch.randn(16, 2, 8))
    assert calls
    remove_hooks(seq_model)


def test_the_cost_model_reads_the_padded_rows_not_the_real_ones():
    # eagerly the step leaves padding rows out before planning; the number of real examples
    # in the first micro-batch is private and must not choose the path
    torch.manual_seed(0)
    x, y = torch.randn(16, 1024), torch.randint(0, 512, (16,))
    choices = []
    for real in (4, 12):  # 4 x 525k entries <= SMALL_GRADIENTS < 12 x 525k
        model = nn.Linear(1024, 512)
        params, buffers = dpfunc.functionalize(model)

        def loss_fn(p, ex, model=model, buffers=buffers):
            xi, yi = ex
            return F.cross_entropy(functional_call(model, (p, buffers), (xi[None],)), yi[None])

        step = dpfunc.make_train_step(
            loss_fn, dpfunc.optim.sgd(lr=0.1), model=model, method="auto",
            clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=16,
        )  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step.clip(params, (x, y), torch.arange(16) < real, skip_padding=True)
        (plan,) = step.clip.ghost.plans.values()
        choices.append(sorted(set(plan.explain(list(params)).values())))
    assert choices[0] == choices[1]
