"""Checkpoints of a :class:`dpfunc.Trainer`: save, load, and what makes one resumable.

A checkpoint holds the train state part by part (the parameters, the
optimizer state, the step count, which fixes the sampler and noise streams,
and the states of the clip and noise mechanisms: the clip norm and the
banded noise history), the accountant's history, the run's privacy
settings, the history, the secret seed and the run's lineage. A resumed
run continues the accounting and the state; with a secret seed it draws
its samples and noise afresh (the fork rule, :mod:`dpfunc._plan`), with a
fixed one it ends bit-identical to an uninterrupted run. The sampler's
state is the secret; the partitions are derived again from it on loading. **A checkpoint is as
sensitive as the training data**: with the seed, anyone can remove the noise
from every update it saw. Store it where the data is stored, never next to
the released model.

Loading refuses, naming every difference, a checkpoint written with other
privacy settings, data size or parameter shapes (its accounting holds only
for its own); a checkpoint of an earlier version, with the reason (version
1: keyed with a public default seed; versions 2 and 3: see :data:`VERSION`); and
a seed other than the trainer's, except that a trainer built with
``seed=None`` adopts a checkpoint's seed if that seed was itself a drawn
secret (a fixed one is refused: a run resumed from it would not be private).

One live run per path. The first save to a path (and a Trainer built with
``checkpoint_path``) takes an exclusive lock on ``.<name>.lock`` beside it for as long
as the run lives: a second run on the same path, in this process or
another, is refused before any step. The lock is the operating system's
(``flock``), so a killed process leaves none behind. A save never replaces
another run's record of accounted steps: the file at the path must be this
run's own, or one it continued (its ``lineage`` is a prefix of this run's).

Distributed, :func:`save` and :func:`load` are collective: rank 0 writes,
every rank reads the same file, and all ranks raise together on a failure.

A sharded run (``shard=True``, :mod:`dpfunc.sharding`) writes a directory:
each save is a subdirectory ``step-<steps>-<tag>`` of
``torch.distributed.checkpoint`` files, in which every rank writes its rows
of the parameters, the optimizer state and the noise history (re-cut on
loading, so a checkpoint saved on 2 ranks loads on 4), and rank 0 writes
``dpfunc.pt`` (the settings, the secret seed, the accountant, the step and
the clip state). The file ``latest`` names the complete one: it is replaced
atomically only after every rank has written its part, so a rank that dies
during a save leaves the previous checkpoint in force; older ones are then
removed. The ranks must all see the directory (shared storage).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import warnings
from typing import Any

import optree
import torch

from . import distributed as _distributed
from .accounting import Accountant

__all__ = [
    "STATE_PARTS",
    "VERSION",
    "check_path",
    "from_state_dict",
    "hold",
    "load",
    "save",
    "settings",
    "state_dict",
]

VERSION = 5
"""The checkpoint format. 2: the secret seed and the noise kind. 3: the train state by parts.
4: the same layout, written by the releases whose noise stream has random access by block.
5: with the run's ``lineage`` (an id per continuation), which says whose file a save may replace.

A version 4 checkpoint loads (its lineage is taken as empty, so any run
resumed from it may replace it). Since version 5 a run resumed from a
secret-seeded checkpoint draws fresh samples and noise (the fork rule,
:meth:`dpfunc._plan.RunPlan.continue_run`), so no resume replays a step.

Version 3's releases drew each step's noise from one generator over the
whole tree; version 4's draw it block by block (:data:`dpfunc.noise.NOISE_BLOCK`),
so the same seed and step give other noise. A version 3 checkpoint resumed
here would not continue its run bit for bit: a step replayed after the
checkpoint (one the interrupted run had already computed, and may have
shown) would be released again with other noise, and accounted once. It is
refused, with the reason.

