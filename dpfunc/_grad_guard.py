"""Who may write a private run's ``p.grad``, and when that is checked.

In a loop of one's own, the private gradient reaches the optimizer through
``p.grad``, which autograd and any code can also write. :class:`GradGuard`
makes ``p.grad`` the private step's alone while its run lives:

- a **tensor hook** on each trainable parameter refuses an autograd gradient
  while ``p.grad`` holds a private gradient no optimizer has applied yet (a
  ``loss.backward()`` between ``private.backward(batch)`` and
  ``optimizer.step()`` would add to it); once applied, autograd may add to it,
  and the sum is marked, so that stepping it is refused;
- **one global optimizer pre-step check** (every ``torch.optim`` optimizer)
  refuses a step of a parameter whose ``.grad`` is not the private gradient as
  written, of a frozen parameter holding a gradient, and a step with a
  ``closure`` (the closure recomputes ``p.grad`` inside the step, after the
  check: it would be stepped un-noised). It runs eagerly under
  ``torch.compile`` (``torch.compiler.disable``): a compiled
  ``optimizer.step`` is checked at every call, not only while it is traced;
- **one global post-step check** raises if the gradient stepped was not the
  one checked (an optimizer's own pre-step hook, which runs after the global
  one, replaced it): too late to keep the model, but never silent.

The guard holds its run's state (what was written, whether it was applied)
and the parameters' ids; hooks and the global check hold the guard weakly,
so that a collected run leaves nothing behind.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

# id(parameter) -> (its guard, held weakly; its name if trainable there, else None). Ids, not
# weak references to the parameters (torch.utils.swap_tensors refuses tensors that have
# one); a live guard holds its model's parameters, so their ids stay theirs while it lives.
_GUARDED: dict[int, tuple[Any, str | None]] = {}
_LOCK = threading.RLock()  # re-entered when a collection runs a finalizer inside it
_OPTIMIZER_HOOK: list[Any] = []  # the handles of the global optimizer checks, before and after


class GradGuard:
    """The private step's ownership of ``model``'s ``.grad`` (see the module docstring).

    Args:
        model: the model whose parameters are guarded (all of them: a frozen
            one must not be stepped on a gradient of its own either).
        trainable: ``(name, parameter)`` for each parameter the private step
            writes.
    """

    def __init__(self, model: nn.Module, trainable: list[tuple[str, Tensor]]):
        self.trainable = dict(trainable)
        self.written: dict[str, Tensor] = {}  # the private gradient each p.grad must be
        self.step = -1  # the step whose private gradient was written last
        self.applied = True  # an optimizer stepped the last private gradient (or none yet)
        self.tainted: set[str] = set()  # written gradients autograd has added to since
        self.writing = False  # inside the private step: autograd's gradients are its own
        me = weakref.ref(self)
        params = list(model.parameters())
        with _LOCK:
            for key in [k for k, (g, _) in list(_GUARDED.items()) if g() is None]:
                _GUARDED.pop(key, None)
            for p in params:
                _GUARDED[id(p)] = (me, None)
            for name, p in self.trainable.items():
                _GUARDED[id(p)] = (me, name)
            handles = [p.register_hook(_autograd_check(me, name, p))
                       for name, p in self.trainable.items()]  # fmt: skip
            if not _OPTIMIZER_HOOK:  # eager under torch.compile: checked at every call
                check = torch.compiler.disable(_check_before_step)  # (imports Dynamo)
                _OPTIMIZER_HOOK.append(register_optimizer_step_pre_hook(check))
                after = torch.compiler.disable(_check_after_step)
                _OPTIMIZER_HOOK.append(register_optimizer_step_post_hook(after))
        self._finalizer = weakref.finalize(self, _release, handles, params, me)

    def remove(self) -> None:
        """Stops guarding: the hooks are removed, the model's ``.grad`` is the caller's again."""
        self._finalizer()

    def write(self, grads: dict[str, Tensor], step: int) -> None:
        """Writes step ``step``'s private gradient into each trainable ``p.grad`` (replacing it)."""
        for name, p in self.trainable.items():
            p.grad = grads[name]
            self.written[name] = p.grad
        self.step, self.applied, self.tainted = step, False, set()

    def pending(self, name: str) -> bool:
        """Whether ``name``'s ``.grad`` is the last private gradient, as written."""
        written = self.written.get(name)
        return (
            written is not None
            and self.trainable[name].grad is written
            and name not in self.tainted
        )

    def foreign_grad(self, p: Tensor, name: str | None) -> str | None:
        """Why ``p.grad`` must not be stepped, or ``None``.

        ``name``: ``p``'s name if it was trainable when the guard was made,
        ``None`` if it was frozen.
        """
        if p.grad is None:
            return None
        if name is not None and p.requires_grad:
            if self.pending(name):
                return None
            return (
                f"the .grad of trainable parameter {name!r} is not the private gradient "
                "PrivateGradients.backward wrote (autograd's, after or before zero_grad, or one "
                "set by hand): stepping it would train on the data without clipping or noise. "
                "Call private.backward(batch) after any loss.backward(), then optimizer.step(); "
                "to train outside DP-SGD, call private.close() first"
            )
        if p.requires_grad:
            return (
                "a parameter of the model that was frozen when PrivateGradients was built is "
                "trainable now and holds a gradient PrivateGradients never wrote (gradual "
                "unfreezing): stepping it would train it without clipping or noise. Build "
                "PrivateGradients and the optimizer again after changing requires_grad"
            )
        return (
            "a frozen parameter of the model holds a .grad that PrivateGradients did not "
            "write: stepping it would move the parameter by a non-private gradient. Clear "
            "it (p.grad = None) or call private.backward(batch), which clears it"
        )

    def warn_unapplied(self, step: int) -> None:
        """Warns when the last private gradient is about to be overwritten without having been used.

        Accumulating several logical batches into one optimizer step (a
        habit from virtual steps) does not work here: each write replaces
        ``p.grad``, and each logical batch already has the expected batch
        size. Privacy is not at stake (both were accounted); the dropped
        gradient is.
        """
        if self.applied or not any(self.pending(name) for name in self.trainable):
            return
        warnings.warn(
            f"the private gradient of step {step - 1} was never applied by an optimizer step: "
            f"backward(batch) of step {step} overwrites it (gradients are not accumulated across "
            "logical batches; each logical batch already has expected_batch_size examples, and "
            "physical_batch_size sets the micro-batches). Call optimizer.step() after each "
            "backward",
            stacklevel=4,  # (backward runs in torch.compiler.disable's wrapper: one frame more)
        )

    @staticmethod
    def clear_frozen(model: nn.Module) -> None:
        """Clears the ``.grad`` of ``model``'s frozen parameters (a stale one would be stepped)."""
        stale = [name for name, p in model.named_parameters()
                 if not p.requires_grad and p.grad is not None]  # fmt: skip
        if not stale:
            return
        for p in model.parameters():
            if not p.requires_grad:
                p.grad = None
        warnings.warn(
            f"cleared the .grad of frozen parameters {stale[:5]}"
            f"{'...' if len(stale) > 5 else ''}: PrivateGradients does not train them, and "
            "an optimizer holding them would have moved them by that non-private gradient",
            stacklevel=4,
        )


