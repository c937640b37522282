"""Tests for dpfunc.data and dpfunc.datasets: the accepted dataset forms, Poisson sampling and
fixed-shape padded micro-batches."""

from __future__ import annotations

import math
import re
import warnings
from collections import Counter

import numpy as np
import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

import dpfunc
from dpfunc.data import (
    PoissonBatches,
    micro_batches,
    num_micro_batches,
    poisson_sample,
    split_for_rank,
)
from dpfunc.datasets import ACCEPTED_DATASETS, as_dataset, dataset_fingerprint, dataset_size

# ----------------------------------------------------------------------------- helpers


def rows_dataset(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) whose row i encodes i: x[i] = [i, i + 0.5, -i], y[i] = i."""
    i = torch.arange(n, dtype=torch.float32)
    return torch.stack([i, i + 0.5, -i], dim=1), torch.arange(n)


class ItemDataset:
    """An indexable dataset returning (tensor, int) and checking it gets Python ints."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        assert type(i) is int, type(i)
        if not 0 <= i < self.n:
            raise IndexError(i)
        self.calls.append(i)
        return torch.tensor([float(i), i + 0.5, -float(i)]), i


class NumberDataset:
    """An indexable dataset returning a bare number."""

    def __len__(self) -> int:
        return 7

    def __getitem__(self, i: int) -> float:
        return 10.0 * i


def real_ids(batches) -> list[int]:
    """The row ids (column y) of real rows, in order, across micro-batches."""
    out = []
    for (_, y), mask in batches:
        out += y[mask == 1].tolist()
    return out


# ----------------------------------------------------------------------------- sampling


def test_inclusion_frequency_matches_sample_rate():
    n, q, steps = 200, 0.1, 400
    counts = torch.zeros(n)
    sizes = []
    for step in range(steps):
        idx = poisson_sample(n, q, seed=7, step=step)
        counts[idx] += 1
        sizes.append(idx.numel())
    # each example: Binomial(steps, q), within 5 sigma
    sd = math.sqrt(steps * q * (1 - q))
    assert (counts - steps * q).abs().max() < 5 * sd, counts
    # overall: Binomial(n * steps, q)
    total_sd = math.sqrt(n * steps * q * (1 - q))
    assert abs(counts.sum().item() - n * steps * q) < 5 * total_sd
    # Poisson sampling, not fixed-size: batch sizes vary like Binomial(n, q)
    sizes_t = torch.tensor(sizes, dtype=torch.float64)
    var = sizes_t.var().item()
    assert 0.6 * n * q * (1 - q) < var < 1.4 * n * q * (1 - q), var
    assert min(sizes) < n * q < max(sizes)


@settings(max_examples=25, deadline=None)
@given(q=st.sampled_from([0.01, 0.3, 0.9]))
def test_mean_batch_size_is_expected_batch_size(q):
    n, steps = 500, 200
    total = sum(poisson_sample(n, q, seed=1, step=s).numel() for s in range(steps))
    sd = math.sqrt(n * steps * q * (1 - q))
    assert abs(total - n * steps * q) < 5 * sd


def test_sample_depends_only_on_seed_and_step():
    a = poisson_sample(1000, 0.5, seed=3, step=11)
    torch.manual_seed(123)
    _ = poisson_sample(1000, 0.5, seed=3, step=12)  # other calls in between
    b = poisson_sample(1000, 0.5, seed=3, step=11)
    assert torch.equal(a, b)
    assert not torch.equal(a, poisson_sample(1000, 0.5, seed=3, step=12))
    assert not torch.equal(a, poisson_sample(1000, 0.5, seed=4, step=11))


def test_sample_does_not_touch_global_rng():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    poisson_sample(100, 0.5, seed=0, step=0)
    assert torch.equal(torch.rand(3), expected)


def test_sample_is_sorted_unique_int64():
    idx = poisson_sample(300, 0.4, seed=0, step=2)
    assert idx.dtype == torch.int64 and idx.dim() == 1
    assert torch.all(idx[1:] > idx[:-1])
    assert idx.min() >= 0 and idx.max() < 300


def test_sample_rate_one_takes_everything():
    assert torch.equal(poisson_sample(17, 1.0, seed=2, step=9), torch.arange(17))
    assert torch.equal(poisson_sample(17, 1, seed=2, step=9), torch.arange(17))


# ----------------------------------------------------------------------------- shapes


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40),
    physical=st.integers(1, 9),
    data=st.data(),
)
def test_fixed_shapes_and_nothing_dropped(n, physical, data):
    indices = data.draw(st.lists(st.integers(0, n - 1), max_size=3 * n))
    dataset = rows_dataset(n)
    batches = micro_batches(dataset, torch.tensor(indices, dtype=torch.int64), physical)
    assert len(batches) == num_micro_batches(len(indices), physical)
    assert len(batches) == max(1, math.ceil(len(indices) / physical))
    for (x, y), mask in batches:
        assert x.shape == (physical, 3) and y.shape == (physical,)
        assert mask.shape == (physical,) and mask.dtype == torch.float32
        assert set(mask.tolist()) <= {0.0, 1.0}
        # every row is a real dataset row (x encodes y)
        expected_x = torch.stack([y.float(), y.float() + 0.5, -y.float()], dim=1)
        assert torch.equal(x, expected_x)
        # padding rows are copies of row 0
        assert torch.all(y[mask == 0] == 0)
    assert sum(m.sum().item() for _, m in batches) == len(indices)
    assert real_ids(batches) == indices  # same rows, same order, none dropped