Version 3 stores each part of the train state (``params``, ``opt_state``,
``step``, ``clip_state``, ``noise_state``) under its name, so a part whose
layout changed is named, never read as another. Version 2 stored the state
as one flat list of tensors, and the releases that wrote it rounded the
noisy sum differently (some before the logical batch's sum was float64,
some after), which the file does not record: resuming one would not
continue the same run bit for bit, so it is refused. Its accounting stays
valid for what it released; start a new run.
"""

STATE_PARTS = ("params", "opt_state", "step", "clip_state", "noise_state")


LATEST = "latest"  # in a sharded checkpoint's directory: the name of its complete save


def exists(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a checkpoint: a file, or a sharded directory with a complete save."""
    if os.path.isdir(path):
        return os.path.exists(os.path.join(path, LATEST))
    return os.path.exists(path)


def check_path(path: Any) -> None:
    """Fails now, not at the first save, if checkpoints cannot be written at ``path``.

    A directory is accepted if it holds a sharded checkpoint (a file
    ``latest`` and its saves), a first save that never completed, or nothing.
    """
    if not isinstance(path, str | os.PathLike):
        raise TypeError(
            f"checkpoint_path must be a str or os.PathLike, got checkpoint_path={path!r}"
        )
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) and all(
        name == LATEST or name.startswith(("step-", ".dpfunc-")) for name in os.listdir(path)
    ):  # a sharded checkpoint, one whose first save was interrupted, or an empty directory
        return
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


def settings(trainer: Any) -> dict[str, Any]:
    """The settings a resumed run must share with the saved one (the seed is compared apart)."""
    config = trainer.config
    return {
        "num_examples": trainer.num_examples,
        "expected_batch_size": float(config.expected_batch_size),
        "sample_rate": trainer.sample_rate,
        "noise_multiplier": float(config.noise_multiplier),
        "clip_norm": float(config.clip_norm),
        "clipping": config.clipping,
        "target_quantile": config.target_quantile,
        "quantile_learning_rate": float(config.quantile_learning_rate),
        "count_noise_multiplier": config.count_noise_multiplier,
        "bands": config.bands,
        "seed": trainer.seed,
        "secure_noise": config.secure_noise,
        "accounting": config.accounting,
        "delta": config.delta,
        "physical_batch_size": trainer.physical_batch_size,
        "privacy_unit": config.privacy_unit,
        "max_examples_per_user": config.max_examples_per_user,
        "users": trainer.plan.users_fingerprint(),
    }


def hold(trainer: Any, path: str | os.PathLike) -> bool:
    """Makes ``trainer`` the one live run on ``path``, for as long as it lives.

    Takes an exclusive ``flock`` on ``.<name>.lock`` beside ``path`` (owner-only) and
    keeps it open on the trainer; the operating system releases it when
    the trainer is collected or its process ends, killed or not.
    Distributed: collective; rank 0 holds the lock, and all ranks raise
    together if it is taken. Holding it again is a no-op.

    Returns whether this call took the lock (rank 0's answer; ``False`` elsewhere).

    Raises:
        ValueError: another live run (a Trainer in this process or another
            process) holds ``path``.
    """
    error, taken = None, False
    if trainer.rank == 0:
        try:
            taken = _lock(trainer, path)
        except ValueError as caught:
            error = caught
    _rank0_outcome(trainer, error, f"the lock on checkpoint_path={os.fspath(path)!r}")
    return taken


def _release(trainer: Any, path: str | os.PathLike) -> None:
    handle = trainer.__dict__.get("_checkpoint_locks", {}).pop(os.path.realpath(path), None)
    if handle is not None:
        handle.close()


def release_all(trainer: Any) -> None:
    """Lets go of every checkpoint path ``trainer`` holds (:func:`hold`); it may save no more."""
    for handle in trainer.__dict__.pop("_checkpoint_locks", {}).values():
        if handle is not None:
            handle.close()


