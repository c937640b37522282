"""The privacy report: its numbers are the trainer's, the config's and the accountant's (oracles:
dpfunc.accounting's functions), its text states the generator, the seed and what the guarantee
does not cover, and it refuses inputs it would misdescribe; the steps a budget allows."""

import json
import math

import pytest

import dpfunc
from dpfunc import accounting
from dpfunc.accounting import Accountant
from dpfunc.report import NOT_COVERED, PrivacyReport, privacy_report, steps_within_budget

N = 120  # tiny_problem's examples


@pytest.fixture
def tiny(tiny_problem):
    def build(**overrides):
        loss_fn, params, dataset, _ = tiny_problem()
        kwargs = dict(optimizer=dpfunc.optim.sgd(lr=0.5), epochs=2, expected_batch_size=20,
                      clip_norm=1.0, noise_multiplier=0.8, delta=1e-4, physical_batch_size=16,
                      progress=False, accounting="rdp")  # fmt: skip
        kwargs.update(overrides)
        return dpfunc.Trainer(loss_fn, params, dataset, **kwargs)

    return build


@pytest.mark.parametrize("method", ["rdp", "pld"])
def test_the_reports_numbers_are_the_trainers_and_the_accountants(tiny, method):
    trainer = tiny(accounting=method, seed=7)
    trainer.fit(max_steps=5)
    report = trainer.privacy_report()
    expected = accounting.epsilon(0.8, 20 / N, 5, 1e-4, method)
    assert report.epsilon == trainer.epsilon() == pytest.approx(expected, rel=1e-12)
    assert report.delta == trainer.delta == 1e-4
    assert report.noise_multiplier == report.accounted_noise_multiplier == trainer.noise_multiplier
    assert report.sample_rate == trainer.sample_rate == 20 / N
    assert (report.steps, report.planned_steps) == (5, trainer.total_steps) == (5, 12)
    assert (report.accounting, report.bands, report.participations) == (method, 1, 5)
    assert (report.clip_norm, report.clipping, report.num_examples) == (1.0, "flat", N)
    assert report.count_noise_multiplier is None and report.target_quantile is None
    grid = accounting.PLD_VALUE_DISCRETIZATION_INTERVAL if method == "pld" else None
    assert report.value_discretization_interval == grid
    assert report.accountant.startswith(method.upper())
    other = trainer.privacy_report(delta=1e-7)
    assert other.epsilon == trainer.epsilon(1e-7) > report.epsilon and other.delta == 1e-7
    assert report == privacy_report(trainer.config, trainer.accountant, N, seed_is_secret=False)


def test_the_report_as_data_and_as_text(tiny):
    trainer = tiny(seed=3)
    trainer.fit(max_steps=2)
    report = trainer.privacy_report()
    data = report.as_dict()
    assert json.loads(json.dumps(data)) == data
    assert set(data) == {field.name for field in PrivacyReport.__dataclass_fields__.values()}
    assert data["epsilon"] == report.epsilon and data["not_covered"] == list(report.not_covered)
    text = str(report)
    for fact in (f"{report.epsilon:.6g}", "0.0001)-DP", "2 of 12 planned", "RDP", "sigma = 0.8",
                 "q = 0.166667", "Poisson", "add or remove one example"):  # fmt: skip
        assert fact in text, fact
    for item in NOT_COVERED:
        assert item in text and item in report.not_covered
    for words in ("non-private diagnostics", "hyperparameter search", "checkpoint's secret",
                  "evaluation on private data", "dpfunc.tune has its own epsilon"):  # fmt: skip
        assert words in text, words
    # a fixed seed and torch's generator: both said, with what they void
    assert not report.seed_is_secret and "FIXED" in text and "does NOT hold" in text
    assert "Mersenne Twister" in text and "floating-point attack" in text
    assert "CSPRNG" in str(tiny().privacy_report())  # seed=None: a drawn secret
    assert tiny().privacy_report().seed_is_secret