def test_oversized_batch_splits():
    x, y = rows_dataset(50)
    idx = poisson_sample(50, 0.8, seed=0, step=0)
    assert idx.numel() > 16
    batches = micro_batches((x, y), idx, 8)
    assert len(batches) == math.ceil(idx.numel() / 8)
    assert Counter(real_ids(batches)) == Counter(idx.tolist())
    assert all(m.all() for _, m in batches[:-1])  # only the last one is padded


def test_empty_logical_batch_is_one_all_padding_micro_batch():
    x, y = rows_dataset(5)
    batches = micro_batches((x, y), torch.empty(0, dtype=torch.int64), 4)
    assert len(batches) == 1
    (bx, by), mask = batches[0]
    assert bx.shape == (4, 3) and torch.all(mask == 0)
    assert torch.equal(bx, x[[0, 0, 0, 0]]) and torch.all(by == 0)
    assert torch.isfinite(bx).all()
    assert num_micro_batches(0, 4) == 1


def test_empty_poisson_sample_still_steps():
    idx = poisson_sample(3, 1e-9, seed=0, step=0)
    assert idx.numel() == 0
    loader = PoissonBatches(rows_dataset(3), 1e-9, 4)
    batches, count = loader.logical_batch(0)
    assert count == 0 and len(batches) == 1
    assert torch.all(batches[0][1] == 0)


def test_num_pads_with_extra_micro_batches():
    batches = micro_batches(rows_dataset(10), [3, 4, 5, 6, 7], 4, num=3)
    assert len(batches) == 3
    assert [m.sum().item() for _, m in batches] == [4.0, 1.0, 0.0]
    assert real_ids(batches) == [3, 4, 5, 6, 7]


def test_num_too_small_raises():
    with pytest.raises(ValueError, match=r"num=1"):
        micro_batches(rows_dataset(10), [1, 2, 3, 4, 5], 4, num=1)


def test_indices_as_tensor_list_or_numpy_agree():
    dataset = rows_dataset(8)
    as_list = micro_batches(dataset, [6, 1, 3], 2)
    for other in (torch.tensor([6, 1, 3], dtype=torch.int32), np.array([6, 1, 3])):
        got = micro_batches(dataset, other, 2)
        assert real_ids(got) == real_ids(as_list) == [6, 1, 3]


def test_mask_dtype():
    ((_, mask),) = micro_batches(torch.arange(4.0), [1], 2, mask_dtype=torch.float64)
    assert mask.dtype == torch.float64 and mask.tolist() == [1.0, 0.0]


# ----------------------------------------------------------------------------- dataset kinds


def _kinds():
    x, y = rows_dataset(6)
    return {
        "tensor": x,
        "tuple": (x, y),
        "tensor_dataset": TensorDataset(x, y),
        "items": ItemDataset(6),
        "numbers": NumberDataset(),
    }


def test_dataset_fingerprint_sees_order_and_contents():
    x, y = rows_dataset(6)
    base = dataset_fingerprint((x, y))
    assert dataset_fingerprint((x.clone(), y.clone())) == base
    assert dataset_fingerprint((x.flip(0), y.flip(0))) != base  # another order
    assert dataset_fingerprint((x, y + 1)) != base
    assert dataset_fingerprint(TensorDataset(x, y)) == base
    items = ItemDataset(6)
    assert dataset_fingerprint(items) == dataset_fingerprint(ItemDataset(6))


@pytest.mark.parametrize("kind", list(_kinds()))
def test_dataset_kinds(kind):
    dataset = _kinds()[kind]
    x, y = rows_dataset(6)
    indices = [5, 2, 2, 4, 1]
    padded = indices + [0]
    assert dataset_size(dataset) == (7 if kind == "numbers" else 6)
    batches = micro_batches(dataset, torch.tensor(indices), 3)
    assert len(batches) == 2
    assert [m.tolist() for _, m in batches] == [[1, 1, 1], [1, 1, 0]]
    if kind == "tensor":
        got = torch.cat([b for b, _ in batches])
        assert torch.equal(got, x[padded])
    elif kind == "numbers":
        got = torch.cat([b for b, _ in batches])
        assert got.shape == (6,)
        assert got.tolist() == [10.0 * i for i in padded]
    else:
        for b, _ in batches:
            assert type(b) is tuple and len(b) == 2
            assert b[0].shape == (3, 3) and b[1].shape == (3,)
        got_x = torch.cat([b[0] for b, _ in batches])
        got_y = torch.cat([b[1] for b, _ in batches])
        assert torch.equal(got_x, x[padded])
        assert torch.equal(got_y, y[padded]) and got_y.dtype == torch.int64


