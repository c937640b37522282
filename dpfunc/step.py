"""One DP-SGD step, composed from the pure pieces.

::

    per_sample_grads -> per_sample_norms -> clip_factors -> clipped_sum
        -> add_noise -> average -> optimizer.update

A logical (Poisson) batch may arrive as several fixed-shape micro-batches:
``accumulate`` adds each micro-batch's clipped sum, and ``apply`` adds the
noise exactly once and updates the parameters. ``step(state, batch, mask,
noise)`` does both for a logical batch that fits one micro-batch. All three
are pure and compile with ``torch.compile(fullgraph=True)``.

The mechanisms with state come from the config as ``(init, update)`` pairs:
the noise (:meth:`DPConfig.noise_mechanism`: independent, or banded
correlated) and the clip norm (:meth:`DPConfig.clip_mechanism`: fixed, or
adaptive). Their states live in the :class:`TrainState` beside the
parameters, the optimizer state and the step count, so a step is one pure
function of the state and a checkpoint of it resumes the run.

Two ways to the clipped sum (``method``): ``"vmap"`` materialises every
example's gradient; ``"ghost"`` (with ``model=``) gets the per-example norms and
the clipped sum from each covered layer's inputs and output gradients without
materialising per-example gradients (see :mod:`dpfunc.ghost`), falling back to
vmap for the parameters it cannot handle; ``"auto"`` (the default) ghosts only
the layers where that is cheaper. All give the same sum.

Precision. A micro-batch's clipped sum is computed in the accumulation dtype
(float32 for bf16, fp16 and float32 parameters, float64 for float64; see
:func:`dpfunc.clipping.accumulation_dtype`), with clip factors whose rounding
margin (:func:`dpfunc.clipping.clip_margin`) covers the norm's rounding and
that sum's. The running sum of a logical batch in :meth:`TrainStep.logical_step`,
across micro-batches and ranks (:mod:`dpfunc.distributed`), is in that dtype
too, float32 for float32 and half parameters: the margin covers
``FLOAT32_SUMS`` (128) float32 additions of micro-batch sums and ranks' sums
together, a relative 7.6e-6 more (2.7e-5 in all for 256 rows). Only past that
public bound (more than ``128 - world_size`` micro-batches on a rank), for
float64 parameters, and for a :meth:`TrainStep.zeros` given no bound (a
caller's own loop of :meth:`TrainStep.accumulate`, and ``step(...)``) is it
float64, whose additions the margin covers too (``ACCUMULATED_SUMS``). Every
example's contribution to the sum the noise is added to has norm at most
``clip_norm``, rounding included. ``apply`` adds the noise, averages and
rounds to the parameters' accumulation dtype in one pass per leaf: in float32
for a float32 sum and noise, in float64 for a float64 sum or the float64
secure noise, rounded once after the average; either way a post-processing
of the noisy sum (float32 for half-precision parameters, whose optimizer
state and update are float32).
"""

from __future__ import annotations

import math
import os
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from . import memory, optim
from .checks import check_choice, check_devices, check_int
from .clipping import (
    FLOAT32_SUMS,
    ClippingPolicy,
    ClipState,
    accumulation_dtype,
    clipped_sum,
    per_sample_norms,
    rounding_scope,
    unclipped_count,
)
from .compiling import check_allow_rnn, compile_fullgraph, recurrent_paths
from .config import CLIPPING_MODES, DPConfig, config_from  # noqa: F401 (CLIPPING_MODES: kept importable here)
from .ghost import GhostClipper, ghost_clip
from .memory import check_memory_budget
from .noise import NoiseState, noisy_average, standard_normal_like
from .per_sample import LossFn, batch_size, explain_example_error, per_sample_grads_and_losses
from .tree import Params, PyTree, check_same_structure, tree_add, tree_leaves, tree_map

SUM_DTYPE = torch.float64  # a running clipped sum with no public bound on its micro-batches
METHODS = ("auto", "vmap", "ghost")


class TrainState(NamedTuple):
    """Everything a step reads and replaces: the parameters and each mechanism's state.

    ``clip_norm`` and ``noise_history`` read the mechanisms' states (the
    names of earlier releases). A state derived from another keeps the
    mechanisms' states with ``state._replace(params=..., opt_state=...,
    step=...)``.
    """

    params: Params  # the model's trainable parameters
    opt_state: Any  # the optimizer's state
    step: Tensor  # shape (), int64: private steps taken so far
    clip_state: ClipState  # config.clip_mechanism()'s: the clip norm of the next step
    # config.noise_mechanism()'s: the banded history (correlated noise), empty for DP-SGD
    noise_state: NoiseState = NoiseState()

    @property
    def clip_norm(self) -> Tensor:
        """Shape (), float64: the clip norm of the next step (adaptive clipping moves it)."""
        return self.clip_state.clip_norm

    @property
    def noise_history(self) -> Params:
        """Each leaf ``[b - 1, *param.shape]``, the last correlated draws; ``{}`` for DP-SGD."""
        return self.noise_state.history


def check_state(state: Any) -> None:
    """Raises ``TypeError`` unless ``state`` holds each mechanism's state, as ``init`` builds it.

    A state built in the form of earlier releases, ``TrainState(params,
    opt_state, step, clip_norm)``, holds a tensor where the clip state goes.
    """
    if not isinstance(state, TrainState):
        raise TypeError(
            f"state must be a dpfunc.TrainState (from step.init), got a {type(state).__name__}"
        )
    for name, kind in (("clip_state", ClipState), ("noise_state", NoiseState)):
        part = getattr(state, name)
        if not isinstance(part, kind):
            raise TypeError(
                f"state.{name} must be a {kind.__name__}, got a {type(part).__name__}: a "
                "TrainState holds params, opt_state, step, clip_state and noise_state; build "
                "one from another with state._replace(params=..., opt_state=..., step=...), "
                "which keeps the mechanisms' states"
            )


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