def _lock(trainer: Any, path: str | os.PathLike) -> bool:
    locks = trainer.__dict__.setdefault("_checkpoint_locks", {})
    key = os.path.realpath(path)
    if key in locks:
        return False
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock to take
        warnings.warn(
            "this platform has no flock: two runs on one checkpoint_path are not prevented; "
            "give each run its own path",
            stacklevel=4,
        )
        locks[key] = None
        return True
    folder, name = os.path.split(key)
    handle = open(os.path.join(folder, f".{name}.lock"), "a+b")  # noqa: SIM115 (held for life)
    os.chmod(handle.name, 0o600)
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        handle.close()
        raise ValueError(
            f"checkpoint_path={os.fspath(path)!r} is held by another live run (a Trainer in "
            "this or another process): two runs on one path would overwrite each other's "
            "record of accounted steps. Give this run another path, or end the other one "
            "(trainer.close(), or del trainer) and build this one again to resume it"
        ) from error
    locks[key] = handle
    return True


def _rank0_outcome(trainer: Any, error: Exception | None, what: str) -> None:
    """Raises ``error`` (rank 0's) on this process; distributed, on every rank together."""
    if trainer.distributed:
        flags = _distributed.gather_flags(error is None, f"the check of {what}", trainer.steps_done)
        if error is None and not flags[0]:
            raise ValueError(f"rank 0 refused {what}; see its log")
    if error is not None:
        raise error


def _signature(path: str | os.PathLike) -> tuple | None:
    """What changes when anyone writes the checkpoint at ``path`` (``None``: there is none)."""
    target = os.path.join(path, LATEST) if os.path.isdir(path) else path
    try:
        info = os.stat(target)
    except FileNotFoundError:
        return None
    return (info.st_ino, info.st_mtime_ns, info.st_size)


def _check_overwrite(trainer: Any, path: str | os.PathLike) -> None:
    """Refuses to replace a checkpoint that is not this run's, nor one it continued.

    The file at ``path`` is read unless this run wrote it last (its
    signature unchanged since), so a run saving every epoch reads it once.
    """
    if trainer.step_fn.sharded and os.path.exists(path) and not os.path.isdir(path):
        return  # refused by the sharded save, which needs a directory
    signature = _signature(path)
    written = trainer.__dict__.setdefault("_checkpoints_written", {})
    if signature is None or written.get(os.path.realpath(path)) == signature:
        return
    try:
        if os.path.isdir(path):
            with open(os.path.join(path, LATEST)) as f:
                target = os.path.join(path, f.read().strip(), "dpfunc.pt")
            saved = _torch_load(target)
        else:
            saved = _torch_load(path)
        steps = sum(int(entry[2]) for entry in saved["accountant"]["history"])
        lineage = _lineage(path, saved) if saved.get("version") in (4, VERSION) else None
    except Exception as error:
        raise ValueError(
            f"checkpoint_path={os.fspath(path)!r} holds a file that is not a readable dpfunc "
            "checkpoint; it is not overwritten. Give another path, or remove it yourself"
        ) from error
    mine = trainer.plan.lineage
    if lineage is not None and lineage == mine[: len(lineage)] and steps > trainer.steps_done:
        raise ValueError(
            f"checkpoint_path={os.fspath(path)!r} holds {steps} accounted steps of this run's "
            f"line, more than the {trainer.steps_done} this run has done (it continued an "
            "earlier copy): saving would erase the record of steps already released. Give "
            "this run another path"
        )
    if lineage is None or lineage != mine[: len(lineage)]:
        raise ValueError(
            f"checkpoint_path={os.fspath(path)!r} holds another run's checkpoint ({steps} "
            "accounted steps), "
            "not this run's nor one it continued: saving would erase that run's record of "
            "what it released. Give this run another path, or build it with "
            "checkpoint_path=that path to continue that run"
        )


def _wrote(trainer: Any, path: str | os.PathLike) -> None:
    written = trainer.__dict__.setdefault("_checkpoints_written", {})
    written[os.path.realpath(path)] = _signature(path)


