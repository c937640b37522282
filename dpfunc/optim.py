"""Optimizers as gradient transformations: pure ``(init, update)`` pairs.

The last box of a private step turns the averaged, noised gradient into a
change of the parameters. As in optax, an optimizer is a
:class:`GradientTransformation`, a NamedTuple of two pure functions::

    state = opt.init(params)
    updates, state = opt.update(grads, state, params)
    params = apply_updates(params, updates)       # p + u, leaf by leaf

``update`` returns the UPDATES TO ADD to the parameters (``-lr * g`` for
plain SGD), never the new parameters, so transformations compose with
:func:`chain`. Neither function changes its inputs in place; the state is a
NamedTuple of tensors (counters are 0-d int64 tensors), so a step that calls
``update`` compiles with ``torch.compile(fullgraph=True)`` into one graph that
is reused on every step.

:func:`sgd`, :func:`adam` and :func:`adamw` reproduce the math of
``torch.optim.SGD``, ``torch.optim.Adam`` and ``torch.optim.AdamW`` (default
flags: no amsgrad, no maximize) step for step. The optimizer only ever sees
the private gradient, so it is post-processing and costs no privacy.
Parameters are real floating-point tensors; every hyperparameter is checked
once, when the transformation is built.

Learning-rate schedules: ``lr`` of :func:`sgd`, :func:`adam` and
:func:`adamw` is a float or a schedule (:mod:`dpfunc.schedules`), a callable
of the number of updates already applied. Update number ``k`` (0-based) uses
``lr(state.count)`` with ``state.count == k``, a 0-d int64 tensor, so a
compiled step is one graph for every rate; AdamW's decoupled weight decay
uses the same scheduled rate, as torch.optim does under an LR scheduler.
:func:`learning_rate` reads the rate the next update will use, for logging.
:func:`scale` takes a constant factor only: it is stateless and has no count
(use ``sgd(lr=schedule)`` for scheduled plain gradient descent).

Half precision: for bf16 and fp16 parameters the state (momentum, moments)
is float32, the incoming gradient is widened to float32, and the update is
computed and returned in float32; :func:`apply_updates` adds it to the
parameter in float32 and rounds the sum once to the parameter's dtype. A
bf16 moment would lose the small terms ``(1 - b2) * g**2`` that float32
keeps, and ``1 - 0.999**t`` is 0 in bf16. Scalars that depend on the step
(Adam's bias corrections, a scheduled rate) are computed in float64 and
applied in the state's dtype. Float32 and float64 parameters keep their dtype throughout.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ._checks import check_number
from .tree import Params, PyTree, check_same_structure, tree_map

State = Any  # a NamedTuple (or tuple) of tensors
# a rate: a float > 0, or a schedule mapping the updates already applied (0-d int64) to a rate
LearningRate = float | Callable[[Tensor], Tensor | float]


class GradientTransformation(NamedTuple):
    """An optimizer as two pure functions, and optionally a reader of its rate.

    ``init(params) -> state``: the state before the first step.
    ``update(updates, state, params) -> (updates, state)``: maps the incoming
    gradient tree to the tree of updates to ADD to ``params`` (see
    :func:`apply_updates`) and the next state.
    ``learning_rate(state) -> rate``: the rate the next ``update`` from
    ``state`` will apply (a float, or a 0-d tensor for a schedule); ``None``
    (the default) for a transformation without one, such as :func:`scale`.
    Read it through :func:`learning_rate`. Build a transformation by keyword
    or with two or three positional fields; it is a 3-tuple, so unpack it as
    ``init, update, _ = opt`` or use the attributes.

    The step's other mechanisms with state are this protocol too: the noise
    (:data:`dpfunc.noise.NoiseMechanism`, the step's draw in, the noise to
    add out) and the clip norm (:data:`dpfunc.clipping.ClipMechanism`, the
    logical batch's unclipped count in, the next clip norm out), so one of
    your own is written like an optimizer, and :func:`chain` composes them.
    """

    init: Callable[[PyTree], State]
    update: Callable[[PyTree, State, PyTree], tuple[PyTree, State]]
    learning_rate: Callable[[State], Tensor | float] | None = None


class EmptyState(NamedTuple):
    """The state of a stateless transformation."""


class SgdState(NamedTuple):
    momentum: Params | None  # like params (float32 for half ones); None when momentum == 0
    count: Tensor  # shape (), int64: steps taken


class AdamState(NamedTuple):
    exp_avg: Params  # like params (float32 for half ones): first moment m
    exp_avg_sq: Params  # like params (float32 for half ones): second moment v
    count: Tensor  # shape (), int64: steps taken


HALF = (torch.bfloat16, torch.float16)


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the state and the update for parameters of ``dtype``: float32 for half."""
    return torch.float32 if dtype in HALF else dtype


def _widen(t: Tensor) -> Tensor:
    return t.to(state_dtype(t.dtype))


def _state_zeros(params: PyTree) -> PyTree:
    return tree_map(lambda p: torch.zeros_like(p, dtype=state_dtype(p.dtype)), params)


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """``params + updates`` leaf by leaf, as new tensors (``params`` is unchanged).

    Each sum is computed in the wider of the two dtypes and rounded once to
    the parameter's dtype: a bf16 parameter with a float32 update stays bf16
    and is rounded once, not twice.

    Raises:
        ValueError: ``updates`` and ``params`` differ in tree structure or leaf shape.
    """
    check_same_structure(updates, params, "updates", "params")
    return tree_map(lambda p, u: torch.add(p, u).to(p.dtype), params, updates)


def learning_rate(optimizer: GradientTransformation, opt_state: State) -> float | None:
    """The rate the next ``optimizer.update`` from ``opt_state`` will apply, or ``None``.

    For :func:`sgd`, :func:`adam` and :func:`adamw` this is ``lr`` or, for a
    schedule, ``lr(opt_state.count)``; for :func:`chain`, the rate of the
    first transformation in it that has one (a :func:`scale` around it is not
    folded in); ``None`` when none has one (:func:`scale`, ``chain()``). It
    reads a tensor's value on the host: call it outside a compiled step, e.g.
    to log the rate.

    >>> learning_rate(sgd(lr=0.1), sgd(lr=0.1).init({"w": torch.zeros(2)}))
    0.1

    Raises:
        TypeError: ``optimizer`` is not a :class:`GradientTransformation`.
    """
    if not isinstance(optimizer, GradientTransformation):
        raise TypeError(
            f"optimizer must be a GradientTransformation, got {type(optimizer).__name__}"
        )
    if optimizer.learning_rate is None:
        return None
    return float(optimizer.learning_rate(opt_state))


def scale(factor: float) -> GradientTransformation:
    """Multiplies every update by ``factor``; stateless (state is :class:`EmptyState`).

    ``scale(-lr)`` is gradient descent without momentum; inside :func:`chain`
    it rescales the gradient before (or after) another transformation.
    ``factor`` is a constant, not a schedule (a stateless transformation has
    no update count); ``sgd(lr=schedule)`` is scheduled ``scale(-lr)``. It
    has no learning rate: :func:`learning_rate` gives ``None``.

    Raises:
        ValueError: ``factor`` is not a finite real number.
    """
    check_number("factor", factor, high_open=True, low_open=True)

    def init(params: PyTree) -> EmptyState:
        return EmptyState()

    def update(updates: PyTree, state: EmptyState, params: PyTree = None):
        return tree_map(lambda u: u * factor, updates), state

    return GradientTransformation(init, update)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Applies ``transforms`` in order, each to the previous one's updates.

    The state is a tuple of the inner states, in the same order; every
    transform sees the same ``params``. ``chain()`` is the identity. Its
    ``learning_rate`` is that of the first transform that has one.

    >>> opt = chain(scale(2.0), sgd(lr=0.1))    # SGD on the doubled gradient

    Raises:
        TypeError: an argument is not a :class:`GradientTransformation`.
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"chain expects GradientTransformation arguments, got {type(t).__name__} "
                f"at position {i}: {t!r}"
            )

    def init(params: PyTree) -> tuple:
        return tuple(t.init(params) for t in transforms)

    def update(updates: PyTree, state: tuple, params: PyTree = None):
        new_states = []
        for t, s in zip(transforms, state, strict=True):
            updates, s = t.update(updates, s, params)
            new_states.append(s)
        return updates, tuple(new_states)

    with_rate = [i for i, t in enumerate(transforms) if t.learning_rate is not None]
    if not with_rate:
        return GradientTransformation(init, update)
    first = with_rate[0]

    def rate(state: tuple) -> Tensor | float:
        return transforms[first].learning_rate(state[first])

    return GradientTransformation(init, update, rate)


