"""Which settings train: full fine-tuning against LoRA at epsilon 3 and 8, by batch and rate.

Run from the repository root (about 15 minutes on 2 CPU cores):

    .venv/bin/python bench/hf_settings.py          # writes bench/hf_settings.json and .md

The task is examples/hf_trainer.py's classifier: a small GPT-2 (2 layers, ``n_embd``
64, byte tokens) pretrained WITHOUT privacy on public text (the standard library's
docstrings), then fine-tuned by ``PrivateTrainer`` to classify 4,000 generated review
sentences, 1,000 held out. ``lora`` trains rank-8 adapters on ``c_attn`` and the new
head; ``full`` trains every parameter. Each row is one run (4 epochs, ``clip_norm``
1, AdamW, constant rate, the noise calibrated to the epsilon at ``delta`` 1e-5):
the held-out accuracy, and, at the last logged step, ``grad_norm`` (the private
gradient's norm) over ``noise_norm`` (the norm of the noise alone,
``sigma * C * sqrt(d) / B``). A ratio near 1 means the update is mostly noise.
The non-private rows (``epsilon`` inf) train the same way with no noise and no clipping.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))

RUNS = [
    (mode, epsilon, batch, rate)
    for mode in ("lora", "full")
    for epsilon in (3.0, 8.0)
    for batch in (64, 256)
    for rate in (1e-3, 1e-2)
] + [(mode, math.inf, 64, rate) for mode in ("lora", "full") for rate in (1e-3, 1e-2)]


def run(body, mode: str, epsilon: float, batch: int, rate: float, out: str) -> dict:
    import hf_trainer as example  # examples/hf_trainer.py: the task, its data and model
    import peft
    import torch
    import transformers

    import dpfunc
    from dpfunc.integrations.transformers import PrivateTrainer

    rng = random.Random(example.SEED)
    train, test = example.reviews(example.REVIEWS, rng), example.reviews(1000, rng)
    torch.manual_seed(example.SEED)
    config = example.CONFIG.__class__(**{**example.CONFIG.to_dict(), "num_labels": 2})
    model = transformers.GPT2ForSequenceClassification(config)
    model.transformer.load_state_dict(body)
    if mode == "lora":
        lora = peft.LoraConfig(task_type="SEQ_CLS", r=8, lora_alpha=16,
                               target_modules=["c_attn"], fan_in_fan_out=True)  # fmt: skip
        model = peft.get_peft_model(model, lora)
    private = math.isfinite(epsilon)
    privacy = dpfunc.DPConfig(
        expected_batch_size=batch, clip_norm=1.0 if private else math.inf,
        **({"target_epsilon": epsilon} if private else {"noise_multiplier": 0.0}),
        delta=1e-5, epochs=4,
    )  # fmt: skip
    trainer = PrivateTrainer(
        model=model, train_dataset=train, eval_dataset=test, data_collator=example.collate,
        compute_metrics=example.accuracy, privacy=privacy,
        args=example.arguments(out, learning_rate=rate, lr_scheduler_type="constant",
                               per_device_train_batch_size=64),
    )  # fmt: skip
    trainer.train()
    logged = [row for row in trainer.state.log_history if "grad_norm" in row]
    last = logged[-1]
    return {
        "mode": mode, "epsilon": epsilon, "expected_batch": batch, "learning_rate": rate,
        "accuracy": trainer.evaluate()["eval_accuracy"],
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "noise_multiplier": trainer.private.noise_multiplier, "steps": trainer.private.steps_done,
        "grad_norm": last["grad_norm"], "noise_norm": last.get("noise_norm", 0.0),
    }  # fmt: skip


def table(rows: list[dict]) -> str:
    lines = [
        "# Which settings train: full fine-tuning against LoRA",
        "",
        "The workload and the columns: the docstring of `bench/hf_settings.py`. One run each.",
        "",
        "| trained | parameters | epsilon | expected batch | learning rate | sigma | steps "
        "| accuracy | grad_norm / noise_norm |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        ratio = r["grad_norm"] / r["noise_norm"] if r["noise_norm"] else math.nan
        lines.append(
            f"| {r['mode']} | {r['trainable']:,} | {r['epsilon']:g} | {r['expected_batch']} | "
            f"{r['learning_rate']:g} | {r['noise_multiplier']:.3g} | {r['steps']} | "
            f"{r['accuracy']:.3f} | {'-' if math.isnan(ratio) else f'{ratio:.2f}'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE))
    options = parser.parse_args()
    warnings.simplefilter("ignore")
    import hf_trainer as example
    import transformers

    transformers.logging.set_verbosity_error()
    scratch = "/tmp/dpfunc-bench-hf-settings"
    gpt2 = example.pretrained(scratch)
    body = {k: v.clone() for k, v in gpt2.transformer.state_dict().items()}
    rows = []
    for mode, epsilon, batch, rate in RUNS:
        rows.append(run(body, mode, epsilon, batch, rate, scratch))
        print(rows[-1], flush=True)
    out = Path(options.out)
    (out / "hf_settings.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "hf_settings.md").write_text(table(rows))
    print(table(rows))


if __name__ == "__main__":
    main()
