"""The Gaussian noise: reproducible draws, the right std, the right denominator."""

import math

import pytest
import torch

import dpfunc


def ks_statistic(samples: torch.Tensor, std: float) -> float:
    """Kolmogorov-Smirnov distance between the samples and N(0, std**2)."""
    x, _ = torch.sort(samples.double().flatten())
    n = x.numel()
    cdf = 0.5 * (1 + torch.erf(x / (std * math.sqrt(2))))
    upper = torch.arange(1, n + 1, dtype=torch.float64) / n - cdf
    lower = cdf - torch.arange(0, n, dtype=torch.float64) / n
    return float(torch.maximum(upper, lower).max())


def ks_critical(n: int, alpha: float = 1e-4) -> float:
    return math.sqrt(-math.log(alpha / 2) / (2 * n))


def test_same_seed_and_step_give_the_same_tree():
    params = {"b": torch.zeros(3), "a": torch.zeros(2, 2, dtype=torch.float64)}
    one = dpfunc.standard_normal_like(params, seed=7, step=3)
    two = dpfunc.standard_normal_like(params, seed=7, step=3)
    other_step = dpfunc.standard_normal_like(params, seed=7, step=4)
    other_seed = dpfunc.standard_normal_like(params, seed=8, step=3)
    assert one["a"].dtype == torch.float64 and one["b"].shape == (3,)
    assert all(torch.equal(one[k], two[k]) for k in params)
    assert not torch.equal(one["a"], other_step["a"])
    assert not torch.equal(one["a"], other_seed["a"])
    # independent of dict insertion order
    swapped = dpfunc.standard_normal_like({"a": params["a"], "b": params["b"]}, seed=7, step=3)
    assert all(torch.equal(one[k], swapped[k]) for k in params)


def test_draws_are_standard_normal():
    noise = dpfunc.standard_normal_like({"w": torch.zeros(50_000)}, seed=0, step=0)["w"]
    assert ks_statistic(noise, 1.0) < ks_critical(noise.numel())


@pytest.mark.parametrize("ratio, accept", [(1.0, True), (2 / 3, False), (3 / 2, False)])
def test_private_step_noise_has_std_sigma_c_over_expected_batch(ratio, accept):
    """Zero gradients, SGD with lr=1: the update is exactly -noise."""
    sigma, clip_norm, expected = 1.3, 0.7, 50.0
    params = {"w": torch.zeros(20_000, dtype=torch.float64)}
    step = dpfunc.make_train_step(
        lambda p, x: (p["w"] * 0).sum() + x.sum() * 0,
        dpfunc.optim.sgd(lr=1.0),
        clip_norm=clip_norm,
        noise_multiplier=sigma,
        expected_batch_size=expected,
    )
    state = step.init(params)
    noise = dpfunc.standard_normal_like(params, seed=1, step=0)
    state, _ = step(state, torch.ones(4, 1, dtype=torch.float64), torch.ones(4), noise)
    std = sigma * clip_norm / expected
    statistic = ks_statistic(-state.params["w"], std * ratio)
    assert (statistic < ks_critical(20_000)) == accept


def test_add_noise_and_average():
    summed = {"w": torch.tensor([1.0, 2.0])}
    noise = {"w": torch.tensor([0.5, -1.0])}
    torch.testing.assert_close(dpfunc.add_noise(summed, noise, 2.0)["w"], torch.tensor([2.0, 0.0]))
    torch.testing.assert_close(dpfunc.add_noise(summed, noise, 0.0)["w"], summed["w"])
    torch.testing.assert_close(dpfunc.average(summed, 4)["w"], torch.tensor([0.25, 0.5]))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: dpfunc.add_noise({"w": torch.ones(2)}, {"v": torch.ones(2)}, 1.0), "structure"),
        (lambda: dpfunc.add_noise({"w": torch.ones(2)}, {"w": torch.ones(3)}, 1.0), "shape"),
        (lambda: dpfunc.add_noise({"w": torch.ones(2)}, {"w": torch.ones(2)}, -1.0), "std"),
        (lambda: dpfunc.average({"w": torch.ones(2)}, 0), "expected_batch_size=0"),
        (lambda: dpfunc.average({"w": torch.ones(2)}, -3.0), "expected_batch_size"),
        (lambda: dpfunc.standard_normal_like({"w": torch.ones(2)}, seed=-1, step=0), "seed"),
        (lambda: dpfunc.standard_normal_like({"w": torch.ones(2)}, seed=0, step=1.5), "step"),
        (
            lambda: dpfunc.standard_normal_like({"w": torch.ones(2)}, seed=0, step=0, secure=1),
            "secure must be a bool, got secure=1",
        ),
    ],
)
def test_bad_arguments_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --------------------------------------------------------------------------- secure noise

