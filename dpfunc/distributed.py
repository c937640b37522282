"""Data-parallel DP-SGD over ``torch.distributed`` (gloo on CPU, NCCL on GPU).

Every rank holds the whole model and a share of each logical batch
(:class:`dpfunc.data.PoissonBatches` with ``rank`` and ``world_size``). A rank
computes the clipped sum of its share, one all-reduce adds the ranks' sums,
and every rank adds the same noise, drawn from the shared secret ``(seed,
step)`` with no broadcast, divides by the global expected batch size and
applies the same update: the ranks' parameters stay bit-identical, and a step
is the single-process one up to the order of float additions.

Main names: :func:`init` and :func:`shutdown` (the process group, with the
timeout of every collective), :func:`shared_secret_seed` (rank 0 draws the
secret and broadcasts it), :func:`make_train_step` (a :class:`dpfunc.TrainStep`
with these collectives injected; ``shard=True``: :mod:`dpfunc.sharding`), and
:class:`CollectiveError`, raised when a rank dies or hangs.

Privacy: the noise is added once, after the all-reduce, to the clipped sum of
the whole logical batch, and the accountant counts one step per logical batch
at the whole dataset's ``sample_rate``: the single-process mechanism. Every
rank must hold the same secret seed. The step metrics gather every rank's
per-example statistics and are NOT private.

The step on ``W`` ranks, the split of a batch, why the noise needs no
broadcast, failures and timeouts, ``torch.compile`` and a full loop under
``torchrun``: see docs/distributed.md, from "One step on W ranks" to
"torch.compile".
"""

from __future__ import annotations

import datetime
import hashlib
import math
import os
from collections.abc import Callable, Collection, Mapping
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from . import optim
from .clipper import ExampleStats
from .config import DPConfig, SpeedConfig, settings_from
from .noise import SECRET_BITS, secret_seed
from .per_sample import LossFn
from .sharding import DrawnNoise, Sharding, check_elementwise, require_fsdp2
from .step import Collectives, TrainStep
from .tree import Params, PyTree, tree_leaves, tree_structure

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "CollectiveError",
    "ProcessInfo",
    "all_reduce_sum",
    "check_same_across_ranks",
    "collectives",
    "gather_flags",
    "gather_stats",
    "init",
    "is_initialized",
    "make_train_step",
    "rank_and_world_size",
    "resolve",
    "shared_secret_seed",
    "sharded_collectives",
    "shutdown",
]

DEFAULT_TIMEOUT_S = 300.0
"""Seconds a collective waits for the other ranks before failing (``init``'s default)."""

_timeout_s: float | None = None  # the timeout init() set, for error messages

T = TypeVar("T")


class CollectiveError(RuntimeError):
    """A collective failed: another rank probably died, hangs, or diverged."""


class ProcessInfo(NamedTuple):
    rank: int  # this process's rank, in [0, world_size)
    world_size: int  # the number of processes
    device: torch.device  # where this rank computes: cuda:LOCAL_RANK with nccl, else cpu


# --------------------------------------------------------------------------- process group


