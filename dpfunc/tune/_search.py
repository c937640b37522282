"""The search: K and the draws fixed first, each trial checked, the best kept."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from .._checks import check_choice, check_int, check_number
from ..accounting import Accountant, participations
from ..checkpoint import _atomic_write, _lock, release_all
from ..config import DPConfig, sum_noise_multiplier
from ..noise import check_seed, secret_seed, standard_normal_like
from ._count import _calibrate, _check_count, _draw_count, _rdp_epsilon, _search_event, _trial_event
from ._release import Outcome, SearchResult, _check_result
from ._space import TRIAL_CONFIG_FIELDS, _check_space, _draw

SCORES = ("private", "public")
"""``"private"``: the search noises each trial's validation sum; ``"public"``: taken as given."""

_CHECKPOINT_FORMAT = "dpfunc.tune/1"


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
        validation_size: ``score="private"`` (required there): the public size
            the noisy sum is divided by (the score is ``(sum + noise) /
            validation_size``), a post-processing of the Gaussian sum of
            sensitivity 1 when validation examples are added or removed. The
            number of values a trial returns is not used: under add-or-remove
            it is a count of the private data, and dividing by it would move
            the released score beyond the accounted Gaussian.
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
    >>> tuning = dpfunc.tune.RandomSearch({"lr": dpfunc.tune.Choice([0.1, 1.0])}, config, 500,
    ...                                   mean_trials=3, score="public")
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
        elif score == "private":
            raise ValueError(
                "score='private' divides each trial's noisy validation sum by a public "
                "constant: give validation_size=, the size of the validation set as you would "
                "publish it (e.g. len(validation_set)), got validation_size=None. Dividing by "
                "the number of values a trial returns would make the released score depend on "
                "one validation example's presence beyond the accounted noise"
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
        if config.privacy_unit != "example":
            raise ValueError(
                "a search over user-level runs is not supported: its private score would "
                "have to bound each user's validation examples together, and its event to "
                "count users; search with privacy_unit='example', or run the user-level "
                f"training with fixed settings, got privacy_unit={config.privacy_unit!r}"
            )
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
        _check_result(outcome.result, outcome.run, index,
                      outcome.metric if self.score == "private" else None)  # fmt: skip
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
        declared = self.validation_size
        if not declared / 2 <= values.numel() <= 2 * declared:  # far off: not one per example
            raise ValueError(
                f"trial {index}: Outcome.metric holds {values.numel()} values, but "
                f"validation_size={declared} was declared: the metric is one value in [0, 1] "
                "per validation example (a summary such as [correct, total], or one batch's "
                "values, would be read as that many examples, and the score would be noise)"
            )
        self._state["validation_size"] = values.numel()
        total = torch.nan_to_num(values, nan=0.0).clamp(0.0, 1.0).sum().item()  # sensitivity 1
        noisy = total + self.score_noise_multiplier * self._score_noise(index, attempt)
        return noisy / self.validation_size

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
