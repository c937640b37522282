"""Private gradients for your own training loop: ``torch.optim`` on DP-SGD's noisy average.

:class:`PrivateGradients` is DP-SGD without the optimizer. It samples the
logical batches (Poisson, secretly keyed: :class:`LogicalBatch`), and its
:meth:`~PrivateGradients.backward` writes into every trainable parameter's
``.grad`` the private gradient of the batch, ``(clipped sum + noise) /
expected_batch_size``; any ``torch.optim`` optimizer and learning-rate scheduler
then take the step. It is the Trainer's step without its last box (the same
sampler, clipping, noise, micro-batches, collectives and accountant:
:meth:`dpfunc.TrainStep.logical_gradient`), so with ``torch.optim.SGD`` it gives
the Trainer's update for the same seed::

    private = dpfunc.PrivateGradients(model, loss_fn, dataset, expected_batch_size=256,
                                      clip_norm=1.0, target_epsilon=3.0, delta=1e-5, epochs=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=private.total_steps)
    for batch in private.batches():      # Poisson-sampled logical batches
        private.backward(batch)          # every trainable p.grad = private gradient
        optimizer.step(); scheduler.step(); optimizer.zero_grad()
    print(private.epsilon(1e-5))

Privacy: the optimizer only ever sees the private gradient, so it costs no
privacy (a post-processing), and nothing else may reach it. ``p.grad`` belongs
to the private step: an autograd gradient into a trainable parameter before
the private one is cleared is refused, and so is an optimizer step on a
``.grad`` that ``backward`` did not write, or on a frozen parameter holding one.
A batch is released once, in order, as the sampler drew it (a yielded copy that
was changed is refused). The model is read live: a parameter replaced, or a
change in which parameters are trainable, is refused.

The loop, the model read live, the guards on ``p.grad``, resuming (the state
holds the secret seed) and several processes: see docs/own-loop.md.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor, nn

from . import checkpoint as _checkpoint
from . import optim
from ._checks import check_choice, check_int, check_per_example
from ._forward_state import StateWatch
from ._grad_guard import GradGuard
from ._plan import PlannedRun, RunPlan
from .config import DPConfig, SpeedConfig, settings_from
from .data import MicroBatch
from .distributed import broadcast_from_rank0
from .functional import functionalize
from .per_sample import LossFn
from .sharding import dtensor_class, fsdp_hooks_off, reshard, shard_module
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
        dataset: any form :func:`dpfunc.datasets.as_dataset` accepts.
        config: the privacy settings, a :class:`dpfunc.DPConfig`, resolved
            for this dataset (``target_epsilon`` needs ``epochs``); or their
            keyword form (``expected_batch_size=256, clip_norm=1.0,
            target_epsilon=3.0, delta=1e-5, epochs=3``). Without ``epochs``
            (a ``noise_multiplier`` given), the run has no planned end:
            :meth:`batches` yields until its caller stops or
            ``epsilon_budget`` would be exceeded.
        speed: the speed settings, a :class:`dpfunc.SpeedConfig` (or their
            keyword form, ``method="vmap", physical_batch_size=64, ...``), as
            for :class:`dpfunc.Trainer`; its ``model`` is this ``model`` (left
            out, it is filled in; another module is refused). ``method="auto"``
            uses ghost clipping where it is cheaper. ``shard=True``
            (distributed runs only) shards the model with FSDP2's
            ``fully_shard`` unless it is already (:func:`dpfunc.sharding.shard_module`):
            every trainable parameter becomes a ``DTensor`` of this rank's
            rows (of rank 0's parameters, unless the model came sharded), so
            the optimizer built on ``model.parameters()`` AFTER this keeps
            1/world of its state, and :meth:`backward` writes
            each rank's rows of the private gradient, equal to the single
            process's (:mod:`dpfunc.sharding`). Save the model and the
            optimizer with ``torch.distributed.checkpoint``.
        users: user-level privacy, as for :class:`dpfunc.Trainer`: with
            ``privacy_unit="user"``, each example's user id (a sequence, or
            the dataset's id column by name).

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
        speed: SpeedConfig | None = None,
        seed: int | None = None,
        distributed: bool | None = None,
        nonfinite: str = "warn",
        users: Any = None,
        **settings: Any,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if speed is None:  # the keyword form: the model trained is the speed settings' model
            settings.setdefault("model", model)
        config, speed = settings_from("PrivateGradients", config, speed, settings)
        speed = _with_model(speed, model)
        check_choice("nonfinite", nonfinite, NONFINITE)
        functionalize(model)  # refuses BatchNorm; lets vmap see recurrent layers' hidden state
        self.model = model
        if not _trainable(model):
            raise ValueError("model has no parameter with requires_grad=True: nothing to train")
        self.plan = plan = RunPlan(
            "PrivateGradients",
            config,
            dataset,
            physical_batch_size=speed.physical_batch_size,
            seed=seed,
            distributed=distributed,
            require_epochs=False,
            users=users,
        )
        self.config = plan.config
        # the optimizer is the user's: an identity stands in
        self.step_fn = plan.make_step(loss_fn, optim.chain(), speed)
        if plan.distributed:  # rank 0's model everywhere (then fully_shard keeps rows of it)
            _copy_rank0_model(model)
        if speed.shard:
            shard_module(model)
        self._trainable = _trainable(model)  # what backward may write to, checked each time
        self._shapes = {name: p.shape for name, p in self._trainable}
        self.nonfinite = nonfinite
        self._warned_nonfinite = False
        whole = (
            {name: p.full_tensor().detach() for name, p in self._trainable}
            if speed.shard
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
        self._issued: list[MicroBatch] | None = None  # the sampler's batch of the next step
        self._yielded: LogicalBatch | None = None  # the copy of it batches() yielded
        self._yielded_versions: list[tuple[int, int]] = []  # its tensors (id, version) then
        self._released = 0  # private gradients this object wrote (loading one's own: refused)
        self._closed = False
        self._guard = GradGuard(model, self._trainable)  # p.grad is the private step's alone
        self._watch = StateWatch(model, self.step_fn.sharded)  # nothing else the forward moves
        _run_backward_eagerly()

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
            self._issued = micro_batches  # backward computes from this batch, and no other
            with torch.inference_mode(False):  # a copy with version counters, in any mode
                copy = LogicalBatch(t, optree.tree_map(_clone, micro_batches), size)
            self._yielded = copy
            self._yielded_versions = [(id(t), t._version) for t in _tensors(copy.micro_batches)]
            yield copy
            t += 1

    def backward(self, batch: LogicalBatch) -> dict[str, float]:
        """Writes the private gradient of ``batch`` into every trainable parameter's ``.grad``.

        ``p.grad = (clipped sum + noise) / expected_batch_size`` for each
        parameter with ``requires_grad=True`` (tied parameters once), in the
        parameter's dtype and on its device. Gradients already present are
        OVERWRITTEN, not added to; frozen parameters are not touched. The
        step is accounted before anything is written, empty batches too.
        Runs under the caller's autocast, if any. Distributed: collective,
        and every rank gets the same gradient. Inside a function given to
        ``torch.compile`` it runs eagerly (a graph break): the step compiles itself
        with ``compile=True``.

        Returns the step's metrics as floats (:func:`dpfunc.summarize`:
        loss, batch size, clipped fraction, non-finite examples, norm
        quantiles). They read the data without noise: NOT private.

        Raises:
            TypeError: ``batch`` is not a :class:`LogicalBatch`.
            ValueError: ``batch`` is not the one :meth:`batches` yielded for
                the next step (a batch released twice would release its
                noise twice; a batch of one's own is not a Poisson sample), or the model's
                trainable parameters changed (see docs/own-loop.md, "The
                model is read live").
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
        if self._closed:
            raise RuntimeError("this PrivateGradients is closed (close()): build a new one")
        self._check_yielded(batch, t)
        self.plan.check_next_step(t)
        check_per_example(self.model)  # a BatchNorm added since the build, too
        params = self._live_params()
        if not self._released:
            self._check_first_step(params)
        GradGuard.clear_frozen(self.model)
        self._guard.warn_unapplied(t)
        state = self._state_for(params)
        noise = self._draw_noise(params, t)
        metrics: dict[str, float] = {}
        self._guard.writing = True
        self._watch.start()
        try:
            with fsdp_hooks_off(self.model) if self.step_fn.sharded else nullcontext():
                private, state, _ = self.step_fn.logical_gradient(
                    state, self._issued, noise, before_release=self._before_release(t, metrics)
                )
        finally:
            self._guard.writing = False
            moved = self._watch.moved()  # (put back whether the step ran or raised)
        if moved:
            self.close()  # accounted but not applied: the run's state cannot go on from here
            raise ValueError(
                f"the model's forward changed {moved[:5]}{'...' if len(moved) > 5 else ''} in "
                f"place during step {t}: what a forward writes into the model's own state "
                "may come from the data (it does for running statistics and caches of the "
                "input), with no noise, and the model would carry it out "
                "(state_dict, later outputs). The step was accounted, no gradient was written, "
                "the buffers were put back as they were (a parameter cannot be: reload it), and "
                "this run is closed: fix the model and build a new PrivateGradients. "
                "Keep the forward free of in-place updates (running statistics, caches of the "
                "input, renormalised weights, parametrizations such as spectral_norm that update "
                "their own state in the forward)"
            )
        written = {name: _like(p, private[name].to(p.dtype)) for name, p in self._trainable}
        self._guard.write(written, step=t)
        self._released += 1
        _TRAINED[self.model] = (list(self.plan.lineage), self._released, self.accountant)
        self.state = state._replace(params=params)
        self._issued = self._yielded = None
        return metrics

    def _check_yielded(self, batch: LogicalBatch, t: int) -> None:
        """Refuses a batch other than the copy :meth:`batches` yielded for step ``t``, unchanged."""
        yielded = self._yielded
        if (
            yielded is None
            or batch is not yielded
            and (batch.micro_batches is not yielded.micro_batches or batch.size != yielded.size)
        ):
            raise ValueError(
                f"batch is not the one batches() yielded for step {t}: only the Poisson sample "
                "of the step, keyed by the secret seed, is accounted as such"
            )
        leaves = _tensors(batch.micro_batches)
        if (
            len(batch.micro_batches) != len(self._issued)
            or [(id(t), t._version) for t in leaves] != self._yielded_versions
        ):
            raise ValueError(
                f"the batch of step {t} was changed after batches() yielded it (a mask or an "
                "example edited in place, or a micro-batch replaced): backward releases the "
                "sampler's own batch, and a changed copy says the caller meant another. Leave "
                "the batch as yielded; transform examples (augmentation, moving to a device) "
                "inside loss_fn"
            )

    def close(self) -> None:
        """Ends the run: the model's ``.grad`` is no longer guarded; accounting stays readable.

        After it, :meth:`backward` is refused, while :meth:`epsilon`,
        :meth:`privacy_report` and :meth:`state_dict` still answer. Call it
        before using the model outside DP-SGD (public fine-tuning,
        adversarial examples); what that training releases is not covered
        by this run's epsilon. Collecting the object has the same effect.
        """
        self._closed = True
        self._guard.remove()

    def _check_first_step(self, params: Params) -> None:
        """Before the first release: no outside tensor trains, and the model's record is ours.

        A loss that still requires grad with every trainable parameter
        detached reads a tensor outside the model that requires grad (a
        head or a temperature the optimizer also holds): it would be
        trained by autograd, never privately. And a model that another run
        already trained in this process (not one this run continues) holds
        steps this run's epsilon does not count.
        """
        if self._issued:  # the same count on every rank: the gather below is collective
            batch = self._issued[0][0]  # row 0, real or padding: the answer is not the data's
            example = optree.tree_map(lambda leaf: leaf[0] if isinstance(leaf, Tensor) else leaf,
                                      batch)  # fmt: skip
            sharded = self.step_fn.sharded
            whole = self.step_fn.full_params(self._state_for(params)) if sharded else params
            # the probe's dropout must not move the generators the steps' dropout draws from
            cuda = sorted({p.device.index or 0 for p in whole.values() if p.device.type == "cuda"})
            outside = []
            self._watch.start()
            try:
                with (
                    torch.random.fork_rng(devices=cuda),
                    torch.enable_grad(),
                    fsdp_hooks_off(self.model) if sharded else nullcontext(),
                ):
                    # a leaf that requires grad in both calls' graphs is a tensor that outlives
                    # the call (a parameter kept outside the model); one made in the forward
                    # (enable_input_require_grads' embedding output) is new at each call
                    first, second = (_grad_leaves(self.step_fn.loss_fn(dict(whole), example))
                                     for _ in range(2))  # fmt: skip
                    outside = [t for t in second if any(t is u for u in first)]
            except Exception:  # the step itself raises it, explained
                pass
            if moved := self._watch.moved():
                raise ValueError(
                    f"the model's forward changed {moved[:5]}{'...' if len(moved) > 5 else ''} "
                    "in place, reading one example (the check before the first step): what a "
                    "forward writes into the model's own state may come from the data (it "
                    "does for running statistics and caches of the input), with no noise, and "
                    "the model would carry it out (state_dict, later outputs). "
                    "Nothing was accounted and the buffers were put back as they were (a "
                    "parameter cannot be: reload it). Keep the forward free of in-place "
                    "updates (running statistics, caches, renormalised weights)"
                )
            if outside:
                raise ValueError(
                    "loss_fn reads a tensor that requires grad but is not a trainable parameter "
                    "of model (a head, an embedding or a temperature kept outside it): autograd "
                    "would train it on the data without clipping or noise. Make it a submodule "
                    "or parameter of model, or freeze it (requires_grad_(False))"
                )
        saved = _TRAINED.get(self.model)
        if saved is not None:
            lineage, released, accountant = saved
            if lineage != self.plan.lineage[: len(lineage)]:
                warnings.warn(
                    f"this model has already received {released} private gradients from "
                    f"another run (epsilon {accountant.epsilon(self.delta):.4g} at delta "
                    f"{self.delta:g}), "
                    "which this run does not continue: its epsilon does not count them, and what "
                    "the model releases composes both runs' epsilons. To continue that run, "
                    "load its state_dict into this one before the first backward",
                    stacklevel=4,
                )

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
        together resume the run. A ``PrivateGradients`` built with
        ``seed=None`` adopts the saved run's drawn secret and, as a new
        continuation, draws its samples and noise from here on from a fresh
        one (the fork rule: two continuations of one state dict never share
        noise); a fixed seed must match, and resumes bit for bit (as
        :func:`dpfunc.checkpoint.load`).

        Raises:
            ValueError: of another run's settings (each difference named),
                seed or version, or malformed; or this ``PrivateGradients``
                has already written gradients of its own (the model holds
                steps the loaded accountant would not count: load into a
                fresh one); nothing changes then.
        """
        if self._released:
            raise ValueError(
                f"this PrivateGradients has already written {self._released} private gradients "
                "into the model; loading a state_dict would replace its accountant, and the "
                "model would keep steps no epsilon counts. Load into a freshly built "
                "PrivateGradients (with the model's and the optimizer's state dicts)"
            )
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
            if p.shape != self._shapes[name]:
                raise ValueError(
                    f"the model's parameter {name!r} changed shape from "
                    f"{tuple(self._shapes[name])} to {tuple(p.shape)} since PrivateGradients was "
                    "built (resized in place): the optimizer's state and the noise history no "
                    "longer fit it. Build PrivateGradients and the optimizer again"
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
        noise = self._noise.draw(params, self.stream_seed, t, ahead=ahead)
        if any(
            z.dtype != _noise_dtype(p, self.config.secure_noise) or z.device != p.device
            for z, p in zip(noise.params.values(), params.values(), strict=True)
        ):  # drawn ahead for parameters since moved or converted: draw again, as they are
            noise = self.step_fn.draw_noise(params, seed=self.stream_seed, step=t)
        return noise

    def __repr__(self) -> str:  # the seed is a secret: never in a repr or a log
        return (
            f"PrivateGradients(steps_done={self.steps_done}, total_steps={self.total_steps}, "
            f"noise_multiplier={self.noise_multiplier:.6g}, clip_norm={self.clip_norm:.6g}, "
            f"expected_batch_size={self.expected_batch_size:g})"
        )


def _run_backward_eagerly() -> None:
    """Makes :meth:`PrivateGradients.backward` a graph break under ``torch.compile``, once.

    A compiled loop body then calls it as is (it compiles its own step with
    ``compile=True``). Done on the class at the first build, not as a
    decorator (which would import Dynamo with dpfunc) nor on the instance
    (which would hold itself in a cycle, outliving a ``del``).
    """
    if not getattr(PrivateGradients.backward, "_dpfunc_eager", False):
        eager = torch.compiler.disable(PrivateGradients.backward)
        eager._dpfunc_eager = True
        PrivateGradients.backward = eager


def _grad_leaves(loss: Any) -> list[Tensor]:
    """The leaf tensors that requires-grad ``loss`` would accumulate a gradient into."""
    if not isinstance(loss, Tensor) or not loss.requires_grad:
        return []
    if loss.grad_fn is None:  # the loss is itself a leaf
        return [loss]
    leaves, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if isinstance(variable, Tensor):
            leaves.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def _clone(leaf: Any) -> Any:
    return leaf.clone() if isinstance(leaf, Tensor) else leaf


def _tensors(tree: Any) -> list[Tensor]:
    return [leaf for leaf in optree.tree_leaves(tree) if isinstance(leaf, Tensor)]


# model -> (the lineage of the run that last wrote its gradients, the gradients it wrote, its
# accountant): a record that outlives the run, so that a new run on a trained model is told
# what its epsilon does not count
_TRAINED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _copy_rank0_model(model: nn.Module) -> None:
    """Sets every rank's parameters, frozen ones too, and buffers to rank 0's (collective).

    As DDP does when it wraps a model: a frozen part or a buffer that
    differed between ranks would make each rank compute with another model,
    without a word. A model already sharded by the caller is what its rows
    make up: its parameters are left as they are, its buffers synced.
    """
    dtensor = dtensor_class()
    tensors = {f"buffer:{name}": b for name, b in model.named_buffers()}
    parameters = dict(model.named_parameters())
    if dtensor is None or not any(isinstance(p, dtensor) for p in parameters.values()):
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
    dtensor = dtensor_class()
    return p.to_local() if dtensor is not None and isinstance(p, dtensor) else p


def _like(p: Tensor, values: Tensor) -> Tensor:
    """``values`` (``p``'s own values' shape) as a gradient for ``p``: a ``DTensor`` if ``p`` is."""
    dtensor = dtensor_class()
    if dtensor is None or not isinstance(p, dtensor):
        return values
    return dtensor.from_local(
        values, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def _trainable(model: nn.Module) -> list[tuple[str, Tensor]]:
    """``(name, parameter)`` for each trainable parameter, tied ones once (as functionalize)."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def _with_model(speed: SpeedConfig, model: nn.Module) -> SpeedConfig:
    """``speed`` with ``model`` as its module: filled in, or refused if it names another."""
    if speed.model is None:
        return dataclasses.replace(speed, model=model)
    if speed.model is not model:
        raise ValueError(
            "speed.model must be the model PrivateGradients trains (or left out); got "
            f"another module, a {type(speed.model).__name__}"
        )
    return speed
