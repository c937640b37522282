"""The accounted hyperparameter search (dpfunc.tune): its epsilon is dp_accounting's on the
exposed event, the trial count follows its distribution, adaptive use and overspending trials
are refused, interrupted trials are accounted and resumed, and a real search runs.

Most trials here are stand-ins for a run (``FakeRun``: an accountant that recorded the steps a
trial would take, and the seed it would carry), so that the search's own logic is tested in
milliseconds; ``test_a_real_search_with_the_trainer`` runs the Trainer itself.
"""

import base64
import dataclasses
import io
import math
import os
import types
import warnings

import dp_accounting
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import stats
from torch import nn
from torch.func import functional_call

import dpfunc
from dpfunc import tune
from dpfunc.tune import Choice, LogUniform, Outcome, RandomSearch, _count

N = 1000  # training examples of every search here
CONFIG = dpfunc.DPConfig(
    clip_norm=1.0, expected_batch_size=1000, epochs=5, noise_multiplier=2.0, delta=1e-5
)  # sample rate 1: the RDP accountant is fast there


class FakeRun:
    """What the search checks of a run: its accountant, size, seed (and whether it is secret)."""

    def __init__(self, config, seed, steps=None, sigma=None, rate=None, n=N):
        event = config.accounting_event(N)
        self.accountant = config.accountant()
        self.accountant.step(
            event.noise_multiplier if sigma is None else sigma,
            event.sample_rate if rate is None else rate,
            config.total_steps(N) if steps is None else steps,
        )
        self.num_examples = n
        self.seed_is_secret = seed is None
        self.seed = dpfunc.secret_seed() if seed is None else seed


def honest(metric=None):
    """A trial function that 'trains' as planned and scores ``metric(hyperparameters)``."""

    def trial(hyperparameters, config, seed):
        score = 0.5 if metric is None else metric(hyperparameters)
        return Outcome(FakeRun(config, seed), score, result=dict(hyperparameters))

    return trial


def library_epsilon(event, delta):
    accountant = dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    )
    accountant.compose(event)
    return accountant.get_epsilon(delta)


# -- accounting -----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [math.inf, 1.0, 0.0, 0.5])
def test_epsilon_is_the_rdp_accountant_on_the_exposed_event(shape):
    config = dpfunc.DPConfig(
        clip_norm=1.0, expected_batch_size=100, epochs=2, target_epsilon=3.0, delta=1e-5
    )
    search = RandomSearch(
        {"lr": LogUniform(0.01, 1.0)}, config, N, mean_trials=8, shape=shape,
        score_noise_multiplier=4.0, validation_size=100, seed=0,
    )  # fmt: skip
    sigma = search.trial_config.noise_multiplier
    # the event built here from the paper's description, not read from the search
    step = dp_event.PoissonSampledDpEvent(0.1, dp_event.GaussianDpEvent(sigma))
    trial = dp_event.ComposedDpEvent(
        [dp_event.SelfComposedDpEvent(step, 20), dp_event.GaussianDpEvent(4.0)]
    )
    expected = dp_event.RepeatAndSelectDpEvent(trial, 8.0, shape)
    assert search.dp_event == expected
    eps = library_epsilon(expected, 1e-5)
    assert search.epsilon() == eps <= 3.0
    assert search.epsilon(1e-7) == library_epsilon(expected, 1e-7) > eps
    # calibrated: 0.2% less noise would exceed the target
    lower = dp_event.PoissonSampledDpEvent(0.1, dp_event.GaussianDpEvent(sigma / 1.002))
    trial = dp_event.ComposedDpEvent(
        [dp_event.SelfComposedDpEvent(lower, 20), dp_event.GaussianDpEvent(4.0)]
    )
    assert library_epsilon(dp_event.RepeatAndSelectDpEvent(trial, 8.0, shape), 1e-5) > 3.0
    # and a single trial of that noise costs well under the search: the search is accounted
    single = library_epsilon(dp_event.SelfComposedDpEvent(step, 20), 1e-5)
    assert single < eps


def test_a_target_out_of_reach_is_refused():
    config = dpfunc.DPConfig(
        clip_norm=1.0, expected_batch_size=100, epochs=1, target_epsilon=0.05, delta=1e-5
    )
    with pytest.raises(ValueError, match="target_epsilon=0.05 cannot be met"):
        RandomSearch({}, config, N, mean_trials=10, score_noise_multiplier=1.0, validation_size=100)


def test_a_given_noise_multiplier_is_each_trials():
    search = RandomSearch({}, CONFIG, N, mean_trials=3, score="public", seed=0)
    assert search.trial_config.noise_multiplier == 2.0
    trial = dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(1.0, dp_event.GaussianDpEvent(2.0)), 5
    )
    assert search.dp_event == dp_event.RepeatAndSelectDpEvent(trial, 3.0, math.inf)


# -- the trial count ------------------------------------------------------------------------


def library_gamma(mean, shape):
    """The halting probability that dp_accounting's RDP bound uses for ``mean``."""
    return rdp_privacy_accountant._gamma_truncated_negative_binomial(shape, mean)


def scipy_pmf(k, mean, shape):
    """P[K = k] of the accounted distribution, from scipy's distributions (the truncated ones
    renormalised) at dp_accounting's gamma, not dpfunc's."""
    if shape == math.inf:
        return stats.poisson.pmf(k, mean)
    gamma = library_gamma(mean, shape)
    if shape == 0:
        return stats.logser.pmf(k, 1 - gamma)
    if k == 0:
        return 0.0
    nb = stats.nbinom(shape, gamma)  # failures before `shape` successes of probability gamma
    return nb.pmf(k) / (1 - nb.pmf(0))