def _release(handles: list[Any], params: list[Tensor], me: Any) -> None:
    for handle in handles:
        handle.remove()
    with _LOCK:
        for p in params:
            if _GUARDED.get(id(p), (None,))[0] is me:
                _GUARDED.pop(id(p), None)
    params.clear()


def _autograd_check(me: Any, name: str, p: Tensor) -> Any:
    p_ref = weakref.ref(p)  # the hook lives on p: a strong reference would be a cycle

    def hook(grad: Tensor) -> None:
        guard = me()
        if guard is None or guard.writing or not guard.pending(name) or p_ref() is None:
            return
        if guard.applied:  # already stepped: autograd may add to it, but it is not stepped
            guard.tainted.add(name)
            return
        raise RuntimeError(
            f"autograd computed a gradient for {name!r}, whose .grad holds the private gradient "
            f"of step {guard.step}, not yet applied: a loss.backward() between "
            "private.backward(batch) and optimizer.step() would add a non-private gradient to it "
            "(in Opacus, step() replaced it; here nothing may). Compute a loss you only log "
            "under torch.no_grad(), or call loss.backward() before private.backward(batch); to "
            "train outside DP-SGD, call private.close() first"
        )

    return hook


def _check_before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Refuses an optimizer step that would apply a gradient the private step did not write."""
    closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0]: the optimizer
    guarded, others = [], []
    for group in optimizer.param_groups:
        for p in group["params"]:
            me, name = _GUARDED.get(id(p), (None, None))
            guard = me() if me is not None else None
            if guard is not None:  # (a live guard holds p: the id is p's own)
                guarded.append((guard, p, name))
            elif p.grad is not None:
                others.append(p)
    if guarded and others:
        raise RuntimeError(
            f"{type(optimizer).__name__}.step() refused: it steps the private run's model and "
            f"also {len(others)} tensor(s) outside that model holding a gradient (of shape "
            f"{tuple(others[0].shape)}, ...) that no private step wrote: a head or a "
            "temperature trained by autograd on the data, without clipping or noise. Make "
            "them part of the model (a submodule or parameter: the private step then trains "
            "them), or freeze them. Training them on the data in any other way, with this "
            "optimizer or another, is not private and not covered by the run's epsilon"
        )
    if guarded and closure is not None:
        raise RuntimeError(
            f"{type(optimizer).__name__}.step(closure) refused: the closure runs inside the step, "
            "after this check, and its loss.backward() would put the data's un-noised gradient "
            "into the .grad that is stepped (LBFGS and other closure optimizers evaluate it "
            "several times per step, each a release no epsilon counts). Call "
            "private.backward(batch), then optimizer.step() without a closure, with an optimizer "
            "that takes one gradient per step (SGD, Adam, AdamW, ...)"
        )
    for guard, p, name in guarded:
        if (why := guard.foreign_grad(p, name)) is not None:
            raise RuntimeError(f"{type(optimizer).__name__}.step() refused: {why}")
    for guard, p, name in guarded:
        if name is not None and p.grad is not None:
            guard.applied = True


def _check_after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Raises if the step applied a ``.grad`` that is no longer the private one it was checked as.

    Runs after the optimizer's own pre-step hooks and the step: one of those
    (``optimizer.register_step_pre_hook``, a step overridden to recompute
    ``.grad``) can replace the gradient after the check before the step. The
    parameters have moved by then; the error says so, loudly, rather than let
    the run go on as private.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            me, name = _GUARDED.get(id(p), (None, None))
            guard = me() if me is not None else None
            if guard is None or name is None or p.grad is None or not p.requires_grad:
                continue
            written = guard.written.get(name)
            if written is None or guard.pending(name):
                continue
            same = (  # re-materialised with the same values (a copy, a contiguous clone)
                name not in guard.tainted
                and p.grad.shape == written.shape
                and torch.equal(p.grad.to(written.dtype), written)
            )
            if not same:
                raise RuntimeError(
                    f"{type(optimizer).__name__}.step() applied a .grad of {name!r} that is not "
                    "the private gradient it was checked as: something replaced it after "
                    "dpfunc's check and before the update (an optimizer's own pre-step hook, "
                    "register_step_pre_hook, or a step that recomputes .grad). The model has "
                    "moved by a gradient without clipping or noise, which the run's epsilon "
                    "does not cover: remove that hook, and reload the model from before this step"
                )
