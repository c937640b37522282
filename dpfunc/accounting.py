"""Privacy accounting for DP-SGD: a thin layer over Google's ``dp_accounting``.

One DP-SGD step is the Poisson-sampled Gaussian mechanism (Abadi et al. 2016)
under add-or-remove-one neighbours: every example joins the batch
independently with probability ``sample_rate``, and the clipped sum gets
Gaussian noise of standard deviation ``noise_multiplier * clip_norm``. This
module builds the ``dp_accounting`` events of such runs and answers from them:
:func:`epsilon`, :func:`calibrate_noise_multiplier` (the noise a target
epsilon needs), :func:`max_steps_within` (the steps a budget allows), and
:class:`Accountant` for a history whose noise or rate changes. It re-derives
none of the mathematics.

Two methods (:data:`METHODS`): ``"pld"``, the default, privacy loss
distributions on the grid :data:`PLD_VALUE_DISCRETIZATION_INTERVAL`, nearly
tight and composed fast by :mod:`dpfunc.pld`; and ``"rdp"``, Rényi DP, a
looser bound, what older libraries report. Correlated noise (``bands=b``) is
accounted as DP-SGD for :func:`participations` ``= ceil(steps / b)`` steps.

Privacy: every epsilon is an upper bound. The RDP one is ``dp_accounting``'s,
exactly; the PLD one is the library's pessimistic estimate or above it, never
below (by at most 1e-5 relative for ``delta >= 1e-6``, 1e-3 for ``delta >=
1e-8``). Where the 1e-4 grid is out of reach, a coarser grid or RDP gives a
larger bound and a ``RuntimeWarning`` says so; a ``delta`` that the library's
own FFT rounding reaches is refused (``ValueError``).

>>> round(epsilon(1.5, 0.04, steps=2250, delta=1e-5), 2)  # RDP: 7.33
6.77

The events, both methods, the cost and the caches, the PLD allowances and
what is out of reach: see docs/training.md, "Accounting" and the sections
after it ("The events and the two methods" to "Out of reach").
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import warnings
from collections.abc import Callable
from typing import Any

import dp_accounting
import numpy as np
from dp_accounting.pld import privacy_loss_mechanism as _plm
from dp_accounting.rdp import rdp_privacy_accountant as _rdp_module

from . import pld
from ._checks import check_choice, check_int, check_number
from .pld import Runs

__all__ = [
    "METHODS",
    "PLD_VALUE_DISCRETIZATION_INTERVAL",
    "Accountant",
    "calibrate_noise_multiplier",
    "combined_noise_multiplier",
    "epsilon",
    "example_sampling_user_epsilon",
    "max_steps_within",
    "participations",
]

METHODS = ("pld", "rdp")
"""The accounting methods :func:`epsilon` and :class:`Accountant` accept."""

PLD_VALUE_DISCRETIZATION_INTERVAL = 1e-4
"""Grid step of the privacy loss values in the PLD accountant (the library's
default, and the setting the reference numbers were computed with)."""

# calibrate_noise_multiplier stops once its bracket has hi / lo <= 1 + this.
_CALIBRATION_RTOL = 1e-3
# Secant steps of calibrate_noise_multiplier's coarse search, at most.
_SECANT_STEPS = 8
# Bracketing gives up beyond these noise multipliers (see calibrate_noise_multiplier).
_SIGMA_MIN = 1e-3
_SIGMA_MAX = 1e6

History = list[tuple[float, float, int]]

_RDP_ORDERS = np.asarray(_rdp_module.DEFAULT_RDP_ORDERS, dtype=np.float64)
# The fast paths (here and in dpfunc.pld) read a few of dp_accounting's internals (checked
# here, and against the library's own accountants in the tests); without them every
# epsilon comes from the library's accountants, as slow as they are.
_FAST = all(
    hasattr(owner, name)
    for owner, name in [
        (_rdp_module, "_compute_rdp_poisson_subsampled_gaussian"),
        (_rdp_module, "compute_epsilon"),
        (_plm.GaussianPrivacyLoss, "connect_dots_bounds"),
        (_plm.GaussianPrivacyLoss, "mu_upper_cdf"),
        (_plm.GaussianPrivacyLoss, "mu_lower_log_cdf"),
    ]
)


# --------------------------------------------------------------------------
# Boundary validation (each returns the value in its canonical Python type).
# --------------------------------------------------------------------------


def _check_noise_multiplier(value: Any, name: str = "noise_multiplier") -> float:
    return check_number(name, value, low=0, high_open=True)


def _check_sample_rate(value: Any, name: str = "sample_rate") -> float:
    return check_number(name, value, low=0, high=1, low_open=True)


def _check_steps(value: Any, name: str = "steps") -> int:
    return check_int(name, value)


def _check_bands(value: Any, name: str = "bands") -> int:
    return check_int(name, value, minimum=1)


def _check_delta(value: Any) -> float:
    return check_number("delta", value, low=0, high=1, low_open=True, high_open=True)


def _check_method(value: Any, name: str = "method") -> str:
    return check_choice(name, value, METHODS)


def _check_target_epsilon(value: Any) -> float:
    return check_number("target_epsilon", value, low=0, low_open=True, high_open=True)


# --------------------------------------------------------------------------
# The dp_accounting layer: the events, the library's accountants, and the
# PLD epsilon of dpfunc.pld, which hands over to the library's accountant
# where it decides (see dpfunc.pld's docstring).
# --------------------------------------------------------------------------

# Calibration's first search, on a coarser grid (a cheap guess; never the answer).
_COARSE_VALUE_DISCRETIZATION_INTERVAL = 1e-3
# A PLD beyond dpfunc.pld's size limits is computed on a coarser grid (1e-4 * 2**k, an upper
# bound on the 1e-4 one: _coarse_or_rdp), up to this k; past it, by RDP.
_MAX_COARSENING = 14
# A coarser grid is chosen to need this many times fewer points than the limits (faster).
_COARSE_HEADROOM = 8.0
# Noise multipliers above this are accounted as this one: epsilon only falls as the noise grows,
# and beyond it sigma**2 overflows in the library's formulas.
_SIGMA_CAP = 1e100


@contextlib.contextmanager
def _quiet_absl():
    """Silences dp_accounting's warnings (logged through absl) inside the block."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _run_event(noise_multiplier: float, sample_rate: float, steps: int) -> dp_accounting.DpEvent:
    step = dp_accounting.PoissonSampledDpEvent(
        sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier)
    )
    return dp_accounting.SelfComposedDpEvent(step, steps)


