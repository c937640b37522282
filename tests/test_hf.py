"""Hugging Face models (transformers, peft) under dpfunc, built from tiny configs.

Per-example gradients with padding masks equal a batch-size-1 autograd loop
in float64, for an encoder classifier, two decoder language models (padding
labelled -100) and a LoRA adapter. The compiled step equals the eager one for
each (marked heavy: minutes of compiling, run by ``make test-heavy``).
"""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import dpfunc

peft = pytest.importorskip("peft", reason="needs the 'hf' extra (peft is not installed)")
transformers = pytest.importorskip(
    "transformers", reason="needs the 'hf' extra (transformers is not installed)"
)

B, T, VOCAB = 4, 10, 50


def bert():
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, num_labels=3,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def llama():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def gpt2_lora():
    config = peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True)
    model = peft.get_peft_model(gpt2(), config)
    for name, p in model.named_parameters():  # B starts at 0: move it so A's gradient is not 0
        if "lora_B" in name:
            p.data.normal_()
    return model


def padded_batch():
    ids = torch.randint(1, VOCAB, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 6:] = 0  # right padding
    mask[2, 3:] = 0
    mask[3, :2] = 0  # left padding
    labels = torch.where(mask.bool(), ids, -100)
    return ids, mask, labels


def classify(call, example):
    ids, mask, labels = example
    logits = call(input_ids=ids[None], attention_mask=mask[None]).logits
    return F.cross_entropy(logits, (labels[-1] % 3)[None].clamp(min=0))


def language_model(call, example):
    ids, mask, labels = example
    return call(input_ids=ids[None], attention_mask=mask[None], labels=labels[None]).loss


CASES = [(bert, classify), (gpt2, language_model), (llama, language_model),
         (gpt2_lora, language_model)]  # fmt: skip
IDS = ["bert", "gpt2", "llama", "gpt2-lora"]


@pytest.mark.parametrize("build, forward", CASES, ids=IDS)
def test_padded_batches_match_autograd_loop(build, forward):
    model = build().double().eval()
    batch = padded_batch()
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        return forward(lambda **kw: functional_call(model, (p, buffers), (), kw), example)

    grads = dpfunc.per_sample_grads(loss_fn, params, batch)
    trainable = dict(model.named_parameters())
    for i in range(B):
        example = tuple(t[i] for t in batch)
        loss = forward(lambda **kw: model(**kw), example)
        expected = torch.autograd.grad(loss, [trainable[n] for n in params], allow_unused=True)
        for (name, got), want in zip(grads.items(), expected):
            want = torch.zeros_like(got[i]) if want is None else want
            torch.testing.assert_close(got[i], want, rtol=1e-9, atol=1e-12, msg=name)
    if build is gpt2_lora:
        assert all("lora_" in name for name in params)


def test_transformers_guard_is_restored():
    from transformers.utils import import_utils

    before = import_utils.is_jit_tracing
    model = bert().eval()
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        return classify(lambda **kw: functional_call(model, (p, buffers), (), kw), example)

    dpfunc.per_sample_grads(loss_fn, params, padded_batch())
    assert import_utils.is_jit_tracing is before
    assert not import_utils.is_tracing()


def test_branch_on_an_example_names_the_cause_and_the_way_out():
    w = {"w": torch.ones(3)}

    def loss_fn(p, x):
        if (x > 0).all():  # a Python branch on the example's values
            return (p["w"] * x).sum()
        return (p["w"] * x).square().sum()

    with pytest.raises(RuntimeError, match="branches on a value of one example") as error:
        dpfunc.per_sample_grads(loss_fn, w, torch.randn(4, 3))
    assert "torch.where" in str(error.value)
    assert "data-dependent" in str(error.value.__cause__)


@pytest.mark.parametrize("build, forward", CASES, ids=IDS)
def test_every_parameter_is_ghosted_and_equals_vmap(build, forward):
    """BERT, GPT-2 (tied input and output embeddings), Llama and LoRA: the ghost pass
    covers every trainable parameter and its clipped sum and norms equal vmap's."""
    model = build().double().eval()
    batch = padded_batch()
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        return forward(lambda **kw: functional_call(model, (p, buffers), (), kw), example)

    def step(method, clip_norm):
        return dpfunc.make_train_step(
            loss_fn, dpfunc.optim.sgd(lr=1.0), clip_norm=clip_norm, noise_multiplier=0.0,
            expected_batch_size=B, model=model, method=method,
        )  # fmt: skip

    mask = torch.tensor([True, True, True, False])
    norms = step("vmap", math.inf).clip(params, batch, mask)[1].norm[:3].sort().values
    clip_norm = float(norms[:2].mean())  # clips the largest two of three real examples
    vmap_step, ghost_step = step("vmap", clip_norm), step("ghost", clip_norm)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback warning
        warnings.filterwarnings("ignore", message="There is a performance drop")
        assert set(ghost_step.explain(params, batch).values()) == {"ghost"}
        got, got_stats = ghost_step.clip(params, batch, mask)
    want, want_stats = vmap_step.clip(params, batch, mask)
    assert int(want_stats.scaled[:3].sum()) == 2  # clipping is exercised, and so is none
    torch.testing.assert_close(got_stats.norm, want_stats.norm, rtol=1e-8, atol=1e-12)
    for name in params:
        torch.testing.assert_close(got[name], want[name], rtol=1e-8, atol=1e-12, msg=name)
    assert vmap_step.explain(params, batch)[next(iter(params))] == "vmap: method='vmap'"