def summarize(stats: ExampleStats) -> dict[str, Tensor]:
    """Batch metrics from per-example stats (all 0-d tensors).

    ``loss``: mean loss over real examples; ``batch_size``: the number of real
    examples; ``clipped_fraction``: the fraction whose gradient was scaled
    down; ``nonfinite``: examples dropped for a NaN/inf gradient;
    ``norm_p10``, ``norm_p50``, ``norm_p90``, ``norm_max``: quantiles of the
    finite pre-clipping norms (NaN when there are none).

    These read the data without noise: they are NOT differentially private.
    Log them for debugging; do not publish them as part of a private result.
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


NONFINITE = ("warn", "error")


def check_nonfinite(metrics: dict[str, float], step: int, mode: str, *, warn: bool) -> bool:
    """Makes examples with a NaN/inf gradient norm visible, before anything is released.

    They are left out of the clipped sum either way (what clipping to norm 0
    gives, which keeps the guarantee). ``mode="error"`` raises at the first;
    ``"warn"`` warns (if ``warn``) and raises only when every example of the
    step is non-finite (the update would be noise alone). ``metrics``:
    :func:`summarize` as floats. Returns whether it warned.

    Raises:
        FloatingPointError: as above.
    """
    bad, real = int(metrics["nonfinite"]), int(metrics["batch_size"])
    if not bad:
        return False
    what = (
        f"step {step + 1}: {bad} of its {real} examples have a non-finite (NaN or inf) "
        "gradient norm; they are left out of the sum (which keeps the privacy guarantee). "
        "Likely causes: NaN or inf in the data, a loss that overflows (log of 0, a "
        "learning rate too large for the model), or reduced precision out of range"
    )
    if mode == "error":
        raise FloatingPointError(what + " (nonfinite='error').")
    if bad == real:
        raise FloatingPointError(
            what + ": every example of the step; training on would move the parameters by "
            "the noise alone."
        )
    if warn:
        warnings.warn(
            what + ". Later steps count them in the history's 'nonfinite'; this warning is "
            "shown once; nonfinite='error' raises instead.",
            RuntimeWarning,
            stacklevel=6,
        )
    return warn


class Collectives(NamedTuple):
    """How the ranks of a data-parallel step combine their shares; the identity on one process.

    Injected into :class:`TrainStep` (``dpfunc.distributed.make_train_step``
    injects ``torch.distributed``'s), so one logical step serves one process
    and many.
    """

    # reduce(summed, step) -> the clipped sum over all ranks (in its dtype, bit-identical on each)
    reduce: Callable[[Params, Any], Params]
    # gather(stats, step) -> every rank's per-example stats, in rank order
    gather: Callable[[ExampleStats, Any], ExampleStats]
    # start(params) -> the initial parameters every rank starts from (rank 0's), settings checked;
    # sharded: this rank's rows of them
    start: Callable[[Params], Params]
    distributed: bool = False
    # unshard(params, step) -> the whole parameters (sharded: every rank's rows gathered)
    unshard: Callable[[Params, Any], Params] = lambda params, *_: params
    # noise_rows(params) -> standard_normal_like's rows= for this rank's parameters (None: whole)
    noise_rows: Callable[[Params], Any] = lambda params: None
    sharded: bool = False
    # layout() -> the dpfunc.sharding.Sharding of the parameters (sharded steps only)
    layout: Callable[[], Any] = lambda: None


def _identity(value: Any, *_: Any) -> Any:
    return value


LOCAL = Collectives(reduce=_identity, gather=_identity, start=_identity)


class TrainStep:
    """A DP-SGD step; build it with :func:`make_train_step`.

    ``config`` (a :class:`~dpfunc.DPConfig` with its noise multiplier
    resolved) holds the privacy settings; ``model``, ``method``,
    ``chunk_size`` and ``memory_budget`` only change how fast (and in how
    much memory) the same sum is computed.
    ``collectives`` (:class:`Collectives`) combine the ranks' shares of a
    logical batch: :data:`LOCAL` on one process.
    """

    def __init__(
        self,
        loss_fn: LossFn,
        optimizer: optim.GradientTransformation,
        config: DPConfig | None = None,
        *,
        model: nn.Module | None = None,
        method: str = "auto",
        chunk_size: int | None = None,
        collectives: Collectives = LOCAL,
        memory_budget: int | None = None,
        **settings: Any,
    ):
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if not (
            callable(getattr(optimizer, "init", None))
            and callable(getattr(optimizer, "update", None))
        ):
            raise TypeError(
                "optimizer must be an (init, update) pair such as dpfunc.optim.sgd(lr=0.1), "
                f"got {type(optimizer).__name__}"
            )
        config = config_from("TrainStep", config, settings)  # or its keyword form
        self.noise_std = config.noise_std  # fails for a config not yet calibrated
        if chunk_size is not None:
            check_int("chunk_size", chunk_size, minimum=1)
        memory_budget = check_memory_budget(memory_budget)
        check_choice("method", method, METHODS)
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
        if method == "ghost" and model is None:
            raise ValueError(
                "method='ghost' needs model=, the nn.Module that loss_fn calls through "
                "torch.func.functional_call; got model=None"
            )
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.config = config
        self.chunk_size = chunk_size
        self.memory_budget = memory_budget
        self._warned_budget = False
        self.method = method
        self.collectives = collectives
        # read by the pieces below; all come from the frozen config
        self.clip_norm = float(config.clip_norm)
        self.noise_multiplier = float(config.noise_multiplier)
        self.expected_batch_size = config.expected_batch_size
        self.clipping = config.clipping
        # the mechanisms with state, built once from the config: their states live in the
        # TrainState, and the settings they hold are read-only properties below
        self.noise_mechanism = config.noise_mechanism()
        self.clip_mechanism = config.clip_mechanism()
        use_ghost = model is not None and method != "vmap"
        self._ghost = (
            GhostClipper(
                model, loss_fn, method, memory_budget=memory_budget, vmap_sum=self._timed_vmap
            )
            if use_ghost
            else None
        )
        self._accumulate, self._apply_reduced = self.accumulate, self.apply_reduced
        self._private_gradient = self.private_gradient
        self._recurrent = recurrent_paths(model)  # checked when Dynamo traces the step
        # sharded: the last trees draw_noise gave: (step, their leaves by id); see _check_drawn
        self._drawn: deque[tuple[int, dict[int, weakref.ref]]] = deque(maxlen=4)
        self._drawn_lock = threading.Lock()  # NoiseAhead draws on a worker thread
        self._noise_checked = False  # set while an eager caller runs a checked piece

    # the settings the mechanisms were built with: read-only, since changing one here
    # would not change the mechanism (build another step from another config)
    target_quantile = property(lambda self: self.config.target_quantile)
    quantile_learning_rate = property(lambda self: float(self.config.quantile_learning_rate))
    count_noise_multiplier = property(lambda self: self.config.count_noise_multiplier)
    bands = property(lambda self: self.config.bands)
    # the strategy C with unit column norm: noise_multiplier is the accountant's
    coefficients = property(lambda self: self.config.coefficients)

    @property
    def distributed(self) -> bool:
        """The step's collectives span a process group (``dpfunc.distributed``)."""
        return self.collectives.distributed

    @property
    def sharded(self) -> bool:
        """Each rank holds its rows of the parameters and states (:mod:`dpfunc.sharding`)."""
        return self.collectives.sharded

    def init(self, params: Params) -> TrainState:
        """The state before the first step; ``params`` are not copied or changed.

        Distributed: collective, every rank starts from rank 0's parameters
        (copies) after the ranks' settings are checked to agree.
        """
        params = self.collectives.start(params)
        self.chunk_for(params, 1)  # warns of a chunk_size over memory_budget before any step
        step = torch.zeros((), dtype=torch.int64)
        return TrainState(
            params,
            self.optimizer.init(params),
            step,
            self.clip_mechanism.init(),
            self.noise_mechanism.init(params),
        )

    def compile(self) -> TrainStep:
        """Compiles the local pieces; returns ``self``.

        :meth:`logical_step`, :meth:`logical_gradient` and :meth:`apply` then
        run ``accumulate``, ``apply_reduced`` and ``private_gradient``
        through ``torch.compile(fullgraph=True)``, with Dynamo's RNN support
        on and logging calls in traced code left out, in a scope that ends
        with each call (:func:`dpfunc.compiling.compile_fullgraph`); the
        collectives between them run eagerly. The results are the same as
        eager ones.
        """
        self._accumulate = compile_fullgraph(self.accumulate)
        self._apply_reduced = compile_fullgraph(self.apply_reduced)
        self._private_gradient = compile_fullgraph(self.private_gradient)
        return self

    def explain(self, params: Params, batch: PyTree) -> dict[str, str]:
        """How each trainable parameter is clipped for batches shaped like ``batch``.

        Returns ``{name: "ghost"}`` for a parameter whose per-example norm and
        clipped sum come from ghost clipping, or ``{name: "vmap: <why>"}`` for
        one whose per-example gradient is materialised by vmap, with the
        reason (no rule for its layer, a use the planner cannot follow, a cost
        choice of ``method="auto"``: its cost model's or its timings'). Eagerly
        with ``method="auto"`` this is the plan after the choice between ghost
        and vmap, which runs (and may time both) here if the step has not yet
        seen this batch shape; a compiled step plans by the rules' cost models
        alone, so its plan can differ. Sharded, pass the whole parameters
        (:meth:`full_params`).

        >>> import dpfunc, torch
        >>> from torch.func import functional_call
        >>> model = torch.nn.Linear(3, 1)
        >>> params, buffers = dpfunc.functionalize(model)
        >>> def loss_fn(p, x):
        ...     return functional_call(model, (p, buffers), (x[None],)).sum()
        >>> step = dpfunc.make_train_step(loss_fn, dpfunc.optim.sgd(lr=0.1), clip_norm=1.0,
        ...     noise_multiplier=1.0, expected_batch_size=8, model=model, method="ghost")
        >>> step.explain(params, torch.randn(8, 3))
        {'weight': 'ghost', 'bias': 'ghost'}
        """
        if self.sharded:  # the plan is of the whole parameters, as the pass sees them
            self.collectives.layout().check(params, whole=True)
        if self._ghost is None:
            why = (
                "vmap: method='vmap'"
                if self.method == "vmap"
                else "vmap: ghost clipping needs model=, the nn.Module that loss_fn calls"
            )
            return dict.fromkeys(params, why)
        return self._ghost.plan(params, batch).explain(params)

    @property
    def adaptive(self) -> bool:
        """Adaptive clipping is on: the clip norm moves, in ``TrainState.clip_state``."""
        return self.target_quantile is not None

    def zeros(self, params: Params, *, micro_batches: int | None = None) -> Params:
        """An empty clipped sum, to start accumulating a logical batch.

        ``micro_batches``: a public bound on the micro-batch sums this rank
        will add (shapes and settings, never the realised batch). Without it
        the zeros are float64 whatever the parameters' dtype: a caller's own
        loop of :meth:`accumulate` may add up to ``ACCUMULATED_SUMS``
        micro-batch sums, each addition rounding a contribution by at most
        ``2**-53``. With it, each parameter's zeros are in its accumulation
        dtype (float32 for float32, bf16 and fp16; float64 for float64)
        when ``micro_batches`` plus the ranks is at most
        ``dpfunc.clipping.FLOAT32_SUMS`` (128), else float64. The clip margin
        covers either (see the module docstring).

        >>> import dpfunc, torch
        >>> step = dpfunc.make_train_step(lambda p, x: (p["w"] * x).sum(), dpfunc.optim.sgd(lr=0.1),
        ...     clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=8)
        >>> p = {"w": torch.zeros(3)}
        >>> step.zeros(p)["w"].dtype, step.zeros(p, micro_batches=4)["w"].dtype
        (torch.float64, torch.float32)
        """
        if micro_batches is not None:
            check_int("micro_batches", micro_batches, minimum=0)
        wide = micro_batches is None or micro_batches > self._float32_micro_batches()

        def zeros(p: Tensor) -> Tensor:
            return torch.zeros_like(p, dtype=SUM_DTYPE if wide else accumulation_dtype(p.dtype))

        return tree_map(zeros, params)

    def _float32_micro_batches(self) -> int:
        """The micro-batch sums a float32 running sum may add on this rank: FLOAT32_SUMS less
        the ranks, whose all-reduce adds theirs in the same dtype (public: the world size)."""
        distributed = self.collectives.distributed and torch.distributed.is_initialized()
        return FLOAT32_SUMS - (torch.distributed.get_world_size() if distributed else 1)

    def clip(
        self, params: Params, batch: PyTree, mask: Tensor | None, clip_norm: Tensor | None = None
    ) -> tuple[Params, ExampleStats]:
        """The clipped sum of one micro-batch and its per-example stats.

        ``clip_norm``: adaptive clipping's current norm (``state.clip_state.clip_norm``);
        ``None`` clips at the fixed ``clip_norm`` the step was built with.
        The sum is in the accumulation dtype of each parameter (float32 for
        bf16, fp16 and float32, float64 for float64); the clip factors carry
        the rounding margin for this micro-batch's rows, the gradients'
        dtype and size (public: shapes and dtypes). Every row is
        differentiated, padding too (:meth:`accumulate` leaves padding out).

        Eagerly, a failure of the per-example pass is raised with its fix where
        it is a misfit of the data and the model (a dtype, float labels, an
        index out of range; :func:`dpfunc.per_sample.explain_example_error`),
        chained to torch's error; it costs nothing until the pass fails.
        """
        return self._clip(params, batch, mask, clip_norm, skip_padding=False)

    def _clip(
        self,
        params: Params,
        batch: PyTree,
        mask: Tensor | None,
        clip_norm: Tensor | None,
        skip_padding: bool,
    ) -> tuple[Params, ExampleStats]:
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
            return self._clip_rows(params, batch, mask, clip, size)
        try:
            if skip_padding and size and not bool(mask.all()):
                return self._clip_real_rows(params, batch, mask, clip)
            return self._clip_rows(params, batch, mask, clip, size)
        except Exception as error:  # a misfit of data and model: the error says the fix
            raise explain_example_error(self.loss_fn, params, batch, mask, error)  # noqa: B904

    def _clip_real_rows(
        self, params: Params, batch: PyTree, mask: Tensor, clip: float | Tensor
    ) -> tuple[Params, ExampleStats]:
        """Eagerly, a padded micro-batch's clipped sum from its real rows alone.

        Padding contributes exactly 0 either way; leaving its rows out saves
        their forward and backward (the Trainer pads a Poisson batch to its
        mean plus 3 std: a fifth to a third of the rows). The rounding margin
        still counts the physical rows (public), so no clip factor depends on
        how many examples are real. Padding rows get loss 0, norm 0, not
        scaled. The step's time then follows the realised batch size, as in
        a loop that does not pad; a compiled step keeps the padded shape.
        """
        kept = mask.nonzero().squeeze(1)

        def real(t: Any) -> Any:
            return t.index_select(0, kept.to(t.device)) if isinstance(t, Tensor) else t

        summed, stats = self._clip_rows(params, tree_map(real, batch), mask[kept], clip, len(mask))

        def full(t: Tensor, fill: float | bool) -> Tensor:
            return t.new_full(mask.shape, fill).index_put_((kept,), t)

        loss, norm, scaled = full(stats.loss, 0.0), full(stats.norm, 0.0), full(stats.scaled, False)
        return summed, ExampleStats(loss, norm, scaled, mask)

    def _clip_rows(
        self, params: Params, batch: PyTree, mask: Tensor, clip: float | Tensor, rows: int
    ) -> tuple[Params, ExampleStats]:
        """:meth:`clip` of ``batch`` with the rounding margin of ``rows`` physical rows."""
        size = len(mask)
        if size == 0:  # an empty share (e.g. one rank's): nothing to differentiate
            dtype = next(iter(params.values())).dtype
            empty = torch.zeros(0, dtype=dtype, device=mask.device)
            stats = ExampleStats(empty, empty.to(torch.float64), mask, mask)
            zeros = tree_map(
                lambda p: p.new_zeros(p.shape, dtype=accumulation_dtype(p.dtype)), params
            )
            return zeros, stats
        policy = ClippingPolicy(self.clipping)  # the same policy on both paths
        if self._ghost is not None:
            plan = self._ghost.plan(params, batch, rows)  # rows: padded, public
            if plan.modules:
                summed, losses, clipped = ghost_clip(
                    self.loss_fn,
                    self._ghost.hooks,
                    plan,
                    params,
                    batch,
                    mask,
                    clipping=policy,
                    clip_norm=clip,
                    chunk_size=self.chunk_size,
                    rows=rows,
                )
                return summed, ExampleStats(losses.detach(), clipped.norm, clipped.scaled, mask)
        return self._vmap_rows(params, batch, mask, clip, rows, policy)

    def _vmap_rows(
        self,
        params: Params,
        batch: PyTree,
        mask: Tensor,
        clip: float | Tensor,
        rows: int,
        policy: ClippingPolicy,
    ) -> tuple[Params, ExampleStats]:
        """The vmap path's clipped sum of ``batch``, in chunks if :meth:`chunk_for` says so."""
        size = len(mask)
        chunk = self.chunk_for(params, rows)  # of the physical rows: public
        if chunk is None or chunk >= size:
            return self._vmap_clip(params, batch, mask, clip, rows, policy)
        # chunk by chunk, so that one chunk's per-example gradients are held at a time. The
        # chunks' sums are added in the accumulation dtype: a blocked summation of the rows,
        # whose every contribution meets at most (chunk - 1) + (chunks - 1) <= rows - 1
        # additions, within the margin's gamma_(rows + 2) for ``rows`` rows
        summed, parts = None, []
        for start in range(0, size, chunk):
            rows_of = _row_slice(start, min(start + chunk, size))
            part, stats = self._vmap_clip(
                params, tree_map(rows_of, batch), mask[start : start + chunk], clip, rows, policy
            )
            summed = part if summed is None else tree_add(summed, part)
            parts.append(stats)
        return summed, ExampleStats.cat(parts)

    def _timed_vmap(self, params: Params, batch: PyTree, mask: Tensor) -> Params:
        """The vmap path's clipped sum as this step computes it (``method="auto"`` times it)."""
        policy = ClippingPolicy(self.clipping)
        return self._vmap_rows(params, batch, mask, self.clip_norm, len(mask), policy)[0]

    def chunk_for(self, params: Params, rows: int) -> int | None:
        """The rows per chunk of the vmap path for a micro-batch of ``rows`` rows (``None``: all).

        An explicit ``chunk_size`` wins; it is warned about once if its
        per-example gradients exceed ``memory_budget``. Otherwise
        :func:`dpfunc.memory.chunk_for_budget`. Shapes only (public).
        """
        if self.chunk_size is not None:
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
        return memory.chunk_for_budget(params, rows, self.memory_budget)

    def _vmap_clip(
        self,
        params: Params,
        batch: PyTree,
        mask: Tensor,
        clip: float | Tensor,
        rows: int,
        policy: ClippingPolicy,
    ) -> tuple[Params, ExampleStats]:
        """The clipped sum of ``batch``'s rows from materialised per-example gradients."""
        grads, losses = per_sample_grads_and_losses(self.loss_fn, params, batch)
        groups = policy.groups(grads)
        norms = per_sample_norms(grads, groups)
        clipped = policy(norms, clip, mask, **rounding_scope(params, rows))
        summed = clipped_sum(grads, clipped.weights, groups=groups)
        return summed, ExampleStats(losses.detach(), clipped.norm, clipped.scaled, mask)

    def accumulate(
        self,
        summed: Params,
        params: Params,
        batch: PyTree,
        mask: Tensor | None,
        clip_norm: Tensor | None = None,
    ) -> tuple[Params, ExampleStats]:
        """Adds one micro-batch's clipped sum to ``summed`` (``clip_norm``: as for :meth:`clip`).

        Eagerly, the rows ``mask`` marks as padding are left out of the
        forward and backward (:meth:`_clip_real_rows`); the sum is the same.
        """
        check_same_structure(summed, params, "summed", "params")
        micro, stats = self._clip(params, batch, mask, clip_norm, skip_padding=True)
        return tree_add(summed, micro), stats

    def _check_drawn(self, noise: Params, step: Tensor) -> None:
        """Sharded: refuses noise that :meth:`draw_noise` did not draw for these rows and step.

        ``standard_normal_like(state.params, ...)`` without ``rows`` would
        give every rank with equally shaped rows the SAME noise, so the
        difference of two ranks' released rows would be the difference of
        the clipped sums, without noise; a tree drawn for another step
        would add the same noise twice, so the difference of two releases
        would hold none.
        """
        if not self.sharded:
            return
        with self._drawn_lock:
            drawn = list(self._drawn)
        t = int(step)
        for z in tree_leaves(noise):
            if not any(at == t and d.get(id(z)) is not None and d[id(z)]() is z for at, d in drawn):
                raise ValueError(
                    f"a sharded step takes the noise of step {t} from step.draw_noise("
                    f"state.params, seed=..., step={t}), which draws this rank's rows of the noise "
                    "tree for that step; noise drawn otherwise (standard_normal_like("
                    "state.params, ...) draws the first rows on every rank) or for another step "
                    "would add the same noise twice and release differences of clipped sums "
                    "without noise"
                )

    def _run_checked(self, piece: Callable[..., Any], *args: Any) -> Any:
        """Runs a (possibly compiled) piece that takes noise, after its eager caller checked it."""
        if not self.sharded:  # nothing to check: no state to set (a traced step stays pure)
            return piece(*args)
        self._noise_checked = True
        try:
            return piece(*args)
        finally:
            self._noise_checked = False

    def unclipped_count(self, state: TrainState, stats: ExampleStats) -> Tensor:
        """The count of unclipped examples in a logical batch: adaptive clipping's statistic."""
        return unclipped_count(stats.norm, state.clip_state.clip_norm, stats.mask)

    def all_reduce(self, summed: Params, *, step: int | Tensor | None = None) -> Params:
        """The clipped sum of the whole logical batch: ``summed`` summed over ranks.

        The identity on one process. Distributed, ``summed`` is the running
        sum of :meth:`zeros` and :meth:`accumulate`, and the reduction adds in
        its dtype, whose rounding the clip margin covers: float32 from
        :meth:`logical_step` for float32 and half parameters
        (``dpfunc.clipping.FLOAT32_SUMS`` counts the float32 additions of
        micro-batches and ranks together), float64 for float64 parameters or
        from :meth:`zeros` without a bound (``ACCUMULATED_SUMS``). Every rank
        must pass the same dtypes. Sharded, ``summed`` is this rank's sum of the whole model
        and the result this rank's rows of the total (a reduce-scatter).
        ``step`` only labels error messages.
        """
        return self.collectives.reduce(summed, step)

    def full_params(self, state: TrainState) -> Params:
        """The whole parameters of ``state``: ``state.params``, or every rank's rows gathered.

        Sharded (``shard=True``), ``state.params`` holds this rank's rows of
        each parameter and this is collective: call it on every rank.
        """
        return self.collectives.unshard(state.params, state.step)

    def gather_stats(
        self, stats: ExampleStats, *, step: int | Tensor | None = None
    ) -> ExampleStats:
        """All ranks' per-example stats in rank order (this rank's on one process)."""
        return self.collectives.gather(stats, step)

    def apply(
        self,
        state: TrainState,
        summed: Params,
        noise: Params,
        count: Tensor | None = None,
        count_noise: Tensor | None = None,
    ) -> TrainState:
        """Reduces this rank's clipped sum over the ranks, then :meth:`apply_reduced`.

        On one process the reduction is the identity. Distributed,
        ``summed`` is THIS rank's clipped sum of its share, ``noise`` the
        same on every rank (same seed and step), and ``count`` (adaptive
        clipping) the whole logical batch's. Sharded, ``summed`` is this
        rank's sum of the whole model and ``noise`` this rank's rows of the
        noise tree, as :meth:`draw_noise` draws them (anything else is
        refused).
        """
        check_state(state)
        check_same_structure(noise, state.params, "noise", "params")
        self._check_drawn(noise, state.step)
        if not self.sharded:  # sharded: summed is whole, the reduce-scatter checks its shapes
            check_same_structure(summed, state.params, "summed", "params")
        reduced = self.all_reduce(summed, step=state.step)
        return self._run_checked(self._apply_reduced, state, reduced, noise, count, count_noise)

    def apply_reduced(
        self,
        state: TrainState,
        summed: Params,
        noise: Params,
        count: Tensor | None = None,
        count_noise: Tensor | None = None,
    ) -> TrainState:
        """Noises the logical batch's clipped sum once, averages, and updates.

        :meth:`private_gradient`, then the optimizer's update of the
        parameters. No collective, so it compiles with ``fullgraph=True``.
        """
        private, clip_state, noise_state = self.private_gradient(
            state, summed, noise, count, count_noise
        )
        updates, opt_state = self.optimizer.update(private, state.opt_state, state.params)
        params = optim.apply_updates(state.params, updates)
        return TrainState(params, opt_state, state.step + 1, clip_state, noise_state)

    def private_gradient(
        self,
        state: TrainState,
        summed: Params,
        noise: Params,
        count: Tensor | None = None,
        count_noise: Tensor | None = None,
    ) -> tuple[Params, ClipState, NoiseState]:
        """The private gradient of a logical batch: its clipped sum, noised once, averaged.

        Returns ``(private, clip_state, noise_state)``: ``private`` is
        ``(summed + noise_std * w) / expected_batch_size`` leaf by leaf, and
        the mechanisms' next states. ``summed`` is the whole logical batch's
        (already reduced over the ranks). The noise added is what the
        config's noise mechanism (``self.noise_mechanism``) makes of
        ``noise``, the step's independent standard-normal tree, and
        ``state.noise_state``: the tree itself for DP-SGD, with ``bands > 1``
        the correlated draw of the banded square root normalised to unit
        column norm (:func:`~dpfunc.matrix_factorization.banded_noise`), its
        history carried in the new state. The clip mechanism
        (``self.clip_mechanism``) moves ``state.clip_state``: with adaptive
        clipping it releases ``count`` (from :meth:`unclipped_count`) with
        noise ``count_noise_multiplier * count_noise`` (``count_noise``: a
        standard normal 0-d tensor from ``standard_normal_like(...,
        stream="count")``) and updates the clip norm by
        :func:`dpfunc.clipping.adaptive_clip_norm`; a fixed clip norm stays.
        Nothing here reads the data beyond ``summed`` and ``count``.

        Noise, average and the cast to each parameter's accumulation dtype
        (float32 for half-precision parameters, whose optimizer state and
        update are float32 too; see :mod:`dpfunc.optim`) are one fused pass
        per leaf (:func:`dpfunc.noise.noisy_average`): a float32 ``summed``
        (:meth:`logical_step`'s running sum of float32 or half parameters)
        with float32 noise is noised and averaged in float32; a float64
        ``summed`` (float64 parameters, or :meth:`zeros` without a bound), or
        the float64 secure noise, in float64, rounded once only after the
        average. Either way every rounding comes after the noise: a
        post-processing. ``state.opt_state`` is not read.
        """
        check_same_structure(noise, state.params, "noise", "params")
        check_same_structure(summed, state.params, "summed", "params")
        if self.sharded and not self._noise_checked:  # called directly, not through apply
            if torch.compiler.is_compiling():
                raise RuntimeError(
                    "a sharded step checks its noise eagerly, before the compiled pieces run: "
                    "compile it with step.compile(), not torch.compile(step.apply_reduced)"
                )
            self._check_drawn(noise, state.step)
        # adaptive clipping: this step's noise follows the clip norm it clipped at
        std = (
            self.noise_multiplier * state.clip_state.clip_norm if self.adaptive else self.noise_std
        )
        clip_state = self.clip_mechanism.update(count, count_noise, state.clip_state)
        noise, noise_state = self.noise_mechanism.update(noise, state.noise_state)
        # one pass per leaf; rounded only after the noise (a post-processing), to float32 for
        # half-precision parameters: the optimizer keeps its state and forms its update in float32
        private = noisy_average(summed, noise, std, self.expected_batch_size, state.params)
        return private, clip_state, noise_state

    def draw_noise(
        self, params: Params, *, seed: int, step: int, secure: bool | None = None
    ) -> StepNoise:
        """Step ``step``'s standard-normal draws: the tree and, if adaptive, the count's.

        A function of ``(seed, step)`` and the parameters' shapes only, never
        of the data, so it may be drawn ahead (the Trainer does, on a worker
        thread). The count's comes from its own stream (``stream="count"``).
        ``secure=None`` follows ``config.secure_noise``.
        """
        secure = self.config.secure_noise if secure is None else secure
        rows = self.collectives.noise_rows(params)  # sharded: this rank's rows of the tree
        noise = standard_normal_like(params, seed=seed, step=step, secure=secure, rows=rows)
        if self.sharded:
            drawn = {id(z): weakref.ref(z) for z in tree_leaves(noise)}
            with self._drawn_lock:
                self._drawn.append((step, drawn))
        if not self.adaptive:
            return StepNoise(noise, None)
        zero = {"count": torch.zeros((), dtype=torch.float64)}
        count = standard_normal_like(zero, seed=seed, step=step, secure=secure, stream="count")
        return StepNoise(noise, count["count"])

    def logical_step(
        self,
        state: TrainState,
        micro_batches: Iterable[tuple[PyTree, Tensor]],
        noise: StepNoise,
        *,
        before_release: Callable[[ExampleStats], None] | None = None,
    ) -> tuple[TrainState, ExampleStats]:
        """One private step on a logical batch held in any number of micro-batches.

        The one place where a logical step is written: each micro-batch's
        clipped sum is accumulated (:meth:`accumulate`; float32 for float32
        and half parameters up to ``FLOAT32_SUMS`` sums, see the module
        docstring), the
        per-example stats are gathered over the ranks, ``before_release(stats)``
        runs (the Trainer checks non-finite examples and records the step
        with the accountant there: accounted before its release), and
        :meth:`apply` reduces the sum over the ranks and adds the noise once
        (adaptive clipping's count, of the whole logical batch, with
        ``noise.count``); the collectives are identities on one process. It
        calls the public :meth:`accumulate` and :meth:`apply`, so a subclass
        that changes them (an audit's deliberately broken step) is run as
        written. An empty
        logical batch is a step too: its sum is zero and its noise is added.
        Uses the compiled pieces after :meth:`compile`.

        Args:
            state: the state before the step (identical on every rank).
            micro_batches: ``(batch, mask)`` pairs, this rank's share
                (``PoissonBatches.logical_batch(t)[0]``).
            noise: :meth:`draw_noise` for this step (the same on every rank).
            before_release: called with the whole logical batch's stats
                after the sums and before anything is released; raising
                there releases nothing.

        Returns:
            The new state and the whole logical batch's per-example stats
            (:func:`summarize` them; NOT private).

        Raises:
            TypeError, ValueError: the data does not fit the model (as
                :meth:`clip`, compiled steps too), before ``before_release``:
                nothing is accounted or released.

        Under a caller's ``torch.inference_mode()`` the step runs with it off
        (it needs autograd), so its outputs are ordinary tensors.
        """
        self._check_drawn(noise.params, state.step)  # before any collective: all raise alike
        with _outside_inference_mode():
            summed, stats, count = self._logical_sum(state, micro_batches, before_release)
            counts = (count, noise.count) if self.adaptive else ()
            return self.apply(state, summed, noise.params, *counts), stats  # over the ranks

    def logical_gradient(
        self,
        state: TrainState,
        micro_batches: Iterable[tuple[PyTree, Tensor]],
        noise: StepNoise,
        *,
        before_release: Callable[[ExampleStats], None] | None = None,
    ) -> tuple[Params, TrainState, ExampleStats]:
        """:meth:`logical_step` without the optimizer: the private gradient of a logical batch.

        The same sums, collectives, ``before_release`` and noise as
        :meth:`logical_step`; returns ``(private, state, stats)`` with
        ``private`` from :meth:`private_gradient` (in each parameter's
        accumulation dtype) and ``state`` with the step counted and the
        mechanisms' states moved (``params`` and ``opt_state`` as they were).
        :class:`dpfunc.PrivateGradients` writes ``private`` into ``p.grad``.
        """
        self._check_drawn(noise.params, state.step)
        with _outside_inference_mode():
            summed, stats, count = self._logical_sum(state, micro_batches, before_release)
            reduced = self.all_reduce(summed, step=state.step)
            counts = (count, noise.count) if self.adaptive else ()
            private, clip_state, noise_state = self._run_checked(
                self._private_gradient, state, reduced, noise.params, *counts
            )
        state = state._replace(step=state.step + 1, clip_state=clip_state, noise_state=noise_state)
        return private, state, stats

    def _logical_sum(
        self,
        state: TrainState,
        micro_batches: Iterable[tuple[PyTree, Tensor]],
        before_release: Callable[[ExampleStats], None] | None,
    ) -> tuple[Params, ExampleStats, Tensor | None]:
        """This rank's clipped sum, all ranks' stats, and adaptive clipping's count.

        The running sum is float32 for float32 and half parameters (float64 for
        float64 ones) for the first ``FLOAT32_SUMS - world_size`` micro-batches,
        the count the clip margin covers; a longer logical batch adds the rest
        in float64 and rounds the total once, back to float32, so every rank
        hands the all-reduce the same dtype. With ``FLOAT32_SUMS`` ranks or
        more it is float64 throughout.
        """
        check_state(state)
        adaptive = (
            (state.clip_state.clip_norm,) if self.adaptive else ()
        )  # the clip norm it follows
        params = self.full_params(state)  # sharded: gathered once for all micro-batches
        float32 = self._float32_micro_batches()  # public: FLOAT32_SUMS less the ranks
        summed, stats = self.zeros(params, micro_batches=1), []
        for i, (batch, mask) in enumerate(micro_batches):
            if i == float32:  # past the float32 sums the margin covers: the rest in float64
                summed = tree_map(lambda s: s.to(SUM_DTYPE), summed)
            try:
                summed, part = self._accumulate(summed, params, batch, mask, *adaptive)
            except Exception as error:  # compiled: explained here (eagerly: in _clip)
                raise explain_example_error(self.loss_fn, params, batch, mask, error)  # noqa: B904
            stats.append(part)
        if float32 > 0:  # rounded once if it went on in float64 (the margin counts it)
            summed = tree_map(lambda s, p: s.to(accumulation_dtype(p.dtype)), summed, params)
        stats = ExampleStats.cat(stats) if stats else _no_stats(state.params)
        stats = self.gather_stats(stats, step=state.step)  # this rank's share -> the whole
        if before_release is not None:
            before_release(stats)
        # the whole logical batch's count, noised once from its own stream
        count = self.unclipped_count(state, stats) if self.adaptive else None
        return summed, stats, count

    def __call__(
        self,
        state: TrainState,
        batch: PyTree,
        mask: Tensor | None,
        noise: Params,
        count_noise: Tensor | None = None,
    ) -> tuple[TrainState, dict[str, Tensor]]:
        """One private step on a logical batch held in one micro-batch (each rank's share).

        The same as ``zeros``, one ``accumulate`` and ``apply``: the sum is
        float64 before the noise. Distributed, the metrics and adaptive
        clipping's count cover the whole logical batch (all ranks' stats).
        Pure on one process; ``torch.compile(step, fullgraph=True)`` compiles it.
        """
        check_state(state)
        check_same_structure(noise, state.params, "noise", "params")
        self._check_drawn(noise, state.step)  # before any collective: all raise alike
        clip_norm = state.clip_state.clip_norm if self.adaptive else None
        params = self.full_params(state)
        micro, stats = self._clip(params, batch, mask, clip_norm, skip_padding=True)
        # zeros() + accumulate(): one micro-batch's sum widened to float64 (exactly)
        summed = tree_map(lambda m: m.to(SUM_DTYPE), micro)
        stats = self.gather_stats(stats, step=state.step)
        count = self.unclipped_count(state, stats) if self.adaptive else None
        return self.apply(state, summed, noise, count, count_noise), summarize(stats)


class StepNoise(NamedTuple):
    """One step's standard-normal draws (data-independent)."""

    params: Params  # like the parameters
    count: Tensor | None  # shape (), float64: adaptive clipping's count; None otherwise


class NoiseAhead:
    """Draws a step's noise, and the next step's on a worker thread meanwhile.

    :meth:`TrainStep.draw_noise` depends only on ``(seed, step)`` and the
    parameters' shapes, never on the data, so drawing step ``t + 1``'s
    while step ``t`` computes changes no bit of the result. It draws ahead
    only where a core is free for the worker (:func:`_spare_core`); the
    result is the same either way.
    """

    _worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dpfunc-noise")

    def __init__(self, step: TrainStep):
        self.step = step
        self._ahead: tuple[tuple[int, int], Future] | None = None
        self._shapes: dict[str, torch.Size] | None = None  # the parameters' at the last draw

    def draw(self, params: Params, seed: int, t: int, *, ahead: bool) -> StepNoise:
        """Step ``t``'s draws; with ``ahead``, starts step ``t + 1``'s.

        Raises:
            ValueError: a parameter's shape changed since the last draw (a layer
                resized in place); the message names it, both shapes and the fix.
        """
        shapes = {name: p.shape for name, p in params.items()}
        if self._shapes is not None and shapes != self._shapes:
            _refuse_resized(self._shapes, shapes)
        self._shapes = shapes
        waiting, self._ahead = self._ahead, None
        if waiting is not None and waiting[0] == (seed, t):
            noise = waiting[1].result()
        else:
            noise = self.step.draw_noise(params, seed=seed, step=t)
        if ahead and _spare_core(params):
            future = self._worker.submit(self.step.draw_noise, params, seed=seed, step=t + 1)
            self._ahead = ((seed, t + 1), future)
        return noise


def _spare_core(params: Params) -> bool:
    """Whether a worker thread can draw the next step's noise without slowing this one.

    On a CPU only where this process may run on more cores than torch's own threads use:
    with none to spare, the worker takes a core from the step's threads (the Trainer's
    eager MLP step on 2 cores, 2 torch threads: 12.2 ms a step drawn ahead, 11.3 ms drawn
    in the step; with 1 torch thread, 14.2 ms ahead against 16.5 ms). On a GPU the draw
    is queued on the device, and ahead is always worth it.
    """
    if any(p.device.type != "cpu" for p in params.values()):
        return True
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return cores > torch.get_num_threads()


def _outside_inference_mode() -> AbstractContextManager:
    """``torch.inference_mode(False)`` where a caller's inference mode is on (eagerly).

    A logical step needs autograd (the per-example gradients), and what it returns
    (the state, the private gradient that ``PrivateGradients`` writes into ``p.grad``)
    must stay usable after the caller's ``with torch.inference_mode():`` ends: an
    inference tensor cannot be changed in place outside inference mode
    (``optimizer.zero_grad(set_to_none=False)``, ``p.grad.add_(...)``).
    """
    if torch.is_inference_mode_enabled() and not torch.compiler.is_compiling():
        return torch.inference_mode(False)
    return nullcontext()


def _refuse_resized(before: dict[str, torch.Size], now: dict[str, torch.Size]) -> None:
    """Raises ``ValueError`` naming the first parameter whose shape differs between the dicts."""
    for name, shape in now.items():
        old = before.get(name)
        if old is not None and old != shape:
            raise ValueError(
                f"the model's parameter {name!r} changed shape from {tuple(old)} to "
                f"{tuple(shape)} since the previous step (a layer resized in place, e.g. with "
                "`.data =` or `.set_()`): a run follows a model that is moved or converted, not "
                "one resized, whose noise and optimizer state are shaped like the old "
                "parameter. Resize the model before building PrivateGradients, or build "
                "PrivateGradients and the optimizer again"
            )
    raise ValueError(  # the names changed: the caller checks names first, so not reached there
        f"the model's parameters changed since the previous step: {sorted(before)[:5]} -> "
        f"{sorted(now)[:5]}; build PrivateGradients and the optimizer again"
    )


def _row_slice(start: int, stop: int) -> Callable[[Any], Any]:
    """Rows ``start:stop`` of a batch leaf (other leaves unchanged)."""
    return lambda t: t[start:stop] if isinstance(t, Tensor) else t


def _no_stats(params: Params) -> ExampleStats:
    dtype = next(iter(params.values())).dtype
    empty = torch.zeros(0, dtype=dtype)
    flags = torch.zeros(0, dtype=torch.bool)
    return ExampleStats(empty, empty.to(torch.float64), flags, flags)


def make_train_step(
    loss_fn: LossFn,
    optimizer: optim.GradientTransformation,
    config: DPConfig | None = None,
    *,
    model: nn.Module | None = None,
    method: str = "auto",
    chunk_size: int | None = None,
    memory_budget: int | None = None,
    **settings: Any,
) -> TrainStep:
    """Builds the DP-SGD step (Abadi et al. 2016).

    Args:
        loss_fn: ``loss_fn(params, example) -> scalar`` for ONE example.
        optimizer: a :mod:`dpfunc.optim` transformation, e.g. ``optim.adam(1e-3)``.
        config: the privacy settings, a :class:`~dpfunc.DPConfig` with a
            ``noise_multiplier`` (or ``config.calibrated(num_examples)``):
            ``clip_norm`` ``C`` (``inf`` disables clipping, only with
            ``noise_multiplier=0``: no privacy), ``noise_multiplier`` ``sigma``
            (noise std ``sigma * C``), ``expected_batch_size`` (the
            denominator of the average, never the realised batch size),
            ``clipping``: ``"flat"`` (all parameters together),
            ``"per_layer"`` (each module's parameters bounded by ``C /
            sqrt(num_modules)``, McMahan et al. 2018) or ``"normalized"``
            (automatic clipping, Bu et al. 2022, factor ``C / (norm +
            0.01)``), each bounding an example's whole contribution by ``C``;
            ``target_quantile`` (adaptive clipping, Andrew et al. 2021:
            ``state.clip_state`` starts at ``clip_norm`` and after each step
            moves by ``exp(-quantile_learning_rate * (noisy_count /
            expected_batch_size - gamma))``, where ``noisy_count`` is the
            logical batch's count of unclipped examples plus
            ``count_noise_multiplier`` times a standard normal, passed as
            ``count_noise``; accounted with
            :func:`dpfunc.accounting.combined_noise_multiplier`); ``bands``
            (``b > 1``: correlated noise, the banded square root
            factorization, DP-BandMF, Kalinin and Lampert 2024: step ``t``
            adds ``sigma * C * w_t`` with ``w = C^{-1} z`` for the strategy
            normalised to unit column norm, keeping the last ``b - 1`` draws
            in ``state.noise_state``; needs cyclic Poisson sampling,
            ``config.sampler``, and ``expected_batch_size = sample_rate *
            num_examples / b``).
        model: the ``nn.Module`` that ``loss_fn`` calls through
            ``torch.func.functional_call``; enables ghost clipping. dpfunc
            registers forward hooks on its covered submodules (inert outside
            a ghost pass).
        method: ``"vmap"`` (every example's gradient is materialised),
            ``"ghost"`` (ghost clipping with book-keeping, Li et al. 2022,
            Bu et al. 2023: per-example norms and the clipped sum from each
            covered layer's input and output gradient; needs ``model``) or
            ``"auto"`` (the default: with ``model``, ghost clipping for each
            covered module whose per-example norm is cheaper from its inputs
            and output gradients than from its materialised gradient, i.e. a
            Linear or convolution with ``T`` positions per example and
            ``T = 1`` or ``T^2 < d_in * d_out``, an Embedding with ``T^2 <
            16 num_embeddings``, and recurrent and normalisation layers; vmap
            for the rest, and plain vmap when that leaves nothing to ghost;
            eagerly, the first call for each batch shape then chooses between
            that plan and plain vmap, from shapes where they are decisive
            (a ``memory_budget`` vmap would exceed: ghost; every example's
            gradient together small: vmap; ``Linear`` layers only, one
            position per example: ghost) and otherwise from three timings
            of each, alternately, by their minima (see
            :mod:`dpfunc.ghost.clipper`); without ``model``, vmap). Ghost covers ``Linear``,
            ``Embedding``, ``Conv1d``/``Conv2d``, ``LayerNorm``, ``GroupNorm`` and ``RNN`` / ``GRU``
            / ``LSTM`` (unrolled, without ``proj_size``); every other parameter, and any covered
            module it cannot vouch for (called twice, inside a nested ``torch.func`` transform, tied
            or used outside its call, behind another forward hook), gets per-example gradients from
            vmap in the same pass, or the whole step falls back to vmap; a ``UserWarning`` names the
            reasons once per step. All three clipping modes are supported and the result equals the
            vmap path's.
        chunk_size: the vmap path computes a micro-batch's clipped sum at
            most this many rows at a time, so that only their per-example
            gradients are held at once (bounding memory at some cost in
            speed; the ghost path passes it to ``vmap`` for the parameters it
            leaves to vmap). ``None``: all rows together, or what
            ``memory_budget`` allows.
        memory_budget: bytes (an int > 0) that the vmap path's per-example
            gradients may take at once, or ``None`` (default, no budget).
            Without an explicit ``chunk_size`` the vmap path then works in
            chunks of :func:`dpfunc.memory.chunk_for_budget` rows (at least
            one: a budget below one example's gradient is not met); a
            ``chunk_size`` over the budget is kept, with a warning. With
            ``method="auto"``, a model the ghost path covers whose
            full-batch per-example gradients would exceed the budget is
            ghost-clipped without timing. The result is the same with or
            without a budget, up to the order of float additions (covered by
            the clip margin). Activations and the non-private backward are
            not counted: the budget bounds what DP adds, not the peak.
        **settings: the keyword form: ``DPConfig``'s fields
            (``clip_norm=1.0, noise_multiplier=1.1, expected_batch_size=256,
            ...``) instead of ``config``.

    Returns:
        A :class:`TrainStep` ``step`` with ``step.init(params) -> state`` and
        ``step(state, batch, mask, noise) -> (state, metrics)``, where
        ``mask[B]`` marks real rows (0 for padding), ``noise`` is
        ``dpfunc.standard_normal_like(params, seed, step)``, and
        ``metrics`` is :func:`summarize` (not private). For a logical batch
        split into micro-batches use :meth:`TrainStep.logical_step`, or
        ``step.zeros``, ``step.accumulate`` and ``step.apply``.
        ``torch.compile(step, fullgraph=True)`` compiles one graph that
        serves every step of a fixed batch shape.

    Raises:
        ValueError: a privacy setting is invalid (see :class:`DPConfig`), a
            config with ``target_epsilon`` not yet calibrated, an unknown
            ``method``, ``method="ghost"`` without ``model``, a
            ``chunk_size`` or ``memory_budget`` that is not an int >= 1; at call time,
            a batch, mask or noise tree that does not match, or a non-scalar
            loss.
        TypeError: ``optimizer`` is not an (init, update) pair, ``model`` is
            not an ``nn.Module``, both ``config`` and keyword settings, or an
            unknown keyword.
    """
    config = config_from("make_train_step", config, settings)
    return TrainStep(
        loss_fn,
        optimizer,
        config,
        model=model,
        method=method,
        chunk_size=chunk_size,
        memory_budget=memory_budget,
    )