def _library_epsilon(runs: Runs, delta: float, method: str, interval: float) -> float:
    """The epsilon of ``runs`` exactly as ``dp_accounting``'s accountant computes it (slow)."""
    relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    if method == "pld":
        accountant = dp_accounting.pld.PLDAccountant(
            relation, value_discretization_interval=interval
        )
    else:
        accountant = dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
    with _quiet_absl():
        accountant.compose(dp_accounting.ComposedDpEvent([_run_event(*run) for run in runs]))
        return float(accountant.get_epsilon(delta))


def _pld_epsilon(runs: Runs, delta: float, interval: float, above: float = math.inf) -> float:
    """:func:`dpfunc.pld.epsilon` of validated runs, handing over to the library's accountant.

    Where :func:`dpfunc.pld.epsilon` decides that the library answers, the
    answer is :func:`_library_epsilon`'s PLD on the same runs and grid.

    Raises:
        dpfunc.pld.Infeasible, ValueError: as :func:`dpfunc.pld.epsilon`.
    """

    def library() -> float:
        return _library_epsilon(runs, delta, "pld", interval)

    return pld.epsilon(runs, delta, interval, above, library=library)


def _coarse_or_rdp(runs: Runs, delta: float, interval: float, why: pld.Infeasible):
    """``(epsilon, note)`` where the PLD on the grid ``interval`` is out of reach (``why``).

    First the PLD on the coarsest-needed grid ``interval * 2**k`` (``k <=
    _MAX_COARSENING``): its one-step distributions dominate the fine grid's
    (connect-the-dots interpolates the convex divergence curve between fewer
    of the same points), so its epsilon is an upper bound on the fine grid's.
    Then RDP (Mironov 2017), an upper bound on the true epsilon; ``inf`` where
    even its arithmetic overflows (noise multipliers near 0). ``note`` says
    which, and why.
    """
    reason, k = str(why), 0
    while math.isfinite(why.coarsen):
        k += max(1, math.ceil(math.log2(why.coarsen * _COARSE_HEADROOM)))
        if k > _MAX_COARSENING:
            break
        coarse = interval * 2.0**k
        try:
            eps = pld.epsilon(runs, delta, coarse)
        except pld.Infeasible as error:
            why = error
            continue
        return eps, (
            f"the PLD on the {interval:g} grid is out of reach ({reason}): this is its value on "
            f"the coarser grid {coarse:g}, an upper bound on it"
        )
    eps = _rdp_epsilon(runs, delta)
    return eps, f"the PLD is out of reach ({reason}): this is the RDP upper bound"


@functools.lru_cache(maxsize=256)
def _rdp_orders(sigma: float, rate: float) -> np.ndarray:
    """One step's RDP at the library's default orders (cached: RDP composes by addition)."""
    with _quiet_absl():  # orders that do not converge are left out: still an upper bound
        rdp = _rdp_module._compute_rdp_poisson_subsampled_gaussian(
            q=rate, noise_multiplier=sigma, orders=_RDP_ORDERS
        )
    rdp.setflags(write=False)
    return rdp


def _rdp_epsilon(runs: Runs, delta: float) -> float:
    """RDP epsilon of validated runs: the library's sum over runs and conversion, exactly.

    ``inf`` where the library's arithmetic overflows (noise multipliers near 0).
    """
    rdp = np.zeros_like(_RDP_ORDERS, dtype=np.float64)
    try:
        with np.errstate(over="ignore", invalid="ignore"), _quiet_absl():
            for sigma, rate, steps in runs:
                rdp += steps * _rdp_orders(sigma, rate)
            return float(_rdp_module.compute_epsilon(_RDP_ORDERS, rdp, delta)[0])
    except (ArithmeticError, ValueError):
        return math.inf


