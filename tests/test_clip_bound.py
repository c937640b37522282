"""The clip bound holds as computed: one example's contribution, rounding included, is <= C.

The per-example gradient of ``loss(p, x) = sum_k p_k * x_k`` is ``x`` itself,
exactly in every dtype, so a test picks the gradient an example contributes:
huge, tiny, constant (the worst case for accumulation), of mixed magnitudes, or
with its norm within a few units in the last place of ``C``. The logical batch
holds that one real example among masked rows of other data, over several
micro-batches; the step's running sum (float64) is then exactly that example's
contribution, and its norm, measured in float64, must not exceed ``C``.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

import dpfunc
from dpfunc.clipping import accumulation_dtype
from dpfunc.step import StepNoise

ROWS, MICRO_BATCHES = 4, 3
NEAR = [1 - 1e-5, 1 - 1e-6, 1 - 1e-7, 1.0, 1 + 1e-7, 1 + 1e-6, 1 + 1e-5, 2.0]


def gradient(size, kind, clip_norm, near, scale, dtype, seed):
    """One example's gradient: ``kind`` of direction, norm ``near * C`` or entries ``10**scale``."""
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        v = torch.randn(size, generator=g, dtype=torch.float64)
    elif kind == "constant":
        v = torch.ones(size, dtype=torch.float64)
    else:  # magnitudes spread over six decades: the partial sums differ widely
        spread = torch.rand(size, generator=g, dtype=torch.float64) * 6 - 6
        v = torch.randn(size, generator=g, dtype=torch.float64) * 10**spread
    if near is not None:
        v = v / torch.linalg.vector_norm(v) * clip_norm * near
    else:
        v = v * 10.0**scale
    info = torch.finfo(dtype)
    return v.clamp(-info.max, info.max).to(dtype)


def contribution(step, params, x, seed):
    """What a logical batch whose only real example is ``x`` releases without noise.

    ``step.logical_gradient`` with ``noise_multiplier=0`` and an expected batch size of 1:
    the running sum of its micro-batches (padding around ``x``), rounded as released.
    """
    g = torch.Generator().manual_seed(seed)
    where = int(torch.randint(MICRO_BATCHES * ROWS, (1,), generator=g))
    micro_batches = []
    for m in range(MICRO_BATCHES):
        others = torch.randn(ROWS, x.numel(), generator=g, dtype=torch.float64) * 3
        batch, mask = others.to(x.dtype), torch.zeros(ROWS)
        if where // ROWS == m:
            batch[where % ROWS], mask[where % ROWS] = x, 1.0
        micro_batches.append((batch, mask))
    noise = StepNoise(tree_zeros(params), None)
    private, _, _ = step.logical_gradient(step.init(params), micro_batches, noise)
    return private


def norm64(tree):
    return float(
        torch.linalg.vector_norm(torch.cat([v.reshape(-1).double() for v in tree.values()]))
    )


cases = dict(
    size=st.integers(1_000, 200_000),
    kind=st.sampled_from(["random", "constant", "spread"]),
    log_clip=st.floats(-6, math.log10(3.7e5)),
    near=st.one_of(st.sampled_from(NEAR), st.none()),
    scale=st.floats(-20, 20),
    seed=st.integers(0, 2**16),
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("clipping", ["flat", "per_layer", "normalized"])
@settings(max_examples=10, deadline=None)
@given(**cases)
def test_one_example_contribution_is_within_the_clip_norm(
    clipping, dtype, size, kind, log_clip, near, scale, seed
):
    clip_norm = 10.0**log_clip
    x = gradient(size, kind, clip_norm, near, scale, dtype, seed)
    cut = size // 3  # two modules: per-layer thresholds C / sqrt(2)
    params = {"a.w": torch.zeros(cut, dtype=dtype), "b.w": torch.zeros(size - cut, dtype=dtype)}

    def loss_fn(p, example):
        return (p["a.w"] * example[:cut]).sum() + (p["b.w"] * example[cut:]).sum()

    step = dpfunc.make_train_step(
        loss_fn, dpfunc.optim.sgd(lr=1.0), clip_norm=clip_norm, noise_multiplier=0.0,
        expected_batch_size=1.0, clipping=clipping, method="vmap",
    )  # fmt: skip
    summed = contribution(step, params, x, seed)
    assert norm64(summed) <= clip_norm
    if clipping == "per_layer":
        for k in summed:
            assert norm64({k: summed[k]}) <= clip_norm / math.sqrt(2)
    state, _ = step(step.init(params), x[None], None, tree_zeros(params))  # the update runs
    assert all(state.params[k].dtype == dtype for k in params)


def tree_zeros(params):
    return {k: torch.zeros_like(v) for k, v in params.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@settings(max_examples=6, deadline=None)
@given(**cases)
def test_one_example_contribution_is_within_the_clip_norm_by_ghost_clipping(
    dtype, size, kind, log_clip, near, scale, seed
):
    """A Linear layer's weight gradient of ``sum(W x)`` is ``x``: ghost clipping's outer form."""
    clip_norm = 10.0**log_clip
    x = gradient(size, kind, clip_norm, near, scale, dtype, seed)
    model = nn.Linear(size, 1, bias=False).to(dtype)
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        return functional_call(model, (p, buffers), (example[None],)).sum()

    step = dpfunc.make_train_step(
        loss_fn, dpfunc.optim.sgd(lr=1.0), clip_norm=clip_norm, noise_multiplier=0.0,
        expected_batch_size=1.0, model=model, method="ghost",
    )  # fmt: skip
    assert step.explain(params, torch.zeros(ROWS, size, dtype=dtype)) == {"weight": "ghost"}
    assert norm64(contribution(step, params, x, seed)) <= clip_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_single_micro_batch_step_is_the_pieces_composed(dtype):
    """``step(state, ...)``: the micro-batch's clipped sum in its accumulation dtype, the noise
    added and averaged, rounded once to the parameters' dtype after the update."""
    size, clip_norm = 3000, 0.7
    params = {"w": torch.randn(size, dtype=torch.float64).to(dtype)}

    def loss_fn(p, example):
        return (p["w"] * example).sum()

    step = dpfunc.make_train_step(
        loss_fn, dpfunc.optim.sgd(lr=0.5), clip_norm=clip_norm, noise_multiplier=1.3,
        expected_batch_size=3.0,
    )  # fmt: skip
    batch = (torch.randn(ROWS, size, dtype=torch.float64) * 0.05).to(dtype)
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0])
    noise = dpfunc.standard_normal_like(params, seed=5, step=0)  # public: a test
    short, _ = step(step.init(params), batch, mask, noise)
    summed, _ = step.clip(params, batch, mask, skip_padding=True)
    assert short.params["w"].dtype == dtype
    assert summed["w"].dtype == accumulation_dtype(dtype)
    private = dpfunc.average(dpfunc.add_noise(summed, noise, 1.3 * clip_norm), 3.0)
    assert torch.equal(short.params["w"], (params["w"] - private["w"] * 0.5).to(dtype))


