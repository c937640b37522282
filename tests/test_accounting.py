"""Tests for dpfunc.accounting: published numbers, calibration, histories, checkpoints.

Expected epsilons and noise multipliers come from ``tests/reference/accounting.json``
(computed independently with dp-accounting 0.6.0, PLD grid 1e-4), or from
``dp_accounting`` called directly in the test, never from dpfunc itself.

dpfunc's PLD epsilon is the library's, or its own composition with allowances
for floating-point rounding (its own and the library's) that keep it above the
library's; so PLD values are checked with :func:`assert_pld_matches`: never
below the library's, and within the documented closeness above it
(:func:`pld_rtol`).
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
import torch

from dpfunc import accounting, pld
from dpfunc.accounting import Accountant, calibrate_noise_multiplier, epsilon

# A copy of the project's reference numbers (dp-accounting 0.6.0, PLD grid 1e-4).
REFERENCE_PATH = Path(__file__).resolve().parent / "reference" / "accounting.json"
REFERENCE = json.loads(REFERENCE_PATH.read_text())


def reference_cases(section: str) -> list:
    return [pytest.param(case, id=f"{section}{i}") for i, case in enumerate(REFERENCE[section])]


def pld_rtol(delta):
    """How far above the library's PLD epsilon dpfunc's may be (the module docstring's bound)."""
    return 1e-5 if delta >= 1e-6 else 1e-3 if delta >= 1e-8 else 3e-3 if delta >= 1e-10 else 5e-2


def assert_pld_matches(got, library, delta):
    """``got`` is never below the library's PLD epsilon, and within ``pld_rtol(delta)`` above."""
    assert library <= got <= library * (1 + pld_rtol(delta)), (got, library, delta)


def library_epsilon(runs, delta, method):
    """Epsilon of ``[(noise_multiplier, sample_rate, steps), ...]`` straight from dp_accounting."""
    event = dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(s)), t
            )
            for s, q, t in runs
        ]
    )
    if method == "pld":
        accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    else:
        accountant = dp_accounting.rdp.RdpAccountant()
    return float(accountant.compose(event).get_epsilon(delta))


# --------------------------------------------------------------------------
# epsilon against published numbers
# --------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["pld", "rdp"])
@pytest.mark.parametrize("case", reference_cases("epsilon"))
def test_epsilon_matches_reference(case, method):
    got = epsilon(
        case["noise_multiplier"], case["sample_rate"], case["steps"], case["delta"], method=method
    )
    assert isinstance(got, float)
    if method == "pld":
        assert_pld_matches(got, case[method], case["delta"])
    else:
        assert got == pytest.approx(case[method], rel=1e-9)


@pytest.mark.parametrize("case", reference_cases("epsilon"))
def test_pld_is_default_and_tighter_than_rdp(case):
    args = (case["noise_multiplier"], case["sample_rate"], case["steps"], case["delta"])
    assert_pld_matches(epsilon(*args), case["pld"], case["delta"])
    assert case["pld"] < case["rdp"]


def test_zero_steps_cost_nothing():
    assert epsilon(1.0, 0.01, 0, 1e-5) == 0.0
    assert epsilon(0.0, 0.01, 0, 1e-5, method="rdp") == 0.0


@pytest.mark.parametrize("method", ["pld", "rdp"])
def test_no_noise_means_infinite_epsilon(method):
    assert epsilon(0.0, 0.01, 1, 1e-5, method=method) == math.inf


@pytest.mark.parametrize("method", ["pld", "rdp"])
def test_full_batch_equals_composed_gaussian(method):
    # sample_rate = 1: no amplification; 4 steps at sigma = 2 compose to one
    # Gaussian mechanism with sigma = 1 (for PLD up to the discretisation).
    got = epsilon(2.0, 1.0, 4, 1e-5, method=method)
    exact = dp_accounting.get_epsilon_gaussian(1.0, 1e-5)
    assert got >= exact * (1 - 1e-6)
    assert got == pytest.approx(exact, rel=1e-3 if method == "pld" else 0.2)


# --------------------------------------------------------------------------
# calibration
# --------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["pld", "rdp"])
@pytest.mark.parametrize("case", reference_cases("calibrate"))
def test_calibration_matches_reference(case, method):
    target, delta = case["target_epsilon"], case["delta"]
    rate, steps = case["sample_rate"], case["steps"]
    smallest = case[f"{method}_sigma"]
    sigma = calibrate_noise_multiplier(target, delta, rate, steps, method=method)
    assert isinstance(sigma, float)
    assert epsilon(sigma, rate, steps, delta, method=method) <= target
    assert smallest * (1 - 1e-3) <= sigma <= smallest * 1.01


