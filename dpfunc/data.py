"""Poisson sampling into fixed-shape padded micro-batches.

DP-SGD's privacy guarantee is computed by an accountant that assumes Poisson
subsampling: at every step each of the ``num_examples`` examples joins the
logical batch independently with probability ``sample_rate`` (Abadi et al.
2016, "Deep Learning with Differential Privacy"; Mironov, Talwar and Zhang
2019, "Rényi Differential Privacy of the Sampled Gaussian Mechanism"). The
amplification-by-sampling bound holds for this sampler, not for shuffling
into fixed-size batches, so ``poisson_sample`` is the sampler to use with the
epsilon that ``dpfunc.accounting`` reports.

Under Poisson sampling the batch size is random: ``Binomial(num_examples,
sample_rate)``, with mean ``expected_batch_size = sample_rate *
num_examples``. It can be 0, and it can exceed any fixed memory budget. A
compiled (``torch.compile``) vmap step recompiles for every new batch shape,
so this module never hands the step a variable shape. ``micro_batches``
gathers a logical batch into micro-batches of exactly
``physical_batch_size`` rows each, plus a float mask (1 for real rows, 0 for
padding). Padding rows are copies of dataset row 0, real data on which the
loss is finite; the step multiplies their clip factors by the mask, so they
contribute exactly 0. No example is ever dropped: a logical batch larger
than ``physical_batch_size`` becomes several micro-batches, whose clipped
sums the step accumulates before adding noise once. An empty logical batch
is still one (all-padding) micro-batch: the step must still happen (it
releases noise only) and the accountant counts it.

Datasets come in the forms people have (tensors, numpy arrays, columns, map-style
datasets, a ``DataLoader``, Hugging Face datasets); :mod:`dpfunc.datasets` reads
them all as rows to index and gathers them, and refuses iterable ones, since
Poisson sampling needs random access to every example by index (``docs/data.md``).

Cyclic Poisson sampling serves correlated noise (:mod:`dpfunc.matrix_factorization`):
with ``bands = b > 1`` the examples are split once into ``b`` partitions by a
permutation keyed by the seed, and step ``t`` Poisson-samples, with rate
``sample_rate``, from partition ``t mod b`` only (Choquette-Choo et al.
2023, "(Amplified) Banded Matrix Factorization", whose amplification theorem
covers this sampler). Each example's participations are then at least ``b``
steps apart. ``bands = 1`` is plain Poisson sampling, bit for bit.

The sample of step ``t`` depends only on ``(seed, t)``: resuming a run needs
only its step count, and every rank of a distributed job draws the same
logical batch without communicating. ``split_for_rank`` then gives each rank
a disjoint share. The seed is a secret (:func:`dpfunc.secret_seed`): the
accountant's amplification by sampling assumes that nobody outside knows
which examples a step used, and whoever knows the seed knows exactly that.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from ._checks import check_int, check_number
from .datasets import Collated, as_dataset, dataset_size, gather_rows
from .noise import check_seed, keyed_generator, secret_seed

PyTree = Any
MicroBatch = tuple[PyTree, Tensor]  # (batch with leading dim physical_batch_size, mask)

__all__ = [
    "PoissonBatches",
    "Sampler",
    "SamplerState",
    "cyclic_poisson_sample",
    "micro_batches",
    "num_micro_batches",
    "partitions",
    "poisson_sample",
    "poisson_sampler",
    "split_for_rank",
]


# --------------------------------------------------------------------------- sampling


def poisson_sample(num_examples: int, sample_rate: float, *, seed: int, step: int) -> Tensor:
    """The logical batch of step ``step``: each example kept independently w.p. ``sample_rate``.

    The draw comes from a CPU ``torch.Generator`` whose whole Mersenne
    Twister state is keyed by ``(seed, step)`` (:func:`dpfunc.noise.keyed_generator`:
    19,968 bits of SHAKE-256, not the 32 bits ``manual_seed`` would keep),
    so the result depends only on that pair: not on the global RNG (which
    it neither reads nor advances), on the order of calls, or on the rank.
    Distinct pairs give independent samples.

    Args:
        num_examples: the dataset size ``N``, an int >= 1.
        sample_rate: the inclusion probability ``q``, in ``(0, 1]``. The
            expected batch size is ``q * N``; the realised size is
            ``Binomial(N, q)`` and may be 0.
        seed: the run's secret, a non-negative int (see :func:`dpfunc.secret_seed`).
        step: the non-negative step count.

    Returns:
        The sorted int64 indices (CPU, 1-D, no repeats) of the sampled
        examples; ``sample_rate = 1`` gives ``arange(num_examples)``.

    Raises:
        ValueError: an argument is out of range or of the wrong type.

    >>> from dpfunc import secret_seed
    >>> secret = secret_seed()
    >>> a = poisson_sample(10, 0.5, seed=secret, step=3)
    >>> torch.equal(a, poisson_sample(10, 0.5, seed=secret, step=3))
    True
    >>> poisson_sample(4, 1.0, seed=secret, step=0)
    tensor([0, 1, 2, 3])
    """
    check_int("num_examples", num_examples, minimum=1)
    check_number("sample_rate", sample_rate, low=0, high=1, low_open=True)
    check_seed(seed)
    check_int("step", step, minimum=0)
    generator = keyed_generator("dpfunc.poisson", seed, step, torch.device("cpu"))
    keep = torch.rand(num_examples, generator=generator, dtype=torch.float64) < sample_rate
    return torch.nonzero(keep).flatten().to(torch.int64)


def partitions(num_examples: int, bands: int, *, seed: int) -> list[Tensor]:
    """The ``bands`` disjoint partitions of cyclic Poisson sampling, fixed by ``seed``.

    A permutation of ``range(num_examples)`` from a generator keyed by the
    seed (:func:`dpfunc.noise.keyed_generator`, its own domain) is cut into
    ``bands`` consecutive pieces; the first ``num_examples % bands`` pieces
    hold one example more than the others. Every example is in exactly one
    partition, and none is dropped. The split is as secret as the seed, but
    the privacy analysis does not rely on its secrecy: it holds for any
    split made without looking at the data.

    Returns:
        ``bands`` sorted int64 index tensors; ``bands = 1`` gives
        ``[arange(num_examples)]``.

    Raises:
        ValueError: ``bands`` is not an int in ``[1, num_examples]``, or
            another argument is out of range.
    """
    check_int("num_examples", num_examples, minimum=1)
    check_int("bands", bands, minimum=1)
    if bands > num_examples:
        raise ValueError(
            f"bands must be at most num_examples={num_examples} (every partition needs an "
            f"example), got bands={bands!r}"
        )
    check_seed(seed)
    if bands == 1:
        return [torch.arange(num_examples)]
    generator = keyed_generator("dpfunc.partition", seed, 0, torch.device("cpu"))
    order = torch.randperm(num_examples, generator=generator)
    small, extra = divmod(num_examples, bands)
    sizes = [small + 1] * extra + [small] * (bands - extra)
    return [piece.sort().values for piece in torch.split(order, sizes)]


def cyclic_poisson_sample(partition: Tensor, sample_rate: float, *, seed: int, step: int) -> Tensor:
    """Step ``step``'s batch under cyclic Poisson sampling: a Poisson sample of ``partition``.

    Each member of ``partition`` (step ``t`` uses ``partitions(...)[t %
    bands]``) is kept independently with probability ``sample_rate``, from
    the same keyed stream as :func:`poisson_sample`, so for the whole data
    set as one partition it returns :func:`poisson_sample`'s indices bit
    for bit.

    Returns:
        The sorted int64 indices of the sampled examples (possibly none).

    Raises:
        ValueError: an argument is out of range or of the wrong type.
    """
    if not isinstance(partition, Tensor) or partition.dim() != 1 or partition.numel() < 1:
        raise ValueError(f"partition must be a non-empty 1-D index tensor, got {partition!r}")
    check_number("sample_rate", sample_rate, low=0, high=1, low_open=True)
    check_seed(seed)
    check_int("step", step, minimum=0)
    generator = keyed_generator("dpfunc.poisson", seed, step, torch.device("cpu"))
    keep = torch.rand(partition.numel(), generator=generator, dtype=torch.float64) < sample_rate
    return partition[keep].to(torch.int64)


class SamplerState(NamedTuple):
    """A sampler's state: the secret and what is derived from it. Never printed."""

    seed: int  # the run's secret, an int >= 0
    partitions: tuple[Tensor, ...]  # bands sorted int64 index tensors, from partitions(seed)

    def __repr__(self) -> str:  # the seed is a secret, and the split is as secret as the seed
        return f"SamplerState(seed=<secret>, partitions=<{len(self.partitions)}, secret>)"


