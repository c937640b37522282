"""Empirical privacy audits: the bound is sound and has power; broken variants are caught.

Every audit here runs the real training code on a GradientCanary problem and
compares the empirical lower bound on epsilon with the accountant's epsilon
(the claim). Sound configurations must stay at or below the claim; each
deliberately broken one must be caught with a bound above it. The claims sit
near epsilon 1 to 2 at delta 1e-5, where a few thousand canary scores a side
separate the two cases by a wide margin (the figures in the comments are
typical values).
"""

import itertools
import math
import warnings

import numpy as np
import pytest
import torch

import dpfunc
from dpfunc import accounting, audit, optim
from dpfunc.audit import epsilon_lower_bound

DELTA = 1e-5
SIGMA = 2.0  # one full-batch step: epsilon 1.99 at DELTA
CLIP = 1.0


def gaussian_epsilon(mu: float, delta: float = DELTA) -> float:
    """The exact epsilon of the Gaussian mechanism with sensitivity / std = mu."""
    return audit.gaussian_dp_epsilon(mu, delta)


# --------------------------------------------------------------------------- the bound


@pytest.mark.parametrize("mu", [0.3, 1.0, 2.5])
def test_gaussian_dp_epsilon_agrees_with_dp_accounting(mu):
    """One unsampled Gaussian step with noise multiplier 1/mu is mu-GDP; PLD's pessimistic
    estimate sits just above the exact value."""
    exact = audit.gaussian_dp_epsilon(mu, DELTA)
    pld = accounting.epsilon(1 / mu, 1.0, 1, DELTA)
    assert exact <= pld <= exact + 2e-3
    assert audit.gaussian_dp_epsilon(0.0, DELTA) == 0.0


def test_gaussian_dp_bound_is_sound_and_nearly_tight_on_gaussians():
    """mu = 0.7, 20,000 scores a side: every repetition at or below the truth, and close."""
    rng = np.random.default_rng(3)
    bounds = [
        audit.gaussian_dp_lower_bound(
            rng.normal(0.7, 1, 20_000), rng.normal(0, 1, 20_000), seed=seed
        )
        for seed in range(20)
    ]
    assert all(0.6 < b <= 0.7 for b in bounds), bounds
    falling = audit.gaussian_dp_lower_bound(rng.normal(-0.7, 1, 20_000), rng.normal(0, 1, 20_000))
    assert 0.6 < falling <= 0.7  # the direction does not matter
    same = audit.gaussian_dp_lower_bound(rng.normal(0, 1, 20_000), rng.normal(0, 1, 20_000))
    assert same < 0.05


def test_bound_has_power_on_two_gaussians():
    """mu = 1 (epsilon 4.38 at 1e-5), 10,000 scores a side: at least 40% of the truth."""
    rng = np.random.default_rng(0)
    truth = gaussian_epsilon(1.0)
    bounds = [
        epsilon_lower_bound(rng.normal(1, 1, 10_000), rng.normal(0, 1, 10_000), delta=DELTA)
        for _ in range(5)
    ]
    assert truth == pytest.approx(4.38, abs=0.01)
    assert all(0.4 * truth <= b <= truth for b in bounds), bounds  # about 2.1


def test_bound_is_sound_where_it_is_nearly_tight():
    """Randomized response at epsilon 1 (delta 0): its best test reaches the true epsilon,
    so a bound that ignored the threshold choice or the sampling error would exceed 1 often.
    At 95% confidence at most about 5% of repetitions may."""
    rng = np.random.default_rng(1)
    p = math.e / (1 + math.e)
    bounds = np.array(
        [
            epsilon_lower_bound(
                (rng.random(20_000) < p).astype(float),
                (rng.random(20_000) < 1 - p).astype(float),
                delta=0.0,
            )
            for _ in range(40)
        ]
    )
    assert (bounds > 1.0).sum() <= 2, bounds
    assert bounds.mean() > 0.85  # and it is not vacuous: about 0.95


