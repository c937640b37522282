"""Half precision (bf16, fp16): ghost norms against vmap and a float64 oracle, each example's
contribution bounded with rounding, a bf16 model trained to float32's accuracy, the docs."""

import copy
import functools
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

import dpfunc
from dpfunc.ghost import GhostClipper, ghost_clip
from dpfunc.tree import global_norm

HALF = [torch.bfloat16, torch.float16]
DTYPE_IDS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# how far a half-precision forward and backward may move a norm from the float64 one
ORACLE_RTOL = {torch.bfloat16: 0.03, torch.float16: 0.005}


def mlp():
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                         nn.Linear(256, 10))  # fmt: skip


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2)
        self.fc = nn.Linear(8 * 3 * 3, 10)

    def forward(self, x):
        x = torch.tanh(self.norm(self.conv1(x)))
        return self.fc(torch.relu(self.conv2(x)).flatten(1))


class TinyAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.norm = nn.LayerNorm(32)
        self.out = nn.Linear(32, 10)

    def forward(self, tokens):
        h = self.embed(tokens)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.out(self.norm(h + a).mean(1))


def inputs(name, size, generator):
    if name == "mlp":
        return torch.randn(size, 64, generator=generator)
    if name == "cnn":
        return torch.randn(size, 1, 8, 8, generator=generator)
    return torch.randint(0, 50, (size, 12), generator=generator)


MODELS = {"mlp": mlp, "cnn": SmallCNN, "attention": TinyAttention}


def classifier(model):
    """``(params, loss_fn)``: one example's cross-entropy through ``model``."""
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        x, y = example
        out = functional_call(model, (p, buffers), (x.unsqueeze(0),))
        return F.cross_entropy(out.float(), y.unsqueeze(0))

    return params, loss_fn


@functools.cache
def clipper_for(model, loss_fn):
    return GhostClipper(model, loss_fn, "ghost")


def ghost(model, loss_fn, params, batch, mask, clip_norm):
    """``(summed, norms)`` of the ghost path, every parameter ghosted."""
    clipper = clipper_for(model, loss_fn)
    plan = clipper.plan(params, batch)
    assert set(plan.covered) == set(params), plan.explain(params)
    summed, _, clipped = ghost_clip(
        loss_fn, clipper.hooks, plan, params, batch, mask.bool(), clipping="flat",
        clip_norm=clip_norm,
    )  # fmt: skip
    return summed, clipped.norm


