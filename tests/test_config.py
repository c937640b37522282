"""dpfunc.DPConfig: frozen, validated once, the one source of the step, sampler and accountant.

The Trainers here use a fixed seed so that two runs can be compared bit for
bit; it is public, as the data is: a fixed seed is for tests and research only.
"""

import dataclasses
import functools
import inspect
import math
import re

import pytest
import torch

import dpfunc
from dpfunc import accounting
from dpfunc.accounting import combined_noise_multiplier
from dpfunc.data import PoissonBatches
from dpfunc.step import TrainStep
from dpfunc.tree import tree_leaves

SEED = 1234  # public: these runs are compared, not private
N = 120
BASE = {"clip_norm": 1.0, "expected_batch_size": 20, "noise_multiplier": 1.0}


def config(**overrides):
    return dpfunc.DPConfig(**{**BASE, **overrides})


@pytest.fixture
def problem(tiny_problem):
    """``tiny_problem(N)`` with 6 hidden units: ``(loss_fn, params, (x, y), model)``."""
    return functools.partial(tiny_problem, N, hidden=6)


@pytest.fixture
def trainer(problem):
    """A Trainer on ``problem()`` with the public ``SEED``, from ``config`` or from keywords."""

    def trainer(config=None, **keywords):
        loss_fn, params, dataset, _ = problem()
        settings = {"config": config} if config is not None else {}
        return dpfunc.Trainer(
            loss_fn, params, dataset, optimizer=dpfunc.optim.sgd(lr=0.5, momentum=0.5),
            physical_batch_size=16, progress=False, seed=SEED, **settings, **keywords,
        )  # fmt: skip

    return trainer


# -- validated once, when it is built ---------------------------------------------------------

ADAPTIVE = {"target_quantile": 0.5}
INVALID = [
    ({"clip_norm": 0}, "clip_norm=0"),
    ({"clip_norm": -1.0}, "clip_norm=-1.0"),
    ({"clip_norm": math.nan}, "clip_norm=nan"),
    ({"clip_norm": "1"}, "clip_norm='1'"),
    ({"noise_multiplier": None}, "exactly one of noise_multiplier and target_epsilon"),
    ({"target_epsilon": 1.0, "epochs": 1}, "exactly one of noise_multiplier and target_epsilon"),
    ({"noise_multiplier": -0.5}, "noise_multiplier=-0.5"),
    ({"noise_multiplier": math.inf}, "noise_multiplier=inf"),
    ({"clip_norm": math.inf}, "clip_norm=inf"),
    (
        {"clip_norm": math.inf, "noise_multiplier": None, "target_epsilon": 1.0, "epochs": 1},
        "clip_norm=inf",
    ),
    ({"noise_multiplier": None, "target_epsilon": 0.0, "epochs": 1}, "target_epsilon=0.0"),
    ({"noise_multiplier": None, "target_epsilon": math.inf, "epochs": 1}, "target_epsilon=inf"),
    ({"delta": 0.0}, "delta=0.0"),
    ({"delta": 1.0}, "delta=1.0"),
    ({"epochs": 0}, "epochs=0"),
    ({"epochs": math.inf}, "epochs=inf"),
    ({"expected_batch_size": 0}, "expected_batch_size=0"),
    ({"expected_batch_size": math.inf}, "expected_batch_size=inf"),
    ({"clipping": "per-layer"}, "'flat', 'per_layer', 'normalized', got clipping='per-layer'"),
    ({"clipping": "normalized", "clip_norm": math.inf, "noise_multiplier": 0.0}, "clip_norm=inf"),
    ({"bands": 0}, "bands=0"),
    ({"bands": 2.0}, "bands=2.0"),
    ({"bands": True}, "bands=True"),
    ({"accounting": "gdp"}, "'pld', 'rdp', got accounting='gdp'"),
    ({"epsilon_budget": 0}, "epsilon_budget=0"),
    ({"epsilon_budget": -1.0}, "epsilon_budget=-1.0"),
    ({"secure_noise": "yes"}, "secure_noise='yes'"),
    ({"target_quantile": 0.0}, "target_quantile=0.0"),
    ({"target_quantile": 1.0}, "target_quantile=1.0"),
    ({**ADAPTIVE, "quantile_learning_rate": 0}, "quantile_learning_rate=0"),
    ({**ADAPTIVE, "count_noise_multiplier": 0}, "count_noise_multiplier=0"),
    ({**ADAPTIVE, "count_noise_multiplier": -2.0}, "count_noise_multiplier=-2.0"),
    ({**ADAPTIVE, "clipping": "per_layer"}, "clipping='per_layer'"),
    ({**ADAPTIVE, "clip_norm": math.inf, "noise_multiplier": 0.0}, "clip_norm=inf"),
    ({**ADAPTIVE, "bands": 2}, "target_quantile=0.5, bands=2"),
]


