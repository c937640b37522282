"""Benchmark correlated noise: the step's time and memory for b = 1, 4 and 16 bands.

Run from the repository root:

    .venv/bin/python bench/correlated.py            # writes bench/correlated.json and .md
    .venv/bin/python bench/correlated.py --out DIR

The workload: an MLP of about 1.0M float32 parameters (784 -> 1000 -> 215 -> 10, tanh)
on a fixed batch of 64 random examples, ``make_train_step`` on the vmap path with SGD. For each
band count the step is timed ``REPEATS`` times round-robin in one process, after
``WARMUP`` untimed steps, eager and compiled (``torch.compile(fullgraph=True)``), with
the noise tree drawn outside the timing as the Trainer does. As in ``harness.py``, a repeat
is quiet if other processes took under ``QUIET_LOAD`` cores meanwhile, and with at
least ``MIN_QUIET`` quiet repeats only those count. Ratios are against ``bands=1``
(DP-SGD), the same code without the recurrence.

Memory: the recurrence keeps ``b - 1`` correlated draws, one stacked tensor per
parameter in the train state: ``(b - 1) * 4`` bytes per float32 parameter, exactly.
The table also gives the peak resident memory of the training steps: a child process
per band count (so the allocator's caches do not carry over) builds the problem,
resets the kernel's peak-RSS mark (``/proc/self/clear_refs``), runs 20 eager steps and
reads the peak (``VmHWM``) back, minus the resident memory before the steps.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere
from harness import MIN_QUIET, QUIET_LOAD, cpu_ticks, other_cores  # noqa: E402

import dpfunc  # noqa: E402

BANDS = (1, 4, 16)  # band counts; 1 is DP-SGD
BATCH = 64  # examples per step (one micro-batch)
WARMUP = 3  # untimed steps per configuration
REPEATS = 21  # timed steps per configuration, round-robin
MEMORY_STEPS = 20  # steps the child process runs before its peak memory is read


def problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 1000), nn.Tanh(), nn.Linear(1000, 215), nn.Tanh(),
                          nn.Linear(215, 10))  # fmt: skip
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        x, y = example
        return F.cross_entropy(functional_call(model, (p, buffers), (x[None],)), y[None])

    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(BATCH, 784, generator=g), torch.randint(10, (BATCH,), generator=g))
    return params, loss_fn, batch


def make_step(loss_fn, bands: int):
    return dpfunc.make_train_step(
        loss_fn, dpfunc.optim.sgd(lr=0.1), clip_norm=1.0, noise_multiplier=1.0,
        expected_batch_size=BATCH, bands=bands, method="vmap",
    )  # fmt: skip


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024  # kB -> MiB


def peak_memory(bands: int) -> None:
    """The child process: prints the peak RSS of MEMORY_STEPS eager steps over the start, MiB."""
    params, loss_fn, batch = problem()
    step = make_step(loss_fn, bands)
    secret = dpfunc.secret_seed()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = _status_mib("VmRSS")
    state = step.init(params)
    for t in range(MEMORY_STEPS):
        noise = dpfunc.standard_normal_like(params, seed=secret, step=t)
        state, _ = step(state, batch, None, noise)
    print(_status_mib("VmHWM") - before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench", help="folder for correlated.json and .md")
    parser.add_argument("--peak-memory", type=int, help=argparse.SUPPRESS)  # the child
    args = parser.parse_args()
    if args.peak_memory is not None:
        peak_memory(args.peak_memory)
        return
    params, loss_fn, batch = problem()
    size = sum(p.numel() for p in params.values())
    secret = dpfunc.secret_seed()
    runs, states = {}, {}
    compile_s = {}
    for bands in BANDS:
        step = make_step(loss_fn, bands)
        runs[f"eager, b={bands}"] = step
        started = time.perf_counter()
        compiled = torch.compile(step, fullgraph=True)
        noise = dpfunc.standard_normal_like(params, seed=secret, step=0)
        compiled(step.init(params), batch, None, noise)  # the first call compiles
        compile_s[bands] = time.perf_counter() - started
        runs[f"compiled, b={bands}"] = compiled
        states[f"eager, b={bands}"] = states[f"compiled, b={bands}"] = step.init(params)
    order = list(runs)
    counter = {name: 0 for name in runs}

    def once(name: str) -> float:
        noise = dpfunc.standard_normal_like(params, seed=secret, step=counter[name])
        counter[name] += 1
        started = time.perf_counter()
        states[name], _ = runs[name](states[name], batch, None, noise)
        return (time.perf_counter() - started) * 1e3

    for _ in range(WARMUP):
        for name in order:
            once(name)
    times = {name: [] for name in order}
    loads = []
    for r in range(REPEATS):
        ticks, start = cpu_ticks(), time.perf_counter()
        for name in order[r % len(order) :] + order[: r % len(order)]:
            times[name].append(once(name))
        loads.append(other_cores(ticks, cpu_ticks(), time.perf_counter() - start))
    quiet = [r for r, load in enumerate(loads) if load is None or load < QUIET_LOAD]
    used = quiet if len(quiet) >= MIN_QUIET else list(range(REPEATS))
    medians = {name: statistics.median(t[r] for r in used) for name, t in times.items()}
    peaks = {}
    for bands in BANDS:
        child = subprocess.run(
            [sys.executable, __file__, "--peak-memory", str(bands)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        peaks[bands] = float(child.stdout.strip().splitlines()[-1])
    which = (
        f"the {len(used)} quiet repeats of {REPEATS}"
        if len(used) < REPEATS
        else f"all {REPEATS} repeats ({len(quiet)} quiet)"
    )
    rows = []
    for bands in BANDS:
        eager, compiled = medians[f"eager, b={bands}"], medians[f"compiled, b={bands}"]
        rows.append(
            f"| {bands} | {eager:.1f} | {eager / medians['eager, b=1']:.3f}x | {compiled:.1f} | "
            f"{compiled / medians['compiled, b=1']:.3f}x | {(bands - 1) * size * 4 / 2**20:.1f} | "
            f"{peaks[bands]:.0f} (+{peaks[bands] - peaks[1]:.0f}) | {compile_s[bands]:.0f} |"
        )
    lines = [
        f"# Correlated noise: step time and memory, {size:,} parameters, batch {BATCH}",
        "",
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; {WARMUP} warm-up steps, then medians over {which}. "
        "Ratios against b = 1 (DP-SGD) in the same mode.",
        "",
        "| bands | eager ms | vs b=1 | compiled ms | vs b=1 | history MiB | step peak MiB "
        "| compile s |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *rows,
    ]
    report = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "parameters": size, "batch": BATCH, "ms": medians, "compile_s": compile_s,
        "history_mib": {b: (b - 1) * size * 4 / 2**20 for b in BANDS}, "peak_rss_mib": peaks,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "repeats": REPEATS,
        "quiet_repeats": len(quiet), "used_repeats": len(used), "other_cores_per_repeat": loads,
        "samples_ms": {name: [round(t, 3) for t in ts] for name, ts in times.items()},
    }  # fmt: skip
    (out / "correlated.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "correlated.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