class Sampler(NamedTuple):
    """Poisson sampling as two pure functions (the ``(init, update)`` style of :mod:`dpfunc.optim`).

    ``init(seed) -> SamplerState``: the secret and the partitions derived
    from it (derived again whenever a secret is adopted, e.g. on resume).
    ``sample(state, step) -> indices``: step ``step``'s logical batch, a
    function of the state and the step only. Made by
    :func:`poisson_sampler`; :class:`PoissonBatches` iterates over one.
    """

    init: Callable[[int], SamplerState]
    sample: Callable[[SamplerState, int], Tensor]


def poisson_sampler(num_examples: int, sample_rate: float, *, bands: int = 1) -> Sampler:
    """The sampler of DP-SGD: Poisson, or cyclic Poisson over ``bands`` partitions.

    ``sample(state, t)`` is :func:`poisson_sample` with ``bands = 1`` and
    :func:`cyclic_poisson_sample` of ``state.partitions[t % bands]`` with
    ``bands > 1`` (the partitions from :func:`partitions` of the state's
    seed), bit for bit.

    Raises:
        ValueError: an argument is out of range (``bands`` above
            ``num_examples`` included), or, from ``init``, a seed that is
            not an int >= 0 (never shown).

    >>> from dpfunc import secret_seed
    >>> sampler = poisson_sampler(10, 1.0, bands=2)
    >>> state = sampler.init(secret_seed())
    >>> sorted(sampler.sample(state, 0).tolist() + sampler.sample(state, 1).tolist())
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    """
    check_int("num_examples", num_examples, minimum=1)
    check_number("sample_rate", sample_rate, low=0, high=1, low_open=True)
    check_int("bands", bands, minimum=1)
    if bands > num_examples:
        raise ValueError(
            f"bands must be at most num_examples={num_examples} (every partition needs an "
            f"example), got bands={bands!r}"
        )

    def init(seed: int) -> SamplerState:
        return SamplerState(seed, tuple(partitions(num_examples, bands, seed=seed)))

    def sample(state: SamplerState, step: int) -> Tensor:
        if bands == 1:
            return poisson_sample(num_examples, sample_rate, seed=state.seed, step=step)
        partition = state.partitions[step % bands]
        return cyclic_poisson_sample(partition, sample_rate, seed=state.seed, step=step)

    return Sampler(init, sample)