@pytest.mark.parametrize(("overrides", "named"), INVALID, ids=[repr(o) for o, _ in INVALID])
def test_each_invalid_setting_is_refused_with_its_name_and_value(overrides, named):
    with pytest.raises((ValueError, TypeError), match=re.escape(named)):
        config(**overrides)


def test_the_valid_edge_cases_are_accepted():
    baseline = config(clip_norm=math.inf, noise_multiplier=0.0)  # non-private, allowed
    assert baseline.noise_std == 0.0 and baseline.accounted_noise_multiplier == 0.0
    assert config(noise_multiplier=1.2, clip_norm=0.5).noise_std == 1.2 * 0.5
    # Andrew et al. 2021's default for the count's noise: expected_batch_size / 20
    assert config(**ADAPTIVE, expected_batch_size=40).count_noise_multiplier == 40 / 20
    assert config(bands=3).coefficients == dpfunc.matrix_factorization.normalized_coefficients(3)


def test_a_config_is_frozen_and_every_copy_is_validated_again():
    settings = config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.clip_norm = 0.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.noise_multiplier = 0.0
    assert settings.noise_std == 1.0
    with pytest.raises(ValueError, match=re.escape("clip_norm=-1.0")):
        dataclasses.replace(settings, clip_norm=-1.0)


def test_a_target_epsilon_needs_calibration_before_it_yields_noise():
    planned = config(noise_multiplier=None, target_epsilon=2.0, epochs=1)
    for read in (
        lambda: planned.noise_std,
        lambda: planned.accounted_noise_multiplier,
        lambda: planned.accounting_event(N),
    ):
        with pytest.raises(ValueError, match=r"calibrated\(num_examples\)"):
            read()
    with pytest.raises(ValueError, match=r"calibrated\(num_examples\)"):
        dpfunc.make_train_step(lambda p, e: p["w"].sum(), dpfunc.optim.sgd(lr=0.1), planned)


def test_the_sample_rate_is_bounded_by_the_dataset():
    assert config().sample_rate(N) == 20 / N
    assert config(bands=3).sample_rate(N) == 20 * 3 / N  # within one of 3 partitions
    with pytest.raises(ValueError, match=re.escape("expected_batch_size=20")):
        config().sample_rate(10)
    with pytest.raises(ValueError, match="num_examples / bands"):
        config(bands=7).sample_rate(N)  # 7 * 20 > 120
    with pytest.raises(ValueError, match="epochs=None"):
        config().total_steps(N)
    # a target without epochs may be built (PrivateTrainer fills them in) but not calibrated
    with pytest.raises(ValueError, match="epochs=None"):
        config(noise_multiplier=None, target_epsilon=1.0).calibrated(N)


# -- calibrated(n): the noise for a target epsilon ----------------------------------------------


@pytest.mark.parametrize("bands", [1, 3])
def test_calibrated_finds_the_accountants_noise_multiplier(bands):
    planned = config(noise_multiplier=None, target_epsilon=2.0, delta=1e-4, epochs=2,
                     accounting="rdp", bands=bands, expected_batch_size=10)  # fmt: skip
    resolved = planned.calibrated(N)
    steps = round(2 * round(N / 10))
    rate = 10 * bands / N
    expected = accounting.calibrate_noise_multiplier(2.0, 1e-4, rate, steps, "rdp", bands=bands)
    assert resolved.noise_multiplier == expected
    assert resolved.target_epsilon is None and resolved.delta == 1e-4
    assert accounting.epsilon(expected, rate, steps, 1e-4, "rdp", bands=bands) <= 2.0
    assert dataclasses.replace(resolved, noise_multiplier=None, target_epsilon=2.0) == planned