def test_bound_is_sound_across_confidence_and_delta():
    """The Gaussian case, with delta: 40 repetitions at mu = 0.5, none above the truth."""
    rng = np.random.default_rng(2)
    truth = gaussian_epsilon(0.5, 1e-3)
    bounds = [
        epsilon_lower_bound(rng.normal(0.5, 1, 3000), rng.normal(0, 1, 3000), delta=1e-3)
        for _ in range(40)
    ]
    assert max(bounds) <= truth


def test_bound_sees_scores_that_fall_with_the_canary():
    rng = np.random.default_rng(3)
    high = epsilon_lower_bound(rng.normal(1, 1, 5000), rng.normal(0, 1, 5000), delta=DELTA)
    low = epsilon_lower_bound(rng.normal(-1, 1, 5000), rng.normal(0, 1, 5000), delta=DELTA)
    assert high > 1.2 and low > 1.2


def test_identical_distributions_give_almost_nothing():
    rng = np.random.default_rng(4)
    bound = epsilon_lower_bound(rng.normal(0, 1, 5000), rng.normal(0, 1, 5000), delta=DELTA)
    assert bound < 0.3


def test_bound_accepts_tensors_lists_and_ties():
    separated = epsilon_lower_bound(torch.ones(1000), np.zeros(1000), delta=DELTA)
    assert 4.0 < separated < math.log(1000)
    assert epsilon_lower_bound([0.0] * 50, [0.0] * 50, delta=0.0) < 0.5  # ties: random order


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(scores_in=[], scores_out=[1.0]), "scores_in must be 1-D and non-empty"),
        (dict(scores_in=[[1.0]], scores_out=[1.0]), "scores_in must be 1-D"),
        (dict(scores_in=[1.0], scores_out=[math.nan]), "scores_out must be finite"),
        (dict(scores_in=[1.0], scores_out=[1.0], delta=1.0), "delta must be a number in"),
        (dict(scores_in=[1.0], scores_out=[1.0], confidence=1.0), "confidence must be a number in"),
    ],
)
def test_bound_rejects_bad_input(kwargs, match):
    kwargs.setdefault("delta", DELTA)
    with pytest.raises(ValueError, match=match):
        epsilon_lower_bound(**kwargs)


def test_bound_rejects_scores_that_are_not_numbers():
    with pytest.raises(TypeError, match="scores_in must be a 1-D tensor or array of numbers"):
        epsilon_lower_bound(["a"], [1.0], delta=DELTA)


# --------------------------------------------------------------------------- the canary


def test_canary_gradient_is_a_fixed_direction_and_nulls_contribute_nothing():
    canary = audit.GradientCanary(5, examples=3, canary_norm=50.0)
    dataset = canary.dataset(torch.tensor([True, False, True, False, False]), keep_size=True)
    grads = dpfunc.per_sample_grads(canary.loss_fn, canary.params, dataset)["weight"]
    assert grads.shape == (3 + 5, 2, 5 + 4)
    assert torch.all(grads[:3, :, :5] == 0)  # real examples never touch canary weights
    for row, i in ((3, 0), (5, 2)):  # present canaries 0 and 2
        expected = torch.zeros(2, 9)
        expected[:, i] = 50.0 * canary.v
        torch.testing.assert_close(grads[row], expected)
    assert torch.all(grads[[4, 6, 7]] == 0)  # null rows
    moved = {"weight": canary.params["weight"] - 0.1 * grads[3]}  # one step along canary 0
    torch.testing.assert_close(canary.scores(moved), torch.tensor([5.0, 0, 0, 0, 0]).double())


def test_canary_rejects_bad_arguments():
    with pytest.raises(ValueError, match="canaries must be an int >= 1, got canaries=0"):
        audit.GradientCanary(0)
    with pytest.raises(ValueError, match="canary_norm must be a finite number > 0"):
        audit.GradientCanary(3, canary_norm=math.inf)
    with pytest.raises(ValueError, match="included must be a bool tensor of shape"):
        audit.GradientCanary(3).dataset(torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="runs must be an int >= 1"):
        audit.canary_scores(lambda d: None, audit.GradientCanary(3), 0)