SECRET = dpfunc.secret_seed()


def test_secret_seeds_are_fresh_and_256_bits():
    seeds = [dpfunc.secret_seed() for _ in range(64)]
    assert len(set(seeds)) == 64
    assert max(s.bit_length() for s in seeds) == dpfunc.noise.SECRET_BITS
    assert all(0 <= s < 2**256 for s in seeds)


def test_secure_draws_are_deterministic_float64_and_per_step():
    params = {"b": torch.zeros(3, dtype=torch.float16), "a": torch.zeros(5, 2)}
    one = dpfunc.standard_normal_like(params, seed=SECRET, step=3, secure=True)
    two = dpfunc.standard_normal_like(params, seed=SECRET, step=3, secure=True)
    assert {k: (v.dtype, v.shape) for k, v in one.items()} == {
        "a": (torch.float64, (5, 2)),
        "b": (torch.float64, (3,)),
    }
    assert all(torch.equal(one[k], two[k]) for k in params)
    for other in (
        dpfunc.standard_normal_like(params, seed=SECRET, step=4, secure=True),
        dpfunc.standard_normal_like(params, seed=SECRET + 1, step=3, secure=True),
        dpfunc.standard_normal_like(params, seed=SECRET, step=3),  # the default draw
    ):
        assert not torch.equal(one["a"], other["a"].double())
    swapped = dpfunc.standard_normal_like(
        {"a": params["a"], "b": params["b"]}, SECRET, 3, secure=True
    )
    assert all(torch.equal(one[k], swapped[k]) for k in params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # float64: the 4-term sum
@pytest.mark.parametrize("ratio, accept", [(1.0, True), (2 / 3, False), (3 / 2, False)])
def test_secure_draws_are_standard_normal(dtype, ratio, accept):
    params = {"w": torch.zeros(40_000, dtype=dtype)}
    z = dpfunc.standard_normal_like(params, seed=SECRET, step=7, secure=True)["w"]
    assert (ks_statistic(z, ratio) < ks_critical(z.numel())) == accept


def test_secure_draws_are_uncorrelated_within_and_across_leaves():
    params = {"a": torch.zeros(20_001), "b": torch.zeros(20_001)}  # odd: one pair cut short
    z = dpfunc.standard_normal_like(params, seed=SECRET, step=0, secure=True)
    limit = 5 / math.sqrt(20_000)
    for x, y in ((z["a"][:-1], z["a"][1:]), (z["a"], z["b"]), (z["a"][:10_000], z["a"][10_000:-1])):
        assert abs(float(torch.corrcoef(torch.stack([x, y]))[0, 1])) < limit


def test_box_muller_never_takes_the_log_of_zero():
    extremes = torch.tensor([0, -1, 0, -1, 2**62, -(2**63)], dtype=torch.int64)
    z = dpfunc.noise._box_muller_(extremes.clone())
    assert torch.isfinite(z).all() and z.abs().max() < 9  # u in (0, 1]: |z| <= sqrt(-2 ln 2^-52)


def test_secure_noise_is_added_at_double_precision_and_rounded_once():
    summed = {"w": torch.randn(1000)}
    noise = dpfunc.standard_normal_like(summed, seed=SECRET, step=0, secure=True)
    noisy = dpfunc.add_noise(summed, noise, 1.3)["w"]
    assert noisy.dtype == torch.float32
    torch.testing.assert_close(
        noisy, (summed["w"].double() + 1.3 * noise["w"]).float(), rtol=0, atol=0
    )


def test_a_step_with_secure_noise_keeps_float32_parameters():
    params = {"w": torch.zeros(4)}
    step = dpfunc.make_train_step(
        lambda p, x: (p["w"] * x).sum(),
        dpfunc.optim.adam(lr=0.1),
        clip_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=2.0,
    )
    state = step.init(params)
    noise = dpfunc.standard_normal_like(params, seed=SECRET, step=0, secure=True)
    state, _ = step(state, torch.ones(2, 4), torch.ones(2), noise)
    assert (
        state.params["w"].dtype == torch.float32
        and state.opt_state.exp_avg_sq["w"].dtype == torch.float32
    )