def test_calibrated_leaves_the_adaptive_count_its_share():
    planned = config(noise_multiplier=None, target_epsilon=2.0, delta=1e-4, epochs=2,
                     accounting="rdp", **ADAPTIVE, count_noise_multiplier=10.0)  # fmt: skip
    resolved = planned.calibrated(N)
    combined = accounting.calibrate_noise_multiplier(2.0, 1e-4, 20 / N, 12, "rdp")
    assert combined_noise_multiplier(resolved.noise_multiplier, 10.0) == pytest.approx(
        combined, rel=1e-12
    )
    assert resolved.accounted_noise_multiplier == pytest.approx(combined, rel=1e-12)
    assert resolved.noise_multiplier > combined  # the sum alone needs less than it would
    assert accounting.epsilon(resolved.accounted_noise_multiplier, 20 / N, 12, 1e-4, "rdp") <= (
        2.0 * (1 + 1e-9)
    )
    with pytest.raises(ValueError, match=re.escape("count_noise_multiplier=0.5")):
        dataclasses.replace(planned, count_noise_multiplier=0.5).calibrated(N)


@pytest.mark.parametrize("n", [99, 100, 120, 1000, 60_000])
def test_calibrated_resolves_delta_to_the_largest_power_of_ten_below_one_over_n(n):
    delta = config(expected_batch_size=1).calibrated(n).delta
    exponent = round(math.log10(delta))
    assert delta == 10.0**exponent
    assert delta < 1 / n <= 10 * delta


def test_calibrated_warns_about_a_delta_that_allows_releasing_an_example():
    with pytest.warns(UserWarning, match="1/num_examples"):
        resolved = config(delta=0.01).calibrated(N)
    assert resolved.delta == 0.01 and resolved.noise_multiplier == 1.0


# -- the accounting event and the sampler are the Trainer's ---------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        {"noise_multiplier": 0.8},
        {"noise_multiplier": None, "target_epsilon": 3.0},
        {"noise_multiplier": 0.8, **ADAPTIVE, "count_noise_multiplier": 2.0},
        {"noise_multiplier": 0.8, "bands": 2, "expected_batch_size": 10},
    ],
    ids=["sigma", "target_epsilon", "adaptive", "bands"],
)
def test_the_accountant_records_the_configs_event_every_step(settings, trainer):
    planned = config(**{"epochs": 1, "delta": 1e-4, "accounting": "rdp", **settings})
    run = trainer(planned)
    run.fit(max_steps=3)
    event = planned.calibrated(N).accounting_event(N)
    assert run.accountant.history == [(event.noise_multiplier, event.sample_rate, 3)]
    # the event itself, from the definitions: the whole release and the Poisson rate
    sigma = run.config.noise_multiplier
    if "target_quantile" in settings:
        sigma = combined_noise_multiplier(sigma, 2.0)
    bands = settings.get("bands", 1)
    assert event == (sigma, planned.expected_batch_size * bands / N)
    assert isinstance(event, dpfunc.config.AccountingEvent)


@pytest.mark.parametrize("bands", [1, 2])
def test_the_sampler_is_the_one_the_trainer_draws_from(bands, trainer, problem):
    planned = config(epochs=1, bands=bands, expected_batch_size=10, accounting="rdp")
    run = trainer(planned)
    _, _, dataset, _ = problem()
    sampler = planned.sampler(dataset, run.batches.physical_batch_size, seed=SEED)
    assert isinstance(sampler, PoissonBatches) and isinstance(run.batches, PoissonBatches)
    assert sampler.sample_rate == run.batches.sample_rate == planned.sample_rate(N)
    assert sampler.bands == run.batches.bands == bands
    assert sampler.expected_batch_size == pytest.approx(10)
    for t in range(4):
        assert torch.equal(sampler.indices(t), run.batches.indices(t))
        ours, theirs = sampler.logical_batch(t)[0], run.batches.logical_batch(t)[0]
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs, strict=True):
            for x, y in zip(tree_leaves(a), tree_leaves(b), strict=True):
                assert torch.equal(x, y)


# -- the config form and the keyword form ------------------------------------------------


FORMS = [
    {},
    {"clipping": "per_layer"},
    {"clipping": "normalized", "clip_norm": 0.1},
    {**ADAPTIVE, "count_noise_multiplier": 2.0},
    {"bands": 2, "expected_batch_size": 10},
]


