"""The search space: one fixed distribution a trial's hyperparameters are drawn from."""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .._checks import check_int, check_number
from ..config import DPConfig

TRIAL_CONFIG_FIELDS = ("clip_norm", "clipping")
"""DPConfig fields a space may vary: they leave the trial's accounting event unchanged."""


@dataclasses.dataclass(frozen=True)
class Uniform:
    """A float drawn uniformly from ``[low, high)``.

    >>> Uniform(0.0, 1.0).sample(np.random.default_rng(0)) < 1.0
    True
    """

    low: float
    high: float

    def __post_init__(self) -> None:
        check_number("low", self.low, low_open=True, high_open=True)
        check_number("high", self.high, low=self.low, low_open=True, high_open=True)

    def sample(self, rng: np.random.Generator) -> float:
        """One draw from ``rng``."""
        return float(rng.uniform(self.low, self.high))


@dataclasses.dataclass(frozen=True)
class LogUniform:
    """A float whose logarithm is uniform: ``exp(U[log low, log high))``, for rates and norms.

    >>> 1e-3 <= LogUniform(1e-3, 1.0).sample(np.random.default_rng(0)) < 1.0
    True
    """

    low: float
    high: float

    def __post_init__(self) -> None:
        check_number("low", self.low, low=0, low_open=True, high_open=True)
        check_number("high", self.high, low=self.low, low_open=True, high_open=True)

    def sample(self, rng: np.random.Generator) -> float:
        """One draw from ``rng``."""
        return float(math.exp(rng.uniform(math.log(self.low), math.log(self.high))))


@dataclasses.dataclass(frozen=True)
class IntUniform:
    """An int drawn uniformly from ``low, low + 1, ..., high`` (both included).

    >>> IntUniform(3, 3).sample(np.random.default_rng(0))
    3
    """

    low: int
    high: int

    def __post_init__(self) -> None:
        check_int("low", self.low, minimum=-(2**62))
        if check_int("high", self.high, minimum=self.low) > 2**62:
            raise ValueError(f"high must be an int <= 2**62, got high={self.high!r}")

    def sample(self, rng: np.random.Generator) -> int:
        """One draw from ``rng``."""
        return int(rng.integers(self.low, self.high, endpoint=True))


@dataclasses.dataclass(frozen=True)
class Choice:
    """One of ``options``, each with the same probability (any values: names, tuples, None).

    >>> Choice(["sgd", "adam"]).sample(np.random.default_rng(0)) in ("sgd", "adam")
    True
    """

    options: tuple

    def __post_init__(self) -> None:
        if not isinstance(self.options, list | tuple | range):  # ordered: the same draws
            raise TypeError(f"options must be a list or tuple, got options={self.options!r}")
        if len(self.options) == 0:
            raise ValueError(f"options must hold at least one value, got options={self.options!r}")
        object.__setattr__(self, "options", tuple(self.options))

    def sample(self, rng: np.random.Generator) -> Any:
        """One draw from ``rng``."""
        return self.options[int(rng.integers(len(self.options)))]


def _check_space(space: Any) -> dict[str, Any]:
    """The space as a dict, after refusing what would make the search adaptive or unaccounted."""
    if callable(space) and not isinstance(space, Mapping):
        raise TypeError(
            "space must be a dict of name -> distribution or value, got a callable: a space "
            "computed from earlier results would make the search adaptive, which the "
            "repeat-and-select theorem does not cover (each trial must draw from one fixed "
            "distribution); run separate searches instead, and compose their epsilons"
        )
    if not isinstance(space, Mapping):
        raise TypeError(f"space must be a dict of name -> distribution or value, got {space!r}")
    fixed = {f.name for f in dataclasses.fields(DPConfig)} - set(TRIAL_CONFIG_FIELDS)
    for name, value in space.items():
        if not isinstance(name, str):
            raise TypeError(f"space keys must be str, got the key {name!r}")
        if name in fixed:
            raise ValueError(
                f"space[{name!r}] would change each trial's privacy settings, which the "
                "search fixes for every trial (they decide the trial's accounting event: noise, "
                f"sample rate, steps, accountant); set {name} in config, or run one search per "
                f"value and compose their epsilons. A space may vary {list(TRIAL_CONFIG_FIELDS)} "
                "and any setting of your own"
            )
        sample = getattr(value, "sample", None)
        if callable(sample) and not isinstance(value, type):
            _check_sampler(name, sample)
    return dict(space)


def _check_sampler(name: str, sample: Callable) -> None:
    try:
        signature = inspect.signature(sample)
        signature.bind(np.random.default_rng(0))
    except TypeError:
        raise TypeError(
            f"space[{name!r}].sample must take one argument, the random generator, got "
            f"sample{_signature_text(sample)}: a distribution that reads earlier trials would "
            "make the search adaptive, which the repeat-and-select theorem does not cover"
        ) from None
    except ValueError:  # no signature to read (a builtin): called as sample(rng)
        return


def _signature_text(function: Callable) -> str:
    try:
        return str(inspect.signature(function))
    except (TypeError, ValueError):
        return "(...)"


def _draw(space: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """One trial's hyperparameters: each distribution sampled, each constant kept."""
    drawn = {}
    for name, value in space.items():
        sample = getattr(value, "sample", None)
        drawn[name] = sample(rng) if callable(sample) and not isinstance(value, type) else value
    return drawn
