"""First-call time of a compiled Trainer step: from a cold cache, a warm cache, and a mega-cache.

Run from the repository root (one process at a time; about 3 minutes on 2 cores):

    .venv/bin/python bench/compile_time.py             # writes bench/compile_time.json and .md
    .venv/bin/python bench/compile_time.py --repeats 1 --out DIR

Every measurement is a fresh Python process that imports torch and dpfunc, builds a
``dpfunc.Trainer(compile=True, model=model)`` (default ``method="auto"``) for an MLP
784-512-256-10 at an expected batch of 256 (2,560 random examples), and times its
first three steps (``fit(max_steps=1)`` each). The first step compiles; the second
and third show what remains (no recompiles expected: Dynamo's counters are
recorded after each step). Three kinds of process:

* cold: an empty private cache. ``TMPDIR``, ``TORCHINDUCTOR_CACHE_DIR`` and
  ``TRITON_CACHE_DIR`` point into a fresh folder, so nothing compiled before is
  reused, not even the precompiled header Inductor keeps under ``TMPDIR``
  (``torchinductor_<user>/precompiled_headers``, outside ``TORCHINDUCTOR_CACHE_DIR``).
  After its steps it saves torch's portable cache artifacts
  (``torch.compiler.save_cache_artifacts()``) to a file.
* warm: a second process with the cold one's folders: torch's FX graph cache
  and AOTAutograd cache (on by default) are hit; Dynamo still traces.
* mega-cache: a process with a fresh empty folder that first calls
  ``torch.compiler.load_cache_artifacts`` with the cold process's bytes.

Each kind runs ``--repeats`` times (cold, warm, mega-cache in turn); the tables
give medians.

A second table compares the first compiled call of dpfunc's step with the
same model's non-private step (the issue's bound: at most 1.5x), for the MLP
and the CNN of ``bench/harness.py`` (``mlp()``, B = 256; ``cnn()``, B = 64), each
variant in a fresh process with an empty cache folder and
``TORCHINDUCTOR_FX_GRAPH_CACHE=0``: the non-private step as
``harness.nonprivate(compile=True)`` compiles it (forward and loss under
``torch.compile``, the backward through AOTAutograd, SGD eager), and
``harness.dpfunc_step(method="auto", compile=True)`` (``make_train_step(...,
model=model)``, drawing its noise in the timed call) under
``dpfunc._compiling.compile_fullgraph`` and under a plain ``torch.compile(step,
fullgraph=True)``. Each is timed on its first and second call.

Import time (``import torch, dpfunc``) is reported apart. Where the
first step's time goes comes from ``torch._dynamo.utils.compilation_time_metrics``
of the cold processes. The cold process also checks that neither the saved
artifacts nor any file of its cache folder holds the bytes of the parameters,
the data or the noise (see ``secrets_in``), and that the check finds them in a
pickled tensor (a positive control).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = 2560  # random training examples (sample rate 0.1)
BATCH = 256  # expected batch size
STEPS = 3  # steps timed in each process
# compile phases reported (names of torch._dynamo.utils.compilation_time_metrics)
PHASES = {
    "Dynamo tracing": "bytecode_tracing",
    "AOTAutograd + Inductor (backend)": "OutputGraph.call_user_compiler",
    "Inductor codegen": "GraphLowering.codegen",
    "C++ compiles (summed over workers)": "compile_file",
    "waiting for C++ workers": "async_compile.wait",
    "loading cached graphs": "AOTAutogradCache.inductor_load",
}
RESTART = "compile_attempt_1"  # Dynamo traced a function again (a restart)
# kind of process -> (table label, child mode, extra environment)
KINDS = {
    "cold": ("cold (empty cache)", "cold", {}),
    "warm": ("warm (same cache folder)", "warm", {}),
    "mega": ("mega-cache (empty folder + load_cache_artifacts)", "mega", {}),
    "cold_isa": ("cold, TORCHINDUCTOR_VEC_ISA_OK=1", "cold", {"TORCHINDUCTOR_VEC_ISA_OK": "1"}),
    "warm_isa": ("warm, TORCHINDUCTOR_VEC_ISA_OK=1", "warm", {"TORCHINDUCTOR_VEC_ISA_OK": "1"}),
}

# the cache folder of each kind: warm reuses cold's; the mega-cache starts from an empty one
FOLDERS = {"cold": "a", "warm": "a", "mega": "b", "cold_isa": "c", "warm_isa": "c"}
# first calls compared (each a cold process): the workloads of bench/harness.py, and the variants
FIRST_WORKLOADS = ("mlp", "cnn")
FIRST_VARIANTS = {
    "nonprivate": "non-private (forward+loss compiled)",
    "fullgraph": "dpfunc, compile_fullgraph(step)",
    "plain": "dpfunc, torch.compile(step, fullgraph=True)",
}
BOUND = 1.5  # the bound on dpfunc's first call over the non-private one


def secrets_in(blob: bytes, tensors: list) -> list[int]:
    """Indices of ``tensors`` some 32-byte window of whose raw bytes occurs in ``blob``.

    Four windows per tensor (start, quarter, half, end) of its contiguous
    bytes; a tensor of fewer than 32 bytes is searched whole.
    """
    found = []
    for i, t in enumerate(tensors):
        raw = t.detach().contiguous().numpy().tobytes()
        width = min(32, len(raw))
        starts = {0, len(raw) // 4, len(raw) // 2, len(raw) - width}
        if any(raw[s : s + width] in blob for s in starts):
            found.append(i)
    return found


def child(mode: str, folder: Path, artifact: Path) -> dict:
    """One measurement in this (fresh) process; returns its figures."""
    started = time.perf_counter()
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch._dynamo.utils import compilation_time_metrics, counters
    from torch.func import functional_call

    sys.path.insert(0, str(ROOT))
    import dpfunc

    out: dict = {"mode": mode, "import_s": time.perf_counter() - started}
    if mode == "mega":
        started = time.perf_counter()
        info = torch.compiler.load_cache_artifacts(artifact.read_bytes())
        out["load_s"] = time.perf_counter() - started
        out["loaded"] = {k: len(v) for k, v in vars(info).items()} if info else None

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    params, buffers = dpfunc.functionalize(model)
    x, y = torch.randn(EXAMPLES, 784), torch.randint(10, (EXAMPLES,))

    def loss_fn(p, example):
        xi, yi = example
        return F.cross_entropy(functional_call(model, (p, buffers), (xi[None],)), yi[None])

    trainer = dpfunc.Trainer(
        loss_fn, params, (x, y), optimizer=dpfunc.optim.sgd(lr=0.1), epochs=1,
        expected_batch_size=BATCH, clip_norm=1.0, noise_multiplier=1.0, accounting="rdp",
        compile=True, progress=False, model=model,
    )  # fmt: skip
    out["steps_s"], out["graphs_after_step"] = [], []
    for _ in range(STEPS):
        started = time.perf_counter()
        trainer.fit(max_steps=1)
        out["steps_s"].append(time.perf_counter() - started)
        out["graphs_after_step"].append(counters["stats"]["unique_graphs"])
    out["counters"] = {
        k: dict(counters[k]) for k in ("stats", "aot_autograd", "inductor", "graph_break")
    }
    out["counters"]["inductor"] = {
        k: v for k, v in out["counters"]["inductor"].items() if "cache" in k
    }
    out["phases_s"] = {
        label: sum(compilation_time_metrics.get(key, [])) for label, key in PHASES.items()
    }
    out["restarts"] = len(compilation_time_metrics.get(RESTART, []))
    if mode == "cold":
        saved = torch.compiler.save_cache_artifacts()
        blob = saved[0] if saved else b""
        artifact.write_bytes(blob)
        out["artifact_bytes"] = len(blob)
        noise = trainer.step_fn.draw_noise(params, seed=trainer.seed, step=0).params  # step 1's
        secret = [*params.values(), *trainer.params.values(), x, *noise.values()]
        files = [p for p in folder.rglob("*") if p.is_file()]
        out["secret_check"] = {
            "tensors": len(secret),
            "found_in_artifact": secrets_in(blob, secret),
            "files_searched": len(files),
            "found_in_cache_files": sorted(
                {i for f in files for i in secrets_in(f.read_bytes(), secret)}
            ),
            "positive_control": secrets_in(pickled(torch, secret[0]), secret[:1]) == [0],
        }
    return out


def first_call(workload: str, variant: str) -> dict:
    """The first two calls of one compiled step (``FIRST_VARIANTS``), in this fresh process."""
    started = time.perf_counter()
    import torch
    from torch._dynamo.utils import compilation_time_metrics, counters

    sys.path.insert(0, str(ROOT / "bench"))
    import harness

    out: dict = {"workload": workload, "variant": variant}
    out["import_s"] = time.perf_counter() - started
    if variant == "plain":  # the step compiled as a user would, without dpfunc's wrapper
        harness.compile_fullgraph = lambda fn: torch.compile(fn, fullgraph=True)
    torch.manual_seed(harness.SEED)
    model, x, y = harness.WORKLOADS[workload]()
    if variant == "nonprivate":
        step, _ = harness.nonprivate(model, x, y, compile=True)
    else:
        step, _ = harness.dpfunc_step(model, x, y, "auto", compile=True)
    out["calls_s"] = []
    for _ in range(2):
        started = time.perf_counter()
        step()
        out["calls_s"].append(time.perf_counter() - started)
    out["graphs"] = counters["stats"]["unique_graphs"]
    out["phases_s"] = {
        label: sum(compilation_time_metrics.get(key, [])) for label, key in PHASES.items()
    }
    out["restarts"] = len(compilation_time_metrics.get(RESTART, []))
    return out


def pickled(torch, tensor) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def run(mode: str, folder: Path, artifact: Path, extra: dict[str, str]) -> dict:
    """``child(mode, ...)`` in a fresh process whose caches live under ``folder``."""
    (folder / "tmp").mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        **extra,
        "TMPDIR": str(folder / "tmp"),
        "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor"),
        "TRITON_CACHE_DIR": str(folder / "triton"),
    }
    if mode.startswith("first:"):  # cold, whatever the folder holds
        env["TORCHINDUCTOR_FX_GRAPH_CACHE"] = env["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"
    command = [sys.executable, __file__, "--child", mode, str(folder), str(artifact)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{mode} process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def median(runs: list[dict], get) -> float:
    return statistics.median(get(r) for r in runs)


def first_report(first: dict[str, list[dict]], repeats: int) -> list[str]:
    """The table of first calls, dpfunc's over the non-private one (``first_call``)."""
    lines = [
        "",
        "## First compiled call: dpfunc's step and the non-private step (cold, fresh processes)",
        "",
        f"Median of {repeats} fresh processes each, empty cache folder and "
        "TORCHINDUCTOR_FX_GRAPH_CACHE=0 (seconds; ratio: first call over the non-private "
        f"step's, the bound is {BOUND}x). Graphs: Dynamo's unique graphs; restarts: "
        "whole traces Dynamo began again.",
        "",
        "| model | step | first call | ratio | second call | Dynamo tracing "
        "| AOT + Inductor | C++ compiles (summed) | graphs | restarts |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for workload in FIRST_WORKLOADS:
        runs = {v: first[f"{workload}:{v}"] for v in FIRST_VARIANTS}
        base = median(runs["nonprivate"], lambda r: r["calls_s"][0])
        for variant, label in FIRST_VARIANTS.items():
            r = runs[variant]
            call = median(r, lambda x: x["calls_s"][0])
            phases = [
                f"{median(r, lambda x, k=k: x['phases_s'][k]):.2f}"
                for k in ("Dynamo tracing", "AOTAutograd + Inductor (backend)",
                          "C++ compiles (summed over workers)")
            ]  # fmt: skip
            lines.append(
                f"| {workload} | {label} | {call:.2f} | {call / base:.2f} | "
                f"{median(r, lambda x: x['calls_s'][1]):.3f} | "
                + " | ".join(phases)
                + f" | {sorted({x['graphs'] for x in r})} | {sorted({x['restarts'] for x in r})} |"
            )
    return lines


def report(runs: dict[str, list[dict]], repeats: int) -> str:
    import torch

    lines = [
        "# First compiled Trainer step: cold, warm and mega-cache (MLP 784-512-256-10, B = 256)",
        "",
        f"torch {torch.__version__}, {os.cpu_count()} CPUs; each figure the median of "
        f"{repeats} fresh processes (bench/compile_time.py). Seconds.",
        "",
        "| start | import torch, dpfunc | load artifacts | step 1 (compiles) | step 2 | step 3 |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode, (label, _, _) in KINDS.items():
        r = runs[mode]
        load = f"{median(r, lambda x: x['load_s']):.2f}" if mode == "mega" else "-"
        steps = [f"{median(r, lambda x, i=i: x['steps_s'][i]):.2f}" for i in range(STEPS)]
        lines.append(
            f"| {label} | {median(r, lambda x: x['import_s']):.2f} | {load} | "
            + " | ".join(steps)
            + " |"
        )
    kinds = list(KINDS)
    lines += ["", "Where the first step's time goes (median s, summed over compiled graphs):", ""]
    lines += ["| phase | " + " | ".join(kinds) + " |", "| --- |" + " ---: |" * len(kinds)]
    for label in PHASES:
        cells = [f"{median(runs[m], lambda x, k=label: x['phases_s'][k]):.2f}" for m in kinds]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    cold = runs["cold"][0]
    graphs = {m: sorted({tuple(r["graphs_after_step"]) for r in runs[m]}) for m in kinds}
    check = cold["secret_check"]
    lines += [
        "",
        f"Graphs compiled after steps 1, 2, 3 (per process): {graphs} "
        "(equal counts: no recompile on steps 2 and 3).",
        f"Dynamo restarts per process: { {m: [r['restarts'] for r in runs[m]] for m in kinds} }.",
        "Cache counters of the first process of each kind: "
        + "; ".join(
            f"{m}: {runs[m][0]['counters']['aot_autograd']}, {runs[m][0]['counters']['inductor']}"
            for m in kinds
        )
        + ".",
        f"Mega-cache artifact: {cold['artifact_bytes']} bytes.",
        f"Secret bytes (parameters before and after, data, noise: {check['tensors']} tensors) "
        f"found in the artifact: {check['found_in_artifact']}; in the "
        f"{check['files_searched']} files of the cache folder: "
        f"{check['found_in_cache_files']}; positive control (a pickled parameter) found: "
        f"{check['positive_control']}.",
    ]
    if "first" in runs:
        lines += first_report(runs["first"], repeats)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="processes of each kind")
    parser.add_argument("--out", default="bench", help="folder for compile_time.json and .md")
    parser.add_argument("--child", nargs=3, metavar=("MODE", "FOLDER", "ARTIFACT"),
                        help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args()
    if args.child:
        mode, folder, artifact = args.child
        if mode.startswith("first:"):
            print(json.dumps(first_call(*mode.split(":")[1:])))
        else:
            print(json.dumps(child(mode, Path(folder), Path(artifact))))
        return
    runs: dict[str, Any] = {kind: [] for kind in KINDS}
    first = runs["first"] = {f"{w}:{v}": [] for w in FIRST_WORKLOADS for v in FIRST_VARIANTS}
    with tempfile.TemporaryDirectory(prefix="dpfunc-compile-") as scratch:
        for i in range(args.repeats):
            base = Path(scratch, f"run{i}")
            for kind, (_, mode, extra) in KINDS.items():
                folder = base / FOLDERS[kind]
                artifact = base / f"{FOLDERS['cold' if kind == 'mega' else kind]}.bin"
                runs[kind].append(run(mode, folder, artifact, extra))
                print(kind, i, [round(s, 2) for s in runs[kind][-1]["steps_s"]], flush=True)
            for key, done in first.items():  # each in a folder of its own
                done.append(run(f"first:{key}", base / key.replace(":", "-"), base / "-", {}))
                print(key, i, [round(s, 2) for s in done[-1]["calls_s"]], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile_time.json").write_text(json.dumps(runs, indent=1) + "\n")
    text = report(runs, args.repeats)
    (out / "compile_time.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
