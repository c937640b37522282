"""Callbacks: what runs around the Trainer's steps, and the built-in ones.

A callback is any object with some of the methods in :data:`HOOKS`
(``on_init``, ``on_fit_start``, ``on_epoch_end``, ``on_step_end``,
``on_fit_end``); the Trainer calls those it has. They run in order: the
built-ins from the Trainer's arguments (:class:`Evaluate` from ``eval_fn``),
then the user's, then :class:`Checkpoint` (from ``checkpoint_path``) and
:class:`ProgressBar` (``progress=True``), so a checkpoint holds what the others
added. A callback stops ``fit`` by setting ``trainer.stop_training = True``:
:class:`StopAtEpsilon` does so before a step would exceed an epsilon. The
loggers :class:`CSVLogger`, :class:`JSONLogger` and :class:`TensorBoard` write
the history records, the steps' metrics, or both.

Privacy: the values in :data:`NON_PRIVATE_METRICS` read the data without noise;
they are diagnostics, NOT differentially private. Those in
:data:`PUBLIC_METRICS` are public or post-processing of what the accountant
accounts, and safe to publish with the model. Every other key (what an
``eval_fn`` or a callback adds) is treated as non-private, since an evaluation
on private data is not accounted. The loggers write each non-private key under
the prefix :data:`NON_PRIVATE_PREFIX` (``nonprivate/loss``), so a log file says
which of its numbers may not be published.

Each hook's arguments and timing, the order, stopping a ``fit`` (on every rank
at the same step), and the log files (rank 0 only, never over an existing one,
appended on a resume): see docs/training.md, "Callbacks" and "Logging,
stopping at an epsilon, and the privacy report".
"""

from __future__ import annotations

import abc
import csv
import json
import math
import os
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

from tqdm.auto import tqdm

from . import checkpoint as _checkpoint
from . import distributed as _distributed
from . import optim
from ._checks import check_choice, check_int, check_number
from .accounting import epsilon as _epsilon
from .report import steps_within_budget
from .tree import Params

__all__ = [
    "HOOKS",
    "NON_PRIVATE_METRICS",
    "NON_PRIVATE_PREFIX",
    "PUBLIC_METRICS",
    "CSVLogger",
    "Checkpoint",
    "Evaluate",
    "JSONLogger",
    "ProgressBar",
    "StopAtEpsilon",
    "TensorBoard",
    "built_in",
    "logged_name",
    "run_hook",
]

HOOKS = ("on_init", "on_fit_start", "on_epoch_end", "on_step_end", "on_fit_end")

PUBLIC_METRICS = frozenset({"epoch", "steps", "epsilon", "clip_norm", "lr"})
"""Keys safe to publish: the schedule's (``epoch``, ``steps``, ``lr``), the
accountant's ``epsilon``, and ``clip_norm`` (fixed, or moved by the noisy,
accounted count of adaptive clipping)."""

NON_PRIVATE_METRICS = frozenset(
    {
        "loss",
        "batch_size",
        "clipped_fraction",
        "nonfinite",
        "norm_p10",
        "norm_p50",
        "norm_p90",
        "norm_max",
        "examples_per_second",
    }
)
"""The Trainer's diagnostics that read the data without noise: the step
metrics of :func:`dpfunc.summarize`, the realised batch size and the
throughput, and the history records' ``loss`` and ``nonfinite``. NOT private."""

NON_PRIVATE_PREFIX = "nonprivate/"
"""What the loggers put before every key not in :data:`PUBLIC_METRICS`."""