# --------------------------------------------------------------------------- audits of the step


def audit_step(step, canary, runs, *, physical_batch_size, sample_rate=1.0, steps=1):
    seeds = itertools.count()  # reproducible tests; the scores never use the seeds

    def train(dataset):
        return audit.train_with_step(
            step,
            canary.params,
            dataset,
            steps=steps,
            sample_rate=sample_rate,
            physical_batch_size=physical_batch_size,
            seed=next(seeds),
        )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ghost fallbacks, if any, are not the point here
        scores = audit.canary_scores(train, canary, runs)
    return epsilon_lower_bound(scores.scores_in, scores.scores_out, delta=DELTA)


def full_batch_step(canary, **overrides):
    kwargs = dict(
        clip_norm=CLIP,
        noise_multiplier=SIGMA,
        expected_batch_size=float(canary.canaries),
        model=canary.model,
    )
    kwargs.update(overrides)
    return dpfunc.make_train_step(canary.loss_fn, optim.sgd(1.0), **kwargs)


CLAIM = accounting.epsilon(SIGMA, 1.0, 1, DELTA)


@pytest.mark.parametrize(
    "method, clipping, physical",
    [
        ("vmap", "flat", 1100),
        ("ghost", "flat", 1100),
        ("vmap", "flat", 128),  # nine micro-batches accumulated before the noise
        ("ghost", "per_layer", 256),
        ("vmap", "normalized", 1100),
        ("ghost", "normalized", 1100),
    ],
)
def test_sound_step_audits_below_its_epsilon(method, clipping, physical):
    canary = audit.GradientCanary(1000)
    step = full_batch_step(canary, method=method, clipping=clipping)
    bound = audit_step(step, canary, 10, physical_batch_size=physical)
    assert pytest.approx(1.99, abs=0.01) == CLAIM
    assert 0.3 < bound <= CLAIM  # about 0.5: the canary is seen, and no more than claimed


def test_poisson_sampled_steps_audit_below_their_epsilon():
    canary = audit.GradientCanary(1000)
    step = full_batch_step(canary, expected_batch_size=0.5 * (canary.examples + 500))
    bound = audit_step(step, canary, 10, physical_batch_size=256, sample_rate=0.5, steps=4)
    claim = accounting.epsilon(SIGMA, 0.5, 4, DELTA)
    assert bound <= claim


def test_halved_noise_is_caught():
    """The step adds sigma / 2 while the claim is for sigma: mu = 1 instead of 0.5."""
    canary = audit.GradientCanary(2000)
    step = full_batch_step(canary, noise_multiplier=SIGMA / 2)
    bound = audit_step(step, canary, 40, physical_batch_size=2100)
    assert bound > CLAIM  # about 2.5 against 1.99 (40,000 scores a side)


def test_skipped_clipping_is_caught(monkeypatch):
    import dpfunc.clipping  # the clipping policy of both paths calls clip_factors

    monkeypatch.setattr(
        dpfunc.clipping, "clip_factors", lambda norms, *a, **k: torch.ones_like(norms)
    )
    canary = audit.GradientCanary(500)
    step = full_batch_step(canary, method="vmap")
    bound = audit_step(step, canary, 4, physical_batch_size=600)
    assert bound > CLAIM  # the canaries' norm 1000 dwarfs the noise: about log(1000)


class RealisedBatchSizeStep(dpfunc.TrainStep):
    """Broken on purpose: averages over the realised batch size instead of the expected one.

    The logical step written with the public pieces, as a user might."""

    def logical_step(self, state, micro_batches, noise, *, before_release=None):
        parts = [self.clip(state.params, batch, mask) for batch, mask in micro_batches]
        summed = {k: sum(part[k] for part, _ in parts) for k in state.params}
        realised = sum(float(stats.mask.sum()) for _, stats in parts)
        private = dpfunc.average(dpfunc.add_noise(summed, noise.params, self.noise_std), realised)
        updates, opt_state = self.optimizer.update(private, state.opt_state, state.params)
        params = optim.apply_updates(state.params, updates)
        return state._replace(params=params, opt_state=opt_state, step=state.step + 1), None


