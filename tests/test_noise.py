"""The Gaussian noise: reproducible draws, the right std, the right denominator."""

import hashlib
import math
import re
import struct
import sys
from fractions import Fraction

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


def zero_gradient_step(sigma: float, clip_norm: float, expected: float):
    """A plain-SGD step (lr 1) whose loss has zero gradient: its update is the noise alone."""
    return dpfunc.make_train_step(
        lambda p, x: (p["w"] * 0).sum() + x.sum() * 0,
        dpfunc.optim.sgd(lr=1.0),
        clip_norm=clip_norm,
        noise_multiplier=sigma,
        expected_batch_size=expected,
    )


@pytest.mark.parametrize("ratio, accept", [(1.0, True), (2 / 3, False), (3 / 2, False)])
def test_private_step_noise_has_std_sigma_c_over_expected_batch(ratio, accept):
    """Zero gradients, SGD with lr=1: the update is exactly -noise."""
    sigma, clip_norm, expected = 1.3, 0.7, 50.0
    params = {"w": torch.zeros(20_000, dtype=torch.float64)}
    step = zero_gradient_step(sigma, clip_norm, expected)
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


def test_uniforms_are_midpoints_of_a_2_to_52_grid_strictly_inside_0_1():
    words = [0, -1, 1, -(2**63), 2**63 - 1, 2**52 - 1, 2**52, 0x0123456789ABCDEF, -12345]
    u = dpfunc.noise._uniform_(torch.tensor(words, dtype=torch.int64))
    assert u.dtype == torch.float64
    for word, value in zip(words, u.tolist()):
        k = (word % 2**64) % 2**52  # the low 52 bits of the unsigned word
        assert Fraction(value) == Fraction(2 * k + 1, 2**53)
    assert float(u.min()) == 2**-53 and float(u.max()) == 1 - 2**-53


def test_extreme_keystream_words_give_finite_normals():
    for word in (0, -1):  # all zero bits, all one bits: u = 2**-53 and 1 - 2**-53
        z = dpfunc.noise._box_muller_(torch.full((4,), word, dtype=torch.int64))
        assert torch.isfinite(z).all()
        assert z.abs().max() <= math.sqrt(-2 * math.log(2**-53))


def _chacha20_words(seed: int, step: int, count: int) -> list[int]:
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    key = hashlib.sha256(f"dpfunc.secure-noise:{seed}:{step}".encode()).digest()
    stream = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
    data = stream.update(bytes(8 * count))
    return [int.from_bytes(data[8 * i : 8 * i + 8], "little") for i in range(count)]


def _box_muller(words: list[int]) -> list[float]:
    u = [((w % 2**52) + 0.5) / 2**52 for w in words]
    half = len(u) // 2
    radius = [math.sqrt(-2 * math.log(x)) for x in u[:half]]
    angle = [2 * math.pi * x for x in u[half:]]
    sin = [r * math.sin(a) for r, a in zip(radius, angle)]
    return sin + [r * math.cos(a) for r, a in zip(radius, angle)]


def test_secure_stream_is_the_documented_one():
    """ChaCha20 keyed by SHA-256 of (seed, step), leaf after leaf in sorted-key order."""
    params = {"b": torch.zeros(3), "a": torch.zeros(2, 2, dtype=torch.float64)}
    z = dpfunc.standard_normal_like(params, seed=SECRET, step=11, secure=True)
    words = _chacha20_words(SECRET, 11, 4 * 4 + 4)
    four = _box_muller(words[:16])  # "a": 4 values, 4 terms each
    # rows: sines of pairs 0-3 and 4-7, cosines of pairs 0-3 and 4-7; cosines rolled by one
    expected_a = [
        (four[i] + four[4 + i] + four[8 + (i + 1) % 4] + four[12 + (i + 1) % 4]) / 2
        for i in range(4)
    ]
    expected_b = _box_muller(words[16:20])[:3]  # "b": 3 values from 2 pairs, the last dropped
    torch.testing.assert_close(z["a"].flatten(), torch.tensor(expected_a, dtype=torch.float64))
    torch.testing.assert_close(z["b"], torch.tensor(expected_b, dtype=torch.float64))


