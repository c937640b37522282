"""Benchmark the noise draw: torch.randn against dpfunc's default and secure draws.

Run from the repository root:

    .venv/bin/python bench/noise.py            # writes bench/noise.json and bench/noise.md
    .venv/bin/python bench/noise.py --out DIR

One process, one tree of 1,000,000 parameters shaped like an MLP's (784 x 1000 and
215 x 1000 weights, a bias of 1000), float32 unless a row says float64. Each draw is
timed ``REPEATS`` times round-robin (the starting draw rotated) after ``WARMUP`` untimed
draws, with torch's default threads; as in ``harness.py``, a repeat is quiet if other
processes took under ``QUIET_LOAD`` cores meanwhile, and with at least ``MIN_QUIET``
quiet repeats the statistics use only those. The table gives the median, the fastest
draw and the median's ratio to ``torch.randn`` of the same shapes from a seeded
generator. Target: the secure draw of the float32 tree at most 3x ``torch.randn`` on a
CPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere
from harness import MIN_QUIET, QUIET_LOAD, cpu_ticks, other_cores  # noqa: E402

import dpfunc  # noqa: E402

SHAPES = {"w1": (1000, 784), "b1": (1000,), "w2": (215, 1000)}  # 1,000,000 parameters
WARMUP = 3  # untimed draws per method
REPEATS = 31  # timed draws per method, round-robin
TARGET = 3.0  # secure float32 draw / torch.randn


def tree(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(shape, dtype=dtype) for k, shape in SHAPES.items()}


def methods() -> dict:
    float32, float64 = tree(torch.float32), tree(torch.float64)
    generator = torch.Generator().manual_seed(0)
    secret = dpfunc.secret_seed()
    counter = iter(range(10**9))
    return {
        "torch.randn (reference)": lambda: {
            k: torch.randn(v.shape, generator=generator) for k, v in float32.items()
        },
        "standard_normal_like (default)": lambda: dpfunc.standard_normal_like(
            float32, seed=secret, step=next(counter)
        ),
        "standard_normal_like (secure)": lambda: dpfunc.standard_normal_like(
            float32, seed=secret, step=next(counter), secure=True
        ),
        "standard_normal_like (secure, float64 tree)": lambda: dpfunc.standard_normal_like(
            float64, seed=secret, step=next(counter), secure=True
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench", help="folder for noise.json and noise.md")
    args = parser.parse_args()
    draws = methods()
    order = list(draws)
    times: dict[str, list[float]] = {name: [] for name in draws}
    loads = []
    for _ in range(WARMUP):
        for draw in draws.values():
            draw()
    for r in range(REPEATS):
        ticks, start = cpu_ticks(), time.perf_counter()
        for name in order[r % len(order) :] + order[: r % len(order)]:
            started = time.perf_counter()
            draws[name]()
            times[name].append((time.perf_counter() - started) * 1e3)
        loads.append(other_cores(ticks, cpu_ticks(), time.perf_counter() - start))
    quiet = [r for r, load in enumerate(loads) if load is None or load < QUIET_LOAD]
    used = quiet if len(quiet) >= MIN_QUIET else list(range(REPEATS))
    medians = {name: statistics.median(t[r] for r in used) for name, t in times.items()}
    fastest = {name: min(t) for name, t in times.items()}
    reference = medians["torch.randn (reference)"]
    ratio = {name: m / reference for name, m in medians.items()}
    secure = ratio["standard_normal_like (secure)"]
    if len(used) < REPEATS:
        which = f"the {len(used)} quiet repeats of {REPEATS}"
    elif len(quiet) < MIN_QUIET:
        which = f"all {REPEATS} repeats (busy machine: only {len(quiet)} quiet; inflated)"
    else:
        which = f"all {REPEATS} repeats (all quiet)"
    lines = [
        "# Noise draw, 1,000,000 parameters",
        "",
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; {WARMUP} warm-up draws, then medians over {which}.",
        "",
        "| draw | ms (median) | min ms | vs torch.randn |",
        "| --- | ---: | ---: | ---: |",
        *(
            f"| {name} | {medians[name]:.2f} | {fastest[name]:.2f} | {ratio[name]:.2f}x |"
            for name in draws
        ),
        "",
        f"Target: secure draw of the float32 tree at most {TARGET:.0f}x torch.randn: "
        f"{'met' if secure <= TARGET else 'NOT met'} ({secure:.2f}x).",
    ]
    report = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "ms": medians, "min_ms": fastest, "ratio_to_randn": ratio, "target": TARGET,
        "met": secure <= TARGET, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "repeats": REPEATS, "quiet_repeats": len(quiet), "used_repeats": len(used),
        "other_cores_per_repeat": loads,
        "samples_ms": {name: [round(t, 3) for t in ts] for name, ts in times.items()},
    }  # fmt: skip
    (out / "noise.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "noise.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
