"""The mechanisms with state: noise, the clip norm and the sampler as (init, update) pairs.

Each is checked against the function it wraps (the recurrence of
matrix_factorization, adaptive_clip_norm, poisson_sample and
cyclic_poisson_sample) and, where one exists, an independent oracle (the
banded noise against a triangular solve of the strategy matrix). The train
state holds the noise and clip states; checkpoints store them by name, and
a checkpoint of version 2 is refused with the reason.
"""

import inspect

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import dpfunc
from dpfunc import checkpoint, data
from dpfunc.clipping import (
    ClipState,
    UnclippedCount,
    adaptive_clip_norm,
    adaptive_clipping,
    fixed_clipping,
)
from dpfunc.matrix_factorization import (
    banded_noise,
    init_noise_history,
    normalized_coefficients,
    solve_recurrence,
    strategy_matrix,
)
from dpfunc.noise import NoiseState, independent_noise

SECRET = dpfunc.secret_seed()


def draws(steps, shape=(3, 2), dtype=torch.float64):
    g = torch.Generator().manual_seed(7)
    return [{"w": torch.randn(shape, generator=g, dtype=dtype)} for _ in range(steps)]


# --------------------------------------------------------------------------- noise


def test_independent_noise_adds_each_draw_as_it_is():
    mechanism = independent_noise()
    state = mechanism.init({"w": torch.zeros(3, 2)})
    assert state == NoiseState({})
    for z in draws(3):
        w, state = mechanism.update(z, state)
        assert torch.equal(w["w"], z["w"]) and state.history == {}


@pytest.mark.parametrize("bands", [2, 4, 7])
def test_banded_noise_is_the_recurrence_and_inverts_the_strategy(bands):
    steps = 9
    coefficients = normalized_coefficients(bands)
    mechanism = banded_noise(coefficients)
    state = mechanism.init({"w": torch.zeros(3, 2, dtype=torch.float64)})
    history = init_noise_history({"w": torch.zeros(3, 2, dtype=torch.float64)}, bands)
    out = []
    for z in draws(steps):
        w, state = mechanism.update(z, state)
        expected, history = solve_recurrence(z, history, coefficients)
        assert torch.equal(w["w"], expected["w"])
        assert torch.equal(state.history["w"], history["w"])
        out.append(w["w"].flatten())
    # the oracle: w = C^{-1} z for the whole sequence at once
    z = torch.stack([d["w"].flatten() for d in draws(steps)])
    strategy = strategy_matrix(coefficients, steps)
    oracle = torch.linalg.solve_triangular(strategy, z, upper=False)
    torch.testing.assert_close(torch.stack(out), oracle, rtol=1e-12, atol=1e-12)


def test_the_config_yields_the_noise_mechanism_of_its_bands():
    params = {"w": torch.zeros(3, 2, dtype=torch.float64)}
    one = dpfunc.DPConfig(clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)
    assert one.noise_mechanism().init(params) == NoiseState({})
    z = draws(1)[0]
    assert one.noise_mechanism().update(z, NoiseState({}))[0] is z
    four = dpfunc.DPConfig(clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=4, bands=4)
    mine, reference = four.noise_mechanism(), banded_noise(normalized_coefficients(4))
    a, b = mine.init(params), reference.init(params)
    for z in draws(5):
        (wa, a), (wb, b) = mine.update(z, a), reference.update(z, b)
        assert torch.equal(wa["w"], wb["w"]) and torch.equal(a.history["w"], b.history["w"])


# --------------------------------------------------------------------------- clip norm


