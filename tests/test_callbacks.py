"""Callbacks around the Trainer's steps: the hooks' order, the built-ins' order, callbacks for
one fit, refused objects, one checkpoint per step, and errors that reach the caller; the loggers
(CSV, JSON lines, TensorBoard), stopping a fit (a callback, StopAtEpsilon) and epsilon at any
delta."""

import csv
import gc
import json
import math
import socket
import sys

import pytest
import torch

import dpfunc
from dpfunc import accounting, checkpoint
from dpfunc.callbacks import (
    NON_PRIVATE_METRICS,
    NON_PRIVATE_PREFIX,
    PUBLIC_METRICS,
    Checkpoint,
    CSVLogger,
    Evaluate,
    JSONLogger,
    ProgressBar,
    StopAtEpsilon,
    TensorBoard,
    logged_name,
)
from dpfunc.schedules import linear_warmup

N, BATCH, EPOCHS = 60, 10, 2  # 6 steps an epoch, 12 in all
STEPS_PER_EPOCH, TOTAL = 6, 12


def make(**overrides):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 3, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5])

    def loss_fn(p, example):
        xi, yi = example
        return ((p["w"] * xi).sum() + p["b"] - yi) ** 2

    settings = dict(
        optimizer=dpfunc.optim.sgd(lr=0.1),
        epochs=EPOCHS,
        expected_batch_size=BATCH,
        clip_norm=1.0,
        noise_multiplier=0.8,
        delta=1e-3,
        physical_batch_size=8,
        progress=False,
        accounting="rdp",
    )
    settings.update(overrides)
    params = {"w": torch.zeros(3), "b": torch.zeros(())}
    return dpfunc.Trainer(loss_fn, params, (x, y), **settings)


class Recorder:
    """Appends ``(name, hook, steps_done)`` for every hook, and checks what each receives."""

    def __init__(self, calls, name="user"):
        self.calls, self.name = calls, name

    def on_init(self, trainer):
        self.calls.append((self.name, "on_init", trainer.steps_done))

    def on_fit_start(self, trainer, stop_at):
        self.calls.append((self.name, "on_fit_start", trainer.steps_done, stop_at))

    def on_epoch_end(self, trainer, metrics):
        assert metrics is trainer.history[-1] and metrics["steps"] == trainer.steps_done
        self.calls.append((self.name, "on_epoch_end", trainer.steps_done))

    def on_step_end(self, trainer, metrics):
        assert {"loss", "batch_size", "clipped_fraction", "nonfinite"} <= set(metrics)
        self.calls.append((self.name, "on_step_end", trainer.steps_done))

    def on_fit_end(self, trainer, history):
        assert history is trainer.history
        self.calls.append((self.name, "on_fit_end", trainer.steps_done))


def expected_fit(start, stop, name="user"):
    """The documented sequence of one fit from ``start`` to ``stop`` steps done."""
    calls = [(name, "on_fit_start", start, stop)]
    for done in range(start + 1, stop + 1):
        if done % STEPS_PER_EPOCH == 0 or done == stop:  # an epoch's, or the fit's, last step
            calls.append((name, "on_epoch_end", done))
        calls.append((name, "on_step_end", done))
    return calls + [(name, "on_fit_end", stop)]


def test_the_hooks_run_in_the_documented_order():
    calls = []
    trainer = make(callbacks=[Recorder(calls)])
    assert calls == [("user", "on_init", 0)]
    trainer.fit(max_steps=8)  # stops between epochs: the last step also ends a record
    trainer.fit()
    assert calls == [("user", "on_init", 0)] + expected_fit(0, 8) + expected_fit(8, TOTAL)
    assert [record["steps"] for record in trainer.history] == [6, 8, 12]


