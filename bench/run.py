"""Benchmark one training step: plain PyTorch vs dpfunc vs Opacus, on four small models.

Run from the repository root:

    .venv/bin/python bench/run.py            # full run (6-10 minutes on 2 CPU cores)
    .venv/bin/python bench/run.py --quick    # smoke run (< 2 minutes; skips torch.compile)
    .venv/bin/python bench/run.py --out DIR  # write DIR/results.json and DIR/results.md

For every workload, each method gets its own deep copy of one initialised model and
the same fixed batch. After warm-up (torch.compile happens there; its time is reported
separately) the methods are timed round-robin, one step each per repeat, so drift hits
them alike; the table reports the median over the repeats during which other processes
left the CPUs alone (or over all, when too few were quiet). A step is the whole update:
forward, loss, backward, clipping and noise (DP methods), optimizer step. Peak memory is
the extra memory one step needs above what the process held right before it: on CPU the
growth of the resident set (peak reset through /proc/self/clear_refs), on CUDA
torch.cuda.max_memory_allocated. Everything runs in float32 with torch's default threads.

The workloads, the methods, the timing, the memory measurement and the per-workload tables
live in bench/harness.py, which the other benchmarks share; adding a method is one entry
in its METHODS. This script adds the targets for dpfunc's default step and their table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# A fresh inductor cache for this run, so "compile s" is a cold compile (set before torch loads).
FRESH_CACHE = None
if __name__ == "__main__" and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    FRESH_CACHE = os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp("-inductor")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/harness.py, from anywhere
import harness  # noqa: E402  (bench/harness.py: workloads, builders, measuring, tables)

# --- settings -----------------------------------------------------------------

# dpfunc's default step: make_train_step(..., model=model) compiled; eager where compile fails
DEFAULT = ("dpfunc_ghost_compiled", "dpfunc_ghost")
# targets for the default step: time over non-private, time over Opacus' ghost mode, memory
TARGETS = {
    "mlp": {"x_nonprivate": 1.3, "x_opacus_ghost": 1.0},
    "cnn": {"x_nonprivate": 1.2, "x_opacus_ghost": 1.0},
    "transformer": {"x_nonprivate": 2.5},
    "lstm": {},
    "digits_cnn": {},
}
MEMORY_TARGET = 2.0  # peak memory of the default step over the non-private step, every workload
ANALYSIS = Path(__file__).with_name("analysis.md")  # notes by hand: profiles behind the numbers


# --- reporting ----------------------------------------------------------------


def default_step(methods: dict) -> str | None:
    """The method that measured dpfunc's default step on a workload, if any ran.

    The eager fallback stands in only where compiling failed, not where it was skipped.
    """
    compiled = methods.get(DEFAULT[0], {})
    if "median_ms" in compiled:
        return DEFAULT[0]
    if compiled.get("status", "").startswith("unsupported") and "median_ms" in methods.get(
        DEFAULT[1], {}
    ):
        return DEFAULT[1]
    return None


def targets_table(results: dict) -> list[str]:
    """One row per workload: the default step's ratios against the targets."""
    lines = [
        "## Targets for the default step",
        "",
        "The default step is `make_train_step(..., model=model)` (ghost clipping where it "
        "covers the model, vmap elsewhere) under `torch.compile(fullgraph=True)`, or eager "
        "where Dynamo cannot trace the model. Targets: time over the eager non-private step, "
        f"time over `opacus_ghost`, and peak memory at most {MEMORY_TARGET:g}x non-private.",
        "",
        "| workload | default step | ms/step | x non-private (target) | x opacus_ghost (target) "
        "| x memory (target) | all met |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]

    def check(value, limit):
        if value is None:
            return "-", True
        if limit is None:
            return f"{value:.2f}x", True
        return f"{value:.2f}x (<= {limit:g}x)", value <= limit

    for name, info in results["workloads"].items():
        methods, target = info["methods"], TARGETS.get(name, {})
        method = default_step(methods)
        if method is None or "median_ms" not in methods.get("nonprivate", {}):
            why = methods.get(DEFAULT[0], {}).get("status", "not run")
            lines.append(f"| {name} | - | - | - | - | - | not measured ({why}) |")
            continue
        v, base = methods[method], methods["nonprivate"]
        ghost = methods.get("opacus_ghost", {}).get("median_ms")
        cells = [
            check(v["median_ms"] / base["median_ms"], target.get("x_nonprivate")),
            check(v["median_ms"] / ghost if ghost else None, target.get("x_opacus_ghost")),
            check(
                v["peak_mb"] / base["peak_mb"]
                if v.get("peak_mb") and base.get("peak_mb")
                else None,
                MEMORY_TARGET,
            ),
        ]
        met = "yes" if all(ok for _, ok in cells) else "**no**"
        lines.append(
            f"| {name} | `{method}` | {v['median_ms']:.2f} | "
            + " | ".join(text for text, _ in cells)
            + f" | {met} |"
        )
    return lines


def markdown(results: dict) -> str:
    lines = harness.header(results, "dpfunc step benchmark") + targets_table(results) + [""]
    if ANALYSIS.exists():
        lines += [ANALYSIS.read_text().strip(), ""]
    return "\n".join(lines + harness.auto_table(results) + harness.workload_tables(results))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repeats, no torch.compile")
    parser.add_argument("--out", default="bench", help="folder for results.json and results.md")
    parser.add_argument("--workloads", default=",".join(harness.WORKLOADS), help="comma-separated")
    parser.add_argument("--methods", default=",".join(harness.METHODS), help="comma-separated")
    args = parser.parse_args()
    settings = harness.QUICK if args.quick else harness.FULL
    workloads, methods = args.workloads.split(","), args.methods.split(",")
    for name in workloads + methods:
        if name not in harness.WORKLOADS and name not in harness.METHODS:
            parser.error(f"unknown workload or method {name!r}")
    skip = {m: "skipped: --quick does not compile" for m in harness.COMPILED} if args.quick else {}

    start = time.perf_counter()
    results = harness.new_results(args.quick, settings)
    for name in workloads:
        print(f"{name}:", flush=True)
        results["workloads"][name] = harness.bench_workload(name, methods, skip=skip, **settings)
    results["total_s"] = time.perf_counter() - start
    results["machine"]["load_average_at_end"] = os.getloadavg()
    if FRESH_CACHE:
        shutil.rmtree(FRESH_CACHE, ignore_errors=True)
    harness.write_results(results, Path(args.out), "results", markdown(results))


if __name__ == "__main__":
    main()
