"""Correlated noise: the banded matrix factorization mechanism (DP-BandMF, DP-FTRL).

DP-SGD adds independent noise ``z_t`` to every step's clipped sum. After
``T`` steps of SGD the model has moved by the prefix sum of the noisy
gradients, so it carries the noise ``z_0 + ... + z_{T-1}``, whose variance
grows like ``T``. The matrix factorization mechanism (Denisov, McMahan,
Rush, Smith and Thakurta 2022; Choquette-Choo, McMahan, Rush and Thakurta
2023) factors the prefix-sum workload ``A`` (the all-ones lower-triangular
``T x T`` matrix) as ``A = B C``, privatises ``C X`` (``X`` the sequence of
clipped sums) with Gaussian noise, and releases ``B (C X + Z) = A (X +
C^{-1} Z)``. In DP-SGD form: step ``t`` adds the noise ``(C^{-1} Z)_t``
instead of ``Z_t``. Those draws are correlated across steps, and much of
the noise cancels in the running sum.

This module uses the **banded square root** strategy (Kalinin and Lampert
2024, "Banded Square Root Matrix Factorization for Differentially Private
Model Training"). The square root of ``A`` is the lower-triangular Toeplitz
matrix whose ``k``-th subdiagonal is ``r_k = binom(2k, k) / 4**k``, the
Taylor coefficients of ``(1 - x)**-1/2`` (``1, 1/2, 3/8, 5/16, ...``).
Truncating it to its first ``b`` diagonals gives a ``b``-banded strategy
``C``. No optimisation is involved; ``b = 1`` is ``C = I``, plain DP-SGD.

Privacy, by the amplification theorem for banded strategies
(Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta and Xu 2023,
"(Amplified) Banded Matrix Factorization: A unified approach to private
training", Theorem 4): split the data once, at random, into ``b``
partitions and let step ``t`` Poisson-sample, with rate ``q``, from
partition ``t mod b`` (cyclic Poisson sampling, :mod:`dpfunc.data`). Then
every example's participations are at least ``b`` steps apart, the columns
of ``C`` it touches have disjoint supports, and the banded mechanism with
``C`` normalised to unit maximal column norm and noise multiplier ``sigma``
is as private as DP-SGD with sampling rate ``q`` and noise multiplier
``sigma`` run for ``ceil(T / b)`` steps. dpfunc normalises the strategy by
its :func:`column_norm_sensitivity` (so ``noise_multiplier`` is the
accountant's ``sigma``) and accounts exactly that DP-SGD computation
(:mod:`dpfunc.accounting`, ``bands=``).

The noise recurrence. With the normalised coefficients ``c_0, ..., c_{b-1}``
(``c_0 > 0``), the correlated draw ``w_t = (C^{-1} Z)_t`` solves row ``t``
of ``C w = Z``::

    w_t = (z_t - c_1 w_{t-1} - ... - c_{b-1} w_{t-b+1}) / c_0

so a step needs its own standard-normal tree ``z_t`` and the last ``b - 1``
correlated trees, which live in the train state (``TrainState.noise_state``,
the state of :func:`banded_noise`) as one stacked tensor per parameter
(``[b - 1, *shape]``, newest first): a compiled step stays one graph, and a
checkpoint resumes with its history.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ._checks import check_int
from .noise import NoiseMechanism, NoiseState
from .tree import Params, check_same_structure, tree_leaves, tree_map, tree_structure

__all__ = [
    "banded_noise",
    "banded_sqrt_coefficients",
    "column_norm_sensitivity",
    "correlated_noise",
    "init_noise_history",
    "normalized_coefficients",
    "solve_recurrence",
    "strategy_matrix",
]


def banded_sqrt_coefficients(bands: int) -> tuple[float, ...]:
    """The first ``bands`` diagonals of the square root of the prefix-sum matrix.

    ``r_k = binom(2k, k) / 4**k`` for ``k < bands`` (Kalinin and Lampert
    2024): ``r_0 = 1`` and ``r_k = r_{k-1} (2k - 1) / (2k)``. They decrease
    to 0 like ``1 / sqrt(pi k)``. The strategy ``C`` is the lower-triangular
    Toeplitz matrix with ``C[i, j] = r_{i-j}`` for ``0 <= i - j < bands``.

    Raises:
        ValueError: ``bands`` is not an int >= 1.

    >>> banded_sqrt_coefficients(4)
    (1.0, 0.5, 0.375, 0.3125)
    """
    check_int("bands", bands, minimum=1)
    coefficients = [1.0]
    for k in range(1, bands):
        coefficients.append(coefficients[-1] * (2 * k - 1) / (2 * k))
    return tuple(coefficients)


def column_norm_sensitivity(coefficients: Sequence[float]) -> float:
    """The L2 sensitivity of one participation in a banded Toeplitz strategy: ``||c||_2``.

    One participation of an example at step ``j`` moves ``C X`` by column
    ``j`` of ``C`` (times the clipped contribution, norm at most
    ``clip_norm``); a column holds at most the ``b`` coefficients, so its
    norm is at most ``||c||_2`` (columns within ``b - 1`` of the last step
    are shorter). Under ``b``-min-separated participation, as cyclic Poisson
    sampling gives, two participations of one example touch disjoint rows,
    and the amplification theorem (Choquette-Choo et al. 2023, Theorem 4)
    needs exactly this largest column norm: dividing ``C`` by it makes the
    mechanism's noise multiplier the accountant's.

    Raises:
        ValueError: no coefficients, or any that is not finite, or a first
            coefficient that is not > 0 (``C`` must be invertible).
    """
    values = _check_coefficients(coefficients)
    return math.sqrt(math.fsum(c * c for c in values))


def normalized_coefficients(bands: int) -> tuple[float, ...]:
    """The banded square root's coefficients divided by their sensitivity (unit column norm)."""
    coefficients = banded_sqrt_coefficients(bands)
    sensitivity = column_norm_sensitivity(coefficients)
    return tuple(c / sensitivity for c in coefficients)


