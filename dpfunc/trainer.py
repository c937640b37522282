"""The training loop: Poisson batches, the private step, accounting, callbacks.

``Trainer`` runs DP-SGD end to end. Each logical step draws a Poisson sample,
runs the step's one logical step (:meth:`dpfunc.TrainStep.logical_step`:
micro-batches, the collectives when distributed, the noise added once) and
records it with the accountant before its release, empty batches included.
The privacy settings are a :class:`dpfunc.DPConfig`; progress, evaluation
and checkpoints are callbacks (:mod:`dpfunc.callbacks`,
:mod:`dpfunc.checkpoint`); a resumed run continues the accounting, with
fresh samples and noise when its seed is secret (the fork rule) and bit for
bit when it is fixed (the sample and noise of step t then depend only on the
seed and t).

The seed is a secret. By default (``seed=None``) each Trainer draws a fresh
256-bit one from the operating system's CSPRNG (:func:`dpfunc.secret_seed`);
it lives in memory and in checkpoints only. Whoever knows it can regenerate
every noise draw and subtract it, whatever epsilon is printed; a fixed seed
is for reproducible research only.

Distributed: launch every rank with ``torchrun`` and call
``dpfunc.distributed.init()`` first; see :mod:`dpfunc.distributed`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from . import checkpoint as _checkpoint
from . import optim
from ._checks import check_choice, check_int, check_params
from ._plan import PlannedRun, RunPlan
from .callbacks import StepMeter, built_in, check_callbacks, learning_rate, run_hook
from .config import DPConfig, SpeedConfig, settings_from
from .per_sample import LossFn
from .step import NONFINITE, NoiseAhead, TrainState
from .tree import Params


class Trainer(PlannedRun):
    """Private training of ``params`` on ``dataset`` with DP-SGD.

    Args:
        loss_fn: ``loss_fn(params, example) -> scalar`` for ONE example.
        params: the initial trainable parameters (``functionalize(model)[0]``).
        dataset: a tensor or numpy array of rows, a tuple or list of them read
            as columns, a map-style ``Dataset``, a ``DataLoader`` (its dataset;
            Poisson sampling replaces its sampler) or a Hugging Face
            ``datasets.Dataset``: see :func:`dpfunc.datasets.as_dataset`.
        optimizer: a :mod:`dpfunc.optim` transformation.
        config: the privacy settings, a :class:`dpfunc.DPConfig`: ``epochs``
            plans ``round(epochs * round(n / expected_batch_size))`` steps;
            ``config.calibrated(n)`` resolves ``target_epsilon`` and ``delta``
            for this dataset into ``trainer.config``; ``epsilon_budget`` stops
            the run before a step would exceed it.
        callbacks: objects with any of the hooks of :mod:`dpfunc.callbacks`,
            run after the built-in evaluation, before the built-in checkpoint
            and progress bar.
        progress: a tqdm bar with loss, epsilon and examples/s
            (:class:`dpfunc.callbacks.ProgressBar`).
        seed: the secret that keys the samples and the noise. ``None`` (the
            default) draws one from the OS CSPRNG (distributed: rank 0's,
            broadcast) and adopts a loaded checkpoint's seed if that was drawn
            too. An int makes the run reproducible, and **whoever knows it can
            remove the noise**: public data or debugging only.
        speed: a :class:`dpfunc.SpeedConfig`: ``model``, ``method``,
            ``chunk_size``, ``memory_budget`` as for
            :func:`dpfunc.make_train_step` (ghost clipping needs ``model``;
            ``trainer.step_fn.explain(trainer.params, batch)`` shows the plan);
            ``compile`` (``torch.compile(fullgraph=True)`` on the step's
            pieces); ``physical_batch_size`` (rows per micro-batch, the
            compiled shape; default: the expected batch size per rank plus 3
            std); ``shard=True`` shards parameters, optimizer state and noise
            history over the ranks of a distributed run (:mod:`dpfunc.sharding`):
            ``trainer.params`` are this rank's rows (:meth:`full_params`, the
            checkpoint directories: see docs/sharded.md).
        eval_fn: ``eval_fn(params) -> dict[str, float]`` after each epoch, its
            results in the history (:class:`dpfunc.callbacks.Evaluate`).
        checkpoint_path: saved after every epoch and every ``checkpoint_every``
            steps, and resumed from (with a warning) if it exists: rerunning an
            interrupted script continues the run
            (:class:`dpfunc.callbacks.Checkpoint`).
        checkpoint_every: steps between checkpoints (``None``: epochs only).
        distributed: ``None`` (default) trains data-parallel exactly when a
            ``torch.distributed`` process group is initialised, ``True``
            requires one, ``False`` trains this process alone. Every rank
            builds the Trainer with the same arguments (checked) and calls the
            same methods (``fit``, ``train_step``, ``save``, ``load`` are
            collective).
        nonfinite: ``"warn"`` (default) or ``"error"`` about examples with a
            NaN/inf gradient, left out of the sum either way
            (:func:`dpfunc.step.check_nonfinite`).
        users: with ``DPConfig(privacy_unit="user", max_examples_per_user=k)``
            (and only then), the user of each example: a sequence of ids
            (ints or strings) in dataset order, or the name of a Hugging Face
            dataset's id column (read, then dropped from the rows the loss
            sees). The run protects users (:mod:`dpfunc.users`):
            ``expected_batch_size`` and ``epochs`` count users.
        **settings: ``DPConfig``'s and ``SpeedConfig``'s fields as keywords
            (``epochs=3, expected_batch_size=256, clip_norm=1.0,
            target_epsilon=3.0, model=model, ...``) instead of ``config`` and
            ``speed``.

    Raises:
        ValueError, TypeError: an invalid argument; every argument is checked
            here, before any training.
    """

    def __init__(
        self,
        loss_fn: LossFn,
        params: Params,
        dataset: Any,
        *,
        optimizer: optim.GradientTransformation,
        config: DPConfig | None = None,
        speed: SpeedConfig | None = None,
        callbacks: list[Any] | tuple[Any, ...] = (),
        progress: bool = True,
        seed: int | None = None,
        eval_fn: Callable[[Params], dict[str, float]] | None = None,
        checkpoint_path: str | os.PathLike | None = None,
        checkpoint_every: int | None = None,
        distributed: bool | None = None,
        nonfinite: str = "warn",
        users: Any = None,
        **settings: Any,
    ):
        config, speed = settings_from("Trainer", config, speed, settings)
        check_params(params)
        before, after = built_in(eval_fn, checkpoint_path, checkpoint_every, progress)
        user_callbacks = check_callbacks(callbacks)
        check_choice("nonfinite", nonfinite, NONFINITE)
        self.plan = plan = RunPlan(
            "Trainer", config, dataset, physical_batch_size=speed.physical_batch_size, seed=seed,
            distributed=distributed, require_epochs=True, users=users,
        )  # fmt: skip
        self.config = config = plan.config
        self.batches = plan.batches  # the Poisson sampler the secret seed keys
        self.nonfinite = nonfinite
        self._warned_nonfinite = False
        # compiled (speed.compile): the collectives run eagerly between the compiled pieces
        self.step_fn = plan.make_step(loss_fn, optimizer, speed)
        self.state: TrainState = self.step_fn.init(params)  # distributed: rank 0's params
        self.accountant = config.accountant()
        self.history: list[dict[str, float]] = []
        self.stop_training = False  # a callback sets it to stop fit (see dpfunc.callbacks)
        self._closed = False
        self._noise = NoiseAhead(self.step_fn)  # the same on every rank, drawn ahead
        self.callbacks = before + user_callbacks + after
        try:
            run_hook(self.callbacks, "on_init", self)
        except BaseException:  # a refused resume: the path stays free for the corrected run
            _checkpoint.release_all(self)
            raise

    params = property(lambda self: self.state.params)  # sharded: this rank's rows

    def full_params(self) -> Params:
        """The whole parameters: :attr:`params`, or, sharded, every rank's rows gathered.

        Sharded this is collective: call it on every rank (the evaluation
        callback does, before ``eval_fn``).
        """
        return self.step_fn.full_params(self.state)

    def train_step(self) -> dict[str, float]:
        """One logical DP-SGD step; returns its (non-private) metrics as floats, and ``lr``.

        Raises:
            RuntimeError: the planned ``total_steps`` are done, or one more
                step would take epsilon past ``epsilon_budget`` (a calibrated
                ``target_epsilon`` holds for the planned steps only).
            FloatingPointError: non-finite examples (see ``nonfinite``);
                nothing of the step is released then.
        """
        self._check_open()
        t = self.steps_done
        self.plan.check_next_step(t)
        if int(self.state.step) != t:
            raise RuntimeError(
                f"the optimizer has taken {int(self.state.step)} steps but the accountant "
                f"counted {t}; the trainer's state is inconsistent (load a checkpoint)"
            )
        metrics: dict[str, float] = {}
        lr = learning_rate(self.step_fn.optimizer, self.state.opt_state)  # this update's

        limit = self.plan.last_step()  # draws ahead only a step that may come
        noise = self._noise.draw(self.state.params, self.stream_seed, t, ahead=t + 1 < limit)
        micro_batches, _ = self.batches.logical_batch(t)
        self.state, _ = self.step_fn.logical_step(
            self.state, micro_batches, noise, before_release=self._before_release(t, metrics)
        )
        return metrics if lr is None else {**metrics, "lr": lr}

    def fit(
        self, max_steps: int | None = None, callbacks: list[Any] | tuple[Any, ...] = ()
    ) -> list[dict[str, float]]:
        """Trains until the planned steps are done or the budget would be exceeded.

        Args:
            max_steps: stop after at most this many more steps (e.g. to
                checkpoint and resume later); ``None`` runs to the end.
            callbacks: more callbacks for this ``fit`` only, after the
                Trainer's own (see :mod:`dpfunc.callbacks`). One stops the
                fit before its next step with ``trainer.stop_training = True``.

        Returns the history: one dict per epoch with ``epoch``, ``steps``,
        ``loss`` (mean over the examples since the last record; not
        private), ``nonfinite`` (the examples with a NaN/inf gradient since
        the last record, left out of the sums; not private), ``epsilon``,
        ``clip_norm``, ``lr`` and what callbacks added (``eval_fn``'s
        results); and one more for the last step when ``fit`` stops between
        epochs (budget, ``max_steps`` or a callback), so the last record
        always holds the epsilon of the parameters returned.
        """
        stop_at = self.plan.last_step()
        if max_steps is not None:
            check_int("max_steps", max_steps)
            stop_at = min(stop_at, self.steps_done + max_steps)
        active = self.callbacks + check_callbacks(callbacks)
        self.stop_training = False
        run_hook(active, "on_fit_start", self, stop_at)
        meter = StepMeter()
        while self.steps_done < stop_at and not self.stop_training:
            metrics = meter.add(self.train_step())
            done = self.steps_done
            if done % self.steps_per_epoch == 0 or done == stop_at:
                run_hook(active, "on_epoch_end", self, meter.record(self))
            run_hook(active, "on_step_end", self, metrics)
        if meter.steps:  # a callback stopped the fit between records
            run_hook(active, "on_epoch_end", self, meter.record(self))
        run_hook(active, "on_fit_end", self, self.history)
        return self.history

    def save(self, path: str | os.PathLike) -> None:
        """Writes a checkpoint atomically (:func:`dpfunc.checkpoint.save`).

        **A checkpoint is as sensitive as the training data**: it holds the
        secret seed, with which anyone can remove the noise from every
        update it saw. Distributed: collective, rank 0 writes.
        """
        self._check_open()
        _checkpoint.save(self, path)

    def close(self) -> None:
        """Lets go of the checkpoint paths this trainer holds; it may train and save no more.

        A path is held from the trainer's first save (or its construction
        with ``checkpoint_path``) until ``close()`` or the trainer is
        collected, so that no second live run writes it. Close a trainer
        that a notebook keeps alive (an interrupted ``fit``, a cell run
        again) before building the next one on the same path. Epsilon and
        the report stay readable.
        """
        _checkpoint.release_all(self)
        self.stop_training = True
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Trainer is closed (close()): build a new one to go on")

    def load(self, path: str | os.PathLike) -> None:
        """Restores a checkpoint of an identically set-up run (:func:`dpfunc.checkpoint.load`).

        Raises:
            ValueError: unreadable, corrupted, or of a run with other privacy
                settings, data size or parameter shapes (each difference
                named); the trainer is left unchanged.
        """
        _checkpoint.load(self, path)


__all__ = ["Trainer"]
