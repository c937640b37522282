"""The documented way to compile a step against a plain ``torch.compile`` of it, on HF models.

Run from the repository root (about 10 minutes a workload on 2 cores):

    .venv/bin/python bench/door.py                         # writes bench/door.json and .md
    .venv/bin/python bench/door.py --before ../old-checkout # also that code's door

Each figure comes from a fresh process with an empty inductor cache, 2 torch threads,
on bench/hf.py's workloads (``bert_masked``: masked BERT, one loss per example;
``gpt2_labels``: GPT-2 called with ``labels=``), each step as bench/harness.py builds it
(``make_train_step(..., model=model)``, method "auto", SGD, the noise drawn in the step):

- ``nonprivate``: the eager non-private step (the denominator);
- ``plain``: ``torch.compile(step, fullgraph=True)`` with dpfunc's Dynamo settings
  (``dpfunc._compiling.compile_fullgraph``; a bare ``torch.compile`` fails on GPT-2's
  logger), the whole ``step(state, batch, mask, noise)`` one graph;
- ``door``: ``step.compile()`` (what ``compile=True`` and ``Trainer(compile=True)`` do),
  then ``step(state, batch, mask, noise)``;
- ``door_before``: the same, importing dpfunc from ``--before`` (an earlier checkout);
- ``nonprivate_compiled``: the non-private step with its forward and loss under
  ``torch.compile`` (bench/harness.py's), whose first call is the bound of the DP step's
  first compile (at most 1.5x).

``--modes`` runs only the modes named and merges them into an existing door.json.

A process times its first call (the compile, from a cold cache), where that call's time
goes (``torch._dynamo.utils.compilation_time_metrics``, as bench/compile_time.py reads
them) and how many graphs Dynamo compiled, then the median of STEPS steps after WARMUP.
Modes alternate, REPEATS times each; the table gives the median
over the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKLOADS = ("bert_masked", "gpt2_labels")
MODES = ("nonprivate", "plain", "door", "nonprivate_compiled")
WARMUP, STEPS, REPEATS = 3, 30, 2
PHASE_LABELS = ("Dynamo tracing", "AOTAutograd + Inductor (backend)", "Inductor codegen",
                "C++ compiles (summed over workers)", "waiting for C++ workers")  # fmt: skip


def measure(work: str, mode: str) -> dict:
    """One process's figures (run in the child)."""
    sys.path.insert(0, str(HERE))
    import torch

    torch.set_num_threads(2)
    import harness
    import hf

    torch.manual_seed(0)
    model, x, y = getattr(hf, work)()
    criterion = hf.ModelLoss() if work == "gpt2_labels" else None
    forward = hf.labels_loss if work == "gpt2_labels" else hf.logits
    if mode.startswith("nonprivate"):
        compiled = mode == "nonprivate_compiled"
        step, _ = harness.nonprivate(
            model, x, y, compile=compiled, forward=forward, criterion=criterion
        )
    else:
        step, _ = harness.dpfunc_step(
            model, x, y, "auto", compile=mode == "plain", forward=forward, criterion=criterion
        )
        if mode.startswith("door"):
            step.train_step.compile()
    from compile_time import PHASES  # where a first call's time goes, as compile_time.py reads it
    from torch._dynamo.utils import compilation_time_metrics, counters

    started = time.perf_counter()
    step()
    first = time.perf_counter() - started
    phases = {label: sum(compilation_time_metrics.get(key, [])) for label, key in PHASES.items()}
    graphs = counters["stats"]["unique_graphs"]
    for _ in range(WARMUP):
        step()
    times = []
    for _ in range(STEPS):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return {
        "first_s": first,
        "median_ms": statistics.median(times) * 1e3,
        "phases_s": phases,
        "graphs": graphs,
    }


def launch(work: str, mode: str, before: str | None) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TMPDIR=cache)
        if mode == "door_before":
            env["PYTHONPATH"] = before
        command = [sys.executable, __file__, "--child", work, mode]
        out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
        if out.returncode != 0:
            raise RuntimeError(f"{work} {mode} failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])


def table(results: dict) -> str:
    lines = [
        "# step.compile() against a plain torch.compile of the step",
        "",
        f"Fresh processes, cold inductor cache, 2 torch threads, {os.cpu_count()} CPUs; each "
        f"figure the median of {REPEATS} processes, each the median of {STEPS} steps after "
        f"{WARMUP} (x: over the eager non-private step) and its first call (the compile; "
        "x: over the plain compile's). Generated by `bench/door.py`"
        + (f"; door_before: dpfunc at {results['before_code']}." if results.get("before_code")
           else "."),
        "",
        "| workload | mode | ms / step | x non-private | first call (s) | x plain's first "
        "| x non-private's first |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]  # fmt: skip
    for work, modes in results["workloads"].items():
        med = {m: statistics.median(r["median_ms"] for r in runs) for m, runs in modes.items()}
        first = {m: statistics.median(r["first_s"] for r in runs) for m, runs in modes.items()}
        base = first.get("nonprivate_compiled")
        for m in modes:
            compile_s = "- | - | -" if m == "nonprivate" else (
                f"{first[m]:.1f} | {first[m] / first['plain']:.2f}x | "
                + (f"{first[m] / base:.2f}x" if base else "-")
            )  # fmt: skip
            ratio = med[m] / med["nonprivate"]
            lines.append(f"| {work} | {m} | {med[m]:.1f} | {ratio:.2f}x | {compile_s} |")
    lines += [
        "",
        "Where the first call's time goes (seconds, median over the processes; graphs: "
        "Dynamo's unique graphs):",
        "",
        "| workload | mode | first call | " + " | ".join(PHASE_LABELS) + " | graphs |",
        "| --- | --- | ---: | " + " | ".join("---:" for _ in PHASE_LABELS) + " | ---: |",
    ]
    for work, modes in results["workloads"].items():
        for m, runs in modes.items():
            if m == "nonprivate" or not all("phases_s" in r for r in runs):
                continue
            cells = [
                f"{statistics.median(r['phases_s'][p] for r in runs):.1f}" for p in PHASE_LABELS
            ]
            first_s = statistics.median(r["first_s"] for r in runs)
            graphs = sorted({r["graphs"] for r in runs})
            lines.append(
                f"| {work} | {m} | {first_s:.1f} | " + " | ".join(cells) + f" | {graphs} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default=None, help="an earlier checkout's root")
    parser.add_argument("--out", default=str(HERE))
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    parser.add_argument("--modes", nargs="*", default=None, help="only these; merged")
    parser.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child)))
        return
    modes = MODES + (("door_before",) if args.before else ())
    results: dict = {"workloads": {w: {} for w in args.workloads}}
    if args.modes:
        modes = tuple(args.modes)
        results = json.loads(Path(args.out, "door.json").read_text())
    for work in args.workloads:
        results["workloads"].setdefault(work, {}).update({m: [] for m in modes})
    if args.before:
        code = subprocess.run(["git", "-C", args.before, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip()  # fmt: skip
        results["before_code"] = code or args.before
    for work in args.workloads:
        for _ in range(REPEATS):
            for mode in modes:
                results["workloads"][work][mode].append(launch(work, mode, args.before))
                print(work, mode, results["workloads"][work][mode][-1], flush=True)
    Path(args.out, "door.json").write_text(json.dumps(results, indent=1))
    Path(args.out, "door.md").write_text(table(results))
    print(table(results))


if __name__ == "__main__":
    main()
