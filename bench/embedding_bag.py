"""A recommendation-style model on nn.EmbeddingBag: ghost clipping against vmap and non-private.

Four EmbeddingBag tables (sum mode) each pool one bag of indices per example; an MLP
reads their concatenation and predicts a click (two classes). One example is one bag per
table, called as ``bag(x.unsqueeze(0)[:, k])`` (a 2-D input ``[1, L]``), so the loss sees a
batch of one. Methods: eager and compiled (``dpfunc._compiling.compile_fullgraph``, as
dpfunc compiles) non-private PyTorch, dpfunc ``method="vmap"`` and ``method="ghost"``.

Run: ``.venv/bin/python bench/embedding_bag.py`` (writes bench/embedding_bag.json and .md;
``--quick`` skips the compiled methods).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

TABLES = 4  # EmbeddingBag tables
ROWS = 10_000  # rows per table
DIM = 32  # embedding dimension
BAG = 20  # indices per bag (one bag per table and example)
HIDDEN = 64  # MLP width
BATCH = 256  # examples per step
SETTINGS = {"warmup": 3, "repeats": 20, "memory_steps": 1}  # median of 20 after warm-up
METHODS = (
    "nonprivate",
    "nonprivate_compiled",
    "dpfunc_vmap",
    "dpfunc_vmap_compiled",
    "dpfunc_ghost",
    "dpfunc_ghost_compiled",
)


class Recommender(nn.Module):
    def __init__(self):
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(ROWS, DIM, mode="sum") for _ in range(TABLES))
        self.mlp = nn.Sequential(
            nn.Linear(TABLES * DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
            nn.Linear(HIDDEN, 2),
        )  # fmt: skip

    def forward(self, x):  # x: [N, TABLES, BAG] indices
        pooled = [table(x[:, k]) for k, table in enumerate(self.tables)]
        return self.mlp(torch.cat(pooled, 1))


def build():
    model = Recommender()
    x = torch.randint(0, ROWS, (BATCH, TABLES, BAG))
    y = torch.randint(0, 2, (BATCH,))
    return model, x, y


BUILDERS = {
    "nonprivate": harness.nonprivate,
    "nonprivate_compiled": partial(harness.nonprivate, compile=True),
    "dpfunc_vmap": partial(harness.dpfunc_step, method="vmap"),
    "dpfunc_vmap_compiled": partial(harness.dpfunc_step, method="vmap", compile=True),
    "dpfunc_ghost": partial(harness.dpfunc_step, method="ghost"),
    "dpfunc_ghost_compiled": partial(harness.dpfunc_step, method="ghost", compile=True),
}


def markdown(results: dict) -> str:
    info = results["workloads"]["recommender"]
    m = info["methods"]
    lines = harness.header(results, "EmbeddingBag: a recommendation-style model")
    lines += [
        f"{TABLES} EmbeddingBag tables of {ROWS} x {DIM} (sum mode), one bag of {BAG} "
        f"indices per table and example, an MLP {TABLES * DIM}-{HIDDEN}-{HIDDEN}-2; batch "
        f"{BATCH}, {info['params']} parameters. dpfunc_ghost is method='ghost' (every "
        "parameter ghosted, the tables by the EmbeddingBag rule); dpfunc_vmap materialises "
        "per-example gradients (torch has no vmap batching rule for embedding_bag, so vmap "
        "loops over the examples there).",
        "",
        "| method | ms/step | IQR ms | x non-private | peak MB | compile s | status |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    base = m.get("nonprivate", {}).get("median_ms")
    for name in METHODS:
        v = m.get(name, {"status": "not run"})
        row = [name, harness.fmt(v.get("median_ms"), ".2f"), harness.fmt(v.get("iqr_ms"), ".2f"),
               harness.ratio(v.get("median_ms"), base), harness.fmt(v.get("peak_mb"), ".0f"),
               harness.fmt(v.get("compile_s"), ".1f"), v["status"].replace("|", "/")]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        f"Quiet repeats: {info['quiet_repeats']} of {len(info['other_cores_per_repeat'])} "
        f"(statistics over {info['used_repeats']}); other processes shared the 2 cores "
        "(load average above), so the spreads are wide: compare medians, not single steps.",
        "",
        "Ghost over vmap (vmap ms / ghost ms, higher is faster):",
        "",
    ]
    for suffix, label in (("", "eager"), ("_compiled", "compiled")):
        ghost = m.get(f"dpfunc_ghost{suffix}", {}).get("median_ms")
        plain = m.get(f"dpfunc_vmap{suffix}", {}).get("median_ms")
        lines.append(f"- {label}: {harness.ratio(plain, ghost)}")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repeats, no torch.compile")
    parser.add_argument("--out", default="bench", help="folder for embedding_bag.json and .md")
    args = parser.parse_args()
    settings = harness.QUICK if args.quick else SETTINGS
    skip = {m: "skipped: --quick does not compile" for m in harness.COMPILED} if args.quick else {}
    start = time.perf_counter()
    results = harness.new_results(args.quick, settings)
    results["settings"].update(tables=TABLES, rows=ROWS, dim=DIM, bag=BAG, batch=BATCH)
    results["workloads"]["recommender"] = harness.bench_workload(
        "recommender", METHODS, skip=skip, **settings,
        workloads={"recommender": build}, builders=BUILDERS,
    )  # fmt: skip
    results["total_s"] = time.perf_counter() - start
    results["machine"]["load_average_at_end"] = os.getloadavg()
    harness.write_results(results, Path(args.out), "embedding_bag", markdown(results))


if __name__ == "__main__":
    main()