def logged_name(key: str) -> str:
    """The name a logger writes ``key`` under: ``key`` if public, else ``nonprivate/key``.

    >>> logged_name("epsilon"), logged_name("loss"), logged_name("accuracy")
    ('epsilon', 'nonprivate/loss', 'nonprivate/accuracy')
    """
    return key if key in PUBLIC_METRICS else NON_PRIVATE_PREFIX + key


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
        results = self.eval_fn(trainer.full_params())  # sharded: gathered, collective
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
    privacy settings is refused (:func:`dpfunc.checkpoint.load`). The
    resumed run is a new continuation: with a secret seed its samples and
    noise from there on are freshly drawn (the fork rule). The path is held
    by this trainer from the start (:func:`dpfunc.checkpoint.hold`): a
    second live run on it is refused before any step. Saving is collective
    when distributed (rank 0 writes).

    Raises:
        TypeError, ValueError: ``path`` cannot hold a checkpoint (its
            directory does not exist or is not writable, or it is a
            directory), or ``every`` is not an int >= 1.
    """

    def __init__(self, path: str | os.PathLike, every: int | None = None):
        _checkpoint.check_path(path)
        if every is not None:
            check_int("checkpoint_every", every, minimum=1)
        # the same file after a chdir, in the caller's type (str or a Path)
        self.path = type(path)(os.path.abspath(path)) if isinstance(path, str | Path) else path
        self.every = every
        self._saved_at: int | None = None

    def on_init(self, trainer: Any) -> None:
        _checkpoint.hold(trainer, self.path)  # one live run per path, before any step
        resume = _checkpoint.exists(self.path)  # a file, or a sharded directory
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

    def on_fit_start(self, trainer: Any, stop_at: int) -> None:
        self._bar = tqdm(
            total=stop_at, initial=trainer.steps_done, disable=trainer.rank != 0, unit="step"
        )

    def on_step_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        epsilon = trainer.history[-1]["epsilon"] if trainer.history else 0.0
        self._bar.update(1)
        self._bar.set_postfix(
            loss=f"{metrics['loss']:.4f}",
            eps=f"{epsilon:.3g}",
            ex_s=f"{metrics.get('examples_per_second', math.nan):.0f}",
        )

    def on_fit_end(self, trainer: Any, history: list[dict[str, float]]) -> None:
        self._bar.close()


# -- what fit measures ---------------------------------------------------------------


def learning_rate(optimizer: Any, opt_state: Any) -> float | None:
    """The rate ``optimizer``'s next update from ``opt_state`` applies, or ``None``.

    :func:`dpfunc.optim.learning_rate` for a :mod:`dpfunc.optim`
    transformation; ``None`` for one without a rate (:func:`dpfunc.optim.scale`)
    and for any other ``(init, update)`` pair.
    """
    if not isinstance(optimizer, optim.GradientTransformation):
        return None
    return optim.learning_rate(optimizer, opt_state)


class StepMeter:
    """What ``fit`` adds up between history records, and its throughput since it began."""

    def __init__(self) -> None:
        self.steps = 0  # since the last record
        self._loss_sum = self._examples = self._nonfinite = self._seen = 0.0
        self._lr: float | None = None
        self._started = time.perf_counter()

    def add(self, metrics: dict[str, float]) -> dict[str, float]:
        """Adds a step's metrics; returns them with ``examples_per_second`` since the start."""
        batch = metrics["batch_size"]
        self.steps += 1
        self._loss_sum += metrics["loss"] * batch
        self._examples += batch
        self._nonfinite += metrics["nonfinite"]
        self._seen += batch
        self._lr = metrics.get("lr")
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        metrics["examples_per_second"] = self._seen / elapsed
        return metrics

    def record(self, trainer: Any) -> dict[str, float]:
        """Appends the history record of ``trainer``'s current step, returns it, and resets.

        ``loss`` is the mean over the examples since the last record,
        ``nonfinite`` their count of non-finite examples, ``lr`` the rate of
        the last step's update (absent without one).
        """
        done = trainer.steps_done
        record = {
            "epoch": done / trainer.steps_per_epoch,
            "steps": done,
            "loss": self._loss_sum / max(self._examples, 1.0),
            "nonfinite": int(self._nonfinite),
            "epsilon": trainer.epsilon(),
            "clip_norm": trainer.clip_norm,
        }
        if self._lr is not None:
            record["lr"] = self._lr
        self.steps = 0
        self._loss_sum = self._examples = self._nonfinite = 0.0
        trainer.history.append(record)
        return record


# -- stopping at a budget --------------------------------------------------------------