def test_adaptive_clipping_is_adaptive_clip_norm_of_the_noisy_count():
    settings = dict(clip_norm=0.3, expected_batch_size=16.0, target_quantile=0.7)
    mechanism = adaptive_clipping(**settings, learning_rate=0.2, count_noise_multiplier=0.8)
    state = mechanism.init({"w": torch.zeros(3)})
    assert state.clip_norm.dtype == torch.float64 and float(state.clip_norm) == 0.3
    clip = torch.tensor(0.3, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    for count in [16.0, 3.0, 0.0, 9.0, 12.0]:
        count = torch.tensor(count, dtype=torch.float64)
        noise = torch.randn((), generator=g, dtype=torch.float64)
        clip_norm, state = mechanism.update(UnclippedCount(count, noise), state)
        clip = adaptive_clip_norm(clip, count + 0.8 * noise, 16.0, 0.7, 0.2)
        assert torch.equal(state.clip_norm, clip) and torch.equal(clip_norm, clip)
        assert clip_norm.shape == () and clip_norm.dtype == torch.float64
    with pytest.raises(ValueError, match="count"):
        mechanism.update(None, state)
    with pytest.raises(ValueError, match="count"):
        mechanism.update(UnclippedCount(count, None), state)
    config = dpfunc.DPConfig(
        **settings, noise_multiplier=1.0, quantile_learning_rate=0.2, count_noise_multiplier=0.8
    )
    from_config = config.clip_mechanism()
    released = UnclippedCount(count, noise)
    _, moved = from_config.update(released, ClipState(clip))
    assert torch.equal(moved.clip_norm, mechanism.update(released, ClipState(clip))[1].clip_norm)


def test_fixed_clipping_never_moves_and_refuses_a_bad_norm():
    mechanism = dpfunc.DPConfig(clip_norm=2.5, noise_multiplier=1.0,
                                expected_batch_size=4).clip_mechanism()  # fmt: skip
    state = mechanism.init({"w": torch.zeros(3)})
    assert state.clip_norm.dtype == torch.float64 and float(state.clip_norm) == 2.5
    clip_norm, after = mechanism.update(None, state)
    assert after is state and clip_norm.shape == () and float(clip_norm) == 2.5
    # it reads nothing: a count given anyway changes nothing
    assert mechanism.update(UnclippedCount(torch.tensor(4.0), torch.tensor(1.0)), state)[1] is state
    with pytest.raises(ValueError, match="clip_norm=0"):
        fixed_clipping(0)
    with pytest.raises(ValueError, match="clip_norm=inf"):
        adaptive_clipping(float("inf"), 4.0, 0.5, 0.2, 1.0)


# --------------------------------------------------------------------------- one protocol

F64 = torch.float64
PARAMS = {"w": torch.zeros(3, 2, dtype=F64), "b": torch.zeros(2, dtype=F64)}
GRADS = {"w": torch.ones(3, 2, dtype=F64), "b": torch.full((2,), 2.0, dtype=F64)}
COUNT = UnclippedCount(torch.tensor(3.0, dtype=F64), torch.tensor(0.5, dtype=F64))
CONFIG = dict(clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)


def transformations():
    """Every factory of the protocol, with an input of the kind its update reads."""
    adaptive = dpfunc.DPConfig(**CONFIG, target_quantile=0.5)
    return {
        "sgd": (dpfunc.optim.sgd(lr=0.1, momentum=0.9), GRADS),
        "adam": (dpfunc.optim.adam(lr=0.1), GRADS),
        "adamw": (dpfunc.optim.adamw(lr=0.1), GRADS),
        "scale": (dpfunc.optim.scale(0.5), GRADS),
        "chain": (dpfunc.optim.chain(dpfunc.optim.scale(0.5), dpfunc.optim.sgd(lr=0.1)), GRADS),
        "independent_noise": (independent_noise(), GRADS),
        "banded_noise": (banded_noise(normalized_coefficients(3)), GRADS),
        "DPConfig.noise_mechanism": (dpfunc.DPConfig(**CONFIG, bands=2).noise_mechanism(), GRADS),
        "fixed_clipping": (fixed_clipping(1.0), None),
        "adaptive_clipping": (adaptive_clipping(1.0, 4.0, 0.5, 0.2, 1.0), COUNT),
        "DPConfig.clip_mechanism": (adaptive.clip_mechanism(), COUNT),
    }


@pytest.mark.parametrize("name", list(transformations()))
def test_every_optimizer_and_mechanism_is_one_protocol(name):
    """``init(params) -> state``; ``update(updates, state, params=None) -> (updates, state)``."""
    transform, updates = transformations()[name]
    assert isinstance(transform, dpfunc.optim.GradientTransformation)
    assert list(inspect.signature(transform.init).parameters) == ["params"]
    arguments = inspect.signature(transform.update).parameters
    assert len(arguments) == 3 and list(arguments)[1:] == ["state", "params"]
    assert arguments["params"].default is None
    state = transform.init(PARAMS)
    structure = optree.tree_structure(state, none_is_leaf=True)
    for _ in range(2):
        out, state = transform.update(updates, state, PARAMS)
        assert optree.tree_structure(state, none_is_leaf=True) == structure  # the same layout
    if "noise" in name or "clip" in name:  # a mechanism reads no params: None is the same
        again, _ = transform.update(updates, transform.init(PARAMS))
        first, _ = transform.update(updates, transform.init(PARAMS), PARAMS)
        assert all(map(torch.equal, optree.tree_leaves(again), optree.tree_leaves(first)))
    if "clip" in name:  # the next step's clip norm, the one the state holds
        assert out.shape == () and out.dtype == F64 and torch.equal(out, state.clip_norm)
    else:
        assert optree.tree_structure(out) == optree.tree_structure(PARAMS)


def test_the_step_calls_its_noise_optimizer_and_clip_norm_alike():
    """The step's private update is ``output, state = m.update(input, state, params)`` thrice."""
    loss_fn, params, (x, y), config = problem(target_quantile=0.5)
    step = dpfunc.make_train_step(loss_fn, dpfunc.optim.sgd(lr=0.1), config)
    calls = []

    def recorded(name, transform):
        def update(updates, state, params=None):
            calls.append((name, type(updates).__name__, params is not None))
            return transform.update(updates, state, params)

        return transform._replace(update=update)

    step.noise_mechanism = recorded("noise", step.noise_mechanism)
    step.optimizer = recorded("optimizer", step.optimizer)
    step.clip_mechanism = recorded("clip", step.clip_mechanism)
    state = step.init(params)
    noise = step.draw_noise(state.params, seed=SECRET, step=0)
    step.logical_step(state, [((x[:8], y[:8]), torch.ones(8))], noise)
    # each once, with its input, its own state and the parameters
    assert sorted(calls) == [
        ("clip", "UnclippedCount", True),
        ("noise", "dict", True),
        ("optimizer", "dict", True),
    ]


# --------------------------------------------------------------------------- sampler


@pytest.mark.parametrize("bands", [1, 4])
def test_the_sampler_draws_what_poisson_sample_and_cyclic_poisson_sample_draw(bands):
    n, rate = 50, 0.3
    sampler = data.poisson_sampler(n, rate, bands=bands)
    state = sampler.init(SECRET)
    parts = data.partitions(n, bands, seed=SECRET)
    assert all(torch.equal(a, b) for a, b in zip(state.partitions, parts, strict=True))
    batches = data.PoissonBatches(torch.arange(float(n)), rate, 8, seed=SECRET, bands=bands)
    config = dpfunc.DPConfig(clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=15 / bands,
                             bands=bands)  # fmt: skip
    from_config = config.poisson_sampler(n)
    for t in range(9):
        if bands == 1:
            expected = data.poisson_sample(n, rate, seed=SECRET, step=t)
        else:
            expected = data.cyclic_poisson_sample(parts[t % bands], rate, seed=SECRET, step=t)
        assert torch.equal(sampler.sample(state, t), expected)
        assert torch.equal(batches.indices(t), expected)
        assert torch.equal(from_config.sample(from_config.init(SECRET), t), expected)


def test_the_sampler_state_never_shows_its_secret():
    state = data.poisson_sampler(20, 0.5, bands=2).init(SECRET)
    assert str(SECRET) not in repr(state) and "<secret>" in repr(state)
    with pytest.raises(ValueError, match="never printed"):
        data.poisson_sampler(20, 0.5).init(-1)
    with pytest.raises(ValueError, match="bands must be at most"):
        data.poisson_sampler(3, 0.5, bands=4)


# --------------------------------------------------------------------------- train state


def problem(**settings):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    params, buffers = dpfunc.functionalize(model)
    x = torch.randn(40, 4)
    y = (x[:, 0] > 0).long()

    def loss_fn(p, example):
        xi, yi = example
        return F.cross_entropy(functional_call(model, (p, buffers), (xi[None],)), yi[None])

    config = dpfunc.DPConfig(clip_norm=0.5, noise_multiplier=1.0, expected_batch_size=5,
                             epochs=1, delta=1e-4, **settings)  # fmt: skip
    return loss_fn, params, (x, y), config


@pytest.mark.parametrize("settings", [dict(bands=4), dict(target_quantile=0.5)])
def test_the_train_state_holds_each_mechanism_state_and_the_step_moves_it(settings):
    loss_fn, params, (x, y), config = problem(**settings)
    step = dpfunc.make_train_step(loss_fn, dpfunc.optim.sgd(lr=0.1), config)
    state = step.init(params)
    assert isinstance(state.clip_state, ClipState) and isinstance(state.noise_state, NoiseState)
    assert state.clip_state.clip_norm.shape == ()
    assert state.clip_state.clip_norm.dtype == torch.float64
    noise = step.draw_noise(state.params, seed=SECRET, step=0)
    batch = [((x[:8], y[:8]), torch.ones(8))]
    new, stats = step.logical_step(state, batch, noise)
    # the mechanisms, applied by hand to what the step saw
    _, noise_state = config.noise_mechanism().update(noise.params, state.noise_state)
    count = dpfunc.clipping.unclipped_count(stats.norm, state.clip_state.clip_norm, stats.mask)
    released = UnclippedCount(count, noise.count) if step.adaptive else None
    _, clip_state = config.clip_mechanism().update(released, state.clip_state, state.params)
    assert torch.equal(new.clip_state.clip_norm, clip_state.clip_norm)
    assert optree.tree_structure(new.noise_state) == optree.tree_structure(noise_state)
    for a, b in zip(optree.tree_leaves(new.noise_state), optree.tree_leaves(noise_state)):
        assert torch.equal(a, b)
    assert "target_quantile" not in settings or not torch.equal(
        new.clip_state.clip_norm, state.clip_state.clip_norm
    )


def test_a_state_in_the_earlier_form_is_refused_with_the_replacement():
    loss_fn, params, (x, y), config = problem()
    step = dpfunc.make_train_step(loss_fn, dpfunc.optim.sgd(lr=0.1), config)
    state = step.init(params)
    earlier = dpfunc.TrainState(
        state.params, state.opt_state, state.step, state.clip_state.clip_norm
    )
    noise = step.draw_noise(state.params, seed=SECRET, step=0)
    with pytest.raises(TypeError, match=r"clip_state must be a ClipState.*_replace"):
        step.logical_step(earlier, [((x[:8], y[:8]), torch.ones(8))], noise)
    with pytest.raises(TypeError, match="_replace"):
        step(earlier, (x[:8], y[:8]), torch.ones(8), noise.params)
    kept = state._replace(step=state.step + 1)
    assert kept.clip_state is state.clip_state and kept.noise_state is state.noise_state


# --------------------------------------------------------------------------- checkpoints


def trainer(**settings):
    loss_fn, params, dataset, config = problem(**settings)
    return dpfunc.Trainer(loss_fn, params, dataset, optimizer=dpfunc.optim.sgd(lr=0.1),
                          config=config, physical_batch_size=8, progress=False)  # fmt: skip


def test_checkpoints_store_the_state_by_part(tmp_path):
    path = tmp_path / "run.pt"
    run = trainer(bands=4)
    run.fit(max_steps=2)
    run.save(path)
    saved = torch.load(path, weights_only=True)
    assert saved["version"] == checkpoint.VERSION == 5
    assert tuple(saved["state"]) == checkpoint.STATE_PARTS
    assert [h.shape for h in saved["state"]["noise_state"]] == [
        h.shape for h in optree.tree_leaves(run.state.noise_state)
    ]
    saved["state"]["noise_state"] = saved["state"]["noise_state"][:-1]
    torch.save(saved, path)
    with pytest.raises(ValueError, match="noise_state tensors do not match"):
        trainer(bands=4).load(path)


@pytest.mark.parametrize(
    "version, reason",
    [
        (2, "start a new run"),  # the state as one flat list, other rounding
        (3, "other noise"),  # the same layout, from the releases with one generator per step
    ],
)
def test_a_checkpoint_of_an_earlier_version_is_refused_with_the_reason(tmp_path, version, reason):
    path = tmp_path / f"v{version}.pt"
    run = trainer()
    run.fit(max_steps=1)
    run.save(path)
    saved = torch.load(path, weights_only=True)
    saved["version"] = version
    if version == 2:  # what version 2 wrote: the state as one flat list
        saved["state"] = optree.tree_leaves(run.state)
    torch.save(saved, path)
    fresh = trainer()
    with pytest.raises(ValueError, match=f"version {version}") as caught:
        fresh.load(path)
    message = str(caught.value)
    assert "cannot be resumed bit-identically" in message and reason in message
    assert fresh.steps_done == 0
