"""One DP-SGD step, composed from the pure pieces.

::

    per_sample_grads -> per_sample_norms -> clip_factors -> clipped_sum
        -> add_noise -> average -> optimizer.update

A logical (Poisson) batch may arrive as several fixed-shape micro-batches:
``accumulate`` adds each micro-batch's clipped sum, and ``apply`` adds the
noise exactly once and updates the parameters. ``step(state, batch, mask,
noise)`` does both for a logical batch that fits one micro-batch. All three
are pure and compile with ``torch.compile(fullgraph=True)``.

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
that sum's. The running sum of a logical batch, across micro-batches (and
ranks, :mod:`dpfunc.distributed`), is float64, whose additions the margin
covers too (``ACCUMULATED_SUMS``): every example's contribution to the sum
the noise is added to has norm at most ``clip_norm``, rounding included.
``apply`` adds the noise and averages in float64 and rounds only then, a
post-processing of the noisy sum, to the parameters' dtype (float32 for
half-precision parameters, whose optimizer state and update are float32).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from . import optim
from .checks import check_choice, check_int, check_number
from .clipping import (
    ClippingPolicy,
    accumulation_dtype,
    adaptive_clip_norm,
    clipped_sum,
    per_sample_norms,
    rounding_scope,
    unclipped_count,
)
from .ghost import GhostClipper, ghost_clip
from .matrix_factorization import init_noise_history, normalized_coefficients, solve_recurrence
from .noise import add_noise, average, check_expected_batch_size
from .per_sample import LossFn, batch_size, per_sample_grads_and_losses
from .tree import Params, PyTree, check_same_structure, tree_add, tree_map

CLIPPING_MODES = ("flat", "per_layer", "normalized")
SUM_DTYPE = torch.float64  # the running clipped sum of a logical batch
METHODS = ("auto", "vmap", "ghost")


class TrainState(NamedTuple):
    params: Params  # the model's trainable parameters
    opt_state: Any  # the optimizer's state
    step: Tensor  # shape (), int64: private steps taken so far
    clip_norm: (
        Tensor  # shape (), float64: the clip norm of the next step (adaptive clipping moves it)
    )
    # correlated noise (bands b > 1): each leaf [b - 1, *param.shape], the last b - 1
    # correlated draws, newest first (dpfunc.matrix_factorization); {} for DP-SGD
    noise_history: Params = {}  # noqa: RUF012 (never mutated: states are replaced, not changed)


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


class TrainStep:
    """A DP-SGD step; build it with :func:`make_train_step`."""

    def __init__(
        self,
        loss_fn: LossFn,
        optimizer: optim.GradientTransformation,
        *,
        clip_norm: float,
        noise_multiplier: float,
        expected_batch_size: float,
        clipping: str = "flat",
        chunk_size: int | None = None,
        model: nn.Module | None = None,
        method: str = "auto",
        target_quantile: float | None = None,
        quantile_learning_rate: float = 0.2,
        count_noise_multiplier: float | None = None,
        bands: int = 1,
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
        check_number("clip_norm", clip_norm, low=0, low_open=True, note="(inf disables clipping)")
        check_number("noise_multiplier", noise_multiplier, low=0, high_open=True)
        if math.isinf(clip_norm) and noise_multiplier > 0:
            raise ValueError(
                "clip_norm=inf leaves the sensitivity unbounded, so noise cannot make the "
                f"step private; use a finite clip_norm or noise_multiplier=0, got "
                f"noise_multiplier={noise_multiplier!r}"
            )
        check_expected_batch_size(expected_batch_size)
        check_choice("clipping", clipping, CLIPPING_MODES)
        if clipping == "normalized" and math.isinf(clip_norm):
            raise ValueError("clipping='normalized' needs a finite clip_norm, got clip_norm=inf")
        if chunk_size is not None:
            check_int("chunk_size", chunk_size, minimum=1)
        check_choice("method", method, METHODS)
        if target_quantile is not None:
            check_number("target_quantile", target_quantile, low=0, high=1, low_open=True,
                         high_open=True)  # fmt: skip
            check_number("quantile_learning_rate", quantile_learning_rate, low=0,
                         low_open=True, high_open=True)  # fmt: skip
            check_number("count_noise_multiplier", count_noise_multiplier, low=0,
                         low_open=True, high_open=True)  # fmt: skip
            if clipping != "flat" or math.isinf(clip_norm):
                raise ValueError(
                    "adaptive clipping (target_quantile) follows a quantile of the flat "
                    "per-example norms from a finite starting clip_norm; it needs "
                    f"clipping='flat', got clipping={clipping!r}, clip_norm={clip_norm!r}"
                )
        check_int("bands", bands, minimum=1)
        if bands > 1 and target_quantile is not None:
            raise ValueError(
                "adaptive clipping (target_quantile) is not combined with correlated noise: "
                "the amplification theorem for bands > 1 is stated for one fixed clip norm and "
                "no other release; use target_quantile=None or bands=1, got "
                f"target_quantile={target_quantile!r}, bands={bands!r}"
            )
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
        if method == "ghost" and model is None:
            raise ValueError(
                "method='ghost' needs model=, the nn.Module that loss_fn calls through "
                "torch.func.functional_call; got model=None"
            )
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.clip_norm = float(clip_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.expected_batch_size = expected_batch_size
        self.clipping = clipping
        self.chunk_size = chunk_size
        self.method = method
        self.target_quantile = target_quantile
        self.quantile_learning_rate = float(quantile_learning_rate)
        self.count_noise_multiplier = (
            None if count_noise_multiplier is None else float(count_noise_multiplier)
        )
        self.bands = bands
        # the strategy C with unit column norm: noise_multiplier is the accountant's
        self.coefficients = normalized_coefficients(bands)
        use_ghost = model is not None and method != "vmap"
        self._ghost = GhostClipper(model, loss_fn, method) if use_ghost else None
        # sensitivity of the clipped sum is clip_norm in every mode
        self.noise_std = 0.0 if noise_multiplier == 0 else self.noise_multiplier * self.clip_norm

    def init(self, params: Params) -> TrainState:
        """The state before the first step; ``params`` are not copied or changed."""
        step = torch.zeros((), dtype=torch.int64)
        clip_norm = torch.tensor(self.clip_norm, dtype=torch.float64)
        history = init_noise_history(params, self.bands)
        return TrainState(params, self.optimizer.init(params), step, clip_norm, history)

    def explain(self, params: Params, batch: PyTree) -> dict[str, str]:
        """How each trainable parameter is clipped for batches shaped like ``batch``.

        Returns ``{name: "ghost"}`` for a parameter whose per-example norm and
        clipped sum come from ghost clipping, or ``{name: "vmap: <why>"}`` for
        one whose per-example gradient is materialised by vmap, with the
        reason (no rule for its layer, a use the planner cannot follow, a cost
        choice of ``method="auto"``). Eagerly with ``method="auto"`` this is
        the plan after the one-time timing of ghost against vmap, which runs
        here if the step has not yet seen this batch shape; a compiled step
        plans by the rules' cost models alone, so its plan can differ.

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
        """Adaptive clipping is on: the clip norm lives in ``TrainState.clip_norm``."""
        return self.target_quantile is not None

    def zeros(self, params: Params) -> Params:
        """An empty clipped sum, to start accumulating a logical batch: float64 zeros.

        The running sum is float64 whatever the parameters' dtype, so adding
        micro-batch sums rounds each contribution by at most ``2**-53`` per
        addition (covered by the clip margin, see the module docstring).
        """
        return tree_map(lambda p: torch.zeros_like(p, dtype=SUM_DTYPE), params)

    def clip(
        self, params: Params, batch: PyTree, mask: Tensor | None, clip_norm: Tensor | None = None
    ) -> tuple[Params, ExampleStats]:
        """The clipped sum of one micro-batch and its per-example stats.

        ``clip_norm``: adaptive clipping's current norm (``state.clip_norm``);
        ``None`` clips at the fixed ``clip_norm`` the step was built with.
        The sum is in the accumulation dtype of each parameter (float32 for
        bf16, fp16 and float32, float64 for float64); the clip factors carry
        the rounding margin for this micro-batch's rows, the gradients'
        dtype and size (public: shapes and dtypes).
        """
        clip = self.clip_norm if clip_norm is None else clip_norm
        size = batch_size(batch)
        if mask is None:
            mask = torch.ones(size, dtype=torch.bool)
        if tuple(mask.shape) != (size,):
            raise ValueError(
                f"mask must have shape ({size},) to match the batch, got {tuple(mask.shape)}"
            )
        mask = mask.to(torch.bool)
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
            plan = self._ghost.plan(params, batch)
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
                )
                return summed, ExampleStats(losses.detach(), clipped.norm, clipped.scaled, mask)
        grads, losses = per_sample_grads_and_losses(
            self.loss_fn, params, batch, chunk_size=self.chunk_size
        )
        groups = policy.groups(grads)
        norms = per_sample_norms(grads, groups)
        clipped = policy(norms, clip, mask, **rounding_scope(params, size))
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
        """Adds one micro-batch's clipped sum to ``summed`` (``clip_norm``: as for :meth:`clip`)."""
        check_same_structure(summed, params, "summed", "params")
        micro, stats = self.clip(params, batch, mask, clip_norm)
        return tree_add(summed, micro), stats

    def unclipped_count(self, state: TrainState, stats: ExampleStats) -> Tensor:
        """The count of unclipped examples in a logical batch: adaptive clipping's statistic."""
        return unclipped_count(stats.norm, state.clip_norm, stats.mask)

    def apply(
        self,
        state: TrainState,
        summed: Params,
        noise: Params,
        count: Tensor | None = None,
        count_noise: Tensor | None = None,
    ) -> TrainState:
        """Noises the logical batch's clipped sum once, averages, and updates.

        With ``bands > 1`` the noise added is the correlated draw
        :func:`~dpfunc.matrix_factorization.correlated_noise` makes from
        ``noise`` and ``state.noise_history`` (the banded square root,
        normalised to unit column norm), and the new state carries the
        updated history; ``noise`` is still the step's independent
        standard-normal tree. With adaptive clipping, also releases ``count`` (from
        :meth:`unclipped_count`) with noise ``count_noise_multiplier *
        count_noise`` (``count_noise``: a standard normal 0-d tensor from
        ``standard_normal_like(..., stream="count")``) and moves
        ``state.clip_norm`` by :func:`dpfunc.clipping.adaptive_clip_norm`.

        The noise is added and the average taken in ``summed``'s dtype
        (float64 from :meth:`zeros` and :meth:`accumulate`); the result is
        rounded only then, before the optimizer, to each parameter's
        accumulation dtype (float32 for half-precision parameters, whose
        optimizer state and update are float32 too; see :mod:`dpfunc.optim`).
        """
        check_same_structure(noise, state.params, "noise", "params")
        check_same_structure(summed, state.params, "summed", "params")
        clip_norm = state.clip_norm
        std = self.noise_std
        if self.adaptive:
            if count is None or count_noise is None:
                raise ValueError(
                    "adaptive clipping releases the unclipped count with its own noise: pass "
                    "count=step.unclipped_count(state, stats) and count_noise"
                )
            std = self.noise_multiplier * state.clip_norm
            noisy_count = count + self.count_noise_multiplier * count_noise
            clip_norm = adaptive_clip_norm(
                state.clip_norm,
                noisy_count,
                self.expected_batch_size,
                self.target_quantile,
                self.quantile_learning_rate,
            )
        history = state.noise_history
        if self.bands > 1:
            noise, history = solve_recurrence(noise, history, self.coefficients)
        private = average(add_noise(summed, noise, std), self.expected_batch_size)
        # rounded only after the noise (a post-processing), to float32 for half-precision
        # parameters: the optimizer keeps its state and forms its update in float32
        private = tree_map(lambda u, p: u.to(accumulation_dtype(p.dtype)), private, state.params)
        updates, opt_state = self.optimizer.update(private, state.opt_state, state.params)
        params = optim.apply_updates(state.params, updates)
        return TrainState(params, opt_state, state.step + 1, clip_norm, history)

    def __call__(
        self,
        state: TrainState,
        batch: PyTree,
        mask: Tensor | None,
        noise: Params,
        count_noise: Tensor | None = None,
    ) -> tuple[TrainState, dict[str, Tensor]]:
        """One private step on a logical batch held in one micro-batch.

        The same as ``zeros``, one ``accumulate`` and ``apply``: the sum is
        float64 before the noise.
        """
        check_same_structure(noise, state.params, "noise", "params")
        clip_norm = state.clip_norm if self.adaptive else None
        summed, stats = self.accumulate(
            self.zeros(state.params), state.params, batch, mask, clip_norm
        )
        count = self.unclipped_count(state, stats) if self.adaptive else None
        return self.apply(state, summed, noise, count, count_noise), summarize(stats)


