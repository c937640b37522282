"""The gap between the batched and the one-example ghost pass in bf16, on one model.

The batched-loss check (dpfunc.ghost.batched) compares, on the first batch of each
shape, each example's loss and gradient norm in the batched pass with those of the
one-example pass, to the rounding of the dtype the model computes in. This script
measures that gap for PrivateTrainer's first step, to set and check the tolerance:

    .venv/bin/python bench/bf16_gap.py WIDTH KIND PRECISION PRETRAIN_STEPS

KIND is gpt2, gpt2-lora or llama-lora (2 layers below width 768, 12 at 768);
PRECISION is autocast (bf16=True) or bf16params (the model converted to bf16);
PRETRAIN_STEPS non-private AdamW steps first make predictions peaked. It prints one
JSON line: the largest relative gap of the losses and of the norms over a physical
batch of 16. bench/bf16_gap.jsonl holds the runs summarised in bench/hf_scale.md.
"""

import json
import sys
import warnings

import datasets
import peft
import torch
import transformers

import dpfunc
import dpfunc.ghost.batched as B
from dpfunc.integrations.transformers import PrivateTrainer

warnings.filterwarnings("ignore")
transformers.logging.set_verbosity_error()
width, kind, precision, pre = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
layers = 12 if width >= 768 else 2
torch.manual_seed(0)
V = 1024
if kind.startswith("llama"):
    cfg = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=max(4, width // 64),
        num_key_value_heads=max(4, width // 64),
        max_position_embeddings=256,
        pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(cfg)
    targets = ["q_proj", "v_proj"]
else:
    cfg = transformers.GPT2Config(
        vocab_size=V,
        n_embd=width,
        n_layer=layers,
        n_head=max(4, width // 64),
        n_positions=256,
        pad_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(cfg)
    targets = ["c_attn"]
g = torch.Generator().manual_seed(0)
rows = [
    {"input_ids": (torch.arange(int(n)) * int(s) % (V - 1) + 1).tolist()}
    for n, s in zip(
        torch.randint(16, 64, (128,), generator=g), torch.randint(1, 50, (128,), generator=g)
    )
]


def pad(features):
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    for i, f in enumerate(features):
        ids[i, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
    mask = (ids != 0).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)}


if pre:  # a few non-private steps, so that predictions are peaked
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for s in range(pre):
        b = pad(rows[(s * 16) % 128 : (s * 16) % 128 + 16])
        loss = model(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    print("pretrain loss", float(loss), file=sys.stderr)
if kind.endswith("lora"):
    model = peft.get_peft_model(
        model, peft.LoraConfig(r=16, target_modules=targets, fan_in_fan_out=kind.startswith("gpt2"))
    )
if precision == "bf16params":
    model = model.to(torch.bfloat16)
ds = datasets.Dataset.from_list(rows)
captured = []
orig = B.ghost_clip


def spy(*a, **k):
    out = orig(*a, **k)
    captured.append(out)
    return out


B.ghost_clip = spy
args = transformers.TrainingArguments(
    output_dir="/tmp/dpfunc-bench-bf16-gap",
    per_device_train_batch_size=16,
    learning_rate=1e-3,
    save_strategy="no",
    report_to=[],
    max_grad_norm=0.0,
    use_cpu=True,
    disable_tqdm=True,
    bf16=precision == "autocast",
    max_steps=1,
)
t = PrivateTrainer(
    model=model,
    args=args,
    train_dataset=ds,
    data_collator=pad,
    speed=dpfunc.SpeedConfig(model=model, method="auto"),
    privacy=dpfunc.DPConfig(
        expected_batch_size=32, clip_norm=1.0, noise_multiplier=1.0, delta=1e-5
    ),
)
err = ""
try:
    t.train()
except Exception as e:
    err = str(e)[:200]
res = {
    "width": width,
    "layers": layers,
    "kind": kind,
    "precision": precision,
    "pretrained_steps": pre,
    "error": err,
}
if len(captured) >= 2:
    (_, l1, c1), (_, l2, c2) = captured[:2]

    def rel(a, b):
        return float(((a.double() - b.double()).abs() / b.double().abs().clamp(min=1e-12)).max())

    res.update(
        loss_gap=rel(l1, l2), norm_gap=rel(c1.norm, c2.norm), median_norm=float(c2.norm.median())
    )
print(json.dumps(res))
