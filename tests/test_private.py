"""dpfunc.PrivateGradients: DP-SGD's private gradient written into p.grad for torch.optim.

Oracles: the Trainer with dpfunc.optim.sgd (the same update for the same seed),
the Gaussian distribution of the noise (std sigma * C / B), the clip bound on a
neighbouring dataset, dp-accounting's epsilon, and a resumed run against an
uninterrupted one.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import dpfunc
from dpfunc import PrivateGradients
from dpfunc.accounting import epsilon as accounting_epsilon

SETTINGS = dict(expected_batch_size=8.0, clip_norm=0.7, noise_multiplier=1.3, delta=1e-5)


def mlp(seed: int = 0, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def loss_for(model: nn.Module):
    def loss_fn(params, example):
        x, y = example
        return F.cross_entropy(functional_call(model, params, (x[None],)), y[None])

    return loss_fn


def dataset(n: int = 60, dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    return torch.randn(n, 6, generator=g, dtype=dtype) * 2, torch.randint(0, 3, (n,), generator=g)


def private_for(model, data=None, **overrides):
    # ghost, not auto: auto times both paths and may pick either, which rounds differently
    kwargs = dict(SETTINGS, epochs=1, seed=11, physical_batch_size=5, method="ghost")
    kwargs.update(overrides)
    return PrivateGradients(model, loss_for(model), dataset() if data is None else data, **kwargs)


def params_of(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def train(private, optimizer, steps=None):
    for batch in private.batches(steps):
        private.backward(batch)
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize(
    "options",
    [
        {"method": "auto"},
        {"method": "vmap", "physical_batch_size": 3},  # several micro-batches per step
        {"bands": 3, "expected_batch_size": 4.0},  # correlated noise, cyclic Poisson sampling
        {"target_quantile": 0.5, "count_noise_multiplier": 5.0},  # adaptive clipping
        {"secure_noise": True},  # the ChaCha20 generator
    ],
    ids=["auto", "vmap-accumulated", "bands", "adaptive", "secure"],
)
def test_torch_sgd_on_private_gradients_equals_the_trainer(options):
    model = mlp()
    start = params_of(model)
    private = private_for(model, **options)
    train(private, torch.optim.SGD(model.parameters(), lr=0.3))

    reference = mlp()
    params, _ = dpfunc.functionalize(reference)
    trainer_options = dict(SETTINGS, epochs=1, seed=11, physical_batch_size=5, method="ghost")
    trainer_options.update(options)
    trainer = dpfunc.Trainer(
        loss_for(reference), params, dataset(), optimizer=dpfunc.optim.sgd(lr=0.3),
        progress=False, model=reference, **trainer_options,
    )  # fmt: skip
    trainer.fit()
    assert private.steps_done == trainer.steps_done == trainer.total_steps > 3
    assert private.epsilon() == trainer.epsilon()
    assert private.clip_norm == pytest.approx(trainer.clip_norm, rel=1e-12)
    for name, p in model.named_parameters():
        assert not torch.equal(p.detach(), start[name])
        torch.testing.assert_close(p.detach(), trainer.params[name], rtol=1e-6, atol=1e-7)


def zero_gradient_model():
    """A Linear(100, 100) whose loss has gradient 0: the private gradient is the noise alone."""
    model = nn.Linear(100, 100)

    def loss_fn(params, example):
        return (functional_call(model, params, (example[None],)) * 0.0).sum()

    return model, loss_fn


def test_the_gradient_is_gaussian_noise_of_std_sigma_c_over_b():
    model, loss_fn = zero_gradient_model()
    private = PrivateGradients(model, loss_fn, torch.randn(40, 100), epochs=1, seed=5,
                               **SETTINGS)  # fmt: skip
    batch = next(private.batches())
    private.backward(batch)
    draws = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
    std = SETTINGS["noise_multiplier"] * SETTINGS["clip_norm"] / SETTINGS["expected_batch_size"]
    assert draws.numel() == 10100

    def ks(scale):  # Kolmogorov-Smirnov distance to N(0, scale^2)
        x, _ = torch.sort(draws / scale)
        cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
        n = x.numel()
        ranks = torch.arange(1, n + 1, dtype=torch.float64)
        return max(float((ranks / n - cdf).max()), float((cdf - (ranks - 1) / n).max()))

    critical = 1.63 / math.sqrt(draws.numel())  # alpha = 0.01
    assert ks(std) < critical
    assert ks(std * 2 / 3) > critical and ks(std * 3 / 2) > critical


def test_each_example_moves_the_gradient_by_at_most_the_clip_norm():
    # one example, sample rate 1, no noise: B * p.grad is that example's clipped gradient,
    # the most one example can add to (or, removed, take from) the sum
    x, y = dataset(6)
    x[3] *= 1e3  # an outlier with a huge gradient
    for i in range(6):
        model = mlp(dtype=torch.float64)
        private = PrivateGradients(
            model, loss_for(model), (x[i : i + 1].double(), y[i : i + 1]), epochs=1, seed=1,
            expected_batch_size=1.0, clip_norm=0.25, noise_multiplier=0.0, delta=1e-5,
        )  # fmt: skip
        assert private.sample_rate == 1.0
        private.backward(next(private.batches()))
        norm = float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm())
        assert norm <= 0.25 * (1 + 1e-12)
        if i == 3:
            assert norm > 0.2499  # the outlier is clipped, not dropped


def test_backward_overwrites_gradients_and_clears_those_of_frozen_parameters():
    model = mlp()
    model[0].bias.requires_grad_(False)
    model[0].bias.grad = torch.full_like(model[0].bias, 5.0)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.full_like(p, 1e6)  # a stale gradient the user forgot to zero
    private = private_for(model)
    with pytest.warns(UserWarning, match=r"cleared the .grad of frozen parameters \['0.bias'\]"):
        private.backward(next(private.batches()))
    fresh_model = mlp()
    fresh_model[0].bias.requires_grad_(False)
    fresh = private_for(fresh_model)
    fresh.backward(next(fresh.batches()))
    for (name, p), q in zip(model.named_parameters(), fresh_model.parameters()):
        if name == "0.bias":  # stale: an optimizer would have stepped it
            assert p.grad is None
        else:
            assert torch.equal(p.grad, q.grad)


def test_metrics_epsilon_at_any_delta_and_the_batch_order():
    model = mlp()
    private = private_for(model)
    batches = private.batches()
    first = next(batches)
    assert repr(first).startswith("LogicalBatch(step=0")  # no data in the repr
    metrics = private.backward(first)
    assert set(metrics) >= {"loss", "batch_size", "clipped_fraction", "nonfinite"}
    with pytest.raises(ValueError, match="released once"):
        private.backward(first)  # the same batch again would release its noise twice
    with pytest.raises(TypeError, match="batches"):
        private.backward(dataset())
    next(batches)  # the batch of step 1, never passed to backward
    with pytest.raises(RuntimeError, match="backward"):
        next(batches)
    rate = private.sample_rate
    for delta in (1e-5, 1e-3):
        assert private.epsilon(delta) == accounting_epsilon(1.3, rate, 1, delta)
    assert private.epsilon() == private.epsilon(1e-5)
    report = private.privacy_report(1e-3)
    assert report.as_dict()["epsilon"] == private.epsilon(1e-3)
    assert "FIXED" in str(report)  # seed=11: not private against whoever knows it
    with pytest.raises(ValueError, match="delta"):
        private.epsilon(2.0)
    assert "seed" not in repr(private)


def test_a_rewind_or_a_batch_of_ones_own_is_refused():
    model = mlp()
    private = private_for(model)
    batches = private.batches()
    private.backward(next(batches))
    saved = private.state_dict()
    batch = next(batches)
    with pytest.raises(ValueError, match="not the one batches"):  # relabelled data of one's own
        private.backward(dpfunc.LogicalBatch(batch.step, list(batch.micro_batches), batch.size))
    private.backward(batch)
    with pytest.raises(ValueError, match="already written 2 private gradients"):  # step 1 again
        private.load_state_dict(saved)
    assert private.steps_done == 2


def test_the_plan_and_the_budget_end_the_batches():
    model = mlp()
    private = private_for(model)
    train(private, torch.optim.SGD(model.parameters(), lr=0.1))
    assert private.steps_done == private.total_steps == round(60 / 8)
    assert list(private.batches()) == []
    budget = accounting_epsilon(1.3, 8 / 60, 3, 1e-5) * 1.0001
    limited_model = mlp()
    limited = private_for(limited_model, epochs=None, epsilon_budget=budget)
    assert limited.total_steps is None
    train(limited, torch.optim.SGD(limited_model.parameters(), lr=0.1))
    assert limited.steps_done == 3 and limited.epsilon() <= budget


def test_a_moved_or_converted_model_is_followed():
    model = mlp()
    private = private_for(model)
    model.double()  # converted after PrivateGradients was built: read live
    data64 = (dataset()[0].double(), dataset()[1])
    reference_model = mlp(dtype=torch.float64)
    reference = private_for(reference_model, data=data64)
    private.plan.batches.dataset = reference.plan.batches.dataset  # the data converted too
    for _ in range(2):
        for one in (private, reference):
            one.backward(next(one.batches(1)))
        for p, q in zip(model.parameters(), reference_model.parameters()):
            assert p.grad.dtype == torch.float64
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15)


def test_a_replaced_module_or_a_changed_trainable_set_is_refused():
    model = mlp()
    private = private_for(model)
    model[2] = nn.Linear(8, 3)  # the optimizer would hold the old parameters
    with pytest.raises(ValueError, match="another tensor"):
        private.backward(next(private.batches()))
    model = mlp()
    private = private_for(model)
    model[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match="trainable parameters changed"):
        private.backward(next(private.batches()))
    assert private.steps_done == 0  # refused before anything was accounted or released


def test_a_peft_wrap_after_building_is_refused():
    peft = pytest.importorskip("peft")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(6, 8)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            return self.head(torch.tanh(self.body(x)))

    model = Net()
    private = private_for(model)
    peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["body"]))
    with pytest.raises(ValueError, match="PEFT"):
        private.backward(next(private.batches()))


def test_state_dict_resumes_bit_identically_with_the_optimizer():
    """With a fixed seed; a secret one continues with fresh draws (tests/test_misuse.py)."""

    def run(model, private, optimizer, steps):
        train(private, optimizer, steps)
        return private

    model = mlp()
    whole = private_for(model, seed=2024, bands=2, expected_batch_size=4.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    run(model, whole, optimizer, None)

    model = mlp()
    first = private_for(model, seed=2024, bands=2, expected_batch_size=4.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    run(model, first, optimizer, 4)
    saved = (first.state_dict(), model.state_dict(), optimizer.state_dict())

    resumed_model = mlp(seed=5)
    resumed = private_for(resumed_model, seed=2024, bands=2, expected_batch_size=4.0)
    resumed_optimizer = torch.optim.AdamW(resumed_model.parameters(), lr=0.05)
    resumed.load_state_dict(saved[0])
    resumed_model.load_state_dict(saved[1])
    resumed_optimizer.load_state_dict(saved[2])
    assert resumed.steps_done == 4 and resumed.seed == whole.seed
    run(resumed_model, resumed, resumed_optimizer, None)
    assert resumed.epsilon() == whole.epsilon()
    whole_params = dict(whole.model.named_parameters())
    for name, p in resumed_model.named_parameters():
        assert torch.equal(p, whole_params[name]), name

    other = private_for(mlp(), seed=2024, clip_norm=0.5)
    with pytest.raises(ValueError, match="clip_norm"):
        other.load_state_dict(saved[0])
    assert other.steps_done == 0


def test_works_under_autocast_and_writes_the_parameters_dtype():
    model = mlp()
    private = private_for(model, method="vmap")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        metrics = private.backward(next(private.batches()))
    assert math.isfinite(metrics["loss"])
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    half = mlp(dtype=torch.bfloat16)
    private = private_for(half, data=(dataset()[0].bfloat16(), dataset()[1]))
    private.backward(next(private.batches()))
    assert all(p.grad.dtype == torch.bfloat16 for p in half.parameters())


def test_arguments_are_checked_before_any_work():
    model = mlp()
    with pytest.raises(TypeError, match="model"):
        PrivateGradients(loss_for(model), model, dataset(), epochs=1, **SETTINGS)
    with pytest.raises(ValueError, match="epochs"):
        PrivateGradients(model, loss_for(model), dataset(), target_epsilon=3.0,
                         expected_batch_size=8.0, clip_norm=1.0)  # fmt: skip
    with pytest.raises(ValueError, match="nonfinite"):
        private_for(model, nonfinite="ignore")
    with pytest.raises(ValueError, match="BatchNorm"):
        bn = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4))
        PrivateGradients(bn, loss_for(bn), dataset(), epochs=1, **SETTINGS)
    frozen = mlp().requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad"):
        private_for(frozen)
    with pytest.raises(ValueError, match="steps"):
        next(private_for(model).batches(-1))


def test_all_nan_data_raises_before_writing():
    model = mlp()
    x, y = dataset()
    private = private_for(model, data=(torch.full_like(x, math.nan), y))
    batch = next(private.batches())
    while batch.size == 0:  # an empty step is released (noise only) and accounted
        private.backward(batch)
        batch = next(private.batches())
    with pytest.raises(FloatingPointError, match="non-finite"):
        private.backward(batch)
    assert all(p.grad is None for p in model.parameters())


def test_digits_with_adamw_and_a_cosine_schedule_trains():
    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    train_x, train_y, test_x, test_y = x[:1400], y[:1400], x[1400:], y[1400:]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    private = PrivateGradients(
        model, loss_for(model), (train_x, train_y), expected_batch_size=128, clip_norm=1.0,
        target_epsilon=3.0, delta=1e-5, epochs=8,
    )  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=private.total_steps)
    for batch in private.batches():
        private.backward(batch)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
    assert private.epsilon() <= 3.0
    assert accuracy > 0.8, accuracy


def test_compiled_equals_eager():
    results = []
    for compile in (False, True):
        model = mlp()
        private = private_for(model, compile=compile)
        train(private, torch.optim.SGD(model.parameters(), lr=0.3), steps=2)
        results.append(params_of(model))
    for name, value in results[0].items():
        torch.testing.assert_close(results[1][name], value, rtol=1e-5, atol=1e-6)