@pytest.mark.parametrize("method", ["pld", "rdp"])
@pytest.mark.parametrize(
    ("target_epsilon", "delta", "sample_rate", "steps"),
    [(0.5, 1e-5, 0.01, 1000), (2.0, 1e-6, 0.02, 2000), (0.5, 1e-6, 1.0, 10)],
)
def test_calibration_is_tight_and_never_above_target(
    target_epsilon, delta, sample_rate, steps, method
):
    sigma = calibrate_noise_multiplier(target_epsilon, delta, sample_rate, steps, method=method)
    assert epsilon(sigma, sample_rate, steps, delta, method=method) <= target_epsilon
    assert epsilon(sigma * 0.99, sample_rate, steps, delta, method=method) > target_epsilon


def test_calibration_of_zero_steps_is_zero():
    assert calibrate_noise_multiplier(1.0, 1e-5, 0.01, 0) == 0.0


# --------------------------------------------------------------------------
# Accountant
# --------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["pld", "rdp"])
def test_noise_schedule_composes_like_dp_accounting(method):
    delta = 1e-5
    phase1, phase2 = (3.0, 0.02, 300), (2.0, 0.01, 200)
    acc = Accountant(method=method)
    for _ in range(phase1[2]):
        acc.step(phase1[0], phase1[1])
    acc.step(phase2[0], phase2[1], steps=phase2[2])
    assert acc.history == [phase1, phase2]
    assert acc.steps == 500
    got = acc.epsilon(delta)
    if method == "pld":
        assert_pld_matches(got, library_epsilon([phase1, phase2], delta, method), delta)
    else:
        assert got == library_epsilon([phase1, phase2], delta, method)
    # Both phases count: more than either one alone.
    assert got > library_epsilon([phase1], delta, method) * 1.01
    assert got > library_epsilon([phase2], delta, method) * 1.01


def test_consecutive_equal_steps_are_merged():
    acc = Accountant()
    for _ in range(100_000):
        acc.step(1.0, 0.001)
    assert acc.history == [(1.0, 0.001, 100_000)]
    assert acc.steps == 100_000
    assert acc.epsilon(1e-5) == pytest.approx(epsilon(1.0, 0.001, 100_000, 1e-5), rel=1e-12)


def test_only_consecutive_equal_steps_are_merged():
    acc = Accountant(method="rdp")
    for sigma, rate in [(1.0, 0.1), (1.0, 0.1), (1.0, 0.2), (2.0, 0.2), (1.0, 0.1)]:
        acc.step(sigma, rate)
    acc.step(1.0, 0.1, steps=0)  # records nothing
    assert acc.history == [(1.0, 0.1, 2), (1.0, 0.2, 1), (2.0, 0.2, 1), (1.0, 0.1, 1)]
    assert acc.steps == 5


def test_empty_history_has_zero_epsilon():
    assert Accountant().epsilon(1e-5) == 0.0
    assert Accountant().steps == 0
    assert Accountant().history == []


@pytest.mark.parametrize("method", ["pld", "rdp"])
def test_a_noiseless_step_makes_epsilon_infinite(method):
    acc = Accountant(method=method)
    acc.step(3.0, 0.01, steps=10)
    assert math.isfinite(acc.epsilon(1e-5))
    acc.step(0.0, 0.01)
    acc.step(5.0, 0.01, steps=10)
    assert acc.epsilon(1e-5) == math.inf


def test_epsilon_follows_new_steps_and_delta():
    acc = Accountant(method="rdp")
    acc.step(1.0, 0.01, steps=100)
    first = acc.epsilon(1e-5)
    assert first == pytest.approx(epsilon(1.0, 0.01, 100, 1e-5, method="rdp"), rel=1e-12)
    assert acc.epsilon(1e-3) < first
    acc.step(1.0, 0.01, steps=100)
    assert acc.epsilon(1e-5) == pytest.approx(epsilon(1.0, 0.01, 200, 1e-5, "rdp"), rel=1e-12)