@pytest.mark.parametrize("settings", FORMS, ids=[repr(s) for s in FORMS])
def test_make_train_step_config_and_keywords_are_bit_identical(settings, problem):
    loss_fn, params, (x, y), _ = problem()
    keywords = {**BASE, **settings}
    steps = [
        dpfunc.make_train_step(loss_fn, dpfunc.optim.adam(1e-2), dpfunc.DPConfig(**keywords)),
        dpfunc.make_train_step(loss_fn, dpfunc.optim.adam(1e-2), **keywords),
    ]
    mask = (torch.arange(16) < 13).double()
    results = []
    for step in steps:
        state = step.init(params)
        for t in range(3):
            noise = dpfunc.standard_normal_like(params, seed=SEED, step=t)
            count_noise = torch.tensor(0.3, dtype=torch.float64) if step.adaptive else None
            rows = slice(16 * t, 16 * (t + 1))
            state, _ = step(state, (x[rows], y[rows]), mask, noise, count_noise)
        results.append(state)
    config_form, keyword_form = results
    assert not torch.equal(config_form.params["0.weight"], params["0.weight"])  # it trained
    for a, b in zip(tree_leaves(config_form), tree_leaves(keyword_form), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "settings",
    [
        {"noise_multiplier": None, "target_epsilon": 3.0, "epsilon_budget": 2.5},
        {**ADAPTIVE, "quantile_learning_rate": 0.5},
    ],
    ids=["target_epsilon", "adaptive"],
)
def test_trainer_config_and_keywords_are_bit_identical(settings, trainer):
    keywords = {**BASE, "epochs": 1, "delta": 1e-4, "accounting": "rdp", **settings}
    runs = [trainer(dpfunc.DPConfig(**keywords)), trainer(**keywords)]
    histories = [run.fit() for run in runs]
    assert histories[0] == histories[1] and histories[0][-1]["steps"] > 0
    assert runs[0].config == runs[1].config
    for key, value in runs[0].params.items():
        assert torch.equal(value, runs[1].params[key])


def test_config_and_privacy_keywords_are_not_mixed(trainer, problem):
    loss_fn, params, dataset, _ = problem()
    opt = dpfunc.optim.sgd(lr=0.1)
    settings = config()
    with pytest.raises(TypeError, match=r"not both.*\['noise_multiplier'\]"):
        dpfunc.make_train_step(loss_fn, opt, settings, noise_multiplier=2.0)
    with pytest.raises(TypeError, match="not both"):
        TrainStep(loss_fn, opt, settings, clip_norm=2.0)
    with pytest.raises(TypeError, match=r"not both.*\['epochs'\]"):
        trainer(config(epochs=1), epochs=2)
    with pytest.raises(TypeError, match=re.escape("config must be a dpfunc.DPConfig")):
        dpfunc.make_train_step(loss_fn, opt, dict(BASE))


def test_an_unknown_keyword_is_refused_with_the_valid_names(trainer, problem):
    loss_fn, *_ = problem()
    names = [field.name for field in dataclasses.fields(dpfunc.DPConfig)]
    with pytest.raises(TypeError, match=r"\['clip_nrom'\]") as caught:
        dpfunc.make_train_step(loss_fn, dpfunc.optim.sgd(lr=0.1), **BASE, clip_nrom=2.0)
    assert all(repr(name) in str(caught.value) for name in names)
    with pytest.raises(TypeError, match=r"\['epoch'\]") as caught:
        trainer(**BASE, epoch=1)
    assert all(repr(name) in str(caught.value) for name in names)


@pytest.mark.parametrize(
    "unused", [dict(count_noise_multiplier=2.0), dict(quantile_learning_rate=0.5)]
)
def test_adaptive_settings_without_adaptive_clipping_are_refused(unused):
    with pytest.raises(ValueError, match="adaptive clipping, which is off"):
        dpfunc.DPConfig(clip_norm=1.0, expected_batch_size=8, noise_multiplier=1.0, **unused)


def test_a_mistyped_keyword_beside_a_config_is_named_as_such():
    config = dpfunc.DPConfig(clip_norm=1.0, expected_batch_size=8, noise_multiplier=1.0)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['clip_nrom'\]"):
        dpfunc.make_train_step(lambda p, x: p["w"].sum(), dpfunc.optim.sgd(lr=0.1), config,
                               clip_nrom=2.0)  # fmt: skip


# -- the speed settings as data ---------------------------------------------------------------


