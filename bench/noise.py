"""Benchmark the noise draw: torch.randn against dpfunc's default and secure draws.

Run from the repository root:

    .venv/bin/python bench/noise.py            # writes bench/noise.json and bench/noise.md
    .venv/bin/python bench/noise.py --out DIR

One process, one tree of 1,000,000 parameters shaped like an MLP's (784 x 1000 and
215 x 1000 weights, a bias of 1000), float32 unless a row says float64. Each draw is
timed ``REPEATS`` times round-robin after ``WARMUP`` untimed draws; the table gives the
median and the ratio to ``torch.randn`` of the same shapes from a seeded generator.
Target: the secure draw of the float32 tree at most 3x ``torch.randn`` on a CPU.
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
    times: dict[str, list[float]] = {name: [] for name in draws}
    for _ in range(WARMUP):
        for draw in draws.values():
            draw()
    for _ in range(REPEATS):
        for name, draw in draws.items():
            started = time.perf_counter()
            draw()
            times[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    reference = medians["torch.randn (reference)"]
    ratio = {name: m / reference for name, m in medians.items()}
    secure = ratio["standard_normal_like (secure)"]
    lines = [
        "# Noise draw, 1,000,000 parameters",
        "",
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; median of {REPEATS} draws after {WARMUP} warm-up draws.",
        "",
        "| draw | ms | vs torch.randn |",
        "| --- | ---: | ---: |",
        *(f"| {name} | {medians[name]:.2f} | {ratio[name]:.2f}x |" for name in draws),
        "",
        f"Target: secure draw of the float32 tree at most {TARGET:.0f}x torch.randn: "
        f"{'met' if secure <= TARGET else 'NOT met'} ({secure:.2f}x).",
    ]
    report = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "noise.json").write_text(
        json.dumps({"ms": medians, "ratio_to_randn": ratio, "target": TARGET}, indent=1) + "\n"
    )
    (out / "noise.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