def test_the_built_ins_run_around_the_users_callbacks(tmp_path):
    path = tmp_path / "run.pt"
    seen = []

    class AddsToTheRecord:
        def on_epoch_end(self, trainer, metrics):
            seen.append(dict(metrics))  # Evaluate has run before
            metrics["added"] = float(trainer.steps_done)  # Checkpoint saves it after

    user = AddsToTheRecord()
    trainer = make(callbacks=[user], eval_fn=lambda p: {"bias": float(p["b"])},
                   checkpoint_path=path, progress=True)  # fmt: skip
    kinds = [type(callback) for callback in trainer.callbacks]
    assert kinds == [Evaluate, AddsToTheRecord, Checkpoint, ProgressBar]
    assert trainer.callbacks[1] is user
    trainer.fit(max_steps=STEPS_PER_EPOCH)
    assert len(seen) == 1 and set(seen[0]) == set(trainer.history[0]) - {"added"}
    assert "bias" in seen[0]
    reloaded = make()
    reloaded.load(path)
    assert reloaded.history == trainer.history and reloaded.history[-1]["added"] == 6.0


def test_callbacks_given_to_fit_apply_to_that_fit_only():
    calls = []
    trainer = make(callbacks=[Recorder(calls, "own")])
    trainer.fit(max_steps=2, callbacks=[Recorder(calls, "once")])
    trainer.fit(max_steps=1)
    assert len(trainer.callbacks) == 1
    first = list(zip(expected_fit(0, 2, "own"), expected_fit(0, 2, "once"), strict=True))
    assert calls == [
        ("own", "on_init", 0),
        *[call for pair in first for call in pair],  # the Trainer's own first, then fit's
        *expected_fit(2, 3, "own"),
    ]


class NoHook:
    def on_step(self, trainer, metrics):  # not a hook's name
        pass


class HookNotCallable:
    on_step_end = None


@pytest.mark.parametrize("refused", [object(), NoHook(), HookNotCallable(), "on_step_end"])
def test_an_object_with_no_hook_is_refused_before_any_step(refused):
    with pytest.raises(TypeError, match="defines none of"):
        make(callbacks=[refused])
    calls = []
    trainer = make(callbacks=[Recorder(calls)])
    with pytest.raises(TypeError, match="defines none of"):
        trainer.fit(callbacks=[refused])
    assert trainer.steps_done == 0 and calls == [("user", "on_init", 0)]


def test_callbacks_must_be_a_list():
    with pytest.raises(TypeError, match="callbacks must be a list"):
        make(callbacks=Recorder([]))
    with pytest.raises(TypeError, match="callbacks must be a list"):
        make().fit(callbacks=Recorder([]))


@pytest.mark.parametrize("every", [3, 4])
def test_checkpoint_every_saves_once_per_step(tmp_path, monkeypatch, every):
    saved = []
    save = checkpoint.save

    def counting_save(trainer, path):
        saved.append(trainer.steps_done)
        save(trainer, path)

    monkeypatch.setattr(checkpoint, "save", counting_save)
    path = tmp_path / "run.pt"
    trainer = make(checkpoint_path=path, checkpoint_every=every)
    trainer.fit(max_steps=5)
    trainer.fit()
    ends = {STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH, 5}  # epochs' ends and the first fit's last
    expected = sorted({done for done in range(1, TOTAL + 1) if done % every == 0} | ends)
    assert saved == expected
    assert path.exists()


def test_a_users_checkpoint_callback_also_saves_once_per_step(tmp_path, monkeypatch):
    saved = []
    monkeypatch.setattr(checkpoint, "save", lambda trainer, path: saved.append(trainer.steps_done))
    make(callbacks=[Checkpoint(tmp_path / "run.pt", every=2)]).fit()
    assert saved == list(range(2, TOTAL + 1, 2))


def test_checkpoint_settings_are_checked_when_the_trainer_is_built(tmp_path):
    with pytest.raises(ValueError, match="checkpoint_every=0"):
        make(checkpoint_path=tmp_path / "run.pt", checkpoint_every=0)
    with pytest.raises(ValueError, match="checkpoint_every needs checkpoint_path"):
        make(checkpoint_every=2)
    with pytest.raises((ValueError, TypeError), match="does not exist"):
        make(checkpoint_path=tmp_path / "missing" / "run.pt")


