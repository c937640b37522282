"""The trainer: calibration, budget stop, empty steps, exact resume, checkpoints."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import dpfunc
from dpfunc import accounting
from dpfunc.step import StepNoise


@pytest.fixture
def make(tiny_problem):
    """A Trainer on ``tiny_problem()`` with these tests' settings, ``overrides`` replacing them
    (``loss_fn`` and ``params`` too)."""

    def make(**overrides):
        loss_fn, params, dataset, _ = tiny_problem()
        kwargs = dict(
            loss_fn=loss_fn,
            params=params,
            optimizer=dpfunc.optim.sgd(lr=0.5, momentum=0.5),
            epochs=2,
            expected_batch_size=20,
            clip_norm=1.0,
            noise_multiplier=0.8,
            delta=1e-4,
            physical_batch_size=16,
            progress=False,
            accounting="rdp",  # PLD is checked once below; RDP is 10x faster
        )
        kwargs.update(overrides)
        return dpfunc.Trainer(kwargs.pop("loss_fn"), kwargs.pop("params"), dataset, **kwargs)

    return make


def test_fit_trains_accounts_every_step_and_records_history(make):
    evaluated = []
    trainer = make(
        accounting="pld",
        eval_fn=lambda p: evaluated.append(1) or {"norm": float(p["2.bias"].norm())},
    )
    history = trainer.fit()
    assert trainer.steps_done == trainer.total_steps == 12
    assert [h["steps"] for h in history] == [6, 12] and len(evaluated) == 2
    expected = accounting.epsilon(0.8, 20 / 120, 12, 1e-4)
    assert history[-1]["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert history[-1]["loss"] < history[0]["loss"] + 0.5 and "norm" in history[0]
    assert int(trainer.state.step) == 12


def test_target_epsilon_is_calibrated_and_never_exceeded(make):
    trainer = make(noise_multiplier=None, target_epsilon=2.0)
    expected_sigma = accounting.calibrate_noise_multiplier(2.0, 1e-4, 20 / 120, 12, method="rdp")
    assert trainer.noise_multiplier == pytest.approx(expected_sigma)
    trainer.fit()
    assert trainer.epsilon() <= 2.0


def test_budget_stops_before_a_step_would_exceed_it(make):
    budget = accounting.epsilon(0.8, 20 / 120, 7, 1e-4, method="rdp") * 1.0001
    trainer = make(epsilon_budget=budget)
    trainer.fit()
    assert trainer.steps_done == 7
    assert trainer.epsilon() <= budget
    assert accounting.epsilon(0.8, 20 / 120, 8, 1e-4, method="rdp") > budget


def test_a_stop_between_epochs_records_the_final_epsilon(make):
    budget = accounting.epsilon(0.8, 20 / 120, 9, 1e-4, method="rdp") * 1.0001
    trainer = make(epsilon_budget=budget)  # epochs of 6 steps: stops in the second
    history = trainer.fit()
    assert [h["steps"] for h in history] == [6, 9]
    assert history[-1]["epsilon"] == trainer.epsilon()
    paused = make()
    assert [h["steps"] for h in paused.fit(max_steps=4)] == [4]
    assert [h["steps"] for h in paused.fit()] == [4, 6, 12]


def test_train_step_refuses_to_pass_the_budget_or_the_plan(make):
    budget = accounting.epsilon(0.8, 20 / 120, 3, 1e-4, method="rdp") * 1.0001
    trainer = make(epsilon_budget=budget)
    for _ in range(3):
        trainer.train_step()
    with pytest.raises(RuntimeError, match="step 4 would exceed epsilon_budget"):
        trainer.train_step()
    assert trainer.steps_done == 3 and trainer.epsilon() <= budget
    planned = make(epochs=1 / 6)  # one step
    planned.train_step()
    with pytest.raises(RuntimeError, match="planned total_steps=1"):
        planned.train_step()


def test_eval_values_are_stored_as_floats_or_refused(make):
    import numpy as np

    history = make(eval_fn=lambda p: {"acc": np.float64(0.5)}).fit()
    assert type(history[0]["acc"]) is float
    with pytest.raises(TypeError, match="eval_fn must return a dict of numbers, got acc="):
        make(eval_fn=lambda p: {"acc": "high"}).fit()


@pytest.mark.filterwarnings("ignore:noise_multiplier=.* exceeds expected_batch_size")
def test_empty_poisson_batches_are_steps_with_noise_only(make):
    # five steps; a public seed whose five samples are all empty
    trainer = make(expected_batch_size=0.01, epochs=0.01 / 120 * 5, seed=0)
    sizes = [trainer.batches.counts_per_rank(t)[0] for t in range(trainer.total_steps)]
    before = {k: v.clone() for k, v in trainer.params.items()}
    trainer.fit()
    assert trainer.total_steps == 5 and sum(sizes) == 0
    assert trainer.accountant.steps == 5
    assert any(not torch.equal(before[k], trainer.params[k]) for k in before)  # noise moved it


def test_oversized_batches_use_several_micro_batches(make):
    trainer = make(physical_batch_size=4, epochs=1)
    counts = [trainer.batches.micro_batch_count(t) for t in range(trainer.total_steps)]
    assert max(counts) > 1
    trainer.fit()
    assert trainer.steps_done == trainer.total_steps


def test_resume_adopts_the_secret_and_draws_afresh(tmp_path, make):
    """The fork rule: a resumed secret run keeps its partitions and accountant, not its draws."""
    first = make(epochs=3)  # a fresh secret seed
    whole = make(epochs=3, seed=first.seed)  # the same run, uninterrupted
    whole.fit()

    first.fit(max_steps=7)
    assert first.steps_done == 7
    first.save(tmp_path / "run.pt")

    resumed = make(epochs=3)  # draws its own secret, then takes the checkpoint's
    assert resumed.seed != whole.seed
    resumed.fit(max_steps=2)  # its noise for step 2 is drawn ahead, with its own seed
    resumed.load(tmp_path / "run.pt")
    assert resumed.seed == whole.seed and resumed.batches.seed != whole.seed
    assert resumed.seed_is_secret and resumed.steps_done == 7
    resumed.fit()
    assert any(not torch.equal(resumed.params[k], whole.params[k]) for k in whole.params)
    assert resumed.epsilon() == whole.epsilon()


def test_default_seed_is_a_fresh_secret_and_a_given_one_reproduces(make):
    one, two = make(), make()
    assert one.seed != two.seed and one.seed.bit_length() > 200  # 256 random bits
    assert str(one.seed) not in repr(one.batches)
    one.fit(max_steps=2)
    two.fit(max_steps=2)
    assert any(not torch.equal(one.params[k], two.params[k]) for k in one.params)
    same = [make(seed=12345), make(seed=12345)]  # reproducible research only: no privacy
    for trainer in same:
        trainer.fit(max_steps=2)
    assert all(torch.equal(same[0].params[k], same[1].params[k]) for k in one.params)


@pytest.mark.parametrize("spare", [True, False], ids=["ahead", "in-step"])
def test_noise_drawn_ahead_changes_no_bit(make, tiny_problem, monkeypatch, spare):
    """The trainer draws step t+1's noise while step t runs where a core is spare, else in
    the step; a plain loop draws it in turn."""
    monkeypatch.setattr(dpfunc.step, "_spare_core", lambda params: spare)
    trainer = make(epochs=1)
    trainer.fit()
    loss_fn, params, dataset, _ = tiny_problem()
    step = dpfunc.make_train_step(
        loss_fn,
        dpfunc.optim.sgd(lr=0.5, momentum=0.5),
        clip_norm=1.0,
        noise_multiplier=0.8,
        expected_batch_size=20,
    )
    state = step.init(params)
    batches = dpfunc.data.PoissonBatches(dataset, 20 / 120, 16, seed=trainer.seed)
    for t in range(trainer.steps_done):
        noise = StepNoise(dpfunc.standard_normal_like(params, trainer.seed, t), None)
        state, _ = step.logical_step(state, batches.logical_batch(t)[0], noise)
    assert all(torch.equal(state.params[k], trainer.params[k]) for k in params)


def test_a_checkpoint_of_another_seed_is_refused_without_printing_either(tmp_path, make):
    path = tmp_path / "ck.pt"
    secret = dpfunc.secret_seed()
    make(seed=secret).save(path)
    other = dpfunc.secret_seed()
    with pytest.raises(ValueError, match="another seed") as caught:
        make(seed=other).load(path)
    assert str(secret) not in str(caught.value) and str(other) not in str(caught.value)
    with pytest.raises(ValueError, match="secure_noise"):
        make(seed=secret, secure_noise=True).load(path)
    assert torch.load(path, weights_only=True)["config"]["seed"] == secret


def test_a_fresh_trainer_refuses_a_checkpoint_of_a_fixed_seed(tmp_path, make):
    """Adopting it would silently continue a run whose noise anyone with the seed removes."""
    path = tmp_path / "ck.pt"
    fixed = make(seed=0)  # a public seed: reproducible, not private
    fixed.fit(max_steps=2)
    fixed.save(path)
    with pytest.raises(ValueError, match="fixed seed, which is not a secret"):
        make().load(path)
    again = make(seed=0)
    again.load(path)  # resumed knowingly, as the reproducible run it is
    assert again.steps_done == 2


def test_checkpoints_of_the_public_default_seed_era_are_refused(tmp_path, make):
    path = tmp_path / "v1.pt"
    trainer = make()
    trainer.save(path)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["version"] = 1
    del checkpoint["seed_secret"]
    torch.save(checkpoint, path)
    with pytest.raises(ValueError, match="public default"):
        make().load(path)


def test_secure_noise_without_cryptography_fails_at_construction(monkeypatch, make):
    import sys

    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers", None)
    with pytest.raises(ImportError, match="dpfunc\\[secure\\]"):
        make(secure_noise=True)


def test_checkpoint_written_during_fit_resumes(tmp_path, make):
    path = tmp_path / "ck.pt"
    trainer = make(checkpoint_path=path, checkpoint_every=5)
    trainer.fit()
    again = make()
    again.load(path)
    assert again.steps_done == trainer.steps_done
    assert all(torch.equal(again.params[k], trainer.params[k]) for k in trainer.params)
    assert again.history == trainer.history


def test_bad_or_mismatched_checkpoints_raise_and_leave_state(tmp_path, make, tiny_problem):
    trainer = make()
    trainer.fit()
    path = tmp_path / "ck.pt"
    trainer.save(path)
    good_bytes = path.read_bytes()

    other = make(noise_multiplier=1.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        other.load(path)
    assert other.steps_done == 0

    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(good_bytes[: len(good_bytes) // 2])
    fresh = make()
    with pytest.raises(ValueError, match="unreadable"):
        fresh.load(corrupt)
    assert fresh.steps_done == 0

    loss_fn, params, _, _ = tiny_problem()
    wider = make(
        loss_fn=lambda p, ex: (
            loss_fn({k: v for k, v in p.items() if k != "extra"}, ex) + p["extra"].sum()
        ),
        params={**params, "extra": torch.zeros(3)},
    )
    with pytest.raises(ValueError, match="do not match"):
        wider.load(path)
    for key, value in [("accounting", "pld"), ("delta", 1e-5), ("physical_batch_size", 8)]:
        with pytest.raises(ValueError, match=f"written with {key}="):
            make(**{key: value}).load(path)
    malformed = tmp_path / "malformed.pt"
    checkpoint = torch.load(path, weights_only=True)
    for broken in (
        {**checkpoint, "state": 5},
        {k: v for k, v in checkpoint.items() if k != "history"},
    ):
        torch.save(broken, malformed)
        with pytest.raises(ValueError, match="malformed"):
            make().load(malformed)
    assert path.read_bytes() == good_bytes  # a failed load never touches the file


def test_save_replaces_atomically(tmp_path, monkeypatch, make):
    trainer = make()
    path = tmp_path / "ck.pt"
    trainer.save(path)
    good = path.read_bytes()

    def broken_save(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError):
        trainer.save(path)
    assert path.read_bytes() == good
    assert [p.name for p in tmp_path.iterdir() if p.name != ".ck.pt.lock"] == ["ck.pt"]


def test_default_delta_is_below_one_over_n_and_large_delta_warns(make):
    trainer = make(delta=None)
    assert trainer.delta < 1 / 120
    with pytest.warns(UserWarning, match="delta"):
        make(delta=0.01)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(noise_multiplier=None), "exactly one of noise_multiplier and target_epsilon"),
        (dict(target_epsilon=1.0), "exactly one of noise_multiplier and target_epsilon"),
        (dict(epochs=0), "epochs=0"),
        (dict(expected_batch_size=500), "expected_batch_size=500"),
        (dict(delta=1.5), "delta=1.5"),
        (dict(physical_batch_size=0), "physical_batch_size=0"),
        (dict(epsilon_budget=-1.0), "epsilon_budget=-1.0"),
        (dict(epsilon_budget="2"), "epsilon_budget='2'"),
        (dict(epochs=True), "epochs=True"),
        (dict(checkpoint_every=3), "checkpoint_path"),
        (dict(seed=-1), "seed must be an int >= 0 .* got a negative int"),
        (dict(seed=1.0), "seed must be an int >= 0 .* got a float"),
        (dict(seed=True), "seed must be an int >= 0 .* got a bool"),
        (dict(secure_noise=1), "secure_noise must be a bool, got secure_noise=1"),
    ],
)
def test_bad_arguments_raise(overrides, match, make):
    with pytest.raises(ValueError, match=match):
        make(**overrides)


def test_progress_bar_shows_loss_epsilon_and_throughput(capsys, make):
    trainer = make(progress=True, epochs=1)
    trainer.fit()
    err = capsys.readouterr().err
    assert "eps=" in err and "loss=" in err and "ex_s=" in err
    assert math.isfinite(trainer.epsilon())


def test_adaptive_clipping_follows_the_quantile_and_accounts_the_count(make):
    trainer = make(
        target_quantile=0.5,
        quantile_learning_rate=1.0,
        clip_norm=1e-3,
        epochs=3,
        count_noise_multiplier=2.0,
    )
    history = trainer.fit()
    combined = accounting.combined_noise_multiplier(0.8, 2.0)
    assert trainer.accounted_noise_multiplier == pytest.approx(combined)
    assert history[-1]["epsilon"] == pytest.approx(
        accounting.epsilon(combined, 20 / 120, trainer.total_steps, 1e-4, method="rdp"), rel=1e-9
    )
    assert history[0]["clip_norm"] > 1e-3 and trainer.clip_norm > 1e-2  # grew from far below
    assert history[-1]["clip_norm"] == trainer.clip_norm


def test_adaptive_clipping_calibrates_the_combined_noise_and_resumes(tmp_path, make):
    assert make(target_quantile=0.5).step_fn.count_noise_multiplier == 20 / 20  # the default
    settings = dict(
        target_quantile=0.5,
        count_noise_multiplier=5.0,
        noise_multiplier=None,
        target_epsilon=3.0,
        epochs=2,
    )
    trainer = make(**settings, seed=4321)  # a fixed seed resumes bit for bit
    sigma_c = trainer.accounted_noise_multiplier
    assert sigma_c == pytest.approx(
        accounting.combined_noise_multiplier(trainer.noise_multiplier, 5.0)
    )
    assert sigma_c < trainer.noise_multiplier  # the count takes its share
    whole = make(**settings, seed=trainer.seed)
    whole.fit()
    trainer.fit(max_steps=5)
    trainer.save(tmp_path / "ck.pt")
    resumed = make(**settings, seed=4321)
    resumed.load(tmp_path / "ck.pt")
    resumed.fit()
    assert resumed.clip_norm == whole.clip_norm
    assert all(torch.equal(resumed.params[k], whole.params[k]) for k in whole.params)
    assert whole.epsilon() <= 3.0


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(target_quantile=0.5, clipping="per_layer"), "adaptive clipping .* clipping='flat'"),
        (dict(target_quantile=1.0), "target_quantile must be a number in \\(0, 1\\)"),
        (
            dict(target_quantile=0.5, count_noise_multiplier=0.0),
            "count_noise_multiplier must be a finite number > 0",
        ),
        (
            dict(target_quantile=0.5, noise_multiplier=None, target_epsilon=0.5,
                 count_noise_multiplier=0.5),
            "raise it",
        ),
    ],
)  # fmt: skip
def test_adaptive_clipping_rejects_what_it_cannot_do(overrides, match, make):
    with pytest.raises(ValueError, match=match):
        make(**overrides)


@pytest.mark.parametrize("method, expected", [("ghost", "ghost"), ("vmap", "vmap: method='vmap'")])
def test_method_reaches_the_step(method, expected):
    model = nn.Linear(4, 2)
    params, buffers = dpfunc.functionalize(model)
    x, y = torch.randn(40, 4), torch.randint(0, 2, (40,))

    def loss_fn(p, example):
        xi, yi = example
        return F.cross_entropy(functional_call(model, (p, buffers), (xi[None],)), yi[None])

    trainer = dpfunc.Trainer(
        loss_fn, params, (x, y), optimizer=dpfunc.optim.sgd(lr=0.1), epochs=1,
        expected_batch_size=8, clip_norm=1.0, noise_multiplier=1.0, delta=1e-4,
        progress=False, model=model, method=method,
    )  # fmt: skip
    plan = trainer.step_fn.explain(trainer.params, (x[:8], y[:8]))
    assert set(plan.values()) == {expected}
    with pytest.raises(ValueError, match="method must be one of"):
        dpfunc.Trainer(loss_fn, params, (x, y), optimizer=dpfunc.optim.sgd(lr=0.1), epochs=1,
                       expected_batch_size=8, clip_norm=1.0, noise_multiplier=1.0,
                       delta=1e-4, progress=False, model=model, method="fast")  # fmt: skip