def sgd(
    lr: LearningRate,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
) -> GradientTransformation:
    """Stochastic gradient descent with momentum; the math of ``torch.optim.SGD``.

    With ``d = g + weight_decay * p`` and ``t`` the step (1, 2, ...)::

        buf_1 = d,   buf_t = momentum * buf_{t-1} + (1 - dampening) * d
        update = -lr * (d + momentum * buf_t)   if nesterov
                 -lr * buf_t                    if momentum > 0
                 -lr * d                        otherwise

    The first-step case ``buf_1 = d`` (no dampening) is a ``torch.where`` on
    the step counter, so the compiled step is one graph for all steps.
    ``lr`` is a float or a schedule (:mod:`dpfunc.schedules`): step ``t`` uses
    ``lr(t - 1)``, as ``torch.optim.SGD`` under an LR scheduler stepped after
    each ``optimizer.step()``.
    State: :class:`SgdState` (no momentum buffer when ``momentum == 0``),
    float32 for bf16 and fp16 parameters, whose updates are float32 too.

    Raises:
        ValueError: ``lr`` is not a finite number > 0 or a schedule whose
            ``lr(0)`` is a finite number >= 0; ``momentum`` outside [0, 1); ``dampening``
            outside [0, 1]; ``weight_decay < 0``; ``nesterov`` with
            ``momentum == 0`` or ``dampening != 0`` (as torch does).
    """
    lr = _check_lr(lr)
    check_number("momentum", momentum, low=0, high=1, high_open=True)
    check_number("dampening", dampening, low=0, high=1)
    check_number("weight_decay", weight_decay, low=0, high_open=True)
    if not isinstance(nesterov, bool):
        raise ValueError(f"nesterov must be a bool, got nesterov={nesterov!r}")
    if nesterov and (momentum == 0 or dampening != 0):
        raise ValueError(
            "nesterov requires momentum > 0 and dampening == 0, got "
            f"nesterov={nesterov!r}, momentum={momentum!r}, dampening={dampening!r}"
        )

    def init(params: PyTree) -> SgdState:
        buffers = _state_zeros(params) if momentum > 0 else None
        return SgdState(buffers, torch.zeros((), dtype=torch.int64))

    def update(grads: PyTree, state: SgdState, params: PyTree = None):
        grads = tree_map(_widen, grads)
        if weight_decay > 0:
            _require_params(params, "sgd", "weight_decay")
            check_same_structure(grads, params, "grads", "params")
            grads = tree_map(lambda g, p: g + weight_decay * _widen(p), grads, params)
        rate = _rate_at(lr, state.count)
        if momentum == 0:
            return tree_map(lambda d: -_times(rate, d), grads), SgdState(None, state.count + 1)

        first = state.count == 0

        def new_buffer(d: Tensor, buf: Tensor) -> Tensor:
            return torch.where(first.to(d.device), d, momentum * buf + (1 - dampening) * d)

        buffers = tree_map(new_buffer, grads, state.momentum)
        if nesterov:
            updates = tree_map(lambda d, buf: -_times(rate, d + momentum * buf), grads, buffers)
        else:
            updates = tree_map(lambda buf: -_times(rate, buf), buffers)
        return updates, SgdState(buffers, state.count + 1)

    return GradientTransformation(init, update, lambda state: _rate_at(lr, state.count))


