"""Learning-rate schedules: the rate of an update as a function of the updates already applied.

A schedule is a callable ``schedule(count) -> rate``. ``count`` is the number
of updates already applied: 0 for the first update, ``k`` for update number
``k`` (0-based). The :mod:`dpfunc.optim` transformations accept one wherever
they take ``lr`` and call it with their own step counter, ``state.count``,
BEFORE the update that uses the rate.

``count`` may be

- a 0-d int64 tensor, as inside a step: the rate is then a 0-d float64
  tensor on ``count``'s device, computed with torch ops only (``torch.where``,
  ``clamp``, ``cos``), never a Python branch on the count's value. A compiled
  step sees the count as data, so it compiles once and does not recompile as
  the rate changes;
- a Python ``int`` >= 0, for plotting or logging: the rate is a Python
  ``float``.

**Index convention, against torch.optim.lr_scheduler.** A torch loop calls
``scheduler.step()`` AFTER ``optimizer.step()``, so update number ``k`` uses
the rate the scheduler holds after ``k`` calls of ``scheduler.step()``. Here
update ``k`` uses ``schedule(k)``, so ``schedule(k)`` equals that rate: each
built-in below names the torch scheduler it reproduces this way (up to the
rounding of torch's recursive formulas, which are exact in real arithmetic).

The built-ins check their arguments when they are built and raise
``ValueError`` naming the argument and its value. Every rate they give is
finite and >= 0. A schedule of your own is any callable with the same
contract; to compile, it must use torch ops on the count (``0.1 * 0.99 **
count.double()`` works; ``if count < 100:`` breaks the graph). Without the
``.double()``, ``0.99 ** count`` of an int64 count is a float32 tensor (torch's
default dtype): the optimizers accept it, with float32's 7 digits.

The optimizer is post-processing of the private gradient: a schedule, like a
constant rate, costs no privacy. A rate of 0 still spends the step's privacy
budget (the noisy gradient still enters the momentum or the moments).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ._checks import check_int, check_number

__all__ = [
    "Schedule",
    "constant",
    "cosine_decay",
    "linear_warmup",
    "piecewise_constant",
    "step_decay",
    "warmup_cosine",
]


class Schedule:
    """A learning-rate schedule: ``schedule(count) -> rate`` (see the module docstring).

    Built by :func:`constant`, :func:`linear_warmup`, :func:`cosine_decay`,
    :func:`warmup_cosine`, :func:`piecewise_constant` and :func:`step_decay`;
    ``repr`` shows the name and the settings. ``rate_fn`` maps a 0-d int64
    tensor to a 0-d float64 tensor on the same device with torch ops only.
    """

    def __init__(self, name: str, rate_fn: Callable[[Tensor], Tensor], **settings: Any):
        self.name = name
        self.settings = settings
        self._rate_fn = rate_fn

    def __call__(self, count: int | Tensor) -> float | Tensor:
        """The rate of update number ``count`` (0-based).

        Args:
            count: the updates already applied, a 0-d integer tensor or an ``int`` >= 0.

        Returns:
            A 0-d float64 tensor on ``count``'s device for a tensor ``count``;
            a ``float`` for an ``int``.

        Raises:
            TypeError: ``count`` is a tensor that is not 0-d or not of an integer dtype.
            ValueError: ``count`` is not an ``int`` >= 0.
        """
        if isinstance(count, Tensor):
            if count.dim() != 0 or count.dtype.is_floating_point or count.dtype.is_complex:
                raise TypeError(
                    "count must be a 0-d integer tensor (the updates already applied), got "
                    f"a tensor of shape {tuple(count.shape)} and dtype {count.dtype}"
                )
            return self._rate_fn(count.to(torch.int64))
        count = check_int("count", count, minimum=0)
        return float(self._rate_fn(torch.tensor(count, dtype=torch.int64)))

    def __repr__(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in self.settings.items())
        return f"{self.name}({settings})"


def _f64(count: Tensor) -> Tensor:
    return count.to(torch.float64)


def _rate(name: str, value: Any) -> float:
    return check_number(name, value, low=0, low_open=True, high_open=True)


def _linear_factor(count: Tensor, start_factor: float, steps: int) -> Tensor:
    """``start_factor`` at 0 rising linearly to 1 at ``steps``, then 1."""
    progress = _f64(torch.clamp(count, 0, steps)) / steps
    return start_factor + (1.0 - start_factor) * progress


def _cosine(count: Tensor, lr: float, final_lr: float, steps: int) -> Tensor:
    """``lr`` at 0 falling along half a cosine to ``final_lr`` at ``steps``, then held."""
    progress = _f64(torch.clamp(count, 0, steps)) / steps
    return final_lr + (lr - final_lr) * (1.0 + torch.cos(math.pi * progress)) / 2.0


def constant(lr: float) -> Schedule:
    """The same rate for every update: ``schedule(k) = lr``.

    torch equivalent: no scheduler, or ``LambdaLR(optimizer, lambda k: 1.0)``.

    Raises:
        ValueError: ``lr`` is not a finite number > 0.
    """
    lr = _rate("lr", lr)
    return Schedule(
        "constant",
        lambda count: torch.full((), lr, dtype=torch.float64, device=count.device),
        lr=lr,
    )


def linear_warmup(lr: float, warmup_steps: int, start_factor: float = 1 / 3) -> Schedule:
    """A linear ramp from ``start_factor * lr`` up to ``lr`` over ``warmup_steps`` updates.

    ``schedule(k) = lr * (start_factor + (1 - start_factor) * min(k, warmup_steps) /
    warmup_steps)``: update 0 uses ``start_factor * lr``, update ``warmup_steps``
    and later use ``lr``.

    torch equivalent: ``LinearLR(optimizer, start_factor=start_factor,
    end_factor=1.0, total_iters=warmup_steps)`` with ``lr`` the optimizer's
    rate; the default ``start_factor=1/3`` is torch's. ``start_factor=0``
    (which torch refuses) makes the first update's rate 0.

    Raises:
        ValueError: ``lr`` is not a finite number > 0; ``warmup_steps`` is not an
            int >= 1; ``start_factor`` is not in [0, 1].
    """
    lr = _rate("lr", lr)
    warmup_steps = check_int("warmup_steps", warmup_steps, minimum=1)
    start_factor = check_number("start_factor", start_factor, low=0, high=1)

    def rate(count: Tensor) -> Tensor:
        return lr * _linear_factor(count, start_factor, warmup_steps)

    return Schedule(
        "linear_warmup", rate, lr=lr, warmup_steps=warmup_steps, start_factor=start_factor
    )


def cosine_decay(lr: float, decay_steps: int, final_lr: float = 0.0) -> Schedule:
    """Half a cosine from ``lr`` down to ``final_lr`` over ``decay_steps`` updates, then held.

    ``schedule(k) = final_lr + (lr - final_lr) * (1 + cos(pi * min(k, decay_steps) /
    decay_steps)) / 2``: update 0 uses ``lr``, update ``decay_steps`` and later
    use ``final_lr``.

    torch equivalent: ``CosineAnnealingLR(optimizer, T_max=decay_steps,
    eta_min=final_lr)`` for ``k <= decay_steps``. Past ``T_max`` torch's rate
    climbs back along the cosine; this one stays at ``final_lr`` (as optax's
    ``cosine_decay_schedule`` does, whose ``alpha`` is ``final_lr / lr``).

    Raises:
        ValueError: ``lr`` is not a finite number > 0; ``decay_steps`` is not an
            int >= 1; ``final_lr`` is not in [0, lr].
    """
    lr = _rate("lr", lr)
    decay_steps = check_int("decay_steps", decay_steps, minimum=1)
    final_lr = check_number("final_lr", final_lr, low=0, high=lr, note="(at most lr)")

    def rate(count: Tensor) -> Tensor:
        return _cosine(count, lr, final_lr, decay_steps)

    return Schedule("cosine_decay", rate, lr=lr, decay_steps=decay_steps, final_lr=final_lr)


def warmup_cosine(
    lr: float,
    warmup_steps: int,
    total_steps: int,
    start_factor: float = 1 / 3,
    final_lr: float = 0.0,
) -> Schedule:
    """:func:`linear_warmup` for ``warmup_steps`` updates, then :func:`cosine_decay` to the end.

    Updates ``0 .. warmup_steps - 1`` ramp linearly from ``start_factor * lr``;
    update ``warmup_steps`` uses ``lr``; the cosine then falls to ``final_lr``
    at update ``total_steps`` (so it lasts ``total_steps - warmup_steps``
    updates) and holds it. ``total_steps`` counts the warmup, as the number of
    steps of a run does; ``warmup_steps=0`` is :func:`cosine_decay`.

    torch equivalent: ``SequentialLR(optimizer, [LinearLR(optimizer,
    start_factor=start_factor, total_iters=warmup_steps),
    CosineAnnealingLR(optimizer, T_max=total_steps - warmup_steps,
    eta_min=final_lr)], milestones=[warmup_steps])``, for ``k <= total_steps``.

    Raises:
        ValueError: ``lr`` is not a finite number > 0; ``warmup_steps`` is not an
            int >= 0; ``total_steps`` is not an int > ``warmup_steps``;
            ``start_factor`` is not in [0, 1]; ``final_lr`` is not in [0, lr].
    """
    lr = _rate("lr", lr)
    warmup_steps = check_int("warmup_steps", warmup_steps, minimum=0)
    total_steps = check_int("total_steps", total_steps, minimum=1)
    if total_steps <= warmup_steps:
        raise ValueError(
            f"total_steps must be > warmup_steps={warmup_steps} (it counts the warmup), got "
            f"total_steps={total_steps!r}"
        )
    start_factor = check_number("start_factor", start_factor, low=0, high=1)
    final_lr = check_number("final_lr", final_lr, low=0, high=lr, note="(at most lr)")
    decay_steps = total_steps - warmup_steps

    def rate(count: Tensor) -> Tensor:
        decayed = _cosine(count - warmup_steps, lr, final_lr, decay_steps)
        if warmup_steps == 0:  # a setting, not a value of the count
            return decayed
        warm = lr * _linear_factor(count, start_factor, warmup_steps)
        return torch.where(count < warmup_steps, warm, decayed)

    return Schedule(
        "warmup_cosine",
        rate,
        lr=lr,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        start_factor=start_factor,
        final_lr=final_lr,
    )


def piecewise_constant(boundaries: Sequence[int], values: Sequence[float]) -> Schedule:
    """``values[i]`` for the updates between ``boundaries[i - 1]`` and ``boundaries[i]``.

    ``schedule(k) = values[j]`` with ``j`` the number of boundaries ``<= k``:
    ``values[0]`` before the first boundary, ``values[-1]`` from the last one
    on, so update number ``boundaries[i]`` is the first to use ``values[i + 1]``.

    torch equivalents: ``MultiStepLR(optimizer, milestones=boundaries,
    gamma=g)`` is ``values = [lr * g**j for j in range(len(boundaries) + 1)]``;
    ``ConstantLR(optimizer, factor=f, total_iters=n)`` is ``boundaries=[n],
    values=[f * lr, lr]``.

    Raises:
        ValueError: ``boundaries`` is not a sequence of strictly increasing ints
            >= 1; ``values`` does not hold ``len(boundaries) + 1`` finite numbers
            >= 0 with at least one > 0.
    """
    if isinstance(boundaries, (str, bytes)) or not isinstance(boundaries, Sequence):
        raise ValueError(f"boundaries must be a sequence of ints, got boundaries={boundaries!r}")
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(f"values must be a sequence of numbers, got values={values!r}")
    bounds = [check_int(f"boundaries[{i}]", b, minimum=1) for i, b in enumerate(boundaries)]
    if any(b >= c for b, c in zip(bounds, bounds[1:])):
        raise ValueError(f"boundaries must increase strictly, got boundaries={list(boundaries)!r}")
    if len(values) != len(bounds) + 1:
        raise ValueError(
            f"values must hold len(boundaries) + 1 = {len(bounds) + 1} rates, got "
            f"values={list(values)!r}"
        )
    rates = [check_number(f"values[{i}]", v, low=0, high_open=True) for i, v in enumerate(values)]
    if not any(rates):
        raise ValueError(f"values must hold a rate > 0, got values={list(values)!r}")

    def rate(count: Tensor) -> Tensor:
        table = torch.tensor(rates, dtype=torch.float64, device=count.device)
        edges = torch.tensor(bounds, dtype=torch.int64, device=count.device)
        return table[(count >= edges).sum()]

    return Schedule("piecewise_constant", rate, boundaries=bounds, values=rates)


def step_decay(lr: float, step_size: int, gamma: float = 0.1) -> Schedule:
    """``lr`` multiplied by ``gamma`` every ``step_size`` updates.

    ``schedule(k) = lr * gamma ** (k // step_size)``.

    torch equivalent: ``StepLR(optimizer, step_size=step_size, gamma=gamma)``
    (torch's default ``gamma=0.1`` too). For decays at uneven steps
    (``MultiStepLR``) use :func:`piecewise_constant`.

    Raises:
        ValueError: ``lr`` is not a finite number > 0; ``step_size`` is not an int
            >= 1; ``gamma`` is not in (0, 1].
    """
    lr = _rate("lr", lr)
    step_size = check_int("step_size", step_size, minimum=1)
    gamma = check_number("gamma", gamma, low=0, high=1, low_open=True)

    def rate(count: Tensor) -> Tensor:
        decays = torch.div(torch.clamp(count, min=0), step_size, rounding_mode="floor")
        return lr * torch.pow(gamma, _f64(decays))

    return Schedule("step_decay", rate, lr=lr, step_size=step_size, gamma=gamma)