def test_the_secure_generator_adaptive_clipping_and_bands_are_reported():
    pytest.importorskip("cryptography")
    config = dpfunc.DPConfig(clip_norm=1.0, expected_batch_size=10, noise_multiplier=1.0,
                             target_quantile=0.5, secure_noise=True, epochs=1)  # fmt: skip
    config = config.calibrated(1000)
    acc = config.accountant()
    acc.step(*config.accounting_event(1000), steps=3)
    report = privacy_report(config, acc, 1000, seed_is_secret=True)
    combined = accounting.combined_noise_multiplier(1.0, config.count_noise_multiplier)
    assert report.accounted_noise_multiplier == pytest.approx(combined, rel=1e-15)
    assert report.noise_multiplier == 1.0 and report.count_noise_multiplier == 0.5
    assert report.epsilon == accounting.epsilon(combined, 0.01, 3, config.delta)
    assert report.secure_noise and "ChaCha20" in report.noise_generator
    assert "floating-point attack" not in str(report) and "accounted sigma" in str(report)
    assert report.planned_steps == 100 and report.target_quantile == 0.5

    bands = dpfunc.DPConfig(clip_norm=1.0, expected_batch_size=10, noise_multiplier=1.0,
                            bands=4, delta=1e-5)  # fmt: skip
    acc = bands.accountant()
    acc.step(*bands.accounting_event(1000), steps=10)
    report = privacy_report(bands, acc, 1000, seed_is_secret=True)
    assert (report.bands, report.participations, report.planned_steps) == (4, 3, None)
    assert report.sample_rate == 0.04 and "cyclic Poisson over b = 4" in report.sampling
    assert report.epsilon == accounting.epsilon(1.0, 0.04, 10, 1e-5, bands=4)


def test_the_report_refuses_what_it_would_misdescribe():
    config = dpfunc.DPConfig(clip_norm=1.0, expected_batch_size=10, noise_multiplier=1.0,
                             delta=1e-5)  # fmt: skip
    acc = config.accountant()
    acc.step(*config.accounting_event(1000))
    with pytest.raises(TypeError, match="config must be"):
        privacy_report({"clip_norm": 1.0}, acc, 1000, seed_is_secret=True)
    with pytest.raises(TypeError, match="accountant must be"):
        privacy_report(config, [], 1000, seed_is_secret=True)
    with pytest.raises(TypeError, match="seed_is_secret must be"):
        privacy_report(config, acc, 1000, seed_is_secret=1)
    with pytest.raises(ValueError, match="num_examples"):
        privacy_report(config, acc, 0, seed_is_secret=True)
    with pytest.raises(ValueError, match="other than the config's step"):
        privacy_report(config, acc, 500, seed_is_secret=True)  # another sample rate
    with pytest.raises(ValueError, match="is not the config's"):
        privacy_report(config, Accountant("rdp"), 1000, seed_is_secret=True)
    uncalibrated = dpfunc.DPConfig(clip_norm=1.0, expected_batch_size=10, target_epsilon=1.0,
                                   epochs=1)  # fmt: skip
    with pytest.raises(ValueError, match="calibrated"):
        privacy_report(uncalibrated, acc, 1000, seed_is_secret=True)
    for bad in (0, 1, math.nan, "1e-5"):
        with pytest.raises(ValueError, match="delta must be"):
            privacy_report(config, acc, 1000, seed_is_secret=True, delta=bad)


def test_no_noise_is_reported_as_infinite_epsilon():
    config = dpfunc.DPConfig(clip_norm=1.0, expected_batch_size=10, noise_multiplier=0.0,
                             delta=1e-5)  # fmt: skip
    acc = config.accountant()
    acc.step(*config.accounting_event(1000))
    assert privacy_report(config, acc, 1000, seed_is_secret=True).epsilon == math.inf


@pytest.mark.parametrize("method", ["rdp", "pld"])
def test_steps_within_budget_is_the_last_step_within_it(method):
    config = dpfunc.DPConfig(clip_norm=1.0, expected_batch_size=20, noise_multiplier=0.8,
                             epochs=2, accounting=method)  # fmt: skip

    def eps(steps):
        return accounting.epsilon(0.8, 20 / N, steps, 1e-4, method)

    for budget, expected in [(eps(4), 4), ((eps(4) + eps(5)) / 2, 4), (eps(12) * 2, 12)]:
        steps = steps_within_budget(config, N, budget, 1e-4)
        assert steps == expected and eps(steps) <= budget
        assert steps == 12 or eps(steps + 1) > budget
    assert steps_within_budget(config, N, eps(1) / 2, 1e-4) == 0
    assert steps_within_budget(config, N, None, 1e-4) == 12
    with pytest.raises(ValueError, match="epsilon_budget must be"):
        steps_within_budget(config, N, 0.0, 1e-4)