def test_item_dataset_reads_row_zero_once_for_padding():
    dataset = ItemDataset(6)
    micro_batches(dataset, [3], 5)
    assert sorted(dataset.calls) == [0, 3]


def test_dict_items_keep_their_structure():
    class DictDataset:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"x": torch.full((2,), float(i)), "label": i}

    ((batch, mask),) = micro_batches(DictDataset(), [3, 1], 3)
    assert set(batch) == {"x", "label"}
    assert batch["x"].tolist() == [[3.0, 3.0], [1.0, 1.0], [0.0, 0.0]]
    assert batch["label"].tolist() == [3, 1, 0]
    assert mask.tolist() == [1.0, 1.0, 0.0]


def test_unsupported_dataset_raises_type_error():
    with pytest.raises(TypeError, match="object"):
        dataset_size(object())
    with pytest.raises(TypeError, match="int"):
        micro_batches(5, [0], 2)


def test_mismatched_leading_sizes_raise():
    with pytest.raises(ValueError, match="leading size"):
        micro_batches((torch.zeros(4, 2), torch.zeros(5)), [0], 2)


def test_empty_dataset_raises():
    with pytest.raises(ValueError, match="at least one"):
        micro_batches(torch.zeros(0, 3), [], 2)


# ----------------------------------------------------------------------------- accepted forms


