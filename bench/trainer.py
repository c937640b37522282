"""Benchmark the Trainer's time per step against a plain non-private PyTorch loop.

Run from the repository root:

    .venv/bin/python bench/trainer.py            # writes bench/trainer.json and .md
    .venv/bin/python bench/trainer.py --quick    # fewer steps, no torch.compile
    .venv/bin/python bench/trainer.py --out DIR

The workload is bench/harness.py's MLP (784-512-256-10) on 5,120 random examples
with an expected batch of 256 (sample rate 0.05). The baseline is what a user
writes without privacy: a shuffled ``DataLoader`` of batch 256, forward,
cross-entropy, backward and ``torch.optim.SGD``. ``dpfunc.Trainer`` adds what
privacy costs end to end: Poisson sampling into fixed-shape micro-batches,
per-example clipping (with ``model=``: ghost clipping where it is cheaper;
without: per-example gradients from vmap), the noise draw (prefetched for
the next step on a worker thread) and the accountant. Each row is the median seconds per step
over whole epochs after one warm-up epoch (the compiled Trainer compiles
there), in one process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import functional_call

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import harness  # noqa: E402  (bench/harness.py: the workloads)

import dpfunc  # noqa: E402

EXAMPLES = 5120  # random training examples
BATCH = 256  # the loop's batch and the Trainer's expected batch
FULL = {"epochs": 3}  # timed epochs (20 steps each) after one warm-up epoch
QUICK = {"epochs": 1}


def data():
    generator = torch.Generator().manual_seed(harness.SEED)
    x = torch.randn(EXAMPLES, 784, generator=generator)
    return x, torch.randint(10, (EXAMPLES,), generator=generator)


def plain_loop(epochs: int) -> list[float]:
    torch.manual_seed(harness.SEED)
    model, _, _ = harness.mlp()
    x, y = data()
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=True
    )
    opt = torch.optim.SGD(model.parameters(), lr=harness.LR)
    per_epoch = []
    for epoch in range(epochs + 1):
        started = time.perf_counter()
        for xb, yb in loader:
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if epoch:  # the first epoch warms up
            per_epoch.append((time.perf_counter() - started) / len(loader))
    return per_epoch


def trainer(epochs: int, compile: bool, ghost: bool) -> list[float]:
    torch.manual_seed(harness.SEED)
    model, _, _ = harness.mlp()
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        xi, yi = example
        return F.cross_entropy(functional_call(model, (p, buffers), (xi[None],)), yi[None])

    fit = dpfunc.Trainer(
        loss_fn,
        params,
        data(),
        optimizer=dpfunc.optim.sgd(lr=harness.LR),
        epochs=epochs + 1,
        expected_batch_size=BATCH,
        clip_norm=harness.CLIP_NORM,
        noise_multiplier=harness.NOISE_MULTIPLIER,
        accounting="rdp",
        compile=compile,
        progress=False,
        model=model if ghost else None,
    )
    per_epoch = []
    for epoch in range(epochs + 1):
        started = time.perf_counter()
        fit.fit(max_steps=fit.steps_per_epoch)
        if epoch:
            per_epoch.append((time.perf_counter() - started) / fit.steps_per_epoch)
    return per_epoch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one timed epoch, no compile")
    parser.add_argument("--out", default="bench", help="folder for trainer.json and .md")
    args = parser.parse_args()
    epochs = (QUICK if args.quick else FULL)["epochs"]
    runs = {"plain PyTorch loop (non-private)": plain_loop(epochs)}
    for ghost, label in ((True, "model= (ghost where cheaper)"), (False, "vmap")):
        runs[f"dpfunc.Trainer, {label}, eager"] = trainer(epochs, compile=False, ghost=ghost)
        if not args.quick:
            runs[f"dpfunc.Trainer, {label}, compiled"] = trainer(epochs, True, ghost)
    ms = {name: statistics.median(t) * 1e3 for name, t in runs.items()}
    base = ms["plain PyTorch loop (non-private)"]
    lines = [
        "# Trainer against a plain PyTorch loop (MLP 784-512-256-10, batch 256)",
        "",
        f"{torch.get_num_threads()} threads, torch {torch.__version__}; median ms per step "
        f"over {epochs} epoch(s) of {EXAMPLES // BATCH} steps after a warm-up epoch.",
        "",
        "| loop | ms / step | vs plain loop |",
        "| --- | ---: | ---: |",
        *(f"| {name} | {ms[name]:.1f} | {ms[name] / base:.2f}x |" for name in runs),
    ]
    report = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "trainer.json").write_text(json.dumps({"ms_per_step": ms}, indent=1) + "\n")
    (out / "trainer.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
