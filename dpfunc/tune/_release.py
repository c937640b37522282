"""What a search releases: what trials return, what is refused in a result, the result."""

from __future__ import annotations

import dataclasses
import itertools
import types
import warnings
from typing import Any, NamedTuple

import numpy as np
import torch
from dp_accounting import dp_event

from .._checks import check_number
from ._count import _distribution, _rdp_epsilon


class Outcome(NamedTuple):
    """What a trial function returns.

    Args:
        run: the trial's :class:`dpfunc.Trainer` or :class:`dpfunc.PrivateGradients`,
            trained with the config and seed the trial was given; its
            accountant is checked against the trial's event.
        metric: ``score="private"``: each private validation example's value
            (accuracy 0/1, or any value mapped into ``[0, 1]``; clamped there,
            NaN read as 0), 1-D; ``score="public"``: the score as a float,
            computed on public data only.
        result: what the search hands back for the best trial (its parameters,
            a model); ``None`` by default.
    """

    run: Any
    metric: Any
    result: Any = None


class Best(NamedTuple):
    """What a search releases of its best trial (:attr:`SearchResult.best`), covered by its epsilon.

    Its hyperparameters, its score (private: noisy) and the steps its run
    accounted; not its index, nor its attempts: where the best stands in the
    trial list tells how many trials there were at least, and the theorem
    covers the best trial's output only, with ``K`` hidden. (For Poisson ``K``
    of mean 5 and a Gaussian score of sensitivity 1 and std 1, releasing the
    index with the best score raises delta at epsilon 3 from 7.3e-3 to 4.4e-2,
    both directions of the neighbouring relation.)
    """

    hyperparameters: dict
    score: float
    steps: int


class Trial(NamedTuple):
    """One trial of a finished search (in :attr:`SearchResult.trials`: NOT covered).

    ``score`` is the private (noisy) or public score, NaN where a public
    score was NaN; ``steps`` the steps its run accounted; ``attempts`` the
    runs started for it (more than 1: interrupted ones, among the ``retries``
    accounted in advance, each with its own hyperparameters:
    ``hyperparameters`` are the last attempt's).
    """

    index: int
    hyperparameters: dict
    score: float
    steps: int
    attempts: int


