"""Private fine-tuning at the size people run it: PrivateTrainer against transformers.Trainer.

Run from the repository root:

    .venv/bin/python bench/hf_scale.py                 # the whole table (about an hour, 2 cores)
    .venv/bin/python bench/hf_scale.py --quick         # a smoke run at a small size
    .venv/bin/python bench/hf_scale.py --only corpus   # the corpus rows alone (or runs, long,
                                                       # or one run by name)

**Step time and memory.** The model is GPT-2 small's config (12 layers, ``n_embd`` 768,
12 heads, vocabulary 50257, 1024 positions, random initialisation, dropout 0) under
``peft.get_peft_model`` with ``LoraConfig(r=16, target_modules=["c_attn"])``; the data
are 2048 sequences of 200 to 512 tokens (T = 512), right-padded by the collator to the
micro-batch's longest, labels -100 at padding. ``plain`` is ``transformers.Trainer``
with ``per_device_train_batch_size=8``; ``private`` is ``PrivateTrainer`` with
``expected_batch_size=64`` and the same physical batch of 8 (a logical step is about 8
micro-batches), ``method="auto"``. Each runs in fp32 and in bf16 (``bf16=True``:
autocast), with activation checkpointing off and on (``gradient_checkpointing=True``).
The ratio compares time per example: one private step's time over the examples it
drew (the step after the first, which plans and checks each shape), against six plain
steps' over their 8 each (after two). Peak memory is the process's peak resident set
(``ru_maxrss``), the first private step's plan and per-example check included; the
steps' peak is the peak resident set of the measured steps alone (the kernel's
``VmHWM``, reset through ``/proc/self/clear_refs`` after the warm-up steps); every
run is a fresh process.

**Activation checkpointing at T = 1024.** The same model on 2048 sequences of 1024
tokens in fp32: ``plain`` one step with a batch of 4, ``private`` two steps with
``expected_batch_size=8`` in micro-batches of 4; peak resident memory with
checkpointing off and on, of the whole process and of the measured step alone (the
private run's second step).

**A corpus larger than memory.** 1,000,000 rows of 512 int32 tokens in an Arrow file
(``datasets.Dataset``, memory-mapped: 2 GB on disk), trained by ``PrivateTrainer`` on a
small GPT-2 (2 layers, ``n_embd`` 64) with ``expected_batch_size=64``, physical batch
8, with the usual padding collator: the resident set before the trainer is built,
before step 1 and after 20 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

CORPUS_DIR = "/tmp/dpfunc-bench-hf-scale-corpus"
RUNS = {
    f"{kind}_{precision}_{'ckpt' if ckpt else 'nockpt'}": (kind, precision, ckpt)
    for kind in ("plain", "private")
    for precision in ("fp32", "bf16")
    for ckpt in (False, True)
}
LONG = {  # activation checkpointing's memory at T = 1024: one step, fp32
    f"t1024_{kind}_{'ckpt' if ckpt else 'nockpt'}": (kind, "fp32", ckpt)
    for kind in ("plain", "private")
    for ckpt in (False, True)
}


def rss_mb() -> float:
    """The resident set now, from /proc (ru_maxrss is the peak)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def rss_parts_mb() -> dict:
    """The resident set's anonymous and file-backed parts (a memory-mapped corpus is the
    latter: pages the kernel can drop), from /proc/self/status."""
    parts = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:")):
                parts[line.split(":")[0]] = int(line.split()[1]) / 1024
    return {"anon_mb": parts.get("RssAnon", 0.0), "file_mb": parts.get("RssFile", 0.0)}


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak() -> None:
    """Resets the kernel's peak resident set (VmHWM) to the current one (Linux 4.0 on)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def steady_peak_mb() -> float:
    """The peak resident set since :func:`reset_peak` (VmHWM), in MB."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def collator():
    import torch

    def collate(features):
        longest = max(len(f["input_ids"]) for f in features)
        ids = torch.zeros(len(features), longest, dtype=torch.long)
        for i, f in enumerate(features):
            ids[i, : len(f["input_ids"])] = torch.as_tensor(f["input_ids"])
        mask = (ids != 0).long()
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100),
        }

    return collate