@pytest.mark.parametrize("method", ["pld", "rdp"])
def test_state_dict_round_trip_through_torch_checkpoint(tmp_path, method):
    acc = Accountant(method=method)
    acc.step(2.5, 0.04, steps=100)
    acc.step(2.0, 0.04, steps=50)
    path = tmp_path / "ckpt.pt"
    torch.save({"accountant": acc.state_dict()}, path)
    state = torch.load(path, weights_only=True)["accountant"]
    assert state == {"method": method, "bands": 1, "history": [[2.5, 0.04, 100], [2.0, 0.04, 50]]}

    restored = Accountant(method="rdp" if method == "pld" else "pld")
    restored.step(3.0, 0.5)  # replaced by the load
    restored.load_state_dict(state)
    assert restored.method == method
    assert restored.history == acc.history
    assert restored.steps == 150
    before = acc.epsilon(1e-5)
    clear_caches()  # the restored accountant computes afresh, as a resumed process does
    assert restored.epsilon(1e-5) == before


GOOD_HISTORY = [[1.0, 0.1, 3]]


@pytest.mark.parametrize(
    ("state", "needle"),
    [
        ([("method", "pld")], "state_dict"),
        ({"history": GOOD_HISTORY}, "keys"),
        ({"method": "pld"}, "keys"),
        ({"method": "pld", "history": GOOD_HISTORY, "extra": 1}, "keys"),
        ({"method": "gdp", "history": GOOD_HISTORY}, "'gdp'"),
        ({"method": "pld", "history": "1.0,0.1,3"}, "history"),
        ({"method": "pld", "history": [[1.0, 0.1]]}, "[0]"),
        ({"method": "pld", "history": [1.0, 0.1, 3]}, "[0]"),
        ({"method": "pld", "history": [[1.0, 0.1, 3], [-1.0, 0.1, 3]]}, "[1][0]"),
        ({"method": "pld", "history": [[1.0, 0.0, 3]]}, "[0][1]"),
        ({"method": "pld", "history": [[1.0, 1.5, 3]]}, "[0][1]"),
        ({"method": "pld", "history": [[1.0, 0.1, 3.0]]}, "[0][2]"),
        ({"method": "pld", "history": [[1.0, 0.1, -3]]}, "[0][2]"),
        ({"method": "pld", "history": [["1.0", 0.1, 3]]}, "[0][0]"),
        ({"method": "pld", "history": [[math.nan, 0.1, 3]]}, "[0][0]"),
    ],
)
def test_malformed_state_dict_is_rejected_and_changes_nothing(state, needle):
    acc = Accountant(method="rdp")
    acc.step(2.0, 0.5, steps=7)
    with pytest.raises(ValueError) as info:
        acc.load_state_dict(state)
    assert needle in str(info.value)
    assert acc.method == "rdp"
    assert acc.history == [(2.0, 0.5, 7)]


# --------------------------------------------------------------------------
# Boundary validation
# --------------------------------------------------------------------------

EPS = dict(noise_multiplier=1.0, sample_rate=0.01, steps=10, delta=1e-5)
CAL = dict(target_epsilon=1.0, delta=1e-5, sample_rate=0.01, steps=10)


def _step(**kwargs):
    Accountant().step(**{"noise_multiplier": 1.0, "sample_rate": 0.01, **kwargs})