class TransformDataset(Dataset):
    """A map-style Dataset whose __getitem__ normalises x and adds fresh noise to it.

    It records every item it returns, so a test can check that the gathered
    batch holds exactly those items (the noise differs between calls).
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, item: str = "tuple") -> None:
        self.x, self.y, self.item = x, y, item
        self.mean, self.std = x.mean(0), x.std(0)
        self.returned: list = []

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        x = (self.x[i] - self.mean) / self.std + 0.1 * torch.randn(self.x.shape[1])
        item = {
            "tuple": (x, int(self.y[i])),
            "dict": {"x": x, "y": int(self.y[i])},
            "numpy": (x.numpy(), np.int64(self.y[i])),
        }[self.item]
        self.returned.append(item)
        return item


def row_ids(batch) -> torch.Tensor:
    """The row ids of a gathered batch of any form built from ``rows_dataset``."""
    if isinstance(batch, dict):
        return batch["y"]
    if isinstance(batch, torch.Tensor):  # rows of x: column 1 is id + 0.5
        return (batch[:, 1] - 0.5).long()
    return batch[1]


def forms(n: int) -> dict:
    """The same examples (row i encodes i) in every accepted form."""
    x, y = rows_dataset(n)
    return {
        "tensor_tuple": (x, y),
        "numpy_tuple": (x.numpy(), y.numpy()),
        "tensor_list": [x, y],
        "mixed_list": [x.numpy(), y],
        "numpy_rows": x.numpy(),
        "tensor_dataset": TensorDataset(x, y),
        "loader": DataLoader(TensorDataset(x, y), batch_size=7, shuffle=True),
        "loader_no_batching": DataLoader(TensorDataset(x, y), batch_size=None),
        "items": ItemDataset(n),
        "transform": TransformDataset(x, y),
        "list_of_examples": [(x[i], y[i]) for i in range(n)],
    }


@pytest.mark.filterwarnings("ignore:dpfunc reads the DataLoader")
@pytest.mark.parametrize("form", list(forms(2)))
def test_poisson_batches_gather_the_sampled_rows_from_every_form(form):
    n = 30
    dataset = forms(n)[form]
    assert dataset_size(dataset) == n
    loader = PoissonBatches(dataset, 0.3, 4, seed=11)
    for step in range(4):
        sampled = poisson_sample(n, 0.3, seed=11, step=step).tolist()
        batches, count = loader.logical_batch(step)
        assert count == len(sampled)
        got = []
        for batch, mask in batches:
            ids = row_ids(batch)
            assert ids.shape == mask.shape == (4,)
            assert torch.all(ids[mask == 0] == 0)  # padding is row 0
            got += ids[mask == 1].tolist()
        assert got == sampled
    # and micro_batches directly, without PoissonBatches
    ((batch, mask),) = micro_batches(dataset, [9, 2, 9], 4)
    assert row_ids(batch).tolist() == [9, 2, 9, 0] and mask.tolist() == [1, 1, 1, 0]


def test_numpy_columns_are_columns_not_two_examples():
    x, y = rows_dataset(6)
    xn, yn = x.numpy().astype(np.float64), y.numpy()
    assert dataset_size((xn, yn)) == 6  # was 2: the tuple's elements read as examples
    cx, cy = as_dataset((xn, yn))
    assert np.shares_memory(cx.numpy(), xn) and np.shares_memory(cy.numpy(), yn)  # no copy
    assert cx.dtype == torch.float64 and cy.dtype == torch.int64  # dtypes kept
    ((bx, by), mask) = micro_batches((xn, yn), [4, 1], 3)[0]
    assert torch.equal(bx, torch.from_numpy(xn[[4, 1, 0]])) and by.tolist() == [4, 1, 0]
    assert mask.tolist() == [1.0, 1.0, 0.0]


def test_a_list_of_tensors_is_columns_like_a_tuple():
    x, y = rows_dataset(6)
    assert dataset_size([x, y]) == 6
    from_list = micro_batches([x, y], [5, 0, 3], 2)
    from_tuple = micro_batches((x, y), [5, 0, 3], 2)
    for (bl, ml), (bt, mt) in zip(from_list, from_tuple):
        assert type(bl) is tuple and torch.equal(ml, mt)
        assert all(torch.equal(a, b) for a, b in zip(bl, bt))


@pytest.mark.parametrize("count, shape", [(50, (3, 4, 4)), (200, (5,)), (2, (7,))])
def test_a_list_of_tensors_of_one_shape_is_refused_naming_both_readings(count, shape):
    # measured: 50 images of (3, 4, 4) were read as 3 examples of 50 columns, and 200
    # vectors of 5 as 5 examples (refused later for its expected_batch_size)
    entries = [torch.randn(shape) for _ in range(count)]
    for entry in (entries, [e.numpy() for e in entries]):
        with pytest.raises(ValueError) as info:
            dataset_size(entry)
        message = str(info.value)
        assert f"as {count} examples of shape {shape}" in message
        assert f"as {shape[0]} examples of {count} columns" in message
        assert "torch.stack(dataset)" in message and "tuple(dataset)" in message
        with pytest.raises(ValueError, match="reads two ways"):
            PoissonBatches(entry, 0.5, 2, seed=0)
    # each way of saying which is read as it says
    assert dataset_size(torch.stack(entries)) == count
    assert dataset_size(tuple(entries)) == shape[0]


def test_a_list_of_0d_tensors_is_examples():
    values = [torch.tensor(float(i)) for i in range(5)]
    assert dataset_size(values) == 5
    ((batch, mask),) = micro_batches(values, [4, 1], 3)
    assert batch.tolist() == [4.0, 1.0, 0.0] and mask.tolist() == [1.0, 1.0, 0.0]


def test_a_tuple_of_one_shape_stays_columns():
    ids, mask, labels = (torch.arange(12).reshape(4, 3) + k for k in range(3))
    assert dataset_size((ids, mask, labels)) == 4  # the (input_ids, mask, labels) form
    ((batch, _),) = micro_batches((ids, mask, labels), [2], 1)
    assert [t.tolist() for t in batch] == [[[6, 7, 8]], [[7, 8, 9]], [[8, 9, 10]]]


def test_a_list_of_example_tuples_is_examples():
    x, y = rows_dataset(6)
    pairs = list(zip(x, y))
    assert dataset_size(pairs) == 6
    ((bx, by), mask) = micro_batches(pairs, [5, 2], 3)[0]
    assert torch.equal(bx, x[[5, 2, 0]]) and by.tolist() == [5, 2, 0]
    assert mask.tolist() == [1.0, 1.0, 0.0]


def test_a_tuple_of_tuples_is_refused_naming_both_readings():
    x, y = rows_dataset(6)
    for dataset in (tuple(zip(x, y)), tuple(zip(*zip(x, y)))):  # 6 examples; 2 columns
        with pytest.raises(ValueError) as info:
            dataset_size(dataset)
        message = str(info.value)
        assert f"as {len(dataset)} examples, one per tuple" in message
        assert "columns of per-example values" in message and "list(dataset)" in message
    assert dataset_size(list(zip(x, y))) == 6


def test_a_numpy_array_is_rows_like_a_tensor():
    x, _ = rows_dataset(5)
    xn = x.numpy()
    assert dataset_size(xn) == 5
    ((batch, _),) = micro_batches(xn, [3, 3], 2)
    assert torch.equal(batch, x[[3, 3]])
    assert dataset_fingerprint(xn) == dataset_fingerprint(x)
    assert dataset_fingerprint((xn, xn)) == dataset_fingerprint((x, x))


def test_numpy_arrays_torch_cannot_share_are_read_right():
    x = np.arange(12.0).reshape(6, 2)
    reversed_rows = x[::-1]  # negative stride
    big_endian = x.astype(">f8")
    read_only = x.copy()
    read_only.flags.writeable = False
    for array in (reversed_rows, big_endian, read_only):
        ((batch, _),) = micro_batches(array, [0, 5], 2)
        assert batch.tolist() == array[[0, 5]].tolist()


@pytest.mark.parametrize(
    "array",
    [
        np.array([{"a": 1}, None, 3], dtype=object),
        np.array(["cat", "dog", "cow"]),
        np.array([b"a", b"b", b"c"]),
        np.array(["2024-01-01", "2024-01-02", "2024-01-03"], dtype="datetime64[D]"),
    ],
)
def test_non_numeric_numpy_arrays_raise_naming_the_dtype(array):
    for dataset in (array, (np.zeros((3, 2)), array), [array, torch.zeros(3)]):
        with pytest.raises(TypeError, match=re.escape(f"dtype {array.dtype}")):
            dataset_size(dataset)


def test_columns_of_different_sizes_raise_naming_the_sizes():
    for dataset in ((np.zeros((4, 2)), np.zeros(5)), [torch.zeros(4, 2), np.zeros(5)]):
        with pytest.raises(ValueError, match=re.escape("sizes [4, 5]")):
            micro_batches(dataset, [0], 2)
        with pytest.raises(ValueError, match=re.escape("sizes [4, 5]")):
            PoissonBatches(dataset, 0.5, 2, seed=0)


def test_a_tuple_holding_a_non_array_is_refused():
    x, y = rows_dataset(3)
    for dataset in ((x, y.tolist()), (x.tolist(), y), [x.numpy(), y.tolist()]):
        with pytest.raises(TypeError, match="element [01] is a list"):
            dataset_size(dataset)
    with pytest.raises(ValueError, match="empty tuple"):
        dataset_size(())


@pytest.mark.parametrize("item", ["tuple", "dict", "numpy"])
def test_per_example_transforms_are_applied_at_getitem(item):
    x, y = rows_dataset(10)
    dataset = TransformDataset(x, y, item)
    indices = [7, 2, 7, 9]
    batches = micro_batches(dataset, indices, 3)
    returned = dataset.returned  # dataset[7], [2], [7], [9], then row 0 once, for 2 pads
    assert len(returned) == 5
    rows = [optree.tree_leaves(r) for r in returned + returned[-1:]]
    got = [optree.tree_leaves(b) for b, _ in batches]
    for k in range(2):  # x, then y
        expected = torch.stack([torch.as_tensor(r[k]) for r in rows])
        assert torch.equal(torch.cat([g[k] for g in got]), expected)
    xs = torch.cat([g[0] for g in got])
    normalised = (x[indices + [0, 0]] - dataset.mean) / dataset.std
    assert 0 < (xs - normalised).abs().max() < 1.0  # the transform (and its noise) ran


def test_a_data_loader_gives_way_to_poisson_sampling_with_a_warning():
    x, y = rows_dataset(12)
    loader = DataLoader(TensorDataset(x, y), batch_size=5, shuffle=True)
    with pytest.warns(UserWarning, match=r"Poisson sampling.*privacy accounting") as caught:
        dataset = as_dataset(loader)
    message = str(caught[0].message)
    assert "RandomSampler" in message and "batch_size=5" in message and "12 examples" in message
    assert caught[0].filename == __file__  # points at the caller's line, not into dpfunc
    assert type(dataset) is tuple and dataset[0] is x and dataset[1] is y
    with pytest.warns(UserWarning):
        assert dataset_fingerprint(loader) == dataset_fingerprint((x, y))


def test_a_data_loader_that_would_change_the_examples_is_refused():
    x, y = rows_dataset(12)
    data = TensorDataset(x, y)
    refused = {
        "collate_fn": DataLoader(data, batch_size=4, collate_fn=lambda items: items),
        "SubsetRandomSampler": DataLoader(data, sampler=SubsetRandomSampler(range(6))),
        "WeightedRandomSampler": DataLoader(
            data, sampler=WeightedRandomSampler([1.0] * 6 + [0.0] * 6, 12)
        ),
        "list": DataLoader(data, batch_sampler=[[0, 1], [2, 3]]),
    }
    for name, loader in refused.items():
        with pytest.raises(TypeError, match=name) as err:
            PoissonBatches(loader, 0.5, 4, seed=0)
        assert ACCEPTED_DATASETS in str(err.value)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(5))


@pytest.mark.parametrize(
    "dataset",
    [
        Stream(),
        DataLoader(Stream(), batch_size=2),
        (i for i in range(5)),
        iter([1.0, 2.0]),
        map(float, range(5)),
    ],
    ids=["IterableDataset", "loader", "generator", "iterator", "map"],
)
def test_iterable_datasets_are_refused_for_want_of_random_access(dataset):
    with pytest.raises(TypeError, match="random access") as err:
        micro_batches(dataset, [0], 2)
    assert "by its index" in str(err.value) and ACCEPTED_DATASETS in str(err.value)


@pytest.mark.parametrize(
    "dataset",
    [
        object(),
        5,
        {"x": torch.zeros(3, 2), "y": torch.zeros(3)},
        "abc",
        (torch.zeros(3), [1, 2, 3]),
        np.array(["a", "b"]),
        DataLoader(TensorDataset(torch.zeros(3)), collate_fn=list),
    ],
    ids=["object", "int", "dict", "str", "tuple_with_list", "str_array", "collate_fn"],
)
def test_every_refusal_names_the_accepted_forms(dataset):
    for call in (
        lambda: as_dataset(dataset),
        lambda: dataset_size(dataset),
        lambda: dataset_fingerprint(dataset),
        lambda: micro_batches(dataset, [0], 2),
        lambda: PoissonBatches(dataset, 0.5, 2, seed=0),
    ):
        with pytest.raises(TypeError) as err:
            call()
        assert str(err.value).endswith(f"dpfunc accepts {ACCEPTED_DATASETS}")


def test_as_dataset_is_idempotent():
    for form in forms(8).values():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            once = as_dataset(form)
        twice = as_dataset(once)
        assert twice is once or (type(twice) is tuple and twice == once)


@pytest.mark.filterwarnings("ignore:dpfunc reads the DataLoader")
@pytest.mark.parametrize("form", ["numpy_tuple", "tensor_list", "loader"])
def test_trainer_takes_each_form_as_it_is(form):
    def train(dataset):
        model = torch.nn.Linear(3, 2)
        params = {k: torch.zeros_like(v) for k, v in model.named_parameters()}

        def loss_fn(p, example):
            x, y = example
            out = torch.func.functional_call(model, p, (x.unsqueeze(0),))
            return torch.nn.functional.cross_entropy(out, y.unsqueeze(0) % 2)

        trainer = dpfunc.Trainer(
            loss_fn, params, dataset, optimizer=dpfunc.optim.sgd(lr=0.1), epochs=1,
            expected_batch_size=8, clip_norm=1.0, noise_multiplier=1.0, delta=1e-3,
            physical_batch_size=8, seed=3, progress=False, accounting="rdp",
        )  # fmt: skip
        trainer.fit()
        return trainer.params

    reference = train(rows_dataset(40))
    got = train(forms(40)[form])
    assert all(torch.equal(got[k], reference[k]) for k in reference)


# ----------------------------------------------------------------------------- Hugging Face


@pytest.fixture
def hf():
    return pytest.importorskip("datasets")


def hf_rows(hf, n: int):
    x, y = rows_dataset(n)
    return hf.Dataset.from_dict({"x": x.tolist(), "y": y.tolist()})


def test_hugging_face_dataset_rows_are_its_torch_format(hf):
    table = hf_rows(hf, 9)
    assert dataset_size(table) == 9
    ((batch, mask),) = micro_batches(table, [8, 3, 8], 4)
    oracle = table.with_format("torch")
    assert set(batch) == {"x", "y"} and mask.tolist() == [1, 1, 1, 0]
    for key in batch:
        expected = torch.stack([oracle[i][key] for i in (8, 3, 8, 0)])
        assert torch.equal(batch[key], expected) and batch[key].dtype == expected.dtype
    assert batch["x"][:, 1].tolist() == [8.5, 3.5, 8.5, 0.5]
    assert dataset_fingerprint(table) == dataset_fingerprint(hf_rows(hf, 9))
    assert dataset_fingerprint(table) != dataset_fingerprint(hf_rows(hf, 10))


def test_hugging_face_non_numeric_columns_are_refused_by_name(hf):
    table = hf_rows(hf, 4).add_column("text", ["a", "b", "c", "d"])
    with pytest.raises(TypeError, match="'text'") as err:
        dataset_size(table)
    assert "'x'" not in str(err.value) and ACCEPTED_DATASETS in str(err.value)
    for chosen in (table.remove_columns("text"), table.select_columns(["x", "y"])):
        ((batch, _),) = micro_batches(chosen, [2], 2)
        assert set(batch) == {"x", "y"} and batch["y"].tolist() == [2, 0]


def test_hugging_face_ragged_column_raises_naming_it(hf):
    table = hf.Dataset.from_dict({"ids": [[1] * (i + 1) for i in range(4)], "y": [0, 1, 0, 1]})
    assert dataset_size(table) == 4
    with pytest.raises(ValueError, match="column 'ids'.*different shapes"):
        micro_batches(table, [3], 2)


def test_hugging_face_images_and_class_labels(hf):
    pil = pytest.importorskip("PIL.Image")
    pixels = [np.full((4, 5), 10 * i, dtype=np.uint8) for i in range(3)]
    table = hf.Dataset.from_dict(
        {"image": [pil.fromarray(p) for p in pixels], "label": [0, 1, 2]},
        features=hf.Features({"image": hf.Image(), "label": hf.ClassLabel(num_classes=3)}),
    )
    ((batch, _),) = micro_batches(table, [2, 1], 2)
    assert batch["image"].dtype == torch.uint8
    assert torch.equal(batch["image"].reshape(2, 4, 5), torch.from_numpy(np.stack(pixels[2:0:-1])))
    assert batch["label"].tolist() == [2, 1]


def test_hugging_face_splits_and_streams_are_refused(hf):
    table = hf_rows(hf, 4)
    with pytest.raises(TypeError, match=r"DatasetDict.*dataset\['train'\]"):
        dataset_size(hf.DatasetDict({"train": table}))
    with pytest.raises(TypeError, match="random access"):
        dataset_size(table.to_iterable_dataset())


# ----------------------------------------------------------------------------- ranks


@settings(max_examples=60, deadline=None)
@given(k=st.integers(0, 60), world_size=st.integers(1, 7))
def test_split_for_rank_covers_each_index_once(k, world_size):
    indices = torch.randperm(200)[:k]
    shares = [split_for_rank(indices, r, world_size) for r in range(world_size)]
    assert Counter(torch.cat(shares).tolist()) == Counter(indices.tolist())
    assert all(Counter(s.tolist()).most_common(1)[0][1] == 1 for s in shares if s.numel())
    sizes = [s.numel() for s in shares]
    assert max(sizes) - min(sizes) <= 1


def test_two_ranks_agree_on_count_and_cover_logical_batch():
    dataset = rows_dataset(60)
    physical = 4
    ranks = [PoissonBatches(dataset, 0.25, physical, seed=9, rank=r, world_size=2) for r in (0, 1)]
    uneven_seen = False
    for step in range(60):
        logical = poisson_sample(60, 0.25, seed=9, step=step)
        results = [loader.logical_batch(step) for loader in ranks]
        (b0, c0), (b1, c1) = results
        assert len(b0) == len(b1) == ranks[0].micro_batch_count(step)
        assert [c0, c1] == ranks[0].counts_per_rank(step) == ranks[1].counts_per_rank(step)
        assert c0 + c1 == logical.numel()
        for batches, count in results:
            assert sum(m.sum().item() for _, m in batches) == count
        assert sorted(real_ids(b0) + real_ids(b1)) == logical.tolist()
        assert not set(real_ids(b0)) & set(real_ids(b1))
        own = [num_micro_batches(c, physical) for c in (c0, c1)]
        uneven_seen |= own[0] != own[1]
    assert uneven_seen  # some step needed the padding micro-batch on one rank


def test_poisson_batches_single_rank_matches_functions():
    dataset = rows_dataset(30)
    loader = PoissonBatches(dataset, 0.3, 4, seed=2)
    assert loader.expected_batch_size == pytest.approx(9.0)
    for step, batches, count in loader.steps(5, 8):
        idx = poisson_sample(30, 0.3, seed=2, step=step)
        assert count == idx.numel()
        assert real_ids(batches) == idx.tolist()
        assert len(batches) == num_micro_batches(count, 4)
    first = next(iter(loader))
    assert first[0] == 0 and real_ids(first[1]) == poisson_sample(30, 0.3, seed=2, step=0).tolist()


def test_poisson_batches_default_to_a_fresh_secret_seed():
    dataset = rows_dataset(30)
    one, two = PoissonBatches(dataset, 0.5, 4), PoissonBatches(dataset, 0.5, 4)
    assert one.seed != two.seed and one.seed.bit_length() > 200
    assert str(one.seed) not in repr(one) and "seed=<secret>" in repr(one)
    assert any(not torch.equal(one.indices(t), two.indices(t)) for t in range(5))
    with pytest.raises(ValueError, match="shared_secret_seed"):  # ranks would disagree
        PoissonBatches(dataset, 0.5, 4, rank=0, world_size=2)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: poisson_sample(0, 0.5, seed=0, step=0), "num_examples"),
        (lambda: poisson_sample(2.0, 0.5, seed=0, step=0), "num_examples"),
        (lambda: poisson_sample(True, 0.5, seed=0, step=0), "num_examples"),
        (lambda: poisson_sample(10, 0.0, seed=0, step=0), "sample_rate"),
        (lambda: poisson_sample(10, -0.1, seed=0, step=0), "sample_rate"),
        (lambda: poisson_sample(10, 1.5, seed=0, step=0), "sample_rate"),
        (lambda: poisson_sample(10, float("nan"), seed=0, step=0), "sample_rate"),
        (lambda: poisson_sample(10, "0.1", seed=0, step=0), "sample_rate"),
        (lambda: poisson_sample(10, 0.5, seed=-1, step=0), "seed"),
        (lambda: poisson_sample(10, 0.5, seed=1.0, step=0), "seed"),
        (lambda: poisson_sample(10, 0.5, seed=0, step=-1), "step"),
        (lambda: split_for_rank(torch.arange(4), -1, 2), "rank"),
        (lambda: split_for_rank(torch.arange(4), 2, 2), "rank"),
        (lambda: split_for_rank(torch.arange(4), 0, 0), "world_size"),
        (lambda: split_for_rank(torch.zeros(2, 2), 0, 1), "indices"),
        (lambda: num_micro_batches(-1, 4), "batch_size"),
        (lambda: num_micro_batches(4, 0), "physical_batch_size"),
        (lambda: micro_batches(torch.zeros(4), [0], 0), "physical_batch_size"),
        (lambda: micro_batches(torch.zeros(4), [0], 2, num=0), "num"),
        (lambda: micro_batches(torch.zeros(4), [4], 2), "indices"),
        (lambda: micro_batches(torch.zeros(4), [-1], 2), "indices"),
        (lambda: micro_batches(torch.zeros(4), torch.zeros(1, 1, dtype=torch.int64), 2), "indices"),
        (lambda: micro_batches(torch.zeros(4), torch.tensor([0.0]), 2), "indices"),
        (lambda: micro_batches(torch.zeros(4), [0], 2, mask_dtype=torch.int64), "mask_dtype"),
        (lambda: PoissonBatches(torch.zeros(4), 0.0, 2), "sample_rate"),
        (lambda: PoissonBatches(torch.zeros(4), 0.5, 0), "physical_batch_size"),
        (lambda: PoissonBatches(torch.zeros(4), 0.5, 2, seed=-2), "seed"),
        (lambda: PoissonBatches(torch.zeros(4), 0.5, 2, rank=1), "rank"),
        (lambda: PoissonBatches(torch.zeros(4), 0.5, 2, world_size=0), "world_size"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(call, name):
    with pytest.raises(ValueError, match=name):
        call()


# -- Collated: items collated per micro-batch, when a step uses them ----------------------------


class CountingTexts(torch.utils.data.Dataset):
    """Token lists of different lengths; counts every item read."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        self.lengths = torch.randint(1, 9, (n,), generator=g).tolist()
        self.reads = 0

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        self.reads += 1
        return {"ids": [i % 7 + 1] * self.lengths[i], "y": i % 2}


