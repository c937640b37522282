"""Sharded DP-SGD against data-parallel DP-SGD and non-private FSDP2: per-rank memory and time.

Every method runs on W ranks (gloo on CPU, one thread each; NCCL with one GPU per
rank when there are W GPUs), each rank a fresh process, on an MLP
``IN -> HIDDEN -> HIDDEN -> HIDDEN -> 10`` (tanh) with Adam and BATCH examples
per rank per step:

- ``fsdp``: non-private FSDP2, ``fully_shard`` on each linear layer and the
  root, mean loss, ``backward``, ``torch.optim.Adam``.
- ``dpfunc_dp``: ``dpfunc.distributed.make_train_step(..., model=model)``
  (ghost clipping), data-parallel: every rank holds everything.
- ``dpfunc_sharded``: the same with ``shard=True``.

Per rank: the state it keeps between steps (parameters, optimizer state) in
bytes, counted exactly; the peak memory during the timed steps above the
memory before the model was built (CPU: the process's resident set, sampled
every millisecond, in a run of its own with glibc's mmap threshold fixed so
that freed tensors leave it; CUDA: ``max_memory_allocated``); the median
step time
(a private step includes drawing the noise). The whole model is built on
every rank first (as each method starts from it), then freed.

Run: ``.venv/bin/python bench/sharded.py`` (writes bench/sharded.json and
.md; ``--quick`` runs a small model for a smoke check).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

SIZES = {"full": (1024, 3072, 16), "quick": (64, 128, 4)}  # IN, HIDDEN, BATCH per rank
WARMUP, REPEATS = 2, 7
METHODS = ("fsdp", "dpfunc_dp", "dpfunc_sharded")
WORLD_SIZES = (2, 4)


def build(size: str) -> nn.Module:
    inputs, hidden, _ = SIZES[size]
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
        nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 10),
    )  # fmt: skip


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """The peak memory in a block, above the level at its start (sampled on a CPU)."""

    def __init__(self, device: torch.device):
        self.device, self.peak, self._stop = device, 0, threading.Event()

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        self.peak = rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
            return
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def nbytes(tree) -> int:
    from torch.distributed.tensor import DTensor

    leaves = [x.to_local() if isinstance(x, DTensor) else x for x in dpfunc_leaves(tree)]
    return sum(x.numel() * x.element_size() for x in leaves if isinstance(x, torch.Tensor))


def dpfunc_leaves(tree):
    import optree

    return optree.tree_leaves(tree, none_is_leaf=False)


def run_rank(method: str, size: str, out: str) -> None:
    import dpfunc

    info = dpfunc.distributed.init(timeout_s=600)
    torch.set_num_threads(1)
    device = info.device
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else rss()
    inputs, _, batch = SIZES[size]
    g = torch.Generator().manual_seed(1 + info.rank)
    x = torch.randn(batch, inputs, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    model = build(size).to(device)
    if method == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

        def step(t: int) -> None:
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def kept() -> int:
            return nbytes(list(model.parameters())) + nbytes(
                [s for state in optimizer.state.values() for s in state.values()]
            )
    else:
        params, buffers = dpfunc.functionalize(model)

        def loss_fn(p, example):
            xi, yi = example
            out = torch.func.functional_call(model, (p, buffers), (xi[None],))
            return F.cross_entropy(out, yi[None])

        train_step = dpfunc.distributed.make_train_step(
            loss_fn, dpfunc.optim.adam(lr=1e-3), model=model, method="ghost", clip_norm=1.0,
            noise_multiplier=1.0, expected_batch_size=batch * info.world_size,
            shard=method == "dpfunc_sharded",
        )  # fmt: skip
        state = train_step.init(params)
        del params  # the trainer keeps its state only (rows, when sharded)
        for p in model.parameters():  # nor does the model hold a copy (loss_fn passes them all)
            p.data = torch.empty(0, device=device)
        mask = torch.ones(batch, dtype=torch.bool, device=device)
        holder = [state]

        def step(t: int) -> None:
            noise = train_step.draw_noise(holder[0].params, seed=12345, step=t)
            holder[0], _ = train_step.logical_step(holder[0], [((x, y), mask)], noise)

        def kept() -> int:
            s = holder[0]
            return nbytes((s.params, s.opt_state, s.noise_state))

    for t in range(WARMUP):
        step(t)
    times = []
    with PeakMemory(device) as peak:
        for t in range(WARMUP, WARMUP + REPEATS):
            torch.distributed.barrier()
            started = time.perf_counter()
            step(t)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - started)
    result = {
        "method": method,
        "rank": info.rank,
        "world_size": info.world_size,
        "device": str(device),
        "kept_bytes": kept(),
        "peak_bytes": peak.peak - base,
        "step_s": statistics.median(times),
        "times": times,
    }
    with open(os.path.join(out, f"{method}-{info.world_size}-{info.rank}.json"), "w") as f:
        json.dump(result, f)
    dpfunc.distributed.shutdown()


def launch(method: str, size: str, world_size: int, out: str, memory: bool) -> list[dict]:
    """One run of ``method`` on ``world_size`` fresh processes; each rank's result.

    ``memory``: with glibc's mmap threshold fixed at 128 KiB, so that every
    tensor of that size or more is mapped on its own and returned on free,
    and the resident set follows the live tensors (glibc's adaptive
    threshold keeps freed model-sized buffers in the heap). The fixed
    threshold slows allocation, so times come from a run without it.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world_size):
        env = dict(
            os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
            WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
        )  # fmt: skip
        if memory:
            env["MALLOC_MMAP_THRESHOLD_"] = "131072"
        command = [sys.executable, __file__, "--rank-of", method, "--size", size, "--into", out]
        procs.append(subprocess.Popen(command, env=env))
    for proc in procs:
        if proc.wait(timeout=1800) != 0:
            raise RuntimeError(f"{method} on {world_size} ranks failed")
    return [
        json.loads(Path(out, f"{method}-{world_size}-{r}.json").read_text())
        for r in range(world_size)
    ]


