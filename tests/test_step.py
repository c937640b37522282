"""The composed step against oracles: a per-example loop, torch.optim, compiled vs eager."""

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounter

import dpfunc
from dpfunc.tree import tree_map


@pytest.fixture
def data(classification_data):
    """The batches of these tests: ``classification_data`` with features scaled by 2."""
    return functools.partial(classification_data, scale=2.0)


def test_no_privacy_limit_is_one_torch_sgd_step_on_the_mean_loss(classifier, data):
    model, params, loss_fn = classifier()
    x, y = data(16)
    step = dpfunc.make_train_step(
        loss_fn,
        dpfunc.optim.sgd(lr=0.3, momentum=0.9),
        clip_norm=math.inf,
        noise_multiplier=0.0,
        expected_batch_size=16,
    )
    state = step.init(params)
    zero_noise = tree_map(torch.zeros_like, params)
    reference = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    for _ in range(3):
        state, metrics = step(state, (x, y), torch.ones(16), zero_noise)
        reference.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        reference.step()
        torch.testing.assert_close(metrics["loss"], loss.detach(), rtol=1e-12, atol=0)
        for name, p in model.named_parameters():
            torch.testing.assert_close(state.params[name], p.detach(), rtol=1e-10, atol=1e-12)
    assert int(state.step) == 3


@pytest.mark.parametrize("clipping", ["flat", "normalized"])
def test_private_step_equals_per_example_loop(clipping, classifier, data):
    model, params, loss_fn = classifier()
    x, y = data(8)
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 0, 1.0])
    clip_norm, sigma, expected, lr = 0.5, 1.1, 6.5, 0.2
    step = dpfunc.make_train_step(
        loss_fn,
        dpfunc.optim.sgd(lr=lr),
        clip_norm=clip_norm,
        noise_multiplier=sigma,
        expected_batch_size=expected,
        clipping=clipping,
    )
    noise = dpfunc.standard_normal_like(params, seed=3, step=0)
    state, metrics = step(step.init(params), (x, y), mask, noise)

    total = {k: torch.zeros_like(v) for k, v in params.items()}
    clipped = 0
    for i in range(8):
        if not mask[i]:
            continue
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        g = {k: p.grad for k, p in model.named_parameters()}
        norm = torch.sqrt(sum(v.pow(2).sum() for v in g.values()))
        if clipping == "flat":
            factor = min(1.0, clip_norm / float(norm))
        else:
            factor = clip_norm / (float(norm) + 0.01)
        clipped += factor < 1
        for k in total:
            total[k] += factor * g[k]
    for k, p in params.items():
        want = p - lr * (total[k] + sigma * clip_norm * noise[k]) / expected
        torch.testing.assert_close(state.params[k], want, rtol=1e-10, atol=1e-12)
    assert metrics["batch_size"] == 6
    torch.testing.assert_close(metrics["clipped_fraction"], torch.tensor(clipped / 6))


def test_per_layer_step_bounds_each_module(classifier, data):
    _, params, loss_fn = classifier()
    x, y = data(4)
    x[0] *= 1e3
    step = dpfunc.make_train_step(
        loss_fn,
        dpfunc.optim.sgd(lr=1.0),
        clip_norm=1.0,
        noise_multiplier=0.0,
        expected_batch_size=1,
        clipping="per_layer",
    )
    one = torch.tensor([1.0, 0, 0, 0])
    state, metrics = step(step.init(params), (x, y), one, tree_map(torch.zeros_like, params))
    update = {k: params[k] - state.params[k] for k in params}
    for module in ("0", "2"):
        layer = torch.sqrt(sum(update[k].pow(2).sum() for k in update if k.startswith(module)))
        assert layer <= 1 / math.sqrt(2) * (1 + 1e-9)
    assert metrics["clipped_fraction"] == 1