def _check_result(result: Any, run: Any, index: int, metric: Any = None) -> None:
    """Refuses a trial's ``result`` that would release what the search's epsilon does not cover.

    Looked for in dicts, lists, tuples, sets, numpy object arrays and the
    attributes of objects (dataclasses, namespaces, models; up to
    :data:`_MAX_VISITS` values): a run (a Trainer, a ``PrivateGradients``,
    what holds one, as a ``PrivateTrainer`` does, or its plan), a dpfunc state
    dict, the run's secret seeds (as an int, written in a string in decimal or
    hex, or as its bytes, raw, in base64 or in a ``torch.save`` file), each
    of which lets anyone remove the noise; a tensor or numpy array of the
    run's training data (its memory, a copy of a whole column, in any dtype
    or transposed, or rows copied from one); and, with a private score
    (``metric``), the trial's validation values, which the search releases
    only noised. A block list: data kept in another form
    is not seen (docs/tuning.md says what ``result`` may hold).
    """
    columns = _data_columns(run)
    secrets = [getattr(run, name, None) for name in ("seed", "stream_seed")]
    secrets = [int(s) for s in secrets if s is not None] if run.seed_is_secret else []
    texts = [w for s in secrets for w in (str(s), format(s, "x"), format(s, "X"))]
    raw = [b for s in secrets for b in _seed_bytes(s)]
    texts += [b.decode("latin-1") for b in raw if b.isascii()]  # base64, written in a string
    try:  # (a malformed metric is refused by the score, with its own message)
        values = None if metric is None else torch.as_tensor(metric).detach().cpu().double()
    except (TypeError, ValueError, RuntimeError):
        values = None
    if values is not None and (values.dim() != 1 or _constant(values)):
        values = None  # a constant metric (all 0, all 1) would match any constant parameter
    means = set() if values is None else {float(values.mean()), float(values.sum())}
    seen: set[int] = set()

    def leak(value: Any, where: str) -> str | None:
        if _is_run(value) or _is_run(getattr(value, "private", None)):
            return f"a run ({type(value).__name__})"
        if hasattr(value, "lineage") and hasattr(value, "stream_seed"):
            return f"a run's plan ({type(value).__name__}), which holds its secret seed"
        if isinstance(value, dict) and {"accountant", "lineage"} <= value.keys():
            return "a dpfunc state dict, which holds the run's secret seed"
        if isinstance(value, int | np.integer) and not isinstance(value, bool):
            return "the run's secret seed" if int(value) in secrets else None
        if isinstance(value, str):
            return "the run's secret seed, written out" if any(w in value for w in texts) else None
        if isinstance(value, bytes | bytearray):
            text = bytes(value).decode("latin-1")
            if any(w in text for w in texts) or any(b in value for b in raw):
                return "the run's secret seed, in bytes"
            return None
        if isinstance(value, float | np.floating) and float(value) in means:
            warnings.warn(
                f"trial {index}: Outcome.result{where} is a number equal to the mean or the "
                "sum of the trial's private validation values: if it is that accuracy, the "
                "search releases it un-noised, which its epsilon does not cover",
                UserWarning,
                stacklevel=5,
            )
            return None
        if isinstance(value, np.ndarray) and value.dtype != object:
            if value.dtype.kind not in "biuf" or value.dtype.itemsize > 8:
                return None  # (no tensor of it: strings, long doubles)
            value = torch.from_numpy(
                np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("="))
            )
        if isinstance(value, torch.Tensor):
            if any(_same_data(value, c) for c in columns):
                return "a tensor of the training data"
            if values is not None and not _constant(value) and _same_data(value, values):
                return "the trial's private validation values, un-noised"
        return None

    def visit(value: Any, where: str, depth: int) -> None:
        if id(value) in seen or depth > _MAX_DEPTH or len(seen) > _MAX_VISITS:
            return
        seen.add(id(value))
        try:
            why = leak(value, where)
        except Exception:  # an object that cannot be read as a value: opaque
            why = None
        if why is not None:
            raise ValueError(
                f"trial {index}: Outcome.result{where} is {why}, which the search would "
                "release as covered by its epsilon, and it is not: result may hold the "
                "trained model, its parameters, the hyperparameters and public values, "
                "never the run, its state_dict, its seed, training data or the private metric"
            )
        try:
            items = _children(value)
        except Exception:  # an attribute that raises, say: opaque
            items = iter(())
        for step, item in itertools.islice(items, max(0, _MAX_VISITS - len(seen))):
            visit(item, where + step, depth + 1)

    visit(result, "", 0)


def _children(value: Any) -> Any:
    """The values inside ``value``, with how to name each (``[key]``, ``.name``), lazily."""
    if isinstance(value, dict):
        return ((f"[{key!r}]", item) for key, item in value.items())
    if isinstance(value, list | tuple | set | frozenset):
        return ((f"[{k}]", item) for k, item in enumerate(value))
    if isinstance(value, np.ndarray) and value.dtype == object:
        return ((f"[{k}]", item) for k, item in enumerate(value.ravel()))
    if isinstance(value, (torch.Tensor, np.ndarray, str, bytes, bytearray, *_OPAQUE)):
        return iter(())
    attributes = getattr(value, "__dict__", None)
    return (
        ((f".{k}", v) for k, v in attributes.items()) if isinstance(attributes, dict) else iter(())
    )


def _constant(t: torch.Tensor) -> bool:
    """Whether every entry of ``t`` is the same (a row of zeros, a weight still at ones)."""
    flat = t.detach().reshape(-1)
    return flat.numel() == 0 or bool((flat == flat[0]).all())


_OPAQUE = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType)
_MAX_DEPTH = 12  # how deep in result the leaks are looked for
_MAX_VISITS = 20_000  # and at most this many values (a model's attributes included)


