"""Datasets in the forms people have them, read as rows that Poisson sampling can index.

DP-SGD's sampler (:mod:`dpfunc.data`) includes every example independently at
every step, so it must read any example by its index, and the accountant needs
the number of examples. This module is where a user's dataset becomes that:
:func:`as_dataset` reads the forms people have (a tensor or numpy array of rows,
columns such as ``(x, y)``, a map-style dataset or a list of examples, a
``DataLoader`` over one of these, a Hugging Face ``datasets.Dataset``) into a
tensor, a tuple of column tensors or a map-style dataset, never by a guess where
a form reads two ways, and refuses the rest (iterable datasets, dicts, a
``DatasetDict``) with a message that names the accepted forms
(:data:`ACCEPTED_DATASETS`, ``docs/data.md``). :func:`dataset_size` counts its
examples, :func:`dataset_fingerprint` hashes it (ranks of a data-parallel job
must hold the same data in the same order), and :func:`gather_rows` gathers the
rows at given indices into one batch: a pytree whose leaves have the indices as
their leading dimension.

Data that needs a collate function (token sequences of different lengths, a
random masking collator) is :class:`Collated`: its items are read and collated
per micro-batch, when a step uses them, so memory does not grow with the corpus
and a random collator draws afresh at every step.

Nothing here samples, pads or shuffles: which rows a step reads, and how they
become fixed-shape micro-batches with a mask, is :mod:`dpfunc.data`'s.
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

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

PyTree = Any

__all__ = [
    "ACCEPTED_DATASETS",
    "Collated",
    "as_dataset",
    "dataset_fingerprint",
    "dataset_size",
    "gather_rows",
]


ACCEPTED_DATASETS = (
    "a Tensor or numpy array of rows; a tuple of tensors or numpy arrays, read as columns "
    "with a common leading size, e.g. (x, y), or a list of them whose shapes differ, e.g. "
    "[x, y]; a map-style dataset (__len__ and __getitem__(int) returning tensors, numbers, "
    "numpy arrays or tuples/lists/dicts of them), e.g. a TensorDataset or a list of (x, y) "
    "examples; a DataLoader over one of these; or a Hugging Face datasets.Dataset with "
    "numeric or image columns; or Collated(dataset, collate_fn) for items that a collate "
    "function makes into batches (e.g. token ids of different lengths)"
)
"""The accepted forms, in words: the end of every message that refuses a dataset's form."""


def as_dataset(dataset: Any) -> Any:
    """``dataset`` in the form that :func:`gather_rows` gathers rows from.

    Every function here and in :mod:`dpfunc.data` that takes a dataset calls
    this first, so a :class:`dpfunc.Trainer` can be handed any accepted form
    as it is. Each form, how it is read, the order of the checks and every
    refusal: see docs/data.md, "Accepted forms" and "What happens to a
    DataLoader".

    Args:
        dataset: a tensor or numpy array of rows; a tuple of columns
            (``(x, y)``) or a list of columns whose shapes differ; a
            ``TensorDataset``, another map-style dataset or a list of
            examples; a ``DataLoader`` over one of these (its ``.dataset``,
            with a warning); a Hugging Face ``datasets.Dataset``.

    Returns:
        A ``Tensor``, a tuple of column tensors, or a map-style dataset.
        ``as_dataset(as_dataset(d))`` is ``as_dataset(d)``.

    Raises:
        TypeError: a refused form (an iterable dataset, a dict, a
            ``DatasetDict``, ...) or non-numeric data; the message names the
            accepted forms.
        ValueError: a 0-d tensor, columns of different lengths, or a form
            that reads two ways (a list of tensors of one shape, a tuple of
            tuples): the message names both readings and how to say which.

    >>> import numpy as np
    >>> x, y = as_dataset([np.zeros((3, 2)), torch.tensor([1, 0, 1])])
    >>> x.dtype, y.tolist(), dataset_size((x, y))
    (torch.float64, [1, 0, 1], 3)
    """
    if isinstance(dataset, DataLoader):
        return _loader_dataset(dataset)
    if isinstance(dataset, Collated):
        return dataset
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
    if isinstance(dataset, list) and _lists_of_one_length(dataset):
        k, m = len(dataset), len(dataset[0])
        raise _refusal(
            ValueError,
            f"dataset is a list of {k} lists that all have length {m}, which reads two ways: "
            f"as {k} examples of {m} values each, or as {k} columns of {m} examples (like "
            "[x.tolist(), y.tolist()]). Say which: columns as a tuple of tensors, e.g. "
            "(torch.tensor(xs), torch.tensor(ys)); examples as a list of tuples, e.g. "
            "list(zip(xs, ys)), or one tensor of rows, torch.tensor(rows)",
        )
    if _is_indexable(dataset):
        return dataset
    raise _refusal(TypeError, f"dataset of type {type(dataset).__name__} is not a dataset")