def test_default_stream_is_torch_randn_from_a_state_keyed_by_shake256():
    """The CPU generator's 624 Mersenne Twister words are SHAKE-256 of (seed, step)."""
    params = {"b": torch.zeros(3), "a": torch.zeros(2, 2, dtype=torch.float64)}
    z = dpfunc.standard_normal_like(params, seed=SECRET, step=11)
    material = hashlib.shake_256(f"dpfunc.noise:{SECRET}:11".encode()).digest(4 * 624)
    state = torch.Generator().manual_seed(1).get_state()
    words = struct.unpack("<624I", material)
    state[24 : 24 + 8 * 624] = torch.frombuffer(
        bytearray(struct.pack("<624Q", *words)), dtype=torch.uint8
    )
    generator = torch.Generator()
    generator.set_state(state)
    a = torch.randn(2, 2, generator=generator, dtype=torch.float64)
    b = torch.randn(3, generator=generator)
    assert torch.equal(z["a"], a) and torch.equal(z["b"], b)


def test_default_draws_use_every_bit_of_the_seed():
    """manual_seed keeps 32 bits on the CPU: seeds 2**32 apart would share their noise,
    and every step's noise would be one of 2**32 trees an attacker can try."""
    params = {"w": torch.zeros(16)}
    base = dpfunc.standard_normal_like(params, seed=SECRET, step=3)["w"]
    for other in (SECRET + 2**32, SECRET ^ (1 << 200)):
        assert not torch.equal(base, dpfunc.standard_normal_like(params, other, step=3)["w"])
    sample = dpfunc.data.poisson_sample(64, 0.5, seed=7, step=0)
    assert not torch.equal(sample, dpfunc.data.poisson_sample(64, 0.5, seed=7 + 2**32, step=0))


def test_secure_draws_take_a_256_bit_seed_whole():
    params = {"w": torch.zeros(8)}
    top = dpfunc.standard_normal_like(params, seed=2**256 - 1, step=0, secure=True)["w"]
    low = dpfunc.standard_normal_like(params, seed=2**256 - 1 - 2**128, step=0, secure=True)
    assert torch.isfinite(top).all() and not torch.equal(top, low["w"])


def test_secure_without_cryptography_raises_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers", None)
    with pytest.raises(ImportError, match=re.escape('pip install "dpfunc[secure]"')):
        dpfunc.standard_normal_like({"w": torch.zeros(2)}, seed=0, step=0, secure=True)
    assert dpfunc.standard_normal_like({"w": torch.zeros(2)}, seed=0, step=0)["w"].shape == (2,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_secure_noise_is_added_at_double_precision_and_rounded_once(dtype):
    summed = {"w": torch.randn(1000).to(dtype)}
    noise = dpfunc.standard_normal_like(summed, seed=SECRET, step=0, secure=True)
    noisy = dpfunc.add_noise(summed, noise, 1.3)["w"]
    assert noisy.dtype == dtype
    expected = (summed["w"].double() + 1.3 * noise["w"]).to(dtype)
    torch.testing.assert_close(noisy, expected, rtol=0, atol=0)
    twice = (summed["w"] + (1.3 * noise["w"]).to(dtype)).to(dtype)  # rounding noise, then sum
    assert not torch.equal(noisy, twice)


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


def test_a_secure_step_releases_the_noisy_average_rounded_once():
    """Zero gradients, SGD with lr=1: the update is the float32 rounding of std * z / B."""
    sigma, clip_norm, expected = 1.3, 0.7, 3.0
    params = {"w": torch.zeros(1000)}
    step = zero_gradient_step(sigma, clip_norm, expected)
    noise = dpfunc.standard_normal_like(params, seed=SECRET, step=0, secure=True)
    state, _ = step(step.init(params), torch.ones(4, 1), torch.ones(4), noise)
    released = (sigma * clip_norm * noise["w"] / expected).float()  # float64, then one rounding
    assert state.params["w"].dtype == torch.float32
    torch.testing.assert_close(-state.params["w"], released, rtol=0, atol=0)


def test_a_bad_seed_is_refused_without_printing_it():
    secret = dpfunc.secret_seed()
    for bad in (str(secret), -secret, float(secret)):
        for call in (
            lambda b=bad: dpfunc.standard_normal_like({"w": torch.zeros(2)}, seed=b, step=0),
            lambda b=bad: dpfunc.data.poisson_sample(10, 0.5, seed=b, step=0),
            lambda b=bad: dpfunc.data.PoissonBatches(torch.zeros(4), 0.5, 2, seed=b),
        ):
            with pytest.raises(ValueError, match="seed must be an int >= 0") as caught:
                call()
            assert str(secret)[:12] not in str(caught.value)


@pytest.mark.parametrize("secure", [False, True])
def test_complex_parameters_are_refused_not_under_noised(secure):
    with pytest.raises(ValueError, match="params must be real tensors, got dtype torch.complex64"):
        dpfunc.standard_normal_like(
            {"w": torch.zeros(3, dtype=torch.complex64)}, 0, 0, secure=secure
        )
