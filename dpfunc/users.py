"""User-level privacy: the unit of the guarantee is a user, with all of that user's examples.

Example-level DP-SGD protects one example; a person who wrote 200 of them is
protected as 200 examples, far less than the printed epsilon says. With
``DPConfig(privacy_unit="user", max_examples_per_user=k)`` and the user of
each example given beside the dataset (``users=``), a step is user-level
sampling (ULS; Charles et al. 2024, "Fine-Tuning Large Language Models with
User-Level Differential Privacy"; Chua et al. 2024, "Mind the Privacy Unit!"):

1. each of the ``U`` users joins the step independently with probability
   ``q = expected_batch_size / U`` (``expected_batch_size`` counts users);
2. of each sampled user with ``n > k`` examples, ``k`` are drawn uniformly
   without replacement, afresh each step, from the run's secret stream
   (``(seed, step)``); a user with ``n <= k`` gives all of them;
3. the user's update is the MEAN of the gradients of those examples, clipped
   once to ``C``. The mean, not the sum: a user's clipped update is then on
   the scale of one example's gradient whatever their count, so the clip
   norm tuned at the example level carries over and a user with many
   examples is not clipped harder than one with a few (the sum's norm grows
   with the count, so ``C`` would have to grow with ``k``);
4. noise ``N(0, (sigma C)^2)`` is added once per logical step to the sum of
   the users' clipped updates, and the sum is divided by the expected
   number of users.

Each user's contribution to the sum has norm at most ``C`` whichever
examples were drawn, so the step is the sampled Gaussian mechanism over
users: the accountant counts users (``q`` above), and every report says
"per user". The user ids and the number of users are public (the sample
rate is computed from them).

Layout. A micro-batch holds whole users: ``users_per_micro_batch`` slots of
``k`` rows each, a user's examples in consecutive rows of its slot, the rest
of the slot padding (dataset row 0, masked out). The steps see ordinary
rows and a row mask; :class:`UserGroups` turns the row mask into each row's
weight ``1 / n`` (``n`` the user's rows in the step) and each slot's mask,
and the clipper sums each user's weighted per-example gradients (vmap), or
joins their ghost forms along the positions axis (ghost clipping: a user's
``k`` examples are then one sequence of ``k T`` positions), before the one
norm that both the clip factor and the sum use. Padding slots cost compute:
a step runs ``users_per_micro_batch * k`` rows for at most that many
examples, fewer when users have fewer than ``k``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from ._checks import check_int
from .clipping import accumulation_dtype
from .data import (
    MicroBatch,
    PoissonBatches,
    _share_size,
    gather_micro_batches,
    num_micro_batches,
    poisson_sampler,
    split_for_rank,
)
from .datasets import dataset_size
from .noise import check_seed, keyed_generator, secret_seed

__all__ = ["UserBatches", "UserIndex", "bound_contributions", "index_users"]


def read_user_column(who: str, dataset: Any, column: str) -> tuple[list, Any]:
    """``users="column"``: that column of a Hugging Face dataset, and the dataset without it.

    The ids are read without the dataset's format (a torch-format column
    would give tensors), and the column never reaches the loss.

    Raises:
        ValueError: the dataset has no such column (its columns are named).
    """
    names = getattr(dataset, "column_names", None)
    if names is None or column not in names or not hasattr(dataset, "remove_columns"):
        raise ValueError(
            f"{who}: users={column!r} names a column, but the dataset "
            + (f"has the columns {list(names)}" if names is not None else "has no named columns")
            + "; give the column that holds each example's user id, or the ids themselves "
            "(a sequence, one per example)"
        )
    plain = dataset.with_format(None) if hasattr(dataset, "with_format") else dataset
    return list(plain[column]), dataset.remove_columns(column)


class UserIndex(NamedTuple):
    """Which rows of the dataset each user holds (public: the user ids are public).

    User ``u`` (numbered in order of first appearance) holds the dataset
    rows ``rows[offsets[u]:offsets[u + 1]]``, in dataset order.
    """

    rows: Tensor  # [N] int64, the dataset's rows grouped by user
    offsets: Tensor  # [U + 1] int64

    @property
    def num_users(self) -> int:
        return self.offsets.numel() - 1

    @property
    def counts(self) -> Tensor:
        """``[U]`` int64: each user's number of examples."""
        return self.offsets[1:] - self.offsets[:-1]

    def __repr__(self) -> str:
        return f"UserIndex(num_users={self.num_users}, num_examples={self.rows.numel()})"