def chi_square_pvalue(counts, mean, shape, top=9):
    """Pearson's test of the counts against the pmf (bins 0 .. top - 1 and the tail; the bins
    expected below 5 times merged into one)."""
    bins = np.bincount(np.minimum(counts, top), minlength=top + 1)
    p = np.array([scipy_pmf(k, mean, shape) for k in range(top)])
    p = np.append(p, 1 - p.sum()) * len(counts)
    keep = p >= 5
    observed, expected = list(bins[keep]), list(p[keep])
    if p[~keep].sum() > 0:
        observed.append(bins[~keep].sum())
        expected.append(p[~keep].sum())
    return stats.chisquare(observed, expected).pvalue


@pytest.mark.parametrize("mean, shape", [(3.0, math.inf), (4.0, 1.0), (4.0, 0.0), (4.0, 0.5)])
def test_the_trial_count_follows_its_distribution(mean, shape):
    counts = [
        len(RandomSearch({}, CONFIG, N, mean_trials=mean, shape=shape, score="public",
                         seed=seed)._state["scores"])
        for seed in range(1500)
    ]  # fmt: skip
    assert chi_square_pvalue(counts, mean, shape) > 1e-3
    assert abs(np.mean(counts) - mean) < 5 * np.std(counts) / len(counts) ** 0.5
    assert all(
        math.isclose(tune.trial_count_pmf(k, mean, shape), scipy_pmf(k, mean, shape),
                     rel_tol=1e-7, abs_tol=1e-15)
        for k in range(12)
    )  # fmt: skip


MEANS_AND_SHAPES = [(m, s) for m in (1.0, 1.0001, 3.0, 8.0, 10_000.0) for s in (0.0, 0.5, 1.0, 4.0)]


@pytest.mark.parametrize("fallback", [False, True])
def test_the_drawn_count_is_never_more_than_the_accounted_one(fallback, monkeypatch):
    """K is drawn at a gamma at least dp_accounting's, whose mean is at most the given one:
    log(1 / gamma) and log E[K] in the bound are then at least the drawn distribution's. The
    library's inversion returns a gamma whose mean is up to 1e-9 above; the fallback (without
    the library's private function) keeps the same rule."""
    if fallback:
        monkeypatch.setattr(_count, "_library_gamma", None)
    for mean, shape in MEANS_AND_SHAPES:
        gamma = _count._tnb_gamma(mean, shape)
        accounted = library_gamma(mean, shape)
        assert accounted <= gamma <= accounted * (1 + 3e-9), (mean, shape)
        assert rdp_privacy_accountant._truncated_negative_binomial_mean(gamma, shape) <= mean


@pytest.mark.parametrize("mean, shape", [(4.0, 0.0), (4.0, 0.5), (2.5, 3.0)])
def test_the_fallback_draws_follow_the_accounted_distribution(mean, shape, monkeypatch):
    """Without dp_accounting's private inversion the count is drawn from the same pmf."""
    monkeypatch.setattr(_count, "_library_gamma", None)
    rng = np.random.default_rng(12)
    counts = [_count._draw_count(rng, mean, shape) for _ in range(3000)]
    assert chi_square_pvalue(counts, mean, shape) > 1e-3
    assert abs(np.mean(counts) - mean) < 5 * np.std(counts) / len(counts) ** 0.5
    wrong = [_count._draw_count(rng, mean * 1.3, shape) for _ in range(3000)]  # the test can fail
    assert chi_square_pvalue(wrong, mean, shape) < 1e-6


def test_the_chi_square_test_rejects_a_wrong_distribution():
    """The same test of geometric draws of mean 3 (numpy's) against Poisson(3) fails."""
    counts = np.random.default_rng(0).geometric(1 / 3.0, 1500)
    assert chi_square_pvalue(counts, 3.0, 1.0) > 1e-3
    assert chi_square_pvalue(counts, 3.0, math.inf) < 1e-6


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mean_trials=0.5), "mean_trials must be a number in \\[1, 10000\\]"),
        (dict(mean_trials=1e9), "mean_trials must be a number in \\[1, 10000\\]"),
        (dict(mean_trials=float("nan")), "mean_trials"),
        (dict(mean_trials=3, shape=-1), "shape must be a number >= 0"),
        (dict(mean_trials=3, score="best"), "score must be one of 'private', 'public'"),
        (dict(mean_trials=3), "give score_noise_multiplier"),
        (dict(mean_trials=3, score="public", score_noise_multiplier=1.0), "leave"),
    ],
)
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RandomSearch({}, CONFIG, N, **kwargs)


def test_bad_distributions_are_refused():
    """Infinite bounds, unordered options (a set draws in another order in another process:
    neither reproducible nor resumable) and integers beyond numpy's range fail when built."""
    for build, error, match in [
        (lambda: tune.Uniform(0.0, math.inf), ValueError, "high must be a finite number"),
        (lambda: tune.Uniform(-math.inf, 0.0), ValueError, "low must be a finite number"),
        (lambda: tune.LogUniform(1e-3, math.inf), ValueError, "high=inf"),
        (lambda: tune.LogUniform(0.0, 1.0), ValueError, "low=0.0"),
        (lambda: tune.IntUniform(0, 2**70), ValueError, "high must be an int <= 2\\*\\*62"),
        (lambda: tune.IntUniform(2, 1), ValueError, "high must be an int >= 2"),
        (lambda: Choice({"sgd", "adam"}), TypeError, "options must be a list or tuple"),
        (lambda: Choice({"sgd": 1}), TypeError, "options must be a list or tuple"),
        (lambda: Choice("sgd"), TypeError, "options must be a list or tuple"),
        (lambda: Choice([]), ValueError, "at least one value"),
    ]:
        with pytest.raises(error, match=match):
            build()


