"""Accounted hyperparameter search: random search whose epsilon covers the search.

Choosing a learning rate (or any other setting) by training many times on
the private data and keeping the best run leaks about the data too; the
epsilon of the last run covers only that run. Papernot and Steinke (ICLR
2022, "Hyperparameter Tuning with Renyi Differential Privacy") show that if

* the number of trials ``K`` is itself random, drawn from a Poisson or a
  truncated negative binomial distribution (geometric and logarithmic
  included), and hidden,
* every trial draws its hyperparameters independently from one fixed
  distribution, then trains (a private run) and scores itself privately,
* and only the best trial is released (its hyperparameters, score and
  model),

then the whole search costs little more than one trial: ``dp_accounting``
accounts it as ``RepeatAndSelectDpEvent(trial_event, mean, shape)`` in its
RDP accountant. :class:`RandomSearch` runs such a search with dpfunc's
Trainer or ``PrivateGradients`` inside each trial, and calibrates the
trials' noise so that the search meets a target epsilon.

Honest by construction: ``K`` and every trial's hyperparameters are drawn
from the search's secret stream before any trial runs; the trial function
sees only its hyperparameters, its :class:`dpfunc.DPConfig` and its seed,
never an earlier result; the scores' noise is drawn by the search; each
trial's run is checked against its planned event (noise multiplier, sample
rate, at most the planned steps, its own seed); a trial that spent more is
refused and voids the search. docs/tuning.md says what is and is not
covered.

>>> import dpfunc
>>> space = {"lr": dpfunc.tune.LogUniform(0.01, 1.0), "momentum": 0.9}
>>> config = dpfunc.DPConfig(clip_norm=1.0, expected_batch_size=1000, epochs=2,
...                          target_epsilon=3.0, delta=1e-5)
>>> tuning = dpfunc.tune.RandomSearch(space, config, num_examples=1000, mean_trials=5,
...                                   score_noise_multiplier=20.0)
>>> tuning.epsilon() <= 3.0  # the whole search's, with each trial's noise calibrated for it
True
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import math
import os
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import dp_accounting
import numpy as np
import torch
from dp_accounting import dp_event

from . import accounting
from ._checks import check_choice, check_int, check_number
from .accounting import Accountant, _quiet_absl, participations
from .checkpoint import _atomic_write, _lock, release_all
from .config import DPConfig, sum_noise_multiplier
from .noise import check_seed, secret_seed, standard_normal_like

try:  # the inversion of the mean that dp_accounting's RDP bound uses (a private function)
    from dp_accounting.rdp.rdp_privacy_accountant import (
        _gamma_truncated_negative_binomial as _library_gamma,
    )
except ImportError:  # pragma: no cover (exercised by a test that removes it)
    _library_gamma = None

__all__ = [
    "Best",
    "Choice",
    "IntUniform",
    "LogUniform",
    "Outcome",
    "RandomSearch",
    "SearchReport",
    "SearchResult",
    "Trial",
    "Uniform",
    "search",
    "trial_count_pmf",
]

MAX_MEAN_TRIALS = 10_000
"""The largest ``mean_trials`` accepted: every drawn trial is a whole private run."""

SCORES = ("private", "public")
"""``"private"``: the search noises each trial's validation sum; ``"public"``: taken as given."""

TRIAL_CONFIG_FIELDS = ("clip_norm", "clipping")
"""DPConfig fields a space may vary: they leave the trial's accounting event unchanged."""

_CHECKPOINT_FORMAT = "dpfunc.tune/1"


# --------------------------------------------------------------------------- the space


@dataclasses.dataclass(frozen=True)
class Uniform:
    """A float drawn uniformly from ``[low, high)``.

    >>> Uniform(0.0, 1.0).sample(np.random.default_rng(0)) < 1.0
    True
    """

    low: float
    high: float

    def __post_init__(self) -> None:
        check_number("low", self.low, low_open=True, high_open=True)
        check_number("high", self.high, low=self.low, low_open=True, high_open=True)

    def sample(self, rng: np.random.Generator) -> float:
        """One draw from ``rng``."""
        return float(rng.uniform(self.low, self.high))


@dataclasses.dataclass(frozen=True)
class LogUniform:
    """A float whose logarithm is uniform: ``exp(U[log low, log high))``, for rates and norms.

    >>> 1e-3 <= LogUniform(1e-3, 1.0).sample(np.random.default_rng(0)) < 1.0
    True
    """

    low: float
    high: float

    def __post_init__(self) -> None:
        check_number("low", self.low, low=0, low_open=True, high_open=True)
        check_number("high", self.high, low=self.low, low_open=True, high_open=True)

    def sample(self, rng: np.random.Generator) -> float:
        """One draw from ``rng``."""
        return float(math.exp(rng.uniform(math.log(self.low), math.log(self.high))))


@dataclasses.dataclass(frozen=True)
class IntUniform:
    """An int drawn uniformly from ``low, low + 1, ..., high`` (both included).

    >>> IntUniform(3, 3).sample(np.random.default_rng(0))
    3
    """

    low: int
    high: int

    def __post_init__(self) -> None:
        check_int("low", self.low, minimum=-(2**62))
        if check_int("high", self.high, minimum=self.low) > 2**62:
            raise ValueError(f"high must be an int <= 2**62, got high={self.high!r}")

    def sample(self, rng: np.random.Generator) -> int:
        """One draw from ``rng``."""
        return int(rng.integers(self.low, self.high, endpoint=True))


