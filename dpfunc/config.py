"""Settings as data: the privacy settings and the speed settings, each frozen and validated once.

A :class:`DPConfig` holds what decides a run's privacy and nothing else: the
clip norm and clipping mode, the noise (a ``noise_multiplier``, or a
``target_epsilon`` with ``delta`` and ``epochs`` to calibrate one), the
expected batch size, adaptive clipping, correlated noise (``bands``), the
accountant, the epsilon budget and the noise generator. How fast the step
runs (``model`` for ghost clipping, ``method``, ``chunk_size``,
``memory_budget``, ``compile``, ``physical_batch_size``, ``shard``) is a
:class:`SpeedConfig` beside it: it changes the time and the memory of a
step, never what the step releases (beyond float rounding).

It is checked once, when it is built, and it is the one source the step,
the sampler and the accountant read, so the accountant records exactly
what the step releases:

* the noise: ``noise_std = noise_multiplier * clip_norm`` on the clipped sum
  (and ``coefficients``, the banded strategy, with ``bands > 1``), drawn
  through :meth:`DPConfig.noise_mechanism`;
* the clip norm: :meth:`DPConfig.clip_mechanism`, fixed, or moved by a
  noisy count with adaptive clipping;
* the sampler: :meth:`DPConfig.sampler`, Poisson (cyclic over ``bands``
  partitions) at :meth:`DPConfig.sample_rate`, over
  :meth:`DPConfig.poisson_sampler`;
* the accounting event: :meth:`DPConfig.accounting_event`, the
  ``(noise_multiplier, sample_rate)`` of one step, where the multiplier
  covers the gradient sum and, with adaptive clipping, the private count.

A ``target_epsilon`` needs the dataset size before it becomes a noise
multiplier: :meth:`DPConfig.calibrated` returns the config with
``noise_multiplier`` (and ``delta``) resolved.

>>> import dpfunc
>>> config = dpfunc.DPConfig(clip_norm=1.0, noise_multiplier=1.1, expected_batch_size=256)
>>> config.noise_std
1.1
>>> config.accounting_event(60_000)
AccountingEvent(noise_multiplier=1.1, sample_rate=0.004266666666666667)
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, NamedTuple

from torch import nn

from ._checks import check_choice, check_int, check_number
from .accounting import Accountant, calibrate_noise_multiplier, combined_noise_multiplier
from .clipping import CLIPPING_MODES, ClipMechanism, adaptive_clipping, fixed_clipping
from .data import PoissonBatches, Sampler, poisson_sampler
from .datasets import as_dataset, dataset_size
from .matrix_factorization import banded_noise, normalized_coefficients
from .memory import check_memory_budget
from .noise import NoiseMechanism, check_expected_batch_size, independent_noise
from .users import UserBatches, UserIndex

__all__ = [
    "CLIPPING_MODES",
    "METHODS",
    "AccountingEvent",
    "DPConfig",
    "SpeedConfig",
    "settings_from",
]

METHODS = ("auto", "vmap", "ghost")

ACCOUNTING = ("pld", "rdp")
PRIVACY_UNITS = ("example", "user")


class AccountingEvent(NamedTuple):
    """What the accountant records for one logical step (``Accountant.step(*event)``)."""

    noise_multiplier: float  # of the whole release: the sum, and the count if adaptive
    sample_rate: float  # Poisson rate (within a partition when bands > 1)


@dataclasses.dataclass(frozen=True)
class DPConfig:
    """The privacy settings of DP-SGD, validated once.

    Args:
        clip_norm: ``C``, the bound on each example's contribution; ``inf``
            disables clipping (only with ``noise_multiplier=0``: no privacy).
        expected_batch_size: ``sample_rate * num_examples``, the
            denominator of the average (never the realised batch size).
            With ``bands = b > 1``: ``sample_rate * num_examples / b``.
        noise_multiplier: ``sigma``; the noise std is ``sigma * C``. ``0``
            adds no noise (no privacy). Give it or ``target_epsilon``.
        target_epsilon: the epsilon after all planned steps; the smallest
            ``sigma`` reaching it is found by :meth:`calibrated`.
        delta: the delta of the reported epsilon. ``None``: resolved by
            :meth:`calibrated` to the largest power of ten below
            ``1 / num_examples``.
        epochs: planned passes over the data: the Trainer runs
            ``round(epochs * steps_per_epoch)`` steps, and ``target_epsilon``
            is calibrated for them. ``target_epsilon`` needs them when the
            run is planned (:meth:`calibrated`), unless the run's length is
            set elsewhere: ``PrivateTrainer`` fills them in from its
            ``TrainingArguments``.
        clipping: ``"flat"``, ``"per_layer"`` or ``"normalized"`` (see
            :func:`dpfunc.make_train_step`).
        target_quantile: ``None`` (fixed clipping) or ``gamma`` in (0, 1):
            adaptive clipping (Andrew et al. 2021), flat clipping only.
        quantile_learning_rate: ``eta > 0`` of the geometric update.
        count_noise_multiplier: the std of the noise on the count of
            unclipped examples (sensitivity 1). Default with
            ``target_quantile``: ``expected_batch_size / 20``.
        bands: ``1`` (DP-SGD) or ``b > 1``: banded correlated noise with
            cyclic Poisson sampling (:mod:`dpfunc.matrix_factorization`).
            Not with ``target_quantile``.
        accounting: ``"pld"`` (tight, default) or ``"rdp"``.
        epsilon_budget: the Trainer stops before a step would take epsilon
            (at ``delta``) past it. ``None``: no budget beyond the plan.
        secure_noise: draw the noise from a cryptographically secure
            generator (``standard_normal_like(..., secure=True)``).
        privacy_unit: ``"example"`` (default) or ``"user"``: what one unit
            of the guarantee is. ``"user"`` protects everything one user
            contributed (user-level sampling, :mod:`dpfunc.users`): each step
            samples users, takes at most ``max_examples_per_user`` of each
            sampled user's examples, clips the mean of their gradients once,
            and every count above (``expected_batch_size``, ``epochs``, the
            accountant's) is of users. The user of each example is given
            beside the dataset (``users=``).
        max_examples_per_user: ``k``, the most examples of one user in one
            step; only with ``privacy_unit="user"``, which needs it.

    Raises:
        ValueError, TypeError: a setting is invalid or the combination is
            (the message names the argument and its value).
    """

    clip_norm: float
    expected_batch_size: float
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    delta: float | None = None
    epochs: float | None = None
    clipping: str = "flat"
    target_quantile: float | None = None
    quantile_learning_rate: float = 0.2
    count_noise_multiplier: float | None = None
    bands: int = 1
    accounting: str = "pld"
    epsilon_budget: float | None = None
    secure_noise: bool = False
    privacy_unit: str = "example"
    max_examples_per_user: int | None = None

    def __post_init__(self) -> None:
        clip = check_number(
            "clip_norm", self.clip_norm, low=0, low_open=True, note="(inf disables clipping)"
        )
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError(
                "give exactly one of noise_multiplier and target_epsilon, got "
                f"noise_multiplier={self.noise_multiplier!r}, "
                f"target_epsilon={self.target_epsilon!r}"
            )
        if self.noise_multiplier is not None:
            check_number("noise_multiplier", self.noise_multiplier, low=0, high_open=True)
        if math.isinf(clip) and self.noise_multiplier != 0:
            raise ValueError(
                "clip_norm=inf leaves each example's influence unbounded, so no noise makes "
                "the run private; give a finite clip_norm (or noise_multiplier=0 for a "
                f"non-private baseline), got noise_multiplier={self.noise_multiplier!r}, "
                f"target_epsilon={self.target_epsilon!r}"
            )
        if self.target_epsilon is not None:
            check_number("target_epsilon", self.target_epsilon, low=0, low_open=True,
                         high_open=True)  # fmt: skip
        if self.delta is not None:
            check_number("delta", self.delta, low=0, high=1, low_open=True, high_open=True)
        if self.epochs is not None:  # with target_epsilon, calibrated() needs them
            check_number("epochs", self.epochs, low=0, low_open=True, high_open=True)
        check_expected_batch_size(self.expected_batch_size)
        check_choice("clipping", self.clipping, CLIPPING_MODES)
        if self.clipping == "normalized" and math.isinf(clip):
            raise ValueError("clipping='normalized' needs a finite clip_norm, got clip_norm=inf")
        check_int("bands", self.bands, minimum=1)
        check_choice("accounting", self.accounting, ACCOUNTING)
        if self.epsilon_budget is not None:
            check_number("epsilon_budget", self.epsilon_budget, low=0, low_open=True)
        if not isinstance(self.secure_noise, bool):
            raise ValueError(f"secure_noise must be a bool, got secure_noise={self.secure_noise!r}")
        self._check_unit()
        if self.target_quantile is not None:
            self._check_adaptive()
        elif self.count_noise_multiplier is not None or self.quantile_learning_rate != 0.2:
            raise ValueError(  # nothing is silently dropped
                "count_noise_multiplier and quantile_learning_rate set adaptive clipping, which "
                "is off (target_quantile=None); give target_quantile or leave them out, got "
                f"count_noise_multiplier={self.count_noise_multiplier!r}, "
                f"quantile_learning_rate={self.quantile_learning_rate!r}"
            )

    def _check_unit(self) -> None:
        check_choice("privacy_unit", self.privacy_unit, PRIVACY_UNITS)
        k = self.max_examples_per_user
        if self.privacy_unit == "example":
            if k is not None:
                raise ValueError(  # nothing is silently dropped
                    "max_examples_per_user bounds a user's examples in a step of user-level "
                    "privacy; give privacy_unit='user' (and users= beside the dataset) or leave "
                    f"it out, got max_examples_per_user={k!r} with privacy_unit='example'"
                )
            return
        if k is None:
            raise ValueError(
                "privacy_unit='user' needs max_examples_per_user=k, the most examples of one "
                "user in a step (e.g. 4), got max_examples_per_user=None"
            )
        object.__setattr__(self, "max_examples_per_user", int(check_int("max_examples_per_user", k,
                                                                        minimum=1)))  # fmt: skip
        unsupported = {"target_quantile": self.target_quantile, "bands": self.bands}
        given = {name: v for name, v in unsupported.items() if v not in (None, 1)}
        if given:
            raise ValueError(
                "privacy_unit='user' runs with a fixed clip norm and independent noise: "
                "adaptive clipping's count and correlated noise's partitions are not yet "
                "defined over users; use target_quantile=None and bands=1, got "
                + ", ".join(f"{name}={v!r}" for name, v in given.items())
            )

    def _check_adaptive(self) -> None:
        check_number("target_quantile", self.target_quantile, low=0, high=1, low_open=True,
                     high_open=True)  # fmt: skip
        check_number("quantile_learning_rate", self.quantile_learning_rate, low=0,
                     low_open=True, high_open=True)  # fmt: skip
        if self.count_noise_multiplier is None:  # Andrew et al. 2021's suggestion
            object.__setattr__(self, "count_noise_multiplier", self.expected_batch_size / 20)
        check_number("count_noise_multiplier", self.count_noise_multiplier, low=0,
                     low_open=True, high_open=True)  # fmt: skip
        if self.clipping != "flat" or math.isinf(self.clip_norm):
            raise ValueError(
                "adaptive clipping (target_quantile) follows a quantile of the flat "
                "per-example norms from a finite starting clip_norm; it needs "
                f"clipping='flat', got clipping={self.clipping!r}, clip_norm={self.clip_norm!r}"
            )
        if self.bands > 1:
            raise ValueError(
                "adaptive clipping (target_quantile) is not combined with correlated noise: "
                "the amplification theorem for bands > 1 is stated for one fixed clip norm and "
                "no other release; use target_quantile=None or bands=1, got "
                f"target_quantile={self.target_quantile!r}, bands={self.bands!r}"
            )

    # -- what the step releases ---------------------------------------------------

    @property
    def adaptive(self) -> bool:
        """Adaptive clipping is on: each step also releases a noisy count."""
        return self.target_quantile is not None

    @property
    def noise_std(self) -> float:
        """The std of the noise on the clipped sum, ``noise_multiplier * clip_norm``.

        The sensitivity of the clipped sum is ``clip_norm`` in every mode.
        ``0.0`` without noise; with adaptive clipping the step scales by
        the current clip norm instead of this value.
        """
        sigma = self._resolved_noise_multiplier()
        return 0.0 if sigma == 0 else sigma * float(self.clip_norm)

    @property
    def coefficients(self) -> list[float]:
        """The banded strategy with unit column norm (``[1.0]`` for DP-SGD)."""
        return normalized_coefficients(self.bands)

    @property
    def accounted_noise_multiplier(self) -> float:
        """The noise multiplier of one step's whole release (sum and, if adaptive, count)."""
        sigma = self._resolved_noise_multiplier()
        if not self.adaptive:
            return sigma
        return combined_noise_multiplier(sigma, self.count_noise_multiplier)

    def _resolved_noise_multiplier(self) -> float:
        if self.noise_multiplier is None:
            raise ValueError(
                f"this DPConfig has target_epsilon={self.target_epsilon!r} and no "
                "noise_multiplier yet; use config.calibrated(num_examples), which finds it"
            )
        return float(self.noise_multiplier)

    def noise_mechanism(self) -> NoiseMechanism:
        """The noise the step adds, as an ``(init, update)`` pair: the optimizers' protocol.

        :func:`dpfunc.noise.independent_noise` with ``bands = 1``;
        :func:`dpfunc.matrix_factorization.banded_noise` of
        :attr:`coefficients` with ``bands > 1``. ``init(params)`` gives the
        state, ``TrainState.noise_state``; ``update(z, state, params=None) ->
        (w, state)`` turns the step's standard-normal draw into the noise it
        adds (times :attr:`noise_std`).
        """
        if self.bands == 1:
            return independent_noise()
        return banded_noise(self.coefficients)

    def clip_mechanism(self) -> ClipMechanism:
        """The clip norm of each step, as an ``(init, update)`` pair: the optimizers' protocol.

        :func:`dpfunc.clipping.fixed_clipping` at ``clip_norm``, or with
        ``target_quantile`` :func:`dpfunc.clipping.adaptive_clipping` from
        it. ``init(params)`` gives the state, ``TrainState.clip_state``;
        ``update(count, state, params=None) -> (clip_norm, state)`` takes the
        logical batch's :class:`dpfunc.clipping.UnclippedCount` (``None``
        with a fixed norm) and gives the next step's clip norm.
        """
        if not self.adaptive:
            return fixed_clipping(self.clip_norm)
        return adaptive_clipping(
            self.clip_norm,
            self.expected_batch_size,
            self.target_quantile,
            self.quantile_learning_rate,
            self.count_noise_multiplier,
        )

    # -- what the sampler and the accountant need: the dataset size ----------------

    def poisson_sampler(self, num_examples: int) -> Sampler:
        """The pure sampler of this config for ``num_examples`` examples.

        :func:`dpfunc.data.poisson_sampler` at :meth:`sample_rate`, cyclic
        over ``bands`` partitions; :meth:`sampler` iterates over it.
        """
        if self.privacy_unit == "user":
            raise ValueError(
                "privacy_unit='user' samples users, and a user's examples together: use "
                "config.sampler(dataset, physical_batch_size, seed=..., users=dpfunc.users."
                "index_users(ids, len(dataset))), or dpfunc.users.UserBatches"
            )
        return poisson_sampler(num_examples, self.sample_rate(num_examples), bands=self.bands)

    def sample_rate(self, num_examples: int) -> float:
        """Each example's Poisson inclusion probability (within its partition if bands > 1).

        Raises:
            ValueError: ``expected_batch_size * bands`` exceeds ``num_examples``.
        """
        n = check_int("num_examples", num_examples, minimum=1)
        check_number(
            "expected_batch_size", self.expected_batch_size, low=0, high=n, low_open=True,
            note="(at most the dataset size)" if self.privacy_unit == "example" else
            f"(it counts users with privacy_unit='user': at most the {n} users)",
        )  # fmt: skip
        if self.expected_batch_size * self.bands > n:
            raise ValueError(
                f"with bands={self.bands} each step samples from one of {self.bands} partitions "
                f"of about {n / self.bands:.6g} examples, so expected_batch_size must be at most "
                f"num_examples / bands = {n / self.bands:.6g}, got "
                f"expected_batch_size={self.expected_batch_size!r}"
            )
        return self.expected_batch_size * self.bands / n

    def steps_per_epoch(self, num_examples: int) -> int:
        """``round(num_examples / expected_batch_size)``, at least 1."""
        return max(1, round(num_examples / self.expected_batch_size))

    def total_steps(self, num_examples: int) -> int:
        """The planned steps, ``round(epochs * steps_per_epoch)``, at least 1."""
        if self.epochs is None:
            raise ValueError(
                "the planned number of steps needs epochs; give DPConfig(epochs=...), got "
                "epochs=None"
            )
        return max(1, round(self.epochs * self.steps_per_epoch(num_examples)))

    def accounting_event(self, num_examples: int) -> AccountingEvent:
        """What the accountant records for each logical step, empty ones too."""
        return AccountingEvent(self.accounted_noise_multiplier, self.sample_rate(num_examples))

    def accountant(self) -> Accountant:
        """An empty accountant of this config's method and bands."""
        return Accountant(method=self.accounting, bands=self.bands)

    def sampler(
        self,
        dataset: Any,
        physical_batch_size: int,
        *,
        seed: int | None,
        rank: int = 0,
        world_size: int = 1,
        users: Any = None,
    ) -> PoissonBatches:
        """The Poisson sampler of this config for ``dataset`` (cyclic with ``bands > 1``).

        With ``privacy_unit="user"``, ``users`` is the dataset's
        :class:`dpfunc.users.UserIndex` and the sampler samples users
        (:class:`dpfunc.users.UserBatches`).
        """
        if self.privacy_unit == "user":
            if not isinstance(users, UserIndex):
                raise ValueError(
                    "privacy_unit='user' samples users: give users=, the dataset's "
                    "dpfunc.users.UserIndex (dpfunc.users.index_users(ids, len(dataset))), got "
                    f"users={users!r:.60}"
                )
            return UserBatches(
                dataset,
                users,
                self.sample_rate(users.num_users),
                physical_batch_size,
                self.max_examples_per_user,
                seed=seed,
                rank=rank,
                world_size=world_size,
            )
        batches = PoissonBatches(
            dataset,
            self.sample_rate(dataset_size(as_dataset(dataset))),
            physical_batch_size,
            seed=seed,
            rank=rank,
            world_size=world_size,
            bands=self.bands,
        )
        return batches

    def calibrated(self, num_examples: int) -> DPConfig:
        """This config for ``num_examples`` examples, ``noise_multiplier`` and ``delta`` resolved.

        With ``target_epsilon``, finds the smallest combined noise multiplier
        whose epsilon after :meth:`total_steps` steps is at most the target
        (:func:`dpfunc.accounting.calibrate_noise_multiplier`); with
        adaptive clipping the count keeps ``count_noise_multiplier`` and
        the gradient sum gets what it leaves. The result has
        ``target_epsilon=None``. A ``delta`` of ``1 / num_examples`` or
        more gets a warning: it allows releasing a whole example.

        Raises:
            ValueError: the dataset is smaller than the batch needs, or the
                count's noise alone leaves no room for the target.
        """
        rate = self.sample_rate(num_examples)
        delta = self.delta
        if delta is None:
            delta = 10.0 ** -(math.floor(math.log10(num_examples)) + 1)
        elif delta >= 1 / num_examples:
            warnings.warn(
                f"delta={delta!r} is not below 1/num_examples={1 / num_examples:.3g}: a "
                "mechanism that publishes one whole random example meets it. Use delta < 1/n.",
                stacklevel=3,
            )
        if self.target_epsilon is None:
            return dataclasses.replace(self, delta=delta)
        accounted = calibrate_noise_multiplier(
            self.target_epsilon,
            delta,
            rate,
            self.total_steps(num_examples),
            method=self.accounting,
            bands=self.bands,
        )
        sigma = accounted
        if self.adaptive:  # the count takes its share of the budget
            count = self.count_noise_multiplier
            if not count > accounted:
                raise ValueError(
                    f"target_epsilon={self.target_epsilon!r} needs a combined noise multiplier "
                    f"of {accounted:.4g}, which count_noise_multiplier={count!r} alone does not "
                    "leave room for; raise it"
                )
            sigma = sum_noise_multiplier(accounted, count)
        return dataclasses.replace(self, noise_multiplier=sigma, target_epsilon=None, delta=delta)


def sum_noise_multiplier(accounted: float, count_noise_multiplier: float) -> float:
    """The gradient sum's share of a combined noise multiplier, never leaving it too low.

    The inverse of :func:`dpfunc.accounting.combined_noise_multiplier` for a
    fixed count multiplier (``> accounted``): ``(accounted**-2 - count**-2)
    ** -0.5``, raised by as many ulps as rounding needs so that the combined
    multiplier the accountant sees is at least ``accounted`` (a smaller one
    would put the epsilon above the one calibrated for).
    """
    count = count_noise_multiplier
    sigma = (accounted**-2 - count**-2) ** -0.5
    while combined_noise_multiplier(sigma, count) < accounted:
        sigma = math.nextafter(sigma, math.inf)
    return sigma


@dataclasses.dataclass(frozen=True)
class SpeedConfig:
    """How fast, and in how much memory, a private step runs; never what it releases.

    Args:
        model: the ``nn.Module`` the loss calls through ``functional_call``;
            enables ghost clipping (``PrivateGradients`` fills in its model).
        method: ``"auto"`` (ghost clipping where cheaper), ``"vmap"`` or
            ``"ghost"`` (needs ``model``); see :func:`dpfunc.make_train_step`.
        chunk_size: at most this many rows' per-example gradients at once
            (the vmap path), or ``None``.
        memory_budget: bytes the vmap path's per-example gradients may take
            at once, or ``None``.
        compile: run the step's local pieces through
            ``torch.compile(fullgraph=True)`` (:meth:`dpfunc.TrainStep.compile`).
        physical_batch_size: rows per micro-batch of the Trainer's and
            ``PrivateGradients``' sampler (``None``: the expected batch per
            rank plus 3 std); a step built alone takes micro-batches as given.
        shard: shard the parameters, optimizer state and noise history over
            the ranks of a distributed run (:mod:`dpfunc.sharding`).

    Privacy: every setting here changes the order of float operations at
    most; the clip margin covers that rounding, so the guarantee is the
    config's whatever the speed settings.

    >>> import dpfunc
    >>> dpfunc.SpeedConfig(method="vmap", chunk_size=32).chunk_size
    32

    Raises:
        ValueError: an unknown ``method``, ``method="ghost"`` without
            ``model``, a ``chunk_size``, ``memory_budget`` or
            ``physical_batch_size`` that is not an int >= 1.
        TypeError: ``model`` is not an ``nn.Module``, ``compile`` or
            ``shard`` is not a bool.
    """

    model: nn.Module | None = None
    method: str = "auto"
    chunk_size: int | None = None
    memory_budget: int | None = None
    compile: bool = False
    physical_batch_size: int | None = None
    shard: bool = False

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, nn.Module):
            raise TypeError(
                f"model must be a torch.nn.Module or None, got {type(self.model).__name__}"
            )
        check_choice("method", self.method, METHODS)
        if self.method == "ghost" and self.model is None:
            raise ValueError(
                "method='ghost' needs model=, the nn.Module that loss_fn calls through "
                "torch.func.functional_call; got model=None"
            )
        for name in ("chunk_size", "physical_batch_size"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), minimum=1)
        check_memory_budget(self.memory_budget)
        for name in ("compile", "shard"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {name}={getattr(self, name)!r}")


def settings_from(
    who: str, config: DPConfig | None, speed: SpeedConfig | None, settings: dict[str, Any]
) -> tuple[DPConfig, SpeedConfig]:
    """``(config, speed)``, each given or built from ``who``'s keywords; never both for one.

    The keyword form names the fields of :class:`DPConfig` and of
    :class:`SpeedConfig` (``clip_norm=1.0, model=model``); they are split by
    name and each dataclass validates its own.

    Raises:
        TypeError: a config (or speed) and keywords of it too, an unknown
            keyword (the message lists both dataclasses' fields), a
            ``speed`` that is not a ``SpeedConfig``.
    """
    _check_known(who, settings)
    fast = {name: settings.pop(name) for name in _fields(SpeedConfig) if name in settings}
    if speed is None:
        speed = SpeedConfig(**fast)
    elif not isinstance(speed, SpeedConfig):
        raise TypeError(f"{who}: speed must be a dpfunc.SpeedConfig, got speed={speed!r}")
    elif fast:
        raise TypeError(
            f"{who} takes the speed settings either as speed= or as keywords, not both; "
            f"got speed and {sorted(fast)}"
        )
    return _config_from(who, config, settings), speed


def _config_from(who: str, config: DPConfig | None, settings: dict[str, Any]) -> DPConfig:
    if config is None:
        return DPConfig(**settings)
    if not isinstance(config, DPConfig):
        raise TypeError(f"{who}: config must be a dpfunc.DPConfig, got config={config!r}")
    if settings:
        raise TypeError(
            f"{who} takes the privacy settings either as config= or as keywords, not both; "
            f"got config and {sorted(settings)}"
        )
    return config


def _fields(kind: type) -> list[str]:
    return [field.name for field in dataclasses.fields(kind)]


def _check_known(who: str, settings: dict[str, Any]) -> None:
    privacy, speed = _fields(DPConfig), _fields(SpeedConfig)
    unknown = sorted(set(settings) - set(privacy) - set(speed))
    if unknown:
        raise TypeError(
            f"{who} got unexpected keyword arguments {unknown}; its privacy settings "
            f"(dpfunc.DPConfig) are {privacy} and its speed settings (dpfunc.SpeedConfig) "
            f"are {speed}"
        )