def table(results: dict, size: str) -> str:
    inputs, hidden, batch = SIZES[size]
    model = build(size)
    whole = sum(p.numel() * 4 for p in model.parameters())
    lines = [
        "# Sharded DP-SGD: per-rank memory and step time",
        "",
        f"MLP {inputs}-{hidden}-{hidden}-{hidden}-10 ({whole / 1e6:.1f} MB of float32 "
        f"parameters; Adam keeps two more copies), {batch} examples per rank per step, "
        f"{results['device']}, one thread per rank, {os.cpu_count()} cores. Kept: what a rank "
        "holds between steps (parameters, optimizer state), counted. Peak: the highest resident "
        "memory during the timed steps above the level before the model was built, in a run "
        "with glibc's mmap threshold fixed at 128 KiB (freed tensors leave the resident set). "
        "Time: in a run with the default allocator, the median "
        f"of {REPEATS} steps after {WARMUP}. Generated by `bench/sharded.py`.",
        "",
        "| ranks | method | kept per rank (MB) | kept / whole | peak per rank (MB) | "
        "step (s) | step / fsdp | step / dpfunc_dp |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for world_size, by_method in results["runs"].items():
        ref = {m: max(r["step_s"] for r in by_method[m]) for m in by_method}
        for method, ranks in by_method.items():
            kept = max(r["kept_bytes"] for r in ranks)
            peak = max(r["peak_bytes"] for r in ranks)
            step_s = max(r["step_s"] for r in ranks)
            lines.append(
                f"| {world_size} | {method} | {kept / 1e6:.1f} | {kept / (3 * whole):.2f} | "
                f"{peak / 1e6:.0f} | {step_s:.3f} | {step_s / ref['fsdp']:.2f}x | "
                f"{step_s / ref['dpfunc_dp']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent))
    parser.add_argument("--rank-of", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--size", default="full", help=argparse.SUPPRESS)
    parser.add_argument("--into", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of is not None:
        run_rank(args.rank_of, args.size, args.into)
        return
    size = "quick" if args.quick else "full"
    results = {"size": size, "sizes": SIZES[size], "device": "CPU (gloo)", "runs": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for world_size in WORLD_SIZES:
            by_method = {}
            for method in METHODS:
                timed = launch(method, size, world_size, scratch, memory=False)
                measured = launch(method, size, world_size, scratch, memory=True)
                for t, m in zip(timed, measured):
                    t["peak_bytes"] = m["peak_bytes"]  # from the run with the fixed threshold
                by_method[method] = timed
            results["runs"][world_size] = by_method
    name = "sharded_quick" if args.quick else "sharded"
    Path(args.out, f"{name}.json").write_text(json.dumps(results, indent=1))
    Path(args.out, f"{name}.md").write_text(table(results, size))
    print(table(results, size))


if __name__ == "__main__":
    main()