@dataclasses.dataclass(frozen=True)
class Choice:
    """One of ``options``, each with the same probability (any values: names, tuples, None).

    >>> Choice(["sgd", "adam"]).sample(np.random.default_rng(0)) in ("sgd", "adam")
    True
    """

    options: tuple

    def __post_init__(self) -> None:
        if not isinstance(self.options, list | tuple | range):  # ordered: the same draws
            raise TypeError(f"options must be a list or tuple, got options={self.options!r}")
        if len(self.options) == 0:
            raise ValueError(f"options must hold at least one value, got options={self.options!r}")
        object.__setattr__(self, "options", tuple(self.options))

    def sample(self, rng: np.random.Generator) -> Any:
        """One draw from ``rng``."""
        return self.options[int(rng.integers(len(self.options)))]


def _check_space(space: Any) -> dict[str, Any]:
    """The space as a dict, after refusing what would make the search adaptive or unaccounted."""
    if callable(space) and not isinstance(space, Mapping):
        raise TypeError(
            "space must be a dict of name -> distribution or value, got a callable: a space "
            "computed from earlier results would make the search adaptive, which the "
            "repeat-and-select theorem does not cover (each trial must draw from one fixed "
            "distribution); run separate searches instead, and compose their epsilons"
        )
    if not isinstance(space, Mapping):
        raise TypeError(f"space must be a dict of name -> distribution or value, got {space!r}")
    fixed = {f.name for f in dataclasses.fields(DPConfig)} - set(TRIAL_CONFIG_FIELDS)
    for name, value in space.items():
        if not isinstance(name, str):
            raise TypeError(f"space keys must be str, got the key {name!r}")
        if name in fixed:
            raise ValueError(
                f"space[{name!r}] would change each trial's privacy settings, which the "
                "search fixes for every trial (they decide the trial's accounting event: noise, "
                f"sample rate, steps, accountant); set {name} in config, or run one search per "
                f"value and compose their epsilons. A space may vary {list(TRIAL_CONFIG_FIELDS)} "
                "and any setting of your own"
            )
        sample = getattr(value, "sample", None)
        if callable(sample) and not isinstance(value, type):
            _check_sampler(name, sample)
    return dict(space)


def _check_sampler(name: str, sample: Callable) -> None:
    try:
        signature = inspect.signature(sample)
        signature.bind(np.random.default_rng(0))
    except TypeError:
        raise TypeError(
            f"space[{name!r}].sample must take one argument, the random generator, got "
            f"sample{_signature_text(sample)}: a distribution that reads earlier trials would "
            "make the search adaptive, which the repeat-and-select theorem does not cover"
        ) from None
    except ValueError:  # no signature to read (a builtin): called as sample(rng)
        return


def _signature_text(function: Callable) -> str:
    try:
        return str(inspect.signature(function))
    except (TypeError, ValueError):
        return "(...)"