def _lists_of_one_length(dataset: list) -> bool:
    """Whether ``dataset`` holds 2 or more lists, all of one length (columns or examples?)."""
    return (
        len(dataset) >= 2
        and all(type(item) is list for item in dataset)
        and len({len(item) for item in dataset}) == 1
    )


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
    elif isinstance(dataset, Collated):  # raw items: token lists, strings, numbers
        picks = sorted({round(k * (size - 1) / max(rows - 1, 1)) for k in range(rows)})
        for i in picks if size else []:
            for leaf in optree.tree_leaves(dataset[i]):
                if isinstance(leaf, Tensor):
                    leaf = leaf.detach().cpu().contiguous()
                    digest.update(leaf.reshape(-1).view(torch.uint8).numpy().tobytes())
                else:
                    digest.update(repr(leaf).encode())
        return digest.hexdigest()
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


def gather_rows(dataset: Any, indices: Tensor, count: int) -> PyTree:
    """Rows at ``indices`` of an :func:`as_dataset` form: a pytree, leading dim ``len(indices)``.

    Tensors and columns are read with one ``index_select`` each, on their own
    device; a Hugging Face dataset a batch at a time; other map-style datasets
    item by item, collated with ``default_collate`` into the structure of one
    item.

    Args:
        dataset: what :func:`as_dataset` returns.
        indices: 1-D int64 CPU indices in ``[0, dataset_size(dataset))``.
        count: the number of real rows, at the front of ``indices``; the
            rest are padding, all index 0, and a map-style dataset reads its
            item 0 once for them.

    Raises:
        ValueError: map-style items differ in structure (both are named), or
            a Hugging Face column holds examples of different shapes.
        TypeError: a leaf of the items does not collate to a tensor.
    """
    if isinstance(dataset, Tensor):
        return dataset.index_select(0, indices.to(dataset.device))
    if isinstance(dataset, tuple):
        return tuple(t.index_select(0, indices.to(t.device)) for t in dataset)
    if isinstance(dataset, _HuggingFaceRows):
        return dataset.rows(indices)
    if isinstance(dataset, Collated):
        return dataset.collate(indices)
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