def index_users(users: Any, num_examples: int) -> UserIndex:
    """The :class:`UserIndex` of ``users``, the user id of each of ``num_examples`` rows.

    Args:
        users: one id per dataset row, in row order: a 1-D integer tensor or
            numpy array, or a sequence of ints or of strings (0-d tensors and
            numpy scalars are read as their values). Ids are public: they
            name who holds which rows, and the count of users is printed.
        num_examples: the dataset's rows.

    Raises:
        ValueError: ``users`` is not 1-D, its length is not ``num_examples``,
            an id is missing (``None``, ``pd.NA``), a float (a NaN id would
            make a user per row), a bool or anything but an int or a string,
            or ints and strings are mixed (``1`` and ``"1"`` would be two users).

    >>> index = index_users(["ann", "bob", "ann"], 3)
    >>> index.rows.tolist(), index.counts.tolist()
    ([0, 2, 1], [2, 1])
    """
    check_int("num_examples", num_examples, minimum=1)
    codes = _codes(users)
    if codes.numel() != num_examples:
        raise ValueError(
            f"users must give one user id per example: the dataset has {num_examples} rows, "
            f"got {codes.numel()} ids"
        )
    order = torch.sort(codes, stable=True).indices
    counts = torch.bincount(codes)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    return UserIndex(order.to(torch.int64), offsets)


def _codes(users: Any) -> Tensor:
    """Each row's user as an int64 code, ``0..U-1`` in order of first appearance."""
    if isinstance(users, Tensor | np.ndarray):
        array = users.detach().cpu().numpy() if isinstance(users, Tensor) else users
        if array.ndim != 1:
            raise ValueError(f"users must be 1-D (one id per example), got shape {array.shape}")
        if array.dtype.kind in "iu":
            _, first, inverse = np.unique(array, return_index=True, return_inverse=True)
            rank = np.empty_like(first)
            rank[np.argsort(first, kind="stable")] = np.arange(first.size)
            return torch.from_numpy(rank[inverse].astype(np.int64))
        if array.dtype.kind in "fcb":
            raise ValueError(
                f"users must hold integer or string ids, got an array of dtype {array.dtype} "
                "(a float id can be NaN, and NaN is never equal to itself)"
            )
        users = array.tolist()
    if isinstance(users, str | bytes | dict) or not hasattr(users, "__iter__"):
        raise ValueError(
            f"users must be a 1-D sequence of user ids, one per example, got users={users!r:.80}"
        )
    seen: dict[Any, int] = {}
    codes, kinds = [], set()
    for position, user in enumerate(users):
        user = _id(user, position)
        kinds.add(type(user))
        if len(kinds) > 1:
            raise ValueError(
                f"users mixes ints and strings (users[{position}] is {user!r}): 1 and '1' would "
                "be two users; give every id in one kind"
            )
        codes.append(seen.setdefault(user, len(seen)))
    return torch.tensor(codes, dtype=torch.int64)


def _id(user: Any, position: int) -> int | str:
    """One id as a Python int or str; anything that could split or merge people is refused.

    A 0-d tensor or a numpy scalar (what iterating a tensor, or a Hugging Face
    column in torch format, gives) is read as its value: hashed as an object,
    no two rows would ever share a user.
    """
    if isinstance(user, Tensor | np.ndarray) and user.ndim == 0 or isinstance(user, np.generic):
        user = user.item()
    if isinstance(user, int | str) and not isinstance(user, bool):
        return int(user) if isinstance(user, int) else str(user)
    why = (
        "a missing id: every example needs its user's (an example without a user cannot be "
        "protected as part of one)"
        if user is None or type(user).__name__ in ("NAType", "NaTType")
        else "a float id can be NaN, and NaN is never equal to itself"
        if isinstance(user, float)
        else "ids are ints or strings"
    )
    raise ValueError(f"users[{position}] is {user!r:.80}: {why}")


def sample_user_rows(
    index: UserIndex, sampled: Tensor, max_examples_per_user: int, *, seed: int, step: int
) -> tuple[Tensor, Tensor]:
    """Each sampled user's rows of step ``step``, laid out as slots of ``k`` rows.

    Of a user with ``n > k`` examples, ``k`` are drawn uniformly without
    replacement from a generator keyed by ``(seed, step)`` (a stream of its
    own, independent of the Poisson draw); a user with ``n <= k`` gives all
    of them. The draw reads the secret and the sampled users' counts, never
    what the examples hold, so it does not change what one user can
    contribute. :class:`UserBatches` draws it for the whole logical batch
    before splitting it over ranks, so a user gets the same rows on any
    number of ranks.

    Returns:
        ``(rows, mask)``: int64 ``[len(sampled) * k]`` dataset rows and bool
        ``[len(sampled) * k]``, ``True`` for real rows; user ``sampled[j]``
        fills slot ``j``, rows ``j*k .. j*k+k-1``, its real rows first, then
        copies of its first row as padding (data on which the user's loss
        is finite exactly when it is on the user's own rows).
    """
    k = max_examples_per_user
    counts = index.counts[sampled]
    total = int(counts.sum())
    slot = torch.repeat_interleave(torch.arange(sampled.numel()), counts)
    start = index.offsets[sampled]
    within = torch.arange(total) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    rows = index.rows[torch.repeat_interleave(start, counts) + within]
    if bool((counts > k).any()):  # a uniform k-subset: the k smallest of i.i.d. keys per user
        generator = keyed_generator("dpfunc.user_rows", seed, step, torch.device("cpu"))
        keys = torch.rand(total, generator=generator, dtype=torch.float64)
        by_key = torch.argsort(keys)
        order = by_key[torch.sort(slot[by_key], stable=True).indices]  # by slot, then key
        rows = rows[order]
    keep = within < k
    mask = torch.zeros(sampled.numel() * k, dtype=torch.bool)
    position = slot[keep] * k + within[keep]
    first = torch.zeros(sampled.numel(), dtype=torch.int64)
    first[slot[within == 0]] = rows[within == 0]
    out = first.repeat_interleave(k)  # a slot's padding rows: copies of the user's first row
    out[position] = rows[keep]
    mask[position] = True
    return out, mask


