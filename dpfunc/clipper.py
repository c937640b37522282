"""One micro-batch's clipped sum, by vmap or by ghost clipping: ``clip(params, batch, mask)``.

::

    per_sample_grads -> per_sample_norms -> clip_factors -> clipped_sum     (method="vmap")
    ghost pass: norms and the sum from each layer's inputs and output grads (method="ghost")

:func:`make_clipper` turns a one-example loss and the speed settings into a
:class:`Clipper`, the function a :class:`~dpfunc.TrainStep` calls for each
micro-batch. Every way to the sum gives the same sum up to float rounding,
which the clip margin covers: ``method="vmap"`` materialises each example's
gradient (in chunks of rows under a ``memory_budget``), ``"ghost"`` (with
``model=``) computes the norms and the sum from each covered layer's inputs
and output gradients (:mod:`dpfunc.ghost`), and ``"auto"`` ghosts the layers
where that is cheaper. The speed settings choose how fast the sum is
computed, never what it is.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from . import memory
from ._activation_checkpointing import (
    activation_checkpointing,
    inside_transforms_without_input_grads,
)
from ._checks import check_devices
from ._compiling import check_allow_rnn, recurrent_paths
from .clipping import (
    ClippingPolicy,
    accumulation_dtype,
    clipped_sum,
    per_sample_norms,
    rounding_scope,
)
from .config import DPConfig, SpeedConfig
from .ghost import GhostClipper, ghost_clip
from .per_sample import LossFn, batch_size, explain_example_error, per_sample_grads_and_losses
from .tree import Params, PyTree, tree_add, tree_leaves, tree_map
from .users import UserGroups

__all__ = ["Clipper", "ExampleStats", "make_clipper", "summarize"]


class ExampleStats(NamedTuple):
    """What the step saw of each example; for monitoring, NOT private."""

    loss: Tensor  # [B], each example's loss
    norm: Tensor  # [B] float64, gradient norm before clipping
    scaled: Tensor  # [B] bool, the gradient was scaled down (or dropped)
    mask: Tensor  # [B] bool, a real example (not padding)

    @staticmethod
    def cat(stats: list[ExampleStats]) -> ExampleStats:
        """Joins the stats of a logical batch's micro-batches."""
        return ExampleStats(*(torch.cat(parts) for parts in zip(*stats)))

    @staticmethod
    def empty(params: Params) -> ExampleStats:
        """The stats of no example (an empty logical batch)."""
        dtype = next(iter(params.values())).dtype
        loss = torch.zeros(0, dtype=dtype)
        flags = torch.zeros(0, dtype=torch.bool)
        return ExampleStats(loss, loss.to(torch.float64), flags, flags)


def summarize(stats: ExampleStats) -> dict[str, Tensor]:
    """Batch metrics from per-example stats (all 0-d tensors).

    ``loss``: mean loss over real examples; ``batch_size``: the number of real
    examples; ``clipped_fraction``: the fraction whose gradient was scaled
    down; ``nonfinite``: examples dropped for a NaN/inf gradient;
    ``norm_p10``, ``norm_p50``, ``norm_p90``, ``norm_max``: quantiles of the
    finite pre-clipping norms (NaN when there are none).

    Privacy: these read the data without noise; they are NOT differentially
    private. Log them for debugging; do not publish them as part of a private result.
    """
    real = stats.mask
    count = real.sum()
    denominator = count.clamp(min=1)
    finite = torch.isfinite(stats.norm)
    norms = torch.where(real & finite, stats.norm, torch.full_like(stats.norm, math.nan))
    quantiles = torch.nanquantile(norms, norms.new_tensor([0.1, 0.5, 0.9, 1.0]))
    return {
        "loss": torch.where(real, stats.loss, torch.zeros_like(stats.loss)).sum() / denominator,
        "batch_size": count,
        "clipped_fraction": (stats.scaled & real).sum() / denominator,
        "nonfinite": (~finite & real).sum(),
        "norm_p10": quantiles[0],
        "norm_p50": quantiles[1],
        "norm_p90": quantiles[2],
        "norm_max": quantiles[3],
    }