def adam(
    lr: LearningRate = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> GradientTransformation:
    """Adam (Kingma & Ba 2015) with L2 on the gradient; the math of ``torch.optim.Adam``.

    With ``d = g + weight_decay * p`` and ``t`` the step (1, 2, ...)::

        m_t = lerp(m_{t-1}, d, 1 - b1),   v_t = b2 * v_{t-1} + (1 - b2) * d**2
        update = -lr / (1 - b1**t) * m_t / (sqrt(v_t) / sqrt(1 - b2**t) + eps)

    The bias corrections are computed from the 0-d step counter in float64
    (as torch.optim computes them, in Python floats) and applied in the
    state's dtype, so the compiled step is one graph for all steps. State:
    :class:`AdamState`, float32 for bf16 and fp16 parameters, whose updates
    are float32 too. A gradient entry that has been 0 on every step gets a
    zero update (``0 / eps``), never NaN. ``lr`` is a float or a schedule
    (:mod:`dpfunc.schedules`): step ``t`` uses ``lr(t - 1)``, as
    ``torch.optim.Adam`` under an LR scheduler stepped after each
    ``optimizer.step()``.

    Raises:
        ValueError: ``lr`` is not a finite number > 0 or a schedule whose
            ``lr(0)`` is a finite number >= 0; a beta outside [0, 1); ``eps <= 0``;
            ``weight_decay < 0``.
    """
    return _adam(lr, betas, eps, weight_decay, decoupled=False)


def adamw(
    lr: LearningRate = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
) -> GradientTransformation:
    """Adam with decoupled weight decay (Loshchilov & Hutter 2019); ``torch.optim.AdamW``.

    The parameters shrink by ``(1 - lr * weight_decay)`` before the Adam step
    on the plain gradient, so the update is
    ``-lr * weight_decay * p + adam_update(g)``. State: :class:`AdamState`.
    With a schedule, the decay uses the scheduled rate of the step, as
    ``torch.optim.AdamW`` under an LR scheduler does.

    Raises:
        ValueError: as :func:`adam`.
    """
    return _adam(lr, betas, eps, weight_decay, decoupled=True)


def _adam(lr, betas, eps, weight_decay, decoupled: bool) -> GradientTransformation:
    lr = _check_lr(lr)
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas must be a pair (beta1, beta2), got betas={betas!r}")
    b1, b2 = (
        check_number(f"betas[{i}]", beta, low=0, high=1, high_open=True)
        for i, beta in enumerate(betas)
    )
    check_number("eps", eps, low=0, low_open=True, high_open=True)
    check_number("weight_decay", weight_decay, low=0, high_open=True)

    def init(params: PyTree) -> AdamState:
        zeros = torch.zeros((), dtype=torch.int64)
        return AdamState(_state_zeros(params), _state_zeros(params), zeros)

    def update(grads: PyTree, state: AdamState, params: PyTree = None):
        grads = tree_map(_widen, grads)
        if weight_decay > 0:
            _require_params(params, "adamw" if decoupled else "adam", "weight_decay")
            check_same_structure(grads, params, "grads", "params")
            if not decoupled:
                grads = tree_map(lambda g, p: g + weight_decay * _widen(p), grads, params)
        count = state.count + 1
        exp_avg = tree_map(lambda m, d: torch.lerp(m, d, 1 - b1), state.exp_avg, grads)
        exp_avg_sq = tree_map(lambda v, d: b2 * v + (1 - b2) * (d * d), state.exp_avg_sq, grads)
        # float64 scalars: b2 = 0.999 is 1 in bf16, and 1 - b2**t loses digits in float32
        t = count.to(torch.float64)
        rate = _rate_at(lr, state.count)
        step_size = rate * torch.reciprocal(1 - b1**t)  # what `lr / tensor` computes
        correction = (1 - b2**t).sqrt()

        def adam_update(m: Tensor, v: Tensor) -> Tensor:
            denom = v.sqrt() / correction.to(m.device, m.dtype) + eps
            return -step_size.to(m.device, m.dtype) * (m / denom)

        updates = tree_map(adam_update, exp_avg, exp_avg_sq)
        if decoupled and weight_decay > 0:
            decay = rate * weight_decay
            updates = tree_map(lambda u, p: u - _times(decay, _widen(p)), updates, params)
        return updates, AdamState(exp_avg, exp_avg_sq, count)

    return GradientTransformation(init, update, lambda state: _rate_at(lr, state.count))


# --- learning rates: a float or a schedule -------------------------------------


def _check_lr(lr: Any) -> LearningRate:
    """``lr`` as a float > 0, or the schedule ``lr`` after checking ``lr(0)``."""
    if isinstance(lr, numbers.Real):  # a bool is refused there, by name
        return check_number("lr", lr, low=0, low_open=True, high_open=True)
    if not callable(lr):
        raise ValueError(
            "lr must be a finite number > 0 or a schedule (a callable of the number of "
            f"updates already applied, see dpfunc.schedules), got lr={lr!r}"
        )
    first = float(_rate_at(lr, torch.zeros((), dtype=torch.int64)))
    if not (math.isfinite(first) and first >= 0):
        raise ValueError(
            f"the schedule lr must give a finite rate >= 0, got lr(0)={first!r} for lr={lr!r}"
        )
    return lr


def _rate_at(lr: LearningRate, count: Tensor) -> float | Tensor:
    """The rate of the update after ``count`` updates: ``lr``, or ``lr(count)`` in float64."""
    if not callable(lr):
        return lr
    rate = lr(count)
    if isinstance(rate, Tensor) and rate.dim() == 0 and not rate.dtype.is_complex:
        return rate.to(torch.float64)
    if isinstance(rate, numbers.Real) and not isinstance(rate, bool):
        return float(rate)
    shown = f"a tensor of shape {tuple(rate.shape)}" if isinstance(rate, Tensor) else repr(rate)
    raise TypeError(
        f"the schedule lr must return a real number or a 0-d real tensor, got {shown} "
        f"from lr={lr!r}"
    )


def _times(rate: float | Tensor, x: Tensor) -> Tensor:
    """``rate * x`` in ``x``'s dtype and on its device (a tensor rate is cast first)."""
    if isinstance(rate, Tensor):
        return rate.to(x.device, x.dtype) * x
    return rate * x


# --- validation at the boundary ----------------------------------------------


def _require_params(params: PyTree, optimizer: str, option: str) -> None:
    if params is None:
        raise ValueError(f"{optimizer} with {option} > 0 needs params, got params=None")


__all__ = [
    "AdamState",
    "EmptyState",
    "GradientTransformation",
    "SgdState",
    "adam",
    "adamw",
    "apply_updates",
    "chain",
    "learning_rate",
    "scale",
    "sgd",
    "state_dtype",
]