def bound_contributions(
    users: Any, max_examples_per_user: int, *, seed: int | None = None
) -> Tensor:
    """The rows to keep so that no user holds more than ``k``: for example-level sampling (ELS).

    Example-level training protects a user with ``n`` examples as ``n``
    examples; with at most ``k`` of each user's examples in the dataset,
    :func:`dpfunc.accounting.example_sampling_user_epsilon` gives the
    run's epsilon per user. The ``k`` rows of a larger user are drawn
    uniformly, once, from a generator keyed by ``seed`` (``None``: a fresh
    secret); the others are left out of training.

    Args:
        users: each row's user id, as for :func:`index_users`.
        max_examples_per_user: ``k``, an int >= 1.
        seed: the draw's key; ``None`` draws a secret.

    Returns:
        The sorted int64 indices of the rows kept.

    >>> bound_contributions(["a", "a", "b", "a"], 2, seed=0).numel()  # a public seed: an example
    3
    """
    k = check_int("max_examples_per_user", max_examples_per_user, minimum=1)
    codes = _codes(users)
    index = index_users(codes, codes.numel())
    if seed is None:
        seed = secret_seed()
    check_seed(seed)
    rows, mask = sample_user_rows(index, torch.arange(index.num_users), k, seed=seed, step=0)
    return torch.sort(rows[mask]).values


class UserGroups(NamedTuple):
    """The users of a micro-batch of ``U`` slots of ``k`` rows, as the clipper needs them.

    A user's update is the mean of its real rows' gradients, ``scale *
    sum``: the clipper sums each slot's real rows (:meth:`join`; padding
    rows become exact zeros), takes the norm of the sum times ``scale``,
    and weighs the sum by the clip factor times ``scale``. ``scale`` is
    ``1 / n`` in float64 (``n`` the user's real rows), so the norm and the
    weight carry no rounding of float32's.
    """

    size: int  # k, the rows of a slot
    rows: Tensor  # [U * k] bool, the real rows
    mask: Tensor  # [U] bool, a slot that holds a user
    scale: Tensor  # [U] float64, 1 / n (0 for an empty slot)

    @staticmethod
    def of(row_mask: Tensor, size: int) -> UserGroups:
        """The groups of a row mask ``[U * k]`` (bool or 0/1) in slots of ``size`` rows.

        Raises:
            ValueError: the mask's length is not a multiple of ``size``.
        """
        if row_mask.dim() != 1 or row_mask.numel() % size:
            raise ValueError(
                f"a user-level micro-batch holds whole slots of max_examples_per_user={size} "
                f"rows, got a mask of shape {tuple(row_mask.shape)}"
            )
        rows = row_mask.to(torch.bool)
        counts = rows.reshape(-1, size).sum(1)
        scale = 1.0 / counts.clamp(min=1).to(torch.float64)
        return UserGroups(size, rows, counts > 0, torch.where(counts > 0, scale, 0.0))

    def join(self, per_row: Tensor) -> Tensor:
        """``[U * k, ...]`` per-row values to ``[U, ...]``: the sum of each slot's real rows.

        ``k = 1`` returns ``per_row`` itself (its padding rows are masked
        users). A padding row of a user's slot is a copy of that user's row
        (:func:`sample_user_rows`), so a NaN there is that user's own.
        """
        if self.size == 1:
            return per_row
        per_row = per_row.to(accumulation_dtype(per_row.dtype))  # half: summed in float32
        slots = per_row.reshape(-1, self.size, per_row[0].numel())
        ones = self.rows.to(per_row.dtype).reshape(-1, 1, self.size)
        return torch.bmm(ones, slots).reshape(-1, *per_row.shape[1:])

    def scaled(self, values: Tensor | dict[str, Tensor]) -> Tensor | dict[str, Tensor]:
        """``[U]`` values (norms, clip weights; or a dict of them) times ``scale``, in float64."""
        if isinstance(values, dict):
            return {key: v * self.scale.to(v.device) for key, v in values.items()}
        return values * self.scale.to(values.device)

    def mean(self, per_row: Tensor) -> Tensor:
        """``[U * k]`` per-row values (losses) to each user's mean ``[U]``; padding ignored."""
        value = torch.where(self.rows, per_row, per_row.new_zeros(()))
        return value.reshape(-1, self.size).sum(1) * self.scale.to(per_row.dtype)