def _seed_bytes(seed: int) -> list[bytes]:
    """A seed's bytes as a file may hold them: big- and little-endian (pickle's), and base64."""
    import base64

    size = max(1, (seed.bit_length() + 7) // 8)
    forms = [seed.to_bytes(size, "big"), seed.to_bytes(size, "little")]
    return forms + [base64.b64encode(f).rstrip(b"=") for f in forms]


def _is_run(value: Any) -> bool:
    return hasattr(value, "accountant") and hasattr(value, "seed_is_secret")


def _data_columns(run: Any) -> list[torch.Tensor]:
    """The tensors a run's training set is made of, where it is tensors (else none)."""
    batches = getattr(getattr(run, "plan", None), "batches", None)
    dataset = getattr(batches, "dataset", None)
    if isinstance(dataset, torch.Tensor):
        return [dataset]
    if isinstance(dataset, tuple):
        return [c for c in dataset if isinstance(c, torch.Tensor)]
    return []


def _same_data(value: torch.Tensor, column: torch.Tensor) -> bool:
    """Whether ``value`` is ``column``'s memory, a copy of it, or holds rows copied from it.

    Also a transposed copy, and one in another dtype (the column rounded to
    it). Rows are compared where they have 8 entries or more and are not
    constant (a row of zeros or a label would match by chance); up to 4 of
    ``value``'s.
    """
    if value.layout != torch.strided or column.layout != torch.strided or not value.numel():
        return False
    if value.device == column.device and _overlap(value, column):
        return True  # a view of the column's memory (a test split beside it is not)
    if value.dim() == 2 and value.shape != column.shape and value.T.shape == column.shape:
        value = value.T  # a transposed copy
    if value.dim() != column.dim() or value.shape[1:] != column.shape[1:]:
        return False  # (before any copy: a model's parameters are looked at too)
    value, column = value.detach().cpu(), column.detach().cpu()
    if value.shape == column.shape and (
        torch.equal(value.to(column.dtype), column) or torch.equal(column.to(value.dtype), value)
    ):
        return True
    row = column.shape[1:]
    if value.dim() != column.dim() or value.shape[1:] != row or row.numel() < 8:
        return False
    flat = column.reshape(len(column), -1)
    for item in value[:4].reshape(min(len(value), 4), -1).to(column.dtype):
        if bool((item == item[0]).all()) or not bool((flat == item).all(1).any()):
            return False
    return True


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' elements share bytes of one storage."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def extent(t: torch.Tensor) -> tuple[int, int]:
        start = t.storage_offset() * t.element_size()
        last = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) if t.numel() else -1
        return start, start + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = extent(a), extent(b)
    return a0 < b1 and b0 < a1


NOT_COVERED = (
    "the trial list (SearchResult.trials): K, every trial's hyperparameters and score, and "
    "the best trial's index among them (a lower bound on K); releasing them costs "
    "SearchResult.all_trials_epsilon (K whole trials composed), not the search's epsilon",
    "how many trials ran, and where an interrupted search stopped: anything that reveals K "
    "(a log, the search's duration) voids the theorem's hiding of K",
    "a trial function that keeps state between calls, reads earlier results, or trains more "
    "than the one run it returns: the search checks the returned run only",
    "an interrupted attempt whose interruption depends on the data (a diverged run that "
    "raises, a check of the raw data): restarting it conditions the completed trials on the "
    "data; return a failing score from the trial instead (docs/tuning.md)",
    "another search on the same data: its epsilon composes with this one's",
    "a score='public' metric: taken as computed on public data, unaccounted",
    "what each trial's own privacy report leaves out (diagnostics, side channels, the "
    "checkpoints' secrets); a search checkpoint holds K and the draws: keep it as private as "
    "the data",
)
"""What the search's guarantee does not cover, in the words its report prints."""


@dataclasses.dataclass(frozen=True)
class SearchReport:
    """The privacy of a search, as data (``dataclasses.asdict``) and text (``str``)."""

    epsilon: float
    delta: float
    target_epsilon: float | None
    accountant: str
    search: str
    trial_count: str
    released: str
    trial: str
    score: str
    interrupted_attempts: int
    retries: int
    seed: str
    not_covered: tuple[str, ...]

    def __str__(self) -> str:
        lines = [
            "Privacy report (accounted hyperparameter search)",
            f"  guarantee:       ({self.epsilon:.6g}, {self.delta:.6g})-DP for what is released"
            + (f" (target {self.target_epsilon:g})" if self.target_epsilon else ""),
            f"  search:          {self.search}",
            f"  trial count K:   {self.trial_count}",
            f"  released:        {self.released}",
            f"  each trial:      {self.trial}",
            f"  score:           {self.score}",
            f"  interrupted:     {self.interrupted_attempts} attempts; {self.retries} accounted "
            "in advance, each as a whole trial",
            f"  accountant:      {self.accountant}",
            f"  seed:            {self.seed}",
            "  not covered by the guarantee:",
            *(f"    - {item}" for item in self.not_covered),
        ]
        return "\n".join(lines)


