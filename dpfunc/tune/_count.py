"""The law of the number of trials K, and the search's accounting event.

Papernot and Steinke (ICLR 2022): K Poisson or truncated negative binomial,
hidden; the whole search is ``RepeatAndSelectDpEvent(trial_event, mean, shape)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import dp_accounting
import numpy as np
from dp_accounting import dp_event

from .. import accounting
from .._checks import check_int, check_number
from ..accounting import _quiet_absl

try:  # the inversion of the mean that dp_accounting's RDP bound uses (a private function)
    from dp_accounting.rdp.rdp_privacy_accountant import (
        _gamma_truncated_negative_binomial as _library_gamma,
    )
except ImportError:  # pragma: no cover (exercised by a test that removes it)
    _library_gamma = None

MAX_MEAN_TRIALS = 10_000
"""The largest ``mean_trials`` accepted: every drawn trial is a whole private run."""


_GAMMA_RTOL = 1e-9  # dp_accounting's tolerance on gamma


def _tnb_mean(gamma: float, shape: float) -> float:
    """``E[K]`` of the truncated negative binomial of ``gamma`` and ``shape``."""
    if gamma >= 1.0:
        return 1.0
    halt = 1.0 - gamma  # exact near 1, where the mean is near 1
    if shape == 0:  # logarithmic
        return halt / (gamma * -math.log1p(-halt))
    return shape * halt / (gamma * -math.expm1(shape * math.log1p(-halt)))


def _tnb_gamma(mean: float, shape: float) -> float:
    """The halting probability ``gamma`` at which ``K`` is drawn (``0 <= shape < inf``).

    dp_accounting inverts the mean by bisection and bounds the search with
    the low end of its bracket, a ``gamma`` whose mean is up to 1e-9 above
    ``mean``. ``K`` is drawn at the high end instead: a ``gamma`` at least
    the library's, with a mean at most ``mean``, so both terms of the bound
    (``log(1 / gamma)`` and ``log E[K]``) are at least the drawn
    distribution's. Without the library's function, the same bisection here.
    """
    if shape == 1:
        return 1 / mean  # geometric: exact
    if _library_gamma is not None:
        gamma = float(_library_gamma(shape, mean))
        while _tnb_mean(gamma, shape) > mean:
            gamma = min(1.0, gamma * (1 + _GAMMA_RTOL))
        return gamma
    low, high = 0.0, min(1.0, 2 * (shape + 1) / mean)  # the library's bracket
    while high > low * (1 + _GAMMA_RTOL):
        middle = (low + high) / 2
        low, high = (low, middle) if _tnb_mean(middle, shape) < mean else (middle, high)
    return high


def _log_tnb_pmf(k: int, gamma: float, shape: float) -> float:
    """``log P[K = k]`` of the truncated negative binomial (Papernot and Steinke, Definition 1)."""
    if gamma >= 1.0:
        return 0.0 if k == 1 else -math.inf
    if shape == 0:  # logarithmic
        return k * math.log1p(-gamma) - math.log(k) - math.log(-math.log(gamma))
    normaliser = math.log(math.expm1(-shape * math.log(gamma)))  # gamma**-shape - 1
    binomial = math.lgamma(k + shape) - math.lgamma(shape) - math.lgamma(k + 1)
    return k * math.log1p(-gamma) + binomial - normaliser


def trial_count_pmf(k: int, mean: float, shape: float = math.inf) -> float:
    """``P[K = k]``: the probability that a search of ``mean``, ``shape`` draws ``k`` trials.

    Args:
        k: a trial count, an int >= 0.
        mean: the expected number of trials, in ``[1, MAX_MEAN_TRIALS]``.
        shape: ``inf`` (Poisson), ``1`` (geometric), ``0`` (logarithmic) or
            another number > 0 (truncated negative binomial), as in
            ``dp_accounting.dp_event.RepeatAndSelectDpEvent``.

    Returns:
        The probability; ``0.0`` for ``k = 0`` unless Poisson.

    >>> round(trial_count_pmf(0, 2.0), 4)  # Poisson: no trial at all, e**-2
    0.1353
    >>> round(trial_count_pmf(1, 2.0, shape=1), 4)  # geometric: 1 / mean
    0.5
    """
    k = check_int("k", k)
    mean, shape = _check_count(mean, shape)
    if shape == math.inf:
        return math.exp(k * math.log(mean) - mean - math.lgamma(k + 1))
    if k == 0:
        return 0.0
    return math.exp(_log_tnb_pmf(k, _tnb_gamma(mean, shape), shape))


def _check_count(mean: Any, shape: Any) -> tuple[float, float]:
    mean = check_number(
        "mean_trials", mean, low=1, high=MAX_MEAN_TRIALS,
        note="(every drawn trial is a whole private run; dp_accounting needs a mean >= 1)",
    )  # fmt: skip
    shape = check_number("shape", shape, low=0, high=math.inf, note="(inf: Poisson)")
    return mean, shape


def _draw_count(rng: np.random.Generator, mean: float, shape: float) -> int:
    """``K`` drawn exactly from its distribution (inverse CDF; the tail past 1e-16 is cut)."""
    if shape == math.inf:
        return int(rng.poisson(mean))
    gamma = _tnb_gamma(mean, shape)
    u, k, total = float(rng.random()), 0, 0.0
    while True:
        k += 1
        p = math.exp(_log_tnb_pmf(k, gamma, shape))
        total += p
        if u < total or (k > mean and p < 1e-16 / k):
            return k


def _distribution(mean: float, shape: float) -> str:
    if shape == math.inf:
        return f"Poisson with mean {mean:g} (K = 0 is possible: then nothing is released)"
    name = {0.0: "logarithmic", 1.0: "geometric"}.get(shape, "truncated negative binomial")
    gamma = _tnb_gamma(mean, shape)
    return f"{name} (shape {shape:g}, gamma {gamma:.6g}) with mean {mean:g}, K >= 1"


def _trial_event(sigma: float, rate: float, steps: int, score_sigma: float | None):
    """One trial: its training run, then (a private score) one Gaussian release of sensitivity 1."""
    step = dp_event.PoissonSampledDpEvent(rate, dp_event.GaussianDpEvent(sigma))
    train = dp_event.SelfComposedDpEvent(step, steps)
    if score_sigma is None:
        return train
    return dp_event.ComposedDpEvent([train, dp_event.GaussianDpEvent(score_sigma)])


def _search_event(trial: Any, mean: float, shape: float, retries: int):
    """The repeat-and-select event, composed with ``retries`` whole trials (fixed in advance)."""
    selected = dp_event.RepeatAndSelectDpEvent(trial, mean, shape)
    if retries == 0:
        return selected
    return dp_event.ComposedDpEvent([selected, dp_event.SelfComposedDpEvent(trial, retries)])


def _rdp_epsilon(event: Any, delta: float) -> float:
    """dp_accounting's RDP accountant on ``event`` (add or remove one example), exactly."""
    relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    accountant = dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"), _quiet_absl():
        accountant.compose(event)
        return float(accountant.get_epsilon(delta))


def _calibrate(epsilon_of: Callable[[float], float], target: float, floor_note: str) -> float:
    """The smallest noise multiplier (within 0.1%) whose search epsilon is at most ``target``.

    The bracket and the shrinking of :func:`dpfunc.accounting.calibrate_noise_multiplier`,
    which keep ``epsilon_of(returned) <= target`` (epsilon falls as the noise grows).
    """

    def out_of_range() -> ValueError:
        floor = epsilon_of(accounting._SIGMA_MAX)
        if floor <= target:  # met below the smallest noise multiplier searched
            return ValueError(
                f"target_epsilon={target!r} needs a noise multiplier below "
                f"{accounting._SIGMA_MIN:g}; lower target_epsilon or give noise_multiplier"
            )
        return ValueError(
            f"target_epsilon={target!r} cannot be met: even with "
            f"noise_multiplier={accounting._SIGMA_MAX:g} on every trial the search costs "
            f"epsilon={floor:.4g} ({floor_note}); raise target_epsilon or lower mean_trials"
        )

    bracket = accounting._bracket(epsilon_of, target, 1.0, 2.0, out_of_range)
    return accounting._shrink(epsilon_of, target, bracket, accounting._CALIBRATION_RTOL)[0]