# -- honest by construction -----------------------------------------------------------------


def test_the_hyperparameters_are_drawn_before_any_trial_and_from_the_seed_alone():
    space = {"lr": LogUniform(1e-3, 1.0), "width": Choice([16, 32, 64]), "name": "mine"}
    first = RandomSearch(space, CONFIG, N, mean_trials=6, score="public", seed=7)
    second = RandomSearch(space, CONFIG, N, mean_trials=6, score="public", seed=7)
    good = first.run(honest(lambda h: h["lr"]))
    bad = second.run(honest(lambda h: -h["lr"]))  # other scores: the same draws
    assert [t.hyperparameters for t in good.trials] == [t.hyperparameters for t in bad.trials]
    assert len(good.trials) >= 2 and good.best.hyperparameters != bad.best.hyperparameters
    assert all(t.hyperparameters["name"] == "mine" for t in good.trials)
    assert len({t.hyperparameters["lr"] for t in good.trials}) == len(good.trials)
    other = RandomSearch(space, CONFIG, N, mean_trials=6, score="public", seed=8).run(honest())
    assert [t.hyperparameters for t in other.trials] != [t.hyperparameters for t in good.trials]


def test_adaptive_use_is_refused():
    with pytest.raises(TypeError, match="adaptive"):  # a space computed from earlier results
        RandomSearch(lambda history: {"lr": 0.1}, CONFIG, N, mean_trials=3, score="public")

    class FromHistory:
        def sample(self, rng, history):
            return 0.1

    with pytest.raises(TypeError, match="adaptive"):
        RandomSearch({"lr": FromHistory()}, CONFIG, N, mean_trials=3, score="public")

    search = RandomSearch({"lr": LogUniform(0.01, 1.0)}, CONFIG, N, mean_trials=4,
                          score="public", seed=1, retries=3)  # fmt: skip

    def peeking(hyperparameters, config, seed):
        search.result  # noqa: B018 (reading an earlier result)

    with pytest.raises(RuntimeError, match="released once, at the end"):
        search.run(peeking)

    def nested(hyperparameters, config, seed):
        search.run(honest())

    with pytest.raises(RuntimeError, match="inside a trial"):
        search.run(nested)

    def mutating(hyperparameters, config, seed):
        hyperparameters["lr"] = 1.0

    with pytest.raises(TypeError):  # the trial's hyperparameters are read-only
        search.run(mutating)


@pytest.mark.parametrize("name", ["noise_multiplier", "expected_batch_size", "epochs", "delta"])
def test_a_space_cannot_change_a_trials_event(name):
    with pytest.raises(ValueError, match=f"space\\['{name}'\\] would change"):
        RandomSearch({name: Choice([1, 2])}, CONFIG, N, mean_trials=3, score="public")


def test_the_space_sets_the_clip_norm_of_each_trial():
    seen = []

    def trial(hyperparameters, config, seed):
        seen.append((hyperparameters["clip_norm"], config.clip_norm))
        return Outcome(FakeRun(config, seed), 0.0)

    space = {"clip_norm": LogUniform(0.1, 10.0)}
    RandomSearch(space, CONFIG, N, mean_trials=5, score="public", seed=3).run(trial)
    assert seen and all(a == b for a, b in seen)
    with pytest.raises(ValueError, match="clip_norm"):
        RandomSearch({"clip_norm": -1.0}, CONFIG, N, mean_trials=5, score="public", seed=3)


@pytest.mark.parametrize(
    "run, match",
    [
        (dict(steps=6), "accounted 6 steps"),  # more steps than planned
        (dict(sigma=1.0), "accounted steps"),  # less noise
        (dict(rate=0.5), "accounted steps"),  # another sample rate
        (dict(n=999), "trained on 999 examples"),
        (dict(fixed_seed=True), "its seed was fixed"),  # a fixed seed in a secret search
    ],
)
def test_a_trial_that_spends_more_voids_the_search(run, match, tmp_path):
    path = tmp_path / "search.pt"
    search = RandomSearch({}, CONFIG, N, mean_trials=3, shape=1.0, score="public",
                          checkpoint_path=path)  # fmt: skip

    def trial(hyperparameters, config, seed):
        if run.get("fixed_seed"):
            return Outcome(FakeRun(config, 0), 0.0)
        return Outcome(FakeRun(config, seed, **run), 0.0)

    with pytest.raises(RuntimeError, match=match):
        search.run(trial)
    with pytest.raises(RuntimeError, match="void"):  # now, and after a resume
        search.run(honest())
    search.close()
    with pytest.warns(UserWarning, match="resuming"):
        resumed = RandomSearch({}, CONFIG, N, mean_trials=3, shape=1.0, score="public",
                               checkpoint_path=path)  # fmt: skip
    with pytest.raises(RuntimeError, match="void"):
        resumed.run(honest())