def _draw(space: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """One trial's hyperparameters: each distribution sampled, each constant kept."""
    drawn = {}
    for name, value in space.items():
        sample = getattr(value, "sample", None)
        drawn[name] = sample(rng) if callable(sample) and not isinstance(value, type) else value
    return drawn


# --------------------------------------------------------------------------- the trial count


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


# --------------------------------------------------------------------------- accounting


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


# --------------------------------------------------------------------------- what trials return


class Outcome(NamedTuple):
    """What a trial function returns.

    Args:
        run: the trial's :class:`dpfunc.Trainer` or :class:`dpfunc.PrivateGradients`,
            trained with the config and seed the trial was given; its
            accountant is checked against the trial's event.
        metric: ``score="private"``: each private validation example's value
            (accuracy 0/1, or any value mapped into ``[0, 1]``; clamped there,
            NaN read as 0), 1-D; ``score="public"``: the score as a float,
            computed on public data only.
        result: what the search hands back for the best trial (its parameters,
            a model); ``None`` by default.
    """

    run: Any
    metric: Any
    result: Any = None


class Best(NamedTuple):
    """What a search releases of its best trial (:attr:`SearchResult.best`), covered by its epsilon.

    Its hyperparameters, its score (private: noisy) and the steps its run
    accounted; not its index, nor its attempts: where the best stands in the
    trial list tells how many trials there were at least, and the theorem
    covers the best trial's output only, with ``K`` hidden. (For Poisson ``K``
    of mean 5 and a Gaussian score of sensitivity 1 and std 1, releasing the
    index with the best score raises delta at epsilon 3 from 7.3e-3 to 4.4e-2,
    both directions of the neighbouring relation.)
    """

    hyperparameters: dict
    score: float
    steps: int


class Trial(NamedTuple):
    """One trial of a finished search (in :attr:`SearchResult.trials`: NOT covered).

    ``score`` is the private (noisy) or public score, NaN where a public
    score was NaN; ``steps`` the steps its run accounted; ``attempts`` the
    runs started for it (more than 1: interrupted ones, among the ``retries``
    accounted in advance, each with its own hyperparameters:
    ``hyperparameters`` are the last attempt's).
    """

    index: int
    hyperparameters: dict
    score: float
    steps: int
    attempts: int


# --------------------------------------------------------------------------- the search


class RandomSearch:
    """A random search whose epsilon covers the whole search (Papernot and Steinke 2022).

    Args:
        space: name -> a distribution (:class:`Uniform`, :class:`LogUniform`,
            :class:`IntUniform`, :class:`Choice`, or any object whose
            ``sample(rng)`` takes a ``numpy.random.Generator``) or a constant.
            May hold ``clip_norm`` and ``clipping``, applied to each trial's
            config; no other DPConfig field.
        config: the trials' privacy settings: ``epochs``, ``expected_batch_size``,
            and ``target_epsilon`` (the whole search's: each trial's noise is
            calibrated to meet it) or ``noise_multiplier`` (each trial's).
        num_examples: the private training set's size (public, as for the Trainer).
        mean_trials: the expected number of trials ``E[K]``, in ``[1, 10000]``.
        shape: the distribution of ``K``: ``inf`` Poisson, ``1`` geometric,
            ``0`` logarithmic, else truncated negative binomial.
        score: ``"private"`` (the search adds ``N(0, score_noise_multiplier**2)``
            to the sum of each trial's validation values) or ``"public"``.
        score_noise_multiplier: the std of that noise, in examples (needed
            with ``score="private"``); accounted inside each trial.
        validation_size: ``score="private"``: the public size the noisy sum
            is divided by (the score is ``(sum + noise) / validation_size``),
            which makes the score a post-processing of the Gaussian sum of
            sensitivity 1 when validation examples are added or removed.
            ``None``: the sum is divided by the number of values each trial
            returns, which is exact only when the validation set's size is
            public (examples replaced, never added or removed): under
            add-or-remove the realised size itself moves the score.
        seed: ``None`` (a secret from the OS CSPRNG draws ``K``, the
            hyperparameters and the score noise) or an int: **research mode**,
            reproducible, and no privacy against whoever knows it.
        checkpoint_path: a file saved before and after every trial, and
            resumed from (with a warning) if it exists.
        retries: how many interrupted attempts (a trial that raised, or was
            running when the process died) the search may restart; each is
            accounted IN ADVANCE as a whole trial, whether or not it
            happens, so that the epsilon does not depend on how many did.
            One more interruption voids the search.

    Privacy: the released output (:attr:`SearchResult.best` and
    :attr:`SearchResult.result`) is ``(epsilon(delta), delta)``-DP with
    ``epsilon`` dp_accounting's RDP accountant on :attr:`dp_event`, the
    repeat-and-select event of the trial event (composed with ``retries``
    whole trials, the interrupted attempts it may restart), provided each trial
    function reads nothing but
    its arguments and trains one run. ``K``, the trial list and the other
    scores are not covered (:meth:`SearchResult.all_trials_epsilon` is their cost).

    Raises:
        ValueError, TypeError: a bad argument (named with its value), a space
            that would make the search adaptive or change a trial's event, a
            target that cannot be met, or a checkpoint of another search.

    >>> import dpfunc
    >>> config = dpfunc.DPConfig(clip_norm=1.0, expected_batch_size=500, epochs=4,
    ...                          noise_multiplier=4.0, delta=1e-5)
    >>> tuning = RandomSearch({"lr": Choice([0.1, 1.0])}, config, 500, mean_trials=3,
    ...                       score="public")
    >>> one_run = dpfunc.accounting.epsilon(4.0, 1.0, 4, 1e-5, method="rdp")
    >>> one_run < tuning.epsilon() < 3 * one_run  # more than one run, less than three
    True
    """

    def __init__(
        self,
        space: Mapping[str, Any],
        config: DPConfig,
        num_examples: int,
        *,
        mean_trials: float,
        shape: float = math.inf,
        score: str = "private",
        score_noise_multiplier: float | None = None,
        validation_size: int | None = None,
        seed: int | None = None,
        checkpoint_path: str | os.PathLike | None = None,
        retries: int = 0,
    ):
        self.space = _check_space(space)
        self.retries = check_int("retries", retries, minimum=0)
        self.num_examples = check_int("num_examples", num_examples, minimum=1)
        self.mean_trials, self.shape = _check_count(mean_trials, shape)
        self.score = check_choice("score", score, SCORES)
        self.score_noise_multiplier = _check_score_noise(score, score_noise_multiplier)
        if validation_size is not None:
            check_int("validation_size", validation_size, minimum=1)
            if score == "public":
                raise ValueError(
                    "score='public' takes the score as computed; leave validation_size out, "
                    f"got validation_size={validation_size!r}"
                )
        self.validation_size = validation_size
        if seed is not None:
            check_seed(seed)
        self.seed_is_secret = seed is None
        self._secret = secret_seed() if seed is None else seed
        self.target_epsilon = config.target_epsilon if isinstance(config, DPConfig) else None
        self.trial_config = self._calibrated(config)
        self.delta = float(self.trial_config.delta)
        self._rate = self.trial_config.sample_rate(self.num_examples)
        self._steps = self.trial_config.total_steps(self.num_examples)
        self._event = self.trial_config.accounting_event(self.num_examples)
        self._state = self._fresh_state()
        self._running = False
        self._result: SearchResult | None = None
        self.checkpoint_path = checkpoint_path
        if checkpoint_path is not None:
            self._open_checkpoint(checkpoint_path)
            # absolute from here: a trial that changes the working directory must not move it
            self.checkpoint_path = os.path.abspath(checkpoint_path)

    # -- accounting ---------------------------------------------------------------------

    def _calibrated(self, config: Any) -> DPConfig:
        """The trials' config: delta resolved, the noise calibrated for the whole search."""
        if not isinstance(config, DPConfig):
            raise TypeError(f"config must be a dpfunc.DPConfig, got config={config!r}")
        if config.epochs is None:
            raise ValueError("config.epochs fixes each trial's steps; give it, got epochs=None")
        if config.epsilon_budget is not None:
            raise ValueError(
                "config.epsilon_budget would let a trial stop at a data-dependent step; the "
                "search's budget is config.target_epsilon, got "
                f"epsilon_budget={config.epsilon_budget!r}"
            )
        sigma = 1.0 if config.noise_multiplier is None else config.noise_multiplier
        plain = dataclasses.replace(config, noise_multiplier=sigma, target_epsilon=None)
        plain = plain.calibrated(self.num_examples)  # delta resolved (and checked against 1/n)
        if config.target_epsilon is None:
            return plain
        rate = plain.sample_rate(self.num_examples)
        steps = participations(plain.total_steps(self.num_examples), plain.bands)

        def epsilon_of(accounted: float) -> float:
            trial = _trial_event(accounted, rate, steps, self.score_noise_multiplier)
            event = _search_event(trial, self.mean_trials, self.shape, self.retries)
            return _rdp_epsilon(event, plain.delta)

        floor = "the score's noise and the trial count's mean alone"
        accounted = _calibrate(epsilon_of, config.target_epsilon, floor)
        while True:  # the split of adaptive clipping rounds: keep the search within the target
            trial = dataclasses.replace(plain, noise_multiplier=_sum_sigma(plain, accounted))
            if epsilon_of(trial.accounted_noise_multiplier) <= config.target_epsilon:
                return trial
            accounted *= 1 + 1e-9

    @property
    def dp_event(self) -> Any:
        """The search's ``dp_accounting`` event: anyone can recompute :meth:`epsilon` from it.

        ``RepeatAndSelectDpEvent(trial, mean_trials, shape)``, where a trial is
        ``steps`` Poisson-sampled Gaussian steps, composed (private score) with
        the score's Gaussian; composed with ``SelfComposedDpEvent(trial, n)``,
        ``n = retries`` fixed in advance (or the interrupted attempts, if a
        void search had more).
        """
        n = max(self.retries, self._abandoned())
        return _search_event(self.trial_event, self.mean_trials, self.shape, n)

    @property
    def trial_event(self) -> Any:
        """One trial's ``dp_accounting`` event (training, then the private score)."""
        steps = participations(self._steps, self.trial_config.bands)
        return _trial_event(
            self._event.noise_multiplier, self._rate, steps, self.score_noise_multiplier
        )

    def epsilon(self, delta: float | None = None) -> float:
        """The search's epsilon at ``delta`` (default: the config's): RDP of :attr:`dp_event`.

        Raises:
            ValueError: ``delta`` outside ``(0, 1)``.
        """
        delta = self.delta if delta is None else delta
        check_number("delta", delta, low=0, high=1, low_open=True, high_open=True)
        return _rdp_epsilon(self.dp_event, delta)

    def _abandoned(self) -> int:
        state = self._state
        return sum(a - int(s is not None) for a, s in zip(state["attempts"], state["scores"]))

    # -- the secret stream ----------------------------------------------------------------

    def _key(self, *labels: Any) -> int:
        """A 256-bit key for ``labels``, derived from the secret (never printed)."""
        digest = hashlib.shake_256(b"dpfunc.tune\x00" + str(self._secret).encode())
        for label in labels:
            digest.update(b"\x00" + str(label).encode())
        return int.from_bytes(digest.digest(32), "little")

    def _rng(self, *labels: Any) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence(self._key(*labels))))

    def _fresh_state(self) -> dict[str, Any]:
        """K and every trial's hyperparameters, drawn before any trial runs."""
        count = _draw_count(self._rng("count"), self.mean_trials, self.shape)
        drawn = [self._hyperparameters(i, 0) for i in range(count)]
        return {
            "hyperparameters": drawn,
            "scores": [None] * count,  # a float once the trial completed (NaN allowed)
            "steps": [0] * count,
            "attempts": [0] * count,  # runs started (a run not completed: interrupted)
            "best": None,  # {"index": i, "result": ...}
            "validation_size": None,
            "void": None,  # why the search may release nothing (a trial overspent)
            "seeds": [],  # SHA-256 of each completed run's seed: no two trials share one
        }

    def _hyperparameters(self, index: int, attempt: int) -> dict[str, Any]:
        drawn = _draw(self.space, self._rng("hyperparameters", index, attempt))
        self._trial_config(drawn)  # a bad clip_norm or clipping fails before any run
        return drawn

    def _trial_config(self, hyperparameters: dict[str, Any]) -> DPConfig:
        changes = {k: hyperparameters[k] for k in TRIAL_CONFIG_FIELDS if k in hyperparameters}
        return dataclasses.replace(self.trial_config, **changes)

    def _run_seed(self, index: int, attempt: int) -> int | None:
        """The seed handed to a trial: ``None`` (its run draws a secret) or, research mode, one."""
        return None if self.seed_is_secret else self._key("run", index, attempt)

    def _score_noise(self, index: int, attempt: int) -> float:
        key = self._key("score", index, attempt)
        z = standard_normal_like({"z": torch.zeros(1, dtype=torch.float64)}, seed=key, step=0,
                                 secure=self.trial_config.secure_noise)  # fmt: skip
        return float(z["z"][0])

    # -- running ----------------------------------------------------------------------------

    def run(self, trial_fn: Callable[[Mapping[str, Any], DPConfig, int | None], Outcome]):
        """Runs the trials not yet completed, in order; returns the :class:`SearchResult`.

        ``trial_fn(hyperparameters, config, seed)`` trains ONE private run with
        ``config`` and ``seed`` (``Trainer(..., config=config, seed=seed)``)
        and returns an :class:`Outcome`. It must read nothing but its
        arguments (no earlier trial, no state of its own). A call after an
        exception or a crash goes on from the trial that was interrupted,
        with fresh hyperparameters and a fresh seed, as long as the
        interrupted attempts stay within ``retries`` (accounted in advance);
        one more voids the search.

        Raises:
            RuntimeError: a trial's run spent more than its event (more steps,
                another noise multiplier or sample rate) or reused a seed, or
                the interrupted attempts exceed ``retries``: the search is void
                and releases nothing, now or after a resume; or ``run`` is
                called from inside a trial.
            TypeError, ValueError: a trial returned something malformed.
            Whatever ``trial_fn`` raises (the attempt stays accounted).
        """
        if self._running:
            raise RuntimeError(
                "run() was called from inside a trial: trials run one after the other, and "
                "none sees another's result (an adaptive search is not covered)"
            )
        if not callable(trial_fn):
            raise TypeError(f"trial_fn must be callable, got trial_fn={trial_fn!r}")
        self._check_retries()
        self._check_not_void()
        self._running = True
        try:
            state = self._state
            for index, done in enumerate(state["scores"]):
                if done is None:
                    self._run_trial(trial_fn, index)
        finally:
            self._running = False
        self._result = SearchResult(self)
        return self._result

    def _run_trial(self, trial_fn: Callable, index: int) -> None:
        state = self._state
        attempt = state["attempts"][index]
        if attempt > 0:  # an interrupted attempt: fresh hyperparameters for an independent trial
            state["hyperparameters"][index] = self._hyperparameters(index, attempt)
        state["attempts"][index] = attempt + 1
        self._save()  # recorded before the trial runs: an interruption is always counted
        hyperparameters = state["hyperparameters"][index]
        seed = self._run_seed(index, attempt)
        outcome = trial_fn(
            types.MappingProxyType(dict(hyperparameters)), self._trial_config(hyperparameters), seed
        )
        steps = self._check_outcome(outcome, index, seed)
        _check_result(outcome.result, outcome.run, index)
        state["scores"][index] = self._score(outcome.metric, index, attempt)
        state["steps"][index] = steps
        best = state["best"]
        if best is None or _rank(state["scores"][index]) > _rank(state["scores"][best["index"]]):
            state["best"] = {"index": index, "result": outcome.result}  # ties: the earliest
        self._save()

    def _check_outcome(self, outcome: Any, index: int, seed: int | None) -> int:
        """The steps the trial's run accounted, after checking them against the trial's event."""
        if not isinstance(outcome, Outcome):
            raise TypeError(
                f"trial {index} returned {type(outcome).__name__}; a trial function returns "
                "dpfunc.tune.Outcome(run, metric, result)"
            )
        run = outcome.run
        accountant = getattr(run, "accountant", None)
        if not isinstance(accountant, Accountant) or not hasattr(run, "seed_is_secret"):
            raise TypeError(
                f"trial {index}: Outcome.run must be the trial's dpfunc.Trainer or "
                f"dpfunc.PrivateGradients, whose accountant is checked, got {run!r}"
            )
        expected = tuple(self._event)
        wrong = [tuple(r) for r in accountant.history if tuple(r[:2]) != expected]
        steps = accountant.steps
        why = None
        if wrong:
            why = f"it accounted steps {wrong} (noise_multiplier, sample_rate, steps)"
        elif steps > self._steps:
            why = f"it accounted {steps} steps"
        elif getattr(run, "num_examples", None) != self.num_examples:
            why = f"it trained on {getattr(run, 'num_examples', None)} examples"
        elif accountant.bands != self.trial_config.bands:
            why = f"it used bands={accountant.bands}"
        elif self.seed_is_secret and not run.seed_is_secret:
            why = "its seed was fixed, not the secret its run draws with seed=None"
        elif not self.seed_is_secret and run.seed != seed:
            why = "its seed was not the one the trial was given"
        else:
            mark = hashlib.sha256(str(run.seed).encode()).hexdigest()
            why = "its seed was another trial's" if mark in self._state["seeds"] else None
            self._state["seeds"].append(mark)
        if why is not None:
            self._state["void"] = f"trial {index}: {why}"
            self._save()
            raise RuntimeError(
                f"trial {index} spent other than its event allows: {why}; each trial may run at "
                f"most {self._steps} steps of (noise_multiplier, sample_rate) = {expected} on "
                f"{self.num_examples} examples with its own seed. Those steps were released "
                "beyond what the search accounts, so this search is void: it releases nothing"
            )
        return steps

    def _score(self, metric: Any, index: int, attempt: int) -> float:
        if self.score == "public":
            if isinstance(metric, bool) or not isinstance(metric, int | float | np.floating):
                raise TypeError(
                    f"trial {index}: with score='public' Outcome.metric is the score as a "
                    f"float, got {metric!r}"
                )
            return float(metric)
        values = torch.as_tensor(metric, dtype=torch.float64).detach().cpu()
        if values.dim() != 1 or values.numel() < 2:
            raise ValueError(
                f"trial {index}: with score='private' Outcome.metric holds each validation "
                "example's value in [0, 1], 1-D, one per example, got shape "
                f"{tuple(values.shape)}: a single value would be read as a validation set of "
                "one example, whose noisy score is noise (an accuracy of the whole set is "
                "passed as the per-example values it averages)"
            )
        size = self._state["validation_size"]
        if size is not None and values.numel() != size:
            raise ValueError(
                f"trial {index}: scored on {values.numel()} validation examples, the earlier "
                f"trials on {size}; every trial is scored on the same validation set"
            )
        self._state["validation_size"] = values.numel()
        total = torch.nan_to_num(values, nan=0.0).clamp(0.0, 1.0).sum().item()  # sensitivity 1
        noisy = total + self.score_noise_multiplier * self._score_noise(index, attempt)
        return noisy / (self.validation_size or values.numel())

    def _check_retries(self) -> None:
        """Voids the search once its interrupted attempts exceed the ``retries`` accounted."""
        abandoned = self._abandoned()
        if abandoned > self.retries and self._state["void"] is None:
            self._state["void"] = (
                f"{abandoned} interrupted attempts, more than the retries={self.retries} its "
                "epsilon accounts in advance; how many attempts a search needs may depend on "
                "the data, so it cannot be accounted afterwards"
            )
            self._save()

    def _check_not_void(self) -> None:
        if self._state["void"] is not None:
            raise RuntimeError(
                f"this search is void ({self._state['void']}): it spent more than its epsilon "
                "accounts, so nothing of it may be released; a new search spends its own"
            )

    @property
    def result(self) -> SearchResult:
        """The finished search's :class:`SearchResult`.

        Raises:
            RuntimeError: the search has not finished: results are released
                once, at the end, never to a trial.
        """
        if self._result is None:
            raise RuntimeError(
                "the search has not finished: its results are released once, at the end "
                "(a trial that read earlier results would make the search adaptive)"
            )
        return self._result

    # -- checkpoints ----------------------------------------------------------------------

    def _fingerprint(self) -> dict[str, Any]:
        """What a resumed search must share with the saved one."""
        return {
            "space": repr(sorted(self.space.items())),
            "config": repr(self.trial_config),
            "target_epsilon": self.target_epsilon,
            "num_examples": self.num_examples,
            "mean_trials": self.mean_trials,
            "shape": self.shape,
            "score": self.score,
            "score_noise_multiplier": self.score_noise_multiplier,
            "validation_size": self.validation_size,
            "retries": self.retries,
            "seed_is_secret": self.seed_is_secret,
            "seed": None if self.seed_is_secret else self._secret,
        }

    def _open_checkpoint(self, path: Any) -> None:
        if not isinstance(path, str | os.PathLike):
            raise TypeError(f"checkpoint_path must be a str or path, got checkpoint_path={path!r}")
        if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise ValueError(f"checkpoint_path={os.fspath(path)!r} is in a missing directory")
        try:
            _lock(self, path)  # one live search per path, held while this object lives
        except ValueError as error:
            raise ValueError(
                f"checkpoint_path={os.fspath(path)!r} is held by another live search; close() "
                "it or give this search another path"
            ) from error
        if not os.path.exists(path):
            _check_plain(self._state["hyperparameters"], "the drawn hyperparameters")
            self._save()
            return
        try:
            saved = torch.load(path, weights_only=True, map_location="cpu")
        except Exception as error:
            raise ValueError(
                f"checkpoint_path={os.fspath(path)!r} is not a readable search checkpoint "
                f"({type(error).__name__}); resume from an intact copy or give another path"
            ) from error
        if not isinstance(saved, dict) or saved.get("format") != _CHECKPOINT_FORMAT:
            raise ValueError(
                f"checkpoint_path={os.fspath(path)!r} holds no dpfunc.tune search checkpoint"
            )
        ours = self._fingerprint()
        differ = sorted(k for k in ours if saved["fingerprint"].get(k) != ours[k])
        if differ:
            raise ValueError(
                f"checkpoint_path={os.fspath(path)!r} holds another search (its "
                f"{', '.join(differ)} differ): a search resumed with other settings would be "
                "another search, chosen after seeing this one's progress (adaptive); give "
                "another path for a new search, whose epsilon composes with this one's"
            )
        self._state = saved["state"]
        if self.seed_is_secret:  # the fork rule: a continuation never reuses a draw
            self._secret = secret_seed()
        warnings.warn(
            f"resuming the search saved at {os.fspath(path)!r}: {self._abandoned()} interrupted "
            f"attempts of the retries={self.retries} accounted in advance",
            stacklevel=3,
        )

    def _save(self) -> None:
        if self.checkpoint_path is None:
            return
        payload = {
            "format": _CHECKPOINT_FORMAT,
            "fingerprint": self._fingerprint(),
            "state": self._state,
        }
        try:
            _atomic_write(os.fspath(self.checkpoint_path), lambda f: torch.save(payload, f))
        except Exception as error:
            raise ValueError(
                "the search checkpoint holds the hyperparameters and the best trial's result, "
                "which must be plain values (numbers, strings, None, lists, dicts, tensors) "
                f"for a safe load; saving failed: {error}"
            ) from error

    def close(self) -> None:
        """Lets go of the checkpoint path, so that another search object may resume from it."""
        release_all(self)

    def __repr__(self) -> str:  # never K, a hyperparameter draw or the secret
        return (
            f"RandomSearch(mean_trials={self.mean_trials:g}, shape={self.shape:g}, "
            f"score={self.score!r}, epsilon={self.epsilon():.4g}, delta={self.delta:g})"
        )