def save(trainer: Any, path: str | os.PathLike) -> None:
    """Writes ``trainer``'s checkpoint atomically: a temporary file, then a rename.

    The path is this run's from the first save on (:func:`hold`), and the
    file there is replaced only if this run wrote it or continued it.
    Distributed: collective, call it on every rank. Rank 0 writes (the
    ranks' states are identical); then all ranks wait until the file is
    complete, and all raise if rank 0 failed to write it.

    Raises:
        ValueError: another live run holds ``path``, or ``path`` holds
            another run's checkpoint or a file that is not a checkpoint.
    """
    taken = hold(trainer, path)
    error = None
    if trainer.rank == 0:
        try:
            _check_overwrite(trainer, path)
        except ValueError as caught:
            error = caught
            if taken:  # a refused save leaves the path to whoever it belongs to
                _release(trainer, path)
    _rank0_outcome(trainer, error, f"checkpoint_path={os.fspath(path)!r}")
    if not trainer.distributed:
        _write(trainer, path)
        _wrote(trainer, path)
        return
    if trainer.step_fn.sharded:
        _save_sharded(trainer, path)
        if trainer.rank == 0:
            _wrote(trainer, path)
        return
    error = None
    if trainer.rank == 0:
        try:
            _write(trainer, path)
            _wrote(trainer, path)
        except Exception as caught:
            error = caught
    flags = _distributed.gather_flags(
        error is None,
        f"the barrier after rank 0 saved checkpoint {os.fspath(path)!r}",
        step=trainer.steps_done,
    )
    if error is not None:
        raise error
    if not flags[0]:
        raise RuntimeError(f"rank 0 failed to write checkpoint {os.fspath(path)!r}; see its log")


def state_dict(trainer: Any, parts: tuple[str, ...] = STATE_PARTS) -> dict[str, Any]:
    """What a checkpoint holds: the settings, the secret seed, the accountant and ``parts``.

    ``parts`` names the parts of ``trainer.state`` stored (each as its list
    of tensors); :class:`dpfunc.PrivateGradients`, whose parameters and
    optimizer live in the user's model and ``torch.optim`` optimizer,
    stores the step and the mechanisms' states only. Plain Python and
    tensors: ``torch.save`` / ``torch.load(weights_only=True)`` take it.
    """
    return {
        "version": VERSION,
        "config": settings(trainer),
        "state": {part: _stored(part, getattr(trainer.state, part)) for part in parts},
        "accountant": trainer.accountant.state_dict(),
        "history": trainer.history,
        "seed_secret": trainer.seed_is_secret,
        "lineage": list(trainer.plan.lineage),
    }


def from_state_dict(
    trainer: Any, checkpoint: Any, where: str, parts: tuple[str, ...] = STATE_PARTS
) -> tuple[Any, Accountant, list, int, list[str]]:
    """Validates :func:`state_dict`'s output for ``trainer``; changes nothing.

    Returns ``(state, accountant, history, seed, lineage)`` for ``trainer.restore``:
    ``trainer.state`` with ``parts`` replaced by the saved ones. ``where``
    names the checkpoint in messages (a path, or ``"state_dict"``).

    Raises:
        ValueError: the checkpoint is of another version, seed or settings
            (each difference named), or malformed.
    """
    try:
        _check_seed(trainer, where, checkpoint)
        _check_settings(trainer, where, checkpoint["config"])
        state = _state(trainer, where, checkpoint, parts)
        _check_not_behind(trainer, where, state[1].steps)
        return (*state, _lineage(where, checkpoint))
    except ValueError:
        raise
    except Exception as error:  # missing keys, wrong types: a malformed checkpoint
        raise ValueError(
            f"checkpoint {os.fspath(where)!r} is malformed: {type(error).__name__}: {error}"
        ) from error


def _write(trainer: Any, path: str | os.PathLike) -> None:
    checkpoint = state_dict(trainer)
    _atomic_write(os.fspath(path), lambda f: torch.save(checkpoint, f))


