"""Benchmark whole Hugging Face fine-tuning runs: transformers.Trainer vs PrivateTrainer.

Run from the repository root:

    .venv/bin/python bench/hf_trainer.py            # full run (about 10 minutes, 2 CPU cores)
    .venv/bin/python bench/hf_trainer.py --quick    # smoke run
    .venv/bin/python bench/hf_trainer.py --out DIR  # write DIR/hf_trainer.json and .md

The workload: a GPT-2 from a small config (n_embd 128, 2 layers, 2 heads, vocabulary
1000, 64 positions, dropout 0) under ``peft.get_peft_model`` with ``LoraConfig(r=8,
target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)``, fine-tuned on 4096
sequences of 64 tokens, right-padded (lengths 32..64), labels -100 at padding; AdamW,
constant learning rate, no checkpoints, logging every 10 steps.

Each configuration is trained ``STEPS`` optimizer steps in a FRESH process (imports,
model building and first-call costs included, as a user pays them): ``trainer`` is
``transformers.Trainer`` (batch 32, non-private); ``private`` is ``PrivateTrainer`` with
``expected_batch_size=32`` and ``per_device_train_batch_size=32`` (a Poisson batch
above 32 takes a second micro-batch), method "auto"; ``private_ghost`` forces ghost
clipping; ``private_p64`` has physical batches of 64 (one micro-batch almost always).
Reported: the median step time after ``WARMUP`` steps (a callback's clock between
``on_step_begin`` and ``on_step_end``), steps per second from it, the whole process's
wall time, and its peak resident memory (``ru_maxrss``).

dp-transformers (an Opacus-based ``Trainer``) is not measured: its release on PyPI,
1.0.0, requires ``torch<=1.12.1``, which has no build for Python 3.11.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

STEPS, WARMUP = 60, 5
CONFIGS = {
    "trainer": {},
    "private": {"method": "auto", "physical": 32},
    "private_ghost": {"method": "ghost", "physical": 32},
    "private_p64": {"method": "auto", "physical": 64},
}


def one_run(name: str, steps: int) -> dict:
    """Trains configuration ``name`` in this process; its timings and memory."""
    import warnings

    import peft
    import torch
    import transformers

    import dpfunc
    from dpfunc.integrations.transformers import PrivateTrainer

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=1000, n_embd=128, n_layer=2, n_head=2,
                                     n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)  # fmt: skip
    lora = peft.LoraConfig(r=8, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
    model = peft.get_peft_model(transformers.GPT2LMHeadModel(config), lora)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(32, 65, (4096,), generator=g)
    rows = [{"input_ids": torch.randint(1, 1000, (int(n),), generator=g).tolist()}
            for n in lengths]  # fmt: skip

    def collate(features):
        ids = torch.zeros(len(features), 64, dtype=torch.long)
        for i, f in enumerate(features):
            ids[i, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask = (ids != 0).long()
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100),
        }

    stamps: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    setting = CONFIGS[name]
    args = transformers.TrainingArguments(
        output_dir="/tmp/dpfunc-bench-hf-trainer",
        per_device_train_batch_size=setting.get("physical", 32),
        max_steps=steps, learning_rate=1e-3, lr_scheduler_type="constant", max_grad_norm=0.0,
        logging_steps=10, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    common = dict(model=model, args=args, train_dataset=rows, data_collator=collate,
                  callbacks=[Clock()])  # fmt: skip
    if name == "trainer":
        trainer = transformers.Trainer(**common)
    else:
        privacy = dpfunc.DPConfig(expected_batch_size=32, clip_norm=1.0, noise_multiplier=1.0,
                                  delta=1e-5)  # fmt: skip
        speed = dpfunc.SpeedConfig(model=model, method=setting["method"])
        trainer = PrivateTrainer(**common, privacy=privacy, speed=speed)
    before_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    trainer.train()
    times = [end - begin for begin, end in zip(stamps[::2], stamps[1::2])]
    median = statistics.median(times[WARMUP:])
    return {"steps": len(times), "median_ms": 1000 * median, "steps_per_second": 1 / median,
            "first_step_s": times[0], "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            / 1024, "peak_before_train_mb": before_mb}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).parent))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a configuration, in this process
    parser.add_argument("--steps", type=int, default=STEPS, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.one:
        print(json.dumps(one_run(options.one, options.steps)))
        return
    steps = 2 * WARMUP + 2 if options.quick else STEPS
    results = {}
    for name in CONFIGS:
        started = time.perf_counter()
        done = subprocess.run([sys.executable, __file__, "--one", name, "--steps", str(steps)],
                              capture_output=True, text=True, check=True)  # fmt: skip
        results[name] = {**json.loads(done.stdout.strip().splitlines()[-1]),
                         "process_s": time.perf_counter() - started}  # fmt: skip
        print(name, results[name], flush=True)
    import torch
    import transformers

    base = results["trainer"]
    lines = [
        "# Whole fine-tuning runs: transformers.Trainer vs PrivateTrainer",
        "",
        f"torch {torch.__version__}, transformers {transformers.__version__}; CPU "
        f"({torch.get_num_threads()} threads); {steps} steps per run, each run a fresh "
        "process; see the docstring of `bench/hf_trainer.py` for the workload.",
        "",
        "| run | ms/step (median) | steps/s | x Trainer time | first step s | process s "
        "| peak MB | x Trainer memory |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in results.items():
        lines.append(
            f"| `{name}` | {r['median_ms']:.1f} | {r['steps_per_second']:.2f} | "
            f"{r['median_ms'] / base['median_ms']:.2f}x | {r['first_step_s']:.2f} | "
            f"{r['process_s']:.1f} | {r['peak_mb']:.0f} | {r['peak_mb'] / base['peak_mb']:.2f}x |"
        )
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hf_trainer.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "hf_trainer.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