class UserBatches(PoissonBatches):
    """User-level sampled logical batches as fixed-shape micro-batches of whole users.

    Step ``t``: the users of :func:`dpfunc.data.poisson_sample` over ``U``
    users at ``sample_rate`` (keyed by ``(seed, t)``; ``indices(t)`` are
    the users, ``self.sampler`` samples users), each with at most
    ``k`` of their rows (:func:`sample_user_rows`). Each rank takes every
    ``world_size``-th sampled user; all ranks run the same number of
    micro-batches. Everything else is :class:`dpfunc.data.PoissonBatches`'
    (the secret, ``rekey``, ``steps``).

    Args:
        dataset: any form :func:`dpfunc.datasets.as_dataset` accepts.
        users: the :class:`UserIndex` of the dataset's rows.
        sample_rate: each user's inclusion probability, in ``(0, 1]``.
        physical_batch_size: rows per micro-batch, a multiple of ``k``.
        max_examples_per_user: ``k``, an int >= 1.
        seed, rank, world_size: as for :class:`dpfunc.data.PoissonBatches`.
    """

    def __init__(
        self,
        dataset: Any,
        users: UserIndex,
        sample_rate: float,
        physical_batch_size: int,
        max_examples_per_user: int,
        *,
        seed: int | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        k = check_int("max_examples_per_user", max_examples_per_user, minimum=1)
        check_int("physical_batch_size", physical_batch_size, minimum=1)
        if physical_batch_size % k:
            raise ValueError(
                f"physical_batch_size={physical_batch_size!r} must be a multiple of "
                f"max_examples_per_user={k} (a micro-batch holds whole users, k rows each)"
            )
        super().__init__(
            dataset, sample_rate, physical_batch_size, seed=seed, rank=rank, world_size=world_size
        )
        if users.rows.numel() != dataset_size(self.dataset):
            raise ValueError(
                f"users index {users.rows.numel()} rows, the dataset has "
                f"{dataset_size(self.dataset)}"
            )
        self.users = users
        self.max_examples_per_user = k
        self.users_per_micro_batch = physical_batch_size // k
        # the Poisson sampler over the users, keyed by the same secret
        self.sampler = poisson_sampler(users.num_users, sample_rate)
        self.sampler_state = self.sampler.init(self.sampler_state.seed)

    @property
    def expected_batch_size(self) -> float:
        """``sample_rate * num_users``: the expected users of a step, the average's denominator."""
        return self.sample_rate * self.users.num_users

    def _agreed_count(self, logical_size: int) -> int:
        return max(
            num_micro_batches(_share_size(logical_size, r, self.world_size),
                              self.users_per_micro_batch)
            for r in range(self.world_size)
        )  # fmt: skip

    def logical_batch(self, step: int) -> tuple[list[MicroBatch], int]:
        """This rank's micro-batches of step ``step`` and its number of users in them."""
        sampled = self.indices(step)
        k = self.max_examples_per_user
        # every user's rows drawn for the whole logical batch, then this rank's users taken:
        # each user gets the same rows on any number of ranks
        rows, mask = sample_user_rows(self.users, sampled, k, seed=self.sampler_state.seed,
                                      step=step)  # fmt: skip
        share = split_for_rank(torch.arange(sampled.numel()), self.rank, self.world_size)
        ours = (share[:, None] * k + torch.arange(k)).reshape(-1)
        rows, mask = rows[ours], mask[ours]
        padded = self._agreed_count(sampled.numel()) * self.physical_batch_size
        rows = torch.cat([rows, torch.zeros(padded - rows.numel(), dtype=torch.int64)])
        mask = torch.cat([mask, torch.zeros(padded - mask.numel(), dtype=torch.bool)])
        batches = gather_micro_batches(
            self.dataset, rows, mask, self.physical_batch_size, torch.float32
        )
        return batches, share.numel()

    def __repr__(self) -> str:
        return (  # the seed is a secret: never in a repr or a log
            f"UserBatches(num_users={self.users.num_users}, num_examples={self.num_examples}, "
            f"sample_rate={self.sample_rate}, physical_batch_size={self.physical_batch_size}, "
            f"max_examples_per_user={self.max_examples_per_user}, seed=<secret>, "
            f"rank={self.rank}, world_size={self.world_size})"
        )