def test_masked_example_equals_removed_example_in_the_step(classifier, data):
    _, params, loss_fn = classifier()
    x, y = data(6)
    step = dpfunc.make_train_step(
        loss_fn,
        dpfunc.optim.adam(lr=0.1),
        clip_norm=0.3,
        noise_multiplier=0.8,
        expected_batch_size=5,
    )
    noise = dpfunc.standard_normal_like(params, seed=0, step=0)
    masked, m1 = step(step.init(params), (x, y), torch.tensor([1, 1, 1, 0, 1, 1.0]), noise)
    keep = [0, 1, 2, 4, 5]
    removed, m2 = step(step.init(params), (x[keep], y[keep]), torch.ones(5), noise)
    for k in params:
        torch.testing.assert_close(masked.params[k], removed.params[k], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(m1["loss"], m2["loss"])


def test_accumulated_micro_batches_equal_one_batch(classifier, data):
    _, params, loss_fn = classifier(seed=2)
    x, y = data(256, seed=5)
    step = dpfunc.make_train_step(
        loss_fn,
        dpfunc.optim.adamw(lr=0.05),
        clip_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=256.0,
    )
    noise = dpfunc.standard_normal_like(params, seed=9, step=0)
    state = step.init(params)
    whole, _ = step(state, (x, y), torch.ones(256), noise)

    micro = [((x[r : r + 64], y[r : r + 64]), torch.ones(64)) for r in range(0, 256, 64)]
    accumulated, stats = step.logical_step(state, micro, step.draw_noise(params, seed=9, step=0))
    for k in params:  # a float32 running sum of four micro-batches against one float64 sum
        torch.testing.assert_close(accumulated.params[k], whole.params[k], rtol=1e-6, atol=1e-7)
    assert dpfunc.summarize(stats)["batch_size"] == 256


def test_nonfinite_example_is_dropped_and_counted(classifier, data):
    _, params, loss_fn = classifier()
    x, y = data(5)
    x[2, 0] = math.nan
    step = dpfunc.make_train_step(
        loss_fn,
        dpfunc.optim.sgd(lr=0.1),
        clip_norm=1.0,
        noise_multiplier=0.5,
        expected_batch_size=5,
    )
    noise = dpfunc.standard_normal_like(params, seed=0, step=0)
    state, metrics = step(step.init(params), (x, y), torch.ones(5), noise)
    assert metrics["nonfinite"] == 1
    assert all(torch.isfinite(v).all() for v in state.params.values())
    keep = [0, 1, 3, 4]
    mask = torch.tensor([1.0, 1, 0, 1, 1])
    without, _ = step(step.init(params), (x[keep], y[keep]), torch.ones(4), noise)
    del mask
    for k in params:
        torch.testing.assert_close(state.params[k], without.params[k])


def test_empty_batch_still_steps_with_noise_only(classifier, data):
    _, params, loss_fn = classifier()
    x, y = data(4)
    step = dpfunc.make_train_step(
        loss_fn,
        dpfunc.optim.sgd(lr=1.0),
        clip_norm=2.0,
        noise_multiplier=1.5,
        expected_batch_size=10,
    )
    noise = dpfunc.standard_normal_like(params, seed=0, step=0)
    state, metrics = step(step.init(params), (x, y), torch.zeros(4), noise)
    for k in params:
        torch.testing.assert_close(state.params[k], params[k] - 1.5 * 2.0 * noise[k] / 10)
    assert metrics["batch_size"] == 0 and metrics["loss"] == 0
    assert int(state.step) == 1

    # a batch with no rows at all (an empty share of a logical batch): zeros, no loss call
    def indexing_loss(p, example):
        xi, yi = example
        return loss_fn(p, example) + xi[yi].sum()  # fails under vmap over 0 rows

    step = dpfunc.make_train_step(
        indexing_loss,
        dpfunc.optim.sgd(lr=1.0),
        clip_norm=2.0,
        noise_multiplier=1.5,
        expected_batch_size=10,
    )
    summed, stats = step.clip(params, (x[:0], y[:0]), torch.zeros(0))
    assert all(torch.equal(summed[k], torch.zeros_like(params[k])) for k in params)
    assert all(t.shape == (0,) for t in stats)


def test_inputs_are_not_modified(classifier, data):
    _, params, loss_fn = classifier()
    before = {k: v.clone() for k, v in params.items()}
    x, y = data(4)
    step = dpfunc.make_train_step(
        loss_fn,
        dpfunc.optim.sgd(lr=1.0, momentum=0.5),
        clip_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=4,
    )
    state = step.init(params)
    noise = dpfunc.standard_normal_like(params, seed=0, step=0)
    step(state, (x, y), torch.ones(4), noise)
    assert all(torch.equal(params[k], before[k]) for k in params)


@pytest.mark.slow
def test_compiled_equals_eager_with_one_graph_over_many_steps(classifier, data):
    torch._dynamo.reset()
    _, params, loss_fn = classifier(dtype=torch.float32)
    step = dpfunc.make_train_step(
        loss_fn,
        dpfunc.optim.adam(lr=0.01),
        clip_norm=0.5,
        noise_multiplier=1.0,
        expected_batch_size=12.5,
    )
    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    # what Trainer(compile=True) compiles: each micro-batch's sum, the noise, the rounding
    pieces = dpfunc.make_train_step(
        loss_fn, dpfunc.optim.adam(lr=0.01), clip_norm=0.5, noise_multiplier=1.0,
        expected_batch_size=12.5,
    ).compile()  # fmt: skip
    eager_state = counted_state = compiled_state = step.init(params)
    for i in range(4):
        x, y = data(16, dtype=torch.float32, seed=i)
        mask = (torch.arange(16) % (i + 2) != 0).float()
        noise = dpfunc.standard_normal_like(params, seed=0, step=i)
        eager_state, eager_metrics = step(eager_state, (x, y), mask, noise)
        counted_state, _ = compiled(counted_state, (x, y), mask, noise)
        halves = [((x[h], y[h]), mask[h]) for h in (slice(0, 8), slice(8, 16))]
        drawn = pieces.draw_noise(params, seed=0, step=i)
        compiled_state, _ = pieces.logical_step(compiled_state, halves, drawn)
        for k in params:
            assert compiled_state.params[k].dtype == torch.float32
            torch.testing.assert_close(
                compiled_state.params[k], eager_state.params[k], rtol=1e-5, atol=1e-6
            )
            torch.testing.assert_close(counted_state.params[k], eager_state.params[k])
    assert counter.frame_count == 1
    # one example near the clip norm among masked rows: within it, compiled as eagerly
    x, y = data(8, dtype=torch.float32, seed=9)
    one = torch.zeros(8)
    one[3] = 1.0
    norm = step.clip(params, (x, y), one)[1].norm[3]
    compiled_bound = dpfunc.make_train_step(
        loss_fn, dpfunc.optim.adam(lr=0.01), clip_norm=float(norm), noise_multiplier=0.0,
        expected_batch_size=1.0,
    )  # fmt: skip
    summed, _ = torch.compile(compiled_bound.clip, fullgraph=True)(params, (x, y), one)
    total = torch.linalg.vector_norm(torch.cat([v.reshape(-1) for v in summed.values()]))
    assert total <= float(norm)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(clip_norm=0.0), ValueError, "clip_norm=0.0"),
        (dict(clip_norm=-1.0), ValueError, "clip_norm=-1.0"),
        (dict(noise_multiplier=-0.1), ValueError, "noise_multiplier=-0.1"),
        (dict(noise_multiplier=math.nan), ValueError, "noise_multiplier=nan"),
        (dict(expected_batch_size=0), ValueError, "expected_batch_size=0"),
        (dict(clip_norm=math.inf), ValueError, "clip_norm=inf"),
        (dict(clipping="ghost-free"), ValueError, "clipping='ghost-free'"),
        (dict(chunk_size=0), ValueError, "chunk_size=0"),
        (dict(optimizer=torch.optim.SGD), TypeError, "optimizer"),
    ],
)
def test_bad_construction_raises(kwargs, error, match, classifier):
    _, _, loss_fn = classifier()
    args = dict(
        optimizer=dpfunc.optim.sgd(lr=0.1),
        clip_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=8,
    )
    args.update(kwargs)
    with pytest.raises(error, match=match):
        dpfunc.make_train_step(loss_fn, **args)