def load(trainer: Any, path: str | os.PathLike) -> None:
    """Restores a checkpoint written by :func:`save` of an identically set-up run.

    Distributed: collective, call it on every rank; every rank reads the
    same file (so ``path`` must be on storage all ranks see), and all ranks
    raise if any rank could not load it or the ranks read different files.
    A checkpoint may be resumed with another number of ranks: the logical
    batches and the noise do not depend on it (the sums then differ only in
    float rounding).

    Raises:
        ValueError: the file is unreadable or corrupted, or it was written by
            a run with other privacy settings, data size or parameter shapes;
            distributed, also when another rank failed to load it or read a
            different file. The trainer is left unchanged.
    """
    if trainer.step_fn.sharded:
        _load_sharded(trainer, path)
        return
    if os.path.isdir(path):  # every rank sees the same: all raise, without a collective
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} is a sharded checkpoint (a directory); load it into "
            "a Trainer built with distributed=True, shard=True"
        )
    if not trainer.distributed:
        trainer.restore(*_read(trainer, path))
        return
    error = loaded = None
    try:
        loaded = _read(trainer, path)
    except ValueError as caught:
        error = caught
    _all_read(error, path)
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    _distributed.check_same_across_ranks(
        {"steps": loaded[1].steps, "sha256": digest},
        f"checkpoint {os.fspath(path)!r} as read by each rank",
    )
    trainer.restore(*loaded)


def _all_read(error: ValueError | None, path: str | os.PathLike) -> None:
    """Raises on every rank unless every rank read the checkpoint (``error``: this rank's)."""
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


def _read(trainer: Any, path: str | os.PathLike) -> tuple[Any, Accountant, list, int]:
    """Reads and validates a checkpoint; changes nothing.

    Raises ValueError for every kind of bad file, so that in a distributed
    run every rank reaches the collective that compares the outcomes.
    """
    return from_state_dict(trainer, _torch_load(path), path)


def _torch_load(path: str | os.PathLike) -> Any:
    """``torch.load`` of a checkpoint file; a file that is not one raises ``ValueError``.

    torch's own message for a damaged file suggests ``weights_only=False``,
    which would not repair it (and would run code from the file): the
    message says what the file is instead.
    """
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as error:  # torch raises many types for a bad file
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} is unreadable: it is damaged (truncated or "
            "overwritten) or not a dpfunc checkpoint (torch.load said "
            f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}). "
            "Resume from an intact copy, or give another checkpoint_path to start a new run"
        ) from error


def _check_seed(trainer: Any, path: str | os.PathLike, checkpoint: Any) -> None:
    version = checkpoint.get("version") if isinstance(checkpoint, dict) else None
    if version == 1:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} was written by an earlier dpfunc (checkpoint "
            "version 1), whose Trainer keyed its noise and batches with a public default "
            "(seed=0, public) unless given another seed: whoever knows it can remove the "
            "noise of that run, and this version draws noise and batches differently, so it "
            "cannot be resumed bit-identically. Start a new run."
        )
    if version == 2:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} was written by an earlier dpfunc (checkpoint "
            "version 2), which stored the train state as one flat list of tensors; this "
            "version stores the clip and noise mechanisms' states by name, and the releases "
            "that wrote version 2 rounded the noisy sum differently without recording which "
            "did, so it cannot be resumed bit-identically. Its epsilon still holds for what it "
            "released; start a new run."
        )
    if version == 3:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} was written by an earlier dpfunc (checkpoint "
            "version 3), whose noise came from one generator per step; this version draws it "
            "block by block (so that each rank of a sharded run draws its own rows), so the same "
            "seed gives other noise and the run cannot be resumed bit-identically: a step "
            "replayed after the checkpoint would be released again with other noise. Its "
            "epsilon still holds for what it released; finish it with the release that wrote "
            "it, or start a new run."
        )
    if version not in (4, VERSION):
        raise ValueError(f"{os.fspath(path)!r} is not a dpfunc checkpoint (version {VERSION})")
    seed, secret = checkpoint["config"]["seed"], checkpoint["seed_secret"]
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"checkpoint {os.fspath(path)!r} holds no valid seed")
    if not isinstance(secret, bool):
        raise ValueError(f"checkpoint {os.fspath(path)!r} holds no valid seed_secret flag")
    if seed != trainer.seed and not trainer.adopts_seed:
        raise ValueError(  # neither seed is printed: both are secrets
            f"checkpoint {os.fspath(path)!r} was written with another seed than the one "
            "this trainer was given; build the trainer with seed=None to resume it"
        )
    if seed != trainer.seed and not secret:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} was written with a fixed seed, which is not a "
            "secret: a run resumed from it is not private, whoever knows the seed can remove "
            "its noise. To continue it as the reproducible run it is, build the trainer with "
            "that seed; for a private run, start anew with seed=None."
        )


