"""Activation checkpointing: the private gradient equals the one without it.

transformers' ``gradient_checkpointing_enable()`` (not reentrant), with the
PEFT recipe's ``enable_input_require_grads()``, on LoRA and full fine-tuning:
the batched ghost pass recomputes each block with the probes of the forward,
so the per-example norms, the clipped sum and the private gradient are those
of the same model without checkpointing (float64 to 1e-9, float32 to 1e-5).
Reentrant checkpointing, whose blocks backpropagate on their own, is refused, and
the vmap path, which cannot run checkpointing at all, says so.
"""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

import dpfunc

peft = pytest.importorskip("peft", reason="needs the 'hf' extra (peft is not installed)")
transformers = pytest.importorskip("transformers", reason="needs the 'hf' extra")
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop", "ignore:.*deprecated")

VOCAB, T, N = 64, 12, 16


def gpt2(dtype, *, lora: bool, dropout: float = 0.0):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2,
                                     n_positions=32, pad_token_id=0, resid_pdrop=dropout,
                                     embd_pdrop=dropout, attn_pdrop=dropout)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).to(dtype)
    if lora:
        lora_config = peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True)
        model = peft.get_peft_model(model, lora_config)
    return model


def rows():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (N, T), generator=g)
    mask = (torch.arange(T) < torch.randint(4, T + 1, (N, 1), generator=g)).long()
    return [{"input_ids": ids[i], "attention_mask": mask[i],
             "labels": torch.where(mask[i].bool(), ids[i], -100)} for i in range(N)]  # fmt: skip


def private_gradient(model, method="auto", noise=0.0):
    @dpfunc.batched_loss
    def loss(params, batch):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = functional_call(model, params, (), inputs, strict=False).logits
        return dpfunc.losses.causal_lm(logits, batch["labels"])

    model.train()
    private = dpfunc.PrivateGradients(model, loss, rows(), expected_batch_size=8, clip_norm=0.5,
                                      noise_multiplier=noise, delta=1e-5, epochs=1,
                                      physical_batch_size=8, seed=3, method=method)  # fmt: skip
    (batch,) = private.batches(1)
    torch.manual_seed(5)  # the dropout draws, the same in every run
    private.backward(batch)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize(
    "dtype, tolerance", [(torch.float64, 1e-9), (torch.float32, 1e-5)], ids=["f64", "f32"]
)
def test_the_private_gradient_equals_the_one_without_checkpointing(lora, dtype, tolerance):
    # the same path (auto may time plain vmap faster without checkpointing): the same rounding
    plain = private_gradient(gpt2(dtype, lora=lora, dropout=0.1), method="ghost")
    model = gpt2(dtype, lora=lora, dropout=0.1)
    model.gradient_checkpointing_enable()  # use_reentrant=False, transformers 5's default
    model.enable_input_require_grads()  # the PEFT / QLoRA recipe
    assert dpfunc._activation_checkpointing.activation_checkpointing(model)
    checkpointed = private_gradient(model)  # auto: the batched ghost pass, the one that runs
    assert plain.keys() == checkpointed.keys()
    assert any(float(g.abs().max()) > 0 for g in plain.values())
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=tolerance,
                                   atol=tolerance * float(plain[name].abs().max()))  # fmt: skip


def test_reentrant_checkpointing_is_refused_not_trained_with_lost_gradients():
    # its blocks run without a graph and backpropagate on their own: the probes' gradients
    # would be pruned away, and the LoRA layers inside would get a clipped sum of zero
    model = gpt2(torch.float32, lora=True)
    model.gradient_checkpointing_enable({"use_reentrant": True})
    with pytest.raises(RuntimeError, match="use_reentrant"):
        private_gradient(model, method="ghost")


def test_the_vmap_path_says_it_cannot_run_a_checkpointing_model():
    model = gpt2(torch.float32, lora=True)
    model.gradient_checkpointing_enable()
    with pytest.raises(RuntimeError, match="checkpoints activations.*batched ghost pass"):
        private_gradient(model, method="vmap")


def test_a_tensor_outside_the_model_is_still_refused_with_the_input_grad_hook():
    model = gpt2(torch.float32, lora=True)
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    temperature = torch.ones((), requires_grad=True)  # trained by autograd, never privately

    @dpfunc.batched_loss
    def loss(params, batch):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = functional_call(model, params, (), inputs, strict=False).logits
        return dpfunc.losses.causal_lm(logits * temperature, batch["labels"])

    private = dpfunc.PrivateGradients(model, loss, rows(), expected_batch_size=8, clip_norm=1.0,
                                      noise_multiplier=1.0, delta=1e-5, epochs=1,
                                      physical_batch_size=8, seed=3)  # fmt: skip
    (batch,) = private.batches(1)
    with pytest.raises(ValueError, match="not a trainable parameter"):
        private.backward(batch)