class SearchResult:
    """A finished search: the best trial (released), the trial list (not), the epsilon.

    Attributes:
        best: the best trial as :class:`Best` (highest score; NaN lowest;
            ties: the earliest), without its index, or ``None`` when ``K = 0``
            (Poisson): then nothing is released but that no trial ran.
        result: the best trial's ``Outcome.result`` (``None`` when ``K = 0``).
        trials: every :class:`Trial`, in order. NOT covered by the search's
            epsilon: their number is ``K``; releasing them costs
            :meth:`all_trials_epsilon`.
        dp_event, delta, trial_config: the search's event, default delta, and
            the config each trial was given (before its space's clip settings).
    """

    def __init__(self, tuning: Any):  # the RandomSearch that ran
        state = tuning._state
        self._search = tuning
        self.trials = tuple(
            Trial(i, dict(h), float(s), int(t), int(a))
            for i, (h, s, t, a) in enumerate(
                zip(state["hyperparameters"], state["scores"], state["steps"], state["attempts"])
            )
        )
        best = state["best"]
        if best is None:
            self.best = None
        else:
            chosen = self.trials[best["index"]]
            self.best = Best(chosen.hyperparameters, chosen.score, chosen.steps)
        self.result = None if best is None else best["result"]
        self.dp_event = tuning.dp_event
        self.delta = tuning.delta
        self.trial_config = tuning.trial_config

    def epsilon(self, delta: float | None = None) -> float:
        """The search's epsilon at ``delta``: dp_accounting's RDP on :attr:`dp_event`."""
        return self._search.epsilon(delta)

    def all_trials_epsilon(self, delta: float | None = None) -> float:
        """What releasing every trial (and so ``K``) would cost: all attempts' events composed.

        A function of ``K``: keep it as private as the trial list (it is not in the report).
        """
        delta = self.delta if delta is None else delta
        check_number("delta", delta, low=0, high=1, low_open=True, high_open=True)
        attempts = sum(t.attempts for t in self.trials)
        if attempts == 0:
            return 0.0
        return _rdp_epsilon(dp_event.SelfComposedDpEvent(self._search.trial_event, attempts), delta)

    def privacy_report(self, delta: float | None = None) -> SearchReport:
        """The search's :class:`SearchReport` at ``delta`` (default: the config's)."""
        tuning = self._search
        delta = self.delta if delta is None else delta
        config = tuning.trial_config
        trial = (
            f"DP-SGD, accounted noise multiplier {tuning._event.noise_multiplier:.6g}, sample "
            f"rate {tuning._rate:.6g}, at most {tuning._steps} steps on {tuning.num_examples} "
            f"examples, clip norm {config.clip_norm:g} unless the space sets it"
        )
        score = (
            "public (computed by the trial on data taken to be public; not accounted)"
            if tuning.score == "public"
            else f"private: the sum of each validation example's value in [0, 1] plus "
            f"N(0, {tuning.score_noise_multiplier:g}**2), over the validation size; accounted "
            "in each trial as a Gaussian of sensitivity 1"
        )
        seed = (
            "a secret from the OS CSPRNG draws K, the hyperparameters and the score noise; each "
            "trial's run draws its own"
            if tuning.seed_is_secret
            else "FIXED (research mode): whoever knows it knows K, every draw and the score "
            "noise, so the guarantee does NOT hold against them"
        )
        return SearchReport(
            epsilon=self.epsilon(delta),
            delta=float(delta),
            target_epsilon=tuning.target_epsilon,
            accountant="RDP (dp_accounting's RdpAccountant, default orders) on dp_event",
            search="random search, repeat and select the best (Papernot and Steinke 2022)",
            trial_count=_distribution(tuning.mean_trials, tuning.shape),
            released="the best trial only: its hyperparameters, score, steps and result "
            "(not its index)"
            if self.best is not None
            else "nothing: K = 0, no trial ran",
            trial=trial,
            score=score,
            interrupted_attempts=tuning._abandoned(),
            retries=tuning.retries,
            seed=seed,
            not_covered=NOT_COVERED,
        )

    def __repr__(self) -> str:  # the trial list is not shown: its length is K
        best = None if self.best is None else self.best.score
        epsilon = self.epsilon()
        return f"SearchResult(best_score={best!r}, epsilon={epsilon:.4g}, delta={self.delta:g})"
