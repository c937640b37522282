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
of its runs. dpfunc re-derives none of the mathematics: it builds these
events, hands them to one of the library's accountants and reports the
library's epsilon unchanged (never a smaller one).

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
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import dp_accounting

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
# Bracketing gives up beyond these noise multipliers (see calibrate_noise_multiplier).
_SIGMA_MIN = 1e-3
_SIGMA_MAX = 1e6

History = list[tuple[float, float, int]]


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
# --------------------------------------------------------------------------


def _make_accountant(method: str) -> dp_accounting.PrivacyAccountant:
    relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    if method == "pld":
        return dp_accounting.pld.PLDAccountant(
            neighboring_relation=relation,
            value_discretization_interval=PLD_VALUE_DISCRETIZATION_INTERVAL,
        )
    return dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)


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


def _history_epsilon(history: History, delta: float, method: str) -> float:
    """Epsilon of already-validated runs ``(noise_multiplier, sample_rate, steps)``.

    Memoised (a pure function of its arguments): runs that repeat one
    configuration, such as the audits of :mod:`dpfunc.audit`, pay for the
    PLD construction once.
    """
    return _runs_epsilon(tuple(tuple(run) for run in history if run[2] > 0), delta, method)


@functools.lru_cache(maxsize=256)
def _runs_epsilon(runs: tuple[tuple[float, float, int], ...], delta: float, method: str) -> float:
    if not runs:
        return 0.0
    if any(sigma == 0.0 for sigma, _, _ in runs):
        # A noiseless step releases a deterministic function of the data.
        return math.inf
    event = dp_accounting.ComposedDpEvent([_run_event(*run) for run in runs])
    accountant = _make_accountant(method)
    with _quiet_absl():  # RDP orders that do not converge are left out: still an upper bound
        accountant.compose(event)
        eps = float(accountant.get_epsilon(delta))
    return max(eps, 0.0) if not math.isnan(eps) else math.inf


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
    adding or removing one example. The number is ``dp_accounting``'s,
    unchanged: the PLD accountant (Koskela et al. 2020; Doroshenko et al.
    2022) with ``value_discretization_interval=1e-4`` for ``"pld"``, the RDP
    accountant (Mironov 2017) with its default orders for ``"rdp"``.

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
        ``noise_multiplier == 0`` and ``steps > 0`` (no privacy).

    Raises:
        ValueError: an argument is out of range or of the wrong type
            (the message names it and its value), or ``method`` is unknown.

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
    steps, delta, method)``:

    * ``eps(sigma) <= target_epsilon``: the value :func:`epsilon` returned
      for exactly this ``sigma`` was checked before returning, so the
      calibration never errs on the side of less noise;
    * some ``lo >= sigma / 1.001`` has ``eps(lo) > target_epsilon``, so
      ``sigma`` is within 0.1% above the smallest noise multiplier that meets
      the target (epsilon decreases as sigma grows).

    How: a bracket ``eps(lo) > target >= eps(hi)`` is grown geometrically
    around a first guess (for ``"pld"`` the cheap RDP calibration, which
    usually lands within ~10% above PLD's answer), then shrunk until
    ``hi / lo <= 1.001`` by interpolating ``log eps`` linearly in
    ``log sigma`` and probing just either side of the estimate, with
    bisection as the fallback whenever that does not halve the bracket.
    ``hi`` is returned. A PLD calibration typically costs four to eight PLD
    evaluations (about half a second each for 10^4 steps at sigma ~ 1; more
    for large epsilons, whose loss distributions are wider).

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
        ValueError: an argument is out of range (named in the message), or
            the target needs a noise multiplier outside the search range
            ``[1e-3, 1e6]``.
    """
    target = _check_target_epsilon(target_epsilon)
    delta = _check_delta(delta)
    rate = _check_sample_rate(sample_rate)
    steps = _check_steps(steps)
    method = _check_method(method)
    bands = _check_bands(bands)
    if steps == 0:
        return 0.0
    rtol = _CALIBRATION_RTOL

    def out_of_range() -> ValueError:
        return ValueError(
            f"no noise_multiplier in [{_SIGMA_MIN}, {_SIGMA_MAX}] meets "
            f"target_epsilon={target_epsilon!r} (delta={delta!r}, "
            f"sample_rate={sample_rate!r}, steps={steps!r}, method={method!r}, bands={bands!r})"
        )

    def eps(sigma: float) -> float:
        # The public function itself, so the returned sigma is checked with it.
        return epsilon(sigma, rate, steps, delta, method, bands=bands)

    # First guess and initial growth factor of the bracket.
    guess, factor = 1.0, 2.0
    if method == "pld":
        # Outside RDP's search range: let PLD's own bracketing decide. RDP's notes
        # about orders it excludes concern only this guess, which PLD then checks.
        with contextlib.suppress(ValueError), _quiet_absl():
            guess = calibrate_noise_multiplier(target, delta, rate, steps, "rdp", bands=bands)
            factor = 1.1

    lo, e_lo, hi, e_hi = _bracket(eps, target, guess, factor, out_of_range)

    def probe(sigma: float) -> None:
        nonlocal lo, e_lo, hi, e_hi
        e = eps(sigma)
        if e <= target:
            hi, e_hi = sigma, e
        else:
            lo, e_lo = sigma, e

    # Shrink the bracket to hi / lo <= 1 + rtol.
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

    if not e_hi <= target:  # the loop invariant; cannot fail
        raise RuntimeError(f"calibration failed: epsilon({hi}) = {e_hi} > {target}")
    return hi


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
    ``SelfComposedDpEvent`` per run (``ComposedDpEvent`` over runs). A noise
    schedule that changes every step therefore costs one PLD construction per
    step in :meth:`epsilon`; change it in stages if that becomes slow.

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