@pytest.mark.parametrize(
    ("call", "name", "value"),
    [
        (lambda v: epsilon(**{**EPS, "sample_rate": v}), "sample_rate", 0.0),
        (lambda v: epsilon(**{**EPS, "sample_rate": v}), "sample_rate", 1.5),
        (lambda v: epsilon(**{**EPS, "sample_rate": v}), "sample_rate", -0.1),
        (lambda v: epsilon(**{**EPS, "delta": v}), "delta", 0.0),
        (lambda v: epsilon(**{**EPS, "delta": v}), "delta", 1.0),
        (lambda v: epsilon(**{**EPS, "delta": v}), "delta", math.nan),
        (lambda v: epsilon(**{**EPS, "noise_multiplier": v}), "noise_multiplier", -1.0),
        (lambda v: epsilon(**{**EPS, "noise_multiplier": v}), "noise_multiplier", math.inf),
        (lambda v: epsilon(**{**EPS, "noise_multiplier": v}), "noise_multiplier", "1.0"),
        (lambda v: epsilon(**{**EPS, "steps": v}), "steps", -1),
        (lambda v: epsilon(**{**EPS, "steps": v}), "steps", 10.5),
        (lambda v: epsilon(**{**EPS, "steps": v}), "steps", 10.0),
        (lambda v: epsilon(**{**EPS, "steps": v}), "steps", True),
        (lambda v: epsilon(**EPS, method=v), "method", "prv"),
        (
            lambda v: calibrate_noise_multiplier(**{**CAL, "target_epsilon": v}),
            "target_epsilon",
            0.0,
        ),
        (
            lambda v: calibrate_noise_multiplier(**{**CAL, "target_epsilon": v}),
            "target_epsilon",
            -1.0,
        ),
        (
            lambda v: calibrate_noise_multiplier(**{**CAL, "target_epsilon": v}),
            "target_epsilon",
            math.inf,
        ),
        (lambda v: calibrate_noise_multiplier(**{**CAL, "delta": v}), "delta", 2.0),
        (lambda v: calibrate_noise_multiplier(**{**CAL, "sample_rate": v}), "sample_rate", 0.0),
        (lambda v: calibrate_noise_multiplier(**{**CAL, "steps": v}), "steps", -5),
        (lambda v: calibrate_noise_multiplier(**CAL, method=v), "method", "RDP"),
        (lambda v: Accountant(method=v), "method", "moments"),
        (lambda v: _step(noise_multiplier=v), "noise_multiplier", -0.5),
        (lambda v: _step(sample_rate=v), "sample_rate", 0.0),
        (lambda v: _step(steps=v), "steps", -1),
        (lambda v: _step(steps=v), "steps", 1.5),
        (lambda v: Accountant().epsilon(delta=v), "delta", 0.0),
        (lambda v: Accountant().epsilon(delta=v), "delta", 1.0),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(call, name, value):
    with pytest.raises(ValueError) as info:
        call(value)
    message = str(info.value)
    assert f"{name}={value!r}" in message
    if name == "method":
        assert "'pld'" in message and "'rdp'" in message


def test_calibration_outside_search_range_raises():
    # 10**9 full-batch steps at sigma are one Gaussian mechanism at sigma / 31623:
    # even sigma = 1e6 (the top of the search range) gives epsilon ~ 0.15 > 1e-5.
    with pytest.raises(ValueError, match="target_epsilon=1e-05"):
        calibrate_noise_multiplier(1e-5, 1e-5, 1.0, 10**9, method="rdp")


def test_gradient_sum_and_private_count_compose_to_one_gaussian():
    """Full batch, one step: dp-accounting's composition of the two Gaussian mechanisms
    equals one Gaussian mechanism with the combined noise multiplier."""
    sigma, count_sigma, delta = 1.2, 3.0, 1e-5
    combined = accounting.combined_noise_multiplier(sigma, count_sigma)
    assert combined == pytest.approx((sigma**-2 + count_sigma**-2) ** -0.5)
    composed = dp_accounting.ComposedDpEvent(
        [dp_accounting.GaussianDpEvent(sigma), dp_accounting.GaussianDpEvent(count_sigma)]
    )
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(composed)
    assert accounting.epsilon(combined, 1.0, 1, delta) == pytest.approx(
        accountant.get_epsilon(delta), rel=2e-3
    )
    with pytest.raises(ValueError, match="count_noise_multiplier must be a finite number > 0"):
        accounting.combined_noise_multiplier(1.0, 0.0)


# --------------------------------------------------------------------------
# The cached, incremental computation against dp_accounting from scratch
# --------------------------------------------------------------------------


def clear_caches():
    accounting._runs_result.cache_clear()
    pld.step_losses.cache_clear()
    accounting._rdp_orders.cache_clear()


def library_accountant(runs, method):
    """A dp_accounting accountant that composed ``runs`` from scratch."""
    event = dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(s)), t
            )
            for s, q, t in runs
        ]
    )
    if method == "pld":
        accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    else:
        accountant = dp_accounting.rdp.RdpAccountant()
    return accountant.compose(event)


def test_the_fast_paths_are_active():
    # The installed dp_accounting has the internals the cached paths read; without
    # them every epsilon would come from the library's (slow) accountants.
    assert accounting._FAST


# (sigma, q, steps): small and full-batch rates, one step and many, wide and narrow losses.
GRID = [(2.0, 0.1, 1), (1.2, 0.05, 300), (5.0, 1.0, 20), (0.9, 0.02, 800), (3.0, 0.5, 7)]


