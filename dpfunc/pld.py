"""The PLD epsilon of DP-SGD, composed in one FFT over cached one-step distributions.

:func:`epsilon` gives the epsilon at a ``delta`` of a history of runs
``(noise_multiplier, sample_rate, steps)`` of the Poisson-sampled Gaussian
mechanism under add-or-remove-one neighbours, from privacy loss distributions
(PLDs) with the pessimistic "connect the dots" discretisation (Koskela, Jälkö &
Honkela 2020; Doroshenko, Ghazi, Kamath, Kumar & Manurangsi 2022): the number
``dp_accounting.pld.PLDAccountant`` gives for the events :mod:`dpfunc.accounting`
builds, or an upper bound on it, computed so that each piece is paid once.
:func:`step_losses` builds one step's distribution (:class:`StepLoss`, each side
kept in a small cache with its FFT); a history composes in one FFT, whatever its
length. An epsilon after each epoch costs ~10-30 ms and a calibration
0.05-0.2 s, against 0.4-0.6 s and 1.3 s by the library's accountant.

Privacy: the result is never below the library's at the same settings. It is
the library's pessimistic bound on the same grid with the composition's tails
and the FFT's rounding (its own and the library's) counted as infinite loss,
and rounded up; above the library's by at most 1e-5 relative for ``delta >=
1e-6``, 1e-3 for ``delta >= 1e-8``, 3e-3 for ``delta >= 1e-10``, a few percent
below that, and ``inf`` for ``delta`` at most 2e-15 per run. Where that
allowance is too large the caller's library accountant decides, or the
``delta`` is refused (``ValueError``). A one-step PLD or a composition beyond
the size limits is not built: :class:`Infeasible` says so, and by how much
coarser the grid would have to be.

The construction, the allowances and why they suffice, who computes an
epsilon, and the measured numbers: see docs/training.md, "How the PLD epsilon
is computed" and "Out of reach".
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np
import scipy.fft
from dp_accounting.pld import privacy_loss_mechanism as _plm

__all__ = ["Infeasible", "StepLoss", "epsilon", "step_losses"]

Runs = tuple[tuple[float, float, int], ...]  # (noise_multiplier, sample_rate, steps) per run

# The pieces below use the library's construction and its formulas; where they
# compute in their own way (the vectorised divergence, the spectrum kept across
# calls, the window of the FFT, the epsilon search in numpy blocks) the tests
# compare them with the library.

# Probability mass a self-composition may cut from its tails (the library's
# default tail_mass_truncation); the cut mass is counted as infinite loss.
_TAIL_MASS = 1e-15
# The (noise_multiplier, sample_rate, grid) single steps kept, each with its
# distributions and one spectrum (up to ~10 MB at sample_rate 0.005, grid 1e-4).
_STEP_CACHE_SIZE = 8
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
# 64 MB of float64. A PLD that needs more raises Infeasible, with the factor by which the grid
# would have to be coarser.
_MAX_STEP_POINTS = 1 << 20
_MAX_FFT_SIZE = 1 << 23
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


class Infeasible(Exception):
    """The PLD of some runs on some grid is beyond what is computed here; the message says why.

    ``coarsen`` is the factor by which the grid would have to be coarser for it to fit
    (``inf`` where no grid would: the FFT's rounding, or overflow).
    """

    def __init__(self, reason: str, coarsen: float = math.inf) -> None:
        super().__init__(reason)
        self.coarsen = coarsen


class StepLoss:
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
        Infeasible: the grid would have more than ``_MAX_STEP_POINTS`` points
            (or infinitely many: noise multipliers near 0).
    """
    bounds = loss.connect_dots_bounds()
    span = (bounds.epsilon_upper - bounds.epsilon_lower) / interval + 2
    if not span <= _MAX_STEP_POINTS:  # NaN and inf included
        coarsen = span / _MAX_STEP_POINTS if math.isfinite(span) else math.inf
        raise Infeasible(f"one step's PLD would need {span:.3g} grid points", coarsen)
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
def step_losses(sigma: float, rate: float, interval: float) -> tuple[StepLoss, StepLoss]:
    """(remove, add) sides of one Poisson-sampled Gaussian step's PLD (one object if rate = 1).

    The library's ``from_gaussian_mechanism`` with its defaults
    (connect-the-dots, pessimistic, sensitivity 1, log mass truncation -50),
    computed by :class:`_GaussianLoss` and :func:`_connect_the_dots`.

    Raises:
        Infeasible: as :func:`_connect_the_dots`, or the library's privacy loss
            fails in floating point (sigma or rate near 0: overflow, 0 / 0).
    """

    def side(adjacency: Any) -> StepLoss:
        try:
            with np.errstate(all="ignore"):
                loss = _GaussianLoss(sigma, sampling_prob=rate, adjacency_type=adjacency)
                return StepLoss(*_connect_the_dots(loss, interval))
        except Infeasible:
            raise
        except (ArithmeticError, ValueError) as error:  # extreme sigma or rate (overflow, 0 / 0)
            raise Infeasible(f"the library's privacy loss fails ({error})") from error

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


Parts = list[tuple[StepLoss, int]]


def _side_plan(parts: Parts) -> tuple[int, int, int]:
    """``(start, length, size)`` of the composition of ``parts``: see :func:`_composed_side`.

    Raises:
        Infeasible: the transform would be larger than ``_MAX_FFT_SIZE``.
    """
    windows = [step.window(count) for step, count in parts]
    start = sum(lo for lo, _ in windows)
    length = sum(hi - lo for lo, hi in windows) + 1
    need = max(length, *(len(step.probs) for step, _ in parts))
    if need > _MAX_FFT_SIZE:
        raise Infeasible(f"the composition would need {need:.3g} grid points", need / _MAX_FFT_SIZE)
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
    Chernoff window (:meth:`StepLoss.window`) loses at most ``_TAIL_MASS``;
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


def _library_seconds(losses: list[tuple[tuple[StepLoss, StepLoss], int]]) -> float:
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


def epsilon(
    runs: Runs,
    delta: float,
    interval: float,
    above: float = math.inf,
    *,
    library: Callable[[], float] | None = None,
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

    Args:
        runs: ``(noise_multiplier, sample_rate, steps)`` per run, in order.
        delta: in ``(0, 1)``.
        interval: the grid step of the privacy loss values (1e-4 in dpfunc).
        above: the early stop's threshold (see above); ``inf`` (default): none.
        library: the epsilon of the same ``runs``, ``delta`` and grid from
            ``dp_accounting``'s ``PLDAccountant``, called where the library
            decides; ``None`` (default): the library is never asked.

    Raises:
        Infeasible: a one-step PMF or a composition exceeds the size limits,
            or ``A >= delta / 2`` where the library is not asked or cannot
            answer (``_library_seconds`` infinite).
        ValueError: ``A >= delta / 2`` where the library could answer, but
            slower than ``_LIBRARY_HARD_SECONDS``: ``delta`` is too small.
    """
    if delta <= 2 * _TAIL_MASS * len(runs):  # below the tails counted as infinite loss
        return math.inf
    losses = [(step_losses(sigma, rate, interval), steps) for sigma, rate, steps in runs]
    symmetric = all(rate == 1.0 for _, rate, _ in runs)
    sides = [[(pair[side], steps) for pair, steps in losses] for side in (0, 1)]
    sides = sides[:1] if symmetric else sides
    plans = [_side_plan(parts) for parts in sides]
    allowances = [_noise_allowance(parts, plan[2]) for parts, plan in zip(sides, plans)]
    allowance = max(allowances)
    if allowance * _NOISE_MARGIN > delta:
        seconds = _library_seconds(losses) if library is not None else math.inf
        cap = _LIBRARY_HARD_SECONDS if 2 * allowance >= delta else _LIBRARY_MAX_SECONDS
        if seconds <= cap:
            return library()
        if 2 * allowance >= delta:
            steps = sum(steps for _, _, steps in runs)
            if math.isfinite(seconds):  # the library would answer, slowly: no bound stands in
                raise ValueError(
                    f"delta must be at least {2 * allowance:.2g} for PLD accounting of "
                    f"{steps} steps at these settings (the FFT rounding of dp-accounting's "
                    f"composition is ~{allowance:.1g}; method='rdp' has no such floor), "
                    f"got delta={delta!r}"
                )
            raise Infeasible(
                f"delta={delta!r} is within reach of the FFT's rounding over {steps} steps"
            )
    eps = 0.0
    for parts, plan, allowance in zip(sides, plans, allowances):
        composed = _composed_side(parts, plan, allowance)
        eps = max(eps, _pmf_epsilon(*composed, interval, delta) * (1 + _PLD_ROUND_UP))
        if eps > above:
            break
    return eps