class StopAtEpsilon:
    """Stops ``fit`` before a step would take epsilon at ``delta`` past ``epsilon``.

    Like the Trainer's own ``epsilon_budget``, it decides before the step:
    when ``fit`` starts it finds the most steps whose epsilon is within the
    budget (:func:`dpfunc.report.steps_within_budget`: every step of a
    Trainer is the same accounting event), and sets
    ``trainer.stop_training`` once they are done, so the step that would
    exceed the budget is never taken (nor accounted). A fit that it stops
    before any step warns, with the epsilon one more step would reach.
    Unlike ``epsilon_budget`` it can be given to one ``fit``, and at another
    delta than the Trainer's.

    Args:
        epsilon: the budget, a number ``> 0``.
        delta: the delta of that epsilon, in ``(0, 1)``; ``None``: the
            Trainer's ``delta``.

    Raises:
        ValueError: ``epsilon`` or ``delta`` out of range (here); the
            trainer's accountant holds steps other than its config's (at
            ``fit``: the budget arithmetic would not hold).
    """

    def __init__(self, epsilon: float, delta: float | None = None):
        self.epsilon = check_number("epsilon", epsilon, low=0, low_open=True, high_open=True)
        if delta is not None:
            delta = check_number("delta", delta, low=0, high=1, low_open=True, high_open=True)
        self.delta = delta
        self.limit: int | None = None  # the most steps within the budget, set at fit start

    def on_fit_start(self, trainer: Any, stop_at: int) -> None:
        config, n = trainer.config, trainer.num_units  # users, with privacy_unit="user"
        event = config.accounting_event(n)
        if any((sigma, rate) != tuple(event) for sigma, rate, _ in trainer.accountant.history):
            raise ValueError(
                f"StopAtEpsilon counts steps of the trainer's event {tuple(event)}; its "
                f"accountant holds other steps: {trainer.accountant.history}"
            )
        delta = trainer.delta if self.delta is None else self.delta
        self.limit = steps_within_budget(config, n, self.epsilon, delta)
        if trainer.steps_done >= self.limit:
            trainer.stop_training = True
            if trainer.steps_done < stop_at:
                after = _epsilon(*event, trainer.steps_done + 1, delta, config.accounting,
                                 bands=config.bands)  # fmt: skip
                warnings.warn(
                    f"StopAtEpsilon(epsilon={self.epsilon!r}) at delta={delta!r} stops this fit "
                    f"before its first step: step {trainer.steps_done + 1} would reach "
                    f"epsilon={after:.4g}",
                    stacklevel=4,
                )

    def on_step_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        if self.limit is not None and trainer.steps_done >= self.limit:
            trainer.stop_training = True


# -- loggers ---------------------------------------------------------------------------


def _check_log_path(path: Any) -> str:
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path must be a str or os.PathLike, got path={path!r}")
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ValueError(f"the directory of path={path!r} does not exist: {directory!r}")
    if os.path.isdir(path):
        raise ValueError(f"path={path!r} is a directory; give the file to write")
    return path


def _open_on_rank_0(trainer: Any, opener: Callable[[], None], what: str) -> None:
    """Runs ``opener`` on rank 0; distributed, every rank raises if it failed there."""
    error = None
    if trainer.rank == 0:
        try:
            opener()
        except Exception as caught:  # joins the others first, then raises
            error = caught
    flags = [error is None]
    if trainer.distributed:
        flags = _distributed.gather_flags(error is None, what, step=trainer.steps_done)
    if error is not None:
        raise error
    if not flags[0]:
        raise RuntimeError(f"rank 0 failed at {what}; see its log")


def _refuse_another_run(trainer: Any, path: str, mine: bool, exists: bool) -> None:
    if exists and not mine and trainer.steps_done == 0:
        raise FileExistsError(
            f"{path!r} already holds a log, and this run has done no steps: a new run never "
            "writes into another run's log. Give another path or delete it (a resumed run, "
            "with steps done, appends to it)"
        )