def test_an_existing_checkpoint_is_resumed_at_init(tmp_path):
    path = tmp_path / "run.pt"
    first = make(checkpoint_path=path)
    first.fit(max_steps=4)
    history, params = first.history, first.params
    del first  # one live run per path: its lock goes with it
    gc.collect()
    with pytest.warns(UserWarning, match="resumed from the existing checkpoint_path"):
        second = make(checkpoint_path=path)
    assert second.steps_done == 4 and second.history == history
    for key, value in params.items():
        assert torch.equal(second.params[key], value)


@pytest.mark.parametrize("hook", ["on_fit_start", "on_epoch_end", "on_step_end", "on_fit_end"])
def test_an_error_in_a_callback_reaches_the_caller_at_once(hook):
    calls = []

    def fail(trainer, *_):
        if trainer.steps_done >= 2 or hook == "on_fit_start":
            raise KeyError(f"{hook} failed")

    Fails = type("Fails", (), {hook: staticmethod(fail)})

    trainer = make(callbacks=[Fails(), Recorder(calls)])
    with pytest.raises(KeyError, match=f"{hook} failed"):
        trainer.fit(max_steps=3)
    stopped_at = {"on_fit_start": 0, "on_epoch_end": 3, "on_step_end": 2, "on_fit_end": 3}[hook]
    assert trainer.steps_done == stopped_at
    # the callback after the failing one did not run that hook then
    assert not any(call[1] == hook and call[2] == stopped_at for call in calls)


def test_an_error_at_init_or_in_eval_fn_reaches_the_caller():
    class FailsAtInit:
        def on_init(self, trainer):
            raise OSError("cannot open the log")

    with pytest.raises(OSError, match="cannot open the log"):
        make(callbacks=[FailsAtInit()])
    with pytest.raises(ZeroDivisionError):
        make(eval_fn=lambda p: {"x": 1 / 0}).fit()
    with pytest.raises(TypeError, match="eval_fn must return a dict of numbers"):
        make(eval_fn=lambda p: 0.5).fit()


# -- built-in loggers, stopping at a budget, epsilon at any delta -------------------------

SIGMA, RATE, DELTA = 0.8, 20 / 120, 1e-4  # tiny_problem: 120 examples, 6 steps an epoch


@pytest.fixture
def tiny(tiny_problem):
    """A Trainer on ``tiny_problem()``: 2 epochs of 6 steps, RDP unless overridden."""

    def build(**overrides):
        loss_fn, params, dataset, _ = tiny_problem()
        kwargs = dict(optimizer=dpfunc.optim.sgd(lr=0.5), epochs=2, expected_batch_size=20,
                      clip_norm=1.0, noise_multiplier=SIGMA, delta=DELTA, physical_batch_size=16,
                      progress=False, accounting="rdp")  # fmt: skip
        kwargs.update(overrides)
        return dpfunc.Trainer(loss_fn, params, dataset, **kwargs)

    return build


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_csv_logger_writes_the_history_records_with_the_non_private_keys_labelled(tiny, tmp_path):
    path = tmp_path / "log.csv"
    trainer = tiny(callbacks=[CSVLogger(path)], eval_fn=lambda p: {"bias": float(p["2.bias"][0])})
    history = trainer.fit()
    rows = read_csv(path)
    assert len(rows) == len(history) == 2
    for row, record in zip(rows, history, strict=True):
        assert set(row) == {logged_name(key) for key in record}
        for key, value in record.items():
            assert float(row[logged_name(key)]) == value  # full precision, nothing dropped
    assert {"nonprivate/loss", "nonprivate/nonfinite", "nonprivate/bias"} <= set(rows[0])
    assert {"epoch", "steps", "epsilon", "clip_norm"} <= set(rows[0])
    assert "loss" not in rows[0] and "bias" not in rows[0]