def _history_epsilon(history: History, delta: float, method: str) -> float:
    """Epsilon of already-validated runs ``(noise_multiplier, sample_rate, steps)``.

    Memoised (a pure function of its arguments): runs that repeat one
    configuration, such as the audits of :mod:`dpfunc.audit`, pay once.
    Warns (``RuntimeWarning``) where the value is an upper bound computed
    otherwise than by the method asked for (:func:`_coarse_or_rdp`).
    """
    runs = tuple(tuple(run) for run in history if run[2] > 0)
    eps, note = _runs_result(runs, delta, method, PLD_VALUE_DISCRETIZATION_INTERVAL)
    if note is not None:
        warnings.warn(f"epsilon at delta={delta!r}: {note}", RuntimeWarning, stacklevel=3)
    return eps


def _canonical(runs: Runs) -> Runs:
    """``runs`` with noise multipliers above ``_SIGMA_CAP`` lowered to it (an upper bound)."""
    return tuple((min(sigma, _SIGMA_CAP), rate, steps) for sigma, rate, steps in runs)


def _runs_epsilon(runs: Runs, delta: float, method: str, interval: float) -> float:
    """The epsilon of :func:`_runs_result`, without its note."""
    return _runs_result(runs, delta, method, interval)[0]


@functools.lru_cache(maxsize=256)
def _runs_result(runs: Runs, delta: float, method: str, interval: float) -> tuple[float, Any]:
    """``(epsilon, note)``: ``note`` is ``None``, or says what upper bound stands in for it."""
    if not runs:
        return 0.0, None
    if any(sigma == 0.0 for sigma, _, _ in runs):
        # A noiseless step releases a deterministic function of the data.
        return math.inf, None
    runs, note = _canonical(runs), None
    if not _FAST:
        eps = _library_epsilon(runs, delta, method, interval)
    elif method == "pld":
        try:
            eps = _pld_epsilon(runs, delta, interval)
        except pld.Infeasible as why:
            eps, note = _coarse_or_rdp(runs, delta, interval, why)
    else:
        eps = _rdp_epsilon(runs, delta)
    return (max(eps, 0.0) if not math.isnan(eps) else math.inf), note


# --------------------------------------------------------------------------
# Public API.
# --------------------------------------------------------------------------


def combined_noise_multiplier(noise_multiplier: float, count_noise_multiplier: float) -> float:
    """The one Gaussian mechanism equal to the gradient sum and a private count released together.

    Adaptive clipping (Andrew et al. 2021) releases, on the same Poisson
    sample, the clipped sum (sensitivity ``C``, noise ``noise_multiplier *
    C``) and the count of unclipped examples (sensitivity 1, noise
    ``count_noise_multiplier``). Divide each release by its noise's standard
    deviation: both get unit noise, and one example moves them by at most
    ``1 / noise_multiplier`` and ``1 / count_noise_multiplier``, so the pair
    is one Gaussian mechanism of L2 sensitivity ``sqrt(noise_multiplier**-2
    + count_noise_multiplier**-2)``, i.e. noise multiplier ``(noise_multiplier**-2
    + count_noise_multiplier**-2) ** -0.5`` (the paper's argument).
    Accounting each step with this multiplier and the step's sample rate
    accounts both releases.

    Raises:
        ValueError: either multiplier is not a finite number > 0.

    >>> round(combined_noise_multiplier(1.0, 1.0), 6)
    0.707107
    """
    sigma = check_number("noise_multiplier", noise_multiplier, low=0, low_open=True, high_open=True)
    count = check_number(
        "count_noise_multiplier", count_noise_multiplier, low=0, low_open=True, high_open=True
    )
    return (sigma**-2 + count**-2) ** -0.5