def _sum_sigma(config: DPConfig, accounted: float) -> float:
    """The gradient sum's noise multiplier for an accounted one (adaptive clipping: a split)."""
    if not config.adaptive:
        return accounted
    count = config.count_noise_multiplier
    if not count > accounted:
        raise ValueError(
            f"the search needs a combined noise multiplier of {accounted:.4g} per step, which "
            f"count_noise_multiplier={count!r} alone does not leave room for; raise it"
        )
    return sum_noise_multiplier(accounted, count)


def _check_score_noise(score: str, value: Any) -> float | None:
    if score == "public":
        if value is not None:
            raise ValueError(
                "score='public' adds no noise; leave score_noise_multiplier out, got "
                f"score_noise_multiplier={value!r}"
            )
        return None
    if value is None:
        raise ValueError(
            "score='private' noises each trial's validation sum (sensitivity 1): give "
            "score_noise_multiplier, its std in examples (e.g. 2% of the validation size), "
            "got None"
        )
    return check_number("score_noise_multiplier", value, low=0, low_open=True, high_open=True)


def _check_result(result: Any, run: Any, index: int) -> None:
    """Refuses a trial's ``result`` that would release what the search's epsilon does not cover.

    Looked for in dicts, lists and tuples: a run (a Trainer, a
    ``PrivateGradients``, what holds one, as a ``PrivateTrainer`` does, or its
    plan), a dpfunc state dict, the run's secret seeds (as an int or written in
    a string, decimal or hex), each of which lets anyone remove the noise, and
    a tensor of the run's training data (its memory, a copy of a whole
    column, or rows copied from one). A block list: data kept in another form
    is not seen (docs/tuning.md says what ``result`` may hold).
    """
    columns = _data_columns(run)
    secrets = [getattr(run, name, None) for name in ("seed", "stream_seed")]
    secrets = [int(s) for s in secrets if s is not None] if run.seed_is_secret else []
    seen: set[int] = set()

    def leak(value: Any) -> str | None:
        if _is_run(value) or _is_run(getattr(value, "private", None)):
            return f"a run ({type(value).__name__})"
        if hasattr(value, "lineage") and hasattr(value, "stream_seed"):
            return f"a run's plan ({type(value).__name__}), which holds its secret seed"
        if isinstance(value, dict) and {"accountant", "lineage"} <= value.keys():
            return "a dpfunc state dict, which holds the run's secret seed"
        if isinstance(value, int | np.integer) and not isinstance(value, bool):
            return "the run's secret seed" if int(value) in secrets else None
        if isinstance(value, str | bytes):
            text = value.decode("latin-1") if isinstance(value, bytes) else value
            words = [w for s in secrets for w in (str(s), format(s, "x"), format(s, "X"))]
            return "the run's secret seed, written out" if any(w in text for w in words) else None
        if isinstance(value, torch.Tensor) and any(_same_data(value, c) for c in columns):
            return "a tensor of the training data"
        return None

    def visit(value: Any, where: str) -> None:
        if id(value) in seen:  # a result that holds itself
            return
        seen.add(id(value))
        why = leak(value)
        if why is not None:
            raise ValueError(
                f"trial {index}: Outcome.result{where} is {why}, which the search would "
                "release as covered by its epsilon, and it is not: result may hold the "
                "trained model, its parameters, the hyperparameters and public values, "
                "never the run, its state_dict, its seed, or training data"
            )
        if isinstance(value, dict):
            for key, item in value.items():
                visit(item, f"{where}[{key!r}]")
        elif isinstance(value, list | tuple):
            for k, item in enumerate(value):
                visit(item, f"{where}[{k}]")

    visit(result, "")