def test_speed_settings_are_one_frozen_validated_object_or_its_keywords(problem):
    loss_fn, params, _, model = problem()
    opt = dpfunc.optim.sgd(lr=0.1)
    speed = dpfunc.SpeedConfig(model=model, method="vmap", chunk_size=4, memory_budget=2**20)
    given = dpfunc.make_train_step(loss_fn, opt, config(), speed=speed)
    keywords = dpfunc.make_train_step(
        loss_fn, opt, **BASE, model=model, method="vmap", chunk_size=4, memory_budget=2**20
    )
    assert given.speed == keywords.speed == speed and given.config == keywords.config
    assert keywords.clip.chunk_size == 4 and keywords.clip.ghost is None  # vmap: no ghost pass
    with pytest.raises(dataclasses.FrozenInstanceError):
        speed.method = "ghost"
    with pytest.raises(TypeError, match="either as speed= or as keywords"):
        dpfunc.make_train_step(loss_fn, opt, config(), speed=speed, method="auto")
    with pytest.raises(TypeError, match=r"speed must be a dpfunc.SpeedConfig"):
        dpfunc.make_train_step(loss_fn, opt, config(), speed={"method": "vmap"})
    with pytest.raises(TypeError, match=r"\['metod'\].*SpeedConfig\) are \['model', 'method'"):
        dpfunc.make_train_step(loss_fn, opt, config(), metod="vmap")


@pytest.mark.parametrize(
    "fields, error, match",
    [
        (dict(method="ghost"), ValueError, "method='ghost' needs model="),
        (dict(method="fast"), ValueError, "method"),
        (dict(chunk_size=0), ValueError, "chunk_size must be an int >= 1, got chunk_size=0"),
        (dict(physical_batch_size=2.5), ValueError, "physical_batch_size"),
        (dict(memory_budget=-1), ValueError, "memory_budget"),
        (dict(compile="yes"), TypeError, "compile must be a bool, got compile='yes'"),
        (dict(shard=1), TypeError, "shard must be a bool"),
        (dict(model=object()), TypeError, "model must be a torch.nn.Module or None"),
    ],
)
def test_a_bad_speed_setting_is_refused_when_built(fields, error, match):
    with pytest.raises(error, match=match):
        dpfunc.SpeedConfig(**fields)


def test_each_speed_setting_reaches_the_step_that_uses_it_or_is_refused(problem):
    loss_fn, params, dataset, model = problem()
    opt = dpfunc.optim.sgd(lr=0.1)
    with pytest.raises(ValueError, match="takes micro-batches as given: physical_batch_size"):
        dpfunc.make_train_step(loss_fn, opt, config(), physical_batch_size=8)
    with pytest.raises(ValueError, match="shard=True but the step's collectives are not sharded"):
        dpfunc.make_train_step(loss_fn, opt, config(), shard=True)
    compiled = dpfunc.make_train_step(loss_fn, opt, config(), compile=True)
    eager = dpfunc.make_train_step(loss_fn, opt, config())
    assert inspect.ismethod(eager._sum) and not inspect.ismethod(compiled._sum)  # compile()d
    fit = dpfunc.Trainer(
        loss_fn, params, dataset, optimizer=opt, config=config(epochs=1), progress=False,
        speed=dpfunc.SpeedConfig(model=model, physical_batch_size=7),
    )  # fmt: skip
    assert fit.batches.physical_batch_size == 7  # the sampler's
    assert fit.step_fn.speed == dpfunc.SpeedConfig(model=model)  # the step's: the rest
    private = dpfunc.PrivateGradients(model, loss_fn, dataset, config=config(), method="vmap")
    assert private.step_fn.speed.model is model  # filled in: the model it trains
    other = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="speed.model must be the model PrivateGradients trains"):
        dpfunc.PrivateGradients(
            model, loss_fn, dataset, config=config(), speed=dpfunc.SpeedConfig(model=other)
        )


def test_the_sum_share_never_leaves_the_combined_noise_below_the_calibrated_one():
    """Rounding in (a**-2 - c**-2) ** -0.5 must not put the accounted multiplier below a."""
    from dpfunc.accounting import combined_noise_multiplier
    from dpfunc.config import sum_noise_multiplier

    g = torch.Generator().manual_seed(0)
    accounted = 0.3 + 5 * torch.rand(2000, generator=g, dtype=torch.float64)
    ratio = 1.0001 + 20 * torch.rand(2000, generator=g, dtype=torch.float64)
    low = 0
    for a, c in zip(accounted.tolist(), (accounted * ratio).tolist()):
        sigma = sum_noise_multiplier(a, c)
        assert combined_noise_multiplier(sigma, c) >= a
        plain = (a**-2 - c**-2) ** -0.5
        low += combined_noise_multiplier(plain, c) < a
        assert sigma - plain <= 4 * math.ulp(plain)  # the correction is rounding, nothing more
    assert low > 0  # the plain formula does fall below: the correction is needed