@pytest.mark.parametrize("run", GRID, ids=str)
def test_pld_is_never_below_the_library_from_scratch(run):
    clear_caches()
    library = library_accountant([run], "pld")
    # At tiny deltas the allowances (tails and FFT rounding, counted as infinite loss)
    # weigh more: still never below the library, within pld_rtol(delta) above it.
    for delta in (1e-3, 1e-5, 1e-8, 1e-12):
        assert_pld_matches(epsilon(*run, delta), library.get_epsilon(delta), delta)


@pytest.mark.parametrize("method", ["pld", "rdp"])
def test_epoch_by_epoch_equals_the_library_from_scratch(method):
    """The epsilon after each epoch (cached one-step distribution, one composition per call)
    is the library's for the whole history, composed from nothing."""
    clear_caches()
    acc = Accountant(method=method)
    for epoch in range(1, 4):
        acc.step(1.1, 0.03, steps=40)
        library = library_accountant([(1.1, 0.03, 40 * epoch)], method).get_epsilon(1e-5)
        if method == "pld":
            assert_pld_matches(acc.epsilon(1e-5), library, 1e-5)
        else:
            assert acc.epsilon(1e-5) == library  # RDP composes by addition: exactly


@pytest.mark.parametrize("method", ["pld", "rdp"])
def test_histories_with_changed_noise_equal_the_library(method):
    # Runs of different sigma and rate, full-batch (symmetric) among them, and a return
    # to an earlier setting: one FFT over all runs against the library's compositions.
    runs = [(2.0, 0.1, 30), (1.5, 0.1, 20), (3.0, 1.0, 5), (2.0, 0.1, 10)]
    clear_caches()
    acc = Accountant(method=method)
    for run in runs:
        acc.step(*run)
    library = library_accountant(runs, method)
    for delta in (1e-4, 1e-6):
        if method == "pld":
            assert_pld_matches(acc.epsilon(delta), library.get_epsilon(delta), delta)
        else:
            assert acc.epsilon(delta) == library.get_epsilon(delta)


@pytest.mark.parametrize("method", ["pld", "rdp"])
def test_bands_account_their_participations(method):
    clear_caches()
    acc = Accountant(method=method, bands=4)
    acc.step(1.3, 0.05, steps=90)  # ceil(90 / 4) = 23 participations
    library = library_accountant([(1.3, 0.05, 23)], method).get_epsilon(1e-5)
    if method == "pld":
        assert_pld_matches(acc.epsilon(1e-5), library, 1e-5)
    else:
        assert acc.epsilon(1e-5) == library


@pytest.mark.parametrize(("sigma", "rate", "interval"), [(0.8, 0.01, 1e-4), (3.0, 1.0, 1e-3)])
def test_one_step_distribution_is_the_librarys(sigma, rate, interval):
    """The vectorised construction gives the library's connect-the-dots PMFs."""
    from dp_accounting.pld import privacy_loss_distribution

    library = privacy_loss_distribution.from_gaussian_mechanism(
        sigma, value_discretization_interval=interval, sampling_prob=rate
    )
    ours = pld.step_losses(sigma, rate, interval)
    for side, theirs in zip(ours, (library._pmf_remove, library._pmf_add)):
        theirs = theirs.to_dense_pmf()
        assert side.lower == theirs._lower_loss
        assert side.inf_mass == pytest.approx(theirs._infinity_mass, rel=1e-9, abs=1e-300)
        np.testing.assert_allclose(side.probs, theirs._probs, rtol=1e-9, atol=1e-20)


def test_early_stop_for_calibration_is_a_lower_bound():
    runs = ((1.0, 0.05, 100),)
    full = accounting._pld_epsilon(runs, 1e-5, 1e-4)
    assert accounting._pld_epsilon(runs, 1e-5, 1e-4, above=0.0) <= full
    assert accounting._pld_epsilon(runs, 1e-5, 1e-4, above=full) == full


def test_without_the_internals_the_library_answers(monkeypatch):
    clear_caches()
    monkeypatch.setattr(accounting, "_FAST", False)
    run = (1.2, 0.05, 300)
    assert epsilon(*run, 1e-5) == library_accountant([run], "pld").get_epsilon(1e-5)
    clear_caches()


