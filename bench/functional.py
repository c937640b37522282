"""Benchmark the pure pieces: dpfunc's vmap step against the same step written by hand.

Run from the repository root:

    .venv/bin/python bench/functional.py            # writes bench/functional.json and .md
    .venv/bin/python bench/functional.py --quick    # fewer repeats
    .venv/bin/python bench/functional.py --out DIR

The hand-written step is what a user writes with ``torch.func`` alone:
``vmap(grad(loss))``, flat norms in the gradients' dtype, clip factors
``min(1, C / norm)``, one ``einsum`` per leaf for the clipped sum, the same
noise tree, the average and SGD. dpfunc's step is ``make_train_step`` without
``model=`` (per-example gradients from vmap, norms accumulated in float64,
NaN-safe clipped sum). Both take the same noise tree, so their parameters
must agree (checked to 1e-5). Times are medians of round-robin repeats in one
process (``bench/harness.py``'s machinery); peak memory is the extra resident
memory one step needs, for the eager and the compiled vmap step.
Target: dpfunc eager at most 1.15x the hand-written step.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import harness  # noqa: E402  (bench/harness.py: workloads, timing and memory helpers)

import dpfunc  # noqa: E402

WORKLOADS = ("mlp", "cnn")
TARGET = 1.15  # dpfunc eager / hand-written eager
FULL = {"warmup": 3, "repeats": 15}
QUICK = {"warmup": 2, "repeats": 5}
LR, CLIP_NORM, NOISE_MULTIPLIER = harness.LR, harness.CLIP_NORM, harness.NOISE_MULTIPLIER


def loss_of(model, buffers):
    def loss_fn(p, example):
        xi, yi = example
        out = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        return F.cross_entropy(out, yi.unsqueeze(0))

    return loss_fn


def noise_for(params, step):
    return dpfunc.standard_normal_like(params, seed=0, step=step)  # public: a benchmark


def hand_written(model, x, y):
    params, buffers = dpfunc.functionalize(model)
    per_example = vmap(grad(loss_of(model, buffers)), in_dims=(None, 0))
    box = {"params": params, "i": 0}

    def step():
        p = box["params"]
        grads = per_example(p, (x, y))
        norms = torch.stack(
            [torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads.values()]
        ).norm(dim=0)
        factors = torch.clamp(CLIP_NORM / (norms + 1e-12), max=1.0)
        noise = noise_for(p, box["i"])
        summed = {k: torch.einsum("b,b...->...", factors, g) for k, g in grads.items()}
        std = NOISE_MULTIPLIER * CLIP_NORM
        box["params"] = {k: p[k] - LR * (summed[k] + std * noise[k]) / len(x) for k in p}
        box["i"] += 1

    return step, lambda: box["params"]


def dpfunc_vmap(model, x, y, compile=False):
    params, buffers = dpfunc.functionalize(model)
    train_step = dpfunc.make_train_step(
        loss_of(model, buffers),
        dpfunc.optim.sgd(lr=LR),
        clip_norm=CLIP_NORM,
        noise_multiplier=NOISE_MULTIPLIER,
        expected_batch_size=len(x),
    )
    call = torch.compile(train_step, fullgraph=True) if compile else train_step
    mask = torch.ones(len(x))
    box = {"state": train_step.init(params), "i": 0}

    def step():
        noise = noise_for(box["state"].params, box["i"])
        box["state"], _ = call(box["state"], (x, y), mask, noise)
        box["i"] += 1

    return step, lambda: box["state"].params


METHODS = {
    "hand_written": hand_written,
    "dpfunc_vmap": dpfunc_vmap,
    "dpfunc_vmap_compiled": lambda m, x, y: dpfunc_vmap(m, x, y, compile=True),
}


def bench(name: str, warmup: int, repeats: int) -> dict:
    torch.manual_seed(harness.SEED)
    model, x, y = harness.WORKLOADS[name]()
    built = {m: METHODS[m](copy.deepcopy(model), x, y) for m in METHODS}
    first = {}
    for method, (step, _) in built.items():
        first[method] = harness.timed(step)
    params = {m: get() for m, (_, get) in built.items()}  # after exactly one step each
    difference = max(
        float((params["dpfunc_vmap"][k] - params["hand_written"][k]).abs().max())
        for k in params["hand_written"]
    )
    for _ in range(warmup - 1):
        for step, _ in built.values():
            step()
    samples = {m: [] for m in built}
    order = list(built)
    for r in range(repeats):
        for method in order[r % len(order) :] + order[: r % len(order)]:
            samples[method].append(harness.timed(built[method][0]) * 1000)
    ms = {m: statistics.median(s) for m, s in samples.items()}
    memory = {m: harness.peak_mb(built[m][0]) for m in built}
    return {
        "batch_size": len(x),
        "params": sum(p.numel() for p in model.parameters()),
        "ms": ms,
        "first_call_s": first,
        "peak_mb": memory,
        "ratio_to_hand_written": {m: ms[m] / ms["hand_written"] for m in ms},
        "max_abs_difference_after_one_step": difference,
    }


def markdown(results: dict) -> str:
    lines = [
        "# The functional path against a hand-written torch.func step",
        "",
        f"{results['machine']}; medians of {results['repeats']} round-robin steps.",
        "",
        "| workload | method | ms / step | vs hand-written | peak MB | first call s |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for name, info in results["workloads"].items():
        for method in METHODS:
            lines.append(
                f"| {name} (B={info['batch_size']}) | {method} | {info['ms'][method]:.1f} | "
                f"{info['ratio_to_hand_written'][method]:.2f}x | {info['peak_mb'][method]:.0f} | "
                f"{info['first_call_s'][method]:.1f} |"
            )
    lines.append("")
    for name, info in results["workloads"].items():
        ratio = info["ratio_to_hand_written"]["dpfunc_vmap"]
        lines.append(
            f"- {name}: dpfunc eager {ratio:.2f}x the hand-written step (target <= {TARGET}x: "
            f"{'met' if ratio <= TARGET else 'NOT met'}); parameters after one step differ by "
            f"{info['max_abs_difference_after_one_step']:.1e} (<= 1e-5 required)."
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--out", default="bench", help="folder for functional.json and .md")
    args = parser.parse_args()
    settings = QUICK if args.quick else FULL
    started = time.perf_counter()
    results = {
        "machine": f"{torch.get_num_threads()} threads, torch {torch.__version__}",
        "repeats": settings["repeats"],
        "workloads": {name: bench(name, **settings) for name in WORKLOADS},
    }
    results["total_s"] = time.perf_counter() - started
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "functional.json").write_text(json.dumps(results, indent=1) + "\n")
    report = markdown(results)
    (out / "functional.md").write_text(report)
    print(report)
    bad = [
        n for n, i in results["workloads"].items() if i["max_abs_difference_after_one_step"] > 1e-5
    ]
    if bad:
        raise SystemExit(f"dpfunc and the hand-written step disagree on {bad}")


if __name__ == "__main__":
    main()