class Clipper:
    """One micro-batch's clipped sum as a function; built by :func:`make_clipper`."""

    def __init__(self, loss_fn: LossFn, config: DPConfig, speed: SpeedConfig):
        self.loss_fn = loss_fn
        self.model = speed.model
        self.clip_norm = float(config.clip_norm)
        self.clipping = config.clipping
        # user-level privacy: rows come in slots of k, one user each (dpfunc.users)
        self.user_rows = config.max_examples_per_user if config.privacy_unit == "user" else None
        self.method = speed.method
        self.chunk_size = speed.chunk_size
        self.memory_budget = speed.memory_budget
        self._warned_budget = False
        self._recurrent = recurrent_paths(speed.model)  # checked when Dynamo traces the step
        self.ghost = (
            GhostClipper(
                speed.model,
                loss_fn,
                speed.method,
                memory_budget=speed.memory_budget,
                vmap_sum=self._timed,
            )  # fmt: skip
            if speed.model is not None and speed.method != "vmap"
            else None
        )

    def __call__(
        self,
        params: Params,
        batch: PyTree,
        mask: Tensor | None,
        clip_norm: Tensor | None = None,
        *,
        skip_padding: bool = False,
    ) -> tuple[Params, ExampleStats]:
        """The clipped sum of one micro-batch and its per-example stats.

        ``clip_norm``: adaptive clipping's current norm
        (``state.clip_state.clip_norm``); ``None`` clips at the config's.
        The sum is in each parameter's accumulation dtype (float32 for bf16,
        fp16 and float32, float64 for float64). ``mask[B]`` marks real rows
        (``None``: all); every row is differentiated, padding too, unless
        ``skip_padding``, which eagerly leaves padding rows out of the forward
        and backward (the sum is the same; their stats are 0).

        User-level privacy (``DPConfig(privacy_unit="user")``): the rows are
        slots of ``max_examples_per_user`` rows, one user each
        (:mod:`dpfunc.users`); each user's update, the mean of its examples'
        gradients, is clipped once, and the stats are per user (``[B / k]``).
        ``skip_padding`` then leaves out the slots without a user; the
        padding rows of a user's slot stay (the slot's shape joins its forms).

        Rounding: the clip factors carry the margin of this micro-batch's
        physical rows, the gradients' dtype and size (public: shapes and
        dtypes), so every example's contribution has norm at most the clip norm.

        Eagerly, a failure of the per-example pass that is a misfit of the
        data and the model (a dtype, float labels, an index out of range) is
        raised with its fix (:func:`dpfunc.per_sample.explain_example_error`),
        chained to torch's error.
        """
        clip = self.clip_norm if clip_norm is None else clip_norm
        size = batch_size(batch)
        if mask is None:
            leaves = tree_leaves(batch)  # every row is real, on the batch's device
            mask = torch.ones(size, dtype=torch.bool, device=leaves[0].device if leaves else None)
        if tuple(mask.shape) != (size,):
            raise ValueError(
                f"mask must have shape ({size},) to match the batch, got {tuple(mask.shape)}"
            )
        mask = mask.to(torch.bool)
        check_allow_rnn(self._recurrent)  # a user's torch.compile without allow_rnn
        check_devices(params, batch)  # before the mask is read on the batch's device
        if torch.compiler.is_compiling():
            return self._rows(params, batch, mask, clip, size)
        try:
            with inside_transforms_without_input_grads(self.model):
                if skip_padding and size and not bool(mask.all()):
                    return self._real_rows(params, batch, mask, clip)
                return self._rows(params, batch, mask, clip, size)
        except Exception as error:  # a misfit of data and model: the error says the fix
            if activation_checkpointing(self.model) and not self._batched_ghost(params, batch):
                raise RuntimeError(
                    "the model checkpoints activations (gradient_checkpointing_enable()), "
                    "which torch.func's vmap cannot differentiate (its saved-tensor hooks); "
                    "only the batched ghost pass runs it: a loss marked with "
                    "dpfunc.batched_loss (PrivateTrainer's is), method='ghost' or 'auto', "
                    "model=model. Or disable checkpointing (gradient_checkpointing_disable())"
                ) from error
            raise explain_example_error(self.loss_fn, params, batch, mask, error)  # noqa: B904

    def _batched_ghost(self, params: Params, batch: PyTree) -> bool:
        """Whether this batch's plan is the batched ghost pass (eagerly; after the error)."""
        if self.ghost is None:
            return False
        try:
            return self.ghost.plan(params, batch).batched
        except Exception:
            return False

    def explain(self, params: Params, batch: PyTree) -> dict[str, str]:
        """How each trainable parameter is clipped: ``"ghost"`` or ``"vmap: <why>"``."""
        if self.ghost is None:
            why = (
                "vmap: method='vmap'"
                if self.method == "vmap"
                else "vmap: ghost clipping needs model=, the nn.Module that loss_fn calls"
            )
            return dict.fromkeys(params, why)
        return self.ghost.plan(params, batch).explain(params)

    def chunk_for(self, params: Params, rows: int) -> int | None:
        """The rows per chunk of the vmap path for a micro-batch of ``rows`` rows (``None``: all).

        An explicit ``chunk_size`` wins; it is warned about once if its
        per-example gradients exceed ``memory_budget``. Otherwise
        :func:`dpfunc.memory.chunk_for_budget`. Shapes only (public).
        """
        if self.chunk_size is None:
            return memory.chunk_for_budget(params, rows, self.memory_budget)
        if (
            not self._warned_budget
            and not torch.compiler.is_compiling()  # init() has warned already
            and not memory.fits(params, self.chunk_size, self.memory_budget)
        ):
            self._warned_budget = True
            need = memory.vmap_gradient_bytes(params, self.chunk_size)
            warnings.warn(
                f"chunk_size={self.chunk_size} holds about {need:,} bytes of per-example "
                f"gradients at once, over memory_budget={self.memory_budget:,}; the "
                "explicit chunk_size is kept (leave it out to let the budget choose)",
                UserWarning,
                stacklevel=5,
            )
        return self.chunk_size

    def _real_rows(
        self, params: Params, batch: PyTree, mask: Tensor, clip: float | Tensor
    ) -> tuple[Params, ExampleStats]:
        """Eagerly, a padded micro-batch's clipped sum from its real rows alone.

        Padding contributes exactly 0 either way; leaving its rows out saves
        their forward and backward (the Trainer pads a Poisson batch to its
        mean plus 3 std: a fifth to a third of the rows). The rounding margin
        still counts the physical rows (public), so no clip factor depends on
        how many examples are real. The time then follows the realised batch
        size, as in a loop that does not pad; a compiled step keeps the padded shape.
        """
        units = mask  # examples, or users' slots of k rows
        kept = mask.nonzero().squeeze(1)
        if self.user_rows is not None:
            units = mask.reshape(-1, self.user_rows).any(1)
            slots = units.nonzero().squeeze(1)
            kept = (slots[:, None] * self.user_rows + torch.arange(self.user_rows)).reshape(-1)

        def real(t: Any) -> Any:
            return t.index_select(0, kept.to(t.device)) if isinstance(t, Tensor) else t

        summed, stats = self._rows(params, tree_map(real, batch), mask[kept], clip, len(mask))
        kept = kept if self.user_rows is None else slots

        def full(t: Tensor, fill: float | bool) -> Tensor:
            return t.new_full(units.shape, fill).index_put_((kept,), t)

        loss, norm, scaled = full(stats.loss, 0.0), full(stats.norm, 0.0), full(stats.scaled, False)
        return summed, ExampleStats(loss, norm, scaled, units)

    def _rows(
        self, params: Params, batch: PyTree, mask: Tensor, clip: float | Tensor, rows: int
    ) -> tuple[Params, ExampleStats]:
        """The clipped sum of ``batch`` with the rounding margin of ``rows`` physical rows."""
        if len(mask) == 0:  # an empty share (e.g. one rank's): nothing to differentiate
            dtype = next(iter(params.values())).dtype
            empty = torch.zeros(0, dtype=dtype, device=mask.device)
            zeros = tree_map(
                lambda p: torch.zeros_like(p, dtype=accumulation_dtype(p.dtype)), params
            )
            return zeros, ExampleStats(empty, empty.to(torch.float64), mask, mask)
        policy = ClippingPolicy(self.clipping)  # the same policy on both paths
        users = None
        if self.user_rows is not None:
            users = UserGroups.of(mask, self.user_rows)
        if self.ghost is not None:
            plan = self.ghost.plan(params, batch, rows)  # rows: padded, public
            if plan.modules:
                summed, losses, clipped = ghost_clip(
                    self.loss_fn,
                    self.ghost.hooks,
                    plan,
                    params,
                    batch,
                    mask,
                    clipping=policy,
                    clip_norm=clip,
                    chunk_size=self.chunk_size,
                    rows=rows,
                    users=users,
                )
                units = mask if users is None else users.mask
                return summed, ExampleStats(losses.detach(), clipped.norm, clipped.scaled, units)
        return self._vmap_rows(params, batch, mask, clip, rows, policy, users)

    def _vmap_rows(
        self,
        params: Params,
        batch: PyTree,
        mask: Tensor,
        clip: float | Tensor,
        rows: int,
        policy: ClippingPolicy,
        users: UserGroups | None = None,
    ) -> tuple[Params, ExampleStats]:
        """The vmap path's clipped sum of ``batch``, in chunks if :meth:`chunk_for` says so.

        With ``users``, a chunk holds whole users (a multiple of their slot's rows).
        """
        size = len(mask)
        chunk = self.chunk_for(params, rows)  # of the physical rows: public
        if chunk is None or chunk >= size:
            return self._vmap_clip(params, batch, mask, clip, rows, policy, users)
        if users is not None:
            chunk = max(users.size, chunk - chunk % users.size)
        # chunk by chunk, so that one chunk's per-example gradients are held at a time. The
        # chunks' sums are added in the accumulation dtype: a blocked summation of the rows,
        # whose every contribution meets at most (chunk - 1) + (chunks - 1) <= rows - 1
        # additions, within the margin's gamma_(rows + 2) for ``rows`` rows
        summed, parts = None, []
        for start in range(0, size, chunk):
            rows_of = _row_slice(start, min(start + chunk, size))
            part_users = None
            if users is not None:
                slots = slice(start // users.size, (start + chunk) // users.size)
                part_users = users._replace(
                    rows=users.rows[start : start + chunk],
                    mask=users.mask[slots],
                    scale=users.scale[slots],
                )
            part, stats = self._vmap_clip(
                params, tree_map(rows_of, batch), mask[start : start + chunk], clip, rows, policy,
                part_users,
            )  # fmt: skip
            summed = part if summed is None else tree_add(summed, part)
            parts.append(stats)
        return summed, ExampleStats.cat(parts)

    def _vmap_clip(
        self,
        params: Params,
        batch: PyTree,
        mask: Tensor,
        clip: float | Tensor,
        rows: int,
        policy: ClippingPolicy,
        users: UserGroups | None = None,
    ) -> tuple[Params, ExampleStats]:
        """The clipped sum of ``batch``'s rows from materialised per-example gradients.

        With ``users``, each user's gradient is the sum of its slot's real
        rows (formed once; the norm and the sum read that same tensor) times
        ``1 / n`` in float64 (:class:`dpfunc.users.UserGroups`): the mean of
        its examples' gradients.
        """
        grads, losses = per_sample_grads_and_losses(self.loss_fn, params, batch)
        if users is not None:
            grads = tree_map(users.join, grads)
            losses, mask = users.mean(losses), users.mask
        groups = policy.groups(grads)
        norms = per_sample_norms(grads, groups)
        if users is not None:
            norms = users.scaled(norms)
        clipped = policy(norms, clip, mask, **rounding_scope(params, rows))
        weights = clipped.weights if users is None else users.scaled(clipped.weights)
        summed = clipped_sum(grads, weights, groups=groups)
        return summed, ExampleStats(losses.detach(), clipped.norm, clipped.scaled, mask)

    def _timed(self, params: Params, batch: PyTree, mask: Tensor) -> Params:
        """The vmap path's clipped sum as this clipper computes it (``method="auto"`` times it)."""
        policy = ClippingPolicy(self.clipping)
        return self._vmap_rows(params, batch, mask, self.clip_norm, len(mask), policy)[0]


def make_clipper(loss_fn: LossFn, config: DPConfig, speed: SpeedConfig | None = None) -> Clipper:
    """The clipped sum of one micro-batch as a function: ``clip(params, batch, mask)``.

    Args:
        loss_fn: ``loss_fn(params, example) -> scalar`` for ONE example.
        config: the privacy settings; the clipper reads ``clip_norm`` and ``clipping``.
        speed: how the sum is computed (:class:`~dpfunc.SpeedConfig`: ``model``
            for ghost clipping, ``method``, ``chunk_size``, ``memory_budget``);
            ``None``: the defaults (vmap without a model).

    Returns:
        A :class:`Clipper`; ``clip(params, batch, mask, clip_norm=None)``
        returns ``(summed, stats)``: the micro-batch's clipped sum (like
        ``params``, in each one's accumulation dtype) and its
        :class:`ExampleStats`.

    >>> import dpfunc, torch
    >>> config = dpfunc.DPConfig(clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)
    >>> clip = make_clipper(lambda p, x: (p["w"] * x).sum(), config)
    >>> summed, stats = clip({"w": torch.zeros(2)}, torch.tensor([[3.0, 4.0], [0.3, 0.4]]), None)
    >>> [round(v, 4) for v in summed["w"].tolist()], stats.norm.tolist()
    ([0.9, 1.2], [5.0, 0.5])
    """
    return Clipper(loss_fn, config, SpeedConfig() if speed is None else speed)


def _row_slice(start: int, stop: int) -> Callable[[Any], Any]:
    """Rows ``start:stop`` of a batch leaf (other leaves unchanged)."""
    return lambda t: t[start:stop] if isinstance(t, Tensor) else t
