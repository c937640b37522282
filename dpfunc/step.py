"""One DP-SGD step, composed from the pure pieces.

::

    clip (per micro-batch, dpfunc.clipper)  -> running clipped sum
        -> collectives.reduce (the ranks' sums; the identity on one process)
        -> noise once, average by the expected batch size -> optimizer.update

A :class:`TrainStep` has two doors: ``step(state, batch, mask, noise)`` for
a logical (Poisson) batch held in one micro-batch, and
:meth:`TrainStep.logical_step` for one held in any number of fixed-shape
micro-batches; :meth:`TrainStep.logical_gradient` is the latter without the
optimizer. Each checks its inputs once, clips and sums each micro-batch with
``step.clip`` (:func:`dpfunc.clipper.make_clipper`: vmap or ghost clipping,
which only change how fast), combines the ranks' sums through the injected
:class:`Collectives`, adds the noise exactly once and updates. The local
pieces between the collectives compile with ``torch.compile(fullgraph=True)``
(:meth:`TrainStep.compile`), and on one process ``step(...)`` is pure and
compiles whole.

The mechanisms with state come from the config as ``(init, update)`` pairs
of one protocol, the optimizer's (:class:`dpfunc.optim.GradientTransformation`:
``init(params) -> state``, ``update(input, state, params) -> (output,
state)``): the noise (:meth:`DPConfig.noise_mechanism`: independent, or
banded correlated; the step's draw in, the noise to add out) and the clip
norm (:meth:`DPConfig.clip_mechanism`: fixed, or adaptive; the logical
batch's :class:`~dpfunc.clipping.UnclippedCount` in, the next clip norm
out). Their states live in the :class:`TrainState` beside the parameters,
the optimizer state and the step count, so a step is one pure function of
the state and a checkpoint of it resumes the run.

Rounding. A micro-batch's clipped sum is in the accumulation dtype (float32
for bf16, fp16 and float32 parameters, float64 for float64; see
:func:`dpfunc.clipping.accumulation_dtype`), with clip factors whose margin
(:func:`dpfunc.clipping.clip_margin`) covers the norm's rounding and that
sum's. The running sum of :meth:`TrainStep.logical_step` across micro-batches
and ranks (:mod:`dpfunc.distributed`) is in that dtype too: the margin covers
``FLOAT32_SUMS`` (128) float32 additions of micro-batch sums and ranks' sums
together, a relative 7.6e-6 more (2.7e-5 in all for 256 rows). Past that
public bound (more than ``128 - world_size`` micro-batches on a rank) and for
float64 parameters it is float64, whose additions the margin covers too
(``ACCUMULATED_SUMS``). Every example's contribution to the
sum the noise is added to has norm at most ``clip_norm``, rounding included.
The noise, the average and the rounding to the parameters' accumulation
dtype are one pass per leaf (:func:`dpfunc.noise.noisy_average`), rounded
once after the average: a post-processing of the noisy sum.

Memory. The running sum is the first micro-batch's sum, the others added
into it; the noisy average is written into it (eagerly: the step owns it),
and a rank's own sum is let go once the ranks' sums are combined. The
optimizer's update is pure: old and new parameters and optimizer state
are alive together at its end (``bench/sharded.md``).
"""

from __future__ import annotations

import itertools
import os
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from typing import Any, NamedTuple

import torch
from torch import Tensor

from . import optim
from ._compiling import compile_fullgraph
from .clipper import ExampleStats, make_clipper, summarize
from .clipping import FLOAT32_SUMS, ClipState, UnclippedCount, accumulation_dtype, unclipped_count
from .config import DPConfig, SpeedConfig, settings_from
from .noise import NoiseState, noisy_average_, standard_normal_like
from .per_sample import LossFn, explain_example_error
from .tree import Params, PyTree, check_same_structure, tree_leaves, tree_map

SUM_DTYPE = torch.float64  # a running clipped sum past the float32 bound