def _lineage(where: str | os.PathLike, checkpoint: dict[str, Any]) -> list[str]:
    """The saved run's continuation ids (a version 4 checkpoint has none)."""
    lineage = checkpoint.get("lineage", [])
    if not isinstance(lineage, list) or not all(isinstance(i, str) for i in lineage):
        raise ValueError(f"checkpoint {os.fspath(where)!r} holds no valid lineage")
    return list(lineage)


def _check_not_behind(trainer: Any, where: str | os.PathLike, saved_steps: int) -> None:
    """Refuses a checkpoint behind the steps this trainer has already released.

    Loading it would release those steps again, with the same noise (keyed by
    the seed and the step), and account them once: if the second release
    differs from the first at all, the difference holds no noise.
    """
    done = trainer.steps_done
    if saved_steps < done:
        raise ValueError(
            f"checkpoint {os.fspath(where)!r} holds {saved_steps} steps, but this run has already "
            f"released {done}: loading it would release steps {saved_steps + 1} to {done} again "
            "with the same noise. A run does not go back; resume a checkpoint in a new Trainer "
            "or PrivateGradients"
        )


def _check_settings(trainer: Any, path: str | os.PathLike, saved: dict[str, Any]) -> None:
    differences = [
        f"{key}={_saved_setting(saved, key, value)!r} (this trainer: {value!r})"
        for key, value in settings(trainer).items()
        if key != "seed" and _saved_setting(saved, key, value) != value
    ]
    if differences:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} belongs to a run with other settings, and its "
            "accounting holds only for its own; it was written with " + ", ".join(differences)
        )


def _state(trainer: Any, path: str | os.PathLike, checkpoint: Any, parts: tuple[str, ...]) -> tuple:
    saved = checkpoint["state"]  # not a dict, or a part missing: malformed (see _read)
    if not isinstance(saved, dict) or set(saved) != set(parts):
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} holds the train state parts "
            f"{sorted(saved) if isinstance(saved, dict) else saved!r}, not {sorted(parts)}: "
            "a Trainer's checkpoint and a PrivateGradients state_dict are not interchangeable"
        )
    parts = {part: _part(trainer, path, part, saved[part]) for part in parts}
    accountant = trainer.config.accountant()
    accountant.load_state_dict(checkpoint["accountant"])
    state = trainer.state._replace(**parts)
    if int(state.step) != accountant.steps:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} is inconsistent: {int(state.step)} optimizer "
            f"steps but {accountant.steps} accounted steps"
        )
    return state, accountant, list(checkpoint["history"]), checkpoint["config"]["seed"]


def _stored(part: str, tree: Any) -> list[torch.Tensor]:
    """The tensors a checkpoint stores for one part of the state: its leaves.

    The clip state's: its clip norm, 0-d. The state holds it 1-element
    (:class:`dpfunc.clipping.ClipState`); the file keeps the earlier releases'
    0-d form, so checkpoints load across them both ways.
    """
    return [tree.clip_norm] if part == "clip_state" else optree.tree_leaves(tree)


def _part(trainer: Any, path: str | os.PathLike, part: str, leaves: Any) -> Any:
    """One part of the saved state, in the structure of the trainer's own, on its devices."""
    mine = getattr(trainer.state, part)
    current = _stored(part, mine)
    if (
        not isinstance(leaves, list)
        or len(leaves) != len(current)
        or any(
            not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype
            for a, b in zip(leaves, current)
        )
    ):
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} holds a train state whose {part} tensors do not "
            "match this trainer's (their number, shapes or dtypes differ)"
        )
    # each rank's own device, in the state's shapes
    leaves = [a.to(b.device).reshape(b.shape) for a, b in zip(leaves, optree.tree_leaves(mine))]
    return optree.tree_unflatten(optree.tree_structure(mine), leaves)