class Collated:
    """A map-style dataset whose batches ``collate_fn`` makes, one micro-batch at a time.

    ``Collated(dataset, collate_fn)`` is how data that needs a collate function
    (token ids of different lengths, a tokenizer's padding, a masking collator
    such as transformers' ``DataCollatorForLanguageModeling``) is given to
    :class:`dpfunc.Trainer` and :class:`dpfunc.PrivateGradients`; ``PrivateTrainer``
    reads its ``data_collator`` so.
    When a step uses a micro-batch, its items are read (``dataset[i]``, or
    ``dataset.__getitems__(indices)`` where the dataset has it, as a
    ``DataLoader`` does) and ``collate_fn(items)`` makes the batch. So:

    * memory holds one micro-batch of collated rows, never the corpus: a
      memory-mapped ``datasets.Dataset`` of any size is read row by row;
    * a random collator draws afresh at every step (from the global torch
      generator, as in a ``DataLoader``'s worker-less loop: seed it, or
      ``transformers.set_seed``, for a reproducible run). Its randomness need
      not be secret: each example's loss, whatever mask it drew, is clipped
      alone;
    * a micro-batch is padded by the collator to its own longest example,
      not the corpus's (``pad_to_multiple_of``, or the buckets of
      ``PrivateTrainer``, keep the compiled shapes few).

    The contract of ``collate_fn``: row ``i`` of every tensor it returns is
    made from item ``i`` alone (padding, tokenising, masking, augmenting one
    example), one row per item. A collator that packs several examples into a
    row (transformers' ``DataCollatorWithFlattening``) is refused when its
    output has fewer rows than items; one that mixes rows (mixup) cannot be
    told apart from the output and voids the per-example guarantee: do it
    inside the loss, per example, or not at all.

    Args:
        dataset: a map-style dataset: ``len(dataset)`` examples and
            ``dataset[i]`` for ``0 <= i < len(dataset)`` (a ``datasets.Dataset``,
            a torch ``Dataset`` with ``__len__``, a list of items).
        collate_fn: ``collate_fn(list_of_items) -> batch``, a pytree of
            tensors with one row per item.

    Raises:
        TypeError: ``dataset`` has no length or no random access (an
            iterable), or ``collate_fn`` is not callable.
    """

    def __init__(self, dataset: Any, collate_fn: Any) -> None:
        if isinstance(dataset, (DataLoader, Collated)):
            raise TypeError(
                f"Collated takes the dataset itself, got a {type(dataset).__name__}; pass its "
                "dataset (loader.dataset) and the collate function"
            )
        if isinstance(dataset, IterableDataset) or not _is_indexable(dataset):
            raise TypeError(
                f"Collated needs a map-style dataset (__len__ and __getitem__), got a "
                f"{type(dataset).__name__}: Poisson sampling reads any example by its index, "
                "and the accountant needs the number of examples"
            )
        if not callable(collate_fn):
            raise TypeError(
                f"collate_fn must be callable, collate_fn(items) -> batch, got {collate_fn!r}"
            )
        self.dataset = dataset
        self.collate_fn = collate_fn

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        return self.dataset[i]

    def collate(self, indices: Tensor) -> PyTree:
        """``collate_fn`` of the items at ``indices``, after checking its rows.

        Raises:
            ValueError: a tensor of the batch has not one row per item (a
                packing collator), naming the key and both sizes.
            TypeError: the batch holds something other than tensors
                (strings, lists), naming the key.
        """
        positions = indices.tolist()
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems is not None:
            items = getitems(positions)
        else:
            items = [self.dataset[i] for i in positions]
        batch = self.collate_fn(items)
        if isinstance(batch, Mapping) and not isinstance(batch, dict):
            batch = dict(batch)  # transformers' BatchEncoding: a dict with methods
        paths, leaves, _ = optree.tree_flatten_with_path(batch)
        for path, leaf in zip(paths, leaves):
            key = ".".join(map(str, path)) or "the batch"
            if not isinstance(leaf, Tensor):
                raise TypeError(
                    f"collate_fn returned {type(leaf).__name__} at {key!r}, not a tensor: every "
                    "column a step reads must be a tensor with one row per example (drop the "
                    "others in the collator or the dataset)"
                )
            if leaf.dim() == 0 or leaf.shape[0] != len(positions):
                rows = leaf.shape[0] if leaf.dim() else "no"
                raise ValueError(
                    f"collate_fn returned {rows} rows at {key!r} for {len(positions)} examples: "
                    "each example must be a row of its own, since each is clipped alone. A "
                    "collator that packs examples into one row (transformers' "
                    "DataCollatorWithFlattening, padding-free packing) is not supported: pad "
                    "instead (DataCollatorWithPadding, DataCollatorForLanguageModeling)"
                )
        return batch

    def __repr__(self) -> str:
        return f"Collated({type(self.dataset).__name__} of {len(self)}, {self.collate_fn!r})"


# --------------------------------------------------------------------------- helpers


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
    if loader.collate_fn not in (default_collate, default_convert) and not isinstance(
        loader.dataset, IterableDataset
    ):
        raise _refusal(
            TypeError,
            f"the DataLoader has a custom collate_fn ({loader.collate_fn!r}), which dpfunc "
            "does not call unasked: it gathers fixed-shape micro-batches itself. To collate "
            "each micro-batch with it, pass dpfunc.datasets.Collated(loader.dataset, "
            "loader.collate_fn), whose contract is one row per example, made from that "
            "example alone (padding, tokenising, masking; never mixup or packing)",
        )
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