def test_csv_logger_per_step_and_jsonl_logger_write_every_step(tiny, tmp_path):
    steps_csv, lines_path = tmp_path / "steps.csv", tmp_path / "log.jsonl"
    seen = []

    class Keep:
        def on_step_end(self, trainer, metrics):
            seen.append(dict(metrics, steps=trainer.steps_done))

    trainer = tiny(callbacks=[Keep(), CSVLogger(steps_csv, records="step"), JSONLogger(lines_path)])
    history = trainer.fit()
    rows = read_csv(steps_csv)
    assert [int(row["steps"]) for row in rows] == list(range(1, 13))
    for row, metrics in zip(rows, seen, strict=True):
        assert {key: float(row[logged_name(key)]) for key in metrics} == pytest.approx(
            metrics, nan_ok=True
        )
    lines = read_jsonl(lines_path)
    kinds = [(line["record"], line["steps"]) for line in lines]
    expected = []
    for done in range(1, 13):
        expected += [("epoch", done)] if done % 6 == 0 else []  # the record comes first
        expected.append(("step", done))
    assert kinds == expected
    epochs = [line for line in lines if line["record"] == "epoch"]
    assert [{logged_name(k): v for k, v in r.items()} for r in history] == [
        {k: v for k, v in line.items() if k != "record"} for line in epochs
    ]
    step_line = lines[0]
    assert step_line["nonprivate/loss"] == seen[0]["loss"]
    assert {key for key in step_line if key not in ("record", "steps")} == {
        logged_name(key) for key in seen[0] if key != "steps"
    }


def test_every_step_metric_is_labelled_public_or_non_private(tiny):
    metrics = []
    tiny(callbacks=[type("Keep", (), {"on_step_end": lambda s, t, m: metrics.append(m)})()]).fit(
        max_steps=1
    )
    for key in metrics[0]:
        assert (key in PUBLIC_METRICS) != (key in NON_PRIVATE_METRICS), key
    for key in ("loss", "batch_size", "clipped_fraction", "nonfinite", "examples_per_second"):
        assert key in metrics[0] and logged_name(key) == NON_PRIVATE_PREFIX + key
    assert metrics[0]["examples_per_second"] > 0


def test_a_log_is_appended_on_resume_and_never_overwritten_by_a_new_run(tiny, tmp_path):
    path, csv_path, checkpoint_path = (
        tmp_path / "log.jsonl",
        tmp_path / "log.csv",
        tmp_path / "c.pt",
    )
    first = tiny(checkpoint_path=checkpoint_path)
    first.fit(max_steps=4, callbacks=[JSONLogger(path), CSVLogger(csv_path)])
    logger = JSONLogger(path)
    first.fit(max_steps=1, callbacks=[logger])  # a later fit of the same run appends
    first.fit(max_steps=1, callbacks=[logger])
    assert [line["steps"] for line in read_jsonl(path) if line["record"] == "epoch"] == [4, 5, 6]
    del first  # one live run per path
    gc.collect()
    with pytest.warns(UserWarning, match="resumed"):
        resumed = tiny(checkpoint_path=checkpoint_path)  # the checkpoint of step 6
    assert resumed.steps_done == 6
    resumed.fit(callbacks=[JSONLogger(path), CSVLogger(csv_path)])
    epochs = [line for line in read_jsonl(path) if line["record"] == "epoch"]
    assert [line["steps"] for line in epochs] == [4, 5, 6, 12]
    assert epochs[-1]["epsilon"] == resumed.epsilon()
    rows = read_csv(csv_path)  # one header, the resumed run's rows after the first run's
    assert [row["steps"] for row in rows] == ["4", "12"]
    before = path.read_text()
    for logger in (JSONLogger(path), CSVLogger(csv_path)):
        fresh = tiny()
        with pytest.raises(FileExistsError, match="already holds a log"):
            fresh.fit(callbacks=[logger])
        assert fresh.steps_done == 0
    assert path.read_text() == before