def _is_run(value: Any) -> bool:
    return hasattr(value, "accountant") and hasattr(value, "seed_is_secret")


def _data_columns(run: Any) -> list[torch.Tensor]:
    """The tensors a run's training set is made of, where it is tensors (else none)."""
    batches = getattr(getattr(run, "plan", None), "batches", None)
    dataset = getattr(batches, "dataset", None)
    if isinstance(dataset, torch.Tensor):
        return [dataset]
    if isinstance(dataset, tuple):
        return [c for c in dataset if isinstance(c, torch.Tensor)]
    return []


def _same_data(value: torch.Tensor, column: torch.Tensor) -> bool:
    """Whether ``value`` is ``column``'s memory, a copy of it, or holds rows copied from it.

    Rows are compared where they have 8 entries or more and are not constant
    (a row of zeros or a label would match by chance); up to 4 of ``value``'s.
    """
    if value.layout != torch.strided or column.layout != torch.strided or not value.numel():
        return False
    if value.device == column.device and (
        value.untyped_storage().data_ptr() == column.untyped_storage().data_ptr()
    ):
        return True
    value, column = value.detach().cpu(), column.detach().cpu()
    if value.shape == column.shape and torch.equal(value.to(column.dtype), column):
        return True
    row = column.shape[1:]
    if value.dim() != column.dim() or value.shape[1:] != row or row.numel() < 8:
        return False
    flat = column.reshape(len(column), -1)
    for item in value[:4].reshape(min(len(value), 4), -1).to(column.dtype):
        if bool((item == item[0]).all()) or not bool((flat == item).all(1).any()):
            return False
    return True