def init(
    backend: str | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> ProcessInfo:
    """Initialises the default process group, with a timeout on every collective.

    Under ``torchrun --nproc-per-node N script.py`` call it with no
    arguments (besides ``timeout_s``): torchrun sets ``MASTER_ADDR``,
    ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``, which the
    default ``env://`` rendezvous reads.

    Args:
        backend: ``"gloo"`` or ``"nccl"``; ``None`` picks ``"nccl"`` when
            CUDA is available and ``"gloo"`` otherwise.
        timeout_s: seconds a collective (and the rendezvous) waits for the
            other ranks before raising. It must exceed the longest time one
            rank may work between two collectives while the others wait
            (the first ``torch.compile``, evaluation, checkpoint writes).
            A dead rank is usually detected sooner, when its connection
            closes; a hung one only by this timeout.
        init_method: a rendezvous URL such as ``"tcp://10.0.0.1:29500"``;
            ``None`` means ``"env://"``.
        rank, world_size: override ``RANK`` and ``WORLD_SIZE``.

    Returns:
        :class:`ProcessInfo` ``(rank, world_size, device)``. With NCCL the
        current CUDA device is set to ``cuda:LOCAL_RANK`` first.

    Raises:
        ValueError: ``timeout_s`` is not a finite number > 0, or an unknown
            ``backend``.
        RuntimeError: ``torch.distributed`` is unavailable, a process group
            is already initialised (call :func:`shutdown` first), the
            ``env://`` variables are missing (launch with ``torchrun``), or
            the rendezvous failed.
    """
    global _timeout_s
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not 0 < timeout_s < math.inf
    ):
        raise ValueError(f"timeout_s must be a finite number > 0, got timeout_s={timeout_s!r}")
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build of torch")
    if dist.is_initialized():
        raise RuntimeError(
            "a torch.distributed process group is already initialised; call "
            "dpfunc.distributed.shutdown() before init() again"
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or None, got backend={backend!r}")
    if init_method is None or init_method == "env://":
        needed = ["MASTER_ADDR", "MASTER_PORT"]
        needed += ["RANK"] if rank is None else []
        needed += ["WORLD_SIZE"] if world_size is None else []
        missing = [name for name in needed if name not in os.environ]
        if missing:
            raise RuntimeError(
                f"environment variables {missing} are not set: launch with "
                "`torchrun --nproc-per-node N script.py`, or set MASTER_ADDR, MASTER_PORT, "
                "RANK and WORLD_SIZE, or pass init_method, rank and world_size"
            )
    device = torch.device("cpu")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("backend='nccl' needs CUDA; use backend='gloo' on CPU")
        local_rank = int(os.environ.get("LOCAL_RANK", rank if rank is not None else 0))
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(
            backend,
            init_method=init_method,
            timeout=datetime.timedelta(seconds=timeout_s),
            rank=-1 if rank is None else rank,
            world_size=-1 if world_size is None else world_size,
        )
    except RuntimeError as error:
        raise RuntimeError(
            f"dpfunc.distributed.init: the {backend} rendezvous failed within "
            f"timeout_s={timeout_s}: {error}. Check MASTER_ADDR/MASTER_PORT and that every "
            "rank was started."
        ) from error
    _timeout_s = float(timeout_s)
    return ProcessInfo(dist.get_rank(), dist.get_world_size(), device)


def shutdown() -> None:
    """Destroys the default process group, if any (call at the end of a script)."""
    global _timeout_s
    if is_initialized():
        dist.destroy_process_group()
    _timeout_s = None


def is_initialized() -> bool:
    """Whether a default ``torch.distributed`` process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank_and_world_size() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group; ``(0, 1)`` without one."""
    if not is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def resolve(distributed: bool | None) -> tuple[bool, int, int]:
    """``(distributed, rank, world_size)`` for a ``distributed`` argument.

    ``None`` means "exactly when a process group is initialised".

    Raises:
        ValueError: ``distributed=True`` without a process group.
    """
    if distributed is None:
        distributed = is_initialized()
    elif distributed and not is_initialized():
        raise ValueError(
            "distributed=True needs an initialised torch.distributed process group; call "
            "dpfunc.distributed.init() first (launch with torchrun)"
        )
    if not distributed:
        return False, 0, 1
    return (True, *rank_and_world_size())


def _require_group(who: str) -> None:
    if not is_initialized():
        raise RuntimeError(
            f"{who} needs an initialised torch.distributed process group; call "
            "dpfunc.distributed.init() first (and launch with torchrun)"
        )


# --------------------------------------------------------------------------- collectives


def _collective(what: str, step: int | Tensor | None, fn: Callable[[], T]) -> T:
    """Runs ``fn`` (a collective); turns a backend failure into a :class:`CollectiveError`.

    ``step`` may be a 0-d tensor: it is read only if the collective fails.
    """
    try:
        return fn()
    except RuntimeError as error:  # DistBackendError / DistNetworkError are RuntimeErrors
        rank, world_size = rank_and_world_size()
        at = "" if step is None else f" at step {int(step)}"
        timeout = (
            f"timeout_s={_timeout_s:g}" if _timeout_s is not None else "the process group's timeout"
        )
        raise CollectiveError(
            f"dpfunc.distributed: {what}{at} failed on rank {rank} of {world_size}. "
            "Another rank has probably died or hangs (or stopped calling the same "
            "collectives, e.g. after an exception); check the other ranks' logs. A dead "
            f"rank fails the collective when its connection closes, a hung one after "
            f"{timeout} (set it with dpfunc.distributed.init(timeout_s=...)). "
            f"Cause: {error}"
        ) from error


def _small_device() -> torch.device:
    """The device of small bookkeeping tensors: NCCL only moves CUDA tensors."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(
    tree: PyTree, *, step: int | Tensor | None = None, what: str | None = None
) -> PyTree:
    """The sum of ``tree`` over all ranks, as a new tree (the input is not changed).

    Leaves are packed into one flat buffer per (dtype, device), so a model
    costs one all-reduce per dtype (and one gradient-sized copy). Every rank
    receives the same reduced tensors, bit for bit.

    Args:
        tree: a pytree of tensors with the same structure, shapes and dtypes
            on every rank.
        step: the step, for error messages only.
        what: names the collective in error messages.

    Raises:
        RuntimeError: no process group is initialised.
        CollectiveError: the all-reduce failed (a rank died, hangs or diverged).
    """
    _require_group("all_reduce_sum")
    leaves = tree_leaves(tree)
    what = what or "all_reduce (SUM)"
    buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for position, leaf in enumerate(leaves):
        buckets.setdefault((leaf.dtype, leaf.device), []).append(position)
    reduced: list[Tensor | None] = [None] * len(leaves)
    for positions in buckets.values():
        parts = [leaves[p] for p in positions]
        flat = torch.cat([part.reshape(-1) for part in parts])  # a copy: inputs stay unchanged
        _collective(what, step, lambda flat=flat: dist.all_reduce(flat, op=dist.ReduceOp.SUM))
        for p, piece in zip(positions, flat.split([part.numel() for part in parts])):
            reduced[p] = piece.view(leaves[p].shape)
    return tree_structure(tree).unflatten(reduced)


def gather_stats(stats: ExampleStats, *, step: int | Tensor | None = None) -> ExampleStats:
    """Every rank's per-example stats, concatenated in rank order (for metrics).

    Ranks may hold different numbers of rows. The result is the same on every
    rank; :func:`dpfunc.summarize` of it gives whole-batch metrics (NOT
    private). Costs two small all-gathers.

    Raises:
        RuntimeError: no process group is initialised.
        CollectiveError: the all-gather failed.
    """
    _require_group("gather_stats")
    world_size = dist.get_world_size()
    device = stats.norm.device
    size = torch.tensor([stats.mask.numel()], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world_size)]
    what = "all_gather of the per-example stats (metrics)"
    _collective(what, step, lambda: dist.all_gather(sizes, size))
    counts = [int(s) for s in sizes]
    packed = torch.stack(
        [
            stats.loss.to(device=device, dtype=torch.float64),
            stats.norm.to(torch.float64),
            stats.scaled.to(device=device, dtype=torch.float64),
            stats.mask.to(device=device, dtype=torch.float64),
        ]
    )
    longest = max(counts)
    padded = torch.nn.functional.pad(packed, (0, longest - packed.shape[1]))
    gathered = [torch.empty_like(padded) for _ in range(world_size)]
    _collective(what, step, lambda: dist.all_gather(gathered, padded))
    joined = torch.cat([g[:, :count] for g, count in zip(gathered, counts)], dim=1)
    return ExampleStats(
        joined[0].to(device=stats.loss.device, dtype=stats.loss.dtype),
        joined[1].to(stats.norm.dtype),
        joined[2].to(device=stats.scaled.device) > 0,
        joined[3].to(device=stats.mask.device) > 0,
    )


def _hash(value: Any) -> int:
    digest = hashlib.sha256(repr(value).encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def check_same_across_ranks(
    settings: Mapping[str, Any], what: str = "settings", *, secret: Collection[str] = ()
) -> None:
    """Raises ``ValueError`` on every rank unless all ranks pass equal ``settings``.

    Values are compared by a 64-bit hash of their ``repr``; the keys must be
    the same on every rank. One small all-gather. The values of the keys in
    ``secret`` (a seed) never appear in an error message.

    Raises:
        ValueError: a value differs between ranks (the message names its key).
        RuntimeError: no process group is initialised.
        CollectiveError: the all-gather failed.
    """
    _require_group("check_same_across_ranks")
    keys = sorted(settings)
    mine = torch.tensor(
        [_hash(keys)] + [_hash(settings[k]) for k in keys],
        dtype=torch.int64,
        device=_small_device(),
    )
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    _collective(f"all_gather of the {what}", None, lambda: dist.all_gather(everyone, mine))
    table = torch.stack(everyone).cpu()
    if not bool((table[:, 0] == table[0, 0]).all()):
        raise ValueError(f"the ranks' {what} have different keys; this rank has {keys}")
    for column, key in enumerate(keys, start=1):
        if not bool((table[:, column] == table[0, column]).all()):
            ranks = [r for r in range(table.shape[0]) if table[r, column] != table[0, column]]
            shown = "<secret>" if key in secret else repr(settings[key])
            raise ValueError(
                f"{what}: {key} differs across ranks (ranks {ranks} differ from rank 0; "
                f"rank {dist.get_rank()} has {key}={shown}); every rank must use the same value"
            )


def shared_secret_seed() -> int:
    """A fresh secret seed, the same on every rank: rank 0 draws it and broadcasts it.

    Collective: call it on every rank. The seed keys the Poisson sample and
    the noise, so every rank must hold the same one (or ranks would add
    different noise and draw different logical batches), and no rank may
    derive it from anything public such as its rank or the time. It travels
    only inside the process group, like the gradients do.

    Raises:
        RuntimeError: no process group is initialised.
        CollectiveError: the broadcast failed.
    """
    _require_group("shared_secret_seed")
    words = SECRET_BITS // 64
    mask = (1 << 64) - 1
    value = secret_seed() if dist.get_rank() == 0 else 0
    signed = [(value >> (64 * k)) & mask for k in range(words)]
    signed = [w - (1 << 64) if w >= 1 << 63 else w for w in signed]  # int64 two's complement
    buffer = torch.tensor(signed, dtype=torch.int64, device=_small_device())
    _collective("broadcast of rank 0's secret seed", None, lambda: dist.broadcast(buffer, src=0))
    return sum((int(w) & mask) << (64 * k) for k, w in enumerate(buffer.cpu().tolist()))


def gather_flags(ok: bool, what: str, step: int | None = None) -> list[bool]:
    """Every rank's ``ok`` flag, in rank order; a barrier that also reports failures.

    A rank that failed at something the others need (rank 0 writing a
    checkpoint, a rank loading one) still joins, so all ranks can raise
    together instead of waiting for the timeout.

    Raises:
        RuntimeError: no process group is initialised.
        CollectiveError: the all-gather failed (``what`` names it).
    """
    _require_group("gather_flags")
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=_small_device())
    flags = [torch.empty_like(flag) for _ in range(dist.get_world_size())]
    _collective(what, step, lambda: dist.all_gather(flags, flag))
    return [bool(f) for f in flags]


# --------------------------------------------------------------------------- the step


def collectives(config: DPConfig) -> Collectives:
    """``torch.distributed``'s collectives for a :class:`~dpfunc.TrainStep` of ``config``.

    ``reduce`` all-reduces the clipped sum (float64; the same tensors, bit
    for bit, on every rank), ``gather`` all-gathers the per-example stats,
    and ``start`` checks that the step's settings agree across ranks and
    broadcasts rank 0's initial parameters (into copies), as DDP does.

    Raises:
        RuntimeError: no process group is initialised.
    """
    _require_group("dpfunc.distributed.make_train_step")

    def reduce(summed: Params, step: int | Tensor | None) -> Params:
        return all_reduce_sum(summed, step=step, what="all_reduce of the clipped gradient sum")

    def gather(stats: ExampleStats, step: int | Tensor | None) -> ExampleStats:
        return gather_stats(stats, step=step)

    def start(params: Params) -> Params:
        check_step_settings(config, params)
        return broadcast_from_rank0(params)

    return Collectives(reduce=reduce, gather=gather, start=start, distributed=True)


def sharded_collectives(config: DPConfig, optimizer: optim.GradientTransformation) -> Collectives:
    """The collectives of a sharded :class:`~dpfunc.TrainStep` (:mod:`dpfunc.sharding`).

    ``start`` checks the ranks' settings, checks that ``optimizer`` acts
    element by element (:func:`dpfunc.sharding.check_elementwise`), takes
    rank 0's parameters and keeps this rank's rows; ``unshard`` gathers the
    whole parameters, ``reduce`` reduce-scatters the clipped sum, ``gather``
    all-gathers the per-example stats (as :func:`collectives`), and
    ``noise_rows`` names this rank's rows of the noise tree, and
    ``record_noise`` / ``check_noise`` keep the step to the noise
    ``draw_noise`` drew for them (:class:`dpfunc.sharding.DrawnNoise`).

    Raises:
        RuntimeError: no process group is initialised.
    """
    _require_group("dpfunc.distributed.make_train_step(shard=True)")
    require_fsdp2("dpfunc.distributed.make_train_step(shard=True)")
    rank, world_size = rank_and_world_size()
    drawn = DrawnNoise()  # what draw_noise drew for this rank's rows: the only noise it adds
    layouts: list[Sharding] = []  # the layout of the parameters init was called with

    def layout() -> Sharding:
        if not layouts:
            raise RuntimeError(
                "a sharded step learns its layout in step.init(params); call init first"
            )
        return layouts[-1]

    def start(params: Params) -> Params:
        check_step_settings(config, params, sharded=True)
        check_elementwise(optimizer, params, world_size)
        whole = broadcast_from_rank0(params)
        layouts[:] = [Sharding(whole, rank, world_size)]
        return layouts[0].shard(whole)

    def unshard(params: Params, step: int | Tensor | None = None) -> Params:
        what = "all_gather of the parameter shards"
        return _collective(what, step, lambda: layout().unshard(params))

    def reduce(summed: Params, step: int | Tensor | None) -> Params:
        what = "reduce_scatter of the clipped gradient sum"
        return _collective(what, step, lambda: layout().reduce_scatter(summed))

    def noise_rows(params: Params) -> list:
        layout().check(params, whole=False)
        return layout().noise_rows()

    return Collectives(
        reduce=reduce,
        gather=lambda stats, step: gather_stats(stats, step=step),
        start=start,
        distributed=True,
        unshard=unshard,
        noise_rows=noise_rows,
        sharded=True,
        layout=layout,
        record_noise=drawn.record,
        check_noise=drawn.check,
    )


def check_step_settings(config: DPConfig, params: Params, **more: Any) -> None:
    """Raises ``ValueError`` on every rank unless the ranks' step settings and shapes agree."""
    check_same_across_ranks(
        {
            "clip_norm": config.clip_norm,
            "noise_multiplier": config.noise_multiplier,
            "expected_batch_size": config.expected_batch_size,
            "clipping": config.clipping,
            "bands": config.bands,
            "params": [(tuple(x.shape), str(x.dtype)) for x in tree_leaves(params)],
            **more,
        },
        "make_train_step settings",
    )


def broadcast_from_rank0(params: Params) -> Params:
    """Copies of rank 0's ``params`` on every rank (collective; the inputs are not changed)."""
    leaves = [x.detach().clone() for x in tree_leaves(params)]
    for leaf in leaves:
        _collective(
            "broadcast of rank 0's initial parameters",
            None,
            lambda leaf=leaf: dist.broadcast(leaf, src=0),
        )
    return tree_structure(params).unflatten(leaves)


def make_train_step(
    loss_fn: LossFn,
    optimizer: optim.GradientTransformation,
    config: DPConfig | None = None,
    *,
    speed: SpeedConfig | None = None,
    **settings: Any,
) -> TrainStep:
    """:func:`dpfunc.make_train_step` for data-parallel training on a process group.

    Same arguments, same state and the same result as the single-process
    step on the concatenated batch (up to float summation order), with
    ``expected_batch_size`` the GLOBAL expected batch size (``sample_rate *
    num_examples`` of the whole dataset). It is a plain
    :class:`~dpfunc.TrainStep` with :func:`collectives` injected. Call
    everything on every rank: ``init`` broadcasts rank 0's parameters;
    ``step(...)``, ``logical_step`` and ``logical_gradient`` all-reduce the
    clipped sums, then add the shared ``noise`` once (see the module
    docstring for why no broadcast is needed); ``step.compile()`` compiles
    the local pieces between the collectives. With ``bands > 1`` the
    correlated noise is the same on every rank too: it is a function of the
    shared standard-normal trees and of the noise history in the state,
    which every rank updates identically.

    ``shard=True`` (a :class:`~dpfunc.SpeedConfig` field) shards the
    parameters, the optimizer state and the noise history over the ranks
    (:mod:`dpfunc.sharding`): ``init`` keeps this rank's rows of rank 0's
    parameters, ``state.params`` are those rows,
    :meth:`~dpfunc.TrainStep.full_params` gathers the whole ones, and the
    result equals the single-process step's to float rounding.

    Raises:
        RuntimeError: no process group is initialised (call :func:`init`).
        ValueError, TypeError: as :func:`dpfunc.make_train_step`.
    """
    who = "dpfunc.distributed.make_train_step"
    config, speed = settings_from(who, config, speed, settings)
    if speed.physical_batch_size is not None:
        raise ValueError(
            f"{who} takes micro-batches as given: physical_batch_size sets a sampler's "
            f"micro-batches; got physical_batch_size={speed.physical_batch_size!r}"
        )
    chosen = sharded_collectives(config, optimizer) if speed.shard else collectives(config)
    return TrainStep(
        loss_fn,
        optimizer,
        config,
        speed=speed,
        collectives=chosen,
    )
