"""Privacy accounting for DP-SGD: a thin layer over Google's ``dp_accounting``.

One DP-SGD step is the *Poisson-sampled Gaussian mechanism* (Abadi et al.
2016, "Deep Learning with Differential Privacy"): every example joins the
batch independently with probability ``sample_rate``, the clipped sum gets
Gaussian noise of standard deviation ``noise_multiplier * clip_norm``.
Neighbouring datasets differ by adding or removing one example
(``NeighboringRelation.ADD_OR_REMOVE_ONE``). In ``dp_accounting`` terms a
run of ``steps`` identical steps is::

    SelfComposedDpEvent(
        PoissonSampledDpEvent(sample_rate, GaussianDpEvent(noise_multiplier)), steps
    )

and a training history whose noise or rate changes is the ``ComposedDpEvent``
of its runs. dpfunc re-derives none of the mathematics: the epsilon is the
one the library's accountants give for these events, or, for PLD, an upper
bound on it that is never below it (see "Cost" and "Out of reach" below).

Two methods:

* ``"pld"`` (default): privacy loss distributions with the "connect the
  dots" discretisation (Koskela, Jälkö & Honkela 2020, "Computing tight
  differential privacy guarantees using FFT"; Doroshenko, Ghazi, Kamath,
  Kumar & Manurangsi 2022, "Connect the Dots: Tighter Discrete
  Approximations of Privacy Loss Distributions"), via
  ``dp_accounting.pld.PLDAccountant``. Nearly tight, and still an upper
  bound (the library's pessimistic estimate). dpfunc fixes
  ``value_discretization_interval=1e-4`` (:data:`PLD_VALUE_DISCRETIZATION_INTERVAL`),
  the setting with which the reference numbers in ``shared/reference`` were
  made; a coarser grid is faster and gives a (slightly) larger epsilon.
* ``"rdp"``: Rényi differential privacy (Mironov 2017, "Rényi Differential
  Privacy"; Mironov, Talwar & Zhang 2019 for the sampled Gaussian) over
  ``dp_accounting``'s default orders, via ``dp_accounting.rdp.RdpAccountant``.
  A looser upper bound, and what older libraries report (TensorFlow
  Privacy, Opacus with ``accountant="rdp"``); use it to compare with them.

Correlated noise (:mod:`dpfunc.matrix_factorization`, ``bands = b > 1``)
is accounted as its amplification theorem states it (Choquette-Choo,
Ganesh, McKenna, McMahan, Rush, Thakurta and Xu 2023, "(Amplified) Banded
Matrix Factorization", Theorem 4): a ``b``-banded strategy normalised to
unit column norm, with noise multiplier ``sigma`` and cyclic Poisson
sampling at rate ``q`` within each of ``b`` partitions, is as private as
DP-SGD with sampling rate ``q`` and noise multiplier ``sigma`` for
``ceil(steps / b)`` steps, the number of times the first partition (and so
any example, at most) can take part. That DP-SGD computation is what
``bands=`` hands to ``dp_accounting``; ``bands=1`` is DP-SGD itself.

For example, ``noise_multiplier=1.5``, ``sample_rate=0.04``,
``steps=2250``, ``delta=1e-5`` the two give epsilon 6.77 (PLD) and 7.33 (RDP).

Cost, and what is cached. ``dp_accounting``'s ``PLDAccountant`` rebuilds,
on every call, each run's one-step privacy loss distribution (a Python loop
over ~10^5 grid points: 0.1-0.3 s) and self-composes it by FFT; the epsilon
after each epoch of a run cost 0.4-0.6 s that way, and a calibration 1.3 s.
Here the same computation is organised to be paid once:

* the one-step distribution of each ``(noise_multiplier, sample_rate,
  grid)`` is built once, by the library's own privacy-loss object with its
  grid evaluated in one numpy pass, and the connect-the-dots formulas
  (Doroshenko et al. 2022, Algorithm 1); the last 8 stay in memory (an LRU
  cache, up to ~10 MB each at ``sample_rate=0.005``), each with its last FFT;
* ``t`` steps (and a history of runs) compose in one FFT: the product of
  the steps' spectra raised to their counts, over the window that the
  Chernoff bound gives (the library's method, at more orders), whatever the
  history's length. Only the frequencies whose power is not exactly
  ``0.0`` in float64 are exponentiated;
* the epsilon search scans the losses from the top in numpy blocks.

An epsilon after each epoch then costs ~10-30 ms and a calibration
0.05-0.2 s, in a fresh process (``bench/accounting.md``). The result is the
library's pessimistic upper bound on the same grid, never below the library's
value, with these allowances counted as infinite loss (each raises epsilon a
little, never lowers it):

* the tails that the composition cuts (at most 1e-15 of mass per run, by the
  Chernoff bound) as the library counts them, plus another 1e-15 per run for
  what the library's own truncation and FFT wrap-around can add at the top;
* the FFT's rounding, of this composition and of the library's: raising a
  spectrum to the power ``t`` multiplies its rounding by ``t``, which moves
  every tail sum of the composed distribution, hence the hockey-stick
  divergence at every epsilon, by up to about ``eps * t * ||p||_2 *
  sqrt(log2 size)`` (``p`` the one-step PMF; measured at most 3.9 times that,
  against the same composition in extended precision, on 260 random cases);
  16 times that is counted, with twice the mass of the bins the rounding made
  negative (set to 0). Without it the library's own rounding lifted its
  epsilon above the fast one by up to 1.1e-4 relative (long runs at
  ``delta <= 1e-8``).

The PLD epsilon is also rounded up by 1e-7 relative for the one-step
arithmetic, which differs from the library's by rounding (about 1e-9
relative, measured). Who computes it is decided before anything is composed:
the fast composition where its rounding allowance ``A`` is at most
``delta / 100``; else the library's accountant where it is estimated to take
at most ~1.5 s; else the fast composition while ``A < delta / 2``; else the
library where it takes at most ~5 s; else ``ValueError`` (``delta`` too small
for PLD accounting of those steps: the library's own rounding reaches it).
So the epsilon is never below the library's, and above it by at most 1e-5
relative for ``delta >= 1e-6``, 1e-3 for ``delta >= 1e-8``, 3e-3 for
``delta >= 1e-10``, a few percent below that (the largest on 240 random
cases: 1.6e-6, 2.3e-4, 8.7e-4 and 8.3e-3; ``bench/accounting.md``). It is
``inf`` for ``delta`` at most 2e-15 per run (the tails counted as infinite
loss; the library's is ``inf`` below 1e-15): use RDP there.
``tests/test_accounting.py`` compares the two over grids, and a report's
epsilon is checked against the library from scratch
(:meth:`Accountant.checked_epsilon`). RDP is the library's arithmetic
exactly: one step's RDP per ``(noise_multiplier, sample_rate)`` is cached
(256 of them) and multiplied by the step counts. Results of whole histories
are cached too (256, keyed by the runs and delta). If a future
``dp_accounting`` lacks the internals these paths read, every epsilon comes
from its accountants instead, as slow as they are.

Out of reach. Some inputs would need more than the memory or time anyone
has: a one-step PLD of more than 2**20 grid points (``noise_multiplier``
below ~0.1: 6e7 points at 0.01, 38 GiB at 1e-3), a composition of more than
2**23 points (10**9 steps and more), or arithmetic that overflows (sigma
near 0, rates near 0). There the PLD epsilon is computed on a coarser
grid, ``1e-4 * 2**k`` with the smallest ``k <= 14`` that fits an eighth of
those limits (0.2 s at ``noise_multiplier=0.05``): its one-step distributions
dominate the 1e-4 grid's (connect-the-dots interpolates the convex
divergence curve through fewer of the same points), so its epsilon is an
upper bound on the 1e-4 grid's; past that, it is the RDP upper bound (``inf``
where even that overflows). Either way a ``RuntimeWarning`` says so, and
:meth:`Accountant.checked_epsilon` does not run the library. Noise
multipliers above 1e100 are accounted as 1e100: epsilon only falls as the
noise grows (0.0 there, at any realistic step count).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import numbers
import warnings
from collections.abc import Callable
from typing import Any

import dp_accounting
import numpy as np
import scipy.fft
from dp_accounting.pld import privacy_loss_mechanism as _plm
from dp_accounting.rdp import rdp_privacy_accountant as _rdp_module

from .checks import check_choice, check_int, check_number

__all__ = [
    "METHODS",
    "PLD_VALUE_DISCRETIZATION_INTERVAL",
    "Accountant",
    "calibrate_noise_multiplier",
    "combined_noise_multiplier",
    "epsilon",
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
Runs = tuple[tuple[float, float, int], ...]

_RDP_ORDERS = np.asarray(_rdp_module.DEFAULT_RDP_ORDERS, dtype=np.float64)
# The fast paths read a few of dp_accounting's internals (checked here, and
# against the library's own accountants in the tests); without them every
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
# The dp_accounting layer.
#
# The library's PLDAccountant rebuilds every run's single-step PLD and
# self-composes it on each call; both are cached or done once here (module
# docstring, "Cost"). The pieces below use the library's construction and
# its formulas; where they compute in their own way (the vectorised
# divergence, the spectrum kept across calls, the window of the FFT, the
# epsilon search in numpy blocks) the tests compare them with the library.
# --------------------------------------------------------------------------

# Probability mass a self-composition may cut from its tails (the library's
# default tail_mass_truncation); the cut mass is counted as infinite loss.
_TAIL_MASS = 1e-15
# The (noise_multiplier, sample_rate, grid) single steps kept, each with its
# distributions and one spectrum (up to ~10 MB at sample_rate 0.005, grid 1e-4).
_STEP_CACHE_SIZE = 8
# Calibration's first search, on a coarser grid (a cheap guess; never the answer).
_COARSE_VALUE_DISCRETIZATION_INTERVAL = 1e-3
# The reported PLD epsilon is the computed one times (1 + this): it covers the
# floating-point differences (about 1e-9 relative in the tests) between this
# module's one-step arithmetic and the library's, so it is never below the library's.
_PLD_ROUND_UP = 1e-7
# Raising a spectrum to the power t multiplies its rounding by t: the composed PMF's tail sums
# are off by up to about eps * t * ||one-step PMF||_2 * sqrt(log2 size), in the library's
# composition as in this one (3.9 times that at most, measured on 260 cases against the same
# composition in extended precision). This many times it is counted as infinite loss
# (_noise_allowance): the library's rounding cannot lift its epsilon above the fast one.
_NOISE_FACTOR = 16.0
# The fast composition decides alone where that allowance is at most delta / this (it then moves
# epsilon by about 1e-3 relative at most, and typically by less than 1e-5); above it the library
# decides where it is cheap (_LIBRARY_SECONDS), else the fast composition does while the
# allowance stays below delta / 2.
_NOISE_MARGIN = 1e2
# Estimated cost of the library's accountant: seconds per grid point of a one-step PMF (its
# Python loop) and per point of a composed transform, twice what was measured; the library is
# asked only while the estimate is at most _LIBRARY_MAX_SECONDS.
_LIBRARY_SECONDS = (12e-6, 0.5e-6)
_LIBRARY_MAX_SECONDS = 3.0
# Where the fast composition cannot answer at all (allowance >= delta / 2), up to this.
_LIBRARY_HARD_SECONDS = 10.0
# The largest one-step grid (points) built and the largest transform composed here: 8 MB and
# 64 MB of float64. A PLD that needs more is computed on a coarser grid (1e-4 * 2**k, an upper
# bound on the 1e-4 one: _coarse_or_rdp), up to this k; past it, by RDP.
_MAX_STEP_POINTS = 1 << 20
_MAX_FFT_SIZE = 1 << 23
_MAX_COARSENING = 14
# A coarser grid is chosen to need this many times fewer points than the limits (faster).
_COARSE_HEADROOM = 8.0
# Noise multipliers above this are accounted as this one: epsilon only falls as the noise grows,
# and beyond it sigma**2 overflows in the library's formulas.
_SIGMA_CAP = 1e100
_EPS = float(np.finfo(np.float64).eps)
# The library's tolerance for divergences that grow along the grid (rounding).
_DELTA_DIFF_TOLERANCE = 1e-12
# Chernoff orders, times -1 / support size, beyond the library's 1..20: they narrow
# the lower end of the window after many compositions.
_FAR_ORDERS = (35, 60, 100, 180, 300, 550, 1000)
# Ratio between consecutive FFT sizes (_fft_size).
_FFT_LADDER = 1.2
# Losses per block of the epsilon search (_pmf_epsilon).
_EPSILON_BLOCK = 1 << 14
# exp(x) is exactly 0.0 in float64 below this (the smallest subnormal is exp(-745.1)).
_LOG_UNDERFLOW = -750.0


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


class _GaussianLoss(_plm.GaussianPrivacyLoss):
    """The library's privacy loss of the (Poisson-subsampled) Gaussian mechanism.

    Only :meth:`get_delta_for_epsilon` changes: the library inverts the
    privacy loss one epsilon at a time in Python, ~10^5 times per
    distribution; here the same closed forms (stated in the library's
    docstrings) run over the whole grid in numpy. Add and remove neighbours,
    sensitivity 1.
    """

    def __init__(self, standard_deviation: float, **kwargs: Any) -> None:
        super().__init__(standard_deviation, **kwargs)
        self._sigma = standard_deviation

    def get_delta_for_epsilon(self, epsilon):
        """The hockey-stick divergence at each ``epsilon`` (the library's contract)."""
        adjacency = _plm.AdjacencyType
        if isinstance(epsilon, numbers.Number) or self.adjacency_type not in (
            adjacency.ADD,
            adjacency.REMOVE,
        ):
            return super().get_delta_for_epsilon(epsilon)
        eps = np.asarray(epsilon, dtype=np.float64)
        deltas = np.zeros_like(eps)
        q, add = self.sampling_prob, self.adjacency_type == adjacency.ADD
        if q == 1.0:
            inside = np.ones(eps.shape, dtype=bool)
        elif add:  # the divergence is 0 from epsilon = -log(1 - q) on
            inside = eps < -math.log1p(-q)
        else:  # and 1 - exp(epsilon) up to log(1 - q)
            inside = eps > math.log1p(-q)
            deltas[~inside] = -np.expm1(eps[~inside])
        loss = eps[inside]
        if q < 1.0:  # privacy loss without subsampling: +-log(1 + (exp(+-loss) - 1) / q)
            edge = -math.log(1 - q) if add else math.log(1 - q)
            at_edge = np.abs(loss - edge) <= 1e-9 * np.maximum(np.abs(loss), abs(edge))
            b = -loss if add else loss
            a, c = 1 / q, 1 - 1 / q
            d = b + np.log(a)
            with np.errstate(divide="ignore", invalid="ignore"):
                unsampled = np.where(b == 0, np.log(a + c), d + np.log1p(-np.exp(np.log(-c) - d)))
            if add:
                unsampled = -unsampled
            if np.any(~at_edge & (b != 0) & (np.log(-c) >= d)):
                return super().get_delta_for_epsilon(epsilon)  # outside the closed form
            unsampled = np.where(at_edge, np.inf if add else -np.inf, unsampled)
        else:
            unsampled = loss
        sens, var = self.sensitivity, self._sigma**2
        x = -0.5 * sens - unsampled * var / sens
        if add:
            x = sens + x
        deltas[inside] = self.mu_upper_cdf(x) - np.exp(loss + self.mu_lower_log_cdf(x))
        return np.clip(deltas, 0, 1)


class _Infeasible(Exception):
    """The PLD of some runs on some grid is beyond what is computed here; the message says why.

    ``coarsen`` is the factor by which the grid would have to be coarser for it to fit
    (``inf`` where no grid would: the FFT's rounding, or overflow).
    """

    def __init__(self, reason: str, coarsen: float = math.inf) -> None:
        super().__init__(reason)
        self.coarsen = coarsen


class _StepLoss:
    """One side (remove or add neighbours) of one step's discretised PLD, ready to compose.

    ``probs[i]`` is the mass of the loss ``(lower + i) * interval``,
    ``inf_mass`` that of an infinite loss, ``norm`` the L2 norm of ``probs``
    (it sizes the FFT's rounding, :func:`_noise_allowance`). Also holds the
    log moment generating function at the Chernoff orders (for
    :meth:`window`) and the last spectrum computed (for :func:`_composed_side`).
    """

    def __init__(self, lower: int, probs: np.ndarray, inf_mass: float) -> None:
        probs.setflags(write=False)
        self.lower, self.probs, self.inf_mass = lower, probs, inf_mass
        self.norm = float(np.sqrt(np.dot(probs, probs)))
        size = len(probs)
        # log E[exp(t i)] at t = m / size: the library's orders m = +-1..20, and
        # _FAR_ORDERS (lower bound only).
        with np.errstate(divide="ignore"):
            log_probs = np.log(probs)
        positions = np.arange(size, dtype=np.float64) / size
        logs = {}
        for m in (*range(-20, 0), *range(1, 21), *(-m for m in _FAR_ORDERS)):
            exponent = positions * m + log_probs
            peak = float(exponent.max())
            logs[m] = peak + math.log(float(np.exp(exponent - peak).sum()))
        order = sorted(logs)
        self.orders = np.array(order, dtype=np.float64) / size
        self.log_mgfs = np.array([logs[m] for m in order])
        self._library_orders = np.abs(self.orders) <= 20 / size + 1e-12
        self._spectrum: tuple[int, Any, Any] = (0, None, None)

    def window(self, count: int, library: bool = False) -> tuple[int, int]:
        """Index range holding all but ``_TAIL_MASS`` of ``count`` self-compositions.

        The Chernoff bound at each order, as in the library's
        ``compute_self_convolve_bounds``. The upper end is the library's (its
        orders, two bins further), so every loss the library keeps at the top,
        where epsilon is decided, is kept here too. The lower end also uses
        orders further out, which narrow the window (and the FFT) after many
        compositions; the mass it cuts has losses far below any epsilon, where
        it cannot change one. ``library=True``: the library's own window (its
        orders only), to estimate its cost.
        """
        lower, upper = 0, (len(self.probs) - 1) * count
        keep = self._library_orders if library else slice(None)
        orders, log_mgfs = self.orders[keep], self.log_mgfs[keep]
        bounds = (count * log_mgfs + math.log(2 / _TAIL_MASS)) / orders
        for order, bound in zip(orders, bounds):
            if math.isfinite(bound):
                if order > 0:
                    upper = min(upper, math.ceil(bound) + (0 if library else 2))
                else:
                    lower = max(lower, math.floor(bound))
        return lower, upper

    def spectrum(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        """``(rfft(probs, size), log of its modulus)``, kept until another size is asked for."""
        cached = self._spectrum  # one read: another thread may replace it meanwhile
        if cached[0] != size:
            transform = scipy.fft.rfft(self.probs, size)
            with np.errstate(divide="ignore"):
                cached = (size, transform, np.log(np.abs(transform)))
            self._spectrum = cached
        return cached[1], cached[2]


def _connect_the_dots(loss: _GaussianLoss, interval: float) -> tuple[int, np.ndarray, float]:
    """``(lower, probs, inf_mass)``: the pessimistic connect-the-dots PLD of ``loss``.

    Doroshenko et al. 2022, Algorithm 1, on the grid of multiples of
    ``interval`` between the mechanism's connect-the-dots bounds: what the
    library's ``_create_pld_pmf_from_monotone_privacy_loss`` and
    ``create_pmf_pessimistic_connect_dots_fixed_gap`` compute, without their
    detour through a dict of every grid point. With ``d = interval`` and
    ``delta_i`` the divergence at the i-th grid point (made non-increasing):
    ``p_1 = 1 - delta_1 + (delta_2 - delta_1) / (e^d - 1)``, ``p_i =
    ((delta_{i+1} - delta_i) - e^d (delta_i - delta_{i-1})) / (e^d - 1)``,
    ``p_n = (delta_n - delta_{n-1}) / (e^-d - 1)``, all clipped at 0, and
    ``delta_n`` on the infinite loss.

    Raises:
        ValueError: the divergences increase (as the library does).
        _Infeasible: the grid would have more than ``_MAX_STEP_POINTS`` points
            (or infinitely many: noise multipliers near 0).
    """
    bounds = loss.connect_dots_bounds()
    span = (bounds.epsilon_upper - bounds.epsilon_lower) / interval + 2
    if not span <= _MAX_STEP_POINTS:  # NaN and inf included
        coarsen = span / _MAX_STEP_POINTS if math.isfinite(span) else math.inf
        raise _Infeasible(f"one step's PLD would need {span:.3g} grid points", coarsen)
    first = math.floor(bounds.epsilon_lower / interval)
    last = math.ceil(bounds.epsilon_upper / interval)
    deltas = np.asarray(
        loss.get_delta_for_epsilon(np.arange(first, last + 1) * interval), dtype=np.float64
    )
    if first == last:
        return first, np.array([1 - deltas[0]]), float(deltas[0])
    if np.any(np.diff(deltas) > _DELTA_DIFF_TOLERANCE):
        raise ValueError(f"deltas are not in non-increasing order: deltas={deltas}")
    deltas = np.minimum.accumulate(deltas)
    diffs = np.diff(deltas)
    probs = np.zeros_like(deltas)
    probs[0] = 1 - deltas[0] + diffs[0] / math.expm1(interval)
    probs[1:-1] = (diffs[1:] - diffs[:-1] * math.exp(interval)) / math.expm1(interval)
    probs[-1] = diffs[-1] / math.expm1(-interval)
    return first, np.maximum(0.0, probs), float(deltas[-1])


@functools.lru_cache(maxsize=_STEP_CACHE_SIZE)
def _step_losses(sigma: float, rate: float, interval: float) -> tuple[_StepLoss, _StepLoss]:
    """(remove, add) sides of one Poisson-sampled Gaussian step's PLD (one object if rate = 1).

    The library's ``from_gaussian_mechanism`` with its defaults
    (connect-the-dots, pessimistic, sensitivity 1, log mass truncation -50),
    computed by :class:`_GaussianLoss` and :func:`_connect_the_dots`.

    Raises:
        _Infeasible: as :func:`_connect_the_dots`, or the library's privacy loss
            fails in floating point (sigma or rate near 0: overflow, 0 / 0).
    """

    def side(adjacency: Any) -> _StepLoss:
        try:
            with np.errstate(all="ignore"):
                loss = _GaussianLoss(sigma, sampling_prob=rate, adjacency_type=adjacency)
                return _StepLoss(*_connect_the_dots(loss, interval))
        except _Infeasible:
            raise
        except (ArithmeticError, ValueError) as error:  # extreme sigma or rate (overflow, 0 / 0)
            raise _Infeasible(f"the library's privacy loss fails ({error})") from error

    remove = side(_plm.AdjacencyType.REMOVE)
    return (remove, remove) if rate == 1.0 else (remove, side(_plm.AdjacencyType.ADD))


def _fft_size(need: int) -> int:
    """The transform size for ``need`` points: the first rung of a ladder (ratio 1.2) above it.

    A function of ``need`` alone, so the same history always gets the same
    arithmetic (the epsilon calibration checks is the one :func:`epsilon`
    returns later, whatever was cached in between); the rungs leave room for a
    run that grows, whose later compositions reuse the spectrum at hand.
    """
    rung = math.ceil(math.log(need) / math.log(_FFT_LADDER) - 1e-9)
    return scipy.fft.next_fast_len(max(need, math.ceil(_FFT_LADDER**rung)), real=True)


Parts = list[tuple[_StepLoss, int]]


def _side_plan(parts: Parts) -> tuple[int, int, int]:
    """``(start, length, size)`` of the composition of ``parts``: see :func:`_composed_side`.

    Raises:
        _Infeasible: the transform would be larger than ``_MAX_FFT_SIZE``.
    """
    windows = [step.window(count) for step, count in parts]
    start = sum(lo for lo, _ in windows)
    length = sum(hi - lo for lo, hi in windows) + 1
    need = max(length, *(len(step.probs) for step, _ in parts))
    if need > _MAX_FFT_SIZE:
        raise _Infeasible(
            f"the composition would need {need:.3g} grid points", need / _MAX_FFT_SIZE
        )
    return start, length, _fft_size(need)


def _noise_allowance(parts: Parts, size: int) -> float:
    """Mass counted as infinite loss for the FFT's rounding, this module's and the library's.

    The FFT of a one-step PMF ``p`` errs by about ``eps * ||p||_2 *
    sqrt(log2 size)`` per frequency; raised to the power ``t`` that error is
    multiplied by ``t``, and the composed PMF's tail sums (hence the
    hockey-stick divergence at every epsilon) move by about as much, of either
    sign, in the library's composition as in this one. This is
    ``_NOISE_FACTOR`` times that, summed over the parts, plus one unit per
    part after the first for the library's composition of runs with each other.
    """
    scale = sum(count * step.norm for step, count in parts) + len(parts) - 1
    return _NOISE_FACTOR * _EPS * math.sqrt(math.log2(size)) * scale


def _composed_side(
    parts: Parts, plan: tuple[int, int, int], allowance: float
) -> tuple[int, np.ndarray, float]:
    """``(lower, probs, inf_mass)`` of the composition of ``count`` copies of each part.

    The convolution runs in one FFT of ``plan``'s size (:func:`_side_plan`):
    the product of the parts' spectra, each raised to its count. Each part's
    Chernoff window (:meth:`_StepLoss.window`) loses at most ``_TAIL_MASS``;
    the sum lies outside the sum of the windows with at most that much per
    part, which is counted as infinite loss (what the library's
    ``self_compose`` does for one part). Mass outside the window wraps around
    into it, as in the library. Another ``_TAIL_MASS`` per part is counted as
    infinite loss too: it covers what the library's composition moves there
    (its truncation of each run's tails) and what its own wrap-around lifts to
    the top, so the result does not fall below the library's for those
    reasons either. The FFT's rounding is counted twice over: ``allowance``
    (:func:`_noise_allowance`, an a-priori bound covering the library's
    rounding too), and twice the mass of the bins it made negative, which are
    set to 0.
    """
    start, length, size = plan
    spectra = [(count, *step.spectrum(size)) for step, count in parts]
    # Only the low frequencies survive the powers: exp() of the rest is exactly 0.0.
    keep = np.flatnonzero(sum(count * modulus for count, _, modulus in spectra) > _LOG_UNDERFLOW)
    spectrum = np.zeros(size // 2 + 1, dtype=np.complex128)
    spectrum[keep] = np.exp(sum(count * np.log(full[keep]) for count, full, _ in spectra))
    probs = np.roll(scipy.fft.irfft(spectrum, size), -start)[:length]
    rounding = 2.0 * float(-probs[probs < 0].sum())
    probs = np.maximum(probs, 0.0)
    lower = sum(step.lower * count for step, count in parts) + start
    log_keep = sum(count * math.log1p(-step.inf_mass) for step, count in parts)
    inf_mass = 2 * _TAIL_MASS * len(parts) - math.expm1(log_keep) + rounding + allowance
    return lower, probs, inf_mass


def _pmf_epsilon(lower: int, probs: np.ndarray, inf_mass: float, interval: float, delta: float):
    """The smallest epsilon whose hockey-stick divergence is at most ``delta``.

    The library's ``_get_epsilon_for_delta``: a scan from the largest loss
    down, accumulating the upper mass and the lower mass (``exp(-loss)``
    times it), that stops where the epsilon it would return,
    ``log((upper - delta) / lower)``, is at least the next loss. Here the
    scan runs in numpy over blocks of losses from the top and stops at the
    first block holding that point; the test is written without the
    logarithm (the result is continuous there, so ties do not matter).
    Where the scan would pass below loss 0 the epsilon is below 0, and 0.0 is
    returned (the library returns the negative value, or 0; callers take
    ``max(eps, 0)``).
    """
    if inf_mass > delta:
        return math.inf
    top = lower + len(probs) - 1
    mass_upper, mass_lower = inf_mass, 0.0
    rise = _exp_steps(interval)  # exp(i * interval), short enough not to overflow
    for begin in range(0, len(probs), len(rise)):
        p = probs[len(probs) - 1 - begin :: -1][: len(rise)]
        first = (top - begin) * interval  # losses: first - i * interval
        if first < 0:  # the epsilon is below the losses left, and below 0
            return 0.0
        decay = math.exp(-first) * rise[: len(p)]  # exp(-loss)
        upper = np.cumsum(np.concatenate(([mass_upper], p)))  # [i]: mass above loss i
        lower_mass = np.cumsum(np.concatenate(([mass_lower], decay * p)))
        before_upper, before_lower = upper[:-1], lower_mass[:-1]
        stop = (
            (before_upper > delta)
            & (before_lower > 0)
            & ((before_upper - delta) * decay >= before_lower)
        )
        end = int(np.argmax(stop)) if stop.any() else len(p)
        flat = (upper[1 : end + 1] >= delta) & (lower_mass[1 : end + 1] == 0)
        if flat.any():  # exp(-loss) underflowed: epsilon is that loss
            return max(0.0, first - int(np.argmax(flat)) * interval)
        mass_upper, mass_lower = float(upper[end]), float(lower_mass[end])
        if end < len(p):
            break
    if mass_upper <= mass_lower + delta:
        return 0.0
    return math.log((mass_upper - delta) / mass_lower)


@functools.lru_cache(maxsize=4)
def _exp_steps(interval: float) -> np.ndarray:
    """``exp(i * interval)`` for ``i < _EPSILON_BLOCK`` and ``i * interval <= 300`` (read-only)."""
    steps = np.exp(np.arange(max(1, min(_EPSILON_BLOCK, int(300 / interval)))) * interval)
    steps.setflags(write=False)
    return steps


def _library_seconds(losses: list[tuple[tuple[_StepLoss, _StepLoss], int]]) -> float:
    """An estimate (pessimistic, ``_LIBRARY_SECONDS``) of the library's time for these runs.

    Its one-step PMFs are built point by point in Python, its compositions
    transform its own windows. A one-step PMF of at most 1000 points is
    "sparse" (``SparsePLDPmf.self_compose``): its size is raised to the step
    count as a Python integer (2 s at 10**7 steps, hours at 10**9), and a
    one-point PMF is composed step by step.
    """
    per_point, per_size = _LIBRARY_SECONDS
    seconds = 0.0
    for pair, count in losses:
        for step in (pair[0],) if pair[0] is pair[1] else pair:
            if len(step.probs) == 1:
                seconds += 5e-6 * count
            elif len(step.probs) <= 1000 and count > 10**6:
                return math.inf
            lo, hi = step.window(count, library=True)
            seconds += per_point * len(step.probs) + per_size * (hi - lo + 1)
    return seconds


def _pld_epsilon(
    runs: Runs, delta: float, interval: float, above: float = math.inf, *, library: bool = True
) -> float:
    """PLD epsilon of validated runs (all ``sigma > 0``, ``steps > 0``) on the grid ``interval``.

    The larger of the remove and the add side's, each rounded up by
    ``_PLD_ROUND_UP``. Who computes it is decided before anything is composed,
    from the FFT's rounding allowance ``A`` (:func:`_noise_allowance`):

    * ``A <= delta / _NOISE_MARGIN``: the fast composition;
    * else, with ``library``, the library's accountant where its estimated
      cost is at most ``_LIBRARY_MAX_SECONDS`` (:func:`_library_seconds`);
    * else the fast composition while ``A < delta / 2`` (an upper bound on
      the library's value, looser by the allowance);
    * else the library where its estimated cost is at most
      ``_LIBRARY_HARD_SECONDS``: its value is the only one that stands.

    ``inf`` where ``delta`` is at most the ``2 * _TAIL_MASS`` per run counted as infinite
    loss (the library's accountant counts ``_TAIL_MASS``).

    With ``above`` finite, stops after the remove side if the fast composition
    decides and that side alone gives more than ``above``: the value returned
    is then a lower bound on the epsilon, enough to show it exceeds ``above``
    (calibration's use); otherwise the value is the one returned without it.

    Raises:
        _Infeasible: a one-step PMF or a composition exceeds the size limits,
            or ``A >= delta / 2`` where the library is not asked or cannot
            answer (``_library_seconds`` infinite).
        ValueError: ``A >= delta / 2`` where the library could answer, but
            slower than ``_LIBRARY_HARD_SECONDS``: ``delta`` is too small.
    """
    if delta <= 2 * _TAIL_MASS * len(runs):  # below the tails counted as infinite loss
        return math.inf
    losses = [(_step_losses(sigma, rate, interval), steps) for sigma, rate, steps in runs]
    symmetric = all(rate == 1.0 for _, rate, _ in runs)
    sides = [[(pair[side], steps) for pair, steps in losses] for side in (0, 1)]
    sides = sides[:1] if symmetric else sides
    plans = [_side_plan(parts) for parts in sides]
    allowances = [_noise_allowance(parts, plan[2]) for parts, plan in zip(sides, plans)]
    allowance = max(allowances)
    if allowance * _NOISE_MARGIN > delta:
        seconds = _library_seconds(losses) if library else math.inf
        cap = _LIBRARY_HARD_SECONDS if 2 * allowance >= delta else _LIBRARY_MAX_SECONDS
        if seconds <= cap:
            return _library_epsilon(runs, delta, "pld", interval)
        if 2 * allowance >= delta:
            steps = sum(steps for _, _, steps in runs)
            if math.isfinite(seconds):  # the library would answer, slowly: no bound stands in
                raise ValueError(
                    f"delta must be at least {2 * allowance:.2g} for PLD accounting of "
                    f"{steps} steps at these settings (the FFT rounding of dp-accounting's "
                    f"composition is ~{allowance:.1g}; method='rdp' has no such floor), "
                    f"got delta={delta!r}"
                )
            raise _Infeasible(
                f"delta={delta!r} is within reach of the FFT's rounding over {steps} steps"
            )
    eps = 0.0
    for parts, plan, allowance in zip(sides, plans, allowances):
        composed = _composed_side(parts, plan, allowance)
        eps = max(eps, _pmf_epsilon(*composed, interval, delta) * (1 + _PLD_ROUND_UP))
        if eps > above:
            break
    return eps


def _coarse_or_rdp(runs: Runs, delta: float, interval: float, why: _Infeasible):
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
            eps = _pld_epsilon(runs, delta, coarse, library=False)
        except _Infeasible as error:
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
        except _Infeasible as why:
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

    Each step is the Poisson-sampled Gaussian mechanism (Abadi et al. 2016):
    examples are sampled independently with probability ``sample_rate``, and
    Gaussian noise with standard deviation ``noise_multiplier`` times the
    sensitivity (the clip norm) is added. Neighbouring datasets differ by
    adding or removing one example. The number is ``dp_accounting``'s: for
    ``"pld"`` the PLD accountant's (Koskela et al. 2020; Doroshenko et al.
    2022) with ``value_discretization_interval=1e-4``, or an upper bound on
    it that is never below it (within 1e-5 relative for ``delta >= 1e-6``,
    1e-3 for ``delta >= 1e-8``; the module docstring says why, and what is
    cached); for ``"rdp"`` the RDP accountant's (Mironov 2017) with its
    default orders, exactly.

    Out of reach of the 1e-4 grid (``noise_multiplier`` below ~0.1, 10**9
    steps and more, arithmetic that overflows) the PLD epsilon is the one on
    a coarser grid, an upper bound on the 1e-4 grid's, or else the RDP upper
    bound, and a ``RuntimeWarning`` says which (module docstring, "Out of
    reach"). A ``noise_multiplier`` above 1e100 is accounted as 1e100.

    Args:
        noise_multiplier: noise standard deviation over clip norm, ``>= 0``.
        sample_rate: Poisson sampling probability, in ``(0, 1]``
            (``1`` is full-batch training, no amplification by sampling).
        steps: number of steps, an int ``>= 0``.
        delta: target delta, in ``(0, 1)``; usually well below ``1 / n``.
        method: ``"pld"`` (tight, the default) or ``"rdp"`` (looser upper
            bound, what older libraries report).
        bands: ``1`` (DP-SGD) or the band count ``b`` of a correlated-noise
            run with cyclic Poisson sampling; ``sample_rate`` is then the
            rate within a partition and the epsilon is DP-SGD's for
            :func:`participations` ``(steps, b)`` steps (module docstring).

    Returns:
        epsilon as a Python float, an upper bound on the privacy loss.
        ``0.0`` when ``steps == 0`` (nothing released); ``inf`` when
        ``noise_multiplier == 0`` and ``steps > 0`` (no privacy), and for
        ``"pld"`` when ``delta <= 2e-15`` (the tails the composition counts
        as infinite loss; the library's epsilon is ``inf`` below 1e-15).

    Raises:
        ValueError: an argument is out of range or of the wrong type
            (the message names it and its value), ``method`` is unknown, or,
            for ``"pld"``, ``delta`` is within reach of the FFT's rounding
            of the library's composition and the library would take long
            (``delta=1e-13`` after 10**4 steps at ``noise_multiplier=0.3``;
            the message gives the smallest ``delta`` that PLD accounts there).

    >>> epsilon(1.0, 0.01, steps=0, delta=1e-5)
    0.0
    >>> epsilon(0.0, 0.01, steps=10, delta=1e-5)
    inf
    >>> round(epsilon(1.5, 0.04, steps=2250, delta=1e-5, method="rdp"), 2)
    7.33
    """
    sigma = _check_noise_multiplier(noise_multiplier)
    rate = _check_sample_rate(sample_rate)
    rounds = participations(steps, bands)
    delta = _check_delta(delta)
    method = _check_method(method)
    return _history_epsilon([(sigma, rate, rounds)], delta, method)


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

    Contract, for the returned ``sigma`` and ``eps = epsilon(., sample_rate,
    steps, delta, method)`` (the value :func:`epsilon` returns, allowances
    and fallbacks included):

    * ``eps(sigma) <= target_epsilon``: the value :func:`epsilon` returns
      for exactly this ``sigma`` was checked before returning, so the
      calibration never errs on the side of less noise;
    * some ``lo >= sigma / 1.001`` has ``eps(lo) > target_epsilon``, so
      ``sigma`` is within 0.1% above the smallest noise multiplier that
      :func:`epsilon` accepts (epsilon decreases as sigma grows).

    Where :func:`epsilon` is above the library's by its rounding allowance
    (module docstring, "Cost": tiny deltas after many steps), the smallest
    sigma that the library itself would accept can be lower by as much: for
    ``calibrate_noise_multiplier(50.0, 1e-9, 0.001, 10000)`` gives 0.32009,
    where the library accepts 0.31966 (0.13% lower).

    How: a bracket ``eps(lo) > target >= eps(hi)`` is grown geometrically
    around a first guess, then shrunk until ``hi / lo <= 1.001`` by
    interpolating ``log eps`` linearly in ``log sigma`` and probing just
    either side of the estimate, with bisection as the fallback whenever
    that does not halve the bracket. ``hi`` is returned. For ``"pld"`` the
    first guess comes from the Gaussian-DP approximation (Dong, Roth & Su
    2019), refined by a few secant steps on the PLD epsilon over a coarser
    grid (1e-3, ~10x cheaper, never by the library's accountant); the bracket
    then starts at that guess with factor 1.001, and usually closes after two
    evaluations on the 1e-4 grid (the second on the remove side only, when
    that alone exceeds the target: who computes an epsilon is decided before
    either side is composed, so that side is a lower bound on what
    :func:`epsilon` returns). Neither the approximation nor the coarse grid
    decides the answer: both ends of the bracket are checked with
    :func:`epsilon`'s own computation. About 0.1-0.2 s in a fresh process
    (``bench/accounting.md``). Where the answer's epsilon is an upper bound
    computed otherwise (coarser grid, RDP), a ``RuntimeWarning`` says so.

    Args:
        target_epsilon: the privacy budget, a finite number ``> 0``.
        delta: in ``(0, 1)``.
        sample_rate: Poisson sampling probability, in ``(0, 1]``.
        steps: number of steps, an int ``>= 0``.
        method: ``"pld"`` (default) or ``"rdp"``.
        bands: as for :func:`epsilon` (correlated noise with cyclic Poisson
            sampling; ``1`` is DP-SGD).

    Returns:
        the noise multiplier as a Python float. ``0.0`` when ``steps == 0``
        (no steps cost no privacy).

    Raises:
        ValueError: an argument is out of range (named in the message), the
            target needs a noise multiplier outside the search range
            ``[1e-3, 1e6]``, or ``delta`` is too small for PLD accounting
            (as for :func:`epsilon`).
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
            with contextlib.suppress(_Infeasible):
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
                return _pld_epsilon(
                    runs, delta, _COARSE_VALUE_DISCRETIZATION_INTERVAL, library=False
                )
            except _Infeasible as why:  # coarser still, or RDP
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
    once per ``(noise_multiplier, sample_rate)`` (the last 8 are kept; see the
    module docstring), so a constant setting costs ~10-30 ms per call
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
        (module docstring); this runs the library's ``PLDAccountant`` (or
        ``RdpAccountant``) on the whole history too and returns the larger
        value, so a report never rests on the fast path alone. The fast one
        is never below it (module docstring, "Cost"); a library value above it
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
