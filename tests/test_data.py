"""Tests for dpfunc.data: Poisson sampling and fixed-shape padded micro-batches."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import TensorDataset

from dpfunc.data import (
    PoissonBatches,
    dataset_fingerprint,
    dataset_size,
    micro_batches,
    num_micro_batches,
    poisson_sample,
    split_for_rank,
)

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
    np = pytest.importorskip("numpy")
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


def test_a_list_of_tensors_is_refused_as_ambiguous():
    x, y = rows_dataset(6)
    for dataset in ([x, y], list(x)):  # columns, or one tensor per example?
        with pytest.raises(TypeError, match="list of .* tensors, which is ambiguous"):
            dataset_size(dataset)


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
