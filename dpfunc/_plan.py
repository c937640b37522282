"""What a private run fixes before its first step: the plan the Trainer and PrivateGradients share.

A :class:`RunPlan` resolves, once and before any work, everything a run of
DP-SGD over a dataset depends on: the privacy settings calibrated for the
dataset's size (:meth:`dpfunc.DPConfig.calibrated`), the sample rate and the
planned steps, the physical batch size (rows per micro-batch, the compiled
shape), the ranks of a data-parallel run, the secret seed, and the Poisson
sampler that the seed keys. :class:`dpfunc.Trainer` and
:class:`dpfunc.PrivateGradients` build one each, so both sample, noise and
account the same way.

The seed is a secret. By default (``seed=None``) it is drawn from the
operating system's CSPRNG (:func:`dpfunc.secret_seed`; distributed: on rank
0, broadcast) and lives in memory and in checkpoints only; a fixed seed is
for reproducible research, since whoever knows it can remove the noise.

The fork rule. A run continued from a checkpoint (or a ``state_dict``) of a
secret-seeded run draws a fresh secret for the samples and the noise of the
steps to come (:meth:`RunPlan.continue_run`), so two continuations of one
checkpoint never release a step with the same sample or noise: releasing
both composes their epsilons, as two runs on the same data do. The
partitions of cyclic Poisson sampling stay those of the run's own seed. A
fixed seed resumes bit-identically (it is public anyway).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import uuid
import warnings
from collections.abc import Callable
from typing import Any

from . import distributed as _distributed
from ._checks import check_int
from .accounting import epsilon as _epsilon
from .accounting import max_steps_within
from .clipper import ExampleStats, summarize
from .clipping import ACCUMULATED_SUMS
from .config import DPConfig, SpeedConfig
from .datasets import as_dataset, dataset_fingerprint, dataset_size
from .noise import check_seed, secret_seed, standard_normal_like
from .report import PrivacyReport, privacy_report, steps_within_budget
from .step import TrainState, TrainStep, check_nonfinite, make_train_step
from .users import UserIndex, index_users, read_user_column


class RunPlan:
    """The calibrated settings, the step plan, the ranks and the secret of one private run.

    Args:
        who: the caller's name, for error messages (``"Trainer"``).
        config: the privacy settings; ``target_epsilon`` needs ``epochs``.
        dataset: any form :func:`dpfunc.datasets.as_dataset` accepts (read
            once, here), with at least one example.
        physical_batch_size: rows per micro-batch; ``None``: each rank's
            share of the expected batch size plus 3 standard deviations.
        seed: the secret, or ``None`` to draw one (see the module docstring).
        distributed: ``None`` (data-parallel exactly when a process group is
            initialised), ``True`` (requires one) or ``False``.
        require_epochs: refuse a config without ``epochs`` (the Trainer
            plans its steps from them).

    Attributes: ``config`` (calibrated: ``noise_multiplier`` and ``delta``
    resolved), ``num_examples``, ``sample_rate``, ``steps_per_epoch``,
    ``total_steps`` (``None`` without ``epochs``), ``physical_batch_size``,
    ``distributed``, ``rank``, ``world_size``, ``adopts_seed`` (built with
    ``seed=None``: may adopt a loaded checkpoint's drawn secret),
    ``seed_is_secret``, ``batches`` (the :class:`dpfunc.data.PoissonBatches`
    the seed keys), ``stream_seed`` (the secret that keys the samples and
    the noise of the steps to come: the seed, or a continuation's fresh
    one) and ``lineage`` (an id per continuation, oldest first: whose
    checkpoint this run may overwrite); user-level runs also ``users`` (the
    :class:`dpfunc.users.UserIndex`; ``None`` for examples), ``num_units`` (the
    count the accountant reads: users or examples) and ``user_column`` (the
    ids' column, named in the report; ``None`` for ids given as values).

    Raises:
        ValueError, TypeError: an argument is invalid (named with its value),
            the dataset is empty, or, distributed, the ranks disagree.
    """

    def __init__(
        self,
        who: str,
        config: DPConfig,
        dataset: Any,
        *,
        physical_batch_size: int | None,
        seed: int | None,
        distributed: bool | None,
        require_epochs: bool,
        users: Any = None,
    ):
        column = users if isinstance(users, str) else None
        if column is not None:  # a column of a Hugging Face dataset: read, then dropped
            users, dataset = read_user_column(who, dataset, column)
        dataset = as_dataset(dataset)  # numpy, lists, DataLoaders, ...: read once, here
        n = dataset_size(dataset)
        if n < 1:
            raise ValueError("dataset is empty: DP-SGD needs at least one example, got 0")
        self.users = _user_index(who, config, users, n)
        if self.users is not None and config.max_examples_per_user > int(self.users.counts.max()):
            most = int(self.users.counts.max())
            warnings.warn(
                f"max_examples_per_user={config.max_examples_per_user} is above the largest "
                f"user's {most} examples: every user's slot is padded to "
                f"{config.max_examples_per_user} rows for nothing; max_examples_per_user={most} "
                "gives the same updates at less cost",
                UserWarning,
                stacklevel=3,
            )
        self.user_column = column
        # the privacy unit's count: the accountant's, the sample rate's and the epochs'
        units = n if self.users is None else self.users.num_users
        if config.epochs is None and (require_epochs or config.target_epsilon is not None):
            why = "plans" if require_epochs else "calibrates target_epsilon for"
            raise ValueError(
                f"{who} {why} config.epochs passes over the data; give DPConfig(epochs=...), "
                "got epochs=None"
            )
        self.distributed, self.rank, self.world_size = _distributed.resolve(distributed)
        self.config = config = config.calibrated(units)
        self.num_examples = n
        self.num_units = units
        self.sample_rate = config.sample_rate(units)
        self.steps_per_epoch = config.steps_per_epoch(units)
        self.total_steps = config.total_steps(units) if config.epochs is not None else None
        self.physical_batch_size = self._physical_batch_size(physical_batch_size)
        if seed is not None:
            check_seed(seed)
        self.adopts_seed = seed is None  # may take a loaded checkpoint's secret seed
        self.seed_is_secret = seed is None  # drawn from the OS CSPRNG, here or by a loaded run
        if seed is None:
            seed = _distributed.shared_secret_seed() if self.distributed else secret_seed()
        if config.secure_noise:  # without cryptography, fail here rather than at the first step
            standard_normal_like({}, seed=seed, step=0, secure=True)
        if self.distributed:
            self._check_ranks_agree(dataset, seed)
        self._seed = seed
        self.lineage = [uuid.uuid4().hex]  # not a secret: names this run's checkpoints
        self.batches = config.sampler(
            dataset,
            self.physical_batch_size,
            seed=seed,
            rank=self.rank,
            world_size=self.world_size,
            users=self.users,
        )
        self._budget_steps: int | None = None
        self._check_budget(stacklevel=4)

    @property
    def seed(self) -> int:
        """The run's secret: it keys the partitions, and the samples and noise until a resume."""
        return self._seed

    @property
    def stream_seed(self) -> int:
        """The secret that keys the samples and the noise of the steps to come (never print it)."""
        return self.batches.seed

    def make_step(self, loss_fn: Any, optimizer: Any, speed: SpeedConfig) -> TrainStep:
        """The run's step: single-process, data-parallel, or sharded (``speed.shard``).

        ``speed.physical_batch_size`` is this plan's (its sampler's), not the step's.

        Raises:
            ValueError: ``shard=True`` in a run that is not distributed.
        """
        speed = dataclasses.replace(speed, physical_batch_size=None)  # the sampler's, read here
        if not self.distributed:
            if speed.shard:
                raise ValueError(
                    "shard=True splits the model over the ranks of a distributed run; this run "
                    "is on one process (launch with torchrun, call dpfunc.distributed.init(), "
                    "and leave distributed=None or True)"
                )
            return make_train_step(loss_fn, optimizer, self.config, speed=speed)
        return _distributed.make_train_step(loss_fn, optimizer, self.config, speed=speed)

    def adopt_seed(self, seed: int) -> None:
        """Takes a loaded run's drawn secret: the partitions are derived again from it."""
        if seed != self.seed:
            self._seed = self.batches.seed = seed
            self.seed_is_secret = True

    def continue_run(self, lineage: list[str]) -> None:
        """Makes this run a new continuation of a loaded one, whose ``lineage`` it extends.

        With a secret seed, the samples and the noise of the steps to come
        are keyed by a fresh secret from the OS CSPRNG (distributed: rank
        0's, broadcast; collective), so no two continuations of one
        checkpoint share a draw, and a crash recovery continues with draws
        no one has seen. A fixed seed keeps its stream: the continuation is
        bit-identical, and public, as the run was.
        """
        self.lineage = [*lineage, uuid.uuid4().hex]
        if self.seed_is_secret:
            fresh = _distributed.shared_secret_seed() if self.distributed else secret_seed()
            self.batches.rekey(fresh)

    def _physical_batch_size(self, size: int | None) -> int:
        # user-level: a micro-batch holds whole users, k rows each (dpfunc.users)
        k = 1 if self.users is None else self.config.max_examples_per_user
        if size is None:
            share = self.config.expected_batch_size / self.world_size  # each rank's share
            size = k * math.ceil(share + 3 * math.sqrt(share))
        check_int("physical_batch_size", size, minimum=1)
        if size % k:
            raise ValueError(
                f"physical_batch_size={size!r} (a PrivateTrainer's per_device_train_batch_size) "
                f"must be a multiple of max_examples_per_user={k}: a micro-batch holds whole "
                f"users, {k} rows each (e.g. {k * max(1, size // k)})"
            )
        if math.ceil(self.num_units / (size // k)) + self.world_size > ACCUMULATED_SUMS:
            raise ValueError(  # the clip margin covers this many float64 additions
                f"physical_batch_size={size!r} could split a logical batch of "
                f"{self.num_units} {self.config.privacy_unit}s into more than "
                f"{ACCUMULATED_SUMS} micro-batches, beyond what the rounding bound of the "
                "clipped sum covers; raise physical_batch_size"
            )
        return size

    def _check_ranks_agree(self, dataset: Any, seed: int) -> None:
        _distributed.check_same_across_ranks(
            {
                "num_examples": self.num_examples,
                "users": self.users_fingerprint(),
                "num_units": self.num_units,
                "config": repr(self.config),
                "seed": seed,
                "physical_batch_size": self.physical_batch_size,
                "total_steps": self.total_steps,
                "dataset": dataset_fingerprint(dataset),
            },
            "the run's settings",
            secret=("seed",),
        )

    def _check_budget(self, stacklevel: int) -> None:
        config = self.config
        if config.epsilon_budget is not None:
            event = config.accounting_event(self.num_units)
            one_step = _epsilon(*event, 1, config.delta, config.accounting, bands=config.bands)
            if one_step > config.epsilon_budget:
                raise ValueError(
                    f"epsilon_budget={config.epsilon_budget!r} at delta={config.delta!r} does not "
                    f"allow a single step: one step already spends epsilon={one_step:.4g}; raise "
                    "the budget or the noise"
                )
        if config.noise_multiplier > config.expected_batch_size:
            warnings.warn(
                f"noise_multiplier={config.noise_multiplier:.6g} exceeds expected_batch_size="
                f"{config.expected_batch_size!r}: the noise on every coordinate of the averaged "
                "update is larger than a whole clipped gradient, so training will hardly move. "
                "Raise target_epsilon or expected_batch_size, or train fewer epochs.",
                stacklevel=stacklevel,
            )

    def last_step(self) -> int | None:
        """The step count the run may reach: ``total_steps``, or fewer within the budget.

        ``None`` when nothing bounds the run (no ``epochs`` and no
        ``epsilon_budget``). All steps are the same ``(noise_multiplier,
        sample_rate)``, so this is computed once.
        """
        config = self.config
        if config.epsilon_budget is None:
            return self.total_steps
        if self._budget_steps is None and self.total_steps is not None:
            self._budget_steps = steps_within_budget(
                config, self.num_units, config.epsilon_budget, config.delta
            )
        elif self._budget_steps is None:  # the budget alone bounds the run
            event = config.accounting_event(self.num_units)
            self._budget_steps = max_steps_within(
                config.epsilon_budget, config.delta, *event, _steps_bound(config, event),
                config.accounting, bands=config.bands,
            )  # fmt: skip
        return self._budget_steps

    def user_description(self) -> str | None:
        """Where the run's user ids come from and what they hold (``None``: examples)."""
        if self.users is None:
            return None
        source = f"column {self.user_column!r}" if self.user_column else "users="
        return (
            f"{self.users.num_users} users ({source}) over {self.num_examples} examples, "
            f"at most {self.config.max_examples_per_user} examples of a user in a step"
        )

    def users_fingerprint(self) -> str | None:
        """A SHA-256 of which rows each user holds (public, as the ids are); ``None``: examples."""
        if self.users is None:
            return None
        digest = hashlib.sha256(self.users.offsets.numpy().tobytes())
        digest.update(self.users.rows.numpy().tobytes())
        return digest.hexdigest()

    def check_next_step(self, done: int) -> None:
        """Raises ``RuntimeError`` if step ``done + 1`` is beyond :meth:`last_step`."""
        limit = self.last_step()
        if limit is not None and done >= limit:
            config = self.config
            reason = (
                f"epsilon_budget={config.epsilon_budget!r} at delta={config.delta!r}"
                if self.total_steps is None or done < self.total_steps
                else f"the planned total_steps={self.total_steps}"
            )
            raise RuntimeError(f"step {done + 1} would exceed {reason}; training is over")


def _steps_bound(config: DPConfig, event: Any) -> int:
    """A step count whose epsilon exceeds the budget (doubled until it does), at most 2**40."""
    steps = 1
    while (
        steps < 2**40
        and _epsilon(*event, steps, config.delta, config.accounting, bands=config.bands)
        <= config.epsilon_budget
    ):
        steps *= 2
    return steps


class PlannedRun:
    """What the Trainer and PrivateGradients share: a plan, an accountant and a train state.

    A subclass sets ``plan`` (a :class:`RunPlan`), ``config`` (its calibrated
    config), ``accountant``, ``state`` (a :class:`dpfunc.TrainState`),
    ``history``, ``nonfinite`` and ``_warned_nonfinite``; this class names
    the run's settings, reports its privacy and releases its steps in order:
    every step is accounted, after its sums and before its release.
    """

    plan: RunPlan
    config: DPConfig
    state: TrainState

    # the run's plan and settings, by their names in the paper and the config
    num_examples = property(lambda self: self.plan.num_examples)
    num_units = property(lambda self: self.plan.num_units)  # users, or examples: the accountant's
    privacy_unit = property(lambda self: self.config.privacy_unit)
    sample_rate = property(lambda self: self.plan.sample_rate)
    steps_per_epoch = property(lambda self: self.plan.steps_per_epoch)
    total_steps = property(lambda self: self.plan.total_steps)
    physical_batch_size = property(lambda self: self.plan.physical_batch_size)
    distributed = property(lambda self: self.plan.distributed)
    rank = property(lambda self: self.plan.rank)
    world_size = property(lambda self: self.plan.world_size)
    adopts_seed = property(lambda self: self.plan.adopts_seed)
    seed_is_secret = property(lambda self: self.plan.seed_is_secret)
    noise_multiplier = property(lambda self: self.config.noise_multiplier)
    accounted_noise_multiplier = property(lambda self: self.config.accounted_noise_multiplier)
    delta = property(lambda self: self.config.delta)
    epsilon_budget = property(lambda self: self.config.epsilon_budget)
    expected_batch_size = property(lambda self: float(self.config.expected_batch_size))
    bands = property(lambda self: self.config.bands)
    secure_noise = property(lambda self: self.config.secure_noise)

    @property
    def seed(self) -> int:
        """The run's secret, which its checkpoints hold and compare (never print it)."""
        return self.plan.seed

    @property
    def stream_seed(self) -> int:
        """The secret that keys the samples and the noise of the steps to come (never print it)."""
        return self.plan.stream_seed

    @property
    def clip_norm(self) -> float:
        """The clip norm of the next step (it moves with adaptive clipping)."""
        return float(self.state.clip_state.clip_norm)

    @property
    def steps_done(self) -> int:
        """Logical steps released, each accounted before its release."""
        return self.accountant.steps

    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far at ``delta`` (default ``self.delta``): the accountant's value.

        Raises:
            ValueError: ``delta`` is not a number in ``(0, 1)``.
        """
        return self.accountant.epsilon(self.delta if delta is None else delta)

    def privacy_report(self, delta: float | None = None) -> PrivacyReport:
        """The run's privacy so far, as text (``str``) and data (``.as_dict()``), at ``delta``.

        See :func:`dpfunc.report.privacy_report`: epsilon, delta, the
        accountant, sigma, q, the steps done and planned, the sampling, the
        noise generator, the seed, and what the guarantee does not cover.
        """
        return privacy_report(self.config, self.accountant, self.num_units,
                              seed_is_secret=self.seed_is_secret, delta=delta,
                              users=self.plan.user_description())  # fmt: skip

    def restore(
        self, state: TrainState, accountant: Any, history: list, seed: int, lineage: list[str]
    ) -> None:
        """Takes a validated checkpoint's contents (:func:`dpfunc.checkpoint.from_state_dict`).

        The run becomes a new continuation of the saved one: with a secret
        seed its samples and noise from here on are freshly keyed (the fork
        rule, :meth:`RunPlan.continue_run`).
        """
        self.plan.adopt_seed(seed)  # a secret drawn by the saved run: partitions derived again
        self.plan.continue_run(lineage)
        self.state, self.accountant, self.history = state, accountant, history

    def _before_release(self, t: int, metrics: dict[str, float]) -> Callable[[ExampleStats], None]:
        """Step ``t``'s check before its release: metrics, non-finite examples, accounting."""

        def before_release(stats: ExampleStats) -> None:
            metrics.update({k: float(v) for k, v in summarize(stats).items()})
            warned = check_nonfinite(metrics, t, self.nonfinite, warn=not self._warned_nonfinite)
            self._warned_nonfinite |= warned
            # accounted before the release: an interruption can only over-count
            self.accountant.step(*self.config.accounting_event(self.num_units))

        return before_release


def _user_index(who: str, config: DPConfig, users: Any, num_examples: int) -> UserIndex | None:
    """The run's users: required with ``privacy_unit="user"``, refused without it."""
    if config.privacy_unit == "user":
        if users is None:
            raise ValueError(
                f"{who}: privacy_unit='user' needs users=, the user id of each example (a "
                "sequence beside the dataset, or the name of its id column), got users=None"
            )
        if isinstance(users, UserIndex):  # indexed already (PrivateTrainer's column)
            if users.rows.numel() != num_examples:
                raise ValueError(
                    f"{who}: users index {users.rows.numel()} rows, the dataset has {num_examples}"
                )
            return users
        return index_users(users, num_examples)
    if users is not None:
        raise ValueError(  # nothing is silently dropped
            f"{who}: users= groups the examples by user for user-level privacy, but the config "
            "protects examples (privacy_unit='example'); give DPConfig(privacy_unit='user', "
            "max_examples_per_user=k) or leave users out"
        )
    return None