def test_the_margin_compiles_for_a_dynamic_batch_size():
    """Under automatic dynamic shapes the row count is symbolic: the margin still traces."""
    factors = torch.compile(lambda n: dpfunc.clip_factors(n, 1.0), fullgraph=True, dynamic=True)
    for rows in (8, 12):
        norms = torch.rand(rows, dtype=torch.float64) * 3
        torch.testing.assert_close(
            factors(norms), dpfunc.clip_factors(norms, 1.0), rtol=1e-12, atol=0
        )


# --- the ghost path at extreme magnitudes: overflow and underflow in float32 products -----


def _ghost_contribution(din, dout, x, target, clip_norm):
    """The norm (float64) of one example's contribution to the ghost path's clipped sum, for a
    bias-free Linear whose output gradient is ``target`` (the loss is ``(out * target).sum()``)."""
    torch.manual_seed(0)
    model = nn.Linear(din, dout, bias=False)
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        xi, ti = example
        return (functional_call(model, (p, buffers), (xi,)) * ti).sum()

    step = dpfunc.make_train_step(
        loss_fn, dpfunc.optim.sgd(lr=1.0), model=model, method="ghost",
        clip_norm=clip_norm, noise_multiplier=1.0, expected_batch_size=1,
    )  # fmt: skip
    summed, stats = step.clip(params, (x[None], target[None]), torch.ones(1, dtype=torch.bool))
    exact = torch.linalg.matrix_norm(target.double().mT @ x.double()).item()
    return torch.linalg.vector_norm(summed["weight"].double()).item(), exact, stats.norm.item()


def test_gram_rows_that_overflow_count_as_non_finite():
    # every Gram entry is finite, but row 0 sums below -3.4e38 in float32: clamped to 0, the
    # norm would be 1e2 times too small; the example must be left out instead
    t, d = 44, 64
    x = torch.zeros(t, d)
    x[:, 0] = 1.0
    target = torch.zeros(t, d)
    target[:, 0] = 1e18
    target[0, 0] = -1.8e19
    contribution, exact, norm = _ghost_contribution(d, d, x, target, 1.0)
    assert exact > 1e19 and norm >= exact  # inf: dropped as non-finite
    assert contribution <= 1.0


@pytest.mark.parametrize("t, clip_norm", [(64, 1.0), (1, 0.01)])  # Gram form, outer form
def test_products_that_underflow_do_not_hide_a_gradient(t, clip_norm):
    # inputs of 2e-23 (their squares underflow in float32) against output gradients of 9e18:
    # every float32 norm and Gram entry is 0 while the gradient's entries are ordinary
    x, target = torch.full((t, 4096), 2e-23), torch.full((t, 4), 9e18)
    contribution, exact, norm = _ghost_contribution(4096, 4, x, target, clip_norm)
    assert exact > clip_norm and norm >= exact
    assert contribution <= clip_norm * (1 + 1e-12)
