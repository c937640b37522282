"""What a run's privacy is: the privacy report, and the steps an epsilon budget allows.

Both are functions of plain inputs (a calibrated :class:`dpfunc.DPConfig`,
the :class:`dpfunc.accounting.Accountant` that recorded the steps, and the
dataset size), so that every loop that trains with dpfunc's pieces reports
the same facts in the same words: :meth:`dpfunc.Trainer.privacy_report`
calls :func:`privacy_report`.

A report states the guarantee, epsilon at a delta after the steps done, and
everything it rests on: the neighbouring relation, the accountant, the
noise multiplier, the sampling, the noise generator and whether its seed is
a secret. It also states what the guarantee does not cover
(:data:`NOT_COVERED`): a reader who publishes a model with its report should
not have to know dpfunc's internals to see what else they must keep private.
Every number is the accountant's or the config's, unchanged: the epsilon is
``accountant.checked_epsilon(delta)``, the accountant's value checked
against ``dp_accounting``'s own accountant run from scratch (the larger of
the two), never a smaller one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from . import accounting
from ._checks import check_int, check_number
from .accounting import Accountant, max_steps_within, participations
from .config import DPConfig

__all__ = ["NOT_COVERED", "PrivacyReport", "privacy_report", "steps_within_budget"]

NEIGHBOURING = "add or remove one example (dp_accounting's ADD_OR_REMOVE_ONE)"
USER_NEIGHBOURING = (
    "add or remove one user with all of their examples (dp_accounting's ADD_OR_REMOVE_ONE over "
    "users; user-level sampling, each sampled user's mean gradient over at most k of their "
    "examples clipped once)"
)
USER_NOT_COVERED = (
    "the user ids and the counts derived from them: which examples share a user, the number of "
    "users and of each user's examples are treated as public; an example whose user id is wrong "
    "(two people under one id, one person under two ids) is protected only as its id's user is"
)

NOT_COVERED = (
    "non-private diagnostics: the step metrics (loss, batch_size, clipped_fraction, nonfinite, "
    "norm quantiles, examples_per_second) and the loss and nonfinite count of the history "
    "records read the data without noise (dpfunc.callbacks.NON_PRIVATE_METRICS); loggers "
    "label them 'nonprivate/'",
    "evaluation on private data: what an eval_fn computes on training or other private data "
    "is not accounted",
    "hyperparameter search: every run on the same data spends its own epsilon, and choosing "
    "among runs is a release of its own, not accounted by this report; a random search run "
    "with dpfunc.tune has its own epsilon, which covers every trial's training and private "
    "score and the release of the best trial (not the trial list), see docs/tuning.md",
    "the checkpoint's secret: a checkpoint holds the secret seed, with which anyone can remove "
    "the noise from every update; a checkpoint is as sensitive as the training data",
    "continuations of one checkpoint: each resume of a secret-seeded run draws fresh samples "
    "and noise (no two continuations share a draw), so releasing two continuations of one "
    "checkpoint (a sweep from it, a rerun after a crash whose later steps were shown) composes "
    "their epsilons; each report covers its own continuation only",
    "non-private metrics fed back into training: a learning-rate schedule, early stopping or "
    "any choice driven by the non-private loss or by evaluation on private data (e.g. "
    "ReduceLROnPlateau on the training loss) makes the run a function of data read without "
    "noise; drive them by the step count, or by public or privately released values",
    "what the caller does to the private gradient: PrivateGradients writes p.grad and checks "
    "that the optimizer steps it, but an in-place change in between (p.grad.add_ of another "
    "gradient, a hand-written update read from another backward) is not seen; only changes "
    "computed from the parameters and public values (weight decay, clipping the noisy "
    "gradient) keep the guarantee, and anything trained outside the private step (a tensor "
    "outside the model) is not covered",
    "side channels of the training process (its timing, memory, the realised batch sizes)",
)
"""What the guarantee of a report does not cover, in the words the report prints."""

_FLOATING_POINT = (
    "the floating-point attack on the noise's low bits (Mironov 2012; Holohan and Braghin "
    "2021): torch's generator gives no defence against it; secure_noise=True defends against "
    "it (see dpfunc.noise)"
)


@dataclasses.dataclass(frozen=True)
class PrivacyReport:
    """The privacy of a run, as data (:meth:`as_dict`) and as text (``str(report)``).

    Attributes:
        epsilon: the accountant's epsilon at ``delta`` after ``steps`` steps
            (``inf`` when a step had no noise).
        delta: the delta of ``epsilon``.
        neighbouring: the neighbouring relation of the guarantee.
        accounting: ``"pld"`` or ``"rdp"``; ``accountant``: its description;
            ``value_discretization_interval``: PLD's grid (``None`` for RDP).
        noise_multiplier: ``sigma`` of the clipped sum (noise std
            ``sigma * clip_norm``); ``accounted_noise_multiplier``: what the
            accountant records per step (with adaptive clipping, the sum and
            the noisy count as one Gaussian mechanism; else ``sigma``);
            ``count_noise_multiplier``: the count's (``None`` without
            adaptive clipping).
        clip_norm, clipping, target_quantile: the clipping (``clip_norm`` is
            the starting one under adaptive clipping, ``target_quantile``
            not ``None``).
        sample_rate: ``q``, each example's Poisson inclusion probability
            (within its partition when ``bands > 1``); ``expected_batch_size``
            and ``num_examples``: what gives it.
        steps: logical steps accounted; ``planned_steps``: the plan of the
            config's ``epochs`` (``None`` without); ``epsilon_budget``: the
            config's (``None`` without).
        sampling: Poisson, or cyclic Poisson over ``bands`` partitions;
            ``participations``: the most steps any example has taken part in.
        noise_generator: which generator drew the noise; ``seed_is_secret``
            and ``seed``: whether its seed is a secret from the OS CSPRNG.
        not_covered: what the guarantee does not cover.
        privacy_unit: ``"example"`` or ``"user"``: what the guarantee protects;
            with ``"user"``, ``num_examples`` and ``expected_batch_size``
            count users, ``users`` says where the ids come from, how many
            users and examples there are and ``k``, and
            ``max_examples_per_user`` is ``k``.
    """

    epsilon: float
    delta: float
    neighbouring: str
    accounting: str
    accountant: str
    value_discretization_interval: float | None
    noise_multiplier: float
    accounted_noise_multiplier: float
    count_noise_multiplier: float | None
    clip_norm: float
    clipping: str
    target_quantile: float | None
    sample_rate: float
    expected_batch_size: float
    num_examples: int
    steps: int
    planned_steps: int | None
    epsilon_budget: float | None
    bands: int
    participations: int
    sampling: str
    noise_generator: str
    secure_noise: bool
    seed_is_secret: bool
    seed: str
    not_covered: tuple[str, ...]
    privacy_unit: str = "example"
    users: str | None = None
    max_examples_per_user: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """The report as a dict of plain Python values (``not_covered`` a list), for JSON."""
        fields = dataclasses.asdict(self)
        fields["not_covered"] = list(self.not_covered)
        return fields

    def __str__(self) -> str:
        steps = f"{self.steps}" + (
            f" of {self.planned_steps} planned" if self.planned_steps is not None else ""
        )
        noise = f"sigma = {self.noise_multiplier:.6g} on the clipped sum (std sigma * C)"
        if self.count_noise_multiplier is not None:
            noise += (
                f"; count sigma = {self.count_noise_multiplier:.6g}; accounted sigma = "
                f"{self.accounted_noise_multiplier:.6g} (sum and count together)"
            )
        clipping = f"{self.clipping}, C = {self.clip_norm:.6g}"
        if self.target_quantile is not None:
            clipping += f" at the start, adaptive to the {self.target_quantile:.3g} quantile"
        unit = self.privacy_unit
        lines = [
            "Privacy report (DP-SGD)",
            f"  guarantee:       ({self.epsilon:.6g}, {self.delta:.6g})-DP per {unit} after "
            f"{steps} steps"
            + (f", budget epsilon {self.epsilon_budget:.6g}" if self.epsilon_budget else ""),
            f"  neighbouring:    {self.neighbouring}",
            *([f"  users:           {self.users}"] if self.users else []),
            f"  accountant:      {self.accountant}",
            f"  noise:           {noise}",
            f"  clipping:        {clipping}",
            f"  sampling:        {self.sampling}",
            f"  sample rate:     q = {self.sample_rate:.6g} (expected batch "
            f"{self.expected_batch_size:.6g} of {self.num_examples} {unit}s)",
            f"  participations:  at most {self.participations} steps per {unit}",
            f"  noise generator: {self.noise_generator}",
            f"  seed:            {self.seed}",
            "  not covered by the guarantee:",
            *(f"    - {item}" for item in self.not_covered),
        ]
        return "\n".join(lines)


def _check_inputs(config: Any, accountant: Any, num_examples: Any, seed_is_secret: Any) -> None:
    if not isinstance(config, DPConfig):
        raise TypeError(f"config must be a dpfunc.DPConfig, got config={config!r}")
    if not isinstance(accountant, Accountant):
        raise TypeError(
            f"accountant must be a dpfunc.accounting.Accountant, got accountant={accountant!r}"
        )
    check_int("num_examples", num_examples, minimum=1)
    if not isinstance(seed_is_secret, bool):
        raise TypeError(f"seed_is_secret must be a bool, got seed_is_secret={seed_is_secret!r}")
    if config.noise_multiplier is None:
        raise ValueError(
            f"config has target_epsilon={config.target_epsilon!r} and no noise_multiplier yet; "
            "report on config.calibrated(num_examples), the config the run trained with"
        )
    if (accountant.method, accountant.bands) != (config.accounting, config.bands):
        raise ValueError(
            f"the accountant (method={accountant.method!r}, bands={accountant.bands}) is not "
            f"the config's (accounting={config.accounting!r}, bands={config.bands})"
        )
    event = tuple(config.accounting_event(num_examples))
    others = [run for run in accountant.history if tuple(run[:2]) != event]
    if others:
        raise ValueError(
            f"the accountant recorded runs {others} (noise_multiplier, sample_rate, steps) "
            f"other than the config's step (noise_multiplier, sample_rate) = {event} for "
            f"num_examples={num_examples}; this report describes the config's steps only"
        )


def _generator(secure: bool) -> str:
    if secure:
        return (
            "ChaCha20 keystream keyed by SHA-256(seed, step), Box-Muller in float64 "
            "(secure_noise=True, a cryptographically secure generator)"
        )
    return (
        "torch's generator keyed by SHAKE-256(seed, step): Mersenne Twister on the CPU, "
        "Philox on CUDA (statistically sound, not cryptographically secure)"
    )


def _seed(secret: bool) -> str:
    if secret:
        return "a secret drawn from the operating system's CSPRNG, kept in memory and checkpoints"
    return (
        "FIXED (given by the user): whoever knows it can regenerate and subtract the noise and "
        "knows every batch, so the guarantee does NOT hold against them; for research on public "
        "data only"
    )


def privacy_report(
    config: DPConfig,
    accountant: Accountant,
    num_examples: int,
    *,
    seed_is_secret: bool,
    delta: float | None = None,
    users: str | None = None,
) -> PrivacyReport:
    """The privacy report of a run of ``config`` on ``num_examples`` examples (or users).

    Args:
        config: the run's calibrated config (``config.calibrated(n)``: its
            ``noise_multiplier`` resolved), the one every step used.
        accountant: the accountant that recorded the run's steps.
        num_examples: the dataset size ``n``; with ``privacy_unit="user"``,
            the number of users.
        seed_is_secret: whether the seed that keyed the samples and the
            noise was drawn from the OS CSPRNG (``False``: a fixed seed,
            which the report says voids the guarantee against whoever
            knows it).
        delta: the delta of the reported epsilon; ``None``: ``config.delta``.
        users: with ``privacy_unit="user"``, where the ids come from and how
            many users and examples they group (the run's words); required there.

    Returns:
        a :class:`PrivacyReport`; its ``epsilon`` is
        ``accountant.checked_epsilon(delta)`` (``accountant.epsilon(delta)``,
        unless dp_accounting's accountant from scratch gives more).

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: ``delta`` outside ``(0, 1)`` (as the accountant checks
            it), or both it and ``config.delta`` are ``None``; the config has
            no ``noise_multiplier`` yet; the accountant's method or bands
            are not the config's, or it recorded steps other than the
            config's ``(noise_multiplier, sample_rate)``.
    """
    _check_inputs(config, accountant, num_examples, seed_is_secret)
    if delta is None:
        if config.delta is None:
            raise ValueError("give delta: config.delta is None (calibrate the config first)")
        delta = config.delta
    # validates delta as the accountant does; checked against dp_accounting from scratch
    epsilon = accountant.checked_epsilon(delta)
    pld = config.accounting == "pld"
    grid = accounting.PLD_VALUE_DISCRETIZATION_INTERVAL if pld else None
    described = (
        f"PLD (dp_accounting's PLDAccountant, value discretization interval {grid:g}, "
        "pessimistic estimate: an upper bound)"
        if pld
        else "RDP (dp_accounting's RdpAccountant over its default orders: an upper bound)"
    )
    bands, steps = config.bands, accountant.steps
    sampling = (
        f"Poisson: each {config.privacy_unit} joins each step's batch independently with "
        "probability q"
        + (
            " (then at most k of a sampled user's examples, drawn afresh each step from the "
            "secret stream)"
            if config.privacy_unit == "user"
            else ""
        )
        if bands == 1
        else f"cyclic Poisson over b = {bands} partitions: step t samples partition t mod "
        f"{bands} at rate q, with banded correlated noise (accounted as ceil(steps / {bands}) "
        "DP-SGD steps, Choquette-Choo et al. 2023)"
    )
    not_covered = NOT_COVERED if config.secure_noise else (*NOT_COVERED, _FLOATING_POINT)
    by_user = config.privacy_unit == "user"
    if by_user and not users:
        raise ValueError(
            "a user-level report names its users: give users= (where the ids come from, how "
            "many users and examples), got users=None"
        )
    if by_user:
        not_covered = (*not_covered, USER_NOT_COVERED)
    return PrivacyReport(
        epsilon=epsilon,
        delta=float(delta),
        neighbouring=USER_NEIGHBOURING if by_user else NEIGHBOURING,
        accounting=config.accounting,
        accountant=described,
        value_discretization_interval=grid,
        noise_multiplier=float(config.noise_multiplier),
        accounted_noise_multiplier=config.accounted_noise_multiplier,
        count_noise_multiplier=config.count_noise_multiplier,
        clip_norm=float(config.clip_norm),
        clipping=config.clipping,
        target_quantile=config.target_quantile,
        sample_rate=config.sample_rate(num_examples),
        expected_batch_size=float(config.expected_batch_size),
        num_examples=num_examples,
        steps=steps,
        planned_steps=config.total_steps(num_examples) if config.epochs is not None else None,
        epsilon_budget=config.epsilon_budget,
        bands=bands,
        participations=participations(steps, bands),
        sampling=sampling,
        noise_generator=_generator(config.secure_noise),
        secure_noise=config.secure_noise,
        seed_is_secret=seed_is_secret,
        seed=_seed(seed_is_secret),
        not_covered=not_covered,
        privacy_unit=config.privacy_unit,
        users=users if by_user else None,
        max_examples_per_user=config.max_examples_per_user,
    )


def steps_within_budget(
    config: DPConfig, num_examples: int, epsilon_budget: float | None, delta: float
) -> int:
    """The most steps, up to the planned ones, whose epsilon at ``delta`` is within the budget.

    Every step of a run of ``config`` is the same accounting event, so
    :func:`dpfunc.accounting.max_steps_within` finds it (about
    ``log2(planned)`` evaluations of the accountant). A run that stops
    before step ``steps_within_budget(...) + 1`` never exceeds the budget,
    the step that would exceed it included.

    Args:
        config: a calibrated config with ``epochs`` (the plan).
        num_examples: the dataset size.
        epsilon_budget: a number ``> 0``, or ``None`` (no budget: the plan).
        delta: in ``(0, 1)``.

    Returns:
        an int in ``[0, config.total_steps(num_examples)]``; ``0`` when one
        step already exceeds the budget.

    Raises:
        ValueError: as :func:`dpfunc.accounting.max_steps_within`.
    """
    planned = config.total_steps(num_examples)
    if epsilon_budget is None:
        return planned
    check_number("epsilon_budget", epsilon_budget, low=0, low_open=True)
    event = config.accounting_event(num_examples)
    return max_steps_within(
        epsilon_budget, delta, *event, planned, config.accounting, bands=config.bands
    )