def test_fewer_steps_than_planned_are_accepted():
    def trial(hyperparameters, config, seed):
        return Outcome(FakeRun(config, seed, steps=2), 1.0)

    result = RandomSearch({}, CONFIG, N, mean_trials=2, shape=1.0, score="public").run(trial)
    assert all(t.steps == 2 for t in result.trials)


def test_two_trials_sharing_a_seed_are_refused():
    shared = dpfunc.secret_seed()

    def trial(hyperparameters, config, seed):
        run = FakeRun(config, None)
        run.seed = shared
        return Outcome(run, 0.0)

    # a secret search (K > 1 but with probability e**-200 or so), seeds checked only for reuse
    search = RandomSearch({}, CONFIG, N, mean_trials=200, score="public")
    with pytest.raises(RuntimeError, match="another trial's"):
        search.run(trial)


def test_a_seed_reused_across_a_resume_is_refused(tmp_path):
    """A trial that resumes an earlier trial's run (its seed adopted) is caught after the
    search itself was resumed in another process too: the seeds' hashes are checkpointed."""
    path = tmp_path / "search.pt"
    settings = dict(mean_trials=50, score="public", checkpoint_path=path, retries=1)  # K >= 3
    runs = []

    def first(hyperparameters, config, seed):
        if runs:
            raise KeyboardInterrupt  # in trial 1
        runs.append(FakeRun(config, seed))
        return Outcome(runs[-1], 0.0)

    search = RandomSearch({}, CONFIG, N, **settings)
    with pytest.raises(KeyboardInterrupt):
        search.run(first)
    search.close()
    with pytest.warns(UserWarning, match="resuming"):
        resumed = RandomSearch({}, CONFIG, N, **settings)

    def reusing(hyperparameters, config, seed):
        run = FakeRun(config, seed)  # a secret seed, as a Trainer that adopted one has
        if not runs[1:]:
            run.seed = runs[0].seed  # trial 0's run, continued, once
        runs.append(run)
        return Outcome(run, 0.0)

    with pytest.raises(RuntimeError, match="another trial's"):
        resumed.run(reusing)
    resumed.close()


def test_malformed_outcomes_are_refused():
    search = RandomSearch({}, CONFIG, N, mean_trials=2, shape=1.0, score_noise_multiplier=1.0,
                          validation_size=50, retries=2)  # fmt: skip
    with pytest.raises(TypeError, match="returns dpfunc.tune.Outcome"):
        search.run(lambda h, c, s: 0.5)
    with pytest.raises(TypeError, match="Trainer"):
        search.run(lambda h, c, s: Outcome(object(), [1.0]))
    with pytest.raises(ValueError, match="1-D, one per example"):
        search.run(lambda h, c, s: Outcome(FakeRun(c, s), []))


# -- scores, selection, edge cases ----------------------------------------------------------


def test_the_private_score_is_the_clamped_sum_with_the_stated_noise():
    """Every trial's values sum to 60 of 100 (one NaN, some outside [0, 1]): the scores are
    0.6 + N(0, (5 / 100)**2), and a KS test rejects half and twice that spread."""
    values = torch.tensor([1.0] * 58 + [2.0, 7.0] + [float("nan"), -3.0] + [0.0] * 38)

    def trial(hyperparameters, config, seed):
        return Outcome(FakeRun(config, seed), values)

    search = RandomSearch(
        {}, CONFIG, N, mean_trials=400, score_noise_multiplier=5.0, validation_size=100, seed=11
    )
    scores = np.array([t.score for t in search.run(trial).trials])
    assert stats.kstest((scores - 0.6) / 0.05, "norm").pvalue > 1e-3
    assert stats.kstest((scores - 0.6) / 0.025, "norm").pvalue < 1e-3
    assert stats.kstest((scores - 0.6) / 0.1, "norm").pvalue < 1e-3


def test_nan_scores_rank_last_and_ties_go_to_the_earliest():
    scores = iter([float("nan"), 0.3, 0.7, 0.7, float("nan"), 0.7] + [0.0] * 100)

    def trial(hyperparameters, config, seed):
        return Outcome(FakeRun(config, seed), next(scores), result="mine")

    search = RandomSearch({}, CONFIG, N, mean_trials=40, shape=1.0, score="public", seed=2)
    result = search.run(trial)
    assert len(result.trials) >= 6
    assert result.best == tune.Best(*result.trials[2][1:4]) and result.result == "mine"
    assert math.isnan(result.trials[0].score)


def test_the_released_best_does_not_tell_where_it_stands_in_the_trial_list():
    """The index of the best trial bounds K from below, which the theorem hides: the released
    record holds the best trial's hyperparameters, score and steps, and no index or attempts."""
    search = RandomSearch({"lr": LogUniform(0.01, 1.0)}, CONFIG, N, mean_trials=10, shape=1.0,
                          score_noise_multiplier=2.0, validation_size=50, seed=5)  # fmt: skip
    result = search.run(lambda h, c, s: Outcome(FakeRun(c, s), torch.ones(50), result="net"))
    assert len(result.trials) >= 2
    assert type(result.best)._fields == ("hyperparameters", "score", "steps")
    chosen = max(result.trials, key=lambda t: t.score)
    assert result.best == (chosen.hyperparameters, chosen.score, chosen.steps)
    text = str(result.privacy_report())
    assert "not its index" in text and "the best trial's index" in text


def test_all_nan_scores_release_the_first_trial():
    search = RandomSearch({}, CONFIG, N, mean_trials=5, shape=1.0, score="public", seed=4)
    result = search.run(honest(lambda h: float("nan")))
    assert result.best == tune.Best(*result.trials[0][1:4])