def test_caches_are_bounded():
    for sigma in np.linspace(2.0, 3.0, 12):
        epsilon(float(sigma), 0.2, 10, 1e-5)
    assert pld.step_losses.cache_info().currsize <= 8
    assert accounting._runs_result.cache_info().maxsize == 256
    assert accounting._rdp_orders.cache_info().maxsize == 256


@pytest.mark.parametrize(
    ("sample_rate", "steps"),
    [(128 / 1437, 110), (1.0, 40)],  # digits: 10 epochs at batch 128; the example's full batch
    ids=["digits-batch-128", "digits-full-batch"],
)
def test_calibration_contract_for_the_digits_runs(sample_rate, steps):
    clear_caches()  # as in a fresh process: nothing cached from earlier calls
    target, delta = 3.0, 1e-5
    sigma = calibrate_noise_multiplier(target, delta, sample_rate, steps)
    clear_caches()
    assert epsilon(sigma, sample_rate, steps, delta) <= target
    assert epsilon(sigma / 1.001, sample_rate, steps, delta) > target
    # And the library itself, from scratch, agrees that sigma meets the target.
    assert library_accountant([(sigma, sample_rate, steps)], "pld").get_epsilon(delta) <= target


def test_epsilon_does_not_depend_on_what_was_cached():
    """The same history gets the same arithmetic whatever ran before (the FFT size is a
    function of the history), so the epsilon calibration checked is the one reported."""
    runs = ((1.0, 0.05, 120),)
    clear_caches()
    fresh = accounting._pld_epsilon(runs, 1e-5, 1e-4)
    for steps in (5, 2000, 40):  # other step counts leave other spectra cached
        accounting._pld_epsilon(((1.0, 0.05, steps),), 1e-5, 1e-4)
    assert accounting._pld_epsilon(runs, 1e-5, 1e-4) == fresh


def test_checked_epsilon_is_the_library_value_from_scratch_or_above(monkeypatch):
    acc = accounting.Accountant()
    acc.step(1.1, 0.02, steps=300)
    fast = acc.epsilon(1e-5)
    library = dp_accounting.pld.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-4
    )
    library.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.1)), 300
        )
    )
    assert acc.checked_epsilon(1e-5) == fast >= library.get_epsilon(1e-5)
    # a fast path that under-counted is caught: the library's larger value, with a warning
    monkeypatch.setattr(acc, "epsilon", lambda delta: fast * 0.9)
    with pytest.warns(RuntimeWarning, match="above the fast composition"):
        assert acc.checked_epsilon(1e-5) == pytest.approx(library.get_epsilon(1e-5), rel=1e-9)


@pytest.mark.parametrize(
    "sigma, rate, steps, delta",
    [(0.7, 1e-4, 9821, 1e-8), (0.4, 1e-4, 28994, 1e-7), (0.5, 1e-3, 701, 1e-12)],
)
def test_long_runs_at_small_rates_and_deltas_stay_at_or_above_the_library(
    sigma, rate, steps, delta
):
    # where delta nears the FFT's rounding of the composed distribution, the fast path
    # counts that rounding as infinite loss, or leaves the decision to the library
    library = dp_accounting.pld.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-4
    )
    library.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(sigma)), steps
        )
    )
    assert epsilon(sigma, rate, steps, delta) >= library.get_epsilon(delta)


def test_a_calibration_at_a_tiny_delta_meets_the_target_by_the_library_too():
    sigma = calibrate_noise_multiplier(0.5, 1e-12, 0.001, 2000)
    library = dp_accounting.pld.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-4
    )
    library.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.001, dp_accounting.GaussianDpEvent(sigma)), 2000
        )
    )
    assert library.get_epsilon(1e-12) <= 0.5


def test_a_tiny_delta_is_the_librarys_for_a_whole_history():
    runs = [(1.0, 1.0, 17), (5.0, 0.5, 10), (5.0, 0.5, 63)]
    acc = Accountant()
    for run in runs:
        acc.step(*run[:2], steps=run[2])
    # the accountant's history merges the equal runs: the library composes the same events
    assert acc.history == [(1.0, 1.0, 17), (5.0, 0.5, 73)]
    library = library_accountant(acc.history, "pld").get_epsilon(1e-12)
    assert_pld_matches(acc.epsilon(1e-12), library, 1e-12)


# --------------------------------------------------------------------------
# The promises of the issue "the accountant keeps its promises": never below the
# library, calibration within 0.1%, an answer or a ValueError for extreme inputs
# --------------------------------------------------------------------------