def pad_texts(items):
    longest = max(len(item["ids"]) for item in items)
    ids = torch.tensor([item["ids"] + [0] * (longest - len(item["ids"])) for item in items])
    return {"ids": ids, "y": torch.tensor([item["y"] for item in items])}


def test_collated_data_is_read_per_micro_batch_and_padded_to_its_own_length():
    from dpfunc.datasets import Collated

    texts = CountingTexts(10_000)
    batches = PoissonBatches(Collated(texts, pad_texts), 8 / 10_000, 4, seed=3)
    assert texts.reads == 0  # nothing is read up front, whatever the size
    micro, count = batches.logical_batch(0)
    assert texts.reads == 4 * len(micro)  # the micro-batches' rows, padding included
    indices = batches.indices(0).tolist()
    for k, (batch, mask) in enumerate(micro):
        real = indices[4 * k : 4 * k + 4]
        assert batch["ids"].shape[0] == 4 and mask.sum() == len(real)
        assert batch["ids"].shape[1] == max(texts.lengths[i] for i in real + [0] * (4 - len(real)))
    assert count == len(indices)


def test_collated_batches_must_have_one_tensor_row_per_item():
    from dpfunc.datasets import Collated

    def packing(items):  # every item in one row, as padding-free packing does
        return {"ids": torch.tensor([sum((item["ids"] for item in items), [])])}

    with pytest.raises(ValueError, match=r"1 rows at 'ids' for 2 examples.*packs"):
        micro_batches(Collated(CountingTexts(5), packing), [0, 1], 2)
    with pytest.raises(TypeError, match="at 'ids.*not a tensor"):
        micro_batches(Collated(CountingTexts(5), lambda items: {"ids": items}), [0, 1], 2)
    with pytest.raises(TypeError, match="map-style"):
        Collated(iter([1, 2]), pad_texts)
    with pytest.raises(TypeError, match="callable"):
        Collated(CountingTexts(5), None)