def split_for_rank(indices: Tensor, rank: int, world_size: int) -> Tensor:
    """Rank ``rank``'s share of a logical batch: ``indices[rank::world_size]``.

    Every index goes to exactly one rank, and share sizes differ by at most
    one (lower ranks get the extra ones). Every rank can compute every other
    rank's share from the same logical batch, with no communication.

    Args:
        indices: a 1-D tensor of example indices (the logical batch).
        rank: this process's rank, in ``[0, world_size)``.
        world_size: the number of ranks, an int >= 1.

    Raises:
        ValueError: ``indices`` is not 1-D, or ``rank`` / ``world_size`` is
            out of range.

    >>> split_for_rank(torch.arange(5), rank=1, world_size=2)
    tensor([1, 3])
    """
    check_int("world_size", world_size, minimum=1)
    _check_rank(rank, world_size)
    if not isinstance(indices, Tensor) or indices.dim() != 1:
        raise ValueError(f"indices must be a 1-D tensor, got indices={indices!r}")
    return indices[rank::world_size]


def num_micro_batches(batch_size: int, physical_batch_size: int) -> int:
    """``max(1, ceil(batch_size / physical_batch_size))``.

    An empty logical batch still takes one (all-padding) micro-batch: the
    step must still run, adding noise only, and the accountant counts it.

    Raises:
        ValueError: ``batch_size < 0`` or ``physical_batch_size < 1``.

    >>> num_micro_batches(0, 8), num_micro_batches(8, 8), num_micro_batches(17, 8)
    (1, 1, 3)
    """
    check_int("batch_size", batch_size, minimum=0)
    check_int("physical_batch_size", physical_batch_size, minimum=1)
    return max(1, math.ceil(batch_size / physical_batch_size))


