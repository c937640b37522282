"""Accounted hyperparameter search: random search whose epsilon covers the search.

Choosing a learning rate (or any other setting) by training many times on
the private data and keeping the best run leaks about the data too; the
epsilon of the last run covers only that run. Papernot and Steinke (ICLR
2022, "Hyperparameter Tuning with Renyi Differential Privacy") show that if

* the number of trials ``K`` is itself random, drawn from a Poisson or a
  truncated negative binomial distribution (geometric and logarithmic
  included), and hidden,
* every trial draws its hyperparameters independently from one fixed
  distribution, then trains (a private run) and scores itself privately,
* and only the best trial is released (its hyperparameters, score and
  model),

then the whole search costs little more than one trial: ``dp_accounting``
accounts it as ``RepeatAndSelectDpEvent(trial_event, mean, shape)`` in its
RDP accountant. :class:`RandomSearch` runs such a search with dpfunc's
Trainer or ``PrivateGradients`` inside each trial, and calibrates the
trials' noise so that the search meets a target epsilon.

Honest by construction: ``K`` and every trial's hyperparameters are drawn
from the search's secret stream before any trial runs; the trial function
sees only its hyperparameters, its :class:`dpfunc.DPConfig` and its seed,
never an earlier result; the scores' noise is drawn by the search; each
trial's run is checked against its planned event (noise multiplier, sample
rate, at most the planned steps, its own seed); a trial that spent more is
refused and voids the search. docs/tuning.md says what is and is not
covered.

>>> import dpfunc
>>> space = {"lr": dpfunc.tune.LogUniform(0.01, 1.0), "momentum": 0.9}
>>> config = dpfunc.DPConfig(clip_norm=1.0, expected_batch_size=1000, epochs=2,
...                          target_epsilon=3.0, delta=1e-5)
>>> tuning = dpfunc.tune.RandomSearch(space, config, num_examples=1000, mean_trials=5,
...                                   score_noise_multiplier=20.0, validation_size=1000)
>>> tuning.epsilon() <= 3.0  # the whole search's, with each trial's noise calibrated for it
True
"""

from ._count import trial_count_pmf
from ._release import Best, Outcome, SearchReport, SearchResult, Trial
from ._search import RandomSearch, search
from ._space import Choice, IntUniform, LogUniform, Uniform

__all__ = [
    "Best",
    "Choice",
    "IntUniform",
    "LogUniform",
    "Outcome",
    "RandomSearch",
    "SearchReport",
    "SearchResult",
    "Trial",
    "Uniform",
    "search",
    "trial_count_pmf",
]