def _saved_setting(saved: dict[str, Any], key: str, ours: Any) -> Any:
    """A checkpoint's setting; those added later have the value the earlier runs had."""
    if key in saved:
        return saved[key]
    if key == "bands":  # before correlated noise: DP-SGD
        return 1
    if key == "privacy_unit":  # before user-level privacy: examples
        return "example"
    if key == "expected_batch_size":  # implied by the sample rate, which is compared
        return ours
    return None


# --------------------------------------------------------------------------- sharded runs

_SHARDED_PARTS = ("params", "opt_state", "noise_state")  # each rank's rows, through DCP
_REPLICATED_PARTS = ("step", "clip_state")  # the same on every rank: in rank 0's dpfunc.pt


def _sharded_parts(trainer: Any, *, fresh: bool = False) -> dict[str, dict[str, torch.Tensor]]:
    """The cut parts of ``trainer.state`` as DTensors, for torch.distributed.checkpoint.

    ``fresh``: empty tensors of the same layout, to load into (a failed load
    then leaves the trainer's own state untouched).
    """
    from .sharding import as_dtensors

    dims = _part_dims(trainer)
    parts = {}
    for part in _SHARDED_PARTS:
        tree = getattr(trainer.state, part)
        if fresh:
            tree = optree.tree_map(torch.empty_like, tree)
        device = optree.tree_leaves(trainer.state.params)[0].device
        parts[part] = as_dtensors(tree, dims[part], device)
    return parts


def _part_dims(trainer: Any) -> dict[str, list]:
    """For each cut part, each leaf's ``(whole shape, cut dim)`` or ``None`` (held whole)."""
    from .sharding import state_dims

    step = trainer.step_fn
    layout = step.collectives.layout()
    inits = {
        "params": lambda rows: rows,
        "opt_state": step.optimizer.init,
        "noise_state": step.noise_mechanism.init,
    }
    return {part: state_dims(inits[part], layout) for part in _SHARDED_PARTS}


def _part_shapes(trainer: Any) -> dict[str, list]:
    """Each cut part's leaves as ``[whole shape, dtype]``: what a loading run must match."""
    dims = _part_dims(trainer)
    return {
        part: [
            [list(dim[0]) if dim is not None else list(leaf.shape), str(leaf.dtype)]
            for leaf, dim in zip(optree.tree_leaves(getattr(trainer.state, part)), dims[part])
        ]
        for part in _SHARDED_PARTS
    }