def test_no_trial_releases_nothing():
    seed = next(s for s in range(100) if RandomSearch(
        {}, CONFIG, N, mean_trials=1, score="public", seed=s)._state["scores"] == [])  # fmt: skip
    search = RandomSearch({}, CONFIG, N, mean_trials=1, score="public", seed=seed)
    calls = []
    result = search.run(lambda h, c, s: calls.append(1))
    assert calls == [] and result.trials == () and result.best is None and result.result is None
    assert result.epsilon() == search.epsilon() > 0  # the guarantee is the search's, K = 0 or not
    assert "nothing: K = 0" in str(result.privacy_report())
    assert result.all_trials_epsilon() == 0.0


def test_a_single_point_space():
    space = {"lr": Choice([0.1]), "momentum": 0.9}
    result = RandomSearch(space, CONFIG, N, mean_trials=3, shape=1.0, score="public",
                          seed=0).run(honest())  # fmt: skip
    assert all(t.hyperparameters == {"lr": 0.1, "momentum": 0.9} for t in result.trials)


def test_the_report_names_the_search_and_what_is_released():
    # geometric: K >= 1
    search = RandomSearch({"lr": LogUniform(0.01, 1.0)}, CONFIG, N, mean_trials=3, shape=1.0,
                          score_noise_multiplier=2.0, validation_size=50)  # fmt: skip
    result = search.run(lambda h, c, s: Outcome(FakeRun(c, s), torch.ones(50)))
    report = result.privacy_report()
    text = str(report)
    for words in ("repeat and select", "geometric (shape 1", "the best trial only",
                  "N(0, 2**2)", "secret from the OS CSPRNG", "K whole trials"):  # fmt: skip
        assert words in text, words
    assert report.epsilon == result.epsilon()
    assert result.epsilon() < result.all_trials_epsilon() or len(result.trials) < 2
    assert "trials" not in repr(result)  # the repr shows nothing of K
    composed = dp_event.SelfComposedDpEvent(search.trial_event, len(result.trials))
    if result.trials:
        assert result.all_trials_epsilon() == library_epsilon(composed, 1e-5)


# -- interruptions and checkpoints ----------------------------------------------------------


def test_an_exception_is_accounted_in_advance_and_the_trial_restarts_fresh():
    space = {"lr": LogUniform(1e-3, 1.0)}
    search = RandomSearch(space, CONFIG, N, mean_trials=40, shape=1.0, score="public", seed=9,
                          retries=1)  # fmt: skip
    before = search.epsilon()
    calls = []

    def failing_once(hyperparameters, config, seed):
        calls.append((dict(hyperparameters), seed))
        if len(calls) == 2:
            raise OSError("disk full")
        return Outcome(FakeRun(config, seed), 0.0)

    with pytest.raises(OSError, match="disk full"):
        search.run(failing_once)
    trial = search.trial_event
    assert search.dp_event == dp_event.ComposedDpEvent(
        [
            dp_event.RepeatAndSelectDpEvent(trial, 40.0, 1.0),
            dp_event.SelfComposedDpEvent(trial, 1),
        ]
    )
    assert search.epsilon() == library_epsilon(search.dp_event, 1e-5) == before  # in advance
    result = search.run(failing_once)
    assert calls[2][0] != calls[1][0] and calls[2][1] != calls[1][1]  # fresh draws
    assert result.trials[1].attempts == 2 and result.trials[0].attempts == 1
    assert len(calls) == len(result.trials) + 1
    assert "1 attempts; 1 accounted in advance" in str(result.privacy_report())


def test_one_interruption_more_than_the_retries_voids_the_search(tmp_path):
    """How many attempts a search needs may depend on the data: the epsilon accounts a number
    fixed in advance, and the search that needs more releases nothing."""
    path = tmp_path / "search.pt"
    settings = dict(mean_trials=40, shape=1.0, score="public", seed=9, checkpoint_path=path)
    without = RandomSearch({}, CONFIG, N, **settings)
    plain = without.epsilon()
    assert without.dp_event == dp_event.RepeatAndSelectDpEvent(without.trial_event, 40.0, 1.0)
    without.close()
    path.unlink()
    search = RandomSearch({}, CONFIG, N, **settings, retries=1)
    assert search.epsilon() > plain  # the retry is paid for whether it happens or not
    calls = []

    def failing_twice(hyperparameters, config, seed):
        calls.append(seed)
        if len(calls) in (2, 3):
            raise OSError("disk full")
        return Outcome(FakeRun(config, seed), 0.0)

    with pytest.raises(OSError):
        search.run(failing_twice)
    with pytest.raises(OSError):
        search.run(failing_twice)  # the retry, interrupted too
    with pytest.raises(RuntimeError, match="void .*2 interrupted attempts, more than the retr"):
        search.run(failing_twice)
    assert search.epsilon() >= library_epsilon(search.dp_event, 1e-5)  # both attempts counted
    search.close()
    with pytest.warns(UserWarning, match="resuming"):
        resumed = RandomSearch({}, CONFIG, N, **settings, retries=1)
    with pytest.raises(RuntimeError, match="void"):  # and after a resume
        resumed.run(failing_twice)
    resumed.close()
    with pytest.raises(ValueError, match="retries differ"):  # more retries after the fact
        RandomSearch({}, CONFIG, N, **settings, retries=2)
    with pytest.raises(ValueError, match="retries"):
        RandomSearch({}, CONFIG, N, mean_trials=3, score="public", retries=-1)


