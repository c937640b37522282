"""Empirical privacy auditing: lower bounds on epsilon from canary experiments.

An accountant's epsilon is an upper bound that holds if the code does what
the analysis assumes. An audit measures instead: train many times with and
without one chosen example (the *canary*), score each run with a statistic
that should be larger when the canary was present, and turn the two sets of
scores into an epsilon that the runs *prove*. If the code is sound, that
lower bound stays below the accountant's epsilon (up to the stated
confidence); if the code leaks more than it claims (too little noise, a
missing clip, a data-dependent denominator, a seed the attacker knows), the
lower bound can exceed the claim, and the audit has caught it.

Two pieces:

* :func:`epsilon_lower_bound` turns scores into a bound. It is the
  hypothesis-testing view of differential privacy (Kairouz, Oh and
  Viswanath 2015; as used for auditing by Jagielski, Ullman and Oprea 2020,
  "Auditing Differentially Private Machine Learning: How Private is Private
  SGD?", and Nasr, Song, Thakurta, Papernot and Carlini 2021, "Adversary
  Instantiation"): any test that tells the runs apart with false-positive
  rate ``FPR`` and true-positive rate ``TPR`` certifies ``epsilon >=
  log((TPR - delta) / FPR)``, with the rates replaced by confidence bounds.
* :class:`GradientCanary` and :func:`canary_scores` run the real training
  code (:func:`dpfunc.make_train_step` on the vmap or ghost path, with
  micro-batches and any clipping mode, or :class:`dpfunc.Trainer`) on a
  small problem with a white-box *gradient canary*: an example whose
  gradient is a fixed direction ``u`` with a norm far above the clip norm,
  in coordinates no other example's gradient touches (the Dirac canary of
  Nasr, Hayes, Steinke, Balle, Tramèr, Jagielski, Carlini and Terzis 2023,
  "Tight Auditing of Differentially Private Machine Learning"). The score of
  a run is the total update's projection on ``u``, in units of the clip
  norm, which is how the strongest attacker who sees the final parameters
  and knows everything but the noise and the sample would look.

What an audit proves, and what it does not: a bound above the claimed
epsilon is proof (at the stated confidence) that the implementation is
less private than claimed. A bound below it proves nothing about privacy:
the canary, the statistic and the number of runs limit what it can see,
and with ``n`` runs a side no bound much above ``log(n)`` is reachable.
Audits complement the analytic tests; they do not replace them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from scipy import optimize, stats
from torch import Tensor, nn

from ._checks import check_int, check_number
from .noise import secret_seed
from .tree import Params

__all__ = [
    "CanaryScores",
    "GradientCanary",
    "canary_scores",
    "correlated_noise_scores",
    "epsilon_lower_bound",
    "gaussian_dp_epsilon",
    "gaussian_dp_lower_bound",
    "remove_known_noise",
    "threshold_ranks",
    "train_with_step",
]


# --------------------------------------------------------------------------- the bound


def threshold_ranks(num_scores: int) -> list[int]:
    """The ranks ``k`` at which :func:`epsilon_lower_bound` places its thresholds.

    Powers of two from 1 to ``num_scores / 2``: about ``log2(num_scores)``
    candidates. They are fixed before the
    scores are seen, which is what lets the bound pay for choosing the best
    threshold with a union bound over this short list only.

    >>> threshold_ranks(10)
    [1, 2, 4]
    """
    ranks = [1]
    while 2 * ranks[-1] <= num_scores / 2:
        ranks.append(2 * ranks[-1])
    return ranks


def _as_scores(name: str, scores: Any) -> np.ndarray:
    if isinstance(scores, Tensor):
        scores = scores.detach().cpu().double().numpy()
    try:
        array = np.asarray(scores, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"{name} must be a 1-D tensor or array of numbers, got {type(scores).__name__}"
        ) from error
    if array.ndim != 1 or array.size < 1:
        raise ValueError(f"{name} must be 1-D and non-empty, got shape {array.shape}")
    if not np.isfinite(array).all():
        raise ValueError(
            f"{name} must be finite, got {int((~np.isfinite(array)).sum())} non-finite"
        )
    return array


def _one_sided(positive: np.ndarray, negative: np.ndarray, delta: float, alpha: float) -> float:
    """The bound from events "score at or above a threshold": positive over negative runs.

    Thresholds are the ``k``-th largest negative scores for ``k`` in
    :func:`threshold_ranks`. For a continuous score, the negative
    distribution's mass at or above the ``k``-th largest of ``m`` negative
    scores is ``Beta(k, m - k + 1)``-distributed whatever the score's
    distribution, so its upper confidence bound is exact; the positive runs, independent of that
    threshold, give a Clopper-Pearson lower bound on the true-positive
    rate. Each of its ``2 * len(ranks)`` confidence statements gets
    ``alpha / (2 * len(ranks))`` (a union bound), and ties are broken by
    fresh random keys drawn independently of the scores (a randomised test),
    which makes the order continuous; scores without ties give the same
    result every time.
    """
    m, n = negative.size, positive.size
    ranks = threshold_ranks(m)
    level = alpha / (2 * len(ranks))
    keys = np.random.default_rng().random(m + n)  # fresh, independent of the scores
    order = np.lexsort((keys, np.concatenate([negative, positive])))
    position = np.empty(m + n, dtype=np.int64)
    position[order] = np.arange(m + n)
    negative_positions = np.sort(position[:m])[::-1]  # largest first
    positive_positions = position[m:]
    best = 0.0
    for k in ranks:
        threshold = negative_positions[k - 1]
        fpr_upper = stats.beta.ppf(1 - level, k, m - k + 1)
        hits = int((positive_positions > threshold).sum())
        tpr_lower = stats.beta.ppf(level, hits, n - hits + 1) if hits > 0 else 0.0
        if tpr_lower - delta > 0:
            best = max(best, math.log((tpr_lower - delta) / fpr_upper))
    return best


def epsilon_lower_bound(
    scores_in: Any, scores_out: Any, *, delta: float, confidence: float = 0.95
) -> float:
    """A lower bound on epsilon from runs with and without the canary.

    The largest epsilon that a threshold test on the scores certifies, with
    one-sided confidence bounds in place of its rates and a union bound paying
    for the choice of test (Jagielski, Ullman and Oprea 2020; Nasr et al. 2021).

    Args:
        scores_in: one score per run with the canary (a 1-D tensor, array
            or sequence of finite numbers).
        scores_out: one score per run without it.
        delta: the delta of the claim being audited, in ``[0, 1)``.
        confidence: the probability, over the runs, that the bound holds;
            in ``(0, 1)``.

    Returns:
        ``epsilon_lb >= 0``; ``0.0`` when the runs show nothing. With ``n``
        runs a side, no result exceeds about ``log(n)``.

    Guarantee: if the mechanism is ``(epsilon, delta)``-DP (add/remove-one),
    ``epsilon >= epsilon_lb`` with probability at least ``confidence`` over
    the runs, whatever the mechanism and the scores' distribution or direction,
    provided the scores are independent draws (one per run, or one per canary
    where the canaries of a run are independent experiments, as with
    :class:`GradientCanary`). A result below a claim proves nothing about
    privacy. The tests and their bounds: see docs/auditing.md, "How the lower
    bound is computed".

    Raises:
        ValueError: empty, non-1-D or non-finite scores, or ``delta`` or
            ``confidence`` out of range.
        TypeError: scores that are not numbers.

    >>> rng = np.random.default_rng(1)  # unit Gaussians 1 apart: epsilon 4.4 at 1e-5
    >>> bound = epsilon_lower_bound(rng.normal(1, 1, 10_000), rng.normal(0, 1, 10_000),
    ...                             delta=1e-5)
    >>> 1.76 < bound < 4.4  # about 2.1 from 10,000 scores a side
    True
    """
    positive = _as_scores("scores_in", scores_in)
    negative = _as_scores("scores_out", scores_out)
    check_number("delta", delta, low=0, high=1, high_open=True)
    check_number("confidence", confidence, low=0, high=1, low_open=True, high_open=True)
    alpha = (1 - confidence) / 4  # a quarter for each of the four families of tests
    return max(
        _one_sided(a, b, delta, alpha)
        for a, b in (
            (positive, negative),
            (-negative, -positive),
            (negative, positive),
            (-positive, -negative),
        )
    )


def gaussian_dp_lower_bound(
    scores_in: Any, scores_out: Any, *, confidence: float = 0.95, seed: int = 0
) -> float:
    """A lower bound on ``mu`` for a mechanism whose trade-off curve is Gaussian (``mu``-GDP).

    Under ``mu``-Gaussian differential privacy (Dong, Roth and Su 2022,
    "Gaussian Differential Privacy") every test between the runs with and
    without the canary has false-negative rate ``FNR >= Phi(Phi^-1(1 -
    FPR) - mu)``, so any threshold gives ``mu >= Phi^-1(1 - FPR) -
    Phi^-1(FNR)``; with one-sided Clopper-Pearson upper bounds on both rates
    this holds at the stated confidence. For a Gaussian trade-off every
    threshold sees the same ``mu``, and the rates are estimated best where
    both are near their middle, so the threshold is the midpoint of the
    two medians. The scores are split at random (``seed``) into halves: the
    first fixes the threshold and the direction, the second bounds the
    rates at that one threshold, so nothing is paid for the choice.

    This is the tight auditing of Nasr et al. 2023 for the Gaussian
    mechanism. Unlike :func:`epsilon_lower_bound` it assumes the trade-off
    curve's shape: it is exact when every participation is deterministic
    (sampling rate 1), where DP-SGD and the banded mechanism are Gaussian
    mechanisms, and a heuristic under subsampling, whose curve is not
    Gaussian. Compare ``mu`` with the claim's (``sqrt(steps) /
    noise_multiplier`` at sampling rate 1), or turn it into an epsilon
    with :func:`gaussian_dp_epsilon`.

    Returns:
        ``mu_lb >= 0``; ``0.0`` when the runs show nothing.

    Raises:
        ValueError, TypeError: as :func:`epsilon_lower_bound`.

    >>> rng = np.random.default_rng(0)
    >>> bound = gaussian_dp_lower_bound(rng.normal(1, 1, 20_000), rng.normal(0, 1, 20_000))
    >>> 0.9 < bound < 1.0
    True
    """
    positive = _as_scores("scores_in", scores_in)
    negative = _as_scores("scores_out", scores_out)
    check_number("confidence", confidence, low=0, high=1, low_open=True, high_open=True)
    rng = np.random.default_rng(seed)
    positive, negative = rng.permutation(positive), rng.permutation(negative)
    pick_in, test_in = np.array_split(positive, 2)
    pick_out, test_out = np.array_split(negative, 2)
    if min(pick_in.size, test_in.size, pick_out.size, test_out.size) == 0:
        return 0.0

    sign = 1.0 if np.median(pick_in) >= np.median(pick_out) else -1.0
    threshold = sign * (np.median(pick_in) + np.median(pick_out)) / 2
    ins, outs = sign * test_in, sign * test_out
    level = 1 - confidence  # one statement per rate: half each
    false_positives = int((outs >= threshold).sum())
    false_negatives = int((ins < threshold).sum())
    fpr_upper = stats.beta.ppf(1 - level / 2, false_positives + 1, outs.size - false_positives)
    fnr_upper = stats.beta.ppf(1 - level / 2, false_negatives + 1, ins.size - false_negatives)
    if not (fpr_upper < 1 and fnr_upper < 1):
        return 0.0
    return max(0.0, float(stats.norm.isf(fpr_upper) - stats.norm.ppf(fnr_upper)))


def gaussian_dp_epsilon(mu: float, delta: float) -> float:
    """The epsilon at ``delta`` of a ``mu``-GDP mechanism.

    Solves ``delta = Phi(-eps / mu + mu / 2) - exp(eps) Phi(-eps / mu - mu
    / 2)`` (Dong, Roth and Su 2022, Corollary 2.13) for ``eps >= 0``.

    >>> round(gaussian_dp_epsilon(1.0, 1e-5), 2)
    4.38
    """
    check_number("mu", mu, low=0, high_open=True)
    check_number("delta", delta, low=0, high=1, low_open=True, high_open=True)
    if mu == 0:
        return 0.0

    def excess(eps: float) -> float:
        return (
            stats.norm.cdf(-eps / mu + mu / 2)
            - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)
            - delta
        )

    if excess(0.0) <= 0:
        return 0.0
    high = 1.0
    while excess(high) > 0:
        high *= 2
    return float(optimize.brentq(excess, 0.0, high, xtol=1e-10))


# --------------------------------------------------------------------------- canaries

REAL, CANARY, NULL = 0, 1, 2  # the kinds of rows in a GradientCanary dataset
Columns = tuple[Tensor, Tensor, Tensor]  # x, y, kind


class GradientCanary:
    """A small private problem with ``canaries`` white-box gradient canaries.

    The model is ``nn.Linear(canaries + features, classes, bias=False)``.
    Its first ``canaries`` input coordinates belong to the canaries, one
    each; the ``examples`` real examples (Gaussian features, random labels,
    cross-entropy loss) live in the last ``features`` coordinates, so their
    gradients never touch a canary's weights. Canary ``i`` is the input
    ``canary_norm * e_i`` with the loss ``<model(x), v>`` for a fixed unit
    vector ``v``: its gradient is ``canary_norm * v e_i^T`` whatever the
    parameters, a Dirac canary whose clipped contribution is ``clip_norm``
    times the unit direction ``u_i = v e_i^T`` (Nasr et al. 2023). It goes
    through the model's forward, so the vmap and the ghost paths both clip
    it.

    Canaries are independent experiments: their directions are orthogonal,
    each example is clipped on its own, and DP-SGD's noise is independent
    across coordinates, so one training run yields one score per canary.
    (A mechanism that couples examples, e.g. by dividing by the realised
    batch size, breaks that independence: audit it with ``canaries=1``.)

    Rows are ``(x, y, kind)`` with ``kind`` 0 for a real example, 1 for a
    present canary and 2 for a *null* row whose loss is 0, so its gradient
    and its clipped contribution are exactly 0: ``dataset(included,
    keep_size=True)`` puts a null row where a canary is left out, which
    keeps the dataset size, and so a Trainer's sampling rate and epsilon,
    the same in every run; for a mechanism that only sees the clipped sum,
    a null row and no row are the same.

    Args:
        canaries: the number of canaries, an int >= 1.
        examples: the number of real examples, an int >= 0.
        features: their feature dimension, an int >= 1.
        classes: the model's outputs, an int >= 2.
        canary_norm: the norm of a canary's gradient; far above any clip
            norm you audit.
        seed: fixes the real examples and the initial parameters (public:
            the audit's attacker knows everything but the noise and the
            sample).
    """

    def __init__(
        self,
        canaries: int = 1000,
        *,
        examples: int = 16,
        features: int = 4,
        classes: int = 2,
        canary_norm: float = 1e3,
        seed: int = 0,
    ) -> None:
        check_int("canaries", canaries, minimum=1)
        check_int("examples", examples, minimum=0)
        check_int("features", features, minimum=1)
        check_int("classes", classes, minimum=2)
        check_number("canary_norm", canary_norm, low=0, low_open=True, high_open=True)
        self.canaries, self.examples, self.canary_norm = canaries, examples, float(canary_norm)
        generator = torch.Generator().manual_seed(seed)
        self.model = nn.Linear(canaries + features, classes, bias=False)
        with torch.no_grad():
            self.model.weight.copy_(0.1 * torch.randn(self.model.weight.shape, generator=generator))
        self.params: Params = {"weight": self.model.weight.detach().clone()}
        v = torch.ones(classes)
        v[1::2] = -1.0
        self.v = v / v.norm()
        real = torch.zeros(examples, canaries + features)
        real[:, canaries:] = torch.randn(examples, features, generator=generator)
        self._real = (real, torch.randint(classes, (examples,), generator=generator))

    def loss_fn(self, params: Params, example: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        """The loss of ONE row ``(x, y, kind)``: cross-entropy, the canary's, or 0."""
        x, y, kind = example
        out = torch.func.functional_call(self.model, params, (x.unsqueeze(0),))[0]
        canary = out @ self.v
        real = nn.functional.cross_entropy(out.unsqueeze(0), y.unsqueeze(0))
        return torch.where(kind == CANARY, canary, torch.where(kind == REAL, real, 0 * canary))

    def dataset(
        self, included: Tensor, *, keep_size: bool = False
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The columns ``(x, y, kind)``: the real examples, then the included canaries.

        Args:
            included: a bool tensor ``[canaries]``, True for each canary in
                this run's dataset.
            keep_size: put a null row (zero gradient) for each left-out
                canary, so every run has ``examples + canaries`` rows.
        """
        if not isinstance(included, Tensor) or included.shape != (self.canaries,):
            raise ValueError(
                f"included must be a bool tensor of shape ({self.canaries},), got {included!r}"
            )
        included = included.to(torch.bool)
        rows = torch.arange(self.canaries) if keep_size else torch.nonzero(included).flatten()
        x = torch.zeros(rows.numel(), self.model.in_features)
        x[torch.arange(rows.numel()), rows] = self.canary_norm
        kind = torch.where(included[rows], CANARY, NULL)
        real_x, real_y = self._real
        return (
            torch.cat([real_x, x]),
            torch.cat([real_y, torch.zeros(rows.numel(), dtype=torch.int64)]),
            torch.cat([torch.full((self.examples,), REAL), kind]),
        )

    def scores(self, params: Params) -> Tensor:
        """Each canary's score: the total update's projection on its direction.

        ``<params_0 - params, u_i>`` for the initial ``params_0``: positive
        where the canary pulled the parameters (gradient descent moves
        against the gradient), in the parameters' units. Float64, ``[canaries]``.
        """
        moved = (self.params["weight"] - params["weight"]).double()
        return self.v.double() @ moved[:, : self.canaries]


class CanaryScores(NamedTuple):
    scores_in: Tensor  # float64 [runs * included per run]: canaries present
    scores_out: Tensor  # float64: canaries left out


def canary_scores(
    train: Callable[[Columns], Params],
    canary: GradientCanary,
    runs: int,
    *,
    keep_size: bool = False,
    seed: int = 0,
) -> CanaryScores:
    """Runs ``train`` ``runs`` times, each canary present with probability 1/2.

    Args:
        train: ``train(dataset) -> params``: trains from ``canary.params``
            on the dataset (the columns ``(x, y, kind)``) with the code under
            audit and returns the final parameters, e.g. a
            :class:`dpfunc.Trainer`'s ``fit`` or a loop over
            ``make_train_step``. It must draw its own secret randomness.
        canary: the problem.
        runs: independent training runs, an int >= 1.
        keep_size: see :meth:`GradientCanary.dataset`.
        seed: fixes which canaries each run includes. Public on purpose:
            the auditor knows the experiment's design, the noise stays
            secret.

    Returns:
        ``(scores_in, scores_out)`` for :func:`epsilon_lower_bound`, one
        score per canary and run. Pooling a run's canaries as independent
        samples is sound for DP-SGD as dpfunc implements it: each example is
        clipped on its own, the noise and the Poisson inclusions are
        independent across coordinates and examples, and every
        :mod:`dpfunc.optim` transformation acts coordinate by coordinate
        (measured: correlations between canaries' scores within 1/sqrt(runs)
        for flat, per-layer and normalized clipping with SGD, momentum and
        Adam). A mechanism that couples examples breaks it: dividing by the
        realised batch size, or a Trainer whose sampling rate depends on
        how many canaries a run holds (pass ``keep_size=True`` for Trainer
        audits). Audit those with ``canaries=1``.
    """
    check_int("runs", runs, minimum=1)
    generator = torch.Generator().manual_seed(seed)
    scores_in, scores_out = [], []
    for _ in range(runs):
        included = torch.rand(canary.canaries, generator=generator) < 0.5
        params = train(canary.dataset(included, keep_size=keep_size))
        score = canary.scores(params)
        scores_in.append(score[included])
        scores_out.append(score[~included])
    return CanaryScores(torch.cat(scores_in), torch.cat(scores_out))


def train_with_step(
    step: Any,
    params: Params,
    dataset: Any,
    *,
    steps: int,
    sample_rate: float,
    physical_batch_size: int,
    seed: int | None = None,
    secure_noise: bool = False,
    bands: int = 1,
    iterates: bool = False,
) -> Params | list[Params]:
    """Trains ``steps`` private steps with ``step`` (a TrainStep) the way the Trainer does.

    Each step draws a Poisson sample (:class:`dpfunc.data.PoissonBatches`,
    cyclic over ``bands`` partitions when ``bands > 1``) and runs
    :meth:`~dpfunc.TrainStep.logical_step` on its fixed-shape micro-batches
    with :meth:`~dpfunc.TrainStep.draw_noise`: the one logical step the
    Trainer runs, so adaptive clipping's noisy count is audited too.
    ``seed=None`` draws a fresh secret. Returns the final parameters, or
    with ``iterates=True`` the list of all ``steps + 1`` parameter values
    from the initial ones on (what an attacker who sees every update has).
    """
    from .data import PoissonBatches

    if getattr(getattr(step, "config", None), "privacy_unit", "example") != "example":
        raise ValueError(
            "train_with_step samples examples; a user-level step needs micro-batches of whole "
            "users: audit it through dpfunc.Trainer(..., users=...), as tests/test_audit.py does"
        )
    seed = secret_seed() if seed is None else seed
    batches = PoissonBatches(dataset, sample_rate, physical_batch_size, seed=seed, bands=bands)
    state = step.init(params)
    seen = [state.params]
    for t in range(steps):
        noise = step.draw_noise(state.params, seed=seed, step=t, secure=secure_noise)
        state, _ = step.logical_step(state, batches.logical_batch(t)[0], noise)
        seen.append(state.params)
    return seen if iterates else state.params


def correlated_noise_scores(
    canary: GradientCanary,
    iterates: list[Params],
    *,
    coefficients: Any,
    steps_of: Tensor,
) -> Tensor:
    """Each canary's score from every iterate of a run with correlated noise.

    The attacker who sees every update of a banded-noise run (the
    mechanism's whole release) undoes the correlation: with ``s`` the
    updates projected on a canary's direction, step by step (``[T]``), the
    strategy ``C`` (:func:`dpfunc.matrix_factorization.strategy_matrix` of
    ``coefficients``) makes ``C s`` the canary's signal ``C p`` (``p`` its
    participations) plus white noise, and the best linear test projects
    ``C s`` on ``C p``. With ``bands = 1`` (``C = I``) and every step
    possible, it is the total update's projection over ``sqrt(T)``, as in
    :meth:`GradientCanary.scores`.

    Args:
        canary: the problem.
        iterates: ``T + 1`` parameter values (``train_with_step(...,
            iterates=True)``).
        coefficients: the strategy's coefficients as the step uses them
            (``step.coefficients``, normalised to unit column norm).
        steps_of: a bool tensor ``[T, canaries]``, True where the canary
            can take part (under cyclic sampling: the steps of its
            partition), which is the attacker's guess of ``p``.

    Returns:
        Float64 ``[canaries]``: ``<C s, C p> / ||C p||``.
    """
    from .matrix_factorization import strategy_matrix

    steps = len(iterates) - 1
    if steps < 1:
        raise ValueError(f"iterates must hold at least two parameter values, got {len(iterates)}")
    if not isinstance(steps_of, Tensor) or steps_of.shape != (steps, canary.canaries):
        raise ValueError(
            f"steps_of must be a bool tensor of shape ({steps}, {canary.canaries}), got "
            f"{steps_of!r}"
        )
    totals = torch.stack([canary.scores(p) for p in iterates])  # [T + 1, canaries]
    updates = totals[1:] - totals[:-1]  # each step's projected update
    strategy = strategy_matrix(coefficients, steps)
    signal = strategy @ steps_of.double()
    return (strategy @ updates * signal).sum(0) / signal.norm(dim=0).clamp(min=1e-300)


def remove_known_noise(
    params: Params,
    *,
    seed: int,
    steps: int,
    noise_std: float,
    expected_batch_size: float,
    lr: float,
    secure: bool = False,
) -> Params:
    """The attack a known seed allows: regenerate every step's noise and take it back out.

    For parameters released after ``steps`` steps of plain SGD (learning
    rate ``lr``, no momentum) each step subtracted ``lr * noise_std * z_t /
    expected_batch_size`` with ``z_t = standard_normal_like(params, seed,
    t)``; adding those back leaves the initial parameters minus the exact
    clipped sums. With the run's real seed this removes all privacy; with
    any other seed it adds independent noise and learns nothing. The audit
    tests use it to show both.
    """
    from .noise import standard_normal_like

    scale = lr * noise_std / expected_batch_size
    restored = dict(params)
    for t in range(steps):
        z = standard_normal_like(params, seed=seed, step=t, secure=secure)
        restored = {k: restored[k] + (scale * z[k]).to(restored[k].dtype) for k in restored}
    return restored
