"""The training loop: Poisson batches, the private step, accounting, checkpoints.

``Trainer`` runs DP-SGD end to end: each logical step draws a Poisson sample
of the dataset, runs it through the step as fixed-shape micro-batches, adds
the noise once, and records the step with the accountant, empty batches
included. It can calibrate the noise to a target epsilon before training,
stop before a step would exceed an epsilon budget, evaluate after each
epoch, and checkpoint so that a resumed run ends bit-identical to an
uninterrupted one (the sample and the noise of step t depend only on the
seed and t).

The seed is a secret. By default (``seed=None``) each Trainer draws a fresh
256-bit one from the operating system's CSPRNG (:func:`dpfunc.secret_seed`);
it lives in memory and in checkpoints only. Whoever knows the seed can
regenerate every noise draw, subtract it from the released parameters and
read the clipped gradient sums, whatever epsilon is printed; a fixed integer
seed is therefore for reproducible research only.

Distributed (data-parallel) training: launch the same script on every rank
with ``torchrun`` and call ``dpfunc.distributed.init()`` before building the
``Trainer``; it detects the process group (``distributed=None``) and then
gives each rank its share of every logical batch, all-reduces the clipped
sums, adds the shared noise once (see :mod:`dpfunc.distributed`), shows the
progress bar and writes checkpoints on rank 0 only.
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import optree
import torch
from torch import nn
from tqdm.auto import tqdm

from . import distributed as _distributed
from . import optim
from .accounting import Accountant, calibrate_noise_multiplier, combined_noise_multiplier
from .checks import check_choice, check_int, check_number, check_params
from .clipping import ACCUMULATED_SUMS
from .data import PoissonBatches, as_dataset, dataset_fingerprint, dataset_size
from .noise import check_seed, secret_seed, standard_normal_like
from .per_sample import LossFn
from .step import ExampleStats, TrainState, make_train_step, summarize
from .tree import Params

CHECKPOINT_VERSION = 2  # 2: the secret seed and the noise kind
NONFINITE = ("warn", "error")


class Trainer:
    """Private training of ``params`` on ``dataset`` with DP-SGD.

    Args:
        loss_fn: ``loss_fn(params, example) -> scalar`` for ONE example.
        params: the initial trainable parameters (``functionalize(model)[0]``).
        dataset: tensors or numpy arrays of rows, a tuple or list of them
            read as columns, a map-style ``Dataset`` (transforms applied per
            example), a ``DataLoader`` (its dataset; Poisson sampling replaces
            its sampler), or a Hugging Face ``datasets.Dataset``; see
            :func:`dpfunc.data.as_dataset`.
        optimizer: a :mod:`dpfunc.optim` transformation.
        epochs: planned passes over the data; ``steps = epochs * steps_per_epoch``
            with ``steps_per_epoch = round(num_examples / expected_batch_size)``.
        expected_batch_size: ``sample_rate * num_examples``; each example is
            sampled independently with ``sample_rate = expected_batch_size / n``.
        clip_norm: the per-example bound ``C``.
        noise_multiplier: ``sigma``; or give ``target_epsilon`` instead, and
            the smallest sigma whose epsilon after all planned steps is at
            most the target is found before training.
        delta: the delta of the reported epsilon. Default: the largest power
            of ten below ``1 / num_examples``; a delta of ``1 / n`` or more
            allows releasing a whole example and gets a warning.
        physical_batch_size: rows per micro-batch (the compiled shape).
            Default: the expected batch size plus three standard deviations
            of the Poisson batch size, so most batches fit in one.
        clipping: ``"flat"``, ``"per_layer"`` or ``"normalized"``.
        target_quantile: ``None`` (fixed clipping) or a quantile in (0, 1):
            adaptive clipping (Andrew et al. 2021; flat clipping only), the
            clip norm starting at ``clip_norm`` and following that quantile
            of the per-example norms (see :func:`dpfunc.make_train_step`).
            ``trainer.clip_norm`` is the current norm; history records carry it.
        quantile_learning_rate: the geometric update's step size.
        count_noise_multiplier: the standard deviation of the noise on the
            count of unclipped examples (sensitivity 1). Default
            ``expected_batch_size / 20``. Each step then releases the sum and
            the count, accounted together as one Gaussian mechanism with
            :func:`dpfunc.accounting.combined_noise_multiplier`; with
            ``target_epsilon``, the calibration solves for that combined
            multiplier and gives the gradient noise what the count leaves.
        bands: ``1`` (default): DP-SGD, independent noise at every step and
            Poisson sampling from the whole data set. ``b > 1``: correlated
            noise with the banded square root factorization of ``b`` bands
            (:mod:`dpfunc.matrix_factorization`) and cyclic Poisson sampling:
            the data is split once, secretly, into ``b`` partitions and step
            ``t`` samples from partition ``t mod b`` at rate
            ``expected_batch_size * b / num_examples`` (so
            ``expected_batch_size`` can be at most ``num_examples / b``).
            Each example then takes part in at most ``ceil(steps / b)``
            steps, and the run is accounted as DP-SGD with that many steps
            at that rate (Choquette-Choo et al. 2023, Theorem 4; see
            :mod:`dpfunc.accounting`). Costs ``b - 1`` extra copies of the
            parameters. Not with ``target_quantile``.
        accounting: ``"pld"`` (default, tight) or ``"rdp"``.
        epsilon_budget: stop before a step would make epsilon exceed this.
        eval_fn: ``eval_fn(params) -> dict[str, float]`` called after each
            epoch; its results go into the history.
        seed: the secret that keys the Poisson samples and the noise.
            ``None`` (default) draws a fresh one from the OS CSPRNG
            (distributed: rank 0 draws it and broadcasts it), so no two runs
            share it and nobody can regenerate the noise. An int makes the run
            reproducible, and **whoever knows it can remove the noise**: give
            one for research on public data or debugging only, never a small
            or published number on private data. A Trainer built with
            ``seed=None`` adopts the seed of a checkpoint it loads if that
            seed was itself a drawn secret, and refuses a fixed one.
        secure_noise: draw the noise from a cryptographically secure
            generator with the floating-point defences of
            ``standard_normal_like(..., secure=True)`` (needs the ``secure``
            extra). The default draw comes from torch's generator, which is
            fast but not cryptographically secure.
        compile: run the step through ``torch.compile(fullgraph=True)``.
        checkpoint_path: where :meth:`fit` saves after every epoch (and
            every ``checkpoint_every`` steps if given). Its directory must
            exist. If the file exists, the Trainer resumes from it when it is
            built (with a warning that says so), so rerunning an interrupted
            script continues the run instead of overwriting it; a checkpoint
            of other privacy settings is refused (:meth:`load`).
        progress: show a tqdm bar with loss, epsilon and examples/s.
        chunk_size: passed to :func:`~dpfunc.per_sample_grads`.
        model: the ``nn.Module`` that ``loss_fn`` calls; enables ghost
            clipping (``make_train_step(model=...)``). The result is the
            same either way.
        method: ``"auto"`` (ghost clipping where it is cheaper, timed once
            per batch shape when eager), ``"ghost"`` or ``"vmap"``, as for
            :func:`~dpfunc.make_train_step`; ``trainer.step_fn.explain(
            trainer.params, batch)`` shows the plan.
        distributed: data-parallel training over the default
            ``torch.distributed`` process group (``dpfunc.distributed.init()``
            under ``torchrun``). ``None`` (default) turns it on exactly when a
            process group is initialised; ``True`` requires one; ``False``
            trains on this process alone even if one exists. Rank and world
            size come from the process group. Every rank builds the Trainer
            with the same arguments and dataset (checked: the settings must
            agree) and calls the same methods: ``fit``, ``train_step``,
            ``save`` and ``load`` are collective. Each logical batch is split
            across ranks (``physical_batch_size`` is then per rank, and its
            default uses the per-rank expected share), the noise is added once
            to the all-reduced sum, and every rank holds bit-identical
            parameters, rank 0's initial ones. Only rank 0 shows the progress
            bar and writes checkpoints; ``eval_fn`` and the accountant run on
            every rank, so every rank has the same history. A rank that dies
            or hangs makes the others raise
            :class:`dpfunc.distributed.CollectiveError` after the process
            group's timeout (``dpfunc.distributed.init(timeout_s=...)``).
        nonfinite: what to do about examples whose gradient norm is NaN or
            inf (NaN data, an overflowing loss). They are always left out of
            the clipped sum, which keeps the guarantee: leaving out an example
            is what clipping its gradient to norm 0 gives. ``"warn"``
            (default) warns the first time, with the count and likely causes,
            and counts them in the history; a step whose examples are all
            non-finite raises :class:`FloatingPointError` (training on would
            move the parameters by noise alone). ``"error"`` raises at the
            first such example. The count reads the data without noise: a
            diagnostic, not a private statistic.

    Raises:
        ValueError, TypeError: an argument is invalid; every argument is
            checked here, before any training.
    """

    def __init__(
        self,
        loss_fn: LossFn,
        params: Params,
        dataset: Any,
        *,
        optimizer: optim.GradientTransformation,
        epochs: float,
        expected_batch_size: float,
        clip_norm: float,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        delta: float | None = None,
        physical_batch_size: int | None = None,
        clipping: str = "flat",
        target_quantile: float | None = None,
        quantile_learning_rate: float = 0.2,
        count_noise_multiplier: float | None = None,
        bands: int = 1,
        accounting: str = "pld",
        epsilon_budget: float | None = None,
        eval_fn: Callable[[Params], dict[str, float]] | None = None,
        seed: int | None = None,
        secure_noise: bool = False,
        compile: bool = False,
        checkpoint_path: str | os.PathLike | None = None,
        checkpoint_every: int | None = None,
        progress: bool = True,
        chunk_size: int | None = None,
        model: nn.Module | None = None,
        method: str = "auto",
        distributed: bool | None = None,
        nonfinite: str = "warn",
    ):
        dataset = as_dataset(dataset)  # numpy, lists, DataLoaders, ...: read once, here
        n = dataset_size(dataset)
        if n < 1:
            raise ValueError("dataset is empty: DP-SGD needs at least one example, got 0")
        check_params(params)
        check_number("clip_norm", clip_norm, low=0, low_open=True, note="(inf disables clipping)")
        if math.isinf(clip_norm) and (target_epsilon is not None or noise_multiplier != 0):
            raise ValueError(
                "clip_norm=inf leaves each example's influence unbounded, so no noise makes the "
                "run private; give a finite clip_norm (or noise_multiplier=0 for a non-private "
                "baseline)"
            )
        if target_epsilon is not None:
            check_number("target_epsilon", target_epsilon, low=0, low_open=True, high_open=True)
        if eval_fn is not None and not callable(eval_fn):
            raise TypeError(
                "eval_fn must be a callable eval_fn(params) -> dict[str, float] or None, got "
                f"eval_fn={eval_fn!r}"
            )
        check_choice("nonfinite", nonfinite, NONFINITE)
        if checkpoint_path is not None:
            _check_checkpoint_path(checkpoint_path)
        if distributed is None:
            distributed = _distributed.is_initialized()
        elif distributed and not _distributed.is_initialized():
            raise ValueError(
                "distributed=True needs an initialised torch.distributed process group; call "
                "dpfunc.distributed.init() first (launch with torchrun)"
            )
        self.distributed = bool(distributed)
        self.rank, self.world_size = (
            _distributed.rank_and_world_size() if self.distributed else (0, 1)
        )
        check_number("epochs", epochs, low=0, low_open=True, high_open=True)
        check_number(
            "expected_batch_size", expected_batch_size, low=0, high=n, low_open=True,
            note="(at most the dataset size)",
        )  # fmt: skip
        check_int("bands", bands, minimum=1)
        if bands > 1 and target_quantile is not None:
            raise ValueError(
                "adaptive clipping (target_quantile) is not combined with correlated noise "
                f"(bands > 1); got target_quantile={target_quantile!r}, bands={bands!r}"
            )
        if expected_batch_size * bands > n:
            raise ValueError(
                f"with bands={bands} each step samples from one of {bands} partitions of about "
                f"{n / bands:.6g} examples, so expected_batch_size must be at most "
                f"num_examples / bands = {n / bands:.6g}, got "
                f"expected_batch_size={expected_batch_size!r}"
            )
        if (noise_multiplier is None) == (target_epsilon is None):
            raise ValueError(
                "give exactly one of noise_multiplier and target_epsilon, got "
                f"noise_multiplier={noise_multiplier!r}, target_epsilon={target_epsilon!r}"
            )
        if delta is None:
            delta = 10.0 ** -(math.floor(math.log10(n)) + 1)
        elif check_number("delta", delta, low=0, high=1, low_open=True, high_open=True) >= 1 / n:
            warnings.warn(
                f"delta={delta!r} is not below 1/num_examples={1 / n:.3g}: a mechanism that "
                "publishes one whole random example meets it. Use delta < 1/n.",
                stacklevel=2,
            )
        if physical_batch_size is None:
            share = expected_batch_size / self.world_size  # each rank's expected share
            physical_batch_size = math.ceil(share + 3 * math.sqrt(share))
        check_int("physical_batch_size", physical_batch_size, minimum=1)
        if math.ceil(n / physical_batch_size) + self.world_size > ACCUMULATED_SUMS:
            raise ValueError(  # the clip margin covers this many float64 additions
                f"physical_batch_size={physical_batch_size!r} could split a logical batch of "
                f"{n} examples into more than {ACCUMULATED_SUMS} micro-batches, beyond what "
                "the rounding bound of the clipped sum covers; raise physical_batch_size"
            )
        if epsilon_budget is not None:
            check_number("epsilon_budget", epsilon_budget, low=0, low_open=True)
        if checkpoint_every is not None:
            check_int("checkpoint_every", checkpoint_every, minimum=1)
        if checkpoint_every is not None and checkpoint_path is None:
            raise ValueError("checkpoint_every needs checkpoint_path")
        if seed is not None:
            check_seed(seed)
        if not isinstance(secure_noise, bool):
            raise ValueError(f"secure_noise must be a bool, got secure_noise={secure_noise!r}")

        self.num_examples = n
        self.expected_batch_size = float(expected_batch_size)
        self.bands = bands
        self.sample_rate = expected_batch_size * bands / n  # within a partition if bands > 1
        self.steps_per_epoch = max(1, round(n / expected_batch_size))
        self.total_steps = max(1, round(epochs * self.steps_per_epoch))
        self.delta = delta
        if target_quantile is not None and count_noise_multiplier is None:
            count_noise_multiplier = expected_batch_size / 20  # Andrew et al. 2021's suggestion
        if target_quantile is not None:
            check_number("count_noise_multiplier", count_noise_multiplier, low=0, low_open=True,
                         high_open=True)  # fmt: skip
        if target_epsilon is not None:
            accounted = calibrate_noise_multiplier(
                target_epsilon,
                delta,
                self.sample_rate,
                self.total_steps,
                method=accounting,
                bands=bands,
            )
            noise_multiplier = accounted
            if target_quantile is not None:  # the count takes its share of the budget
                if not count_noise_multiplier > accounted:
                    raise ValueError(
                        f"target_epsilon={target_epsilon!r} needs a combined noise multiplier "
                        f"of {accounted:.4g}, which count_noise_multiplier="
                        f"{count_noise_multiplier!r} alone does not leave room for; raise it"
                    )
                noise_multiplier = (accounted**-2 - count_noise_multiplier**-2) ** -0.5
        self.noise_multiplier = float(noise_multiplier)
        self.accounted_noise_multiplier = (
            self.noise_multiplier
            if target_quantile is None
            else combined_noise_multiplier(self.noise_multiplier, count_noise_multiplier)
        )
        self._adopts_seed = seed is None  # may take a loaded checkpoint's secret seed
        self._seed_secret = seed is None  # drawn from the OS CSPRNG, here or by a loaded run
        if seed is None:
            seed = _distributed.shared_secret_seed() if self.distributed else secret_seed()
        self.secure_noise = secure_noise
        if secure_noise:  # without cryptography, fail here rather than at the first step
            standard_normal_like({}, seed=seed, step=0, secure=True)
        self.epsilon_budget = epsilon_budget
        self.eval_fn = eval_fn
        self.progress = progress
        self.checkpoint_path = checkpoint_path
        self.checkpoint_every = checkpoint_every
        self.nonfinite = nonfinite
        self._warned_nonfinite = False

        if self.distributed:
            _distributed.check_same_across_ranks(
                {
                    "num_examples": n,
                    "sample_rate": self.sample_rate,
                    "noise_multiplier": self.noise_multiplier,
                    "clip_norm": clip_norm,
                    "clipping": clipping,
                    "adaptive": (target_quantile, quantile_learning_rate, count_noise_multiplier),
                    "bands": bands,
                    "seed": seed,
                    "secure_noise": secure_noise,
                    "expected_batch_size": expected_batch_size,
                    "physical_batch_size": physical_batch_size,
                    "total_steps": self.total_steps,
                    "epsilon_budget": epsilon_budget,
                    "delta": delta,
                    "accounting": accounting,
                    "dataset": dataset_fingerprint(dataset),
                },
                "Trainer settings",
                secret=("seed",),
            )
        make_step = _distributed.make_train_step if self.distributed else make_train_step
        self.step_fn = make_step(
            loss_fn,
            optimizer,
            clip_norm=clip_norm,
            noise_multiplier=self.noise_multiplier,
            expected_batch_size=expected_batch_size,
            clipping=clipping,
            chunk_size=chunk_size,
            model=model,
            method=method,
            target_quantile=target_quantile,
            quantile_learning_rate=quantile_learning_rate,
            count_noise_multiplier=count_noise_multiplier,
            bands=bands,
        )
        self._accumulate = self.step_fn.accumulate
        # distributed: the all-reduce runs eagerly between the compiled pieces
        self._apply = self.step_fn.apply_reduced if self.distributed else self.step_fn.apply
        if compile:
            self._accumulate = torch.compile(self._accumulate, fullgraph=True)
            self._apply = torch.compile(self._apply, fullgraph=True)
        self.batches = PoissonBatches(
            dataset,
            self.sample_rate,
            physical_batch_size,
            seed=seed,
            rank=self.rank,
            world_size=self.world_size,
            bands=bands,
        )
        self.state: TrainState = self.step_fn.init(params)  # distributed: rank 0's params
        self.accountant = Accountant(method=accounting, bands=bands)
        self.history: list[dict[str, float]] = []
        self._budget_steps: int | None = None  # see _last_step_within_budget
        self._noise_ahead: tuple[tuple[int, int, bool], Future] | None = None  # see _noise
        if epsilon_budget is not None:
            one_step = self._epsilon_after(1)
            if one_step > epsilon_budget:
                raise ValueError(
                    f"epsilon_budget={epsilon_budget!r} at delta={delta!r} does not allow a single "
                    f"step: one step already spends epsilon={one_step:.4g}; raise the budget or "
                    "the noise"
                )
        if self.noise_multiplier > expected_batch_size:
            warnings.warn(
                f"noise_multiplier={self.noise_multiplier:.6g} exceeds expected_batch_size="
                f"{expected_batch_size!r}: the noise on every coordinate of the averaged update "
                "is larger than a whole clipped gradient, so training will hardly move. Raise "
                "target_epsilon or expected_batch_size, or train fewer epochs.",
                stacklevel=2,
            )
        resume = checkpoint_path is not None and os.path.exists(checkpoint_path)
        if self.distributed and checkpoint_path is not None:  # load is collective
            _distributed.check_same_across_ranks(
                {"exists": resume}, f"whether checkpoint_path={os.fspath(checkpoint_path)!r} exists"
            )
        if resume:
            # A rerun of the same command continues the run: overwriting the checkpoint
            # would lose its steps, and its accounting with them.
            self.load(checkpoint_path)
            warnings.warn(
                f"resumed from the existing checkpoint_path={os.fspath(checkpoint_path)!r} at "
                f"step {self.steps_done} of {self.total_steps}; to start a new run, give another "
                "path or delete that file",
                stacklevel=2,
            )

    @property
    def params(self) -> Params:
        return self.state.params

    @property
    def seed(self) -> int:
        """The secret that keys the samples, the partitions and the noise (never print it)."""
        return self.batches.seed

    @property
    def clip_norm(self) -> float:
        """The clip norm of the next step (it moves with adaptive clipping)."""
        return float(self.state.clip_norm)

    @property
    def steps_done(self) -> int:
        return self.accountant.steps

    def epsilon(self) -> float:
        """Epsilon spent so far at ``self.delta`` (the accountant's value)."""
        return self.accountant.epsilon(self.delta)

    def train_step(self) -> dict[str, float]:
        """One logical DP-SGD step; returns its (non-private) metrics as floats.

        Raises:
            RuntimeError: the planned ``total_steps`` are done, or one more
                step would take epsilon past ``epsilon_budget`` (a calibrated
                ``target_epsilon`` holds for the planned steps only).
        """
        t = self.steps_done
        if t >= self._last_step_within_budget():
            limit = (
                f"epsilon_budget={self.epsilon_budget!r} at delta={self.delta!r}"
                if t < self.total_steps
                else f"the planned total_steps={self.total_steps}"
            )
            raise RuntimeError(f"step {t + 1} would exceed {limit}; training is over")
        if int(self.state.step) != t:
            raise RuntimeError(
                f"the optimizer has taken {int(self.state.step)} steps but the accountant "
                f"counted {t}; the trainer's state is inconsistent (load a checkpoint)"
            )
        micro_batches, _ = self.batches.logical_batch(t)
        summed, stats = self.step_fn.zeros(self.state.params), []
        adaptive = self.step_fn.adaptive
        clip_norm = self.state.clip_norm if adaptive else None
        for batch, mask in micro_batches:
            summed, s = self._accumulate(summed, self.state.params, batch, mask, clip_norm)
            stats.append(s)
        stats = ExampleStats.cat(stats)
        if self.distributed:  # this rank's share -> the whole logical batch
            summed = self.step_fn.all_reduce(summed, step=t)
            stats = self.step_fn.gather_stats(stats, step=t)
        metrics = {k: float(v) for k, v in summarize(stats).items()}
        self._check_nonfinite(t, metrics)  # before anything is released
        noise = self._noise(t)  # the same on every rank, added once to the global sum
        count = count_noise = None
        if adaptive:  # the whole logical batch's count, noised once from its own stream
            count = self.step_fn.unclipped_count(self.state, stats)
            zero = {"count": torch.zeros((), dtype=torch.float64)}
            count_noise = standard_normal_like(
                zero, seed=self.seed, step=t, secure=self.secure_noise, stream="count"
            )["count"]
        # accounted before the release: an interruption can only over-count
        self.accountant.step(self.accounted_noise_multiplier, self.sample_rate)
        self.state = self._apply(self.state, summed, noise, count, count_noise)
        return metrics

    def _check_nonfinite(self, t: int, metrics: dict[str, float]) -> None:
        """Makes examples with a NaN/inf loss or gradient visible (see ``nonfinite``)."""
        bad, real = int(metrics["nonfinite"]), int(metrics["batch_size"])
        if not bad:
            return
        what = (
            f"step {t + 1}: {bad} of its {real} examples have a non-finite (NaN or inf) "
            "gradient norm; they are left out of the sum (which keeps the privacy guarantee). "
            "Likely causes: NaN or inf in the data, a loss that overflows (log of 0, a "
            "learning rate too large for the model), or reduced precision out of range"
        )
        if self.nonfinite == "error":
            raise FloatingPointError(what + " (nonfinite='error').")
        if bad == real:
            raise FloatingPointError(
                what + ": every example of the step; training on would move the parameters by "
                "the noise alone."
            )
        if not self._warned_nonfinite:
            self._warned_nonfinite = True
            warnings.warn(
                what + ". Later steps count them in the history's 'nonfinite'; this warning is "
                "shown once; nonfinite='error' raises instead.",
                RuntimeWarning,
                stacklevel=3,
            )

    def _noise(self, t: int) -> Params:
        """Step ``t``'s standard-normal tree; step ``t + 1``'s starts drawing meanwhile.

        The draw depends only on ``(seed, step)`` and the parameters' shapes,
        never on the data, so drawing it ahead on a worker thread, while
        this step computes, changes no bit of the result.
        """
        key = (self.seed, t, self.secure_noise)
        ahead, self._noise_ahead = self._noise_ahead, None
        if ahead is not None and ahead[0] == key:
            noise = ahead[1].result()
        else:
            noise = _draw_noise(self.state.params, *key)
        if t + 1 < self._last_step_within_budget():
            following = (self.seed, t + 1, self.secure_noise)
            future = _NOISE_WORKER.submit(_draw_noise, self.state.params, *following)
            self._noise_ahead = (following, future)
        return noise

    def fit(self, max_steps: int | None = None) -> list[dict[str, float]]:
        """Trains until the planned steps are done or the budget would be exceeded.

        Args:
            max_steps: stop after at most this many more steps (e.g. to
                checkpoint and resume later); ``None`` runs to the end.

        Returns the history: one dict per epoch with ``epoch``, ``steps``,
        ``loss`` (mean over the examples since the last record; not
        private), ``nonfinite`` (the examples with a NaN/inf gradient since
        the last record, left out of the sums; not private), ``epsilon``,
        ``clip_norm`` and whatever ``eval_fn`` returned; and one more
        for the last step when ``fit`` stops between epochs (budget or
        ``max_steps``), so the last record always holds the epsilon of the
        parameters returned. The progress bar shows the epsilon as of the last
        record (each evaluation of the PLD accountant takes about a second).
        """
        stop_at = self._last_step_within_budget()
        if max_steps is not None:
            check_int("max_steps", max_steps)
            stop_at = min(stop_at, self.steps_done + max_steps)
        bar = tqdm(
            total=stop_at,
            initial=self.steps_done,
            disable=not self.progress or self.rank != 0,
            unit="step",
        )
        loss_sum = examples = seen = nonfinite = 0.0
        started = time.perf_counter()
        epsilon = self.history[-1]["epsilon"] if self.history else 0.0
        while self.steps_done < stop_at:
            metrics = self.train_step()
            loss_sum += metrics["loss"] * metrics["batch_size"]
            examples += metrics["batch_size"]
            seen += metrics["batch_size"]
            nonfinite += metrics["nonfinite"]
            done = self.steps_done
            if done % self.steps_per_epoch == 0 or done == stop_at:
                epsilon = self._record(loss_sum / max(examples, 1.0), int(nonfinite))
                loss_sum = examples = nonfinite = 0.0
            elif self.checkpoint_every and done % self.checkpoint_every == 0:
                self.save(self.checkpoint_path)
            bar.update(1)
            bar.set_postfix(
                loss=f"{metrics['loss']:.4f}",
                eps=f"{epsilon:.3g}",
                ex_s=f"{seen / max(time.perf_counter() - started, 1e-9):.0f}",
            )
        bar.close()
        return self.history

    def _record(self, loss: float, nonfinite: int) -> float:
        """Appends the history record of the current step (and checkpoints); its epsilon."""
        done = self.steps_done
        record = {
            "epoch": done / self.steps_per_epoch,
            "steps": done,
            "loss": loss,
            "nonfinite": nonfinite,
            "epsilon": self.epsilon(),
            "clip_norm": self.clip_norm,
        }
        if self.eval_fn is not None:
            results = self.eval_fn(self.state.params)
            if not isinstance(results, Mapping):
                raise TypeError(
                    "eval_fn must return a dict of numbers, e.g. {'accuracy': 0.9}, got "
                    f"{results!r}"
                )
            for key, value in results.items():
                try:
                    record[key] = float(value)
                except (TypeError, ValueError) as error:
                    raise TypeError(
                        f"eval_fn must return a dict of numbers, got {key}={value!r}"
                    ) from error
        self.history.append(record)
        if self.checkpoint_path is not None:
            self.save(self.checkpoint_path)
        return record["epsilon"]

    def _last_step_within_budget(self) -> int:
        """The largest step count <= total_steps whose epsilon fits the budget.

        Computed once: the history is always ``steps`` equal steps of this
        run's (noise_multiplier, sample_rate), so the answer does not change.
        """
        if self.epsilon_budget is None:
            return self.total_steps
        if self._budget_steps is None:
            self._budget_steps = self._search_budget()
        return self._budget_steps

    def _epsilon_after(self, steps: int) -> float:
        """The epsilon of this run's first ``steps`` steps, at ``self.delta``."""
        trial = Accountant(method=self.accountant.method, bands=self.bands)
        trial.step(self.accounted_noise_multiplier, self.sample_rate, steps)
        return trial.epsilon(self.delta)

    def _search_budget(self) -> int:
        low, high = 0, self.total_steps  # epsilon grows with steps

        def within(steps: int) -> bool:
            return steps == 0 or self._epsilon_after(steps) <= self.epsilon_budget

        if within(high):
            return high
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if within(middle) else (low, middle)
        return low

    # -- checkpoints ---------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        return {
            "num_examples": self.num_examples,
            "expected_batch_size": self.expected_batch_size,
            "sample_rate": self.sample_rate,
            "noise_multiplier": self.noise_multiplier,
            "clip_norm": self.step_fn.clip_norm,
            "clipping": self.step_fn.clipping,
            "target_quantile": self.step_fn.target_quantile,
            "quantile_learning_rate": self.step_fn.quantile_learning_rate,
            "count_noise_multiplier": self.step_fn.count_noise_multiplier,
            "bands": self.bands,
            "seed": self.seed,
            "secure_noise": self.secure_noise,
            "accounting": self.accountant.method,
            "delta": self.delta,
            "physical_batch_size": self.batches.physical_batch_size,
        }

    def save(self, path: str | os.PathLike) -> None:
        """Writes a checkpoint atomically: a temporary file, then a rename.

        It holds the parameters, the optimizer state, the accountant's
        history, the step count (which fixes the sampler and noise streams),
        the run's privacy settings and the history, and the secret seed, so
        that a resumed run stays bit-identical. **A checkpoint is as
        sensitive as the training data**: with the seed, anyone can remove
        the noise from every update it saw. Store it where the data is stored,
        never next to the released model.

        Distributed: collective, call it on every rank. Rank 0 writes (the
        ranks' states are identical); then all ranks wait until the file is
        complete, and all raise if rank 0 failed to write it.
        """
        if not self.distributed:
            self._write(path)
            return
        error = None
        if self.rank == 0:
            try:
                self._write(path)
            except Exception as caught:
                error = caught
        flags = _distributed.gather_flags(
            error is None,
            f"the barrier after rank 0 saved checkpoint {os.fspath(path)!r}",
            step=self.steps_done,
        )
        if error is not None:
            raise error
        if not flags[0]:
            raise RuntimeError(
                f"rank 0 failed to write checkpoint {os.fspath(path)!r}; see its log"
            )

    def _write(self, path: str | os.PathLike) -> None:
        path = os.fspath(path)
        checkpoint = {
            "version": CHECKPOINT_VERSION,
            "config": self._config(),
            "state": optree.tree_leaves(self.state),
            "accountant": self.accountant.state_dict(),
            "history": self.history,
            "seed_secret": self._seed_secret,
        }
        directory = os.path.dirname(os.path.abspath(path))
        handle, tmp = tempfile.mkstemp(dir=directory, prefix=".dpfunc-", suffix=".tmp")
        try:
            with os.fdopen(handle, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())  # on disk before the rename makes it the checkpoint
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise

    def load(self, path: str | os.PathLike) -> None:
        """Restores a checkpoint written by :meth:`save` of an identically set-up run.

        Distributed: collective, call it on every rank; every rank reads the
        same file (so ``path`` must be on storage all ranks see), and all
        ranks raise if any rank could not load it or the ranks read different
        files. A checkpoint may be resumed with another number of ranks: the
        logical batches and the noise do not depend on it (the sums then
        differ only in float rounding).

        Raises:
            ValueError: the file is unreadable or corrupted, or it was written
                by a run with other privacy settings, data size or parameter
                shapes; distributed, also when another rank failed to load it
                or read a different file. The trainer is left unchanged.
        """
        if not self.distributed:
            self._restore(self._read(path))
            return
        error = loaded = None
        try:
            loaded = self._read(path)
        except ValueError as caught:
            error = caught
        flags = _distributed.gather_flags(
            error is None, f"the check that every rank loaded checkpoint {os.fspath(path)!r}"
        )
        if error is not None:
            raise error
        if not all(flags):
            failed = [r for r, ok in enumerate(flags) if not ok]
            raise ValueError(
                f"checkpoint {os.fspath(path)!r} could not be loaded on ranks {failed} (see "
                "their logs); this rank is left unchanged"
            )
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        _distributed.check_same_across_ranks(
            {"steps": loaded[1].steps, "sha256": digest},
            f"checkpoint {os.fspath(path)!r} as read by each rank",
        )
        self._restore(loaded)

    def _restore(self, loaded: tuple[TrainState, Accountant, list, int]) -> None:
        self.state, self.accountant, self.history, seed = loaded
        if seed != self.seed:  # adopted (see _validate): a secret drawn by the saved run
            self.batches.seed, self._seed_secret = seed, True  # partitions derived again
        self._budget_steps = None

    def _read(self, path: str | os.PathLike) -> tuple[TrainState, Accountant, list, int]:
        """Reads and validates a checkpoint; changes nothing.

        Raises ValueError for every kind of bad file, so that in a distributed
        run every rank reaches the collective that compares the outcomes.
        """
        try:
            checkpoint = torch.load(path, weights_only=True, map_location="cpu")
        except Exception as error:  # torch raises many types for a bad file
            raise ValueError(f"checkpoint {os.fspath(path)!r} is unreadable: {error}") from error
        try:
            return self._validate(path, checkpoint)
        except ValueError:
            raise
        except Exception as error:  # missing keys, wrong types: a malformed checkpoint
            raise ValueError(
                f"checkpoint {os.fspath(path)!r} is malformed: {type(error).__name__}: {error}"
            ) from error

    def _validate(self, path, checkpoint: Any) -> tuple[TrainState, Accountant, list, int]:
        version = checkpoint.get("version") if isinstance(checkpoint, dict) else None
        if version == 1:
            raise ValueError(
                f"checkpoint {os.fspath(path)!r} was written by an earlier dpfunc (checkpoint "
                "version 1), whose Trainer keyed its noise and batches with a public default "
                "(seed=0, public) unless given another seed: whoever knows it can remove the "
                "noise of that run, and this version draws noise and batches differently, so it "
                "cannot be resumed bit-identically. Start a new run."
            )
        if version != CHECKPOINT_VERSION:
            raise ValueError(
                f"{os.fspath(path)!r} is not a dpfunc checkpoint (version {CHECKPOINT_VERSION})"
            )
        saved, ours = checkpoint["config"], self._config()
        seed, secret = saved["seed"], checkpoint["seed_secret"]
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"checkpoint {os.fspath(path)!r} holds no valid seed")
        if not isinstance(secret, bool):
            raise ValueError(f"checkpoint {os.fspath(path)!r} holds no valid seed_secret flag")
        if seed != self.seed and not self._adopts_seed:
            raise ValueError(  # neither seed is printed: both are secrets
                f"checkpoint {os.fspath(path)!r} was written with another seed than the one "
                "this trainer was given; build the trainer with seed=None to resume it"
            )
        if seed != self.seed and not secret:
            raise ValueError(
                f"checkpoint {os.fspath(path)!r} was written with a fixed seed, which is not a "
                "secret: a run resumed from it is not private, whoever knows the seed can remove "
                "its noise. To continue it as the reproducible run it is, build the trainer with "
                "that seed; for a private run, start anew with seed=None."
            )
        differences = [
            f"{key}={_saved_setting(saved, key, value)!r} (this trainer: {value!r})"
            for key, value in ours.items()
            if key != "seed" and _saved_setting(saved, key, value) != value
        ]
        if differences:
            raise ValueError(
                f"checkpoint {os.fspath(path)!r} belongs to a run with other settings, and its "
                "accounting holds only for its own; it was written with " + ", ".join(differences)
            )
        spec = optree.tree_structure(self.state)
        leaves, current = checkpoint["state"], optree.tree_leaves(self.state)
        if len(leaves) != len(current) or any(
            not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype
            for a, b in zip(leaves, current)
        ):
            raise ValueError(
                f"checkpoint {os.fspath(path)!r} holds a state whose tensors do not match "
                "this trainer's parameters and optimizer"
            )
        accountant = Accountant(method=self.accountant.method, bands=self.bands)
        accountant.load_state_dict(checkpoint["accountant"])
        leaves = [a.to(b.device) for a, b in zip(leaves, current)]  # each rank's own device
        state = optree.tree_unflatten(spec, leaves)
        if int(state.step) != accountant.steps:
            raise ValueError(
                f"checkpoint {os.fspath(path)!r} is inconsistent: {int(state.step)} optimizer "
                f"steps but {accountant.steps} accounted steps"
            )
        return state, accountant, list(checkpoint["history"]), seed


def _check_checkpoint_path(path: Any) -> None:
    """Fails now, not at the first save, if checkpoints cannot be written at ``path``."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(
            f"checkpoint_path must be a str or os.PathLike, got checkpoint_path={path!r}"
        )
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"checkpoint_path must name a file, got the directory {os.fspath(path)!r}")
    if not os.path.isdir(directory):
        raise ValueError(
            f"checkpoint_path={os.fspath(path)!r} is in a directory that does not exist; create "
            f"{directory!r} first"
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(
            f"checkpoint_path={os.fspath(path)!r} is in a directory this process cannot write"
        )


def _saved_setting(saved: dict[str, Any], key: str, ours: Any) -> Any:
    """A checkpoint's setting; those added later have the value the earlier runs had."""
    if key in saved:
        return saved[key]
    if key == "bands":  # before correlated noise: DP-SGD
        return 1
    if key == "expected_batch_size":  # implied by the sample rate, which is compared
        return ours
    return None


_NOISE_WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dpfunc-noise")


def _draw_noise(template: Params, seed: int, step: int, secure: bool) -> Params:
    return standard_normal_like(template, seed=seed, step=step, secure=secure)


__all__ = ["Trainer"]
