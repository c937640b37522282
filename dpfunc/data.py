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
datasets, a ``DataLoader``, Hugging Face datasets); :func:`as_dataset` reads
them all and refuses iterable ones, since Poisson sampling needs random access to
every example by index (``docs/data.md``).

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

import hashlib
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
    default_collate,
    default_convert,
)

from .checks import check_int, check_number
from .noise import check_seed, keyed_generator, secret_seed

PyTree = Any
MicroBatch = tuple[PyTree, Tensor]  # (batch with leading dim physical_batch_size, mask)

__all__ = [
    "PoissonBatches",
    "Sampler",
    "SamplerState",
    "as_dataset",
    "cyclic_poisson_sample",
    "dataset_size",
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


# --------------------------------------------------------------------------- datasets

ACCEPTED_DATASETS = (
    "a Tensor or numpy array of rows; a tuple of tensors or numpy arrays, read as columns "
    "with a common leading size, e.g. (x, y), or a list of them whose shapes differ, e.g. "
    "[x, y]; a map-style dataset (__len__ and __getitem__(int) returning tensors, numbers, "
    "numpy arrays or tuples/lists/dicts of them), e.g. a TensorDataset or a list of (x, y) "
    "examples; a DataLoader over one of these; or a Hugging Face datasets.Dataset with "
    "numeric or image columns"
)


def as_dataset(dataset: Any) -> Any:
    """``dataset`` in the form that the rest of this module gathers rows from.

    Every function here that takes a dataset calls this first, so a
    :class:`dpfunc.Trainer` can be handed any accepted form as it is. The
    forms, checked in this order:

    - a ``torch.utils.data.DataLoader``: its ``.dataset`` is read (any form
      below), with a ``UserWarning``: its sampler, ``shuffle`` and batch
      size give way to Poisson sampling, which the privacy accounting
      assumes (each example joins each step independently; a shuffled
      fixed-size batch is a different mechanism). A loader whose sampler
      or batch sampler may choose WHICH examples are used (anything but
      ``SequentialSampler``, ``RandomSampler`` and ``DistributedSampler``,
      which only order or deal out the whole dataset) is refused, and so
      is a custom ``collate_fn``: ignoring either would silently train on
      other examples than the loader yields (a subset, an augmentation, a
      tokenisation, a mix of examples), and a silent change of the data is
      worse than an error. Pass ``torch.utils.data.Subset(dataset,
      indices)`` and do per-example work in ``__getitem__`` instead.
    - a ``Tensor`` of rows along dim 0, returned as is;
    - a numpy array of rows: ``torch.from_numpy`` (no copy, dtype kept);
    - a tuple or list of tensors or numpy arrays (mixed allowed): read as
      COLUMNS with a common leading size (``(x, y)``, ``[x, y]``) or as
      EXAMPLES (one tensor each), never by a guess. Both readings fit
      exactly when the entries all have one shape, since examples that
      share a micro-batch need one shape, and columns only a common leading
      size. So:

      * a tuple is columns, always (the ``(x, y)`` form, and what
        ``TensorDataset.tensors`` holds): ``(ids, mask, labels)`` of one
        shape is 3 columns;
      * a list whose entries' shapes differ is columns, e.g. ``[x, y]``
        with ``x`` of shape ``(N, d)`` and ``y`` of ``(N,)``, as the
        examples reading cannot batch them;
      * a list whose entries all have one shape ``(n, ...)`` is refused as
        ambiguous (``k`` examples of that shape, or ``n`` examples of ``k``
        columns), naming both readings and how to say which:
        ``torch.stack(dataset)`` for ``k`` examples, ``tuple(dataset)``
        for ``n`` examples of ``k`` columns. (A list of 0-d tensors can
        only be examples: it is stacked.)

      Columns come back as a tuple of tensors, so batches of a list
      dataset are tuples too. A tuple whose elements are not all tensors
      or arrays is refused (``(x, labels_list)`` would otherwise be a
      dataset of 2 examples), and so is a tuple of tuples or lists, which
      reads as examples (``((x0, y0), (x1, y1))``) or as columns of
      per-example values (``(xs, ys)`` from ``zip(*pairs)``): pass
      ``list(dataset)`` for examples, or stack each column;
    - a ``TensorDataset``: the tuple of its tensors;
    - a Hugging Face ``datasets.Dataset`` (when ``datasets`` is installed):
      rows come from its ``"torch"`` format, so every example is a dict of
      tensors, as ``dataset.with_format("torch")`` yields it (floats as
      float32, integers as int64, images decoded to uint8). Only the
      columns the dataset's format selects are read; each must be numeric
      (bool, int, float, a class label, lists or arrays of them) or an
      image, else it is refused by name: remove it
      (``dataset.remove_columns``) or select the others
      (``dataset.select_columns``). Rows are read per batch, never all at
      once. Every column must have one shape across the examples it
      batches (pad tokenised text to a fixed length);
    - any other map-style dataset (``__len__`` and ``__getitem__(int)``,
      e.g. a ``torch.utils.data.Dataset`` with per-example transforms,
      ``Subset``, or a list of examples such as ``(x, y)`` tuples or
      dicts, i.e. a list holding no tensor or array itself): returned as
      is; rows are its items, read one by one.

    Iterable datasets (``torch.utils.data.IterableDataset``, Hugging Face
    ``IterableDataset``, generators, iterators) are refused: Poisson
    sampling includes every example independently at every step, so it
    must read any example by its index, and the accountant needs the
    number of examples. So are dicts (pass the columns as a tuple),
    strings, a ``DatasetDict`` (pick a split) and anything else.

    Returns:
        A ``Tensor``, a tuple of tensors, or a map-style dataset.
        ``as_dataset(as_dataset(d))`` is ``as_dataset(d)``.

    Raises:
        TypeError: a refused form, a non-numeric numpy dtype (named), or
            non-numeric Hugging Face columns (named). Every message names
            the accepted forms.
        ValueError: a 0-d tensor or array, columns whose leading sizes
            differ (the sizes are named), an empty tuple, a list of
            tensors of one shape or a tuple of tuples (ambiguous: both
            readings and how to say which are named). (An empty list is
            an empty dataset, which the callers refuse.)

    >>> import numpy as np
    >>> x, y = as_dataset([np.zeros((3, 2)), torch.tensor([1, 0, 1])])
    >>> x.dtype, y.tolist(), dataset_size((x, y))
    (torch.float64, [1, 0, 1], 3)
    >>> dataset_size([torch.zeros(3, 4, 4) for _ in range(50)])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: dataset is a list of 50 tensors that all have shape (3, 4, 4), which reads ...
    >>> dataset_size(torch.stack([torch.zeros(3, 4, 4) for _ in range(50)]))
    50
    """
    if isinstance(dataset, DataLoader):
        return _loader_dataset(dataset)
    if isinstance(dataset, Tensor):
        if dataset.dim() == 0:
            raise _refusal(ValueError, "dataset must have rows along dim 0, got a 0-d tensor")
        return dataset
    if _is_ndarray(dataset):
        return as_dataset(_from_numpy(dataset, "dataset"))
    if isinstance(dataset, tuple) or (
        isinstance(dataset, list) and any(_is_column(c) for c in dataset)
    ):
        return _sequence(dataset)
    if isinstance(dataset, TensorDataset):
        return tuple(dataset.tensors)
    if isinstance(dataset, _HuggingFaceRows):
        return dataset
    hf = _hugging_face_kind(dataset)
    if hf == "Dataset":
        return _HuggingFaceRows(dataset)
    if hf == "DatasetDict":
        raise _refusal(
            TypeError,
            f"dataset is a Hugging Face DatasetDict with splits {list(dataset)}; pass one "
            "split, e.g. dataset['train']",
        )
    if isinstance(dataset, IterableDataset) or (
        isinstance(dataset, Iterable) and not _is_indexable(dataset)
    ):
        raise _refusal(
            TypeError,
            f"dataset is a {type(dataset).__name__}, an iterable without random access: "
            "Poisson sampling includes each example independently at every step, so it must "
            "read any example by its index, and the accountant needs the number of examples; "
            "gather the examples into one of the accepted forms first",
        )
    if isinstance(dataset, (Mapping, str, bytes)):
        raise _refusal(
            TypeError,
            f"dataset is a {type(dataset).__name__}, whose len() counts keys or characters, "
            "not examples; pass columns as a tuple, e.g. (x, y)",
        )
    if _is_indexable(dataset):
        return dataset
    raise _refusal(TypeError, f"dataset of type {type(dataset).__name__} is not a dataset")


def dataset_size(dataset: Any) -> int:
    """The number of examples (rows) in ``dataset``, any form :func:`as_dataset` accepts.

    Raises:
        TypeError, ValueError: as :func:`as_dataset`.

    >>> dataset_size((torch.zeros(5, 3), torch.zeros(5)))
    5
    """
    dataset = as_dataset(dataset)
    if isinstance(dataset, Tensor):
        return dataset.shape[0]
    if isinstance(dataset, tuple):
        return dataset[0].shape[0]
    return len(dataset)


def dataset_fingerprint(dataset: Any, rows: int = 64) -> str:
    """A SHA-256 of ``dataset``'s size and contents, to check that ranks hold the same data.

    Tensors and columns (and so numpy arrays and a ``TensorDataset``, which
    :func:`as_dataset` turns into them) are hashed whole; other datasets
    through ``rows`` evenly spaced examples (and their size). Data-parallel
    DP-SGD needs the SAME dataset in the same order on every rank: index
    ``i`` must be the same person everywhere, or one person could be
    sampled on two ranks in one step.

    Raises:
        TypeError, ValueError: as :func:`as_dataset`.
    """
    dataset = as_dataset(dataset)
    size = dataset_size(dataset)
    digest = hashlib.sha256(str(size).encode())
    if isinstance(dataset, Tensor):
        tensors = [dataset]
    elif isinstance(dataset, tuple):
        tensors = list(dataset)
    else:
        picks = sorted({round(k * (size - 1) / max(rows - 1, 1)) for k in range(rows)})
        tensors = [
            leaf if isinstance(leaf, Tensor) else torch.as_tensor(leaf)
            for i in (picks if size else [])
            for leaf in optree.tree_leaves(dataset[i])
        ]
    for t in tensors:
        t = t.detach().cpu().contiguous()
        digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


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
        dataset: any form :func:`as_dataset` accepts; it must hold at
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

    Raises:
        ValueError: ``indices`` is not 1-D integer, an index is out of
            range, the dataset is empty, ``physical_batch_size < 1``, ``num``
            is smaller than needed (that would drop examples), or
            ``mask_dtype`` is not a floating dtype.
        TypeError: the dataset's form is refused (:func:`as_dataset`).

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
    batch = _gather(dataset, padded, count)
    leaves = optree.tree_leaves(batch)
    device = leaves[0].device if leaves else torch.device("cpu")
    mask = (torch.arange(total, device=device) < count).to(mask_dtype)
    out = []
    for j in range(num):
        rows = slice(j * physical_batch_size, (j + 1) * physical_batch_size)
        out.append((optree.tree_map(lambda leaf, rows=rows: leaf[rows], batch), mask[rows]))
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
        dataset: any form :func:`as_dataset` accepts, with >= 1 example;
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
        TypeError: the dataset's form is refused (:func:`as_dataset`).
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


def _refusal(kind: type[Exception], reason: str) -> Exception:
    """``kind(reason)`` followed by the one list of accepted forms, shared by every refusal."""
    return kind(f"{reason}. dpfunc accepts {ACCEPTED_DATASETS}")


def _is_indexable(dataset: Any) -> bool:
    return hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")


def _is_ndarray(value: Any) -> bool:
    numpy = sys.modules.get("numpy")  # an array exists only if numpy is imported
    return numpy is not None and isinstance(value, numpy.ndarray)


def _is_column(value: Any) -> bool:
    return isinstance(value, Tensor) or _is_ndarray(value)


def _from_numpy(array: Any, what: str) -> Tensor:
    """A tensor sharing ``array``'s memory where torch can (a copy only if it cannot)."""
    if array.dtype.kind not in "biufc":  # bool, int, uint, float, complex
        raise _refusal(
            TypeError,
            f"{what} is a numpy array of dtype {array.dtype}, which is not numeric; convert it "
            "to numbers first (e.g. class labels to int64)",
        )
    if not array.dtype.isnative:  # torch reads native byte order only
        array = array.astype(array.dtype.newbyteorder("="))
    if any(stride < 0 for stride in array.strides):  # e.g. x[::-1]: torch needs >= 0
        array = array.copy()
    with warnings.catch_warnings():
        # a read-only array is fine: rows are only ever read (index_select copies them)
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def _sequence(columns: Sequence[Any]) -> Tensor | tuple[Tensor, ...]:
    """A tuple, or a list holding a tensor or array, read as columns or examples (never guessed).

    See :func:`as_dataset`: a tuple is columns; a list is columns where its
    entries' shapes differ, examples where they are 0-d, and ambiguous (refused)
    where they all share one shape of at least one dimension.
    """
    kind = type(columns).__name__
    if not columns:
        raise _refusal(ValueError, f"dataset is an empty {kind}, which holds no columns")
    if isinstance(columns, tuple) and all(isinstance(c, (tuple, list)) for c in columns):
        inner = type(columns[0]).__name__
        raise _refusal(
            ValueError,
            f"dataset is a tuple of {len(columns)} {inner}s, which reads two ways: as "
            f"{len(columns)} examples, one per {inner} (e.g. ((x0, y0), (x1, y1))), or as "
            f"{len(columns)} columns of per-example values (e.g. (xs, ys) from zip(*pairs)); "
            "dpfunc does not guess. Say which: list(dataset) for examples, or one tensor per "
            "column, e.g. (torch.stack(xs), torch.as_tensor(ys))",
        )
    for k, column in enumerate(columns):
        if not _is_column(column):
            raise _refusal(
                TypeError,
                f"dataset is a {kind}, read as columns, but its element {k} is a "
                f"{type(column).__name__}, not a tensor or numpy array; convert it with "
                "torch.as_tensor (torch.stack for a list of tensors)",
            )
    tensors = tuple(
        _from_numpy(c, f"column {k} of the dataset") if _is_ndarray(c) else c
        for k, c in enumerate(columns)
    )
    shapes = {tuple(t.shape) for t in tensors}
    if isinstance(columns, list) and len(shapes) == 1:
        (shape,) = shapes
        if not shape:  # 0-d entries: no columns, so one example each
            return torch.stack(tensors)
        raise _refusal(
            ValueError,
            f"dataset is a list of {len(tensors)} tensors that all have shape {shape}, which "
            f"reads two ways: as {len(tensors)} examples of shape {shape}, one per tensor, or "
            f"as {shape[0]} examples of {len(tensors)} columns (like [x, y], one column per "
            "entry); dpfunc does not guess. Say which: torch.stack(dataset) for "
            f"{len(tensors)} examples (with labels: (torch.stack(dataset), labels)), or "
            f"tuple(dataset) for {shape[0]} examples of {len(tensors)} columns",
        )
    return _columns(tensors, kind)


def _columns(tensors: tuple[Tensor, ...], kind: str) -> tuple[Tensor, ...]:
    """``tensors`` as the columns of a dataset, after checking they have rows, as many each."""
    for k, t in enumerate(tensors):
        if t.dim() == 0:
            raise _refusal(
                ValueError,
                f"column {k} of the {kind} dataset is 0-d; every column needs rows (for one "
                "example per tensor, pass torch.stack(dataset))",
            )
    sizes = [t.shape[0] for t in tensors]
    if len(set(sizes)) != 1:
        raise _refusal(
            ValueError,
            f"the columns of a {kind} dataset must share their leading size (one row per "
            f"example), got sizes {sizes}; one tensor per example must be stacked first "
            "(torch.stack), after padding them to one shape",
        )
    return tensors


def _loader_dataset(loader: DataLoader) -> Any:
    """The dataset behind ``loader``, after checking that ignoring the loader changes no example."""
    dataset = as_dataset(loader.dataset)  # refuses an iterable dataset, with its reason
    sampler, batch_sampler = loader.sampler, loader.batch_sampler
    if type(sampler) not in (SequentialSampler, RandomSampler, DistributedSampler) or (
        batch_sampler is not None and type(batch_sampler) is not BatchSampler
    ):
        chooser = sampler if type(batch_sampler) in (BatchSampler, type(None)) else batch_sampler
        raise _refusal(
            TypeError,
            f"the DataLoader's {type(chooser).__name__} may choose which examples are used, "
            "and dpfunc reads the loader's whole dataset with Poisson sampling; pass the "
            "examples to train on as a dataset, e.g. torch.utils.data.Subset(dataset, indices)",
        )
    if loader.collate_fn not in (default_collate, default_convert):
        raise _refusal(
            TypeError,
            f"the DataLoader has a custom collate_fn ({loader.collate_fn!r}), which dpfunc "
            "would not call: it gathers fixed-shape micro-batches itself, so ignoring the "
            "collate_fn would train on other examples than the loader yields; do per-example "
            "work in the dataset's __getitem__ and pass the dataset",
        )
    warnings.warn(
        f"dpfunc reads the DataLoader's dataset ({dataset_size(dataset)} examples) and not its "
        f"sampler ({type(sampler).__name__}), shuffle or batch_size={loader.batch_size}: "
        "every step draws its examples by Poisson sampling (each example independently with "
        "probability sample_rate), which the privacy accounting assumes; pass the dataset "
        "itself to silence this warning",
        UserWarning,
        stacklevel=_caller_outside_dpfunc(),
    )
    return dataset


def _caller_outside_dpfunc() -> int:
    """The ``stacklevel`` of the nearest caller outside dpfunc: a warning points at user code."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _hugging_face_kind(dataset: Any) -> str | None:
    """``"Dataset"`` or ``"DatasetDict"`` for those Hugging Face types, else ``None``."""
    hf = sys.modules.get("datasets")  # a Hugging Face dataset exists only if this is imported
    for name in ("Dataset", "DatasetDict"):
        cls = getattr(hf, name, None)
        if isinstance(cls, type) and isinstance(dataset, cls):
            return name
    return None


class _HuggingFaceRows:
    """A Hugging Face ``datasets.Dataset`` read through its torch format, a batch at a time.

    ``with_format`` returns a view on the same Arrow table: nothing is
    copied until rows are read.
    """

    def __init__(self, table: Any) -> None:
        columns = table.format["columns"]
        if columns is None:
            columns = table.column_names
        refused = [
            f"{name!r} ({table.features[name]})"
            for name in columns
            if not _hf_numeric(table.features[name])
        ]
        if refused:
            raise _refusal(
                TypeError,
                f"the Hugging Face dataset's columns {', '.join(refused)} are neither numeric "
                "nor images; remove them (dataset.remove_columns) or select the others "
                "(dataset.select_columns), after turning what the model needs into numbers "
                "(e.g. tokenising text with padding to a fixed length)",
            )
        self.table = table.with_format("torch", columns=columns)

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return self.table[i]

    def rows(self, indices: Tensor) -> dict[str, Tensor]:
        batch = self.table[indices.tolist()]
        for name, column in batch.items():
            if not isinstance(column, Tensor):
                raise ValueError(
                    f"column {name!r} of the Hugging Face dataset holds examples of different "
                    "shapes, which cannot share a micro-batch; pad them to one shape (e.g. "
                    "padding='max_length' when tokenising) or remove the column"
                )
        return batch


def _hf_numeric(feature: Any) -> bool:
    """Whether a Hugging Face feature's torch format is a tensor of numbers."""
    kind = type(feature).__name__
    if kind == "Value" or kind.startswith("Array"):  # Value, Array2D ... Array5D
        dtype = str(feature.dtype)
        return dtype == "bool" or dtype.startswith(("int", "uint", "float"))
    if kind in ("List", "LargeList", "Sequence"):
        return _hf_numeric(feature.feature)
    if kind == "Image":
        return bool(feature.decode)
    return kind == "ClassLabel"


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


def _gather(dataset: Any, indices: Tensor, count: int) -> PyTree:
    """Rows at ``indices`` of an :func:`as_dataset` form: a pytree, leading dim ``len(indices)``."""
    if isinstance(dataset, Tensor):
        return dataset.index_select(0, indices.to(dataset.device))
    if isinstance(dataset, tuple):
        return tuple(t.index_select(0, indices.to(t.device)) for t in dataset)
    if isinstance(dataset, _HuggingFaceRows):
        return dataset.rows(indices)
    return _gather_items(dataset, indices, count)


def _gather_items(dataset: Any, indices: Tensor, count: int) -> PyTree:
    positions = indices.tolist()
    items = [dataset[i] for i in positions[:count]]
    if len(positions) > count:
        items += [dataset[0]] * (len(positions) - count)
    flat = [optree.tree_flatten(item) for item in items]
    spec = flat[0][1]
    for position, (_, other) in zip(positions, flat):
        if other != spec:
            raise ValueError(
                f"every dataset item must have the same structure; dataset[{position}] has "
                f"{other}, dataset[{positions[0]}] has {spec}"
            )
    columns = []
    for k in range(spec.num_leaves):
        collated = default_collate([leaves[k] for leaves, _ in flat])
        if not isinstance(collated, Tensor):
            raise _refusal(
                TypeError,
                f"leaf {k} of dataset[{positions[0]}] is a {type(flat[0][0][k]).__name__}, "
                f"which collates to a {type(collated).__name__}, not a tensor",
            )
        columns.append(collated)
    return optree.tree_unflatten(spec, columns)