# --------------------------------------------------------------------------- gathering


def micro_batches(
    dataset: Any,
    indices: Tensor | Sequence[int],
    physical_batch_size: int,
    *,
    num: int | None = None,
    mask_dtype: torch.dtype = torch.float32,
) -> list[MicroBatch]:
    """Gathers ``dataset[indices]`` into fixed-shape padded micro-batches.

    The real rows, in the order of ``indices``, fill the micro-batches one
    after another; the rest of the last one (and any extra ones asked for
    with ``num``) is padding: copies of dataset row 0, real data so that the
    loss stays finite, marked 0 in the mask so that they contribute exactly
    0 once the step multiplies the clip factors by the mask. Nothing is ever
    dropped or truncated.

    Args:
        dataset: any form :func:`dpfunc.datasets.as_dataset` accepts; it must hold at
            least one row (the padding row).
        indices: a 1-D integer tensor or sequence of indices in
            ``[0, dataset_size(dataset))``, e.g. ``poisson_sample(...)`` or a
            rank's share of it. May be empty. Repeats are allowed.
        physical_batch_size: the rows per micro-batch, an int >= 1.
        num: the number of micro-batches to return. ``None`` means
            ``num_micro_batches(len(indices), physical_batch_size)``; a larger
            value appends all-padding micro-batches (used so that all ranks
            of a distributed job run the same count).
        mask_dtype: the floating dtype of the mask.

    Returns:
        A list of ``(batch, mask)`` pairs. ``batch`` has the structure of one
        example (a Tensor for a tensor or array of rows, a tuple for columns
        and a ``TensorDataset``, a dict of tensors for a Hugging Face
        dataset, the item structure for other map-style datasets, with
        numbers and numpy arrays turned into tensors by
        ``default_collate``); every leaf has leading
        dimension ``physical_batch_size``. ``mask`` has shape
        ``[physical_batch_size]``, 1 for real rows and 0 for padding, on the
        device of the batch's first leaf. The masks sum to ``len(indices)``.
        A :class:`dpfunc.datasets.Collated` dataset is collated one
        micro-batch at a time, so each is padded to its own longest example.

    Raises:
        ValueError: ``indices`` is not 1-D integer, an index is out of
            range, the dataset is empty, ``physical_batch_size < 1``, ``num``
            is smaller than needed (that would drop examples), or
            ``mask_dtype`` is not a floating dtype.
        TypeError: the dataset's form is refused (:func:`dpfunc.datasets.as_dataset`).

    >>> x = torch.arange(5.0)
    >>> [(b.tolist(), m.tolist()) for b, m in micro_batches(x, [4, 2, 3], 2)]
    [([4.0, 2.0], [1.0, 1.0]), ([3.0, 0.0], [1.0, 0.0])]
    """
    check_int("physical_batch_size", physical_batch_size, minimum=1)
    if not isinstance(mask_dtype, torch.dtype) or not mask_dtype.is_floating_point:
        raise ValueError(
            f"mask_dtype must be a floating torch.dtype, got mask_dtype={mask_dtype!r}"
        )
    dataset = as_dataset(dataset)
    size = dataset_size(dataset)
    if size < 1:
        raise ValueError("dataset must hold at least one example (row 0 pads), got 0 examples")
    indices = _as_indices(indices, size)
    count = indices.numel()
    needed = num_micro_batches(count, physical_batch_size)
    if num is None:
        num = needed
    else:
        check_int("num", num, minimum=1)
        if num < needed:
            raise ValueError(
                f"num must be >= {needed} to hold {count} examples in micro-batches of "
                f"{physical_batch_size} (no example is ever dropped), got num={num!r}"
            )
    total = num * physical_batch_size
    padded = torch.cat([indices, torch.zeros(total - count, dtype=torch.int64)])
    mask = torch.arange(total) < count
    return gather_micro_batches(dataset, padded, mask, physical_batch_size, mask_dtype)


