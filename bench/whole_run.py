"""Whole private training runs, each a script in a fresh process: dpfunc against Opacus 1.6.

Run from the repository root:

    .venv/bin/python bench/whole_run.py            # 5 pairs per workload; writes bench/whole_run.*
    .venv/bin/python bench/whole_run.py --quick    # 1 pair, 2 epochs: checks that it runs
    .venv/bin/python bench/whole_run.py --out DIR --pairs 3 --workloads digits

A run is what a user times: ``python script.py`` from start to exit, imports, set-up,
calibration, training and the epsilon after every epoch included. The scripts are
bench/runs/dpfunc_run.py and bench/runs/opacus_run.py (the same data, model, batch,
optimizer and privacy settings, each written as its library's examples write it); each
prints its own breakdown as JSON. The two libraries alternate (dpfunc first in even
pairs, Opacus first in odd ones) so that background load hits both alike; the table
gives the median over the pairs and the spread (min to max) of the wall time measured
from outside the process.

Workloads:

* ``digits``: scikit-learn's digits (1437 private images after a stratified 20% split),
  a GroupNorm CNN, a DataLoader batch of 128 (Poisson rate 1/12), 10 epochs, target
  epsilon 3 at delta 1e-5 (each library calibrates sigma with its default accountant:
  dpfunc PLD, Opacus PRV), SGD lr 0.5 momentum 0.9, clip norm 1.
* ``mnist``: Opacus' MNIST example configuration (SampleConvNet, SGD lr 0.1, sigma 1.0,
  C 1.0, batch 64, delta 1e-5, 10 epochs) on the first 6000 training images of
  Fashion-MNIST (same 28x28 format; MNIST itself is not on this machine), read from the
  Debian package in /var/cache/apt/archives; the 10000 test images give the accuracy.

Both use torch's CPU threads as given by ``--threads`` (default 1: tiny models run
fastest on one, and the machine is shared).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LIBRARIES = ("dpfunc", "opacus")
PHASES = ("imports", "setup", "calibration", "steps", "epsilon", "evaluation")
DEB = "/var/cache/apt/archives/dataset-fashion-mnist_*.deb"
FULL = {"pairs": 5, "epochs": None}  # None: each workload's 10 epochs
QUICK = {"pairs": 1, "epochs": 2}
NOTES = "<!-- notes: kept when the tables above are written again -->"


def fashion_mnist(folder: str) -> str:
    """Writes Fashion-MNIST from the Debian package as one ``torch.save`` file; its path."""
    import numpy as np
    import torch

    debs = sorted(glob.glob(DEB))
    if not debs:
        raise FileNotFoundError(f"no Fashion-MNIST package matches {DEB}")
    subprocess.run(["dpkg-deb", "-x", debs[-1], folder], check=True)
    root = os.path.join(folder, "usr/share/datasets/fashion-mnist")

    def idx(name: str, offset: int):
        with gzip.open(os.path.join(root, name)) as f:
            return torch.from_numpy(np.frombuffer(f.read(), np.uint8, offset=offset).copy())

    data = {
        "train_x": idx("train-images-idx3-ubyte.gz", 16).reshape(-1, 28, 28),
        "train_y": idx("train-labels-idx1-ubyte.gz", 8),
        "test_x": idx("t10k-images-idx3-ubyte.gz", 16).reshape(-1, 28, 28),
        "test_y": idx("t10k-labels-idx1-ubyte.gz", 8),
    }
    path = os.path.join(folder, "fashion_mnist.pt")
    torch.save(data, path)
    return path


# runs a script with dpfunc imported from another source tree (--dpfunc-src): the editable
# install's finder, which maps "dpfunc" to this checkout, is taken off the import path
LAUNCH = (
    "import runpy, sys; src, script = sys.argv[1], sys.argv[2]; "
    "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
    "sys.path.insert(0, src); sys.argv = sys.argv[2:]; runpy.run_path(script, run_name='__main__')"
)


def run_once(library: str, workload: str, args, data: str | None) -> dict:
    """One script in a fresh process; its JSON report plus the wall time seen from here."""
    script = str(HERE / "runs" / f"{library}_run.py")
    command = [sys.executable, script, "--workload", workload, "--threads", str(args.threads)]
    if library == "dpfunc" and args.dpfunc_src:
        command[1:2] = ["-c", LAUNCH, args.dpfunc_src, script]
    if args.epochs:
        command += ["--epochs", str(args.epochs)]
    if data is not None:
        command += ["--data", data]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{library} {workload} failed:\n{done.stderr[-3000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    report["wall"] = wall
    return report


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(runs: list[dict]) -> dict:
    """Median and spread of the wall time, the phases and the accuracy over the runs."""
    phases = {p: spread([r["phases"].get(p, 0.0) for r in runs]) for p in PHASES}
    later = [(r["phases"]["steps"] - r["first_step"]) / (r["steps"] - 1) * 1e3 for r in runs]
    return {
        "wall": spread([r["wall"] for r in runs]),
        "phases": phases,
        "first_step": spread([r["first_step"] for r in runs]),
        "step_ms": spread(later),
        "accuracy": spread([r["accuracy"] for r in runs]),
        "epsilon": runs[-1]["epsilon"],
        "noise_multiplier": runs[-1]["noise_multiplier"],
        "steps": runs[-1]["steps"],
        "accountant": runs[-1]["accountant"],
    }


def bench_workload(workload: str, args, data: str | None) -> dict:
    runs: dict[str, list] = {lib: [] for lib in LIBRARIES}
    ratios = []
    for pair in range(args.pairs):
        order = LIBRARIES if pair % 2 == 0 else LIBRARIES[::-1]
        got = {lib: run_once(lib, workload, args, data) for lib in order}
        for lib in LIBRARIES:
            runs[lib].append(got[lib])
        ratios.append(got["dpfunc"]["wall"] / got["opacus"]["wall"])
        print(f"  {workload} pair {pair + 1}: dpfunc {got['dpfunc']['wall']:.2f} s, "
              f"opacus {got['opacus']['wall']:.2f} s", flush=True)  # fmt: skip
    return {
        "summary": {lib: summarize(runs[lib]) for lib in LIBRARIES},
        "ratio": spread(ratios),
        "runs": runs,
    }


def table(workload: str, result: dict) -> list[str]:
    s, ratio = result["summary"], result["ratio"]
    d, o = s["dpfunc"], s["opacus"]
    lines = [
        f"## {workload}",
        "",
        f"dpfunc / Opacus wall time, paired: median **{ratio['median']:.2f}x** "
        f"(pairs {ratio['min']:.2f}x to {ratio['max']:.2f}x)",
        "",
        "| seconds (median, min-max) | dpfunc | Opacus |",
        "| --- | --- | --- |",
    ]

    def cell(x: dict, spec: str = ".2f") -> str:
        return f"{x['median']:{spec}} ({x['min']:{spec}}-{x['max']:{spec}})"

    lines.append(f"| **whole run (wall)** | **{cell(d['wall'])}** | **{cell(o['wall'])}** |")
    for phase in PHASES:
        lines.append(f"| {phase} | {cell(d['phases'][phase])} | {cell(o['phases'][phase])} |")
    lines.append(f"| first step (in steps) | {cell(d['first_step'])} | {cell(o['first_step'])} |")
    later = (cell(d["step_ms"], ".1f"), cell(o["step_ms"], ".1f"))
    lines.append(f"| ms per step after the first | {later[0]} | {later[1]} |")
    lines.append(f"| test accuracy | {cell(d['accuracy'], '.3f')} | {cell(o['accuracy'], '.3f')} |")
    lines += [
        f"| steps | {d['steps']} | {o['steps']} |",
        f"| noise multiplier | {d['noise_multiplier']:.4f} | {o['noise_multiplier']:.4f} |",
        f"| final epsilon | {d['epsilon']:.4f} | {o['epsilon']:.4f} |",
        f"| accountant | {d['accountant']} | {o['accountant']} |",
        "",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 pair of 2-epoch runs")
    parser.add_argument("--out", default=str(HERE), help="folder for whole_run.json and .md")
    parser.add_argument("--pairs", type=int, default=None)
    parser.add_argument("--workloads", default="digits,mnist")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--dpfunc-src", help="a folder holding another dpfunc/ to time (e.g. an earlier commit's)"
    )
    args = parser.parse_args()
    settings = dict(QUICK if args.quick else FULL)
    if args.pairs is not None:
        settings["pairs"] = args.pairs
    args.pairs, args.epochs = settings["pairs"], settings["epochs"]
    results = {
        "settings": {
            **settings,
            "threads": args.threads,
            "quick": args.quick,
            "dpfunc_src": args.dpfunc_src,
        },  # fmt: skip
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },  # fmt: skip
        "workloads": {},
    }
    with tempfile.TemporaryDirectory() as folder:
        for workload in args.workloads.split(","):
            data = fashion_mnist(folder) if workload == "mnist" else None
            results["workloads"][workload] = bench_workload(workload, args, data)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "whole_run.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [
        "# Whole runs as fresh processes: dpfunc against Opacus 1.6",
        "",
        f"Written by `bench/whole_run.py`{' --quick' if args.quick else ''}: "
        f"{args.pairs} pair(s) per workload, torch threads {args.threads}, "
        f"{os.cpu_count()} CPUs. See the script's docstring for what is run.",
        "",
    ]
    for workload, result in results["workloads"].items():
        lines += table(workload, result)
    md = out / "whole_run.md"
    notes = md.read_text().partition(NOTES)[2] if md.exists() else ""
    if notes:  # the hand-written reading of the figures below the marker is kept
        lines += [NOTES + notes.rstrip("\n")]
    md.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