# The case, and the case where the fast composition alone came out furthest below
# the library (1.1e-4 relative, measured) before it counted the library's FFT rounding:
# long runs at sigma 5-6, q 0.05-0.3, delta <= 1e-8, just above the old hand-over.
ROUNDING_CASES = [
    (5.484793794906822, 0.05411646686238033, 43027, 3e-10),
    (5.896852689894187, 0.11591444015684127, 44201, 1.2632738544639213e-10),
]


@pytest.mark.parametrize(("sigma", "rate", "steps", "delta"), ROUNDING_CASES)
def test_long_runs_near_the_hand_over_are_never_below_the_library(sigma, rate, steps, delta):
    clear_caches()
    theirs = library_accountant([(sigma, rate, steps)], "pld").get_epsilon(delta)
    assert_pld_matches(epsilon(sigma, rate, steps, delta), theirs, delta)
    # the fast composition on its own (its allowance for the library's rounding), too
    runs = ((sigma, rate, steps),)
    fast = pld.epsilon(runs, delta, 1e-4)
    assert theirs <= fast <= theirs * 1.01


def random_cases(count, seed):
    """Seeded ``(sigma, rate, steps, delta)``, cheap for the library (sigma >= 1, <= 2000 steps)."""
    rng = np.random.default_rng(seed)
    cases = []
    for _ in range(count):
        sigma = float(np.exp(rng.uniform(0.0, np.log(8.0))))
        rate = 1.0 if rng.random() < 0.2 else float(np.exp(rng.uniform(np.log(0.005), 0.0)))
        steps = int(np.exp(rng.uniform(0.0, np.log(2000))))
        delta = float(np.exp(rng.uniform(np.log(1e-12), np.log(1e-4))))
        cases.append(pytest.param(sigma, rate, steps, delta, id=f"{sigma:.3g}-{rate:.3g}-{steps}"))
    return cases


@pytest.mark.parametrize(("sigma", "rate", "steps", "delta"), random_cases(6, seed=7))
def test_a_random_grid_is_never_below_the_library_from_scratch(sigma, rate, steps, delta):
    """A CI-sized sample of bench/accounting.py's grid (240 cases, recorded in
    bench/accounting.md): dpfunc's epsilon, and the fast composition alone, against the
    library's PLDAccountant composed from scratch."""
    clear_caches()
    theirs = library_accountant([(sigma, rate, steps)], "pld").get_epsilon(delta)
    assert_pld_matches(epsilon(sigma, rate, steps, delta), theirs, delta)
    try:
        fast = pld.epsilon(((sigma, rate, steps),), delta, 1e-4)
    except pld.Infeasible:  # the allowance reaches delta / 2: the library decides
        return
    assert fast >= theirs


def test_calibration_is_within_0_1_percent_where_the_library_took_over():
    # The old hand-over decided after the remove side: the early stop's lower bound came
    # from the fast composition, the answer from the library (lower), and the returned
    # sigma was 0.3% above the smallest that epsilon() accepted.
    target, delta, rate, steps = 50.0, 1e-9, 0.001, 10000
    sigma = calibrate_noise_multiplier(target, delta, rate, steps)
    assert epsilon(sigma, rate, steps, delta) <= target
    assert epsilon(sigma / 1.001, rate, steps, delta) > target


def test_the_early_stop_of_calibration_is_a_lower_bound_of_what_epsilon_returns():
    # Who decides is settled before either side is composed: the value with an early stop
    # is either the one epsilon() returns or a lower bound on it above the target.
    for sigma in (0.3196, 0.3199, 0.3202):
        runs = ((sigma, 0.001, 10000),)
        stopped = accounting._pld_epsilon(runs, 1e-9, 1e-4, above=50.0)
        full = epsilon(sigma, 0.001, 10000, 1e-9)
        assert stopped == full or 50.0 < stopped <= full


@pytest.mark.parametrize("sigma", [0.01, 0.05])
def test_small_noise_multipliers_answer_on_a_coarser_grid(sigma):
    # The 1e-4 grid needs 6e7 (sigma 0.01) or 3.9e6 (0.05) points per step: a MemoryError
    # and a run past 30 s before. A coarser grid's PLD bounds the 1e-4 grid's from above
    # (connect-the-dots interpolates a convex curve through fewer of the same points).
    clear_caches()
    with pytest.warns(RuntimeWarning, match="coarser grid"):
        got = epsilon(sigma, 0.01, 10, 1e-5)
    assert 100 < got < epsilon(sigma, 0.01, 10, 1e-5, method="rdp")