def strategy_matrix(coefficients: Sequence[float], steps: int) -> Tensor:
    """The ``steps x steps`` lower-triangular banded Toeplitz matrix ``C`` (float64).

    ``C[i, j] = coefficients[i - j]`` for ``0 <= i - j < len(coefficients)``,
    else 0. For tests and audits: the step never forms it.

    >>> strategy_matrix((1.0, 0.5), 3)
    tensor([[1.0000, 0.0000, 0.0000],
            [0.5000, 1.0000, 0.0000],
            [0.0000, 0.5000, 1.0000]], dtype=torch.float64)
    """
    values = _check_coefficients(coefficients)
    check_int("steps", steps, minimum=1)
    matrix = torch.zeros(steps, steps, dtype=torch.float64)
    for k, c in enumerate(values[:steps]):
        matrix += torch.diag(torch.full((steps - k,), c, dtype=torch.float64), -k)
    return matrix


def init_noise_history(params: Params, bands: int) -> Params:
    """The recurrence state before the first step: ``b - 1`` zero trees, stacked.

    Each leaf is ``zeros([bands - 1, *leaf.shape])`` in the leaf's dtype and
    device: the correlated draws of the steps before the first, which do
    not exist (``w_t = 0`` for ``t < 0``). ``bands = 1`` (DP-SGD) keeps no
    history and gives ``{}``, so its state has no extra tensors.

    Raises:
        ValueError: ``bands`` is not an int >= 1.
    """
    check_int("bands", bands, minimum=1)
    if bands == 1:
        return {}
    return tree_map(lambda p: p.new_zeros((bands - 1, *p.shape)), params)


def banded_noise(coefficients: Sequence[float]) -> NoiseMechanism:
    """The banded correlated noise as a mechanism: ``w_t = (C^{-1} Z)_t``, step by step.

    A :data:`~dpfunc.noise.NoiseMechanism` (the protocol of :mod:`dpfunc.optim`):
    ``init(params)`` gives :func:`init_noise_history` (``b - 1`` zero trees,
    stacked) in a :class:`~dpfunc.noise.NoiseState`; ``update(z_t, state,
    params=None)`` is :func:`solve_recurrence`, which returns the correlated
    draw and the state with it in front (``params`` is not read). Both are
    pure and compile with ``fullgraph=True``. One coefficient gives ``w_t =
    z_t / c_0``.

    Args:
        coefficients: ``c_0, ..., c_{b-1}`` of the banded Toeplitz strategy,
            usually :func:`normalized_coefficients` (unit column norm, so
            the noise multiplier is the accountant's).

    Raises:
        ValueError: the coefficients are not finite or ``c_0`` is not > 0.

    >>> mechanism = banded_noise(normalized_coefficients(3))
    >>> state = mechanism.init({"w": torch.zeros(2)})
    >>> tuple(state.history["w"].shape)
    (2, 2)
    >>> w, state = mechanism.update({"w": torch.ones(2)}, state)
    >>> tuple(w["w"].shape), tuple(state.history["w"].shape)
    ((2,), (2, 2))
    """
    values = _check_coefficients(coefficients)

    def init(params: Params) -> NoiseState:
        return NoiseState(init_noise_history(params, len(values)))

    def update(
        noise: Params, state: NoiseState, params: Params | None = None
    ) -> tuple[Params, NoiseState]:
        correlated, history = solve_recurrence(noise, state.history, values)
        return correlated, NoiseState(history)

    return NoiseMechanism(init, update)