def test_a_csv_log_refuses_a_row_with_a_new_key_and_another_runs_header(tiny, tmp_path):
    path = tmp_path / "log.csv"

    class AddsLater:
        def on_epoch_end(self, trainer, record):
            if trainer.steps_done > 6:
                record["late"] = 1.0

    trainer = tiny(callbacks=[AddsLater(), CSVLogger(path)])
    with pytest.raises(ValueError, match="nonprivate/late"):
        trainer.fit()
    path.write_text("a,b\n1,2\n")
    resumed = tiny()
    resumed.fit(max_steps=1)
    with pytest.raises(ValueError, match="has the columns"):
        resumed.fit(callbacks=[CSVLogger(path)])


def test_loggers_write_on_rank_0_only_and_check_their_arguments(tiny, tmp_path):
    trainer = tiny()
    trainer.plan.rank = 1  # what another rank sees
    trainer.fit(max_steps=2, callbacks=[CSVLogger(tmp_path / "a.csv"), JSONLogger(tmp_path / "b")])
    assert not (tmp_path / "a.csv").exists() and not (tmp_path / "b").exists()
    with pytest.raises(ValueError, match="does not exist"):
        CSVLogger(tmp_path / "missing" / "log.csv")
    with pytest.raises(ValueError, match="is a directory"):
        JSONLogger(tmp_path)
    with pytest.raises(ValueError, match="records"):
        CSVLogger(tmp_path / "log.csv", records="both")
    with pytest.raises(TypeError, match="path must be"):
        JSONLogger(3)


def test_a_callback_stops_fit_and_the_last_record_is_of_the_returned_parameters(tiny):
    calls = []

    class StopAt:
        def __init__(self, at):
            self.at = at

        def on_epoch_end(self, trainer, record):
            calls.append(("on_epoch_end", trainer.steps_done))

        def on_step_end(self, trainer, metrics):
            calls.append(("on_step_end", trainer.steps_done))
            trainer.stop_training = trainer.steps_done == self.at

    trainer = tiny(callbacks=[StopAt(4)])
    trainer.fit()
    assert trainer.steps_done == 4 and [r["steps"] for r in trainer.history] == [4]
    assert calls[-2:] == [("on_step_end", 4), ("on_epoch_end", 4)]  # the record after the stop
    assert trainer.history[-1]["epsilon"] == trainer.epsilon()
    trainer.callbacks[0].at = 6  # reset at the next fit, which stops at an epoch's end
    trainer.fit()
    assert trainer.steps_done == 6 and [r["steps"] for r in trainer.history] == [4, 6]


@pytest.mark.parametrize("accounting_method", ["rdp", "pld"])
def test_stop_at_epsilon_stops_before_a_step_would_exceed_the_budget(tiny, accounting_method):
    def eps(steps, delta):  # the oracle
        return accounting.epsilon(SIGMA, RATE, steps, delta, accounting_method)

    delta = 1e-6  # another delta than the trainer's
    budget = (eps(4, delta) + eps(5, delta)) / 2
    trainer = tiny(accounting=accounting_method)
    trainer.fit(callbacks=[StopAtEpsilon(budget, delta=delta)])
    assert trainer.steps_done == 4
    assert trainer.epsilon(delta) <= budget < eps(5, delta)
    assert trainer.history[-1]["steps"] == 4
    exact = tiny(accounting=accounting_method)  # a budget met exactly is within it
    exact.fit(callbacks=[StopAtEpsilon(eps(7, DELTA))])
    assert exact.steps_done == 7 and exact.epsilon() <= eps(7, DELTA)
    with pytest.warns(UserWarning, match="before its first step"):
        exact.fit(callbacks=[StopAtEpsilon(eps(7, DELTA))])
    assert exact.steps_done == 7


def test_stop_at_epsilon_below_one_step_takes_none_and_checks_its_arguments(tiny):
    trainer = tiny()
    with pytest.warns(UserWarning, match="step 1 would reach epsilon"):
        trainer.fit(callbacks=[StopAtEpsilon(1e-3)])
    assert trainer.steps_done == 0 and trainer.history == []
    for bad in (0, -1.0, math.inf, "1"):
        with pytest.raises(ValueError, match="epsilon must be"):
            StopAtEpsilon(bad)
    for bad in (0, 1, 1.5):
        with pytest.raises(ValueError, match="delta must be"):
            StopAtEpsilon(1.0, delta=bad)