def test_bad_call_raises(classifier, data):
    _, params, loss_fn = classifier()
    x, y = data(4)
    step = dpfunc.make_train_step(
        loss_fn,
        dpfunc.optim.sgd(lr=0.1),
        clip_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=4,
    )
    state = step.init(params)
    noise = dpfunc.standard_normal_like(params, seed=0, step=0)
    with pytest.raises(ValueError, match="noise"):
        step(state, (x, y), torch.ones(4), {"0.weight": noise["0.weight"]})
    with pytest.raises(ValueError, match="mask"):
        step(state, (x, y), torch.ones(5), noise)
    bad = dpfunc.make_train_step(
        lambda p, ex: loss_fn(p, ex) * torch.ones(2),
        dpfunc.optim.sgd(lr=0.1),
        clip_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=4,
    )
    with pytest.raises(ValueError, match="0-d tensor"):
        bad(state, (x, y), torch.ones(4), noise)


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_adaptive_clipping_step_moves_the_clip_norm_geometrically(method, classifier, data):
    """clip at state.clip_norm, count the unclipped, noise the count, update C."""
    model, params, loss_fn = classifier()
    x, y = data(8)
    args = dict(clip_norm=0.05, noise_multiplier=1.0, expected_batch_size=8.0)
    adaptive = dpfunc.make_train_step(
        loss_fn, dpfunc.optim.sgd(lr=0.1), model=model, method=method, target_quantile=0.5,
        quantile_learning_rate=0.3, count_noise_multiplier=2.0, **args,
    )  # fmt: skip
    fixed = dpfunc.make_train_step(loss_fn, dpfunc.optim.sgd(lr=0.1), **args)
    state = adaptive.init(params)
    start = state.clip_state.clip_norm
    assert start.dtype == torch.float64 and float(start) == 0.05
    noise = dpfunc.standard_normal_like(params, seed=3, step=0)  # public: a test
    count_noise = torch.tensor(0.4, dtype=torch.float64)
    new, _ = adaptive(state, (x, y), torch.ones(8), noise, count_noise)
    norms = dpfunc.per_sample_norms(dpfunc.per_sample_grads(loss_fn, params, (x, y)))
    count = float((norms <= 0.05).sum())
    expected = 0.05 * math.exp(-0.3 * ((count + 2.0 * 0.4) / 8.0 - 0.5))
    assert float(new.clip_state.clip_norm) == pytest.approx(expected, rel=1e-12)
    # the first step clips at the starting norm: the same update as fixed clipping
    want, _ = fixed(fixed.init(params), (x, y), torch.ones(8), noise)
    for k in params:
        torch.testing.assert_close(new.params[k], want.params[k], rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="pass count_noise"):
        adaptive(state, (x, y), torch.ones(8), noise)
