"""Memory of a private step against the non-private one: one process, data-parallel, sharded.

Every run is a fresh set of processes (gloo on CPU, one thread each; NCCL with one GPU per
rank where there are enough), on an MLP ``IN -> HIDDEN -> HIDDEN -> HIDDEN -> 10`` (tanh),
BATCH examples per rank per step, with SGD (no momentum) or Adam:

- ``torch``: one process, non-private: mean loss, ``backward``, ``torch.optim``, on
  2 x BATCH examples.
- ``dpfunc``: one process, ``dpfunc.make_train_step(..., model=model)`` (ghost
  clipping) on the same 2 x BATCH examples as two micro-batches (``logical_step``).
- ``ddp``: non-private ``DistributedDataParallel``, BATCH examples per rank.
- ``dpfunc_dp``: ``dpfunc.distributed.make_train_step`` (ghost clipping), data-parallel.
- ``fsdp``: non-private FSDP2, ``fully_shard`` on each linear layer and the root.
- ``dpfunc_sharded``: ``dpfunc.distributed.make_train_step(..., shard=True)``.
- ``private_gradients``, ``private_gradients_dp``, ``private_gradients_sharded``:
  ``dpfunc.PrivateGradients`` (ghost clipping) on one process, data-parallel, and with
  ``shard=True``, with a ``torch.optim`` optimizer (built on the sharded model), one
  Poisson batch per step of expected size BATCH per rank from DATASET x that many
  examples (physical batches of 2 x BATCH: mostly one per rank).

Per rank, in copies of the whole parameters (float32): ``kept``, what it holds between
steps (parameters, optimizer state, a private run's noise history), counted exactly; and
``peak``, kept plus the most a step adds to the resident set above the level before it
(VmHWM reset through ``/proc/self/clear_refs`` before each step, in a run with glibc's mmap
threshold fixed at 64 KiB so that freed tensors leave the resident set; CUDA:
``max_memory_allocated`` above ``memory_allocated``). A private step includes drawing its
noise. Nothing else is alive: the model a run starts from is freed (the functional runs
keep their state only). Time: in a run with the default allocator, the median of REPEATS
steps after WARMUP.

Run: ``.venv/bin/python bench/sharded.py`` (writes bench/sharded.json and .md;
``--quick`` runs a small model for a smoke check; ``--only METHOD ...`` reruns those rows
and keeps the others from the last run's json).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import peak_mb  # noqa: E402

SIZES = {"full": (1024, 3072, 16), "quick": (64, 128, 4)}  # IN, HIDDEN, BATCH per rank
WARMUP, REPEATS = 2, 5
TIMEOUT_S = 600  # one run's processes, start to end
DATASET = 8  # PrivateGradients samples from DATASET x the expected batch
# (method, world sizes): the non-private reference of each row group first
RUNS = (
    ("torch", (1,)), ("dpfunc", (1,)), ("private_gradients", (1,)),
    ("ddp", (2,)), ("dpfunc_dp", (2,)), ("private_gradients_dp", (2,)),
    ("fsdp", (2, 4)), ("dpfunc_sharded", (2, 4)), ("private_gradients_sharded", (2,)),
)  # fmt: skip
REFERENCE = {"dpfunc": "torch", "private_gradients": "torch", "dpfunc_dp": "ddp",
             "private_gradients_dp": "ddp", "dpfunc_sharded": "fsdp",
             "private_gradients_sharded": "fsdp"}  # fmt: skip
OPTIMIZERS = ("sgd", "adam")
LR = 1e-3


def build(size: str) -> nn.Module:
    inputs, hidden, _ = SIZES[size]
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
        nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 10),
    )  # fmt: skip


def nbytes(tree) -> int:
    import optree
    from torch.distributed.tensor import DTensor

    leaves = optree.tree_leaves(tree, none_is_leaf=False)
    leaves = [x.to_local() if isinstance(x, DTensor) else x for x in leaves]
    return sum(x.numel() * x.element_size() for x in leaves if isinstance(x, torch.Tensor))


def torch_optimizer(name: str, params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR) if name == "sgd" else torch.optim.Adam(params, lr=LR)


def nonprivate(model: nn.Module, optimizer: torch.optim.Optimizer, x, y):
    def step(t: int) -> None:
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def kept() -> int:
        states = [s for state in optimizer.state.values() for s in state.values()]
        return nbytes(list(model.parameters())) + nbytes(states)

    return step, kept


def functional(method: str, opt: str, model: nn.Module, x, y, world_size: int):
    import dpfunc

    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        xi, yi = example
        logits = torch.func.functional_call(model, (p, buffers), (xi[None],))
        return F.cross_entropy(logits, yi[None])

    optimizer = dpfunc.optim.sgd(lr=LR) if opt == "sgd" else dpfunc.optim.adam(lr=LR)
    make = dpfunc.make_train_step if method == "dpfunc" else dpfunc.distributed.make_train_step
    shard = {"shard": True} if method == "dpfunc_sharded" else {}
    train_step = make(
        loss_fn, optimizer, model=model, method="ghost", clip_norm=1.0, noise_multiplier=1.0,
        expected_batch_size=len(x) * world_size, **shard,
    )  # fmt: skip
    holder = [train_step.init(params)]
    del params  # the run keeps its state only (rows, when sharded)
    for p in model.parameters():  # nor does the model hold a copy (loss_fn passes them all)
        p.data = torch.empty(0, device=x.device)
    mask = torch.ones(len(x), dtype=torch.bool, device=x.device)
    halves = 2 if method == "dpfunc" else 1  # one process: two micro-batches
    parts = zip(x.chunk(halves), y.chunk(halves), mask.chunk(halves))
    micro = [((xs, ys), ms) for xs, ys, ms in parts]

    def step(t: int) -> None:
        noise = train_step.draw_noise(holder[0].params, seed=12345, step=t)
        holder[0], _ = train_step.logical_step(holder[0], micro, noise)

    def kept() -> int:
        s = holder[0]
        return nbytes((s.params, s.opt_state, s.noise_state))

    return step, kept


def private_gradients(method: str, opt: str, model: nn.Module, x, y, world_size: int):
    import dpfunc

    def loss_fn(p, example):
        xi, yi = example
        return F.cross_entropy(torch.func.functional_call(model, p, (xi[None],)), yi[None])

    per_rank = len(x) // (DATASET * world_size)  # BATCH: each rank's expected share
    private = dpfunc.PrivateGradients(
        model, loss_fn, (x, y), expected_batch_size=per_rank * world_size, clip_norm=1.0,
        noise_multiplier=1.0, method="ghost", shard=method.endswith("sharded"),
        physical_batch_size=2 * per_rank,
        seed=12345,
    )  # fmt: skip
    optimizer = torch_optimizer(opt, model.parameters())  # after the sharding
    batches = private.batches()

    def step(t: int) -> None:
        private.backward(next(batches))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def kept() -> int:
        states = [s for state in optimizer.state.values() for s in state.values()]
        return nbytes(list(model.parameters())) + nbytes(states) + nbytes(private.state_dict())

    return step, kept


def run_rank(method: str, opt: str, size: str, out: str) -> None:
    import dpfunc

    measure_memory = "MALLOC_MMAP_THRESHOLD_" in os.environ  # launch's memory run
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        info = dpfunc.distributed.init(timeout_s=600)
        rank, device = info.rank, info.device
    else:
        rank, device = 0, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(1)
    inputs, _, batch = SIZES[size]
    batch = batch * (2 if world == 1 else 1)  # one process: the examples of 2 ranks
    g = torch.Generator().manual_seed(1 + rank)
    if method.startswith("private_gradients"):  # one dataset, sampled by PrivateGradients
        g, batch = torch.Generator().manual_seed(1), DATASET * batch * world
    x = torch.randn(batch, inputs, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    model = build(size).to(device)
    if method.startswith("private_gradients"):
        step, kept = private_gradients(method, opt, model, x, y, world)
    elif method.startswith("dpfunc"):
        step, kept = functional(method, opt, model, x, y, world)
    else:
        if method == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer)
            fully_shard(model)
        elif method == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
        step, kept = nonprivate(model, torch_optimizer(opt, model.parameters()), x, y)
    for t in range(WARMUP):
        step(t)
    times, peaks = [], []
    for t in range(WARMUP, WARMUP + REPEATS):
        if world > 1:
            torch.distributed.barrier()
        if measure_memory:
            peaks.append(peak_mb(lambda t=t: step(t)) * 2**20)  # synchronized
            continue
        started = time.perf_counter()
        step(t)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    result = {"kept_bytes": kept(), "extra_bytes": max(peaks, default=None),
              "step_s": statistics.median(times) if times else None}  # fmt: skip
    Path(out, f"{method}-{opt}-{world}-{rank}.json").write_text(json.dumps(result))
    if world > 1:
        dpfunc.distributed.shutdown()


def launch(method: str, opt: str, size: str, world: int, out: str, memory: bool) -> list[dict]:
    """One run on ``world`` fresh processes; each rank's result.

    ``memory``: with glibc's mmap threshold fixed at 64 KiB, so that every
    tensor of that size or more is mapped on its own and returned on free
    (glibc's adaptive threshold keeps freed model-sized buffers in the heap).
    The fixed threshold slows allocation, so times come from a run without it.
    """
    for attempt in range(3):
        try:
            return _launch_once(method, opt, size, world, out, memory)
        except subprocess.TimeoutExpired:  # a rendezvous that never met: again, on a new port
            print(f"{method} with {opt} on {world} ranks timed out (attempt {attempt + 1})",
                  file=sys.stderr, flush=True)  # fmt: skip
    raise RuntimeError(f"{method} with {opt} on {world} ranks timed out 3 times")


def _launch_once(
    method: str, opt: str, size: str, world: int, out: str, memory: bool
) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
        if world > 1:
            env.update(
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
            )  # fmt: skip
        if memory:
            env["MALLOC_MMAP_THRESHOLD_"] = "65536"
        command = [sys.executable, __file__, "--rank-of", method, opt, "--size", size]
        command += ["--into", out]
        procs.append(subprocess.Popen(command, env=env))
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for proc in procs:
            if proc.wait(timeout=max(1.0, deadline - time.monotonic())) != 0:
                raise RuntimeError(f"{method} with {opt} on {world} ranks failed")
    except subprocess.TimeoutExpired:
        for proc in procs:  # SIGABRT: faulthandler prints where each rank waited
            if proc.poll() is None:
                proc.send_signal(signal.SIGABRT)
        for proc in procs:
            proc.wait()
        raise
    files = [Path(out, f"{method}-{opt}-{world}-{r}.json") for r in range(world)]
    return [json.loads(f.read_text()) for f in files]


def table(results: dict, size: str, before: dict | None = None) -> str:
    """The markdown table; ``before``: the same bench on earlier code (its peaks beside)."""
    inputs, hidden, batch = SIZES[size]
    whole = sum(p.numel() * 4 for p in build(size).parameters())
    code = f" at {before['code']}" if before else ""
    lines = [
        "# Private steps' memory: one process, data-parallel, sharded",
        "",
        f"MLP {inputs}-{hidden}-{hidden}-{hidden}-10 ({whole / 1e6:.1f} MB of float32 "
        f"parameters = 1 copy), {batch} examples per rank per step (one process: {2 * batch}, "
        f"in two micro-batches for dpfunc), {results['device']}, one thread per rank, "
        f"{os.cpu_count()} cores. Kept: what a rank holds between steps, counted. Peak: kept "
        "plus the most a step adds to the resident set (glibc's mmap threshold fixed at 64 KiB, "
        "so freed tensors leave it), a private step's noise draw included. Both in copies of "
        "the whole parameters, per rank, the largest over the ranks; over: the peak less the "
        "non-private step's of the same layout (torch, DDP, FSDP2). Time: the median of "
        f"{REPEATS} steps after {WARMUP}, in a run with the default allocator; 4 ranks on 2 "
        "cores are oversubscribed (compare their memory, not their time). Generated by "
        "`bench/sharded.py`"
        + (f"; before: `bench/sharded_before.json`, the same bench on the code{code}." if before
           else "."),
        "",
        "| ranks | method | optimizer | kept | peak | over | "
        + (f"peak{code} | over{code} | " if before else "")
        + "step (s) | step / non-private |",
        "| ---: | --- | --- | ---: | ---: | ---: | " + ("---: | ---: | " if before else "")
        + "---: | ---: |",
    ]  # fmt: skip

    def peaks(runs: list[dict]) -> dict:
        return {_key(r): (r["kept_bytes"] + r["extra_bytes"]) / whole for r in runs}

    now, then = peaks(results["runs"]), peaks(before["runs"]) if before else {}
    times = {_key(r): r["step_s"] for r in results["runs"]}
    for r in results["runs"]:
        key = _key(r)
        method, opt, world = key
        ref = (REFERENCE.get(method, method), opt, world)
        cells = [str(world), method, opt, f"{r['kept_bytes'] / whole:.2f}", f"{now[key]:.2f}",
                 f"{now[key] - now[ref]:+.2f}"]  # fmt: skip
        if before and key in then:
            cells += [f"{then[key]:.2f}", f"{then[key] - then[ref]:+.2f}"]
        elif before:
            cells += ["-", "-"]
        cells += [f"{times[key]:.3f}", f"{times[key] / times[ref]:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="*", default=None, help="methods to run (default: all)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent))
    parser.add_argument("--rank-of", nargs=2, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--size", default="full", help=argparse.SUPPRESS)
    parser.add_argument("--into", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of is not None:
        run_rank(*args.rank_of, args.size, args.into)
        return
    size = "quick" if args.quick else "full"
    device = "CUDA (NCCL)" if torch.cuda.device_count() >= 4 else "CPU (gloo)"
    name = "sharded_quick" if args.quick else "sharded"
    path = Path(args.out, f"{name}.json")
    results = {"size": size, "sizes": SIZES[size], "device": device, "runs": []}
    if args.only and path.exists():  # the other rows are kept from the last run
        results = json.loads(path.read_text())
    wanted = [(m, o, w) for m, worlds in RUNS for o in OPTIMIZERS for w in worlds
              if not args.only or m in args.only]  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        for method, opt, world in wanted:
            timed = launch(method, opt, size, world, scratch, memory=False)
            measured = launch(method, opt, size, world, scratch, memory=True)
            row = {
                "method": method, "optimizer": opt, "world_size": world,
                "kept_bytes": max(r["kept_bytes"] for r in measured),
                "extra_bytes": max(r["extra_bytes"] for r in measured),
                "step_s": max(r["step_s"] for r in timed),
            }  # fmt: skip
            results["runs"] = [r for r in results["runs"] if _key(r) != _key(row)] + [row]
            path.write_text(json.dumps(results, indent=1))  # after every row: a crash keeps them
            print(row, flush=True)
    order = [(m, o, w) for m, worlds in RUNS for o in OPTIMIZERS for w in worlds]
    if {_key(r) for r in results["runs"]} >= set(order):
        results["runs"].sort(key=lambda r: order.index(_key(r)))
        earlier = Path(args.out, "sharded_before.json")
        before = json.loads(earlier.read_text()) if earlier.exists() and not args.quick else None
        Path(args.out, f"{name}.md").write_text(table(results, size, before))
        print(table(results, size, before))


def _key(row: dict) -> tuple[str, str, int]:
    return row["method"], row["optimizer"], row["world_size"]


if __name__ == "__main__":
    main()