def _rank(score: float) -> float:
    """The selection key: the score, NaN below every number."""
    return -math.inf if math.isnan(score) else score


def _check_plain(value: Any, what: str) -> None:
    if isinstance(value, dict):
        for item in value.values():
            _check_plain(item, what)
    elif isinstance(value, list | tuple):
        for item in value:
            _check_plain(item, what)
    elif not (value is None or isinstance(value, bool | int | float | str | torch.Tensor)):
        raise ValueError(
            f"a checkpointed search stores {what} for a safe load (torch.load with "
            "weights_only=True): numbers, strings, None, lists, dicts and tensors; got "
            f"{value!r} of type {type(value).__name__}"
        )


# --------------------------------------------------------------------------- the result


NOT_COVERED = (
    "the trial list (SearchResult.trials): K, every trial's hyperparameters and score, and "
    "the best trial's index among them (a lower bound on K); releasing them costs "
    "SearchResult.all_trials_epsilon (K whole trials composed), not the search's epsilon",
    "how many trials ran, and where an interrupted search stopped: anything that reveals K "
    "(a log, the search's duration) voids the theorem's hiding of K",
    "a trial function that keeps state between calls, reads earlier results, or trains more "
    "than the one run it returns: the search checks the returned run only",
    "another search on the same data: its epsilon composes with this one's",
    "a score='public' metric: taken as computed on public data, unaccounted",
    "what each trial's own privacy report leaves out (diagnostics, side channels, the "
    "checkpoints' secrets); a search checkpoint holds K and the draws: keep it as private as "
    "the data",
)
"""What the search's guarantee does not cover, in the words its report prints."""