def make_train_step(
    loss_fn: LossFn,
    optimizer: optim.GradientTransformation,
    *,
    clip_norm: float,
    noise_multiplier: float,
    expected_batch_size: float,
    clipping: str = "flat",
    chunk_size: int | None = None,
    model: nn.Module | None = None,
    method: str = "auto",
    target_quantile: float | None = None,
    quantile_learning_rate: float = 0.2,
    count_noise_multiplier: float | None = None,
    bands: int = 1,
) -> TrainStep:
    """Builds the DP-SGD step (Abadi et al. 2016).

    Args:
        loss_fn: ``loss_fn(params, example) -> scalar`` for ONE example.
        optimizer: a :mod:`dpfunc.optim` transformation, e.g. ``optim.adam(1e-3)``.
        clip_norm: ``C``, the bound on each example's contribution (flat L2
            norm of its gradient); ``inf`` disables clipping (only with
            ``noise_multiplier=0``: no privacy).
        noise_multiplier: ``sigma``; the noise std is ``sigma * C``. ``0``
            adds no noise (no privacy).
        expected_batch_size: ``sample_rate * num_examples``, the denominator
            of the average. Never the realised batch size.
        clipping: ``"flat"`` (all parameters together), ``"per_layer"``
            (each module's parameters bounded by ``C / sqrt(num_modules)``,
            McMahan et al. 2018) or ``"normalized"`` (automatic clipping,
            Bu et al. 2022, factor ``C / (norm + 0.01)``). Each bounds an
            example's whole contribution by ``C``.
        chunk_size: passed to :func:`per_sample_grads` to bound memory.
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
            eagerly, the first call for each batch shape also times that plan
            against plain vmap once and keeps the faster; without ``model``,
            vmap). Ghost covers ``Linear``, ``Embedding``,
            ``Conv1d``/``Conv2d``, ``LayerNorm``, ``GroupNorm`` and ``RNN`` /
            ``GRU`` / ``LSTM`` (unrolled, without ``proj_size``); every other
            parameter, and any covered module it cannot vouch for (called
            twice, inside a nested ``torch.func`` transform, tied or used
            outside its call, behind another forward hook), gets per-example
            gradients from vmap in the same pass, or the whole step falls
            back to vmap; a ``UserWarning`` names the reasons once per step.
            All three clipping modes are supported and the result equals the
            vmap path's.
        target_quantile: ``None`` (fixed clipping) or ``gamma`` in (0, 1):
            adaptive clipping (Andrew et al. 2021). ``state.clip_norm`` starts
            at ``clip_norm`` and after each step moves by
            ``exp(-quantile_learning_rate * (noisy_count / expected_batch_size
            - gamma))``, where ``noisy_count`` is the logical batch's count of
            unclipped examples plus ``count_noise_multiplier`` times a standard
            normal (pass ``count_noise`` to ``step`` / ``apply``). Flat clipping
            only. The pair of releases is accounted as one Gaussian mechanism
            with :func:`dpfunc.accounting.combined_noise_multiplier`.
        quantile_learning_rate: ``eta > 0`` of the geometric update.
        count_noise_multiplier: the standard deviation of the count's noise
            (its sensitivity is 1); required with ``target_quantile``.
        bands: ``1`` (default): DP-SGD, independent noise every step.
            ``b > 1``: correlated noise, the banded square root
            factorization with ``b`` bands (DP-BandMF; Kalinin and Lampert
            2024; see :mod:`dpfunc.matrix_factorization`): step ``t`` adds
            ``noise_multiplier * clip_norm * w_t`` with ``w = C^{-1} z`` for
            the strategy ``C`` normalised to unit column norm, keeping the
            last ``b - 1`` draws in ``state.noise_history`` (``b - 1`` extra
            copies of the parameters). Its privacy needs cyclic Poisson
            sampling (``PoissonBatches(..., bands=b)``) and is accounted with
            ``dpfunc.accounting`` ``bands=b``; ``expected_batch_size`` is then
            ``sample_rate * num_examples / b``. Not with ``target_quantile``.

    Returns:
        A :class:`TrainStep` ``step`` with ``step.init(params) -> state`` and
        ``step(state, batch, mask, noise) -> (state, metrics)``, where
        ``mask[B]`` marks real rows (0 for padding), ``noise`` is
        ``dpfunc.standard_normal_like(params, seed, step)``, and
        ``metrics`` is :func:`summarize` (not private). For a logical batch
        split into micro-batches use ``step.zeros``, ``step.accumulate`` and
        ``step.apply``. ``torch.compile(step, fullgraph=True)`` compiles one
        graph that serves every step of a fixed batch shape.

    Raises:
        ValueError: ``clip_norm <= 0``, ``noise_multiplier < 0``,
            ``expected_batch_size <= 0``, an unknown ``clipping`` or
            ``method``, ``method="ghost"`` without ``model``, or
            ``clip_norm=inf`` with noise; at call time, a batch, mask or
            noise tree that does not match, or a non-scalar loss.
        TypeError: ``optimizer`` is not an (init, update) pair, or ``model``
            is not an ``nn.Module``.
    """
    return TrainStep(
        loss_fn,
        optimizer,
        clip_norm=clip_norm,
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        clipping=clipping,
        chunk_size=chunk_size,
        model=model,
        method=method,
        target_quantile=target_quantile,
        quantile_learning_rate=quantile_learning_rate,
        count_noise_multiplier=count_noise_multiplier,
        bands=bands,
    )
