"""Callbacks around the Trainer's steps: the hooks' order, the built-ins' order, callbacks for
one fit, refused objects, one checkpoint per step, and errors that reach the caller."""

import pytest
import torch

import dpfunc
from dpfunc import checkpoint
from dpfunc.callbacks import Checkpoint, Evaluate, ProgressBar

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
    with pytest.warns(UserWarning, match="resumed from the existing checkpoint_path"):
        second = make(checkpoint_path=path)
    assert second.steps_done == 4 and second.history == first.history
    for key, value in first.params.items():
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
