"""dpfunc compiles with Dynamo's RNN support and logging calls left out, scoped to its calls.

A model with an LSTM whose forward logs (as transformers' models do: GPT-2 with
``labels=`` reaches ``logger.warning_once``) does not compile with
``torch.compile(fullgraph=True)`` under Dynamo's defaults; compiled the dpfunc
way it traces and equals eager, a step's ``compile()`` compiles each of its
pieces that way, and the user's Dynamo settings are unchanged after a call.
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
from dpfunc._compiling import compile_fullgraph, dynamo_settings

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


def test_a_logging_lstm_compiles_the_dpfunc_way_and_equals_eager(monkeypatch):
    # Dynamo's settings act when it traces; Inductor cannot lower CPU's fused LSTM kernel
    # outside dpfunc's step (which unrolls it), so this graph runs on the eager backend
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend="eager", **kw))
    torch.manual_seed(0)
    model = LoggingLSTM()
    x = torch.randn(4, 5, 3)
    compiled = compile_fullgraph(lambda batch: model(batch))
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
    assert torch._dynamo.config.allow_rnn is False  # the user's setting, untouched
    torch._dynamo.reset()


def test_a_steps_compile_compiles_each_piece_the_dpfunc_way(monkeypatch):
    wrapped = []
    monkeypatch.setattr(dpfunc.step, "compile_fullgraph", lambda fn: wrapped.append(fn) or fn)
    model = LoggingLSTM()

    def loss_fn(p, example):
        xi, yi = example
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    step = dpfunc.make_train_step(
        loss_fn, dpfunc.optim.sgd(lr=0.5), clip_norm=0.5, noise_multiplier=1.0,
        expected_batch_size=8, model=model,
    ).compile()  # fmt: skip
    assert [fn.__name__ for fn in wrapped] == ["_micro_sum", "_apply", "_private", "_local_step"]
    assert (step._sum, step._update, step._release, step._whole) == tuple(wrapped)


def test_a_float64_scalar_argument_traces_once_and_reaches_fn_as_passed(monkeypatch):
    # Dynamo gives a 0-d float64 CPU input a symbolic float; a graph that passes it through
    # unread (a train state's clip norm without adaptive clipping) is then traced twice (the
    # symbol is specialised in AOTAutograd's pass, so the eager backend would not show it)
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend="aot_eager", **kw))
    seen = []

    def step(state, x):
        seen.append(tuple(state["clip_norm"].shape))  # at trace time
        return {"clip_norm": state["clip_norm"], "w": state["w"] * x}, (x * 2).sum()

    state = {"clip_norm": torch.tensor(1.5, dtype=torch.float64), "w": torch.ones(3)}
    metrics = torch._dynamo.utils.compilation_time_metrics
    metrics.clear()
    out, total = compile_fullgraph(step)(state, torch.arange(3.0))
    assert not [k for k in metrics if k.startswith("compile_attempt_") and k != "compile_attempt_0"]
    assert seen and set(seen) == {()}  # fn sees the tensor 0-d, as passed
    assert out["clip_norm"].shape == () and out["clip_norm"].dtype == torch.float64
    assert out["clip_norm"].item() == 1.5 and total.item() == 6.0
    torch.testing.assert_close(out["w"], torch.arange(3.0))
    torch._dynamo.reset()


def _mlp_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        xi, yi = example
        return F.cross_entropy(functional_call(model, (p, buffers), (xi[None],)), yi[None])

    step = dpfunc.make_train_step(
        loss_fn, dpfunc.optim.sgd(lr=0.1), clip_norm=1.0, noise_multiplier=1.0,
        expected_batch_size=8, model=model,
    )  # fmt: skip
    batch = (torch.randn(8, 6), torch.randint(3, (8,)))
    return step, step.init(params), batch, step.draw_noise(params, seed=0, step=0)


def _traces(monkeypatch) -> list[torch.fx.GraphModule]:
    """The graphs torch.compile passes to AOTAutograd from now on, one per trace.

    A trace that Dynamo restarts reaches the backend again (the restart after
    specialising a symbolic float is raised in AOTAutograd's pass).
    """
    traced = []
    real = torch.compile

    def backend(gm, example_inputs):
        traced.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend=backend, **kw))
    torch._dynamo.reset()
    return traced


@pytest.mark.slow
def test_a_plain_torch_compile_of_a_step_traces_it_once(monkeypatch):
    # the train state's clip norm is held 1-element (ClipState.norm): a 0-d float64 CPU input
    # would get a symbolic float that torch specialises after tracing, tracing the step again
    traced = _traces(monkeypatch)
    step, state, batch, noise = _mlp_step()
    eager, _ = step(state, batch, torch.ones(8), noise.params)
    compiled, _ = torch.compile(step, fullgraph=True)(state, batch, torch.ones(8), noise.params)
    assert len(traced) == 1
    for k in eager.params:
        torch.testing.assert_close(compiled.params[k], eager.params[k], rtol=1e-5, atol=1e-6)
    assert compiled.clip_state.clip_norm.shape == ()
    assert compiled.clip_state.clip_norm.item() == 1.0
    torch._dynamo.reset()


@pytest.mark.slow
def test_a_steps_compiled_graphs_trace_once_each(monkeypatch):
    traced = _traces(monkeypatch)
    step, state, batch, noise = _mlp_step()
    step.compile()
    eager_step, eager, _, _ = _mlp_step()
    halves = [((batch[0][h], batch[1][h]), torch.ones(4)) for h in (slice(0, 4), slice(4, 8))]
    for t in range(2):  # the second step reuses every graph
        state, stats = step.logical_step(state, iter([(batch, torch.ones(8))]), noise)
        assert len(traced) == 1, t  # one micro-batch on one process: one graph, sum to update
        assert stats.mask.shape == (8,)
    for t in range(2):
        state, _ = step.logical_step(state, iter(halves), noise)  # both halves summed
        assert len(traced) == 3, t  # more: each micro-batch's sum, and the update
    for _ in range(2):
        eager, _ = eager_step.logical_step(eager, [(batch, torch.ones(8))], noise)
    for _ in range(2):
        eager, _ = eager_step.logical_step(eager, halves, noise)
    for k in eager.params:
        torch.testing.assert_close(state.params[k], eager.params[k], rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


@pytest.mark.slow
def test_one_graph_releases_nothing_when_before_release_raises(monkeypatch):
    _traces(monkeypatch)
    step, state, batch, noise = _mlp_step()
    step.compile()
    seen = []

    def refuse(stats):
        seen.append(stats)
        raise FloatingPointError("refused")

    before = {k: v.clone() for k, v in state.params.items()}
    with pytest.raises(FloatingPointError, match="refused"):
        step.logical_step(state, [(batch, torch.ones(8))], noise, before_release=refuse)
    assert len(seen) == 1 and seen[0].mask.shape == (8,)  # the whole logical batch's stats
    for k, v in before.items():  # the caller's state is as it was
        assert torch.equal(state.params[k], v)
    torch._dynamo.reset()


def test_leaves_in_any_order_are_every_leaf_once_eagerly_and_while_dynamo_traces():
    """The checks' cheap walk (dpfunc.tree.leaves_in_any_order) sees what tree_leaves sees:
    eagerly in its order, while Dynamo traces in another (a dict in insertion order)."""
    from dpfunc.tree import leaves_in_any_order, tree_leaves

    values = iter(range(5))
    tree = {
        "z": torch.full((1,), float(next(values))),
        "c": (torch.full((2,), float(next(values))), None),
        "a": ({"y": torch.full((3,), float(next(values))), "x": torch.full((1,), 7.0)}, None),
        "b": [torch.full((2, 1), float(next(values)))],
    }
    assert [x is y for x, y in zip(leaves_in_any_order(tree), tree_leaves(tree))] == [True] * 5

    def walk(t):
        return [x + 0 for x in leaves_in_any_order(t)]

    traced = torch.compile(walk, backend="eager", fullgraph=True)(tree)

    def key(x):
        return (tuple(x.shape), x.flatten().tolist())

    assert sorted(map(key, traced)) == sorted(map(key, tree_leaves(tree)))