class _FileLogger(abc.ABC):
    """One row per step or per history record, appended to a file on rank 0 (see the module)."""

    KINDS = ("epoch", "step")

    def __init__(self, path: str | os.PathLike, records: str):
        self.path = _check_log_path(path)
        self.records = check_choice("records", records, self.KINDS)
        self._file: TextIO | None = None
        self._run: int | None = None  # id() of the trainer this logger has written for

    def on_fit_start(self, trainer: Any, stop_at: int) -> None:
        self.close()
        _open_on_rank_0(trainer, lambda: self._open(trainer), f"opening the log {self.path!r}")

    def _open(self, trainer: Any) -> None:
        exists = os.path.exists(self.path) and os.path.getsize(self.path) > 0
        _refuse_another_run(trainer, self.path, self._run == id(trainer), exists)
        self._file = open(self.path, "a", newline="", encoding="utf-8")  # noqa: SIM115
        self._run = id(trainer)
        self._opened(exists)

    def _opened(self, existed: bool) -> None:  # noqa: B027 (optional: a header, say)
        """Called once the file is open; ``existed``: it held rows of this run before."""

    def on_epoch_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        if self._file is not None and self.records in ("epoch", "both"):
            self._write("epoch", dict(metrics))

    def on_step_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        if self._file is not None and self.records in ("step", "both"):
            self._write("step", {"steps": trainer.steps_done, **metrics})

    @abc.abstractmethod
    def _write(self, kind: str, row: dict[str, Any]) -> None:
        """Writes one row (``kind``: ``"epoch"`` or ``"step"``) and flushes it."""

    def on_fit_end(self, trainer: Any, history: list[dict[str, float]]) -> None:
        self.close()

    def close(self) -> None:
        """Closes the file (``fit`` does it when it ends); the next ``fit`` appends."""
        if self._file is not None:
            self._file.close()
            self._file = None


class CSVLogger(_FileLogger):
    """Writes the history records (``records="epoch"``) or the step metrics (``"step"``) as CSV.

    The columns are the keys of the first row, ``steps`` among them, each
    non-private one under ``nonprivate/`` (:func:`logged_name`); a row
    without some column leaves it empty. Appending to an existing file
    (a resumed run) checks that its header is this run's. File handling: see
    :mod:`dpfunc.callbacks` (rank 0, flushed per row, never another run's file).

    Raises:
        TypeError, ValueError: ``path`` is not a path whose directory exists,
            or ``records`` is not ``"epoch"`` or ``"step"`` (here).
        FileExistsError: at ``fit``, ``path`` holds a log and the run is new.
        ValueError: a row has a key that the header lacks (a callback that
            adds a key after the first row), or the existing header differs;
            use :class:`JSONLogger` for rows whose keys change.
    """

    def __init__(self, path: str | os.PathLike, records: str = "epoch"):
        super().__init__(path, records)
        self._columns: list[str] | None = None

    def _opened(self, existed: bool) -> None:
        self._existing_header = None
        if existed and self._columns is None:
            with open(self.path, newline="", encoding="utf-8") as f:
                self._existing_header = next(csv.reader(f), None)

    def _write(self, kind: str, row: dict[str, Any]) -> None:
        row = {logged_name(key): value for key, value in row.items()}
        if self._columns is None:
            columns = list(row)
            if self._existing_header is not None and self._existing_header != columns:
                raise ValueError(
                    f"the CSV log {self.path!r} has the columns {self._existing_header}, this "
                    f"run writes {columns}; give another path"
                )
            if self._existing_header is None:
                csv.writer(self._file).writerow(columns)
            self._columns = columns
        extra = [key for key in row if key not in self._columns]
        if extra:
            raise ValueError(
                f"a {kind} row has {extra}, which the columns of the CSV log {self.path!r} "
                f"(from its first row) lack: {self._columns}; use JSONLogger for rows whose "
                "keys change"
            )
        csv.DictWriter(self._file, self._columns, restval="").writerow(row)
        self._file.flush()


