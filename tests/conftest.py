import math
import os
import sys
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import dpfunc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from extras import missing_extra  # noqa: E402 (beside this file)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that fails only because an optional extra is not installed is skipped, named."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.excinfo is not None:
        reason = missing_extra(call.excinfo.value)
        if reason is not None:
            report.outcome = "skipped"
            report.longrepr = (str(item.path), item.location[1] or 0, reason)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


class TiedLanguageModel(nn.Module):
    """Tied input and output embeddings (as in GPT-2): the output projection reuses the
    embedding's weight, so one parameter is used twice per example."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.out = nn.Linear(4, 7, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.embed(tokens)))


@pytest.fixture
def auto_timings(monkeypatch):
    """A list that grows by one for every clock read of eager ``method="auto"``'s timing
    (empty: the cost model decided untimed); the clock itself is real."""
    from dpfunc.ghost import clipper

    calls = []
    real = clipper.time.perf_counter

    class Clock:
        @staticmethod
        def perf_counter():
            calls.append(1)
            return real()

    monkeypatch.setattr(clipper, "time", Clock)
    return calls


@pytest.fixture
def tied_language_model():
    """A fresh ``TiedLanguageModel`` (7 tokens, width 4), initialised after ``_seed``."""
    return TiedLanguageModel()


class Classifier(NamedTuple):
    """A module, its parameters as a dict, and the one-example loss over them."""

    model: nn.Module
    params: dict
    loss_fn: Callable


def make_classifier(dtype=torch.float64, seed=0):
    """A two-layer tanh network on 6 features and 3 classes, seeded with ``seed``, in ``dtype``.

    ``loss_fn(params, (x, y))`` is the cross-entropy of one example (``x`` of shape ``(6,)``, ``y``
    a class index) through the module's buffers; ``model`` holds the same starting weights, for
    torch.optim and autograd-loop oracles.
    """
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        x, y = example
        return F.cross_entropy(functional_call(model, (p, buffers), (x.unsqueeze(0),)), y[None])

    return Classifier(model, params, loss_fn)


def make_classification_data(n, dtype=torch.float64, seed=1, scale=1.0):
    """``n`` examples for ``make_classifier``: standard normal features times ``scale``, uniform
    labels in ``0..2``, both drawn from a generator seeded with ``seed`` (the global seed is left
    alone)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=dtype) * scale
    return x, torch.randint(0, 3, (n,), generator=g)


@pytest.fixture
def classifier():
    """The factory ``make_classifier(dtype=torch.float64, seed=0) -> (model, params, loss_fn)``:
    a fresh module on each call."""
    return make_classifier


@pytest.fixture
def classification_data():
    """The factory ``make_classification_data(n, dtype=torch.float64, seed=1, scale=1.0)``,
    which returns ``(x, y)``."""
    return make_classification_data


class TinyProblem(NamedTuple):
    """The one-example loss, its parameters as a dict, the data set ``(x, y)`` and the module."""

    loss_fn: Callable
    params: dict
    dataset: tuple
    model: nn.Module


def make_tiny_problem(n=120, *, seed=0, hidden=8, nan_rows=0):
    """A two-layer tanh network on 4 features and 2 classes (``hidden`` units), in float32, and
    ``n`` standard normal examples labelled by the sign of their first feature.

    The global seed is set to ``seed`` before the module is built; the features come from a
    generator seeded with ``seed``. The first ``nan_rows`` rows of ``x`` are NaN (their labels
    were drawn before). ``loss_fn(params, (x, y))`` is the cross-entropy of one example.
    """
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 2))
    params, buffers = dpfunc.functionalize(model)
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))
    y = (x[:, 0] > 0).long()
    x[:nan_rows] = math.nan

    def loss_fn(p, example):
        xi, yi = example
        return F.cross_entropy(functional_call(model, (p, buffers), (xi[None],)), yi[None])

    return TinyProblem(loss_fn, params, (x, y), model)


@pytest.fixture
def tiny_problem():
    """The factory ``make_tiny_problem(n=120, *, seed=0, hidden=8, nan_rows=0) -> (loss_fn,
    params, (x, y), model)``: a fresh module and data set on each call."""
    return make_tiny_problem