def gather_micro_batches(
    dataset: Any, padded: Tensor, mask: Tensor, physical_batch_size: int, mask_dtype: torch.dtype
) -> list[MicroBatch]:
    """Rows ``padded`` of ``as_dataset(dataset)`` as micro-batches of ``physical_batch_size`` rows.

    ``padded``: int64 row indices, a multiple of ``physical_batch_size`` long;
    ``mask``: bool, as long, ``False`` for padding rows (whose index names a
    real row, e.g. 0). The layout is the caller's (:func:`micro_batches`,
    :class:`dpfunc.users.UserBatches`); this only gathers.
    """
    count = int(mask.sum())
    if not bool(mask[:count].all()):  # padding between real rows: read every row as given
        count = padded.numel()
    num = padded.numel() // physical_batch_size
    pieces = [slice(j * physical_batch_size, (j + 1) * physical_batch_size) for j in range(num)]
    if isinstance(dataset, Collated):  # each micro-batch collated alone: padded to its own length
        batches = [dataset.collate(padded[rows]) for rows in pieces]
    else:
        batch = gather_rows(dataset, padded, count)
        batches = [optree.tree_map(lambda leaf, rows=rows: leaf[rows], batch) for rows in pieces]
    out = []
    for batch, rows in zip(batches, pieces):
        leaves = optree.tree_leaves(batch)
        device = leaves[0].device if leaves else torch.device("cpu")
        out.append((batch, mask[rows].to(device=device, dtype=mask_dtype)))
    return out


# --------------------------------------------------------------------------- iterator