def one_run(name: str, quick: bool) -> dict:
    """Trains run ``name`` in this process; its time per example and its peak memory."""
    import warnings

    import peft
    import torch
    import transformers

    import dpfunc
    from dpfunc.integrations.transformers import PrivateTrainer

    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    kind, precision, ckpt = {**RUNS, **LONG}[name]
    long = name in LONG
    size = (64, 2, 2, 1000, 64) if quick else (768, 12, 12, 50257, 1024 if long else 512)
    width, layers, heads, vocab, longest = size
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=vocab, n_embd=width, n_layer=layers, n_head=heads,
                                     n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)  # fmt: skip
    lora = peft.LoraConfig(r=16, target_modules=["c_attn"], fan_in_fan_out=True)
    model = peft.get_peft_model(transformers.GPT2LMHeadModel(config), lora)
    g = torch.Generator().manual_seed(0)
    shortest = longest if long else longest * 2 // 5
    lengths = torch.randint(shortest, longest + 1, (2048,), generator=g)
    rows = [{"input_ids": torch.randint(1, vocab, (int(n),), generator=g).tolist()}
            for n in lengths]  # fmt: skip
    private = kind == "private"
    warmup, measured = (1, 1) if private else (2, 6)
    physical, expected = (4, 8) if long else (8, 64)
    if long:  # the private run's second step: its steps' peak without the first's plan
        warmup, measured = (1, 1) if private else (0, 1)
    stamps: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if len(stamps) == 2 * warmup:  # the measured steps' own peak, past the first's plan
                reset_peak()
            stamps.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    args = transformers.TrainingArguments(
        output_dir="/tmp/dpfunc-bench-hf-scale", per_device_train_batch_size=physical,
        max_steps=warmup + measured, learning_rate=1e-4, lr_scheduler_type="constant",
        max_grad_norm=0.0, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
        bf16=precision == "bf16", gradient_checkpointing=ckpt,
    )  # fmt: skip
    common = dict(model=model, args=args, train_dataset=rows, data_collator=collator(),
                  callbacks=[Clock()])  # fmt: skip
    sizes: list[int] = []
    if private:
        privacy = dpfunc.DPConfig(expected_batch_size=expected, clip_norm=1.0,
                                  noise_multiplier=1.0, delta=1e-5)  # fmt: skip
        trainer = PrivateTrainer(**common, privacy=privacy)
        backward = trainer.private.backward

        def counting(batch):
            sizes.append(batch.size)
            return backward(batch)

        trainer.private.backward = counting
    else:
        trainer = transformers.Trainer(**common)
    trainer.train()
    times = [end - begin for begin, end in zip(stamps[::2], stamps[1::2])]
    examples = sizes[warmup:] if private else [physical] * measured
    per_example = sum(times[warmup:]) / sum(examples)
    return {"seconds_per_example": per_example, "first_step_s": times[0],
            "median_step_s": statistics.median(times[warmup:]), "examples": sum(examples),
            "peak_mb": peak_mb(), "steady_peak_mb": steady_peak_mb()}  # fmt: skip