def correlated_noise(
    noise: Params, history: Params, coefficients: Sequence[float]
) -> tuple[Params, Params]:
    """Step ``t``'s correlated draw ``w_t = (C^{-1} Z)_t`` and the next history.

    Solves row ``t`` of ``C w = Z`` for the lower-triangular banded Toeplitz
    ``C`` with the given coefficients: ``w_t = (z_t - sum_{j >= 1} c_j
    w_{t-j}) / c_0``. Over steps ``0 .. T-1``, starting from
    :func:`init_noise_history`, the draws are exactly ``C^{-1}`` applied to
    the standard-normal trees (up to float rounding).

    Args:
        noise: ``z_t``, the step's standard-normal tree
            (:func:`dpfunc.standard_normal_like`); float64 with secure
            noise, which ``w_t`` keeps.
        history: ``[b - 1, *shape]`` per leaf, ``history[j - 1] = w_{t-j}``,
            in the parameters' dtype.
        coefficients: ``c_0, ..., c_{b-1}`` (``len(coefficients) == b``),
            usually :func:`normalized_coefficients`.

    Returns:
        ``(w_t, history')``: ``w_t`` shaped like ``noise`` in its dtype, and
        the history with ``w_t`` in front (in the history's dtype) and the
        oldest draw gone.

    Raises:
        ValueError: the trees do not match, or the history does not hold
            ``len(coefficients) - 1`` draws.
    """
    values = _check_coefficients(coefficients)
    if len(values) == 1:
        check_same_structure(history, {}, "history", "the empty history of bands=1")
    elif tree_structure(history) != tree_structure(noise):
        raise ValueError(
            "history must have the tree structure of noise (one stacked tensor per leaf); got "
            f"{tree_structure(history)} and {tree_structure(noise)}"
        )
    for z, past in zip(tree_leaves(noise), tree_leaves(history)):
        if past.shape != (len(values) - 1, *z.shape):
            raise ValueError(
                f"history leaves must have shape {(len(values) - 1, *z.shape)} for "
                f"{len(values)} coefficients, got {tuple(past.shape)}"
            )
    return solve_recurrence(noise, history, values)


def solve_recurrence(
    noise: Params, history: Params, coefficients: tuple[float, ...]
) -> tuple[Params, Params]:
    """:func:`correlated_noise` without its checks, for the compiled step.

    ``coefficients`` must be a tuple of floats already checked (the step
    checks them once when it is built), and the trees must match.
    """
    if len(coefficients) == 1:
        return tree_map(lambda z: z / coefficients[0], noise), history

    def solve(z: Tensor, past: Tensor) -> tuple[Tensor, Tensor]:
        weights = torch.tensor(coefficients[1:], dtype=past.dtype, device=past.device)
        earlier = torch.tensordot(weights, past, dims=1)
        w = (z - earlier) / coefficients[0]
        return w, torch.cat([w.to(past.dtype).unsqueeze(0), past[:-1]])

    spec = tree_structure(noise)
    solved = [solve(z, past) for z, past in zip(tree_leaves(noise), tree_leaves(history))]
    return spec.unflatten([w for w, _ in solved]), spec.unflatten([h for _, h in solved])


def _check_coefficients(coefficients: Sequence[float]) -> tuple[float, ...]:
    try:
        values = tuple(float(c) for c in coefficients)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"coefficients must be a sequence of numbers, got coefficients={coefficients!r}"
        ) from error
    if not values or not all(math.isfinite(c) for c in values) or not values[0] > 0:
        raise ValueError(
            "coefficients must be finite numbers with a first coefficient > 0 (an "
            f"invertible strategy), got coefficients={coefficients!r}"
        )
    return values