def test_a_coarser_grid_is_never_below_the_fine_one():
    # Where the library can still answer (sigma 0.4: 1e5 points), every coarser grid that
    # epsilon() may fall back to is at or above the 1e-4 grid's value.
    runs, delta = ((0.4, 0.05, 5),), 1e-5
    fine = library_accountant(runs, "pld").get_epsilon(delta)
    coarse = [pld.epsilon(runs, delta, 1e-4 * 2**k) for k in (1, 3, 6)]
    assert fine <= coarse[0] <= coarse[1] <= coarse[2] <= fine * 1.001


@pytest.mark.parametrize("method", ["pld", "rdp"])
def test_extreme_noise_multipliers_answer(method):
    # sigma 1e-300 and 1e300 raised OverflowError ("cannot convert float infinity to integer")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # PLD: out of reach, the RDP bound
        assert epsilon(1e-300, 0.01, 10, 1e-5, method=method) == math.inf
        assert epsilon(1e-3, 0.01, 10, 1e-5, method=method) > 1e5
    # more noise than 1e100 is accounted as 1e100 (epsilon only falls with more noise)
    huge = epsilon(1e300, 0.01, 10, 1e-5, method=method)
    assert huge == epsilon(1e100, 0.01, 10, 1e-5, method=method) == 0.0
    assert epsilon(1e300, 1.0, 10**6, 1e-5, method=method) < 1e-3


def test_sigma_near_zero_is_the_rdp_bound_with_a_warning():
    with pytest.warns(RuntimeWarning, match="RDP upper bound"):
        got = epsilon(1e-3, 0.01, 10, 1e-5)  # the 1e-4 grid would need 5e9 points
    assert got == epsilon(1e-3, 0.01, 10, 1e-5, method="rdp")


def test_extreme_rates_answer():
    with pytest.warns(RuntimeWarning, match="RDP upper bound"):  # the library's loss fails
        assert epsilon(1.0, 5e-324, 10, 1e-5) == 0.0
    assert epsilon(1.0, 1e-300, 10, 1e-5) == 0.0


def test_extreme_deltas_answer_or_name_delta():
    # below the 2e-15 per run counted as infinite loss the PLD epsilon is inf (the library's
    # is inf below its 1e-15): no composition is run
    assert epsilon(1.0, 0.01, 1000, 1e-300) == epsilon(1.0, 0.01, 1000, 1e-15) == math.inf
    assert epsilon(1.0, 0.01, 1000, 1e-300, method="rdp") < 100
    assert epsilon(1.0, 0.01, 1000, 1 - 1e-16) == 0.0
    # a delta within reach of the FFT's rounding, where the library would take long
    with pytest.raises(ValueError, match=r"delta must be at least .* got delta=1e-13"):
        epsilon(0.3, 0.01, 10000, 1e-13)


@pytest.mark.parametrize("steps", [10**9, 10**30])
def test_extreme_step_counts_are_the_rdp_bound_with_a_warning(steps):
    with pytest.warns(RuntimeWarning, match="RDP upper bound"):
        got = epsilon(1e4, 0.01, steps, 1e-5)
    assert got == epsilon(1e4, 0.01, steps, 1e-5, method="rdp")


def test_a_calibration_for_a_billion_steps_answers_with_the_rdp_bound():
    # it ran past 30 s: the library raises a PMF size to the power 10**9 as an integer
    with pytest.warns(RuntimeWarning, match="RDP upper bound"):
        sigma = calibrate_noise_multiplier(1.0, 1e-5, 0.01, 10**9)
    with pytest.warns(RuntimeWarning):
        assert epsilon(sigma, 0.01, 10**9, 1e-5) <= 1.0
    assert epsilon(sigma / 1.001, 0.01, 10**9, 1e-5, method="rdp") > 1.0


def test_checked_epsilon_does_not_run_the_library_out_of_reach(monkeypatch):
    acc = Accountant()
    acc.step(0.01, 0.01, steps=10)
    monkeypatch.setattr(accounting, "_library_epsilon", None)  # would fail if called
    with pytest.warns(RuntimeWarning, match="coarser grid"):
        assert acc.checked_epsilon(1e-5) == acc.epsilon(1e-5)
