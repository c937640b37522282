"""Callbacks: what runs around the Trainer's steps, and the built-in ones.

A callback is any object with some of these methods (each optional):

* ``on_init(trainer)``: once, at the end of ``Trainer(...)`` (after its state
  exists; :class:`Checkpoint` resumes an existing file here);
* ``on_fit_start(trainer, stop_at)``: ``fit`` begins; it stops at step ``stop_at``;
* ``on_epoch_end(trainer, metrics)``: after a step that ends an epoch, or the
  last step of a ``fit``: ``metrics`` is the new history record (``epoch``,
  ``steps``, ``loss``, ``nonfinite``, ``epsilon``, ``clip_norm``), already in
  ``trainer.history``; a callback may add keys to it;
* ``on_step_end(trainer, metrics)``: after every step (after
  ``on_epoch_end`` when both fire): ``metrics`` are the step's, as floats
  (``loss``, ``batch_size``, ``clipped_fraction``, ``nonfinite``, norm
  quantiles; see :func:`dpfunc.summarize`). They read the data without
  noise: NOT private;
* ``on_fit_end(trainer, history)``: ``fit`` returns ``history``.

Callbacks run in order: the Trainer's built-ins from its arguments
(:class:`Evaluate` from ``eval_fn``), then the user's, then
:class:`Checkpoint` (from ``checkpoint_path``) and :class:`ProgressBar`
(``progress=True``), so a checkpoint holds what the others added.
Distributed, every rank runs every callback (the built-ins write and show
on rank 0 only).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from tqdm.auto import tqdm

from . import checkpoint as _checkpoint
from . import distributed as _distributed
from .checks import check_int
from .tree import Params

__all__ = ["HOOKS", "Checkpoint", "Evaluate", "ProgressBar", "built_in", "run_hook"]

HOOKS = ("on_init", "on_fit_start", "on_epoch_end", "on_step_end", "on_fit_end")


def run_hook(callbacks: list[Any], hook: str, *args: Any) -> None:
    """Calls ``hook(*args)`` on each callback that defines it, in order."""
    for callback in callbacks:
        method = getattr(callback, hook, None)
        if method is not None:
            method(*args)


def built_in(
    eval_fn: Callable[[Params], Mapping[str, float]] | None,
    checkpoint_path: str | os.PathLike | None,
    checkpoint_every: int | None,
    progress: bool,
) -> tuple[list[Any], list[Any]]:
    """The Trainer's callbacks from its arguments: those before the user's, and those after.

    Raises:
        ValueError, TypeError: as the callbacks' constructors, or
            ``checkpoint_every`` without ``checkpoint_path``.
    """
    if checkpoint_every is not None and checkpoint_path is None:
        raise ValueError(
            "checkpoint_every needs checkpoint_path, got "
            f"checkpoint_every={checkpoint_every!r}, checkpoint_path=None"
        )
    before = [Evaluate(eval_fn)] if eval_fn is not None else []
    after = [Checkpoint(checkpoint_path, checkpoint_every)] if checkpoint_path is not None else []
    return before, after + ([ProgressBar()] if progress else [])


def check_callbacks(callbacks: Any) -> list[Any]:
    """The callbacks as a list; each must define at least one hook.

    Raises:
        TypeError: not a list or tuple, or an element without any hook.
    """
    if not isinstance(callbacks, list | tuple):
        raise TypeError(f"callbacks must be a list of callback objects, got {callbacks!r}")
    for callback in callbacks:
        if not any(callable(getattr(callback, hook, None)) for hook in HOOKS):
            raise TypeError(
                f"callbacks holds {callback!r}, which defines none of {list(HOOKS)}; a callback "
                "is an object with any of these methods"
            )
    return list(callbacks)


class Evaluate:
    """Adds ``eval_fn(params)``'s results to each history record.

    ``eval_fn(params) -> dict[str, float]`` runs after each epoch (and at
    the end of each ``fit``) on every rank; its values are stored as floats.

    Raises:
        TypeError: ``eval_fn`` is not callable (here), or it returns
            something other than a dict of numbers (at the record).
    """

    def __init__(self, eval_fn: Callable[[Params], Mapping[str, float]]):
        if not callable(eval_fn):
            raise TypeError(
                "eval_fn must be a callable eval_fn(params) -> dict[str, float] or None, got "
                f"eval_fn={eval_fn!r}"
            )
        self.eval_fn = eval_fn

    def on_epoch_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        results = self.eval_fn(trainer.params)
        if not isinstance(results, Mapping):
            raise TypeError(
                f"eval_fn must return a dict of numbers, e.g. {{'accuracy': 0.9}}, got {results!r}"
            )
        for key, value in results.items():
            try:
                metrics[key] = float(value)
            except (TypeError, ValueError) as error:
                raise TypeError(
                    f"eval_fn must return a dict of numbers, got {key}={value!r}"
                ) from error


class Checkpoint:
    """Saves the trainer after every epoch (and every ``every`` steps); resumes an existing file.

    When the trainer is built and ``path`` exists, the run is resumed from
    it (with a warning that says so), so rerunning an interrupted script
    continues the run instead of overwriting it; a checkpoint of other
    privacy settings is refused (:func:`dpfunc.checkpoint.load`). Saving is
    collective when distributed (rank 0 writes).

    Raises:
        TypeError, ValueError: ``path`` cannot hold a checkpoint (its
            directory does not exist or is not writable, or it is a
            directory), or ``every`` is not an int >= 1.
    """

    def __init__(self, path: str | os.PathLike, every: int | None = None):
        _checkpoint.check_path(path)
        if every is not None:
            check_int("checkpoint_every", every, minimum=1)
        self.path = path
        self.every = every
        self._saved_at: int | None = None

    def on_init(self, trainer: Any) -> None:
        resume = os.path.exists(self.path)
        if trainer.distributed:  # load is collective
            _distributed.check_same_across_ranks(
                {"exists": resume}, f"whether checkpoint_path={os.fspath(self.path)!r} exists"
            )
        if resume:
            # A rerun of the same command continues the run: overwriting the checkpoint
            # would lose its steps, and its accounting with them.
            trainer.load(self.path)
            warnings.warn(
                f"resumed from the existing checkpoint_path={os.fspath(self.path)!r} at "
                f"step {trainer.steps_done} of {trainer.total_steps}; to start a new run, give "
                "another path or delete that file",
                stacklevel=4,
            )

    def on_epoch_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        trainer.save(self.path)
        self._saved_at = trainer.steps_done

    def on_step_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        done = trainer.steps_done
        if self.every and done % self.every == 0 and self._saved_at != done:
            trainer.save(self.path)
            self._saved_at = done


class ProgressBar:
    """A tqdm bar with the step's loss, the last recorded epsilon and examples/s (rank 0 only).

    The epsilon shown is the last history record's (each evaluation of the
    PLD accountant can take about a second, so it is not recomputed per step).
    """

    def __init__(self) -> None:
        self._bar = None
        self._seen = 0.0
        self._started = 0.0

    def on_fit_start(self, trainer: Any, stop_at: int) -> None:
        self._bar = tqdm(
            total=stop_at, initial=trainer.steps_done, disable=trainer.rank != 0, unit="step"
        )
        self._seen, self._started = 0.0, time.perf_counter()

    def on_step_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        self._seen += metrics["batch_size"]
        epsilon = trainer.history[-1]["epsilon"] if trainer.history else 0.0
        self._bar.update(1)
        self._bar.set_postfix(
            loss=f"{metrics['loss']:.4f}",
            eps=f"{epsilon:.3g}",
            ex_s=f"{self._seen / max(time.perf_counter() - self._started, 1e-9):.0f}",
        )

    def on_fit_end(self, trainer: Any, history: list[dict[str, float]]) -> None:
        self._bar.close()