@pytest.mark.parametrize("accounting_method", ["rdp", "pld"])
def test_epsilon_at_any_delta_is_the_accountants(tiny, accounting_method):
    trainer = tiny(accounting=accounting_method)
    trainer.fit(max_steps=5)
    deltas = [1e-8, 1e-6, DELTA, 1e-2]
    values = [trainer.epsilon(delta) for delta in deltas]
    for delta, value in zip(deltas, values, strict=True):
        assert value == pytest.approx(
            accounting.epsilon(SIGMA, RATE, 5, delta, accounting_method), rel=1e-12
        )
    assert values == sorted(values, reverse=True) and values[0] > values[-1]
    assert trainer.epsilon() == trainer.epsilon(DELTA) == trainer.history[-1]["epsilon"]
    for bad in (0, 1, -1e-5, float("nan"), "1e-5", True):
        with pytest.raises(ValueError, match="delta must be"):
            trainer.epsilon(bad)


def test_tensorboard_writes_scalars_with_the_non_private_ones_apart(tiny, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = tmp_path / "tb"
    trainer = tiny(callbacks=[TensorBoard(log_dir)])
    history = trainer.fit()
    events = EventAccumulator(str(log_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"epoch/epsilon", "epoch/clip_norm", "nonprivate/epoch/loss"} <= tags
    assert {"nonprivate/step/loss", "nonprivate/step/clipped_fraction"} <= tags
    assert not {"epoch/loss", "step/loss"} & tags
    written = [(e.step, e.value) for e in events.Scalars("epoch/epsilon")]
    assert written == [(r["steps"], pytest.approx(r["epsilon"], rel=1e-6)) for r in history]
    assert [e.step for e in events.Scalars("nonprivate/step/loss")] == list(range(1, 13))
    with pytest.raises(FileExistsError, match="already holds a log"):
        tiny().fit(callbacks=[TensorBoard(log_dir)])


def test_tensorboard_without_the_package_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with pytest.raises(ImportError, match=r"pip install \"dpfunc\[tensorboard\]\""):
        TensorBoard(tmp_path)


def test_the_metrics_carry_the_rate_each_update_applied(tiny):
    param = torch.nn.Parameter(torch.zeros(1))
    oracle = torch.optim.SGD([param], lr=0.3)  # torch's rates under its own scheduler
    scheduler = torch.optim.lr_scheduler.LinearLR(oracle, start_factor=1 / 3, total_iters=4)
    expected = []
    for _ in range(8):
        expected.append(oracle.param_groups[0]["lr"])
        oracle.step()
        scheduler.step()
    rates = []
    keep = type("Keep", (), {"on_step_end": lambda s, t, m: rates.append(m["lr"])})()
    optimizer = dpfunc.optim.sgd(lr=linear_warmup(0.3, 4))
    trainer = tiny(optimizer=optimizer, callbacks=[keep])
    history = trainer.fit(max_steps=8)
    assert rates == pytest.approx(expected, rel=1e-12) and len(set(rates)) == 5
    assert [record["lr"] for record in history] == [rates[5], rates[7]]  # the last step's
    unscheduled = tiny(optimizer=dpfunc.optim.scale(-0.1))  # no rate: no lr key
    assert "lr" not in unscheduled.train_step()
    unscheduled.fit(max_steps=1)
    assert "lr" not in unscheduled.history[-1]


def test_loggers_on_a_one_rank_group_write_and_raise_together(tiny, tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dpfunc.distributed.init("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        trainer = tiny(distributed=True)
        assert trainer.distributed
        path = tmp_path / "log.jsonl"
        trainer.fit(max_steps=3, callbacks=[JSONLogger(path)])  # the flags are gathered
        assert [line["steps"] for line in read_jsonl(path) if line["record"] == "step"] == [1, 2, 3]
        with pytest.raises(FileExistsError, match="already holds a log"):
            tiny(distributed=True).fit(callbacks=[JSONLogger(path)])
    finally:
        dpfunc.distributed.shutdown()