def test_a_search_resumes_from_its_checkpoint(tmp_path):
    path = tmp_path / "search.pt"
    space = {"lr": LogUniform(1e-3, 1.0)}
    settings = dict(mean_trials=20, shape=1.0, score_noise_multiplier=3.0, checkpoint_path=path,
                    validation_size=40, seed=1, retries=1)  # fmt: skip
    calls = []

    def crashing(hyperparameters, config, seed):
        calls.append(hyperparameters["lr"])
        if len(calls) == 3:
            raise KeyboardInterrupt  # a crash in the middle of trial 2
        return Outcome(FakeRun(config, seed), torch.rand(40))

    first = RandomSearch(space, CONFIG, N, **settings)
    assert path.exists() and len(first._state["scores"]) >= 4  # this seed draws K >= 4
    with pytest.raises(ValueError, match="held by another live search"):
        RandomSearch(space, CONFIG, N, **settings)
    with pytest.raises(KeyboardInterrupt):
        first.run(crashing)
    saved = list(first._state["scores"][:2])
    count = len(first._state["scores"])
    first.close()
    with pytest.raises(ValueError, match="mean_trials differ"):  # another search
        RandomSearch(space, CONFIG, N, **{**settings, "mean_trials": 21})
    with pytest.raises(ValueError, match="space differ"):
        RandomSearch({"lr": LogUniform(1e-3, 0.5)}, CONFIG, N, **settings)
    with pytest.warns(UserWarning, match="1 interrupted attempts"):
        second = RandomSearch(space, CONFIG, N, **settings)
    result = second.run(crashing)
    assert len(result.trials) == count  # K is not drawn again
    assert [t.score for t in result.trials[:2]] == saved  # completed trials are not run again
    assert len(calls) == count + 1 and calls[3] != calls[2]  # trial 2 again, fresh draws
    assert result.trials[2].attempts == 2
    no_retry = {**settings, "checkpoint_path": None, "retries": 0}
    assert result.epsilon() == library_epsilon(second.dp_event, 1e-5) > RandomSearch(
        space, CONFIG, N, **no_retry).epsilon()  # fmt: skip
    second.close()


def test_a_resumed_secret_search_draws_a_fresh_secret(tmp_path):
    """The fork rule: two continuations of one checkpoint never share score noise."""
    path = tmp_path / "search.pt"
    settings = dict(
        mean_trials=3,
        shape=1.0,
        score_noise_multiplier=3.0,
        validation_size=40,
        checkpoint_path=path,
    )
    first = RandomSearch({}, CONFIG, N, **settings)
    first.close()
    with pytest.warns(UserWarning, match="resuming"):
        second = RandomSearch({}, CONFIG, N, **settings)
    assert second._score_noise(0, 1) != first._score_noise(0, 1)
    assert second._state["hyperparameters"] == first._state["hyperparameters"]


def test_a_checkpoint_needs_plain_hyperparameters(tmp_path):
    with pytest.raises(ValueError, match="weights_only"):
        RandomSearch({"act": Choice([nn.Tanh])}, CONFIG, N, mean_trials=3, shape=1.0,
                     score="public", checkpoint_path=tmp_path / "s.pt")  # fmt: skip


# -- a real search ----------------------------------------------------------------------------