@pytest.mark.parametrize("dtype", HALF, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("name", list(MODELS))
def test_ghost_norms_agree_with_vmap_and_float64_in_half_precision(name, dtype):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = MODELS[name]().to(dtype)
    x = inputs(name, 32, g)
    x = x.to(dtype) if x.is_floating_point() else x
    batch = (x, torch.randint(0, 10, (32,), generator=g))
    params, loss_fn = classifier(model)

    grads = dpfunc.per_sample_grads(loss_fn, params, batch)
    vmap_norms = dpfunc.per_sample_norms(grads).double()
    clip_norm = float(vmap_norms.median())  # half the examples clipped
    summed, ghost_norms = ghost(model, loss_fn, params, batch, torch.ones(32), clip_norm)

    # the oracle: the same (rounded) parameters and inputs, forward and backward in float64
    model64 = copy.deepcopy(model).double()
    params64, loss64 = classifier(model64)
    batch64 = (x.double() if x.is_floating_point() else x, batch[1])
    grads64 = dpfunc.per_sample_grads(loss64, params64, batch64)
    oracle = dpfunc.per_sample_norms(grads64)

    torch.testing.assert_close(ghost_norms, vmap_norms, rtol=0.01, atol=0)
    torch.testing.assert_close(ghost_norms, oracle, rtol=ORACLE_RTOL[dtype], atol=0)
    torch.testing.assert_close(vmap_norms, oracle, rtol=ORACLE_RTOL[dtype], atol=0)

    # the clipped sum is float32, the exact sum of vmap's half gradients with the same factors,
    # and no farther from the float64 one than that (the half forward's rounding, up to 3%
    # for the bf16 MLP)
    assert all(v.dtype == torch.float32 for v in summed.values())
    factors = dpfunc.clip_factors(ghost_norms, clip_norm)
    oracle_sum = dpfunc.clipped_sum(grads64, factors)
    vmap_sum = dpfunc.clipped_sum({k: v.double() for k, v in grads.items()}, factors)

    def distance(a, b):
        return float(global_norm({k: a[k].double() - b[k] for k in b}) / global_norm(b))

    assert distance(summed, vmap_sum) <= 0.01
    assert distance(summed, oracle_sum) <= distance(vmap_sum, oracle_sum) + 0.002


class Mixed(nn.Module):
    """Every form of ghost norm at once: an index Gram (embedding), a Gram over positions
    (the Linear over 6 tokens), formed tensors (biases, the LayerNorm), an unfolded
    convolution and a rank-one Linear (the head)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.mix = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.conv = nn.Conv1d(8, 4, 3)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens):
        h = self.norm(torch.tanh(self.mix(self.embed(tokens))))
        return self.head(self.conv(h.transpose(1, 2)).flatten(1))


def cancelling(dtype):
    """A Linear(3, 3) over two positions whose products nearly cancel: huge inputs and
    output gradients, a small weight gradient. A naive Gram norm rounds to about 0."""
    model = nn.Linear(3, 3, bias=False).to(dtype)
    big = 2.0**13
    x = torch.tensor([[[big, 1.0, 0.0], [big, 0.0, 0.0]]] * 2, dtype=dtype)
    scale = torch.tensor([1.0, 1e3], dtype=dtype)
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        xi, s = example
        out = functional_call(model, (p, buffers), (xi,))
        return s * (out[0] - out[1]).sum()

    return model, params, loss_fn, (x, scale)


def lone_bias(dtype, size, generator):
    """A trained bias alone (a formed gradient of one entry): the clip factor's rounding
    and the product's, which no Gram bound absorbs, decide whether it passes the bound."""
    model = nn.Linear(1, 1).to(dtype)
    model.weight.requires_grad_(False)
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        xi, s = example
        return s * functional_call(model, (p, buffers), (xi,)).sum()

    scales = torch.rand(size, generator=generator, dtype=torch.float64) + 0.5
    return model, params, loss_fn, (torch.ones(size, 1, dtype=dtype), scales.to(dtype))


@pytest.mark.parametrize("dtype", [*HALF, torch.float32], ids=DTYPE_IDS.get)
def test_each_examples_contribution_is_at_most_the_clip_norm_with_rounding(dtype):
    # fp16 overflows past 65504: its scales stay within 1e-3 .. 1e2
    low, high = (-3, 2) if dtype == torch.float16 else (-4, 3)
    size = 8
    g = torch.Generator().manual_seed(2)
    model = Mixed().to(dtype)
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        tokens, y, s = example
        out = functional_call(model, (p, buffers), (tokens.unsqueeze(0),))
        return s * F.cross_entropy(out.float(), y.unsqueeze(0))

    scales = torch.logspace(low, high, size, dtype=torch.float64)[torch.randperm(size, generator=g)]
    tokens = torch.randint(0, 20, (size, 6), generator=g)
    batch = (tokens, torch.randint(0, 3, (size,), generator=g), scales.to(dtype))
    cases = [(model, params, loss_fn, batch), cancelling(dtype), lone_bias(dtype, 8, g)]
    for case, (model, params, loss_fn, batch) in enumerate(cases):
        b = batch[0].shape[0]
        _, norms = ghost(model, loss_fn, params, batch, torch.ones(b), 1.0)
        for clip_norm in (1e-3 * float(norms.min()), float(norms.median()), 1e3):
            for i in range(b):
                one, bound = ghost(model, loss_fn, params, batch, torch.eye(b)[i], clip_norm)
                contribution = global_norm({k: v.double() for k, v in one.items()})
                assert contribution <= clip_norm, (case, clip_norm, i, float(contribution))
                if case != 1 and bound[i] > 1.01 * clip_norm:  # clipped, not over-clipped
                    assert contribution >= 0.99 * clip_norm, (clip_norm, i, float(contribution))


def digits_run(dtype, method):
    """Test accuracy of a small MLP trained privately on sklearn's digits (fixed, public
    seeds: a reproducible test, not a private run)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10)).to(dtype)
    params, loss_fn = classifier(model)
    trainer = dpfunc.Trainer(
        loss_fn, params, (x[:1400].to(dtype), y[:1400]), optimizer=dpfunc.optim.adam(lr=0.02),
        epochs=4, expected_batch_size=200, clip_norm=1.0, noise_multiplier=1.0, seed=1234,
        model=model, method=method, progress=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # delta and sampling notes, not under test
        trainer.fit()
    trained = trainer.params
    assert all(p.dtype == dtype and torch.isfinite(p).all() for p in trained.values())
    with torch.no_grad():
        out = functional_call(model, trained, (x[1400:].to(dtype),))
    return float((out.argmax(1) == y[1400:]).float().mean())


def test_a_bf16_model_trains_to_the_accuracy_of_float32_by_ghost_and_vmap():
    reference = digits_run(torch.float32, "vmap")
    assert reference > 0.7
    for method in ("ghost", "vmap"):
        accuracy = digits_run(torch.bfloat16, method)
        assert abs(accuracy - reference) <= 0.01, (method, accuracy, reference)


def test_precision_doc_python_blocks_run():
    doc = Path(__file__).resolve().parents[1] / "docs" / "precision.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)
    assert blocks
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(doc), "exec"), namespace)


def test_noise_for_half_parameters_is_drawn_in_float32():
    params = {
        "w": torch.zeros(64, 64, dtype=torch.bfloat16),
        "b": torch.zeros(8, dtype=torch.float16),
    }
    noise = dpfunc.standard_normal_like(params, seed=dpfunc.secret_seed(), step=0)
    assert {k: v.dtype for k, v in noise.items()} == {"w": torch.float32, "b": torch.float32}
    w = noise["w"]
    assert bool((w.to(torch.bfloat16).float() != w).any())  # not a rounded bf16 Gaussian


# --- the running sum of a logical batch: float32 within FLOAT32_SUMS, float64 where needed ---


def linear_step(clip_norm=1.0, noise_multiplier=0.0, **settings):
    """A step whose per-example gradient is the example itself (``loss = sum(p * x)``)."""
    return dpfunc.make_train_step(
        lambda p, x: (p["w"] * x).sum(), dpfunc.optim.sgd(lr=1.0), clip_norm=clip_norm,
        noise_multiplier=noise_multiplier, expected_batch_size=1.0, method="vmap", **settings,
    )  # fmt: skip


def running_sum(step, params, micro_batches, noise=None):
    """The clipped sum ``logical_step`` hands the all-reduce (and its state after the step)."""
    seen = []

    def spy(summed, t):
        seen.append(summed)
        return summed

    step.collectives = step.collectives._replace(reduce=spy)
    noise = noise or dpfunc.step.StepNoise(
        {k: torch.zeros_like(v) for k, v in params.items()}, None
    )
    state, _ = step.logical_step(step.init(params), micro_batches, noise)
    return seen[0], state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_running_sum_is_float32_for_float32_and_half_parameters(dtype):
    params = {"w": torch.zeros(50, dtype=dtype)}
    step = linear_step()
    g = torch.Generator().manual_seed(0)
    micro = [(torch.randn(4, 50, generator=g).to(dtype), torch.ones(4)) for _ in range(3)]
    summed, _ = running_sum(step, params, micro)
    assert summed["w"].dtype == dpfunc.clipping.accumulation_dtype(dtype)


def test_past_the_float32_bound_the_rest_is_added_in_float64_and_rounded_once(monkeypatch):
    """A shrunken bound (4 sums) makes a logical batch of 6 micro-batches go on in float64:
    the result is the float32 sum of the first 3, plus the rest in float64, rounded once."""
    monkeypatch.setattr(dpfunc.step, "FLOAT32_SUMS", 4)
    params = {"w": torch.zeros(300)}
    step = linear_step(clip_norm=1e3)
    g = torch.Generator().manual_seed(1)
    micro = [(torch.randn(2, 300, generator=g) * 10.0**k, torch.ones(2)) for k in range(6)]
    summed, _ = running_sum(step, params, micro)
    assert summed["w"].dtype == torch.float32
    parts = [step.clip(params, x, m)[0]["w"] for x, m in micro]
    head = parts[0] + parts[1] + parts[2]  # float32, FLOAT32_SUMS - 1 micro-batches
    expected = (head.double() + parts[3] + parts[4] + parts[5]).float()
    assert torch.equal(summed["w"], expected)
    assert not torch.equal(summed["w"], sum(parts[1:], parts[0]))  # not float32 throughout


def test_the_float32_margin_covers_the_micro_batch_and_rank_additions():
    u = 2.0**-24
    for rows in (1, 16, 256, 1024):
        scale = dpfunc.clipping.clip_margin(rows, torch.float32, size=536_000).scale
        n = rows + 2 + dpfunc.clipping.FLOAT32_SUMS
        assert scale - 1 >= n * u / (1 - n * u)  # gamma_n of float32, at least
    # small: 2.7e-5 for 256 rows (1.9e-5 without the running sum), 1.2e-5 for 16
    assert 2.6e-5 < dpfunc.clipping.clip_margin(256, size=536_000).scale - 1 < 2.8e-5
    assert 1.2e-5 < dpfunc.clipping.clip_margin(16, size=536_000).scale - 1 < 1.3e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=8, deadline=None)
@given(
    size=st.integers(1, 3000),
    micro_batches=st.sampled_from([1, 2, 40, 126, 127, 128, 160]),
    rows=st.integers(1, 3),
    kind=st.sampled_from(["constant", "random"]),
    near=st.sampled_from([1 - 1e-6, 1.0, 1 + 1e-7, 1 + 1e-5, 3.0]),
    log_clip=st.floats(-4, 4),
    seed=st.integers(0, 2**16),
)
def test_identical_examples_through_many_micro_batches_stay_within_n_clip_norms(
    dtype, size, micro_batches, rows, kind, near, log_clip, seed
):
    """Every row one copy of the same example, ``n`` of them in float32 running sums (past
    127 micro-batches, float64): each copy's contribution, rounding included, is at most C,
    so the computed sum's norm is at most ``n * C`` (constant entries: the roundings of the
    running sum all lean one way)."""
    clip_norm = 10.0**log_clip
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, generator=g, dtype=torch.float64)
    if kind == "constant":
        x = torch.ones(size, dtype=torch.float64)
    x = (x / torch.linalg.vector_norm(x) * clip_norm * near).to(dtype)
    params = {"w": torch.zeros(size, dtype=dtype)}
    micro = [(x.expand(rows, size).clone(), torch.ones(rows)) for _ in range(micro_batches)]
    summed, _ = running_sum(linear_step(clip_norm), params, micro)
    assert summed["w"].dtype == torch.float32
    total = float(torch.linalg.vector_norm(summed["w"].double()))
    assert total <= micro_batches * rows * clip_norm


def test_noisy_average_equals_add_noise_then_average():
    g = torch.Generator().manual_seed(3)
    params = {"a": torch.zeros(1000), "b": torch.zeros(7, dtype=torch.float64),
              "h": torch.zeros(30, dtype=torch.bfloat16)}  # fmt: skip
    s32 = {"a": torch.randn(1000, generator=g), "b": torch.randn(7, generator=g).double(),
           "h": torch.randn(30, generator=g)}  # fmt: skip
    z = {k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in s32.items()}
    for std in (1.3, torch.tensor(0.7, dtype=torch.float64)):
        fused = dpfunc.noise.noisy_average(s32, z, std, 3.0, params)
        plain = dpfunc.average(dpfunc.add_noise(s32, z, std), 3.0)
        assert {k: v.dtype for k, v in fused.items()} == {
            "a": torch.float32, "b": torch.float64, "h": torch.float32}  # fmt: skip
        assert torch.equal(fused["b"], plain["b"])  # float64: the same operations
        for k in ("a", "h"):  # a float std: the same operation; a tensor one: to rounding
            assert isinstance(std, torch.Tensor) or torch.equal(fused[k], plain[k])
            scale = (s32[k].abs() + float(std) * z[k].abs()) / 3.0
            assert bool(((fused[k] - plain[k]).abs() <= 4 * 2.0**-24 * scale).all())
        # a float64 sum of the same values: the definition in float64, rounded once
        wide = dpfunc.noise.noisy_average({k: v.double() for k, v in s32.items()}, z, std, 3.0,
                                          params)  # fmt: skip
        oracle = {k: ((s32[k].double() + std * z[k]) / 3.0) for k in s32}
        for k in s32:
            assert torch.equal(wide[k], oracle[k].to(wide[k].dtype))


def test_noisy_average_in_place_gives_the_same_bits_into_the_sum_it_owns():
    g = torch.Generator().manual_seed(5)
    params = {"a": torch.zeros(1000), "b": torch.zeros(7, dtype=torch.float64),
              "h": torch.zeros(30, dtype=torch.bfloat16), "w": torch.zeros(40)}  # fmt: skip
    sums = {
        "a": torch.randn(1000, generator=g),
        "b": torch.randn(7, generator=g).double(),
        "h": torch.randn(30, generator=g),
        "w": torch.randn(40, generator=g).double(),
    }  # fmt: skip  (a wide sum, float32 out)
    for secure in (False, True):  # float32 noise for the float32 leaves, or float64 everywhere
        z = {k: torch.randn(v.shape, generator=g, dtype=torch.float64 if secure else v.dtype)
             for k, v in sums.items()}  # fmt: skip
        for std in (1.3, torch.tensor(0.7, dtype=torch.float64)):
            owned = {k: v.clone() for k, v in sums.items()}
            expected = dpfunc.noise.noisy_average(sums, z, std, 3.0, params)
            got = dpfunc.noise.noisy_average_(owned, z, std, 3.0, params)
            for k, v in expected.items():
                assert got[k].dtype == v.dtype and torch.equal(got[k], v), (secure, std, k)
            # written into the sum where it has the result's dtype and no float64 noise is
            # added to a float32 sum (that one is added in float64 and rounded once)
            into = {"a": not secure, "b": True, "h": not secure, "w": False}
            for k, inside in into.items():
                assert (got[k].data_ptr() == owned[k].data_ptr()) == inside, (secure, k)
                if not inside:  # left as it was
                    assert torch.equal(owned[k], sums[k]), (secure, k)


def test_secure_noise_on_a_float32_sum_is_added_in_float64_and_rounded_once():
    """logical_step's float32 sum with the float64 secure draw equals the float64 definition:
    the noise added to the (exact) sum in float64, averaged, and only then rounded."""
    pytest.importorskip("cryptography")
    params = {"w": torch.zeros(2000)}
    step = linear_step(clip_norm=0.5, noise_multiplier=1.1)
    g = torch.Generator().manual_seed(4)
    micro = [(torch.randn(4, 2000, generator=g), torch.ones(4)) for _ in range(3)]
    noise = step.draw_noise(params, seed=dpfunc.secret_seed(), step=0, secure=True)
    assert noise.params["w"].dtype == torch.float64
    summed, state = running_sum(step, params, micro, noise)
    assert summed["w"].dtype == torch.float32
    private = ((summed["w"].double() + 1.1 * 0.5 * noise.params["w"]) / 1.0).float()
    assert torch.equal(state.params["w"], params["w"] - private)
    # the same as a float64 running sum would give for this sum
    wide = dpfunc.noise.noisy_average({"w": summed["w"].double()}, noise.params, 1.1 * 0.5, 1.0,
                                      params)  # fmt: skip
    assert torch.equal(state.params["w"], params["w"] - wide["w"])