def test_realised_batch_size_denominator_is_caught():
    """One canary and one real example: with the canary the noise is halved by the
    denominator 2, without it it is not. The scores' spread gives it away."""
    canary = audit.GradientCanary(1, examples=1)
    step = RealisedBatchSizeStep(
        canary.loss_fn,
        optim.sgd(1.0),
        clip_norm=CLIP,
        noise_multiplier=4.0,
        expected_batch_size=1.0,
    )
    bound = audit_step(step, canary, 2000, physical_batch_size=2)
    claim = accounting.epsilon(4.0, 1.0, 1, DELTA)  # 0.91
    assert bound > claim  # about 1.9


# --------------------------------------------------------------------------- the Trainer


def trainer_for(canary, dataset, **overrides):
    kwargs = dict(
        optimizer=optim.sgd(1.0),
        epochs=1,
        expected_batch_size=0.5 * len(dataset[0]),
        clip_norm=CLIP,
        noise_multiplier=SIGMA,
        delta=DELTA,
        progress=False,
        physical_batch_size=256,
        model=canary.model,
    )
    kwargs.update(overrides)
    return dpfunc.Trainer(canary.loss_fn, canary.params, dataset, **kwargs)


def attack(trainer, seed):
    """The attacker regenerates the noise from ``seed`` and adds it back to the parameters."""
    return audit.remove_known_noise(
        trainer.params,
        seed=seed,
        steps=trainer.steps_done,
        noise_std=trainer.step_fn.noise_std,
        expected_batch_size=trainer.step_fn.expected_batch_size,
        lr=1.0,
        secure=trainer.secure_noise,
    )


@pytest.mark.parametrize("secure_noise", [False, True])
def test_default_trainer_audits_below_its_epsilon_even_against_the_old_seed(secure_noise):
    """seed=None: the attacker who tries the old public seed 0 learns nothing from it."""
    canary = audit.GradientCanary(500)
    claims = []

    def train(dataset):
        trainer = trainer_for(canary, dataset, secure_noise=secure_noise, noise_multiplier=1.0)
        trainer.fit()
        claims.append(trainer.epsilon())
        return attack(trainer, seed=0)

    scores = audit.canary_scores(train, canary, 8, keep_size=True)
    bound = epsilon_lower_bound(scores.scores_in, scores.scores_out, delta=DELTA)
    assert len(set(claims)) == 1  # null rows keep every run's epsilon the same
    assert 0.2 < bound <= claims[0]  # about 0.5 against 4.85


def test_public_seed_is_caught():
    """The old default: seed=0 for every run. Subtracting the regenerated noise leaves the
    exact clipped sums, and the audit proves it: about 4.6 against the claimed 1.83."""
    canary = audit.GradientCanary(500)
    claims = []

    def train(dataset):
        trainer = trainer_for(canary, dataset, seed=0)  # a public seed: broken on purpose
        trainer.fit()
        claims.append(trainer.epsilon())
        return attack(trainer, seed=0)

    scores = audit.canary_scores(train, canary, 4, keep_size=True)
    bound = epsilon_lower_bound(scores.scores_in, scores.scores_out, delta=DELTA)
    assert bound > 2 * claims[0]


def test_adaptive_clipping_trainer_audits_below_its_epsilon():
    """The clip norm moves with a noised count; the sum and the count are accounted together."""
    canary = audit.GradientCanary(500)
    claims = []

    def train(dataset):
        trainer = trainer_for(
            canary, dataset, noise_multiplier=1.0, target_quantile=0.5, count_noise_multiplier=5.0
        )
        trainer.fit()
        claims.append(trainer.epsilon())
        return trainer.params

    scores = audit.canary_scores(train, canary, 8, keep_size=True)
    bound = epsilon_lower_bound(scores.scores_in, scores.scores_out, delta=DELTA)
    assert len(set(claims)) == 1 and bound <= claims[0]