class TrainState(NamedTuple):
    """Everything a step reads and replaces: the parameters and each mechanism's state.

    A state derived from another keeps the mechanisms' states with
    ``state._replace(params=..., opt_state=..., step=...)``.
    """

    params: Params  # the model's trainable parameters
    opt_state: Any  # the optimizer's state
    step: Tensor  # shape (), int64: private steps taken so far
    clip_state: ClipState  # config.clip_mechanism()'s: the clip norm of the next step
    # config.noise_mechanism()'s: the banded history (correlated noise), empty for DP-SGD
    noise_state: NoiseState = NoiseState()


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
    # record_noise(noise, step): draw_noise drew ``noise`` for ``step`` (sharded: remembered)
    record_noise: Callable[[Params, int], None] = lambda noise, step: None
    # check_noise(noise, step): raises unless a step may add ``noise`` (sharded: what
    # draw_noise drew for this rank's rows and this step; see dpfunc.sharding.DrawnNoise)
    check_noise: Callable[[Params, Any], None] = lambda noise, step: None


def _identity(value: Any, *_: Any) -> Any:
    return value


LOCAL = Collectives(reduce=_identity, gather=_identity, start=_identity)


class TrainStep:
    """A DP-SGD step; build it with :func:`make_train_step`.

    Two doors, each read top to bottom: check the inputs once, clip and sum
    each micro-batch (:attr:`clip`), combine the ranks' sums, noise once and
    average, update. ``step(state, batch, mask, noise)`` takes a logical
    batch held in one micro-batch; :meth:`logical_step` one held in any
    number, and :meth:`logical_gradient` is it without the optimizer (the
    private gradient :class:`dpfunc.PrivateGradients` writes into ``p.grad``).

    ``config`` (a :class:`~dpfunc.DPConfig` with its noise multiplier
    resolved) holds the privacy settings; ``speed`` (a
    :class:`~dpfunc.SpeedConfig`) only changes how fast (and in how much
    memory) :attr:`clip` computes the same sum (:func:`dpfunc.clipper.make_clipper`).
    ``collectives`` (:class:`Collectives`) combine the ranks' shares of a
    logical batch: :data:`LOCAL` on one process.
    """

    def __init__(
        self,
        loss_fn: LossFn,
        optimizer: optim.GradientTransformation,
        config: DPConfig | None = None,
        *,
        speed: SpeedConfig | None = None,
        collectives: Collectives = LOCAL,
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
        config, speed = settings_from("TrainStep", config, speed, settings)  # or keywords
        _check_speed(speed, collectives)
        self.noise_std = config.noise_std  # fails for a config not yet calibrated
        # clip(params, batch, mask, clip_norm) -> one micro-batch's clipped sum and stats
        self.clip = make_clipper(loss_fn, config, speed)
        self.speed = speed
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.config = config
        self.collectives = collectives
        self.clip_norm = float(config.clip_norm)
        self.noise_multiplier = float(config.noise_multiplier)
        self.expected_batch_size = config.expected_batch_size
        # the mechanisms with state, built once from the config: their states live in the
        # TrainState, and the settings they hold are read-only properties below
        self.noise_mechanism = config.noise_mechanism()
        self.clip_mechanism = config.clip_mechanism()
        # the local pieces between the collectives, which compile() compiles
        self._sum, self._update, self._release = self._micro_sum, self._apply, self._private
        # compile() on one process: a logical batch of one micro-batch as one graph
        self._whole: Callable | None = None
        if speed.compile:
            self.compile()

    # the settings the mechanisms were built with: read-only, since changing one here
    # would not change the mechanism (build another step from another config)
    target_quantile = property(lambda self: self.config.target_quantile)
    quantile_learning_rate = property(lambda self: float(self.config.quantile_learning_rate))
    count_noise_multiplier = property(lambda self: self.config.count_noise_multiplier)
    bands = property(lambda self: self.config.bands)
    # the strategy C with unit column norm: noise_multiplier is the accountant's
    coefficients = property(lambda self: self.config.coefficients)

    @property
    def adaptive(self) -> bool:
        """Adaptive clipping is on: the clip norm moves, in ``TrainState.clip_state``."""
        return self.target_quantile is not None

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
        self.clip.chunk_for(params, 1)  # warns of a chunk_size over memory_budget before any step
        step = torch.zeros((), dtype=torch.int64)
        return TrainState(
            params,
            self.optimizer.init(params),
            step,
            self.clip_mechanism.init(params),
            self.noise_mechanism.init(params),
        )

    def __call__(
        self,
        state: TrainState,
        batch: PyTree,
        mask: Tensor | None,
        noise: Params,
        count_noise: Tensor | None = None,
    ) -> tuple[TrainState, dict[str, Tensor]]:
        """One private step on a logical batch held in one micro-batch (each rank's share).

        Args:
            state: the state before the step.
            batch: the micro-batch, each leaf ``[B, ...]``.
            mask: ``[B]``, 1 for a real example, 0 for padding (``None``: all real).
            noise: ``dpfunc.standard_normal_like(params, seed, step)`` (sharded:
                :meth:`draw_noise`).
            count_noise: adaptive clipping only: a standard normal 0-d float64
                tensor (:meth:`draw_noise`'s ``count``).

        Returns:
            The new state and :func:`~dpfunc.clipper.summarize` of the whole
            logical batch's stats (NOT private).

        The same as :meth:`logical_step` on ``[(batch, mask)]``.
        Distributed, the metrics and adaptive clipping's count cover the
        whole logical batch (all ranks' stats). Pure on one process;
        ``torch.compile(step, fullgraph=True)`` compiles it, and after
        :meth:`compile` it runs one compiled graph on one process (the
        compiled pieces, distributed).
        """
        self._check(state, noise, count_noise)
        if self._whole is not None:
            state, stats = self._one_graph(state, batch, mask, noise, count_noise)
            return state, summarize(stats)
        summed, stats, count = self._clipped_sum(state, [(batch, mask)], None, count_noise)
        reduced = self.collectives.reduce(summed, state.step)
        del summed  # distributed: this rank's own sum, not held through the update
        return self._update(state, reduced, noise, count), summarize(stats)

    def logical_step(
        self,
        state: TrainState,
        micro_batches: Iterable[tuple[PyTree, Tensor]],
        noise: StepNoise,
        *,
        before_release: Callable[[ExampleStats], None] | None = None,
    ) -> tuple[TrainState, ExampleStats]:
        """One private step on a logical batch held in any number of micro-batches.

        Args:
            state: the state before the step (identical on every rank).
            micro_batches: ``(batch, mask)`` pairs, this rank's share
                (``PoissonBatches.logical_batch(t)[0]``).
            noise: :meth:`draw_noise` for this step (the same on every rank).
            before_release: called with the whole logical batch's stats
                after the sums and before anything is released; raising
                there releases nothing (the Trainer checks non-finite
                examples and records the step with the accountant there).

        Returns:
            The new state and the whole logical batch's per-example stats
            (:func:`~dpfunc.clipper.summarize` them; NOT private).

        Privacy: an empty logical batch is a step too: its sum is zero and
        its noise is added. The noise is added once, after the ranks' sums
        are combined; adaptive clipping's count is of the whole logical batch.

        Rounding: the running sum is float32 for float32 and half parameters
        for the first ``FLOAT32_SUMS - world_size`` micro-batches (the count
        the clip margin covers), float64 after them and for float64 parameters.

        Raises:
            TypeError, ValueError: the data does not fit the model (as
                :attr:`clip`, compiled steps too), before ``before_release``:
                nothing is accounted or released.

        Under a caller's ``torch.inference_mode()`` the step runs with it off
        (it needs autograd), so its outputs are ordinary tensors.
        """
        self._check(state, noise.params, noise.count)
        with _outside_inference_mode():
            if self._whole is not None:
                micro_batches, alone = _only(micro_batches)
                if alone is not None:  # one graph; nothing is returned before before_release
                    new_state, stats = self._one_graph(state, *alone, noise.params, noise.count)
                    if before_release is not None:
                        before_release(stats)
                    return new_state, stats
            summed, stats, count = self._clipped_sum(
                state, micro_batches, before_release, noise.count
            )
            reduced = self.collectives.reduce(summed, state.step)
            del summed  # distributed: this rank's own sum, not held through the update
            return self._update(state, reduced, noise.params, count), stats

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
        :meth:`logical_step`; returns ``(private, state, stats)``: ``private``
        is ``(summed + noise_std * w) / expected_batch_size`` in each
        parameter's accumulation dtype, ``state`` has the step counted and the
        mechanisms' states moved (``params`` and ``opt_state`` as they were).
        :class:`dpfunc.PrivateGradients` writes ``private`` into ``p.grad``.
        """
        self._check(state, noise.params, noise.count)
        with _outside_inference_mode():
            summed, stats, count = self._clipped_sum(
                state, micro_batches, before_release, noise.count
            )
            reduced = self.collectives.reduce(summed, state.step)
            del summed  # distributed: this rank's own sum, not held through the noise
            private, clip_state, noise_state = self._release(state, reduced, noise.params, count)
        state = state._replace(step=state.step + 1, clip_state=clip_state, noise_state=noise_state)
        return private, state, stats

    def compile(self) -> TrainStep:
        """Compiles the local pieces of both doors; returns ``self``.

        ``step(...)``, :meth:`logical_step` and :meth:`logical_gradient` then
        run each micro-batch's sum and the noise, average and update through
        ``torch.compile(fullgraph=True)``, with Dynamo's RNN support on and
        logging calls in traced code left out, in a scope that ends with each
        call (:func:`dpfunc._compiling.compile_fullgraph`); the collectives
        between them run eagerly. On one process a logical batch held in one
        micro-batch (``step(...)``, and :meth:`logical_step` on one) is one
        graph instead, sum to update, as ``torch.compile(step,
        fullgraph=True)`` traces it; :meth:`logical_step` calls
        ``before_release`` after that graph and before it returns anything,
        so raising there still releases nothing. The results are the same as
        eager ones.
        """
        self._sum = compile_fullgraph(self._micro_sum)
        self._update = compile_fullgraph(self._apply)
        self._release = compile_fullgraph(self._private)
        if not self.collectives.distributed:
            self._whole = compile_fullgraph(self._local_step)
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
        return self.clip.explain(params, batch)

    def draw_noise(
        self, params: Params, *, seed: int, step: int, secure: bool | None = None
    ) -> StepNoise:
        """Step ``step``'s standard-normal draws: the tree and, if adaptive, the count's.

        A function of ``(seed, step)`` and the parameters' shapes only, never
        of the data, so it may be drawn ahead (the Trainer does, on a worker
        thread). The count's comes from its own stream (``stream="count"``).
        ``secure=None`` follows ``config.secure_noise``. Sharded, it draws
        this rank's rows of the tree, and the step takes no other noise.
        """
        secure = self.config.secure_noise if secure is None else secure
        rows = self.collectives.noise_rows(params)  # sharded: this rank's rows of the tree
        noise = standard_normal_like(params, seed=seed, step=step, secure=secure, rows=rows)
        self.collectives.record_noise(noise, step)
        if not self.adaptive:
            return StepNoise(noise, None)
        zero = {"count": torch.zeros((), dtype=torch.float64)}
        count = standard_normal_like(zero, seed=seed, step=step, secure=secure, stream="count")
        return StepNoise(noise, count["count"])

    def full_params(self, state: TrainState) -> Params:
        """The whole parameters of ``state``: ``state.params``, or every rank's rows gathered.

        Sharded (``shard=True``), ``state.params`` holds this rank's rows of
        each parameter and this is collective: call it on every rank.
        """
        return self.collectives.unshard(state.params, state.step)

    def _check(self, state: TrainState, noise: Params, count_noise: Tensor | None) -> None:
        """Checks a door's inputs once, before any collective (so all ranks raise alike)."""
        check_state(state)
        check_same_structure(noise, state.params, "noise", "params")
        if self.adaptive and count_noise is None:
            raise ValueError(
                "adaptive clipping releases the unclipped count with its own noise: pass "
                "count_noise, a standard normal 0-d float64 tensor (step.draw_noise(...).count)"
            )
        self.collectives.check_noise(noise, state.step)  # sharded: drawn for these rows

    def _one_graph(
        self, state: TrainState, batch: PyTree, mask: Tensor | None, noise: Params, count_noise
    ) -> tuple[TrainState, ExampleStats]:
        """:meth:`_local_step`, compiled (:meth:`compile`), its failures explained."""
        if torch.compiler.is_compiling():
            return self._local_step(state, batch, mask, noise, count_noise)
        try:
            return self._whole(state, batch, mask, noise, count_noise)
        except Exception as error:  # explained as the pieces' are
            raise explain_example_error(self.loss_fn, state.params, batch, mask, error)  # noqa: B904

    def _local_step(
        self, state: TrainState, batch: PyTree, mask: Tensor | None, noise: Params, count_noise
    ) -> tuple[TrainState, ExampleStats]:
        """A one-process step on one micro-batch, from the uncompiled pieces: its new state
        and stats (what :meth:`compile` compiles as one graph)."""
        summed, stats, count = self._clipped_sum(
            state, [(batch, mask)], None, count_noise, add=self._micro_sum
        )
        return self._apply(state, summed, noise, count), stats

    def _clipped_sum(
        self,
        state: TrainState,
        micro_batches: Iterable[tuple[PyTree, Tensor]],
        before_release: Callable[[ExampleStats], None] | None,
        count_noise: Tensor | None,
        add: Callable[..., tuple[Params, ExampleStats]] | None = None,
    ) -> tuple[Params, ExampleStats, UnclippedCount | None]:
        """This rank's clipped sum, all ranks' stats, and adaptive clipping's count.

        The count is what the clip mechanism's ``update`` reads: the whole
        logical batch's :func:`~dpfunc.clipping.unclipped_count` with its
        standard-normal draw ``count_noise``; ``None`` with a fixed clip norm.

        The running sum is float32 for float32 and half parameters for the
        first ``FLOAT32_SUMS`` less the ranks (public) micro-batch sums; a
        longer logical batch adds the rest in float64 and rounds the total
        once, back to float32, so every rank hands the reduction the same
        dtype. With ``FLOAT32_SUMS`` ranks or more it is float64 throughout.
        ``add(params, batch, mask, *clip_norm)`` forms a micro-batch's sum
        (default :meth:`_add`).
        """
        add = self._add if add is None else add
        float32 = self._float32_micro_batches()
        clip_norm = (state.clip_state.clip_norm,) if self.adaptive else ()  # the one it follows
        params = self.full_params(state)  # sharded: gathered once for all micro-batches
        summed, stats = None, []
        for i, (batch, mask) in enumerate(micro_batches):
            micro, part = add(params, batch, mask, *clip_norm)
            stats.append(part)
            if summed is None:  # the first sum starts the running one (no zeros to add it to)
                summed = micro if i < float32 else tree_map(lambda m: m.to(SUM_DTYPE), micro)
                continue
            if i == float32:  # past the float32 sums the margin covers: the rest in float64
                summed = tree_map(lambda s: s.to(SUM_DTYPE), summed)
            summed = _add_into(summed, micro)
            del micro  # freed before the next micro-batch's sum is formed
        if summed is None:  # an empty logical batch: its sum is zero (and its noise is added)
            summed = _zeros(params, wide=float32 < 1)
        if float32 > 0:  # rounded once if it went on in float64 (the margin counts it)
            summed = tree_map(lambda s, p: s.to(accumulation_dtype(p.dtype)), summed, params)
        stats = ExampleStats.cat(stats) if stats else ExampleStats.empty(state.params)
        stats = self.collectives.gather(stats, state.step)  # this rank's share -> the whole
        if before_release is not None:
            before_release(stats)
        if not self.adaptive:
            return summed, stats, None
        # the whole logical batch's count, noised once (by the clip mechanism) from its own stream
        count = unclipped_count(stats.norm, state.clip_state.clip_norm, stats.mask)
        return summed, stats, UnclippedCount(count, count_noise)

    def _add(
        self, params: Params, batch: PyTree, mask: Tensor, *clip_norm: Tensor
    ) -> tuple[Params, ExampleStats]:
        """:meth:`_micro_sum` (compiled after :meth:`compile`), its failures explained."""
        if torch.compiler.is_compiling():
            return self._sum(params, batch, mask, *clip_norm)
        try:
            return self._sum(params, batch, mask, *clip_norm)
        except Exception as error:  # compiled: explained here (eagerly: in clip)
            raise explain_example_error(self.loss_fn, params, batch, mask, error)  # noqa: B904

    def _float32_micro_batches(self) -> int:
        """The micro-batch sums a float32 running sum may add on this rank: FLOAT32_SUMS less
        the ranks, whose reduction adds theirs in the same dtype (public: the world size)."""
        distributed = self.collectives.distributed and torch.distributed.is_initialized()
        return FLOAT32_SUMS - (torch.distributed.get_world_size() if distributed else 1)

    def _micro_sum(
        self,
        params: Params,
        batch: PyTree,
        mask: Tensor | None,
        clip_norm: Tensor | None = None,
    ) -> tuple[Params, ExampleStats]:
        """One micro-batch's clipped sum (padding rows left out, eagerly) and its stats."""
        return self.clip(params, batch, mask, clip_norm, skip_padding=True)

    def _apply(
        self, state: TrainState, summed: Params, noise: Params, count: UnclippedCount | None = None
    ) -> TrainState:
        """:meth:`_private`, then the optimizer's update: the local rest of a step.

        The noise mechanism, the optimizer and the clip mechanism are one
        protocol, called alike: ``output, own_state = m.update(input, own_state, params)``.
        """
        private, clip_state, noise_state = self._private(state, summed, noise, count)
        updates, opt_state = self.optimizer.update(private, state.opt_state, state.params)
        params = optim.apply_updates(state.params, updates)
        return TrainState(params, opt_state, state.step + 1, clip_state, noise_state)

    def _private(
        self, state: TrainState, summed: Params, noise: Params, count: UnclippedCount | None = None
    ) -> tuple[Params, ClipState, NoiseState]:
        """The logical batch's clipped sum (over all ranks), noised once and averaged.

        ``(summed + noise_std * w) / expected_batch_size`` leaf by leaf, with
        ``w`` what the noise mechanism makes of ``noise`` and
        ``state.noise_state`` (``noise`` itself for DP-SGD; the banded
        correlated draw with ``bands > 1``), and the mechanisms' next states
        (adaptive clipping releases ``count.count`` with noise
        ``count_noise_multiplier * count.noise``). Nothing here reads the data
        beyond ``summed`` and ``count``. Noise, average and the cast to each
        parameter's accumulation dtype are one fused pass per leaf
        (:func:`dpfunc.noise.noisy_average_`, written into ``summed``, the
        step's own sum): every rounding comes after the
        noise, a post-processing.
        """
        # adaptive clipping: this step's noise follows the clip norm it clipped at
        std = (
            self.noise_multiplier * state.clip_state.clip_norm if self.adaptive else self.noise_std
        )
        w, noise_state = self.noise_mechanism.update(noise, state.noise_state, state.params)
        private = noisy_average_(summed, w, std, self.expected_batch_size, state.params)
        _, clip_state = self.clip_mechanism.update(count, state.clip_state, state.params)
        return private, clip_state, noise_state


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


def _new_noise_worker() -> None:
    """A forked child has none of its parent's threads, so a pool the parent used would
    queue the child's draws for a thread that is not there: the child gets a new one."""
    NoiseAhead._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dpfunc-noise")


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_noise_worker)


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