def participations(steps: int, bands: int = 1) -> int:
    """The most steps any example can take part in: ``ceil(steps / bands)``.

    Under cyclic Poisson sampling with ``bands`` partitions, step ``t``
    samples from partition ``t mod bands``, so partition 0 is visited at
    steps ``0, bands, 2 bands, ...``: ``ceil(steps / bands)`` times, and no
    partition more often. ``bands = 1`` gives ``steps``.

    >>> participations(10, 4)
    3
    """
    return -(-_check_steps(steps) // _check_bands(bands))


def epsilon(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    method: str = "pld",
    *,
    bands: int = 1,
) -> float:
    """Epsilon of ``steps`` DP-SGD steps at a fixed ``delta``.

    Each step is the Poisson-sampled Gaussian mechanism (Abadi et al. 2016),
    add-or-remove-one neighbours. The number is ``dp_accounting``'s (or, for
    PLD, an upper bound never below it); the methods, allowances and
    fallbacks: see docs/training.md, "Accounting" and the sections after it.

    Args:
        noise_multiplier: noise standard deviation over clip norm, ``>= 0``.
        sample_rate: Poisson sampling probability, in ``(0, 1]`` (``1``: no amplification).
        steps: number of steps, an int ``>= 0``.
        delta: in ``(0, 1)``; usually well below ``1 / n``.
        method: ``"pld"`` (tight, the default) or ``"rdp"`` (looser, as older libraries).
        bands: ``1`` (DP-SGD) or correlated noise's ``b`` (cyclic Poisson sampling,
            ``sample_rate`` per partition): DP-SGD for ``participations(steps, b)`` steps.

    Returns:
        An upper bound on the privacy loss, a float: ``0.0`` when ``steps == 0``;
        ``inf`` when ``noise_multiplier == 0 < steps``, and for ``"pld"`` when ``delta <= 2e-15``.

    Raises:
        ValueError: an invalid argument (named), or for ``"pld"`` a ``delta`` within
            reach of the FFT's rounding (the message gives the smallest it takes).

    >>> round(epsilon(1.5, 0.04, steps=2250, delta=1e-5, method="rdp"), 2)
    7.33
    """
    sigma = _check_noise_multiplier(noise_multiplier)
    rate = _check_sample_rate(sample_rate)
    rounds = participations(steps, bands)
    delta = _check_delta(delta)
    method = _check_method(method)
    return _history_epsilon([(sigma, rate, rounds)], delta, method)


def example_sampling_user_epsilon(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    max_examples_per_user: int,
    *,
    value_discretization_interval: float = PLD_VALUE_DISCRETIZATION_INTERVAL,
) -> float:
    """The user-level epsilon of example-level DP-SGD when no user holds more than ``k`` examples.

    Example-level sampling (ELS; Charles et al. 2024, "Fine-Tuning Large
    Language Models with User-Level Differential Privacy"): each example
    joins a step with probability ``q``, each is clipped to ``C``, and a user
    with ``k`` examples in the dataset moves a step's sum by at most ``B C``,
    ``B ~ Binomial(k, q)`` of them sampled. Adding or removing the user is
    then dominated by the mixture of Gaussians ``N(0, sigma^2)`` against
    ``sum_b P(B = b) N(b, sigma^2)`` in units of ``C``, which
    ``dp_accounting``'s PLD accountant composes
    (``MixtureOfGaussiansDpEvent``, add or remove one) on the grid
    ``value_discretization_interval``; its pessimistic estimate is an upper
    bound on any grid; the library builds the mixture's PLD slowly on a fine
    one (14 s for ``k = 4`` at ``1e-4`` on 2 CPU cores, 0.3 s at ``1e-2``,
    whose epsilon is 0.02% larger). ``k = 1`` is :func:`epsilon`'s DP-SGD.

    This is the guarantee per user of a run that protects examples. It
    needs the bound to hold in the dataset: keep at most ``k`` examples of
    each user before training (:func:`dpfunc.users.bound_contributions`),
    or take ``k`` as the largest user's count, which is what an
    example-level run protects its heaviest user with.

    Args:
        noise_multiplier: ``sigma``, ``>= 0``.
        sample_rate: each example's Poisson rate, in ``(0, 1]``.
        steps: an int ``>= 0``.
        delta: in ``(0, 1)``.
        max_examples_per_user: ``k``, an int ``>= 1``: the most examples any
            user holds in the dataset trained on.
        value_discretization_interval: the PLD grid, ``> 0``.

    Returns:
        An upper bound on the user-level epsilon at ``delta``; ``inf`` with
        ``noise_multiplier = 0 < steps``, ``0.0`` with ``steps = 0``.

    >>> coarse = dict(value_discretization_interval=1e-2)  # fast, and still an upper bound
    >>> one = example_sampling_user_epsilon(1.0, 0.01, 10, 1e-5, 1, **coarse)
    >>> 0 <= one - epsilon(1.0, 0.01, 10, 1e-5) < 2e-3
    True
    >>> round(example_sampling_user_epsilon(1.0, 0.01, 10, 1e-5, 4, **coarse) / one, 1)
    4.6
    """
    sigma = _check_noise_multiplier(noise_multiplier)
    rate = _check_sample_rate(sample_rate)
    steps = _check_steps(steps)
    delta = _check_delta(delta)
    k = check_int("max_examples_per_user", max_examples_per_user, minimum=1)
    interval = check_number("value_discretization_interval", value_discretization_interval,
                            low=0, low_open=True, high_open=True)  # fmt: skip
    if steps == 0:
        return 0.0
    if sigma == 0:
        return math.inf
    counts = np.arange(k + 1)
    if rate == 1:  # all of a user's examples, always
        counts, probs = counts[-1:], np.ones(1)
    else:  # Binomial(k, q), from its logarithm: no underflow of q**b for large k
        log_pmf = (
            np.array(
                [math.lgamma(k + 1) - math.lgamma(b + 1) - math.lgamma(k - b + 1) for b in counts]
            )  # fmt: skip
            + counts * math.log(rate)
            + (k - counts) * math.log1p(-rate)
        )
        probs = np.exp(log_pmf)
    kept = probs > 0
    step = dp_accounting.dp_event.MixtureOfGaussiansDpEvent(
        sigma, counts[kept].astype(float).tolist(), (probs[kept] / probs[kept].sum()).tolist()
    )
    accountant = dp_accounting.pld.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
        value_discretization_interval=interval,
    )
    with _quiet_absl():
        accountant.compose(dp_accounting.SelfComposedDpEvent(step, steps))
        return float(accountant.get_epsilon(delta))