@dataclasses.dataclass(frozen=True)
class SearchReport:
    """The privacy of a search, as data (``dataclasses.asdict``) and text (``str``)."""

    epsilon: float
    delta: float
    target_epsilon: float | None
    accountant: str
    search: str
    trial_count: str
    released: str
    trial: str
    score: str
    interrupted_attempts: int
    retries: int
    seed: str
    not_covered: tuple[str, ...]

    def __str__(self) -> str:
        lines = [
            "Privacy report (accounted hyperparameter search)",
            f"  guarantee:       ({self.epsilon:.6g}, {self.delta:.6g})-DP for what is released"
            + (f" (target {self.target_epsilon:g})" if self.target_epsilon else ""),
            f"  search:          {self.search}",
            f"  trial count K:   {self.trial_count}",
            f"  released:        {self.released}",
            f"  each trial:      {self.trial}",
            f"  score:           {self.score}",
            f"  interrupted:     {self.interrupted_attempts} attempts; {self.retries} accounted "
            "in advance, each as a whole trial",
            f"  accountant:      {self.accountant}",
            f"  seed:            {self.seed}",
            "  not covered by the guarantee:",
            *(f"    - {item}" for item in self.not_covered),
        ]
        return "\n".join(lines)


class SearchResult:
    """A finished search: the best trial (released), the trial list (not), the epsilon.

    Attributes:
        best: the best trial as :class:`Best` (highest score; NaN lowest;
            ties: the earliest), without its index, or ``None`` when ``K = 0``
            (Poisson): then nothing is released but that no trial ran.
        result: the best trial's ``Outcome.result`` (``None`` when ``K = 0``).
        trials: every :class:`Trial`, in order. NOT covered by the search's
            epsilon: their number is ``K``; releasing them costs
            :meth:`all_trials_epsilon`.
        dp_event, delta, trial_config: the search's event, default delta, and
            the config each trial was given (before its space's clip settings).
    """

    def __init__(self, tuning: RandomSearch):
        state = tuning._state
        self._search = tuning
        self.trials = tuple(
            Trial(i, dict(h), float(s), int(t), int(a))
            for i, (h, s, t, a) in enumerate(
                zip(state["hyperparameters"], state["scores"], state["steps"], state["attempts"])
            )
        )
        best = state["best"]
        if best is None:
            self.best = None
        else:
            chosen = self.trials[best["index"]]
            self.best = Best(chosen.hyperparameters, chosen.score, chosen.steps)
        self.result = None if best is None else best["result"]
        self.dp_event = tuning.dp_event
        self.delta = tuning.delta
        self.trial_config = tuning.trial_config

    def epsilon(self, delta: float | None = None) -> float:
        """The search's epsilon at ``delta``: dp_accounting's RDP on :attr:`dp_event`."""
        return self._search.epsilon(delta)

    def all_trials_epsilon(self, delta: float | None = None) -> float:
        """What releasing every trial (and so ``K``) would cost: all attempts' events composed.

        A function of ``K``: keep it as private as the trial list (it is not in the report).
        """
        delta = self.delta if delta is None else delta
        check_number("delta", delta, low=0, high=1, low_open=True, high_open=True)
        attempts = sum(t.attempts for t in self.trials)
        if attempts == 0:
            return 0.0
        return _rdp_epsilon(dp_event.SelfComposedDpEvent(self._search.trial_event, attempts), delta)

    def privacy_report(self, delta: float | None = None) -> SearchReport:
        """The search's :class:`SearchReport` at ``delta`` (default: the config's)."""
        tuning = self._search
        delta = self.delta if delta is None else delta
        config = tuning.trial_config
        trial = (
            f"DP-SGD, accounted noise multiplier {tuning._event.noise_multiplier:.6g}, sample "
            f"rate {tuning._rate:.6g}, at most {tuning._steps} steps on {tuning.num_examples} "
            f"examples, clip norm {config.clip_norm:g} unless the space sets it"
        )
        score = (
            "public (computed by the trial on data taken to be public; not accounted)"
            if tuning.score == "public"
            else f"private: the sum of each validation example's value in [0, 1] plus "
            f"N(0, {tuning.score_noise_multiplier:g}**2), over the validation size; accounted "
            "in each trial as a Gaussian of sensitivity 1"
        )
        seed = (
            "a secret from the OS CSPRNG draws K, the hyperparameters and the score noise; each "
            "trial's run draws its own"
            if tuning.seed_is_secret
            else "FIXED (research mode): whoever knows it knows K, every draw and the score "
            "noise, so the guarantee does NOT hold against them"
        )
        return SearchReport(
            epsilon=self.epsilon(delta),
            delta=float(delta),
            target_epsilon=tuning.target_epsilon,
            accountant="RDP (dp_accounting's RdpAccountant, default orders) on dp_event",
            search="random search, repeat and select the best (Papernot and Steinke 2022)",
            trial_count=_distribution(tuning.mean_trials, tuning.shape),
            released="the best trial only: its hyperparameters, score, steps and result "
            "(not its index)"
            if self.best is not None
            else "nothing: K = 0, no trial ran",
            trial=trial,
            score=score,
            interrupted_attempts=tuning._abandoned(),
            retries=tuning.retries,
            seed=seed,
            not_covered=NOT_COVERED,
        )

    def __repr__(self) -> str:  # the trial list is not shown: its length is K
        best = None if self.best is None else self.best.score
        epsilon = self.epsilon()
        return f"SearchResult(best_score={best!r}, epsilon={epsilon:.4g}, delta={self.delta:g})"


def search(
    trial_fn: Callable[[Mapping[str, Any], DPConfig, int | None], Outcome],
    space: Mapping[str, Any],
    config: DPConfig,
    num_examples: int,
    *,
    mean_trials: float,
    shape: float = math.inf,
    score: str = "private",
    score_noise_multiplier: float | None = None,
    validation_size: int | None = None,
    seed: int | None = None,
    checkpoint_path: str | os.PathLike | None = None,
    retries: int = 0,
) -> SearchResult:
    """``RandomSearch(space, config, num_examples, ...).run(trial_fn)``, its path let go after.

    Args: as :class:`RandomSearch`, and ``trial_fn`` as :meth:`RandomSearch.run`.

    Privacy: the result's :attr:`SearchResult.best` and ``result`` are
    ``(result.epsilon(delta), delta)``-DP; see :class:`RandomSearch`.
    """
    tuning = RandomSearch(
        space, config, num_examples, mean_trials=mean_trials, shape=shape, score=score,
        score_noise_multiplier=score_noise_multiplier, validation_size=validation_size, seed=seed,
        checkpoint_path=checkpoint_path, retries=retries,
    )  # fmt: skip
    try:
        return tuning.run(trial_fn)
    finally:
        tuning.close()