def test_a_real_search_with_the_trainer():
    """Trainer runs in every trial: the check passes for honest runs, and the best is released."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(200, 5, generator=generator)
    y = (x[:, 0] > 0).long()
    x_val = torch.randn(100, 5, generator=generator)
    y_val = (x_val[:, 0] > 0).long()
    model = nn.Linear(5, 2)

    def trial(hyperparameters, config, seed):
        params, buffers = dpfunc.functionalize(model)

        def loss_fn(params, example):
            xi, yi = example
            logits = functional_call(model, (params, buffers), (xi.unsqueeze(0),))
            return F.cross_entropy(logits, yi.unsqueeze(0))

        trainer = dpfunc.Trainer(loss_fn, params, (x, y), config=config, seed=seed,
                                 optimizer=dpfunc.optim.sgd(lr=hyperparameters["lr"]),
                                 progress=False)  # fmt: skip
        trainer.fit()
        with torch.no_grad():
            logits = functional_call(model, (trainer.params, buffers), (x_val,))
        return Outcome(trainer, (logits.argmax(1) == y_val).float(), dict(trainer.params))

    config = dpfunc.DPConfig(clip_norm=1.0, expected_batch_size=50, epochs=1, target_epsilon=4.0,
                             delta=1e-4)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = tune.search(trial, {"lr": LogUniform(0.01, 1.0)}, config, 200, mean_trials=3,
                             shape=1.0, score_noise_multiplier=2.0,
                             validation_size=100)  # fmt: skip
    assert result.best is not None and set(result.result) == {"weight", "bias"}
    assert result.epsilon() <= 4.0 and result.trial_config.noise_multiplier > 0
    assert all(t.steps == 4 for t in result.trials)

    def fixed_seed(hyperparameters, config, seed):
        return trial(hyperparameters, config, 0)

    with pytest.raises(RuntimeError, match="seed was fixed"):
        tune.search(fixed_seed, {"lr": 0.1}, config, 200, mean_trials=2, shape=1.0,
                    score_noise_multiplier=2.0, validation_size=100)  # fmt: skip


# -- the audit ------------------------------------------------------------------------------


def test_a_canary_audit_of_the_whole_search_stays_under_its_epsilon():
    """500 gradient canaries, 10 searches (geometric K of mean 3, 2 full-batch steps a trial
    at noise multiplier 3, a private score): the lower bound stays under the search's epsilon,
    and the same audit of one run at an eighth of the noise (which a search refuses) exceeds it.
    Public seeds throughout, so the test cannot flake."""
    canary = dpfunc.audit.GradientCanary(500, examples=16, features=4, seed=0)
    n, (x_val, y_val) = 16 + 500, canary._real  # the validation set: the real examples
    config = dpfunc.DPConfig(clip_norm=1.0, expected_batch_size=n, epochs=2,
                             noise_multiplier=3.0, delta=1e-5)  # fmt: skip
    space = {"lr": LogUniform(0.5, 2.0)}
    settings = dict(
        mean_trials=3, shape=1.0, score_noise_multiplier=5.0, validation_size=len(y_val)
    )
    searches = iter(range(100))

    def train(dataset, config, seed, lr=1.0):
        trainer = dpfunc.Trainer(canary.loss_fn, dict(canary.params), dataset, config=config,
                                 seed=seed, optimizer=dpfunc.optim.sgd(lr=lr), progress=False,
                                 method="vmap")  # fmt: skip
        trainer.fit()
        return trainer

    def searched(dataset):
        def trial(hyperparameters, config, seed):
            trainer = train(dataset, config, seed, hyperparameters["lr"])
            correct = ((x_val @ trainer.params["weight"].T).argmax(1) == y_val).float()
            return Outcome(trainer, correct, result=dict(trainer.params))

        result = tune.search(trial, space, config, n, seed=next(searches), **settings)
        if result.best is None:
            return dict(canary.params)
        start, lr = canary.params["weight"], result.best.hyperparameters["lr"]
        return {"weight": start - (start - result.result["weight"]) / lr}  # in gradient units

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scores = dpfunc.audit.canary_scores(searched, canary, runs=10, keep_size=True)
        claimed = RandomSearch(space, config, n, **settings).epsilon()
        bound = dpfunc.audit.epsilon_lower_bound(*scores, delta=1e-5)
        assert 0 < bound < claimed
        weak = dataclasses.replace(config, noise_multiplier=3.0 / 8)
        broken = dpfunc.audit.canary_scores(
            lambda data: train(data, weak, next(searches)).params, canary, runs=10,
            keep_size=True)  # fmt: skip
        assert dpfunc.audit.epsilon_lower_bound(*broken, delta=1e-5) > claimed


# -- what a search releases is what it accounts ---------------------------------------------


def test_a_relative_checkpoint_path_stays_put_when_a_trial_changes_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def wandering(hyperparameters, config, seed):
        folder = tmp_path / f"trial{len(os.listdir(tmp_path))}"
        folder.mkdir()
        os.chdir(folder)  # a trial that works in a folder of its own
        return Outcome(FakeRun(config, seed), torch.rand(40))

    search = RandomSearch({}, CONFIG, N, mean_trials=4, shape=1.0, score_noise_multiplier=3.0,
                          validation_size=40, seed=3, checkpoint_path="search.pt")  # fmt: skip
    result = search.run(wandering)
    search.close()
    saved = torch.load(tmp_path / "search.pt", weights_only=True)
    assert [s is not None for s in saved["state"]["scores"]] == [True] * len(result.trials)
    assert not [p for p in tmp_path.rglob("search.pt") if p.parent != tmp_path]


def test_a_private_metric_of_one_element_is_refused():
    search = RandomSearch(
        {}, CONFIG, N, mean_trials=2, shape=1.0, score_noise_multiplier=1.0, validation_size=100
    )
    with pytest.raises(ValueError, match="shape \\(1,\\).*validation set of one example"):
        search.run(lambda h, c, s: Outcome(FakeRun(c, s), torch.tensor([0.93])))
    summary = torch.tensor([80.0, 100.0])  # [correct, total]: two "examples" of 100 declared
    settings = dict(mean_trials=2, shape=1.0, score_noise_multiplier=1.0, validation_size=100)
    with pytest.raises(ValueError, match="holds 2 values, but validation_size=100"):
        RandomSearch({}, CONFIG, N, **settings).run(lambda h, c, s: Outcome(FakeRun(c, s), summary))
    one_fewer = lambda h, c, s: Outcome(FakeRun(c, s), torch.ones(99))  # noqa: E731
    result = RandomSearch({}, CONFIG, N, **settings).run(one_fewer)  # a neighbour's count: fine
    assert all(t.score > 0.5 for t in result.trials)


def test_a_declared_validation_size_divides_the_noisy_sum():
    """Under add-or-remove, the realised size is private: the score divides by a constant, which
    a private score must be given."""
    values = torch.ones(50)  # the trial returns 50 values; the declared size is 100
    search = RandomSearch({}, CONFIG, N, mean_trials=400, score_noise_multiplier=5.0, seed=11,
                          validation_size=100)  # fmt: skip
    trials = search.run(lambda h, c, s: Outcome(FakeRun(c, s), values)).trials
    scores = np.array([t.score for t in trials])
    assert stats.kstest((scores - 0.5) / 0.05, "norm").pvalue > 1e-3  # 50 / 100, not 50 / 50
    with pytest.raises(ValueError, match="validation_size"):
        RandomSearch({}, CONFIG, N, mean_trials=2, score="public", validation_size=100)
    with pytest.raises(ValueError, match="give validation_size=.*got validation_size=None"):
        RandomSearch({}, CONFIG, N, mean_trials=2, score_noise_multiplier=5.0)  # the count: no


@dataclasses.dataclass
class Kept:
    """A result's own container: its fields are looked into too."""

    state: object