def _bracket(
    eps: Callable[[float], float],
    target: float,
    guess: float,
    factor: float,
    out_of_range: Callable[[], ValueError],
) -> tuple[float, float, float, float]:
    """``(lo, eps(lo), hi, eps(hi))`` with ``eps(lo) > target >= eps(hi)``.

    Steps away from ``guess`` by ``factor``, squaring the factor after each
    step that does not bracket the target (``eps`` decreases in sigma).

    Raises:
        ValueError: ``out_of_range()``, when the bracket would leave
            ``[_SIGMA_MIN, _SIGMA_MAX]``.
    """
    e_guess = eps(guess)
    if e_guess <= target:
        hi, e_hi = guess, e_guess
        lo, e_lo = hi / factor, eps(hi / factor)
        while e_lo <= target:
            factor *= factor
            hi, e_hi = lo, e_lo
            lo = hi / factor
            if lo < _SIGMA_MIN:
                raise out_of_range()
            e_lo = eps(lo)
    else:
        lo, e_lo = guess, e_guess
        hi, e_hi = lo * factor, eps(lo * factor)
        while e_hi > target:
            factor *= factor
            lo, e_lo = hi, e_hi
            hi = lo * factor
            if hi > _SIGMA_MAX:
                raise out_of_range()
            e_hi = eps(hi)
    return lo, e_lo, hi, e_hi


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    method: str = "pld",
    *,
    bands: int = 1,
) -> float:
    """The (nearly) smallest ``noise_multiplier`` whose epsilon is at most the target.

    Privacy: the returned ``sigma`` has ``epsilon(sigma, sample_rate, steps,
    delta, method) <= target_epsilon``, checked with :func:`epsilon`'s own
    computation before returning, so calibration never errs on the side of
    less noise; and ``sigma`` is within 0.1% above the smallest noise
    multiplier that :func:`epsilon` accepts. The search, its cost (about
    0.1-0.2 s) and where the library alone would accept less noise: see
    docs/training.md, "Calibrating the noise".

    Args:
        target_epsilon: the privacy budget, a finite number ``> 0``.
        delta: in ``(0, 1)``.
        sample_rate: Poisson sampling probability, in ``(0, 1]``.
        steps: number of steps, an int ``>= 0``.
        method: ``"pld"`` (default) or ``"rdp"``.
        bands: as for :func:`epsilon` (``1`` is DP-SGD).

    Returns:
        The noise multiplier, a Python float; ``0.0`` when ``steps == 0``.

    Raises:
        ValueError: an argument out of range (named), a target that needs a
            noise multiplier outside ``[1e-3, 1e6]``, or a ``delta`` too
            small for PLD accounting (as for :func:`epsilon`).

    >>> sigma = calibrate_noise_multiplier(2.0, 1e-5, sample_rate=0.01, steps=500)
    >>> epsilon(sigma, 0.01, 500, 1e-5) <= 2.0 < epsilon(sigma / 1.001, 0.01, 500, 1e-5)
    True
    """
    target = _check_target_epsilon(target_epsilon)
    delta = _check_delta(delta)
    rate = _check_sample_rate(sample_rate)
    steps = _check_steps(steps)
    method = _check_method(method)
    bands = _check_bands(bands)
    if steps == 0:
        return 0.0
    rounds = participations(steps, bands)

    def out_of_range() -> ValueError:
        return ValueError(
            f"no noise_multiplier in [{_SIGMA_MIN}, {_SIGMA_MAX}] meets "
            f"target_epsilon={target_epsilon!r} (delta={delta!r}, "
            f"sample_rate={sample_rate!r}, steps={steps!r}, method={method!r}, bands={bands!r})"
        )

    notes: dict[float, Any] = {}  # sigma -> the note of a value computed otherwise

    def eps(sigma: float) -> float:
        # What epsilon() returns for sigma, so the returned sigma is checked with it; for
        # PLD, a lower bound on it where that alone exceeds the target (_pld_epsilon).
        runs = _canonical(((sigma, rate, rounds),))
        if method == "pld" and _FAST:
            with contextlib.suppress(pld.Infeasible):
                return _pld_epsilon(runs, delta, PLD_VALUE_DISCRETIZATION_INTERVAL, above=target)
        value, notes[sigma] = _runs_result(runs, delta, method, PLD_VALUE_DISCRETIZATION_INTERVAL)
        return value

    guess, factor = 1.0, 2.0  # first guess and initial growth factor of the bracket
    if method == "pld":
        # The Gaussian-DP approximation, then a search on the coarse grid, place the
        # fine search; their answers are only guesses, which it checks from both sides.
        def coarse(sigma: float) -> float:  # never the library's (slow) accountant
            runs = _canonical(((sigma, rate, rounds),))
            try:
                return pld.epsilon(runs, delta, _COARSE_VALUE_DISCRETIZATION_INTERVAL)
            except pld.Infeasible as why:  # coarser still, or RDP
                return _coarse_or_rdp(runs, delta, _COARSE_VALUE_DISCRETIZATION_INTERVAL, why)[0]

        guess = _secant_search(coarse, target, _gdp_guess(target, delta, rate, rounds))
        factor = 1 + _CALIBRATION_RTOL
    bracket = _bracket(eps, target, guess, factor, out_of_range)
    sigma, e_sigma = _shrink(eps, target, bracket, _CALIBRATION_RTOL)
    if not e_sigma <= target:  # the loop invariant; cannot fail
        raise RuntimeError(f"calibration failed: epsilon({sigma}) = {e_sigma} > {target}")
    if notes.get(sigma) is not None:
        warnings.warn(
            f"calibration at delta={delta!r}: {notes[sigma]}", RuntimeWarning, stacklevel=2
        )
    return sigma