def _only(items: Iterable[Any]) -> tuple[Iterable[Any], Any]:
    """``(items, its one element)`` if ``items`` holds exactly one, else ``(items, None)``;
    the items returned are all of them, whether or not they were read to tell."""
    if isinstance(items, list | tuple):
        return items, (items[0] if len(items) == 1 else None)
    iterator = iter(items)
    head = list(itertools.islice(iterator, 2))
    return itertools.chain(head, iterator), (head[0] if len(head) == 1 else None)


def _add_into(summed: Params, micro: Params) -> Params:
    """``summed + micro`` written into ``summed``, the step's own running sum (its first
    micro-batch's sum, or a widened copy): no second copy of the sum is held."""
    for s, m in zip(tree_leaves(summed), tree_leaves(micro)):
        s.add_(m)
    return summed


def _zeros(params: Params, *, wide: bool) -> Params:
    """An empty clipped sum: float64 if ``wide``, else in each parameter's accumulation dtype."""
    return tree_map(
        lambda p: torch.zeros_like(p, dtype=SUM_DTYPE if wide else accumulation_dtype(p.dtype)),
        params,
    )


def make_train_step(
    loss_fn: LossFn,
    optimizer: optim.GradientTransformation,
    config: DPConfig | None = None,
    *,
    speed: SpeedConfig | None = None,
    **settings: Any,
) -> TrainStep:
    """Builds the DP-SGD step (Abadi et al. 2016).

    Args:
        loss_fn: ``loss_fn(params, example) -> scalar`` for ONE example (or a
            :func:`dpfunc.batched_loss`).
        optimizer: a :mod:`dpfunc.optim` transformation, e.g. ``optim.adam(1e-3)``.
        config: the privacy settings, a :class:`~dpfunc.DPConfig` with a
            ``noise_multiplier`` (``config.calibrated(num_examples)`` resolves a
            ``target_epsilon``): clip norm, noise, expected batch size, clipping
            mode, adaptive clipping, correlated noise.
        speed: how fast the same sum is computed, a :class:`~dpfunc.SpeedConfig`:
            ``model`` (the ``nn.Module`` that ``loss_fn`` calls through
            ``torch.func.functional_call``; enables ghost clipping), ``method``
            (``"auto"``, the default: ghost clipping for the layers where it is
            cheaper, vmap for the rest; ``"vmap"``; ``"ghost"``, Li et al. 2022,
            Bu et al. 2023), ``chunk_size``, ``memory_budget``, ``compile``. All
            give the same sum; docs/performance.md says how ``"auto"``
            chooses, and :meth:`TrainStep.explain` shows its plan.
        **settings: the keyword form: ``DPConfig``'s and ``SpeedConfig``'s
            fields (``clip_norm=1.0, noise_multiplier=1.1,
            expected_batch_size=256, model=model``) instead of ``config`` and ``speed``.

    Returns:
        A :class:`TrainStep`: ``state = step.init(params)``, then
        ``step(state, batch, mask, noise) -> (state, metrics)`` for a logical
        batch in one micro-batch (``mask[B]``: 0 for padding rows; ``noise``:
        ``dpfunc.standard_normal_like(params, seed, step)``; ``metrics``:
        :func:`~dpfunc.clipper.summarize`, not private) or
        :meth:`TrainStep.logical_step` for one in many.
        ``torch.compile(step, fullgraph=True)`` compiles one graph for every
        step of a fixed batch shape.

    Privacy: each example's contribution to the clipped sum has norm at most
    ``clip_norm``, rounding included; the noise ``noise_multiplier *
    clip_norm`` is added once per logical batch, and the average divides by
    ``expected_batch_size``, never the realised batch size.

    >>> import dpfunc, torch
    >>> step = dpfunc.make_train_step(lambda p, x: (p["w"] * x).sum(), dpfunc.optim.sgd(lr=1.0),
    ...     clip_norm=1.0, noise_multiplier=0.0, expected_batch_size=2)
    >>> state = step.init({"w": torch.zeros(2)})
    >>> state, _ = step(state, torch.tensor([[3.0, 4.0], [0.0, 0.5]]), None, {"w": torch.zeros(2)})
    >>> [round(v, 3) for v in state.params["w"].tolist()]  # -(0.6 + 0, 0.8 + 0.5) / 2
    [-0.3, -0.65]

    Raises:
        ValueError: an invalid privacy or speed setting (see :class:`DPConfig`
            and :class:`SpeedConfig`), a config not yet calibrated,
            ``physical_batch_size`` (a sampler's setting: a step takes
            micro-batches as given) or ``shard=True`` (use
            :func:`dpfunc.distributed.make_train_step`).
        TypeError: ``optimizer`` is not an (init, update) pair, both a config
            (or speed) and its keywords, or an unknown keyword.
    """
    config, speed = settings_from("make_train_step", config, speed, settings)
    if speed.physical_batch_size is not None:
        raise ValueError(
            "make_train_step takes micro-batches as given: physical_batch_size sets the "
            "micro-batches of the Trainer's and PrivateGradients' sampler (or of "
            f"config.sampler(dataset, physical_batch_size, ...)); got "
            f"physical_batch_size={speed.physical_batch_size!r}"
        )
    return TrainStep(loss_fn, optimizer, config, speed=speed)


def _check_speed(speed: SpeedConfig, collectives: Collectives) -> None:
    """Raises ``ValueError`` for a ``shard`` the step's collectives do not carry out."""
    if speed.shard != collectives.sharded:
        raise ValueError(
            f"shard={speed.shard!r} but the step's collectives are "
            f"{'sharded' if collectives.sharded else 'not sharded'}: a sharded step comes from "
            "dpfunc.distributed.make_train_step(..., shard=True) in a distributed run"
        )