def corpus_run(quick: bool) -> dict:
    """RSS before and after 20 private steps on a memory-mapped corpus of 1M 512-token rows."""
    import warnings

    warnings.simplefilter("ignore")
    import datasets
    import numpy as np
    import torch
    import transformers

    import dpfunc
    from dpfunc.integrations.transformers import PrivateTrainer

    transformers.logging.set_verbosity_error()
    rows, tokens = (20_000, 512) if quick else (1_000_000, 512)
    path = f"{CORPUS_DIR}-{rows}"
    if not os.path.isdir(path):
        features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"))})

        def chunks():
            rng = np.random.default_rng(0)
            for _ in range(rows // 10_000):
                block = rng.integers(1, 1000, size=(10_000, tokens), dtype=np.int32)
                yield from ({"input_ids": row} for row in block)

        datasets.Dataset.from_generator(chunks, features=features).save_to_disk(path)
    corpus = datasets.load_from_disk(path)
    start, start_parts = rss_mb(), rss_parts_mb()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=2,
                                     n_positions=1024)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(
        output_dir="/tmp/dpfunc-bench-hf-scale", per_device_train_batch_size=8, max_steps=20,
        learning_rate=1e-4, max_grad_norm=0.0, save_strategy="no", report_to=[],
        use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    built = time.perf_counter()
    trainer = PrivateTrainer(model=model, args=args, train_dataset=corpus,
                             data_collator=collator(),
                             privacy=dpfunc.DPConfig(expected_batch_size=64, clip_norm=1.0,
                                                     noise_multiplier=1.0, delta=1e-7))  # fmt: skip
    build_s = time.perf_counter() - built
    before, before_parts = rss_mb(), rss_parts_mb()
    trainer.train()
    arrow_gb = sum(f.stat().st_size for f in Path(path).glob("*.arrow")) / 2**30
    return {"rows": rows, "tokens_per_row": tokens, "rss_start_mb": start,
            "rss_before_step_1_mb": before, "rss_after_20_steps_mb": rss_mb(),
            "trainer_build_s": build_s, "steps": trainer.private.steps_done,
            "arrow_gb": arrow_gb, "parts_start": start_parts, "parts_before_step_1": before_parts,
            "parts_after_20_steps": rss_parts_mb()}  # fmt: skip


def table(results: dict, corpus: dict | None) -> str:
    import torch
    import transformers

    lines = [
        "# Private fine-tuning at size: PrivateTrainer against transformers.Trainer",
        "",
        f"torch {torch.__version__}, transformers {transformers.__version__}; CPU "
        f"({torch.get_num_threads()} threads); each run a fresh process; the workload is in "
        "the docstring of `bench/hf_scale.py`.",
        "",
        "| precision | checkpointing | plain s/example | private s/example | x plain time "
        "| plain peak MB | private peak MB | x plain memory | plain steps' peak MB "
        "| private steps' peak MB | x plain | private first step s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def steady(run: dict) -> str:
        return f"{run['steady_peak_mb']:.0f}" if "steady_peak_mb" in run else "-"

    def steady_ratio(plain: dict, private: dict) -> str:
        if "steady_peak_mb" not in plain or "steady_peak_mb" not in private:
            return "-"
        return f"{private['steady_peak_mb'] / plain['steady_peak_mb']:.2f}x"

    for precision in ("fp32", "bf16"):
        for ckpt in ("nockpt", "ckpt"):
            plain = results.get(f"plain_{precision}_{ckpt}")
            private = results.get(f"private_{precision}_{ckpt}")
            if not plain or not private:
                continue
            lines.append(
                f"| {precision} | {'on' if ckpt == 'ckpt' else 'off'} | "
                f"{plain['seconds_per_example']:.3f} | {private['seconds_per_example']:.3f} | "
                f"{private['seconds_per_example'] / plain['seconds_per_example']:.2f}x | "
                f"{plain['peak_mb']:.0f} | {private['peak_mb']:.0f} | "
                f"{private['peak_mb'] / plain['peak_mb']:.2f}x | {steady(plain)} | "
                f"{steady(private)} | {steady_ratio(plain, private)} | "
                f"{private['first_step_s']:.1f} |"
            )
    reruns = [(n, r) for n, r in results.items() if "rerun_peak_mb" in r]
    if reruns:
        lines += [
            "",
            "The steps' peaks come from a second run of each configuration (a fresh process "
            "again, on a machine that was not quiet: its times are not used), whose process "
            "peaks were: "
            + ", ".join(f"{n} {r['rerun_peak_mb']:.0f} MB" for n, r in reruns)
            + ". In every second run the process peak was the measured steps' own; the first "
            "private runs peaked higher (the peak columns), by up to 4.6 GB, in their first "
            "step, whose plan and per-example check depend on the first Poisson batch.",
        ]
    long = {name: results[name] for name in LONG if name in results}
    if long:
        lines += [
            "",
            "Activation checkpointing at T = 1024 (fp32; the plain run one step of 4 "
            "sequences, the private one two steps of 8 expected in micro-batches of 4): peak "
            "resident memory of the process (the private one's first step, with the plan and "
            "the per-example check, included) and of the measured step alone, MB.",
            "",
            "| run | peak | off | on | saved |",
            "| --- | --- | ---: | ---: | ---: |",
        ]
        for kind in ("plain", "private"):
            off, on = long.get(f"t1024_{kind}_nockpt"), long.get(f"t1024_{kind}_ckpt")
            for key, what in (("peak_mb", "process"), ("steady_peak_mb", "the step")):
                if off and on and key in off and key in on:
                    saved = off[key] - on[key]
                    lines.append(
                        f"| {kind} | {what} | {off[key]:.0f} | {on[key]:.0f} | "
                        f"{saved:.0f} ({saved / off[key]:.0%}) |"
                    )
    gaps = Path(__file__).with_name("bf16_gap.jsonl")
    if gaps.exists():
        rows = [json.loads(line) for line in gaps.read_text().splitlines() if line.strip()]
        ran = [r for r in rows if not r["error"]]
        kinds = sorted({r["kind"] for r in rows})
        lines += [
            "",
            f"bf16 and the batched-loss check (`bench/bf16_gap.py`, `bench/bf16_gap.jsonl`): "
            f"{len(rows)} first steps of PrivateTrainer ({', '.join(kinds)}; widths "
            f"{', '.join(str(w) for w in sorted({r['width'] for r in rows}))}; autocast and "
            "bf16 parameters; random and after 20 non-private steps), each example's loss and "
            "gradient norm in the batched pass against the one-example pass: largest relative "
            f"gap {max(r['loss_gap'] for r in ran):.1e} (losses) and "
            f"{max(r['norm_gap'] for r in ran):.1e} (norms), against the bf16 tolerance "
            "2e-2; errors: "
            f"{sum(bool(r['error']) for r in rows)}.",
        ]
    if corpus:
        lines += [
            "",
            f"Corpus: {corpus['rows']:,} rows of {corpus['tokens_per_row']} tokens "
            f"({corpus['arrow_gb']:.2f} GB of Arrow, memory-mapped). Resident set: "
            f"{corpus['rss_start_mb']:.0f} MB with the corpus opened, "
            f"{corpus['rss_before_step_1_mb']:.0f} MB before step 1 (the trainer built in "
            f"{corpus['trainer_build_s']:.1f} s), {corpus['rss_after_20_steps_mb']:.0f} MB after "
            f"{corpus['steps']} steps"
            + (
                f" ({corpus['parts_after_20_steps']['anon_mb']:.0f} MB anonymous, "
                f"{corpus['parts_after_20_steps']['file_mb']:.0f} MB file-backed: pages of "
                "the libraries and of the memory-mapped corpus, which the kernel can drop)."
                if "parts_after_20_steps" in corpus
                else "."
            ),
        ]
        small = corpus.get("small")
        if small:
            lines.append(
                f"The same with {small['rows']:,} rows: {small['rss_start_mb']:.0f}, "
                f"{small['rss_before_step_1_mb']:.0f} and {small['rss_after_20_steps_mb']:.0f} MB"
                + (
                    f" ({small['parts_after_20_steps']['anon_mb']:.0f} MB anonymous, "
                    f"{small['parts_after_20_steps']['file_mb']:.0f} MB file-backed)."
                    if "parts_after_20_steps" in small
                    else "."
                )
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=["runs", "long", "corpus", *RUNS, *LONG],
                        help="one group of rows, or one run by name")  # fmt: skip
    parser.add_argument("--out", default=str(Path(__file__).parent))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a run, in this process
    parser.add_argument("--table", action="store_true", help="rewrite hf_scale.md from the json")
    options = parser.parse_args()
    if options.one:
        result = (
            corpus_run(options.quick)
            if options.one == "corpus"
            else one_run(options.one, options.quick)
        )
        print(json.dumps(result))
        return
    out = Path(options.out)
    stored = out / "hf_scale.json"
    saved = json.loads(stored.read_text()) if stored.exists() and options.only else {}
    if options.table:
        saved = json.loads(stored.read_text())
        runs = {k: v for k, v in saved.items() if k != "corpus"}
        (out / "hf_scale.md").write_text(text := table(runs, saved.get("corpus")))
        print(text)
        return
    names = list(RUNS) if options.only in (None, "runs") else []
    names += list(LONG) if options.only in (None, "long") else []
    names += ["corpus"] if options.only in (None, "corpus") else []
    names += [options.only] if options.only in {**RUNS, **LONG} else []
    for name in names:
        command = [sys.executable, __file__, "--one", name] + (["--quick"] if options.quick else [])
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
        saved[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(name, saved[name], flush=True)
        if not options.quick:  # kept as it comes: a long table survives an interruption
            out.mkdir(parents=True, exist_ok=True)
            stored.write_text(json.dumps(saved, indent=2) + "\n")
    runs = {k: v for k, v in saved.items() if k != "corpus"}
    text = table(runs, saved.get("corpus"))
    if not options.quick:
        (out / "hf_scale.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
