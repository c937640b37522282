"""The Trainer fails before any work on a bad argument, and never trains on NaN in silence."""

import logging
import math
import warnings

import pytest
import torch

import dpfunc
from dpfunc import accounting


@pytest.fixture
def make(tiny_problem):
    """A Trainer on ``tiny_problem(nan_rows=nan_rows)`` with these tests' settings, ``overrides``
    replacing them (``params`` and ``dataset`` too)."""

    def make(nan_rows=0, **overrides):
        loss_fn, params, dataset, _ = tiny_problem(nan_rows=nan_rows)
        kwargs = dict(
            optimizer=dpfunc.optim.sgd(lr=0.5),
            epochs=2,
            expected_batch_size=20,
            clip_norm=1.0,
            noise_multiplier=0.8,
            delta=1e-4,
            progress=False,
            accounting="rdp",
        )
        kwargs.update(overrides)
        params = kwargs.pop("params", params)
        dataset = kwargs.pop("dataset", dataset)
        return dpfunc.Trainer(loss_fn, params, dataset, **kwargs)

    return make


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        (dict(eval_fn=42), TypeError, "eval_fn must be a callable .* got eval_fn=42"),
        (dict(clip_norm=math.inf), ValueError, "clip_norm=inf"),
        (dict(clip_norm=math.inf, noise_multiplier=None, target_epsilon=1.0), ValueError,
         "clip_norm=inf"),
        (dict(clip_norm=0.0), ValueError, "clip_norm must be .* got clip_norm=0.0"),
        (dict(noise_multiplier=None, target_epsilon=-1.0), ValueError, "target_epsilon=-1.0"),
        (dict(epsilon_budget=1e-3), ValueError,
         "epsilon_budget=0.001 .* does not allow a single step: one step already spends"),
        (dict(nonfinite="ignore"), ValueError, "nonfinite must be one of 'warn', 'error'"),
        (dict(params={}), ValueError, "params holds no trainable parameters"),
        (dict(params={"w": torch.zeros(3, dtype=torch.int64)}), TypeError,
         r"params\['w'\] has dtype torch.int64; only floating-point"),
        (dict(dataset=torch.zeros(0, 4)), ValueError, "dataset is empty"),
        (dict(checkpoint_path="/nonexistent-dir/run.pt"), ValueError,
         "checkpoint_path='/nonexistent-dir/run.pt' is in a directory that does not exist"),
    ],
)  # fmt: skip
def test_bad_arguments_fail_at_construction(overrides, error, match, make):
    with pytest.raises(error, match=match):
        make(**overrides)


def test_calibration_is_not_run_for_an_infinite_clip_norm(monkeypatch, make):
    def fail(*args, **kwargs):
        raise AssertionError("calibrated before the arguments were checked")

    monkeypatch.setattr(dpfunc.config, "calibrate_noise_multiplier", fail)
    with pytest.raises(ValueError, match="clip_norm=inf"):
        make(clip_norm=math.inf, noise_multiplier=None, target_epsilon=1.0)


def test_a_budget_of_one_step_is_accepted_and_its_epsilon_is_in_the_message(make):
    one = accounting.epsilon(0.8, 20 / 120, 1, 1e-4, method="rdp")
    trainer = make(epsilon_budget=one * 1.0001)
    assert trainer.fit() and trainer.steps_done == 1
    with pytest.raises(ValueError, match=f"{one:.4g}"):
        make(epsilon_budget=one * 0.999)


def test_a_hopeless_noise_level_warns(make):
    with pytest.warns(UserWarning, match="exceeds expected_batch_size=20"):
        make(noise_multiplier=None, target_epsilon=1e-4)


def test_eval_fn_must_return_a_dict(make):
    trainer = make(eval_fn=lambda params: 0.5)
    with pytest.raises(TypeError, match="eval_fn must return a dict of numbers.* got 0.5"):
        trainer.fit()


def test_rdp_accounting_prints_nothing(capfd, caplog):
    with caplog.at_level(logging.DEBUG):
        value = accounting.epsilon(0.5, 0.5, 100, 1e-5, method="rdp")  # orders fail to converge
    assert math.isfinite(value)
    captured = capfd.readouterr()
    assert captured.err == "" and captured.out == ""
    assert not [r for r in caplog.records if r.name == "absl"]


# -- non-finite examples ----------------------------------------------------------


def test_all_nan_data_raises_at_the_first_step(make):
    trainer = make(nan_rows=120)
    before = {k: v.clone() for k, v in trainer.params.items()}
    with pytest.raises(FloatingPointError, match="every example of the step"):
        trainer.fit()
    assert trainer.steps_done == 0  # nothing released, nothing accounted
    assert all(torch.equal(before[k], trainer.params[k]) for k in before)


def test_some_nan_examples_warn_once_and_are_counted(make):
    trainer = make(nan_rows=30)
    with pytest.warns(RuntimeWarning, match="non-finite .* NaN or inf in the data") as caught:
        history = trainer.fit()
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    assert trainer.steps_done == trainer.total_steps
    assert sum(record["nonfinite"] for record in history) > 0
    assert all(math.isfinite(float(v.sum())) for v in trainer.params.values())


def test_nonfinite_error_raises_at_the_first_nan_example(make):
    trainer = make(nan_rows=30, nonfinite="error")
    with pytest.raises(FloatingPointError, match="nonfinite='error'"):
        trainer.fit()


def test_clean_data_records_zero_and_warns_nothing(make):
    trainer = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        history = trainer.fit()
    assert [record["nonfinite"] for record in history] == [0, 0]


def test_more_micro_batches_than_the_clip_margin_covers_are_refused(monkeypatch, make):
    monkeypatch.setattr(dpfunc._plan, "ACCUMULATED_SUMS", 100)
    with pytest.raises(ValueError, match="physical_batch_size=1 could split .* more than 100"):
        make(physical_batch_size=1)
    make(physical_batch_size=2)  # 60 micro-batches at most
