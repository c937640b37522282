"""Correlated noise (banded square root) against oracles: algebra, DP-SGD, dp-accounting, audits."""

import math

import dp_accounting
import pytest
import torch
from torch._dynamo.testing import CompileCounter

import dpfunc
from dpfunc import accounting, audit, data
from dpfunc.matrix_factorization import (
    banded_noise,
    banded_sqrt_coefficients,
    column_norm_sensitivity,
    correlated_noise,
    init_noise_history,
    normalized_coefficients,
    strategy_matrix,
)
from dpfunc.step import StepNoise


def classifier(dtype=torch.float64):
    """A two-layer tanh network on 6 features, 3 classes, and its one-example loss."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model = model.to(dtype)
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        x, y = example
        out = torch.func.functional_call(model, (p, buffers), (x.unsqueeze(0),))
        return torch.nn.functional.cross_entropy(out, y[None])

    return model, params, loss_fn


def classification_data(n, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g, dtype=dtype), torch.randint(0, 3, (n,), generator=g)


# --------------------------------------------------------------------------- the strategy


def test_coefficients_are_binomials_and_square_to_the_prefix_sum():
    coefficients = banded_sqrt_coefficients(30)
    for k, c in enumerate(coefficients):
        assert c == pytest.approx(math.comb(2 * k, k) / 4**k, rel=1e-14)
    root = strategy_matrix(coefficients, 30)  # untruncated for 30 steps: the exact square root
    prefix_sum = torch.tril(torch.ones(30, 30, dtype=torch.float64))
    torch.testing.assert_close(root @ root, prefix_sum, rtol=0, atol=1e-12)
    assert banded_sqrt_coefficients(1) == (1.0,)


@pytest.mark.parametrize("bands", [1, 2, 4, 16])
def test_sensitivity_is_the_largest_column_norm_and_min_separation_keeps_it(bands):
    coefficients = banded_sqrt_coefficients(bands)
    steps = 3 * bands + 5
    C = strategy_matrix(coefficients, steps)
    zeta = column_norm_sensitivity(coefficients)
    assert C.norm(dim=0).max().item() == pytest.approx(zeta, rel=1e-14)
    # participations at least `bands` apart touch disjoint rows: norms add in squares
    g = torch.Generator().manual_seed(bands)
    for _ in range(20):
        start = int(torch.randint(bands, (1,), generator=g))
        gaps = bands + torch.randint(3, (4,), generator=g)
        steps_of = [start + int(gaps[:i].sum()) for i in range(4)]
        steps_of = [t for t in steps_of if t < steps]
        hit = torch.zeros(steps, dtype=torch.float64)
        hit[steps_of] = 1.0
        assert (C @ hit).norm().item() <= math.sqrt(len(steps_of)) * zeta * (1 + 1e-12)
    if bands > 1:  # closer participations add cross terms: the separation is needed
        hit = torch.zeros(steps, dtype=torch.float64)
        hit[[0, 1]] = 1.0
        assert (C @ hit).norm().item() > math.sqrt(2) * zeta


@pytest.mark.parametrize("bands", [2, 4, 16])
def test_recurrence_is_the_inverse_strategy_applied_to_the_draws(bands):
    coefficients = normalized_coefficients(bands)
    assert column_norm_sensitivity(coefficients) == pytest.approx(1.0, rel=1e-14)
    steps = 40
    z = torch.randn(steps, 3, 2, dtype=torch.float64)
    history = init_noise_history({"w": torch.zeros(3, 2, dtype=torch.float64)}, bands)
    assert history["w"].shape == (bands - 1, 3, 2)
    draws = []
    for t in range(steps):
        w, history = correlated_noise({"w": z[t]}, history, coefficients)
        draws.append(w["w"])
    expected = torch.linalg.solve_triangular(
        strategy_matrix(coefficients, steps), z.reshape(steps, -1), upper=False
    ).reshape(steps, 3, 2)
    torch.testing.assert_close(torch.stack(draws), expected, rtol=1e-12, atol=1e-12)
    # the running sum, what the model carries, holds less noise than DP-SGD's
    assert expected.sum(0).var() < z.sum(0).var()


def test_recurrence_keeps_the_noise_dtype_and_the_history_dtype():
    params = {"w": torch.zeros(5, dtype=torch.float32)}
    history = init_noise_history(params, 4)
    z64 = {"w": torch.randn(5, dtype=torch.float64)}  # a secure draw is float64
    w, history = correlated_noise(z64, history, normalized_coefficients(4))
    assert w["w"].dtype == torch.float64 and history["w"].dtype == torch.float32
    assert init_noise_history(params, 1) == {}


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: banded_sqrt_coefficients(0), "bands"),
        (lambda: column_norm_sensitivity([]), "coefficients"),
        (lambda: column_norm_sensitivity([0.0, 1.0]), "first coefficient"),
        (lambda: strategy_matrix([1.0, math.nan], 3), "finite"),
        (
            lambda: correlated_noise(
                {"w": torch.zeros(3)}, {"w": torch.zeros(2, 3)}, normalized_coefficients(4)
            ),
            "history leaves must have shape",
        ),
        (
            lambda: correlated_noise(
                {"w": torch.zeros(3)}, {"v": torch.zeros(3, 3)}, normalized_coefficients(4)
            ),
            "tree structure",
        ),
    ],
)
def test_bad_strategy_input_raises(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --------------------------------------------------------------------------- sampling


def test_partitions_split_every_example_once_by_the_secret():
    parts = data.partitions(103, 4, seed=5)
    assert sorted(len(p) for p in parts) == [25, 26, 26, 26]
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(103))
    assert all(torch.equal(a, b) for a, b in zip(parts, data.partitions(103, 4, seed=5)))
    assert not torch.equal(parts[0], data.partitions(103, 4, seed=6)[0])
    with pytest.raises(ValueError, match="bands must be at most"):
        data.partitions(3, 4, seed=5)


def test_cyclic_poisson_samples_only_from_the_step_partition():
    batches = data.PoissonBatches(torch.arange(200.0), 0.5, 64, seed=9, bands=4)
    assert batches.expected_batch_size == 25.0
    counts = torch.zeros(200)
    for t in range(400):
        idx = batches.indices(t)
        assert torch.isin(idx, batches.partitions[t % 4]).all()
        counts[idx] += 1
    # each example takes part only in its partition's steps (100 of them), at rate 0.5
    assert counts.mean() == pytest.approx(50, rel=0.03)
    assert counts.max() <= 100
    assert "bands=4" in repr(batches) and "seed=<secret>" in repr(batches)


def test_one_band_is_poisson_sampling_bit_for_bit():
    one = data.PoissonBatches(torch.arange(50.0), 0.3, 16, seed=4, bands=1)
    for t in range(5):
        assert torch.equal(one.indices(t), data.poisson_sample(50, 0.3, seed=4, step=t))
        whole = torch.arange(50)
        assert torch.equal(data.cyclic_poisson_sample(whole, 0.3, seed=4, step=t), one.indices(t))


# --------------------------------------------------------------------------- accounting


@pytest.mark.parametrize("bands, steps", [(1, 12), (4, 12), (4, 13), (16, 40)])
def test_epsilon_is_dp_sgd_for_the_participations(bands, steps):
    sigma, q, delta = 1.3, 0.2, 1e-5
    # the theorem's DP-SGD computation, built here directly with dp_accounting
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)),
        math.ceil(steps / bands),
    )
    independent = dp_accounting.pld.PLDAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
        value_discretization_interval=1e-4,
    )
    expected = independent.compose(event).get_epsilon(delta)
    got = accounting.epsilon(sigma, q, steps, delta, bands=bands)
    # dpfunc's PLD is the library's rounded up by at most 1e-6 relative (never below)
    assert expected <= got <= expected * (1 + 1e-6)
    assert got == accounting.epsilon(sigma, q, math.ceil(steps / bands), delta)
    tracker = accounting.Accountant(bands=bands)
    for _ in range(steps):
        tracker.step(sigma, q)
    assert tracker.steps == steps and tracker.epsilon(delta) == got


def test_banded_accountant_counts_a_participation_at_the_first_step_of_each_round():
    tracker = accounting.Accountant(bands=4)
    epsilons = []
    for _ in range(9):
        tracker.step(1.0, 0.5)
        epsilons.append(tracker.epsilon(1e-5))
    single = accounting.epsilon(1.0, 0.5, 1, 1e-5)
    assert epsilons[0] == single and epsilons[3] == single  # steps 0..3: one round
    assert epsilons[4] == accounting.epsilon(1.0, 0.5, 2, 1e-5) == epsilons[7]
    assert epsilons[8] == accounting.epsilon(1.0, 0.5, 3, 1e-5)
    with pytest.raises(ValueError, match="one \\(noise_multiplier, sample_rate\\)"):
        tracker.step(2.0, 0.5)
    state = tracker.state_dict()
    assert state["bands"] == 4
    restored = accounting.Accountant(bands=1)
    restored.load_state_dict(state)
    assert restored.bands == 4 and restored.epsilon(1e-5) == epsilons[8]
    legacy = accounting.Accountant(bands=4)
    legacy.load_state_dict({"method": "pld", "history": [[1.0, 0.5, 3]]})
    assert legacy.bands == 1  # states saved before bands existed are DP-SGD


def test_calibration_with_bands_meets_the_target():
    sigma = accounting.calibrate_noise_multiplier(2.0, 1e-5, 0.25, 64, bands=8)
    assert accounting.epsilon(sigma, 0.25, 64, 1e-5, bands=8) <= 2.0
    assert accounting.epsilon(sigma / 1.002, 0.25, 64, 1e-5, bands=8) > 2.0
    dp_sgd = accounting.calibrate_noise_multiplier(2.0, 1e-5, 0.25, 8)  # 8 participations
    assert sigma == pytest.approx(dp_sgd, rel=2e-3)


# --------------------------------------------------------------------------- the step


def _zero_grad_run(bands, steps, sigma=1.5, clip=0.5, expected=10.0):
    """Params after each step of plain SGD (lr 1) on a zero loss: minus the summed noise."""
    params = {"w": torch.zeros(7, dtype=torch.float64), "b": torch.zeros(2, dtype=torch.float64)}
    step = dpfunc.make_train_step(
        lambda p, x: 0 * (p["w"].sum() + p["b"].sum()) * x.sum(),
        dpfunc.optim.sgd(lr=1.0),
        clip_norm=clip,
        noise_multiplier=sigma,
        expected_batch_size=expected,
        bands=bands,
    )
    state = step.init(params)
    draws = []
    for t in range(steps):
        z = dpfunc.standard_normal_like(params, seed=3, step=t)
        draws.append(z)
        state, _ = step(state, torch.ones(4, 1, dtype=torch.float64), None, z)
    return state, draws, step


@pytest.mark.parametrize("bands", [4, 16])
def test_step_adds_the_correlated_noise_of_the_normalised_strategy(bands):
    steps, sigma, clip, expected = 24, 1.5, 0.5, 10.0
    state, draws, step = _zero_grad_run(bands, steps, sigma, clip, expected)
    C = strategy_matrix(normalized_coefficients(bands), steps)
    for name in ("w", "b"):
        z = torch.stack([d[name] for d in draws])
        w = torch.linalg.solve_triangular(C, z, upper=False)
        total = -(sigma * clip / expected) * w.sum(0)
        torch.testing.assert_close(state.params[name], total, rtol=1e-10, atol=1e-12)
    assert state.noise_state.history["w"].shape == (bands - 1, 7)
    assert step.coefficients == normalized_coefficients(bands)


def test_one_band_is_the_dp_sgd_step_bit_for_bit():
    model, params, loss_fn = classifier(dtype=torch.float32)
    x, y = classification_data(16, dtype=torch.float32)
    kwargs = dict(clip_norm=0.7, noise_multiplier=1.1, expected_batch_size=12.0)
    banded = dpfunc.make_train_step(loss_fn, dpfunc.optim.sgd(lr=0.2), bands=1, **kwargs)
    dp_sgd = dpfunc.make_train_step(loss_fn, dpfunc.optim.sgd(lr=0.2), **kwargs)
    state, plain = banded.init(params), dp_sgd.init(params)
    assert state.noise_state.history == {}
    reference = params
    for t in range(3):
        noise = dpfunc.standard_normal_like(params, seed=11, step=t)
        mask = (torch.arange(16) % (t + 2) != 0).float()
        state, _ = banded(state, (x, y), mask, noise)
        plain, _ = dp_sgd(plain, (x, y), mask, noise)
        for k in params:  # the DP-SGD step, bit for bit
            assert torch.equal(state.params[k], plain.params[k]), k
        # DP-SGD from the pure pieces, with the same secret and the step's rounding margin;
        # the step sums in float64 and rounds to the parameters' dtype after the noise
        grads = dpfunc.per_sample_grads(loss_fn, reference, (x, y))
        scope = dpfunc.clipping.rounding_scope(reference, rows=16)
        factors = dpfunc.clip_factors(dpfunc.per_sample_norms(grads), 0.7, **scope)
        summed = {k: v.double() for k, v in dpfunc.clipped_sum(grads, factors, mask).items()}
        update = dpfunc.average(dpfunc.add_noise(summed, noise, 1.1 * 0.7), 12.0)
        reference = {k: reference[k] - 0.2 * update[k].float() for k in reference}
        for k in params:  # the eager step leaves padding rows out: the same sum, other rounding
            torch.testing.assert_close(state.params[k], reference[k], rtol=1e-6, atol=1e-7)


def test_ghost_and_micro_batches_give_the_same_banded_step():
    model, params, loss_fn = classifier()
    x, y = classification_data(12)
    kwargs = dict(clip_norm=0.5, noise_multiplier=1.0, expected_batch_size=9.0, bands=4)
    vmap = dpfunc.make_train_step(loss_fn, dpfunc.optim.sgd(lr=0.1), **kwargs)
    ghost = dpfunc.make_train_step(
        loss_fn, dpfunc.optim.sgd(lr=0.1), model=model, method="ghost", **kwargs
    )
    a, b = vmap.init(params), ghost.init(params)
    for t in range(6):
        noise = dpfunc.standard_normal_like(params, seed=2, step=t)
        a, _ = vmap(a, (x, y), None, noise)
        halves = [((x[rows], y[rows]), None) for rows in (slice(0, 5), slice(5, 12))]
        b, _ = ghost.logical_step(b, halves, StepNoise(noise, None))
    for k in params:  # float64 parameters: float64 sums
        torch.testing.assert_close(a.params[k], b.params[k], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(
            a.noise_state.history[k], b.noise_state.history[k], rtol=1e-12, atol=1e-12
        )


def test_banded_step_refuses_adaptive_clipping_and_bad_bands():
    _, params, loss_fn = classifier()
    common = dict(clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=8)
    with pytest.raises(ValueError, match="adaptive clipping"):
        dpfunc.make_train_step(
            loss_fn, dpfunc.optim.sgd(lr=0.1), bands=4, target_quantile=0.5,
            count_noise_multiplier=1.0, **common,
        )  # fmt: skip
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="bands"):
            dpfunc.make_train_step(loss_fn, dpfunc.optim.sgd(lr=0.1), bands=bad, **common)


@pytest.mark.slow
def test_compiled_banded_step_equals_eager_in_one_graph():
    torch._dynamo.reset()
    _, params, loss_fn = classifier(dtype=torch.float32)
    step = dpfunc.make_train_step(
        loss_fn, dpfunc.optim.sgd(lr=0.1, momentum=0.9), clip_norm=0.5,
        noise_multiplier=1.0, expected_batch_size=12.0, bands=4,
    )  # fmt: skip
    counter = CompileCounter()
    counted = torch.compile(step, backend=counter, fullgraph=True)
    inductor = torch.compile(step, fullgraph=True)
    eager = counted_state = compiled = step.init(params)
    for t in range(5):
        x, y = classification_data(16, dtype=torch.float32, seed=t)
        noise = dpfunc.standard_normal_like(params, seed=0, step=t)
        eager, _ = step(eager, (x, y), None, noise)
        counted_state, _ = counted(counted_state, (x, y), None, noise)
        compiled, _ = inductor(compiled, (x, y), None, noise)
        for k in params:
            torch.testing.assert_close(compiled.params[k], eager.params[k], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(counted_state.params[k], eager.params[k])
            torch.testing.assert_close(
                compiled.noise_state.history[k], eager.noise_state.history[k], rtol=1e-5, atol=1e-6
            )
    assert counter.frame_count == 1


# --------------------------------------------------------------------------- the trainer


def _trainer(bands=4, **kwargs):
    _, params, loss_fn = classifier()
    x, y = classification_data(64)
    settings = dict(
        optimizer=dpfunc.optim.sgd(lr=0.1, momentum=0.5), epochs=2, expected_batch_size=8,
        clip_norm=1.0, noise_multiplier=1.2, seed=17, progress=False, bands=bands,
    )  # fmt: skip
    settings.update(kwargs)
    return dpfunc.Trainer(loss_fn, params, (x, y), **settings)


def test_trainer_samples_cyclically_and_accounts_the_participations():
    trainer = _trainer(bands=4)
    assert trainer.sample_rate == 0.5  # 8 expected of the 16 in a partition
    assert trainer.total_steps == 16
    trainer.fit()
    assert trainer.epsilon() == accounting.epsilon(1.2, 0.5, 16, trainer.delta, bands=4)
    assert trainer.epsilon() == accounting.epsilon(1.2, 0.5, 4, trainer.delta)
    assert trainer.state.noise_state.history["0.weight"].shape == (3, 8, 6)
    calibrated = _trainer(bands=4, noise_multiplier=None, target_epsilon=3.0)
    assert accounting.epsilon(calibrated.noise_multiplier, 0.5, 16, calibrated.delta,
                              bands=4) <= 3.0  # fmt: skip


def test_trainer_resumes_a_banded_run_bit_identically(tmp_path):
    whole = _trainer(bands=4, physical_batch_size=5)  # micro-batches too
    whole.fit()
    first = _trainer(bands=4, physical_batch_size=5)
    first.fit(max_steps=6)
    first.save(tmp_path / "run.pt")
    resumed = _trainer(bands=4, physical_batch_size=5)
    resumed.load(tmp_path / "run.pt")
    resumed.fit()
    for k in whole.params:
        assert torch.equal(resumed.params[k], whole.params[k]), k
        assert torch.equal(resumed.state.noise_state.history[k], whole.state.noise_state.history[k])
    with pytest.raises(ValueError, match="bands=4"):  # same sample rate, other strategy
        _trainer(bands=2, expected_batch_size=16).load(tmp_path / "run.pt")


def test_trainer_rejects_a_batch_larger_than_a_partition_and_adaptive_clipping():
    with pytest.raises(ValueError, match="expected_batch_size must be at most"):
        _trainer(bands=16)  # 64 examples: partitions of 4, expected batch 8
    with pytest.raises(ValueError, match="adaptive clipping"):
        _trainer(bands=4, target_quantile=0.5)


# --------------------------------------------------------------------------- audits


def _banded_audit(bands, *, runs, broken=None, sigma=2.0, rounds=2, canaries=1000):
    """The Gaussian-DP lower bound on mu of a banded run, by an attacker who sees every update.

    Sampling rate 1 within the partitions, so every participation is certain and the
    mechanism is exactly Gaussian: the claim is mu = sqrt(participations) / sigma.
    Public seeds: the audit is reproducible research, its runs are not private.
    """
    canary = audit.GradientCanary(canaries, examples=16, features=4)
    n = canary.canaries + canary.examples
    steps = rounds * bands
    step = dpfunc.make_train_step(
        canary.loss_fn, dpfunc.optim.sgd(lr=1.0), clip_norm=1.0, noise_multiplier=sigma,
        expected_batch_size=n / bands, bands=bands,
    )  # fmt: skip
    coefficients = step.coefficients
    sampler_bands = bands
    if broken == "sensitivity 1":  # the strategy not divided by its column norm
        step.noise_mechanism = banded_noise(banded_sqrt_coefficients(bands))
    elif broken == "poisson":  # every example in every step, accounted as cyclic
        sampler_bands = 1
    g = torch.Generator().manual_seed(0)
    scores_in, scores_out = [], []
    for run in range(runs):
        included = torch.rand(canaries, generator=g) < 0.5
        seed = 1000 + run
        parts = data.partitions(n, sampler_bands, seed=seed)
        steps_of = torch.zeros(steps, n, dtype=torch.bool)
        for t in range(steps):  # the attacker knows the partitions, not the noise
            steps_of[t, parts[t % sampler_bands]] = True
        iterates = audit.train_with_step(
            step, canary.params, canary.dataset(included, keep_size=True), steps=steps,
            sample_rate=1.0, physical_batch_size=math.ceil(n / sampler_bands), seed=seed,
            bands=sampler_bands, iterates=True,
        )  # fmt: skip
        scores = audit.correlated_noise_scores(
            canary, iterates, coefficients=coefficients, steps_of=steps_of[:, canary.examples :]
        )
        scores_in.append(scores[included])
        scores_out.append(scores[~included])
    mu = audit.gaussian_dp_lower_bound(torch.cat(scores_in), torch.cat(scores_out))
    claimed = accounting.epsilon(sigma, 1.0, steps, 1e-5, bands=bands)
    assert math.sqrt(accounting.participations(steps, bands)) / sigma == pytest.approx(0.7071, 1e-4)
    return audit.gaussian_dp_epsilon(mu, 1e-5), claimed


@pytest.mark.parametrize("bands", [1, 4, 16])
def test_banded_runs_audit_below_their_epsilon(bands):
    audited, claimed = _banded_audit(bands, runs=60)
    assert 0.7 * claimed < audited <= claimed  # nearly tight, and never above


@pytest.mark.parametrize(
    "bands, broken, runs", [(4, "sensitivity 1", 60), (16, "sensitivity 1", 60), (4, "poisson", 4)]
)
def test_broken_banded_runs_are_caught(bands, broken, runs):
    audited, claimed = _banded_audit(bands, runs=runs, broken=broken)
    assert audited > claimed