def _dcp(trainer: Any, what: str, fn: Any, error: type[Exception]) -> None:
    """Runs a torch.distributed.checkpoint call; its failures become ``error`` on every rank.

    A failure on any rank reaches every rank as a ``CheckpointException`` (a
    ``BaseException``, which ``except Exception`` would miss); a collective
    that fails outright becomes a :class:`~dpfunc.distributed.CollectiveError`.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        _distributed._collective(what, trainer.steps_done, fn)
    except CheckpointException as failure:
        raise error(f"{what} failed: {failure}") from failure


def _save_sharded(trainer: Any, path: str | os.PathLike) -> None:
    import shutil
    import uuid

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    path = os.fspath(path)
    name = [f"step-{trainer.steps_done:09d}-{uuid.uuid4().hex[:8]}" if trainer.rank == 0 else ""]
    _distributed._collective(
        "broadcast of the checkpoint's name", trainer.steps_done,
        lambda: dist.broadcast_object_list(name, src=0),
    )  # fmt: skip
    target = os.path.join(path, name[0])
    error = None
    if trainer.rank == 0:  # owner-only: the noise history and the seed are secrets
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
            os.makedirs(target, mode=0o700)
        except OSError as caught:  # a file at path, no permission: every rank raises
            error = caught
    flags = _distributed.gather_flags(
        error is None, f"the check that rank 0 created {target!r}", trainer.steps_done
    )
    if error is not None:
        raise ValueError(
            f"checkpoint_path={path!r} must be a directory for a sharded run (or not exist "
            f"yet): {error}"
        ) from error
    if not flags[0]:
        raise ValueError(f"rank 0 could not create the sharded checkpoint {path!r}; see its log")
    seen = _distributed.gather_flags(
        os.path.isdir(target), f"the check that every rank sees {target!r}", trainer.steps_done
    )
    if not all(seen):
        blind = [r for r, ok in enumerate(seen) if not ok]
        raise ValueError(
            f"ranks {blind} do not see the directory {target!r} that rank 0 created: a sharded "
            "checkpoint_path must be on storage every rank shares (the same path on every node)"
        )
    what = f"torch.distributed.checkpoint save into {target!r}"
    _dcp(trainer, what, lambda: dcp.save(_sharded_parts(trainer), checkpoint_id=target), OSError)
    for written in os.listdir(target):  # each rank its own files: its rows are secret too
        if written.startswith(f"__{trainer.rank}_"):
            os.chmod(os.path.join(target, written), 0o600)
    error = None
    if trainer.rank == 0:  # every rank's rows are written: make this save the checkpoint
        try:
            for written in os.listdir(target):
                os.chmod(os.path.join(target, written), 0o600)
            meta = state_dict(trainer, _REPLICATED_PARTS)
            meta["parts"] = _part_shapes(trainer)
            _atomic_write(os.path.join(target, "dpfunc.pt"), lambda f: torch.save(meta, f))
            _atomic_write(os.path.join(path, LATEST), lambda f: f.write(name[0].encode()))
            for old in os.listdir(path):
                if old.startswith("step-") and old != name[0]:
                    shutil.rmtree(os.path.join(path, old), ignore_errors=True)
        except Exception as caught:
            error = caught
    flags = _distributed.gather_flags(
        error is None, f"the barrier after rank 0 completed checkpoint {path!r}", trainer.steps_done
    )
    if error is not None:
        raise error
    if not flags[0]:
        raise RuntimeError(f"rank 0 failed to complete checkpoint {path!r}; see its log")


def _atomic_write(path: str, write: Any) -> None:
    """``write(f)`` into a temporary file beside ``path``, on disk, then renamed over it.

    The file is the owner's only (``mkstemp``'s 0600); a reader sees the old
    file or the whole new one, never a part.
    """
    directory = os.path.dirname(os.path.abspath(path))
    handle, tmp = tempfile.mkstemp(dir=directory, prefix=".dpfunc-", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _read_sharded_meta(trainer: Any, path: str) -> tuple[str, tuple]:
    """The complete save's directory and its validated replicated parts; changes nothing."""
    try:
        with open(os.path.join(path, LATEST)) as f:
            target = os.path.join(path, f.read().strip())
        meta = torch.load(os.path.join(target, "dpfunc.pt"), weights_only=True, map_location="cpu")
    except Exception as error:
        raise ValueError(f"checkpoint {path!r} is unreadable: {error}") from error
    loaded = from_state_dict(trainer, meta, path, _REPLICATED_PARTS)
    mine = _part_shapes(trainer)
    for part, leaves in mine.items():
        saved = meta.get("parts", {}).get(part)
        if saved != leaves:
            raise ValueError(
                f"checkpoint {path!r} holds a train state whose {part} tensors do not match this "
                f"trainer's (their number, whole shapes or dtypes differ): saved {saved}, this "
                f"trainer's {leaves}"
            )
    return target, loaded


def _load_sharded(trainer: Any, path: str | os.PathLike) -> None:
    import torch.distributed.checkpoint as dcp

    from .sharding import from_dtensors

    path = os.fspath(path)
    error = None
    try:
        target, loaded = _read_sharded_meta(trainer, path)
    except ValueError as caught:
        error, target = caught, ""
    _all_read(error, path)
    _distributed.check_same_across_ranks({"save": os.path.basename(target)}, f"checkpoint {path!r}")
    parts = _sharded_parts(trainer, fresh=True)  # this run's layout: DCP re-cuts the saved rows
    what = f"torch.distributed.checkpoint load from {target!r}"
    _dcp(trainer, what, lambda: dcp.load(parts, checkpoint_id=target), ValueError)
    state, *rest = loaded
    state = state._replace(
        **{part: from_dtensors(getattr(state, part), parts[part]) for part in _SHARDED_PARTS}
    )
    trainer.restore(state, *rest)