@pytest.mark.parametrize(
    "leak", ["run", "plan", "state_dict", "seed", "stream_seed", "seed_hex", "data", "data_copy",
             "rows", "seed_bytes", "seed_base64", "saved", "namespace", "dataclass", "sampler",
             "numpy", "half", "transposed", "metric"],
)  # fmt: skip
def test_a_result_that_releases_the_secret_or_the_data_is_refused(leak):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(200, 8, generator=generator)  # rows of 8: copied rows are looked for
    y = (x[:, 0] > 0).long()
    model = nn.Linear(8, 2)

    def trial(hyperparameters, config, seed):
        params, buffers = dpfunc.functionalize(model)

        def loss_fn(params, example):
            xi, yi = example
            logits = functional_call(model, (params, buffers), (xi.unsqueeze(0),))
            return F.cross_entropy(logits, yi.unsqueeze(0))

        trainer = dpfunc.Trainer(loss_fn, params, (x, y), config=config, seed=seed,
                                 optimizer=dpfunc.optim.sgd(lr=0.5), progress=False)  # fmt: skip
        trainer.fit()
        result = {
            "run": trainer, "plan": trainer.plan,
            "state_dict": dpfunc.checkpoint.state_dict(trainer), "seed": trainer.seed,
            "stream_seed": trainer.stream_seed, "seed_hex": f"run {hex(trainer.seed)}",
            "data": x, "data_copy": [x.clone()], "rows": x[3:7].double(),
            "params": dict(trainer.params),
        }  # fmt: skip
        state = dpfunc.checkpoint.state_dict(trainer)
        size = (trainer.seed.bit_length() + 7) // 8
        saved = io.BytesIO()
        torch.save(state, saved)
        metric = (torch.arange(50) % 2).float()  # not constant: a constant would match weights
        result |= {
            "seed_bytes": trainer.seed.to_bytes(size, "big"),
            "seed_base64": base64.b64encode(trainer.seed.to_bytes(size, "little")).decode(),
            "saved": saved.getvalue(), "namespace": types.SimpleNamespace(state=state),
            "dataclass": Kept({k: v for k, v in state.items() if k != "lineage"}),
            "sampler": trainer.plan.batches, "numpy": x.numpy(), "half": x.half(),
            "transposed": x.T.clone(), "metric": metric,
        }  # fmt: skip
        keep = {"params": result["params"]} if leak is None else {leak: result[leak]}
        return Outcome(trainer, metric, keep)

    config = dpfunc.DPConfig(clip_norm=1.0, expected_batch_size=50, epochs=1,
                             noise_multiplier=2.0, delta=1e-4)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=f"(?s)Outcome.result\\['{leak}'\\].*never the run"):
            tune.search(trial, {}, config, 200, mean_trials=2, shape=1.0,
                        score_noise_multiplier=2.0, validation_size=50)  # fmt: skip
        leak = None  # the control: the trained parameters
        result = tune.search(trial, {}, config, 200, mean_trials=2, shape=1.0,
                             score_noise_multiplier=2.0, validation_size=50)  # fmt: skip
    assert set(result.result) == {"params"}


def test_an_ordinary_result_is_not_taken_for_a_leak():
    """A constant metric (a failed trial's zeros) beside a zero bias, a test split sliced from
    the same tensor as the training set: released. A number equal to the metric's mean warns."""
    generator = torch.Generator().manual_seed(0)
    everything = torch.randn(300, 8, generator=generator)
    x, x_test = everything[:200], everything[200:]  # one tensor, two splits
    y = (x[:, 0] > 0).long()
    model = nn.Linear(8, 2)
    nn.init.zeros_(model.bias)

    def trial(hyperparameters, config, seed):
        params, buffers = dpfunc.functionalize(model)

        def loss_fn(params, example):
            xi, yi = example
            logits = functional_call(model, (params, buffers), (xi.unsqueeze(0),))
            return F.cross_entropy(logits, yi.unsqueeze(0))

        trainer = dpfunc.Trainer(loss_fn, params, (x, y), config=config, seed=seed,
                                 optimizer=dpfunc.optim.sgd(lr=0.5), progress=False)  # fmt: skip
        trainer.fit()
        metric = torch.zeros(2)  # a failed trial's score, of the bias's length
        return Outcome(trainer, metric, {"model": model, "test": x_test, "acc": 0.0})

    config = dpfunc.DPConfig(clip_norm=1.0, expected_batch_size=50, epochs=1,
                             noise_multiplier=2.0, delta=1e-4)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = tune.search(trial, {}, config, 200, mean_trials=2, shape=1.0,
                             score_noise_multiplier=2.0, validation_size=2)  # fmt: skip
    assert set(result.result) == {"model", "test", "acc"}
    assert not any("equal to the mean" in str(w.message) for w in caught)  # a constant metric

    def scored(hyperparameters, config, seed):
        outcome = trial(hyperparameters, config, seed)
        return Outcome(outcome.run, torch.tensor([1.0, 0.0]), {"acc": 0.5})  # its mean, un-noised

    with pytest.warns(UserWarning, match="equal to the mean or the sum"):
        tune.search(scored, {}, config, 200, mean_trials=2, shape=1.0,
                    score_noise_multiplier=2.0, validation_size=2)  # fmt: skip