class JSONLogger(_FileLogger):
    """Writes one JSON object per line: the history records and/or the step metrics.

    ``records``: ``"both"`` (default), ``"epoch"`` or ``"step"``. Each line
    is ``{"record": "epoch" | "step", "steps": ..., ...}`` with every
    non-private key under ``nonprivate/`` (:func:`logged_name`); rows may
    have different keys. Non-finite numbers are written as ``NaN`` and
    ``Infinity``, which Python's ``json`` and pandas read. On a step that
    ends a record, the ``epoch`` line comes first. File handling: see
    :mod:`dpfunc.callbacks` (rank 0, flushed per line, never another run's file).

    Raises:
        TypeError, ValueError: ``path`` is not a path whose directory exists,
            or ``records`` is not one of the three (here).
        FileExistsError: at ``fit``, ``path`` holds a log and the run is new.
    """

    KINDS = ("epoch", "step", "both")

    def __init__(self, path: str | os.PathLike, records: str = "both"):
        super().__init__(path, records)

    def _write(self, kind: str, row: dict[str, Any]) -> None:
        line = {"record": kind, "steps": row.pop("steps")}
        line.update({logged_name(key): value for key, value in row.items()})
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()


_TENSORBOARD_MISSING = (
    'TensorBoard logging needs the tensorboard package: pip install "dpfunc[tensorboard]"'
)


class TensorBoard:
    """Writes the history records and/or the step metrics as TensorBoard scalars (rank 0).

    Through ``torch.utils.tensorboard.SummaryWriter(log_dir)``, at global
    step ``trainer.steps_done``; the tag of key ``k`` of a ``kind`` row
    (``"epoch"`` or ``"step"``) is ``kind/k``, under ``nonprivate/`` when
    ``k`` is not public (``epoch/epsilon``, ``nonprivate/step/loss``), so
    TensorBoard shows the non-private diagnostics in a section of their own.
    A writer is opened when ``fit`` starts, flushed after every row, and
    closed when it ends. A new run refuses a ``log_dir`` that holds event
    files already; a resumed run writes there, purging the events after its
    step count (``purge_step``), which the interrupted run wrote after its
    checkpoint.

    Args:
        log_dir: the directory of the event files (created if missing).
        records: ``"both"`` (default), ``"epoch"`` or ``"step"``.

    Raises:
        ImportError: tensorboard is not installed (``pip install
            "dpfunc[tensorboard]"``), here.
        TypeError, ValueError: ``log_dir`` is not a path, or ``records`` is
            not one of the three (here).
        FileExistsError: at ``fit``, ``log_dir`` holds event files and the
            run is new.
    """

    def __init__(self, log_dir: str | os.PathLike, records: str = "both"):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ImportError(_TENSORBOARD_MISSING) from error
        if not isinstance(log_dir, str | os.PathLike):
            raise TypeError(f"log_dir must be a str or os.PathLike, got log_dir={log_dir!r}")
        self.log_dir = os.fspath(log_dir)
        if os.path.exists(self.log_dir) and not os.path.isdir(self.log_dir):
            raise ValueError(f"log_dir={self.log_dir!r} is a file; give a directory")
        self.records = check_choice("records", records, ("epoch", "step", "both"))
        self._writer_class = SummaryWriter
        self._writer: Any = None
        self._run: int | None = None

    def on_fit_start(self, trainer: Any, stop_at: int) -> None:
        self.close()
        _open_on_rank_0(trainer, lambda: self._open(trainer), f"opening {self.log_dir!r}")

    def _open(self, trainer: Any) -> None:
        events = os.path.isdir(self.log_dir) and any(
            name.startswith("events.out.tfevents") for name in os.listdir(self.log_dir)
        )
        _refuse_another_run(trainer, self.log_dir, self._run == id(trainer), events)
        done = trainer.steps_done
        self._writer = self._writer_class(self.log_dir, purge_step=done + 1 if done else None)
        self._run = id(trainer)

    def _write(self, kind: str, row: Mapping[str, float], step: int) -> None:
        for key, value in row.items():
            tag = f"{kind}/{key}" if key in PUBLIC_METRICS else f"{NON_PRIVATE_PREFIX}{kind}/{key}"
            self._writer.add_scalar(tag, float(value), step)
        self._writer.flush()

    def on_epoch_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        if self._writer is not None and self.records in ("epoch", "both"):
            self._write("epoch", metrics, trainer.steps_done)

    def on_step_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        if self._writer is not None and self.records in ("step", "both"):
            self._write("step", metrics, trainer.steps_done)

    def on_fit_end(self, trainer: Any, history: list[dict[str, float]]) -> None:
        self.close()

    def close(self) -> None:
        """Closes the writer (``fit`` does it when it ends)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
