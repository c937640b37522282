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


def _chacha20_words(seed: int, step: int, count: int, leaf: int = 0, block: int = 0) -> list[int]:
    """The documented secure stream: key SHA-256 of (seed, step), nonce (0, leaf, block)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    key = hashlib.sha256(f"dpfunc.secure-noise:{seed}:{step}".encode()).digest()
    nonce = struct.pack("<IIQ", 0, leaf, block)  # block counter 0, then the 12-byte nonce
    stream = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor()
    data = stream.update(bytes(8 * count))
    return [int.from_bytes(data[8 * i : 8 * i + 8], "little") for i in range(count)]


def _box_muller(words: list[int]) -> list[float]:
    u = [((w % 2**52) + 0.5) / 2**52 for w in words]
    half = len(u) // 2
    radius = [math.sqrt(-2 * math.log(x)) for x in u[:half]]
    angle = [2 * math.pi * x for x in u[half:]]
    sin = [r * math.sin(a) for r, a in zip(radius, angle)]
    return sin + [r * math.cos(a) for r, a in zip(radius, angle)]


def _secure_block(leaf: int, block: int, n: int, float64: bool, step: int = 11) -> list[float]:
    """Block ``block`` of leaf ``leaf``, ``n`` values, from the documented recipe in pure Python."""
    if not float64:
        return _box_muller(_chacha20_words(SECRET, step, n + n % 2, leaf, block))[:n]
    z = _box_muller(_chacha20_words(SECRET, step, 4 * n, leaf, block))
    # rows: sines of pairs 0..n-1 and n..2n-1, then their cosines; cosines rolled by one
    return [
        (z[i] + z[n + i] + z[2 * n + (i + 1) % n] + z[3 * n + (i + 1) % n]) / 2 for i in range(n)
    ]


def test_secure_stream_is_the_documented_one():
    """ChaCha20 keyed by SHA-256 of (seed, step), one nonce per (leaf, block), leaves in
    sorted-key order."""
    params = {"b": torch.zeros(3), "a": torch.zeros(2, 2, dtype=torch.float64)}
    z = dpfunc.standard_normal_like(params, seed=SECRET, step=11, secure=True)
    expected_a = _secure_block(0, 0, 4, float64=True)  # "a": 4 values, 4 terms each
    expected_b = _secure_block(1, 0, 3, float64=False)  # "b": 3 values from 2 pairs
    torch.testing.assert_close(z["a"].flatten(), torch.tensor(expected_a, dtype=torch.float64))
    torch.testing.assert_close(z["b"], torch.tensor(expected_b, dtype=torch.float64))


def test_secure_stream_is_cut_into_documented_blocks(monkeypatch):
    """With blocks of 4 values: a float64 leaf of 6 (blocks of 4 and 2) and a float32 leaf of 7
    (4 and 3, an odd block dropping its last normal); pairing and roll stay within a block."""
    monkeypatch.setattr(dpfunc.noise, "NOISE_BLOCK", 4)
    params = {"a": torch.zeros(3, 2, dtype=torch.float64), "b": torch.zeros(7)}
    z = dpfunc.standard_normal_like(params, seed=SECRET, step=11, secure=True)
    expected_a = _secure_block(0, 0, 4, True) + _secure_block(0, 1, 2, True)
    expected_b = _secure_block(1, 0, 4, False) + _secure_block(1, 1, 3, False)
    torch.testing.assert_close(z["a"].flatten(), torch.tensor(expected_a, dtype=torch.float64))
    torch.testing.assert_close(z["b"], torch.tensor(expected_b, dtype=torch.float64))


def _shake_generator(text: str) -> torch.Generator:
    """A CPU generator whose 624 Mersenne Twister words are SHAKE-256 of ``text``."""
    material = hashlib.shake_256(text.encode()).digest(4 * 624)
    state = torch.Generator().manual_seed(1).get_state()
    words = struct.unpack("<624I", material)
    state[24 : 24 + 8 * 624] = torch.frombuffer(
        bytearray(struct.pack("<624Q", *words)), dtype=torch.uint8
    )
    generator = torch.Generator()
    generator.set_state(state)
    return generator


def test_default_stream_is_torch_randn_per_block_from_states_keyed_by_shake256(monkeypatch):
    """Block k of leaf i: torch.randn from a CPU generator whose 624 Mersenne Twister words
    are SHAKE-256 of "dpfunc.noise:{seed}:{step}:{i}:{k}"."""
    monkeypatch.setattr(dpfunc.noise, "NOISE_BLOCK", 40)
    params = {"b": torch.zeros(3), "a": torch.zeros(2, 50, dtype=torch.float64)}
    z = dpfunc.standard_normal_like(params, seed=SECRET, step=11)

    def block(i, k, n, dtype):
        generator = _shake_generator(f"dpfunc.noise:{SECRET}:11:{i}:{k}")
        return torch.randn(n, generator=generator, dtype=dtype)

    a = torch.cat([block(0, 0, 40, torch.float64), block(0, 1, 40, torch.float64),
                   block(0, 2, 20, torch.float64)])  # fmt: skip
    assert torch.equal(z["a"].flatten(), a) and torch.equal(z["b"], block(1, 0, 3, torch.float32))
    # without part, the key is the one the Poisson sample has always used
    plain = dpfunc.noise.keyed_generator("dpfunc.poisson", SECRET, 2, torch.device("cpu"))
    oracle = _shake_generator(f"dpfunc.poisson:{SECRET}:2")
    assert torch.equal(torch.rand(64, generator=plain), torch.rand(64, generator=oracle))


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


# --------------------------------------------------------------------------- random access

SHARD_SHAPES = [(5,), (300,), (7, 3, 11), (2, 40), (1, 200), (9, 64)]  # blocks of 64 below


def shard_rows(d0: int, world: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s rows as torch.chunk cuts them: ceil(d0 / world) each, the last ones short."""
    size = -(-d0 // world)
    return min(rank * size, d0), min((rank + 1) * size, d0)


def draw_shards(shapes, world, rank, dtype, secure, step=5, whole=()):
    """Rank ``rank``'s draw of a tree of ``shapes`` (leaves named in leaf order); the leaf
    indices in ``whole`` are held whole (rows entry None)."""
    params, rows = {}, []
    for i, shape in enumerate(shapes):
        if i in whole:
            params[f"p{i}"], entry = torch.zeros(shape, dtype=dtype), None
        else:
            start, stop = shard_rows(shape[0], world, rank)
            params[f"p{i}"] = torch.zeros(stop - start, *shape[1:], dtype=dtype)
            entry = (shape, start, stop)
        rows.append(entry)
    return dpfunc.standard_normal_like(params, SECRET, step, secure=secure, rows=rows)


@pytest.mark.parametrize("secure", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ranks_draws_concatenate_to_the_whole_draw(monkeypatch, world, dtype, secure):
    monkeypatch.setattr(dpfunc.noise, "NOISE_BLOCK", 64)
    full = {f"p{i}": torch.zeros(s, dtype=dtype) for i, s in enumerate(SHARD_SHAPES)}
    whole = dpfunc.standard_normal_like(full, SECRET, 5, secure=secure)
    shards = [draw_shards(SHARD_SHAPES, world, r, dtype, secure, whole={1}) for r in range(world)]
    for i, shape in enumerate(SHARD_SHAPES):
        name = f"p{i}"
        for rank, shard in enumerate(shards):
            start, stop = (0, shape[0]) if i == 1 else shard_rows(shape[0], world, rank)
            assert shard[name].shape == (stop - start, *shape[1:])
            assert shard[name].dtype == whole[name].dtype
            assert torch.equal(shard[name], whole[name][start:stop])
        if i != 1:
            assert torch.equal(torch.cat([shard[name] for shard in shards]), whole[name])
    # a leaf whose first dim is under the world size leaves later ranks empty
    assert shards[-1]["p4"].numel() == 0 and (world == 2 or shards[-1]["p3"].numel() == 0)


@pytest.mark.parametrize("secure", [False, True])
def test_ranks_draws_concatenate_at_the_real_block_size(secure):
    shape = (3, dpfunc.noise.NOISE_BLOCK // 2 + 5)  # rank 0 of 2 ends 10 values into block 1
    whole = dpfunc.standard_normal_like({"w": torch.zeros(shape)}, SECRET, 2, secure=secure)["w"]
    shards = [draw_shards([shape], 2, rank, torch.float32, secure, step=2)["p0"] for rank in (0, 1)]
    assert torch.equal(torch.cat(shards), whole)


def spy_keyed_generator(monkeypatch) -> list:
    calls = []
    real = dpfunc.noise.keyed_generator

    def spy(domain, seed, step, device, *, part=None):
        calls.append(part)
        return real(domain, seed, step, device, part=part)

    monkeypatch.setattr(dpfunc.noise, "keyed_generator", spy)
    return calls


def spy_chacha20(monkeypatch) -> list:
    from cryptography.hazmat.primitives.ciphers import algorithms

    calls = []
    real = algorithms.ChaCha20

    def spy(key, nonce):
        calls.append(struct.unpack("<IIQ", nonce))  # (counter, leaf, block)
        return real(key, nonce)

    monkeypatch.setattr(algorithms, "ChaCha20", spy)
    return calls


@pytest.mark.parametrize("secure", [False, True])
def test_a_rank_draws_only_the_blocks_that_overlap_its_rows(monkeypatch, secure):
    monkeypatch.setattr(dpfunc.noise, "NOISE_BLOCK", 64)
    calls = spy_chacha20(monkeypatch) if secure else spy_keyed_generator(monkeypatch)
    parts = (lambda: {c[1:] for c in calls}) if secure else (lambda: set(calls))
    shapes = [(10, 30), (10, 30)]  # 300 values: blocks 0-3 of 64 and block 4 of 44
    draw_shards(shapes, 4, 0, torch.float32, secure)  # rows [0, 3): values [0, 90)
    assert parts() == {(0, 0), (0, 1), (1, 0), (1, 1)}
    calls.clear()
    draw_shards(shapes, 4, 1, torch.float32, secure, whole={0})  # leaf 1: values [90, 180)
    assert parts() == {(0, k) for k in range(5)} | {(1, 1), (1, 2)}
    assert len(calls) == 7  # each block keyed once
    calls.clear()
    draw_shards([(2, 30), (10, 30)], 4, 2, torch.float32, secure)  # leaf 0: no rows
    assert parts() == {(1, 2), (1, 3), (1, 4)}  # leaf 1: rows [6, 9) = values [180, 270)
    if secure:
        assert all(counter == 0 for counter, _, _ in calls)


def test_secure_nonces_never_repeat_within_a_draw(monkeypatch):
    monkeypatch.setattr(dpfunc.noise, "NOISE_BLOCK", 64)
    calls = spy_chacha20(monkeypatch)
    params = {f"p{i}": torch.zeros(7 * i + 100, dtype=torch.float64) for i in range(5)}
    dpfunc.standard_normal_like(params, SECRET, 0, secure=True)
    assert len(calls) == len(set(calls)) == sum(-(-v.numel() // 64) for v in params.values())


@pytest.mark.parametrize("secure", [False, True])
def test_blocks_and_leaves_are_independent(secure):
    block = dpfunc.noise.NOISE_BLOCK
    params = {"a": torch.zeros(2 * block), "b": torch.zeros(2 * block)}
    z = dpfunc.standard_normal_like(params, SECRET, 1, secure=secure)
    a, b = z["a"].double(), z["b"].double()
    assert ks_statistic(a, 1.0) < ks_critical(a.numel())

    def corr(x, y):
        return abs(float(torch.corrcoef(torch.stack([x, y]))[0, 1]))

    assert corr(a[block - 1000 : block], a[block : block + 1000]) < 5 / math.sqrt(1000)
    for x, y in ((a[:block], a[block:]), (a, b), (a[:block], b[block:])):  # no shared stream
        assert corr(x, y) < 5 / math.sqrt(block)
        assert not torch.equal(x, y)


BAD_ROWS = [
    (5, r"rows must be None or a sequence with one entry per leaf of params \(2 leaves"),
    ([None], "rows must have one entry per leaf of params, in leaf order: 2 entries, got 1"),
    ([None, "w"], r"rows\[1\] \(leaf 1 in leaf order\) must be None \(the whole leaf\) or"),
    ([None, ((4, 3), 0)], r"rows\[1\] .* a tuple \(full_shape, start, stop\)"),
    ([None, (4, 0, 2)], r"rows\[1\] .*full_shape must be a tuple of ints >= 0 .*full_shape=4"),
    ([None, ((), 0, 0)], r"full_shape must be a tuple .* at least one dimension"),
    ([None, ((4, -3), 0, 2)], r"full_shape must be a tuple of ints >= 0"),
    ([None, ((4, 3), 3, 1)], r"0 <= start <= stop <= full_shape\[0\] = 4, got start=3, stop=1"),
    ([None, ((4, 3), 3, 5)], r"got start=3, stop=5"),
    ([None, ((4, 3), -1, 1)], r"got start=-1, stop=1"),
    ([None, ((4, 3), True, 3)], r"got start=True, stop=3"),
    ([None, ((4, 3), 0, 2.0)], r"got start=0, stop=2.0"),
    ([None, ((4, 3), 0, 3)], r"shape must be \(stop - start, \*full_shape\[1:\]\) = \(3, 3\), got"),
    ([None, ((6, 4), 0, 2)], r"= \(2, 4\), got a leaf of shape \(2, 3\)"),
    ([((1,), 0, 1), None], r"rows\[0\] \(leaf 0 .* = \(1,\), got a leaf of shape \(\)"),
]


@pytest.mark.parametrize("secure", [False, True])
@pytest.mark.parametrize("rows, match", BAD_ROWS)
def test_bad_rows_are_refused_naming_the_leaf(rows, match, secure):
    params = {"a": torch.zeros(()), "b": torch.zeros(2, 3)}  # leaf 0: 0-d, leaf 1: rows 0-1 of 4
    with pytest.raises(ValueError, match=match):
        dpfunc.standard_normal_like(params, SECRET, 0, secure=secure, rows=rows)


def test_rows_accept_whole_leaves_lists_and_torch_sizes():
    params = {"a": torch.zeros(()), "b": torch.zeros(2, 3)}
    whole = dpfunc.standard_normal_like(params, SECRET, 0)
    same = dpfunc.standard_normal_like(params, SECRET, 0, rows=(None, (torch.Size([2, 3]), 0, 2)))
    assert torch.equal(whole["a"], same["a"]) and torch.equal(whole["b"], same["b"])
    bigger = {"a": torch.zeros(()), "b": torch.zeros(4, 3)}
    part = dpfunc.standard_normal_like(params, SECRET, 0, rows=[None, [[4, 3], 2, 4]])
    assert torch.equal(part["b"], dpfunc.standard_normal_like(bigger, SECRET, 0)["b"][2:])