class PoissonBatches:
    """Poisson-sampled logical batches as fixed-shape micro-batches, step by step.

    A thin layer over a :func:`poisson_sampler` (``self.sampler``, its
    state ``self.sampler_state``), ``split_for_rank`` and
    ``micro_batches``. Step ``t``'s logical batch depends only on
    ``(seed, t)``, so a resumed run calls ``logical_batch(t)`` with its step
    count and gets the batch it would have had.

    Distributed use: every rank builds this with the same dataset (same
    order), ``sample_rate``, ``physical_batch_size`` and ``seed``, and its own
    ``rank``. All ranks draw the same logical batch; each takes its share
    (``split_for_rank``). Shares differ in size, so they can need different
    numbers of micro-batches, while a collective (all-reduce) step needs
    every rank to run the same count. Every rank can compute every rank's
    share from the logical batch, so ``logical_batch`` pads each rank to the
    maximum over ranks (``micro_batch_count``) with no communication; the
    extra micro-batches are all padding.

    Args:
        dataset: any form :func:`dpfunc.datasets.as_dataset` accepts, with >= 1 example;
            ``self.dataset`` holds ``as_dataset(dataset)``.
        sample_rate: the Poisson inclusion probability, in ``(0, 1]``; with
            ``bands > 1``, within the step's partition.
        physical_batch_size: rows per micro-batch, an int >= 1.
        seed: the run's secret, a non-negative int; ``None`` (default) draws
            a fresh one with :func:`dpfunc.secret_seed`. Whoever knows it
            knows every batch. A fixed seed is for reproducible research
            only. With ``world_size > 1`` every rank must pass the same
            secret (:func:`dpfunc.distributed.shared_secret_seed`), so
            ``None`` is refused there.
        rank: this process's rank, in ``[0, world_size)``.
        world_size: the number of ranks, an int >= 1.
        bands: ``1`` (default) for Poisson sampling from the whole data set;
            ``b > 1`` for cyclic Poisson sampling over ``b`` partitions
            (:func:`partitions`), as correlated noise with ``b`` bands needs.

    Raises:
        ValueError: an argument is out of range, or the dataset is empty.
        TypeError: the dataset's form is refused (:func:`dpfunc.datasets.as_dataset`).
    """

    def __init__(
        self,
        dataset: Any,
        sample_rate: float,
        physical_batch_size: int,
        *,
        seed: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        bands: int = 1,
    ) -> None:
        dataset = as_dataset(dataset)
        num_examples = dataset_size(dataset)
        if num_examples < 1:
            raise ValueError("dataset must hold at least one example, got 0 examples")
        check_number("sample_rate", sample_rate, low=0, high=1, low_open=True)
        check_int("physical_batch_size", physical_batch_size, minimum=1)
        check_int("world_size", world_size, minimum=1)
        _check_rank(rank, world_size)
        if seed is None:
            if world_size > 1:
                raise ValueError(
                    "seed=None would give each rank its own secret and so its own logical "
                    f"batch; with world_size={world_size} pass the same secret on every rank, "
                    "e.g. seed=dpfunc.distributed.shared_secret_seed()"
                )
            seed = secret_seed()
        self.sampler = poisson_sampler(num_examples, sample_rate, bands=bands)
        self.bands = bands
        self.dataset = dataset
        self.num_examples = num_examples
        self.sample_rate = sample_rate
        self.physical_batch_size = physical_batch_size
        self.seed = seed  # derives the partitions
        self.rank = rank
        self.world_size = world_size

    @property
    def seed(self) -> int:
        """The secret that keys the samples (and the partitions, unless :meth:`rekey` moved it)."""
        return self.sampler_state.seed

    @seed.setter
    def seed(self, seed: int) -> None:
        """Adopts another secret (e.g. a resumed run's): everything it keys is derived again."""
        check_seed(seed)
        self.sampler_state = self.sampler.init(seed)

    def rekey(self, stream_seed: int) -> None:
        """Keys the samples of the steps to come with ``stream_seed``; the partitions stay.

        A run continued from a checkpoint samples its steps afresh (two
        continuations of one checkpoint must not share a sample or a noise
        draw), while every example stays in the partition the run's own
        seed gave it, as cyclic Poisson sampling's guarantee needs.
        """
        check_seed(stream_seed)
        self.sampler_state = self.sampler_state._replace(seed=stream_seed)

    @property
    def partitions(self) -> list[Tensor]:
        """The ``bands`` partitions of cyclic Poisson sampling, derived from the seed."""
        return list(self.sampler_state.partitions)

    @property
    def expected_batch_size(self) -> float:
        """``sample_rate * num_examples / bands``: the denominator of the private average.

        With ``bands > 1`` partitions differ in size by at most one example,
        so a step's expected batch differs from this constant by less than
        ``sample_rate``; the denominator is this one number for every step,
        which depends on nothing but public sizes.
        """
        return self.sample_rate * self.num_examples / self.bands

    def indices(self, step: int) -> Tensor:
        """Step ``step``'s whole logical batch (the same on every rank)."""
        return self.sampler.sample(self.sampler_state, step)

    def counts_per_rank(self, step: int) -> list[int]:
        """The number of real examples in each rank's share of step ``step``."""
        count = self.indices(step).numel()
        return [_share_size(count, r, self.world_size) for r in range(self.world_size)]

    def micro_batch_count(self, step: int) -> int:
        """The micro-batch count all ranks run at step ``step``: the max over ranks."""
        return self._agreed_count(self.indices(step).numel())

    def _agreed_count(self, logical_size: int) -> int:
        """The max over ranks of the micro-batches each rank's share needs."""
        return max(
            num_micro_batches(
                _share_size(logical_size, r, self.world_size), self.physical_batch_size
            )
            for r in range(self.world_size)
        )

    def logical_batch(self, step: int) -> tuple[list[MicroBatch], int]:
        """This rank's micro-batches for step ``step`` and its number of real examples.

        Returns ``(micro_batches, count)``: ``micro_batch_count(step)``
        ``(batch, mask)`` pairs whose masks sum to ``count``. With
        ``world_size = 1``, ``count`` is the logical batch size.
        """
        logical = self.indices(step)
        share = split_for_rank(logical, self.rank, self.world_size)
        num = self._agreed_count(logical.numel())
        return micro_batches(self.dataset, share, self.physical_batch_size, num=num), share.numel()

    def steps(
        self, start: int = 0, stop: int | None = None
    ) -> Iterator[tuple[int, list[MicroBatch], int]]:
        """Yields ``(step, micro_batches, count)`` for ``start <= step < stop``.

        ``stop = None`` never ends; resume a run with ``steps(start=its_step)``.
        """
        check_int("start", start, minimum=0)
        if stop is not None:
            check_int("stop", stop, minimum=0)
        step = start
        while stop is None or step < stop:
            batches, count = self.logical_batch(step)
            yield step, batches, count
            step += 1

    def __iter__(self) -> Iterator[tuple[int, list[MicroBatch], int]]:
        """``steps()`` from step 0, without end."""
        return self.steps()

    def __repr__(self) -> str:
        return (  # the seed is a secret: never in a repr or a log
            f"PoissonBatches(num_examples={self.num_examples}, sample_rate={self.sample_rate}, "
            f"physical_batch_size={self.physical_batch_size}, seed=<secret>, "
            f"rank={self.rank}, world_size={self.world_size}, bands={self.bands})"
        )


# --------------------------------------------------------------------------- helpers


def _check_rank(rank: Any, world_size: int) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size={world_size}), got rank={rank!r}")


def _share_size(count: int, rank: int, world_size: int) -> int:
    """``len(range(count)[rank::world_size])``."""
    return max(0, (count - rank + world_size - 1) // world_size)


def _as_indices(indices: Any, size: int) -> Tensor:
    if isinstance(indices, Tensor):
        tensor = indices.detach()
    else:
        try:
            values = list(indices)
            tensor = torch.as_tensor(values) if values else torch.empty(0, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as err:
            raise ValueError(
                f"indices must be a 1-D sequence of ints, got indices={indices!r}"
            ) from err
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise ValueError(f"indices must be integers, got indices of dtype {tensor.dtype}")
    tensor = tensor.to(device="cpu", dtype=torch.int64)
    if tensor.dim() != 1:
        raise ValueError(f"indices must be 1-D, got shape {tuple(tensor.shape)}")
    if tensor.numel() and (int(tensor.min()) < 0 or int(tensor.max()) >= size):
        raise ValueError(
            f"indices must lie in [0, {size}) for a dataset of {size} examples, got "
            f"min {int(tensor.min())} and max {int(tensor.max())}"
        )
    return tensor