def test_train_with_step_runs_the_trainers_logical_step_with_adaptive_clipping():
    """The audit's loop is the Trainer's: same secret, same adaptive clip norms and noisy
    counts, several micro-batches per step, bit-identical parameters."""
    torch.manual_seed(0)
    x, y = torch.randn(40, 3), torch.randn(40)
    params = {"w": torch.zeros(3), "b": torch.zeros(())}

    def loss_fn(p, example):
        features, target = example
        return (features @ p["w"] + p["b"] - target) ** 2

    settings = dict(
        clip_norm=0.5,
        noise_multiplier=0.8,
        expected_batch_size=10,
        target_quantile=0.5,
        count_noise_multiplier=2.0,
    )
    trainer = dpfunc.Trainer(
        loss_fn, params, (x, y), optimizer=optim.sgd(lr=0.1), epochs=2, seed=1234,
        physical_batch_size=4, progress=False, **settings,
    )  # fmt: skip
    trainer.fit()
    step = dpfunc.make_train_step(loss_fn, optim.sgd(lr=0.1), **settings)
    audited = audit.train_with_step(
        step, params, (x, y), steps=trainer.steps_done, sample_rate=10 / 40,
        physical_batch_size=4, seed=1234,
    )  # fmt: skip
    assert trainer.clip_norm != 0.5  # the clip norm moved: the count was released
    for name in params:
        assert torch.equal(audited[name], trainer.params[name]), name


# --------------------------------------------------------------------------- user-level privacy

COPIES = 4  # the examples of each canary user


def canary_users(canary, dataset):
    """Each canary (or its null row) becomes a user of COPIES identical examples; each real
    example is a user of its own. The number of users, and so the sample rate, is fixed."""
    x, y, kind = dataset
    real = canary.examples
    repeat = torch.cat([torch.ones(real, dtype=torch.int64),
                        torch.full((canary.canaries,), COPIES)])  # fmt: skip
    users = torch.repeat_interleave(torch.arange(real + canary.canaries), repeat)
    return tuple(t.repeat_interleave(repeat, 0) for t in (x, y, kind)), users


def user_audit(canary, runs, *, by_user):
    claims = []

    def train(dataset):
        rows, users = canary_users(canary, dataset)
        unit = dict(privacy_unit="user", max_examples_per_user=COPIES, users=users,
                    expected_batch_size=float(users.unique().numel()))  # fmt: skip
        settings = unit if by_user else dict(expected_batch_size=float(len(rows[0])))
        trainer = trainer_for(canary, rows, physical_batch_size=4 * 512, **settings)
        trainer.fit()
        claims.append(trainer.epsilon())
        return trainer.params

    scores = audit.canary_scores(train, canary, runs, keep_size=True)
    bound = epsilon_lower_bound(scores.scores_in, scores.scores_out, delta=DELTA)
    assert len(set(claims)) == 1
    return bound, claims[0]


def test_a_canary_user_audits_below_the_user_level_epsilon_and_above_the_example_level_one():
    """A user of 4 copies of a gradient canary, present or absent as a whole, in one full-batch
    step. User-level: the user's mean is clipped once (mu = 1/sigma = 0.5), within the printed
    epsilon 1.99 per user. Example-level on the same data: each copy is clipped alone, the user
    moves the sum by 4 C (mu = 2), and the audit proves more than the printed epsilon 1.99 per
    example, which a careless reader would take for the user's."""
    canary = audit.GradientCanary(500)
    by_user, claim = user_audit(canary, 8, by_user=True)
    assert claim == pytest.approx(CLAIM)
    assert 0.2 < by_user <= claim  # about 0.6
    by_example, claim = user_audit(canary, 8, by_user=False)
    assert claim == pytest.approx(CLAIM)
    assert by_example > claim  # about 3.4 against 1.99
    # ... and within what example-level sampling guarantees a user of 4 examples (10.0)
    assert by_example <= accounting.example_sampling_user_epsilon(
        SIGMA, 1.0, 1, DELTA, COPIES, value_discretization_interval=1e-3
    )