def _gdp_guess(target: float, delta: float, rate: float, steps: int) -> float:
    """A noise multiplier near the answer, from the Gaussian-DP approximation (a guess only).

    ``steps`` Poisson-sampled Gaussian steps are about ``mu``-GDP with ``mu =
    rate * sqrt(steps * (exp(sigma**-2) - 1))`` (Bu, Dong, Long & Su 2020;
    exact at ``rate = 1``), and ``mu``-GDP is ``(eps, delta)``-DP for
    ``delta = Phi(-eps/mu + mu/2) - exp(eps) Phi(-eps/mu - mu/2)`` (Dong, Roth &
    Su 2019). Solves for ``mu`` by bisection, then for ``sigma``.
    """

    def gdp_delta(mu: float) -> float:
        def phi(x: float) -> float:
            return 0.5 * math.erfc(-x / math.sqrt(2))

        tail = phi(-target / mu - mu / 2)
        return phi(-target / mu + mu / 2) - (math.exp(target) * tail if tail > 0 else 0.0)

    low, high = 1e-6, 1e3  # gdp_delta grows with mu
    for _ in range(60):
        mid = math.sqrt(low * high)
        low, high = (mid, high) if gdp_delta(mid) < delta else (low, mid)
    spread = (low / rate) ** 2 / steps  # exp(sigma**-2) - 1
    return min(max(1 / math.sqrt(math.log1p(spread)), 10 * _SIGMA_MIN), _SIGMA_MAX / 10)


def _secant_search(eps: Callable[[float], float], target: float, guess: float) -> float:
    """A noise multiplier whose ``eps`` is close to ``target``, by secant steps in log-log.

    A guess only (the caller checks it): a few steps from ``guess``, each
    limited to a factor of 4 and kept inside the search range, stopping once
    a step changes sigma by less than ``_CALIBRATION_RTOL / 8``.
    """
    points = []  # (log sigma, log eps), the two latest
    sigma = guess
    for _ in range(_SECANT_STEPS):
        e = eps(sigma)
        if not 0.0 < e < math.inf:  # no slope to follow: step towards the target
            step = math.log(4.0) if e == math.inf else -math.log(4.0)
            points.clear()
        else:
            points = [*points[-1:], (math.log(sigma), math.log(e))]
            if len(points) < 2 or points[0][0] == points[1][0]:
                step = math.log(1.1) if e > target else -math.log(1.1)
            else:
                (x0, y0), (x1, y1) = points
                slope = (y1 - y0) / (x1 - x0)
                if not slope < 0:  # epsilon must fall as sigma grows
                    break
                step = (math.log(target) - y1) / slope
        step = min(max(step, -math.log(4.0)), math.log(4.0))
        sigma = min(max(sigma * math.exp(step), _SIGMA_MIN), _SIGMA_MAX)
        if abs(step) < _CALIBRATION_RTOL / 8:
            break
    return sigma


def _shrink(
    eps: Callable[[float], float],
    target: float,
    bracket: tuple[float, float, float, float],
    rtol: float,
) -> tuple[float, float]:
    """``(hi, eps(hi))`` once ``bracket = (lo, eps(lo), hi, eps(hi))`` has ``hi / lo <= 1 + rtol``.

    Keeps ``eps(lo) > target >= eps(hi)``. Interpolates ``log eps`` linearly
    in ``log sigma`` and probes just either side of the estimate, with
    bisection whenever that does not halve the bracket's log-width.
    """
    lo, e_lo, hi, e_hi = bracket

    def probe(sigma: float) -> None:
        nonlocal lo, e_lo, hi, e_hi
        e = eps(sigma)
        if e <= target:
            hi, e_hi = sigma, e
        else:
            lo, e_lo = sigma, e

    bisect = False
    while hi / lo > 1 + rtol:
        before = hi / lo
        if bisect or not (e_hi > 0.0 and e_lo < math.inf):
            probe(math.sqrt(lo * hi))
        else:
            # log eps is close to linear in log sigma over a small bracket.
            t = (math.log(e_lo) - math.log(target)) / (math.log(e_lo) - math.log(e_hi))
            estimate = lo * (hi / lo) ** t
            # Probe just above the estimate; if it meets the target, probe just
            # below the new hi, which closes the bracket when the estimate was good.
            inner = 1 + rtol / 4  # keeps probes strictly inside (lo, hi)
            old_hi = hi
            probe(min(max(estimate * (1 + rtol / 2), lo * inner), hi / inner))
            if hi != old_hi and hi / lo > 1 + rtol:
                probe(max(hi / (1 + rtol), lo * inner))
        bisect = hi / lo > math.sqrt(before)  # the log-width did not halve
    return hi, e_hi


