"""Clipping bounds every example's contribution; masking equals removal."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

import dpfunc
from dpfunc.tree import global_norm, tree_map

CLIP_NORMS = [1e-6, 1.0, 1e6, math.inf]
SCALES = [0.0, 1e-30, 1.0, 1e30]


def one_hot(i, size):
    mask = torch.zeros(size)
    mask[i] = 1
    return mask


def random_grads(batch, shapes, scale, dtype):
    return {f"p{k}": torch.randn(batch, *s, dtype=dtype) * scale for k, s in enumerate(shapes)}


shapes_strategy = st.lists(
    st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple), min_size=1, max_size=4
)


@settings(max_examples=25, deadline=None)
@given(
    shapes=shapes_strategy,
    batch=st.integers(1, 5),
    clip_norm=st.sampled_from(CLIP_NORMS),
    scale=st.sampled_from(SCALES),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
    mode=st.sampled_from(["flat", "per_layer", "normalized"]),
)
def test_every_contribution_is_bounded(shapes, batch, clip_norm, scale, dtype, mode):
    if mode == "normalized" and math.isinf(clip_norm):
        clip_norm = 1.0
    grads = random_grads(batch, shapes, scale, dtype)
    if mode == "per_layer":
        groups = {f"g{k}": [name] for k, name in enumerate(grads)}
        factors = dpfunc.clip_factors(dpfunc.per_sample_norms(grads, groups), clip_norm)
    else:
        groups = None
        norms = dpfunc.per_sample_norms(grads)
        assert torch.isfinite(norms).all()  # float64 accumulation: no overflow at 1e30
        factors = dpfunc.clip_factors(norms, clip_norm, normalize=mode == "normalized")
    for i in range(batch):
        contribution = dpfunc.clipped_sum(grads, factors, one_hot(i, batch), groups)
        norm = global_norm(tree_map(lambda t: t.double(), contribution))
        raw = global_norm({k: g[i].double() for k, g in grads.items()})
        assert norm <= clip_norm  # rounding included: the default margin covers it
        if not math.isinf(clip_norm) and mode != "normalized":
            # clipping only shrinks, and leaves small gradients alone
            assert norm <= raw * (1 + 16 * torch.finfo(torch.float32).eps)
            if mode == "flat" and raw <= clip_norm / 1.001:
                torch.testing.assert_close(norm, raw, rtol=1e-5, atol=0)


def test_per_group_thresholds_bound_each_group_and_the_total():
    grads = {"a.w": torch.randn(3, 5) * 10, "a.b": torch.randn(3) * 10, "b.w": torch.randn(3, 4)}
    groups = dpfunc.groups_by_module(grads)
    assert groups == {"a": ["a.w", "a.b"], "b": ["b.w"]}
    thresholds = {"a": 0.3, "b": 0.4}
    factors = dpfunc.clip_factors(dpfunc.per_sample_norms(grads, groups), thresholds)
    assert dpfunc.total_clip_norm(thresholds) == pytest.approx(0.5)
    for i in range(3):
        part = tree_map(
            torch.Tensor.double, dpfunc.clipped_sum(grads, factors, one_hot(i, 3), groups)
        )
        assert global_norm({k: part[k] for k in groups["a"]}) <= 0.3  # rounding included
        assert global_norm({k: part[k] for k in groups["b"]}) <= 0.4
    equal = dpfunc.clip_factors(dpfunc.per_sample_norms(grads, groups), 1.0)
    assert set(equal) == {"a", "b"}
    big = torch.full((1,), 1e9, dtype=torch.float64)
    exact = dict(rows=1, dtype=torch.float64, size=1)  # a float64 margin of about 1e-10
    assert dpfunc.clip_factors({"a": big}, 1.0, **exact)["a"] * 1e9 == pytest.approx(1.0)


def test_flat_factor_edge_cases():
    norms = torch.tensor([0.0, 0.5, 2.0, math.inf, math.nan], dtype=torch.float64)
    exact = dict(dtype=torch.float64, size=4)  # a float64 margin of about 1e-10
    torch.testing.assert_close(
        dpfunc.clip_factors(norms, 1.0, **exact),
        torch.tensor([1, 1, 0.5, 0, 0], dtype=torch.float64),
    )
    torch.testing.assert_close(
        dpfunc.clip_factors(norms, math.inf), torch.tensor([1, 1, 1, 0, 0], dtype=torch.float64)
    )
    auto = dpfunc.clip_factors(norms, 1.0, normalize=True, gamma=0.5, **exact)
    torch.testing.assert_close(auto, torch.tensor([2, 1, 0.4, 0, 0], dtype=torch.float64))
    # the margin only ever shrinks a factor, and the default (any size, float32) is the widest
    default = dpfunc.clip_factors(norms, 1.0)
    assert default[2] < dpfunc.clip_factors(norms, 1.0, **exact)[2] < 0.5
    assert torch.equal(default[:2], torch.ones(2, dtype=torch.float64))


def test_nonfinite_gradients_are_dropped_not_spread():
    grads = {"w": torch.randn(4, 3)}
    grads["w"][1, 0] = math.nan
    grads["w"][2, 2] = math.inf
    factors = dpfunc.clip_factors(dpfunc.per_sample_norms(grads), 1.0)
    assert factors[1] == 0 and factors[2] == 0
    total = dpfunc.clipped_sum(grads, factors)
    keep = torch.tensor([1.0, 0, 0, 1.0])
    expected = dpfunc.clipped_sum({"w": grads["w"][[0, 3]]}, factors[[0, 3]])
    torch.testing.assert_close(total["w"], expected["w"])
    torch.testing.assert_close(dpfunc.clipped_sum(grads, factors, keep)["w"], expected["w"])


def test_eager_norms_are_float64_accurate_without_a_float64_copy():
    """Float32 runs of NORM_CHUNK entries, combined in float64; a tail that is not a
    whole run; constant rows (the worst case for accumulation) and random ones."""
    g = torch.randn(8, 3 * dpfunc.clipping.NORM_CHUNK + 7)
    g[0] = 0.3
    grads = {"w": g, "v": torch.randn(8, 2, 5)}
    reference = torch.sqrt(
        sum(torch.linalg.vector_norm(x.double().flatten(1), dim=1) ** 2 for x in grads.values())
    )
    torch.testing.assert_close(dpfunc.per_sample_norms(grads), reference, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_gradients_are_normed_and_summed_in_float32(dtype):
    """A half result would round each run's norm to 8 (11) bits, and 64 half rows summed
    in half precision lose about as much: both run in float32."""
    g = (torch.randn(64, 3 * dpfunc.clipping.NORM_CHUNK + 5) * 0.3).to(dtype)
    wide = g.double()
    reference = torch.linalg.vector_norm(wide, dim=1)
    torch.testing.assert_close(dpfunc.per_sample_norms({"w": g}), reference, rtol=1e-6, atol=0)
    w = torch.rand(64, dtype=torch.float64)
    summed = dpfunc.clipped_sum({"w": g}, w)["w"]
    assert summed.dtype == torch.float32
    # Higham's bound for a float32 dot product of 64 terms, the weight's rounding included
    gamma = 66 * 2.0**-24 / (1 - 66 * 2.0**-24)
    error = (summed.double() - (w[:, None] * wide).sum(0)).abs()
    assert bool((error <= gamma * (w[:, None] * wide.abs()).sum(0)).all())


def test_overflowing_or_nonfinite_runs_fall_back_to_float64():
    g = torch.randn(4, 300)
    g[1, 5] = 3e38  # its square overflows float32
    g[2, 7] = math.nan
    norms = dpfunc.per_sample_norms({"w": g, "v": torch.ones(4, 2)})
    reference = torch.linalg.vector_norm(g.double(), dim=1).square().add(2).sqrt()
    assert math.isfinite(norms[1]) and math.isnan(norms[2])
    torch.testing.assert_close(norms[[0, 1, 3]], reference[[0, 1, 3]], rtol=1e-7, atol=0)


def test_clipped_sum_is_one_contraction_unless_a_dropped_row_is_nonfinite():
    g = torch.randn(6, 4, 3)
    w = torch.tensor([0.5, 0.0, 1.0, 0.25, 0.0, 1.0])
    expected = (g * w.view(-1, 1, 1)).sum(0)
    torch.testing.assert_close(dpfunc.clipped_sum({"w": g}, w)["w"], expected)
    g[1, 0, 0], g[4, 2, 1] = math.nan, -math.inf  # rows of weight 0
    torch.testing.assert_close(dpfunc.clipped_sum({"w": g}, w)["w"], expected)


def test_empty_batch_sums_to_zero():
    grads = {"w": torch.zeros(0, 3)}
    factors = dpfunc.clip_factors(dpfunc.per_sample_norms(grads), 1.0)
    torch.testing.assert_close(dpfunc.clipped_sum(grads, factors)["w"], torch.zeros(3))


def test_inputs_are_not_modified():
    grads = {"w": torch.randn(4, 3) * 5}
    before = grads["w"].clone()
    factors = dpfunc.clip_factors(dpfunc.per_sample_norms(grads), 1.0)
    dpfunc.clipped_sum(grads, factors, torch.ones(4))
    assert torch.equal(grads["w"], before)


def mlp_loss():
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        x, y = example
        return F.cross_entropy(functional_call(model, (p, buffers), (x.unsqueeze(0),)), y[None])

    return loss_fn, params


@pytest.mark.parametrize("clipping", ["flat", "per_layer", "normalized"])
@pytest.mark.parametrize("clip_norm", [0.01, 1.0, 100.0])
def test_add_remove_one_sensitivity_on_neighbouring_batches(clipping, clip_norm):
    loss_fn, params = mlp_loss()
    x = torch.randn(9, 6, dtype=torch.float64) * 3
    y = torch.randint(0, 3, (9,))

    # the margin follows the physical rows: a fixed 9 whether a row is masked or removed
    scope = dpfunc.clipping.rounding_scope(params, rows=9)

    def private_sum(batch, mask=None):
        grads = dpfunc.per_sample_grads(loss_fn, params, batch)
        if clipping == "per_layer":
            groups = dpfunc.groups_by_module(grads)
            norms = dpfunc.per_sample_norms(grads, groups)
            factors = dpfunc.clip_factors(norms, clip_norm, **scope)
            return dpfunc.clipped_sum(grads, factors, mask, groups)
        factors = dpfunc.clip_factors(
            dpfunc.per_sample_norms(grads), clip_norm, normalize=clipping == "normalized", **scope
        )
        return dpfunc.clipped_sum(grads, factors, mask)

    full = private_sum((x, y))
    for removed in range(9):
        keep = [i for i in range(9) if i != removed]
        neighbour = private_sum((x[keep], y[keep]))
        distance = global_norm(tree_map(torch.sub, full, neighbour))
        assert distance <= clip_norm * (1 + 1e-12)  # the two sums round differently
        masked = private_sum((x, y), 1.0 - one_hot(removed, 9).double())
        for k in full:
            torch.testing.assert_close(masked[k], neighbour[k], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: dpfunc.clip_factors(torch.ones(2), 0.0), "clip_norm"),
        (lambda: dpfunc.clip_factors(torch.ones(2), -1.0), "clip_norm"),
        (lambda: dpfunc.clip_factors(torch.ones(2), math.nan), "clip_norm"),
        (lambda: dpfunc.clip_factors(torch.ones(2), math.inf, normalize=True), "clip_norm=inf"),
        (lambda: dpfunc.clip_factors(torch.ones(2), 1.0, normalize=True, gamma=0), "gamma"),
        (lambda: dpfunc.clip_factors({"a": torch.ones(2)}, {"b": 1.0}), "one threshold per group"),
        (
            lambda: dpfunc.per_sample_norms({"a": torch.ones(2, 1)}, {"g": ["a", "b"]}),
            "unknown=\\['b'\\]",
        ),
        (
            lambda: dpfunc.per_sample_norms(
                {"a": torch.ones(2, 1), "c": torch.ones(2)}, {"g": ["a"]}
            ),
            "missing=\\['c'\\]",
        ),
    ],
)
def test_bad_arguments_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --------------------------------------------------------------------------- the clipping policy

Policy = dpfunc.clipping.ClippingPolicy


def test_policy_decides_each_mode_from_the_norms_alone():
    """Factors as clip_factors gives them; stats and weights as the step reports and sums them."""
    f64 = torch.float64
    grads = {"a.w": torch.randn(5, 3, 2, dtype=f64) * 4, "a.b": torch.randn(5, 3, dtype=f64)}
    grads["b.w"] = torch.randn(5, 4, dtype=f64)
    grads["b.w"][3, 0] = math.nan
    mask = torch.tensor([1, 1, 1, 1, 0.0])
    exact = dict(rows=5, dtype=torch.float64, size=13)
    # the oracle: each example's norms in float64, one parameter at a time
    rows = [{k: g[i].square().sum() for k, g in grads.items()} for i in range(5)]
    for mode in ("flat", "per_layer", "normalized"):
        policy = Policy(mode)
        groups = policy.groups(grads)
        assert groups == (dpfunc.groups_by_module(grads) if mode == "per_layer" else None)
        members = groups or {"all": list(grads)}
        oracle = {
            g: torch.stack([sum(r[n] for n in names) for r in rows]).sqrt()
            for g, names in members.items()
        }
        norms = dpfunc.per_sample_norms(grads, groups)
        clipped = policy(norms, 1.5, mask, **exact)
        want = dpfunc.clip_factors(
            oracle if groups else oracle["all"], 1.5, normalize=mode == "normalized", **exact
        )
        torch.testing.assert_close(clipped.factors, want, rtol=1e-12, atol=0)
        total = torch.stack([sum(r.values()) for r in rows]).sqrt()
        torch.testing.assert_close(clipped.norm, total, rtol=1e-12, atol=0, equal_nan=True)
        below = [f < 1 for f in (want.values() if groups else [want])]
        assert torch.equal(clipped.scaled, torch.stack(below).any(0))
        assert clipped.scaled[3]  # a non-finite norm is dropped: factor 0
        summed = dpfunc.clipped_sum(grads, clipped.weights, groups=groups)
        for k, v in dpfunc.clipped_sum(grads, clipped.factors, mask, groups).items():
            assert torch.equal(summed[k], v)


def test_policy_refuses_what_it_cannot_clip():
    with pytest.raises(ValueError, match="mode must be one of .*got mode='layer'"):
        Policy("layer")(torch.ones(2), 1.0)
    with pytest.raises(ValueError, match="gamma"):
        Policy("normalized", gamma=0.0).groups({"w": torch.ones(2)})
    with pytest.raises(ValueError, match=r"'per_layer' takes norms as \{group"):
        Policy("per_layer")(torch.ones(2), 1.0)
    with pytest.raises(ValueError, match="'flat' takes norms as one Tensor"):
        Policy("flat")({"g": torch.ones(2)}, 1.0)


def test_norms_from_squares_and_weights_by_parameter_follow_the_groups():
    squares = {"a.w": torch.tensor([9.0, 0.0]), "a.b": torch.tensor([16.0, 1.0])}
    squares["b.w"] = torch.tensor([0.0, 4.0])
    groups = {"a": ["a.w", "a.b"], "b": ["b.w"]}
    flat = dpfunc.clipping.norms_from_squares(squares)
    torch.testing.assert_close(flat, torch.tensor([5.0, 5**0.5]))
    grouped = dpfunc.clipping.norms_from_squares(squares, groups)
    torch.testing.assert_close(grouped["a"], torch.tensor([5.0, 1.0]))
    torch.testing.assert_close(grouped["b"], torch.tensor([0.0, 2.0]))
    weights = dpfunc.clipping.weights_by_parameter(grouped, list(squares), groups)
    assert weights["a.w"] is grouped["a"] and weights["b.w"] is grouped["b"]
    assert dpfunc.clipping.weights_by_parameter(flat, ["x", "y"]) == {"x": flat, "y": flat}
    with pytest.raises(ValueError, match="groups="):
        dpfunc.clipping.weights_by_parameter(grouped, list(squares))
    with pytest.raises(ValueError, match=r"parameters \['c'\] belong to no group"):
        dpfunc.clipping.weights_by_parameter(grouped, ["c"], groups)


# --------------------------------------------------------------------------- adaptive clipping


def test_unclipped_count_counts_real_unscaled_examples_only():
    norms = torch.tensor([0.5, 1.0, 2.0, math.nan, math.inf, 0.1], dtype=torch.float64)
    mask = torch.tensor([1, 1, 1, 1, 1, 0])
    assert float(dpfunc.clipping.unclipped_count(norms, 1.0)) == 3.0
    # the masked row counts exactly like the removed one
    with_mask = dpfunc.clipping.unclipped_count(norms, 1.0, mask)
    assert float(with_mask) == float(dpfunc.clipping.unclipped_count(norms[:5], 1.0)) == 2.0


@pytest.mark.parametrize("count_noise", [0.0, 5.0])
def test_adaptive_clip_norm_converges_to_the_target_quantile(count_noise):
    """Norms drawn from Exp(1): the 0.7 quantile is ln(1 / 0.3) = 1.204."""
    generator = torch.Generator().manual_seed(0)  # public: a test
    batch, target, clip = 200, 0.7, 0.05
    for _ in range(400):
        norms = -torch.log(torch.rand(batch, generator=generator, dtype=torch.float64))
        count = dpfunc.clipping.unclipped_count(norms, clip)
        noisy = count + count_noise * torch.randn((), generator=generator, dtype=torch.float64)
        clip = dpfunc.clipping.adaptive_clip_norm(clip, noisy, batch, target, 0.2)
    assert float(clip) == pytest.approx(math.log(1 / 0.3), rel=0.1)


def test_adaptive_clip_norm_rejects_bad_settings():
    with pytest.raises(ValueError, match="target_quantile must be a number in \\(0, 1\\)"):
        dpfunc.clipping.adaptive_clip_norm(1.0, torch.tensor(1.0), 10.0, 1.0, 0.2)
    with pytest.raises(ValueError, match="learning_rate must be a finite number > 0"):
        dpfunc.clipping.adaptive_clip_norm(1.0, torch.tensor(1.0), 10.0, 0.5, 0.0)