@pytest.mark.heavy  # each compile takes a minute or more here: make test-heavy
@pytest.mark.parametrize("batched", [False, True], ids=["one-example", "batched"])
@pytest.mark.parametrize("build, forward", CASES, ids=IDS)
def test_compiled_step_equals_eager(build, forward, batched):
    """Compiled equals eager, with the one-example loss and with the batched one (whose
    compiled pass runs the model batched, without vmap)."""
    torch.manual_seed(0)
    model = build().eval()  # no dropout: both steps see the same function
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        return forward(lambda **kw: functional_call(model, (p, buffers), (), kw), example)

    loss = batched_losses(build, model, buffers) if batched else loss_fn
    batch, mask = padded_batch(), torch.tensor([1.0, 1.0, 1.0, 0.0])
    results = []
    for compile in (False, True):
        step = dpfunc.make_train_step(
            loss, dpfunc.optim.sgd(lr=0.5), clip_norm=0.1, noise_multiplier=1.0,
            expected_batch_size=4.0, model=model,
        )  # fmt: skip
        if compile:
            step.compile()
        state = step.init(params)
        for t in range(2):
            noise = step.draw_noise(state.params, seed=7, step=t)
            state, _ = step.logical_step(state, [(batch, mask)], noise)
        results.append(state.params)
    rtol = 1e-5 if batched else 1e-4  # vmap's per-example fallbacks round further apart
    for name, value in results[0].items():
        torch.testing.assert_close(results[1][name], value, rtol=rtol, atol=rtol / 10, msg=name)


def batched_losses(build, model, buffers):
    """The batched form of ``classify`` / ``language_model``, through dpfunc.losses."""

    @dpfunc.batched_loss
    def losses(p, batch):
        ids, mask, labels = batch
        out = functional_call(model, (p, buffers), (), dict(input_ids=ids, attention_mask=mask))
        if build is bert:
            return dpfunc.losses.classification(out.logits, (labels[:, -1] % 3).clamp(min=0))
        return dpfunc.losses.causal_lm(out.logits, labels)

    return losses


@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-9), (torch.float32, 1e-5)])
@pytest.mark.parametrize("build, forward", CASES, ids=IDS)
def test_a_batched_loss_runs_batched_and_equals_the_one_example_loss(build, forward, dtype, rtol):
    """The batched pass (no vmap) gives the one-example loss's clipped sum and norms on
    every family, to float rounding: in float64 the one-example form of the same loss,
    in float32 the one-example loss of ``forward`` (transformers' own labels= loss, which
    it computes in float32 whatever the model's dtype)."""
    torch.manual_seed(0)
    model = build().to(dtype).eval()
    batch = padded_batch()
    params, buffers = dpfunc.functionalize(model)
    losses = batched_losses(build, model, buffers)

    def loss_fn(p, example):
        if dtype == torch.float64:
            return losses(p, example)  # a plain function: the vmap pass
        return forward(lambda **kw: functional_call(model, (p, buffers), (), kw), example)

    def step(loss):
        return dpfunc.make_train_step(
            loss, dpfunc.optim.sgd(lr=1.0), clip_norm=0.5, noise_multiplier=0.0,
            expected_batch_size=B, model=model, method="ghost",
        )  # fmt: skip

    mask = torch.tensor([True, True, True, False])
    batched = step(losses)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback to the vmap pass
        warnings.filterwarnings("ignore", message="There is a performance drop")
        got, got_stats = batched.clip(params, batch, mask)
    assert [plan.batched for plan in batched.clip.ghost.plans.values()] == [True]
    want, want_stats = step(loss_fn).clip(params, batch, mask)
    assert int(got_stats.scaled[:3].sum()) >= 1
    torch.testing.assert_close(got_stats.loss, want_stats.loss, rtol=rtol, atol=rtol * 1e-3)
    torch.testing.assert_close(got_stats.norm, want_stats.norm, rtol=rtol, atol=rtol * 1e-3)
    for name in params:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=rtol * 1e-3, msg=name)