def test_a_loader_with_a_collate_fn_points_to_collated():
    loader = DataLoader(CountingTexts(5), batch_size=2, collate_fn=pad_texts)
    with pytest.raises(TypeError, match=r"Collated\(loader.dataset, loader.collate_fn\)"):
        as_dataset(loader)


def test_private_gradients_on_collated_data_equal_those_on_padded_columns():
    from dpfunc.datasets import Collated

    texts = CountingTexts(40)
    embed = torch.nn.Embedding(8, 3)
    head = torch.nn.Linear(3, 2)
    model = torch.nn.Sequential(embed, head)

    def loss(params, example):  # the mean embedding of the non-zero ids: padding is ignored
        vectors = torch.func.functional_call(model[0], {"weight": params["0.weight"]},
                                             (example["ids"],))  # fmt: skip
        kept = (example["ids"] != 0).unsqueeze(-1)
        pooled = (vectors * kept).sum(0) / kept.sum().clamp(min=1)
        logits = pooled @ params["1.weight"].T + params["1.bias"]
        return torch.nn.functional.cross_entropy(logits[None], example["y"][None])

    padded = pad_texts([texts[i] for i in range(len(texts))])
    grads = []
    for data in (Collated(texts, pad_texts), (padded["ids"], padded["y"])):
        fn = (
            loss
            if isinstance(data, Collated)
            else (lambda params, example: loss(params, {"ids": example[0], "y": example[1]}))
        )
        private = dpfunc.PrivateGradients(model, fn, data, expected_batch_size=8, clip_norm=0.1,
                                          noise_multiplier=0.0, delta=1e-5, epochs=1,
                                          physical_batch_size=4, seed=5, method="vmap")  # fmt: skip
        (batch,) = private.batches(1)
        private.backward(batch)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        private.close()
        model.zero_grad(set_to_none=True)
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-6, atol=1e-8)
