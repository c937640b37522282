"""Private gradients for your own training loop: ``torch.optim`` on DP-SGD's noisy average.

:class:`PrivateGradients` is DP-SGD without the optimizer. It samples the
logical batches (Poisson, secretly keyed), and its :meth:`~PrivateGradients.backward`
writes into every trainable parameter's ``.grad`` the private gradient of
the batch, ``(clipped sum + noise) / expected_batch_size``; any
``torch.optim`` optimizer and learning-rate scheduler then take the step. The
optimizer only ever sees the private gradient, so it costs no privacy (a
post-processing). It is the Trainer's step without its last box: the same
sampler, clipping (vmap or ghost), noise, micro-batch accumulation,
collectives and accountant (:meth:`dpfunc.TrainStep.logical_gradient`), so
with ``torch.optim.SGD`` it gives the Trainer's update for the same seed::

    private = dpfunc.PrivateGradients(model, loss_fn, dataset, expected_batch_size=256,
                                      clip_norm=1.0, target_epsilon=3.0, delta=1e-5, epochs=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=private.total_steps)
    for batch in private.batches():      # Poisson-sampled logical batches
        private.backward(batch)          # every trainable p.grad = private gradient
        optimizer.step(); scheduler.step(); optimizer.zero_grad()
    print(private.epsilon(1e-5))

The model is read live. Every :meth:`~PrivateGradients.backward` reads the
model's current trainable parameters, so a model moved or converted after
``PrivateGradients`` was built (``model.to(device)``, ``model.double()``) is
followed: the gradient is computed from, and written to, the parameters as
they are then. What cannot be followed is refused with a message that says
what changed: a parameter that is no longer the same tensor object (a
module replaced, a conversion that swaps parameters), or a change in which
parameters are trainable or in their shapes (a PEFT wrap injects adapters
and freezes the rest). An optimizer built on the old parameters would then
train tensors the gradient is never written to. Build ``PrivateGradients``
(and the optimizer) after such changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from . import checkpoint as _checkpoint
from . import optim
from .checks import check_choice, check_int
from .config import DPConfig, config_from
from .data import MicroBatch
from .distributed import broadcast_from_rank0
from .functional import functionalize
from .per_sample import LossFn
from .plan import PlannedRun, RunPlan
from .sharding import fsdp_hooks_off, reshard, shard_module
from .step import NONFINITE, NoiseAhead, StepNoise, TrainState
from .tree import Params, tree_map

__all__ = ["LogicalBatch", "PrivateGradients"]

# the parts of the train state that PrivateGradients keeps (the model and the
# optimizer hold the rest): what its state_dict stores
_PARTS = ("step", "clip_state", "noise_state")


class LogicalBatch(NamedTuple):
    """One Poisson-sampled logical batch, as :meth:`PrivateGradients.batches` yields it.

    Its examples are secret: only :meth:`PrivateGradients.backward` may
    turn them into a release.
    """

    step: int  # the step it belongs to (0-based); keys its noise
    micro_batches: list[MicroBatch]  # this rank's (batch, mask) pairs, fixed shape
    size: int  # this rank's real examples (the rest is padding); NOT private

    def __repr__(self) -> str:  # the examples are data: never in a repr or a log
        return f"LogicalBatch(step={self.step}, micro_batches={len(self.micro_batches)})"


class PrivateGradients(PlannedRun):
    """DP-SGD's private gradients for any ``torch.optim`` optimizer (see the module docstring).

    Args:
        model: the ``nn.Module`` being trained; its parameters with
            ``requires_grad=True`` are the trainable ones (read live at every
            :meth:`backward`). Distributed, every rank's model is set to rank
            0's here: its parameters, frozen ones too, and its buffers.
        loss_fn: ``loss_fn(params, example) -> scalar`` for ONE example,
            calling the model through ``torch.func.functional_call(model,
            params, ...)``; pass ``params`` alone (the model's buffers and
            frozen parameters are then read from the model, live).
        dataset: any form :func:`dpfunc.data.as_dataset` accepts.
        config: the privacy settings, a :class:`dpfunc.DPConfig`, resolved
            for this dataset (``target_epsilon`` needs ``epochs``); or their
            keyword form (``expected_batch_size=256, clip_norm=1.0,
            target_epsilon=3.0, delta=1e-5, epochs=3``). Without ``epochs``
            (a ``noise_multiplier`` given), the run has no planned end:
            :meth:`batches` yields until its caller stops or
            ``epsilon_budget`` would be exceeded.
        physical_batch_size, seed, method, chunk_size, compile, distributed,
        nonfinite, memory_budget: as for :class:`dpfunc.Trainer` (``seed=None``, the
        default, draws a secret; ``method="auto"`` uses ghost clipping where
        it is cheaper).
        shard: ``True`` (distributed runs only) shards the model with FSDP2's
            ``fully_shard`` unless it is already (:func:`dpfunc.sharding.shard_module`):
            every trainable parameter becomes a ``DTensor`` of this rank's
            rows (of rank 0's parameters, unless the model came sharded), so
            the optimizer built on ``model.parameters()`` AFTER this keeps
            1/world of its state, and :meth:`backward` writes
            each rank's rows of the private gradient, equal to the single
            process's (:mod:`dpfunc.sharding`). Save the model and the
            optimizer with ``torch.distributed.checkpoint``.

    Raises:
        ValueError, TypeError: an argument is invalid; all are checked here.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        dataset: Any,
        *,
        config: DPConfig | None = None,
        physical_batch_size: int | None = None,
        seed: int | None = None,
        method: str = "auto",
        chunk_size: int | None = None,
        compile: bool = False,
        distributed: bool | None = None,
        nonfinite: str = "warn",
        memory_budget: int | None = None,
        shard: bool = False,
        **settings: Any,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        config = config_from("PrivateGradients", config, settings)
        check_choice("nonfinite", nonfinite, NONFINITE)
        functionalize(model)  # refuses BatchNorm; lets vmap see recurrent layers' hidden state
        self.model = model
        if not _trainable(model):
            raise ValueError("model has no parameter with requires_grad=True: nothing to train")
        self.plan = plan = RunPlan(
            "PrivateGradients",
            config,
            dataset,
            physical_batch_size=physical_batch_size,
            seed=seed,
            distributed=distributed,
            require_epochs=False,
        )
        self.config = plan.config
        self.step_fn = plan.make_step(  # the optimizer is the user's: an identity stands in
            loss_fn, optim.chain(), model=model, method=method, chunk_size=chunk_size,
            memory_budget=memory_budget, shard=shard,
        )  # fmt: skip
        if plan.distributed:  # rank 0's model everywhere (then fully_shard keeps rows of it)
            _copy_rank0_model(model)
        if shard:
            shard_module(model)
        self._trainable = _trainable(model)  # what backward may write to, checked each time
        if compile:
            self.step_fn.compile()
        self.nonfinite = nonfinite
        self._warned_nonfinite = False
        whole = (
            {name: p.full_tensor().detach() for name, p in self._trainable}
            if shard
            else self._live_params()
        )
        self.state: TrainState = self.step_fn.init(whole)  # distributed: rank 0's (rows)
        if plan.distributed:  # every rank's model starts from rank 0's parameters
            with torch.no_grad():
                for name, p in self._trainable:
                    _local(p).copy_(self.state.params[name])
        self.accountant = plan.config.accountant()
        self.history: list[dict[str, float]] = []  # for checkpoints; PrivateGradients keeps none
        self._noise = NoiseAhead(self.step_fn)
        self._issued: list[MicroBatch] | None = None  # the batch batches() yielded last

    def batches(self, steps: int | None = None) -> Iterator[LogicalBatch]:
        """Yields the next logical batches, from step :attr:`steps_done` on.

        Each is step ``t``'s Poisson sample (a function of the secret seed
        and ``t`` only), as this rank's fixed-shape micro-batches; pass it
        to :meth:`backward` before taking the next. The iterator stops after
        ``steps`` batches, or at the end of the plan (``epochs``) or of the
        ``epsilon_budget``, whichever comes first; ``steps=None`` runs to the
        end (``private.batches(private.steps_per_epoch)`` is one epoch).

        Raises:
            ValueError: ``steps`` is not an int >= 0.
            RuntimeError: (while iterating) the previous batch was not passed
                to :meth:`backward`.
        """
        if steps is not None:
            check_int("steps", steps, minimum=0)
        start = self.steps_done
        stop = self.plan.last_step()
        if steps is not None:
            stop = start + steps if stop is None else min(stop, start + steps)
        t = start
        while stop is None or t < stop:
            if self.steps_done != t:
                raise RuntimeError(
                    f"batches() yielded the batch of step {t}, but {self.steps_done} steps are "
                    "done: call backward(batch) on each batch before taking the next"
                )
            micro_batches, size = self.plan.batches.logical_batch(t)
            self._issued = micro_batches  # backward takes this batch, and no other
            yield LogicalBatch(t, micro_batches, size)
            t += 1

    def backward(self, batch: LogicalBatch) -> dict[str, float]:
        """Writes the private gradient of ``batch`` into every trainable parameter's ``.grad``.

        ``p.grad = (clipped sum + noise) / expected_batch_size`` for each
        parameter with ``requires_grad=True`` (tied parameters once), in the
        parameter's dtype and on its device. Gradients already present are
        OVERWRITTEN, not added to; frozen parameters are not touched. The
        step is accounted before anything is written, empty batches too.
        Runs under the caller's autocast, if any. Distributed: collective,
        and every rank gets the same gradient.

        Returns the step's metrics as floats (:func:`dpfunc.summarize`:
        loss, batch size, clipped fraction, non-finite examples, norm
        quantiles). They read the data without noise: NOT private.

        Raises:
            TypeError: ``batch`` is not a :class:`LogicalBatch`.
            ValueError: ``batch`` is not the one :meth:`batches` yielded for
                the next step (a batch released twice would release its
                noise twice; a batch of one's own is not a Poisson sample), or the model's
                trainable parameters changed (see the module docstring).
            RuntimeError: the plan or the ``epsilon_budget`` is used up.
            FloatingPointError: non-finite examples (``nonfinite``); nothing
                is written then.
        """
        if not isinstance(batch, LogicalBatch):
            raise TypeError(
                "backward takes a batch from PrivateGradients.batches(), got "
                f"{type(batch).__name__}"
            )
        t = self.steps_done
        if batch.step != t:
            raise ValueError(
                f"batch is step {batch.step}'s, but the next step is {t}: each logical batch is "
                "released once, in order (take batches from batches())"
            )
        if batch.micro_batches is not self._issued:
            raise ValueError(
                f"batch is not the one batches() yielded for step {t}: only the Poisson sample "
                "of the step, keyed by the secret seed, is accounted as such"
            )
        self.plan.check_next_step(t)
        params = self._live_params()
        state = self._state_for(params)
        noise = self._draw_noise(params, t)
        metrics: dict[str, float] = {}
        with fsdp_hooks_off(self.model) if self.step_fn.sharded else nullcontext():
            private, state, _ = self.step_fn.logical_gradient(
                state, batch.micro_batches, noise, before_release=self._before_release(t, metrics)
            )
        for name, p in self._trainable:
            p.grad = _like(p, private[name].to(p.dtype))
        self.state = state._replace(params=params)
        return metrics

    def full_params(self) -> Params:
        """The model's whole trainable parameters now (detached; sharded: gathered, collective)."""
        return self.step_fn.full_params(self.state._replace(params=self._live_params()))

    def state_dict(self) -> dict[str, Any]:
        """What an exact resume needs besides the model's and the optimizer's own state dicts.

        The step count, the clip and noise mechanisms' states, the
        accountant, the settings, and the SECRET seed: **a state dict is as
        sensitive as the training data** (with the seed, anyone can remove
        the noise from every gradient it wrote). Save it with
        ``torch.save`` next to ``model.state_dict()`` and
        ``optimizer.state_dict()``, where the data is kept.
        """
        saved = _checkpoint.state_dict(self, _PARTS)
        if self.step_fn.sharded and self.bands > 1:  # the noise history holds this rank's rows
            saved["rows_of"] = [self.rank, self.world_size]
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` of an identically set-up run; the next step continues it.

        Load the model's and the optimizer's state dicts too: the three
        together resume bit-identically. A ``PrivateGradients`` built with
        ``seed=None`` adopts the saved run's drawn secret; a fixed seed must
        match (as :func:`dpfunc.checkpoint.load`).

        Raises:
            ValueError: of another run's settings (each difference named),
                seed or version, or malformed; nothing changes then.
        """
        mine = [self.rank, self.world_size] if self.step_fn.sharded and self.bands > 1 else None
        if isinstance(state_dict, dict) and state_dict.get("rows_of") != mine:
            raise ValueError(
                "state_dict holds the noise history rows of (rank, world size) "
                f"{state_dict.get('rows_of')}, not this one's {mine}: a sharded run with "
                "bands > 1 saves each rank's rows; load each rank's own state_dict on the same "
                "number of ranks"
            )
        self.restore(*_checkpoint.from_state_dict(self, state_dict, "state_dict", _PARTS))

    def _live_params(self) -> Params:
        """The model's trainable parameters now, detached (no copy), after checking them."""
        if self.step_fn.sharded:  # after the model's own forward, FSDP2 may hold it gathered
            reshard(self.model)
        now = _trainable(self.model)
        before = {name: p for name, p in self._trainable}
        current = {name: p for name, p in now}
        if before.keys() != current.keys():
            added = sorted(current.keys() - before.keys())
            gone = sorted(before.keys() - current.keys())
            raise ValueError(
                "the model's trainable parameters changed since PrivateGradients was built "
                f"(now trainable: {added[:5]}{'...' if len(added) > 5 else ''}; no longer: "
                f"{gone[:5]}{'...' if len(gone) > 5 else ''}), as a PEFT wrap or a change of "
                "requires_grad does; build PrivateGradients and the optimizer again"
            )
        for name, p in now:
            if p is not before[name]:
                raise ValueError(
                    f"the model's parameter {name!r} is another tensor than when "
                    "PrivateGradients was built (a module replaced, or a conversion that swaps "
                    "parameters); an optimizer built on the old one would never see its "
                    "gradient. Build PrivateGradients and the optimizer again"
                )
        return {name: _local(p).detach() for name, p in now}

    def _state_for(self, params: Params) -> TrainState:
        """The train state on the parameters' devices and dtypes (the model may have moved)."""
        state = self.state._replace(params=params)
        history = state.noise_state.history
        if history:
            moved = tree_map(lambda h, p: h.to(p.device, p.dtype), history, params)
            state = state._replace(noise_state=state.noise_state._replace(history=moved))
        return state

    def _draw_noise(self, params: Params, t: int) -> StepNoise:
        limit = self.plan.last_step()
        ahead = limit is None or t + 1 < limit
        noise = self._noise.draw(params, self.seed, t, ahead=ahead)
        if any(
            z.dtype != _noise_dtype(p, self.config.secure_noise) or z.device != p.device
            for z, p in zip(noise.params.values(), params.values(), strict=True)
        ):  # drawn ahead for parameters since moved or converted: draw again, as they are
            noise = self.step_fn.draw_noise(params, seed=self.seed, step=t)
        return noise

    def __repr__(self) -> str:  # the seed is a secret: never in a repr or a log
        return (
            f"PrivateGradients(steps_done={self.steps_done}, total_steps={self.total_steps}, "
            f"noise_multiplier={self.noise_multiplier:.6g}, clip_norm={self.clip_norm:.6g}, "
            f"expected_batch_size={self.expected_batch_size:g})"
        )


def _copy_rank0_model(model: nn.Module) -> None:
    """Sets every rank's parameters, frozen ones too, and buffers to rank 0's (collective).

    As DDP does when it wraps a model: a frozen part or a buffer that
    differed between ranks would make each rank compute with another model,
    without a word. A model already sharded by the caller is what its rows
    make up: its parameters are left as they are, its buffers synced.
    """
    from torch.distributed.tensor import DTensor

    tensors = {f"buffer:{name}": b for name, b in model.named_buffers()}
    parameters = dict(model.named_parameters())
    if not any(isinstance(p, DTensor) for p in parameters.values()):
        tensors.update({f"parameter:{name}": p for name, p in parameters.items()})
    whole = broadcast_from_rank0({key: t.detach() for key, t in tensors.items()})
    with torch.no_grad():
        for key, t in tensors.items():
            t.copy_(whole[key])


def _noise_dtype(p: Tensor, secure: bool) -> torch.dtype:
    """The dtype of ``p``'s noise: float64 when secure, else ``p``'s, at least float32."""
    return torch.float64 if secure else torch.promote_types(p.dtype, torch.float32)


def _local(p: Tensor) -> Tensor:
    """A parameter's own values: this rank's rows of a sharded (``DTensor``) one."""
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def _like(p: Tensor, values: Tensor) -> Tensor:
    """``values`` (``p``'s own values' shape) as a gradient for ``p``: a ``DTensor`` if ``p`` is."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return values
    return DTensor.from_local(
        values, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def _trainable(model: nn.Module) -> list[tuple[str, Tensor]]:
    """``(name, parameter)`` for each trainable parameter, tied ones once (as functionalize)."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]
