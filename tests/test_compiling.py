"""dpfunc compiles with Dynamo's RNN support and logging calls left out, scoped to its calls.

A model with an LSTM whose forward logs (as transformers' models do: GPT-2 with
``labels=`` reaches ``logger.warning_once``) does not compile with
``torch.compile(fullgraph=True)`` under Dynamo's defaults; dpfunc's compiled
Trainer step equals the eager one, and the user's Dynamo settings are unchanged
after it.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import dpfunc
from dpfunc.compiling import compile_fullgraph, dynamo_settings

with contextlib.suppress(ImportError):  # transformers adds warning_once to every logger
    import transformers.utils.logging  # noqa: F401
LOGGER = logging.getLogger("dpfunc.tests.compiling")
WARNING_ONCE = hasattr(logging.Logger, "warning_once")


class LoggingLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 4, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        LOGGER.info("forward of a batch of %d", x.shape[0])
        if WARNING_ONCE:
            LOGGER.warning_once("the loss type is not set: using cross-entropy")
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def trainer(compile: bool):
    torch.manual_seed(0)
    model = LoggingLSTM()
    params, _ = dpfunc.functionalize(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(40, 5, 3, generator=g), torch.randint(0, 2, (40,), generator=g)

    def loss_fn(p, example):
        xi, yi = example
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    return dpfunc.Trainer(
        loss_fn, params, (x, y), optimizer=dpfunc.optim.sgd(lr=0.5), clip_norm=0.5,
        noise_multiplier=1.0, expected_batch_size=8, epochs=1, physical_batch_size=16, seed=3,
        model=model, method="ghost", compile=compile, progress=False,
    )  # fmt: skip


def test_the_settings_are_dpfuncs_only_inside_its_compiled_calls():
    before = (torch._dynamo.config.allow_rnn, set(torch._dynamo.config.ignore_logger_methods))
    seen = {}

    def probe(x):
        seen["inside"] = torch._dynamo.config.allow_rnn
        return x + 1

    # eager call of the wrapper body: the scope is set around the compiled call
    assert torch.equal(compile_fullgraph(probe)(torch.zeros(2)), torch.ones(2))
    assert seen["inside"] is True
    assert dynamo_settings()["allow_rnn"] is True
    assert logging.Logger.info in dynamo_settings()["ignore_logger_methods"]
    assert logging.Logger.error not in dynamo_settings()["ignore_logger_methods"]
    after = (torch._dynamo.config.allow_rnn, set(torch._dynamo.config.ignore_logger_methods))
    assert after == before


def test_a_logging_lstm_does_not_compile_under_dynamos_defaults():
    model = LoggingLSTM()
    with pytest.raises(Exception, match="(?i)logging|logger|RNN"):
        torch.compile(model, fullgraph=True)(torch.randn(2, 5, 3))
    torch._dynamo.reset()


def test_compiled_trainer_on_a_logging_lstm_equals_eager():
    eager, compiled = trainer(compile=False), trainer(compile=True)
    eager.fit(max_steps=2)
    compiled.fit(max_steps=2)
    for name, value in eager.params.items():
        torch.testing.assert_close(compiled.params[name], value, rtol=1e-5, atol=1e-6)
    assert torch._dynamo.config.allow_rnn is False  # the user's setting, untouched