def max_steps_within(
    epsilon_budget: float,
    delta: float,
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    method: str = "pld",
    *,
    bands: int = 1,
) -> int:
    """The largest step count ``<= steps`` whose :func:`epsilon` is at most ``epsilon_budget``.

    Every step of the run is the same ``(noise_multiplier, sample_rate)``
    mechanism, and epsilon grows with the steps, so a binary search over
    ``[0, steps]`` finds it with about ``log2(steps)`` evaluations. ``0``
    when even one step spends more than the budget.

    Raises:
        ValueError: an argument is out of range (as for :func:`epsilon`),
            or ``epsilon_budget`` is not a number > 0.

    >>> max_steps_within(10.0, 1e-5, 1.0, 0.01, steps=100)
    100
    >>> max_steps_within(1e-3, 1e-5, 1.0, 0.01, steps=100)
    0
    """
    budget = check_number("epsilon_budget", epsilon_budget, low=0, low_open=True)
    steps = _check_steps(steps)

    def within(count: int) -> bool:
        spent = epsilon(noise_multiplier, sample_rate, count, delta, method, bands=bands)
        return count == 0 or spent <= budget

    if within(steps):
        return steps
    low, high = 0, steps  # within(low), not within(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if within(middle) else (low, middle)
    return low


class Accountant:
    """Tracks the privacy spent by a training run whose noise may change.

    The history is a list of runs ``(noise_multiplier, sample_rate, steps)``;
    consecutive steps with the same ``(noise_multiplier, sample_rate)`` are
    merged into one run, so a hundred thousand ``step`` calls at a constant
    setting stay one entry and :meth:`epsilon` composes one
    ``SelfComposedDpEvent`` per run (``ComposedDpEvent`` over runs). Its PLD
    epsilon composes all runs in one FFT, from one-step distributions built
    once per ``(noise_multiplier, sample_rate)`` (the last 8 are kept; see
    :mod:`dpfunc.pld`), so a constant setting costs ~10-30 ms per call
    whatever the step count; a noise schedule that changes every step builds
    one distribution per distinct setting, so change it in stages if that
    becomes slow.

    Epsilon is that of the whole history under add/remove-one neighbours,
    computed by ``dp_accounting`` (see :func:`epsilon`):

    * empty history (or only zero-step runs): ``0.0``;
    * any run with ``noise_multiplier == 0``: ``inf``.

    Results are cached per ``delta`` until the history changes.

    With ``bands = b > 1`` (correlated noise with cyclic Poisson sampling)
    the history counts logical steps and the epsilon is that of
    :func:`participations` ``(steps, b)`` DP-SGD steps (see the module
    docstring). The amplification theorem is stated for one noise
    multiplier and one sampling rate, so such an accountant takes one
    setting only.

    >>> acc = Accountant(method="rdp")
    >>> for _ in range(3):
    ...     acc.step(1.0, 0.01)
    >>> acc.step(2.0, 0.01, steps=10)
    >>> acc.history
    [(1.0, 0.01, 3), (2.0, 0.01, 10)]
    >>> acc.steps
    13
    """

    def __init__(self, method: str = "pld", *, bands: int = 1) -> None:
        """Raises ValueError if ``method`` is not ``"pld"`` or ``"rdp"``, or ``bands < 1``."""
        self._method = _check_method(method)
        self._bands = _check_bands(bands)
        self._history: list[list] = []  # [noise_multiplier, sample_rate, steps]
        self._cache: dict[float, float] = {}

    @property
    def method(self) -> str:
        """The accounting method, ``"pld"`` or ``"rdp"``."""
        return self._method

    @property
    def bands(self) -> int:
        """``1`` for DP-SGD, else the band count of a correlated-noise run."""
        return self._bands

    @property
    def history(self) -> History:
        """A copy of the runs, ``[(noise_multiplier, sample_rate, steps), ...]``."""
        return [tuple(run) for run in self._history]

    @property
    def steps(self) -> int:
        """Total number of steps recorded."""
        return sum(run[2] for run in self._history)

    def step(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        """Records ``steps`` DP-SGD steps with the given noise and sampling rate.

        ``steps == 0`` records nothing. A step with ``noise_multiplier == 0``
        makes every later :meth:`epsilon` infinite.

        Raises:
            ValueError: ``noise_multiplier < 0`` or not finite, ``sample_rate``
                outside ``(0, 1]``, ``steps`` not an int ``>= 0``, or, with
                ``bands > 1``, a setting other than the one recorded.
        """
        sigma = _check_noise_multiplier(noise_multiplier)
        rate = _check_sample_rate(sample_rate)
        steps = _check_steps(steps)
        self._append(sigma, rate, steps)

    def _append(self, sigma: float, rate: float, steps: int) -> None:
        if steps == 0:
            return
        last = self._history[-1] if self._history else None
        if self._bands > 1 and last is not None and (last[0], last[1]) != (sigma, rate):
            raise ValueError(
                f"an accountant with bands={self._bands} takes one (noise_multiplier, "
                f"sample_rate) setting, the one the amplification theorem covers; it has "
                f"({last[0]!r}, {last[1]!r}), got ({sigma!r}, {rate!r})"
            )
        self._cache.clear()
        if last is not None and last[0] == sigma and last[1] == rate:
            last[2] += steps
        else:
            self._history.append([sigma, rate, steps])

    def epsilon(self, delta: float) -> float:
        """Epsilon of the whole history at ``delta`` (``0.0`` if empty).

        Raises:
            ValueError: ``delta`` outside ``(0, 1)``.
        """
        delta = _check_delta(delta)
        if delta not in self._cache:
            history = self.history
            if self._bands > 1:  # one setting (see _append): its participations
                history = [(s, q, participations(t, self._bands)) for s, q, t in history]
            self._cache[delta] = _history_epsilon(history, delta, self._method)
        return self._cache[delta]

    def checked_epsilon(self, delta: float) -> float:
        """:meth:`epsilon`, checked against ``dp_accounting``'s own accountant run from scratch.

        The fast path composes the library's one-step distributions itself
        (:mod:`dpfunc.pld`); this runs the library's ``PLDAccountant`` (or
        ``RdpAccountant``) on the whole history too and returns the larger
        value, so a report never rests on the fast path alone. The fast one
        is never below it (:mod:`dpfunc.pld`); a library value above it
        warns, since the fast path would then have under-counted. Costs the
        library's whole computation (tenths of a second to seconds): for a
        final report, not for every epoch. Where :meth:`epsilon` is an upper
        bound computed otherwise (a coarser grid, RDP: it warned), the library
        would need more memory or time than that, and is not run.

        Raises:
            ValueError: ``delta`` outside ``(0, 1)``, or too small for PLD
                accounting of the history (as for :func:`epsilon`).
        """
        fast = self.epsilon(delta)
        history = [(s, q, participations(t, self._bands)) for s, q, t in self.history]
        runs = tuple(run for run in history if run[2] > 0)
        if not runs or math.isinf(fast):
            return fast
        if _runs_result(runs, delta, self._method, PLD_VALUE_DISCRETIZATION_INTERVAL)[1]:
            return fast  # computed otherwise, and warned: the library is out of reach
        library = _library_epsilon(
            _canonical(runs), delta, self._method, PLD_VALUE_DISCRETIZATION_INTERVAL
        )
        if library > fast:
            warnings.warn(
                f"dp_accounting's accountant gives epsilon={library!r} at delta={delta!r}, above "
                f"the fast composition's {fast!r}; reporting the larger",
                RuntimeWarning,
                stacklevel=2,
            )
        return max(fast, library)

    def state_dict(self) -> dict:
        """Plain-Python state: ``{"method": str, "bands": int, "history": [[float, float, int]]}``.

        Safe for ``torch.save`` / ``torch.load(weights_only=True)`` and JSON.
        """
        return {
            "method": self._method,
            "bands": self._bands,
            "history": [[float(s), float(q), int(t)] for s, q, t in self._history],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Replaces method and history with those of ``state_dict``.

        The dict must have the keys ``"method"`` and ``"history"``, and may
        have ``"bands"`` (absent in states saved before correlated noise
        existed: ``1``); each history entry must be a list or tuple ``[noise_multiplier,
        sample_rate, steps]`` passing the same checks as :meth:`step`.
        Consecutive equal entries are merged. Nothing changes if it fails.

        Raises:
            ValueError: the dict is malformed (the message says where).
        """
        if not isinstance(state_dict, dict):
            raise ValueError(f"state_dict must be a dict, got state_dict={state_dict!r}")
        keys = set(state_dict)
        if keys not in ({"method", "history"}, {"method", "history", "bands"}):
            raise ValueError(
                "state_dict must have the keys 'history' and 'method', and may have 'bands', "
                f"got keys {sorted(map(repr, keys))}"
            )
        method = _check_method(state_dict["method"], "state_dict['method']")
        bands = _check_bands(state_dict.get("bands", 1), "state_dict['bands']")
        history = state_dict["history"]
        if not isinstance(history, (list, tuple)):
            raise ValueError(
                f"state_dict['history'] must be a list, got state_dict['history']={history!r}"
            )
        runs = []
        for i, entry in enumerate(history):
            where = f"state_dict['history'][{i}]"
            if not isinstance(entry, (list, tuple)) or len(entry) != 3:
                raise ValueError(
                    f"{where} must be [noise_multiplier, sample_rate, steps], got {where}={entry!r}"
                )
            runs.append(
                (
                    _check_noise_multiplier(entry[0], f"{where}[0] (noise_multiplier)"),
                    _check_sample_rate(entry[1], f"{where}[1] (sample_rate)"),
                    _check_steps(entry[2], f"{where}[2] (steps)"),
                )
            )
        trial = Accountant(method, bands=bands)
        for run in runs:
            trial._append(*run)
        self._method, self._bands, self._history = method, bands, trial._history
        self._cache.clear()

    def __repr__(self) -> str:
        return (
            f"Accountant(method={self._method!r}, bands={self._bands}, steps={self.steps}, "
            f"runs={len(self._history)})"
        )
