"""What every benchmark in bench/ shares: settings, workloads, step builders, measuring, tables.

Imported by ``run.py`` (the step benchmark) and the other scripts here; it runs nothing by
itself. A workload is ``name -> () -> (model, inputs, labels)`` (``WORKLOADS``); a method is
``name -> builder(model, x, y) -> (step, params)`` (``METHODS``), where ``step()`` performs
one training step and ``params()`` returns the trained tensors. The builders take
``forward`` and ``criterion`` for models whose inputs are not one tensor (bench/hf.py:
Hugging Face models on (input_ids, attention_mask)); ``x`` may then be a tuple of tensors,
and ``y`` holds one row per example. ``bench_workload`` times the methods round-robin and
keeps the repeats during which other processes left the CPUs alone (``cpu_ticks``,
``other_cores``); ``peak_mb`` measures the extra memory of one step.
"""

from __future__ import annotations

import copy
import ctypes
import gc
import json
import os
import platform
import re
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere
import dpfunc  # noqa: E402
from dpfunc._compiling import compile_fullgraph  # noqa: E402

# --- settings -----------------------------------------------------------------

LR = 0.1  # SGD learning rate, every method
CLIP_NORM = 1.0  # C, the per-example clip bound (DP methods)
NOISE_MULTIPLIER = 1.0  # sigma; noise std is sigma * C
SEED = 0  # model initialisation and data
# steps per method: untimed warm-up, timed repeats, then extra steps for peak memory (max)
FULL = {"warmup": 3, "repeats": 17, "memory_steps": 2}
QUICK = {"warmup": 2, "repeats": 5, "memory_steps": 1}
QUIET_LOAD = 0.25  # a repeat is quiet if other processes used fewer cores than this meanwhile
MIN_QUIET = 5  # statistics use only the quiet repeats if there are this many, else all
OPACUS_MODES = ("hooks", "functorch", "ew", "ghost")  # Opacus grad_sample_mode values
# --quick skips these
COMPILED = (
    "nonprivate_compiled",
    "dpfunc_vmap_compiled",
    "dpfunc_ghost_compiled",
    "dpfunc_batched_compiled",
)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Dynamo refuses to trace nn.RNN / GRU / LSTM unless told to; dpfunc's ghost path runs them
# unrolled, which traces. Set for every method, so the compiled ones are compared alike.
torch._dynamo.config.allow_rnn = True
# Every workload compiles the same TrainStep.__call__ anew; torch's default of 8 recompiles per
# code object would fail the later workloads' compiled steps in this one process.
torch._dynamo.config.recompile_limit = 64

warnings.filterwarnings("ignore", category=UserWarning)  # Opacus and vmap are chatty
warnings.filterwarnings("ignore", category=FutureWarning)


# --- workloads: name -> () -> (model, inputs, labels) ------------------------------


class TransformerClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(1000, 128)
        layer = nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(128, 10)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)).mean(1))


class LSTMClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(1000, 64)
        self.lstm = nn.LSTM(64, 128, batch_first=True)
        self.head = nn.Linear(128, 10)

    def forward(self, tokens):
        _, (h, _) = self.lstm(self.embed(tokens))
        return self.head(h[-1])


def mlp():
    model = nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    return model, torch.randn(256, 784), torch.randint(10, (256,))


def cnn():
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 10),
    )  # fmt: skip
    return model, torch.randn(64, 3, 32, 32), torch.randint(10, (64,))


def transformer():
    return TransformerClassifier(), torch.randint(1000, (32, 64)), torch.randint(10, (32,))


def lstm():
    return LSTMClassifier(), torch.randint(1000, (64, 32)), torch.randint(10, (64,))


def digits_cnn():
    """A GroupNorm CNN the size of the digits demo's data: 8x8 images, expected batch 128."""
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.GroupNorm(4, 32), nn.ReLU(),
        nn.AvgPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, 10),
    )  # fmt: skip
    return model, torch.randn(128, 1, 8, 8), torch.randint(10, (128,))


WORKLOADS = {
    "mlp": mlp,
    "cnn": cnn,
    "transformer": transformer,
    "lstm": lstm,
    "digits_cnn": digits_cnn,
}


# --- methods: name -> builder(model, x, y) -> (step, params) ----------------------


def call_model(call, x):
    """The model's output on the inputs ``x``; ``call`` is the model (or a module wrapping
    it, or its functional_call). The builders' default ``forward``."""
    return call(x)


def batched(tree):
    """One example (a tensor or a tuple of them) as a batch of one."""
    return tuple(batched(t) for t in tree) if isinstance(tree, tuple) else tree.unsqueeze(0)


def to_device(tree):
    return tuple(to_device(t) for t in tree) if isinstance(tree, tuple) else tree.to(DEVICE)


def nonprivate(model, x, y, compile=False, forward=call_model, criterion=None):
    """Eager PyTorch; compiled: forward+loss under torch.compile (AOTAutograd compiles the
    backward with it), the SGD step stays eager. ``criterion`` (default cross-entropy)
    averages over the batch."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    criterion = nn.CrossEntropyLoss() if criterion is None else criterion

    def forward_loss(x, y):
        return criterion(forward(model, x), y)

    loss_of = torch.compile(forward_loss) if compile else forward_loss

    def step():
        loss_of(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, lambda: list(model.parameters())


def dpfunc_step(
    model, x, y, /, method, compile=False, forward=call_model, criterion=None, batch_loss=False
):
    """dpfunc.make_train_step(..., model=model, method=method), called with a full mask;
    drawing the noise tree is timed too. ``method="auto"`` (the default) picks ghost
    clipping where it covers the model and per-example gradients (vmap) elsewhere. The
    loss of one example is ``criterion`` on it as a batch of one; with ``batch_loss``,
    the loss is ``dpfunc.batched_loss`` of ``criterion`` with ``reduction="none"`` on the
    whole batch (the ghost pass runs the model batched). ``step.train_step`` is the
    TrainStep."""
    params, buffers = dpfunc.functionalize(model)
    criterion = nn.CrossEntropyLoss() if criterion is None else criterion

    def call_with(p):
        return lambda *args, **kwargs: torch.func.functional_call(model, (p, buffers), args, kwargs)

    def loss_fn(p, example):
        xi, yi = example
        return criterion(forward(call_with(p), batched(xi)), batched(yi))

    if batch_loss:
        criterion.reduction = "none"

        @dpfunc.batched_loss
        def loss_fn(p, batch):
            xb, yb = batch
            return criterion(forward(call_with(p), xb), yb)

    train_step = dpfunc.make_train_step(
        loss_fn, dpfunc.optim.sgd(lr=LR), clip_norm=CLIP_NORM,
        noise_multiplier=NOISE_MULTIPLIER, expected_batch_size=len(y),
        model=model, method=method,
    )  # fmt: skip
    # compiled as dpfunc compiles (compile=True): fullgraph, Dynamo's RNN support on and
    # logging calls (transformers' warning_once) left out of the graph
    call = compile_fullgraph(train_step) if compile else train_step
    mask = torch.ones(len(y), dtype=torch.bool, device=y.device)
    box = {"state": train_step.init(params), "i": 0}

    def step():
        noise = dpfunc.standard_normal_like(box["state"].params, seed=SEED, step=box["i"])
        box["state"], _ = call(box["state"], (x, y), mask, noise)
        box["i"] += 1

    step.train_step = train_step
    return step, lambda: list(box["state"].params.values())


def opacus(model, x, y, mode, forward=call_model, criterion=None):
    """Opacus 1.6 make_private on a fixed batch (no Poisson sampling); modules not swapped.
    ``criterion`` needs a ``reduction`` attribute ("mean"; ghost mode sets "none" and wants
    one loss per example)."""
    from opacus import PrivacyEngine

    criterion = nn.CrossEntropyLoss() if criterion is None else criterion
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    tensors = (*x, y) if isinstance(x, tuple) else (x, y)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(*tensors), batch_size=len(y)
    )
    private = PrivacyEngine().make_private(
        module=model, optimizer=opt, data_loader=loader, criterion=criterion,
        noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=CLIP_NORM,
        poisson_sampling=False, grad_sample_mode=mode,
    )  # fmt: skip
    if mode == "ghost":  # ghost clipping also wraps the loss: it runs the second backward
        gsm, dp_opt, criterion, _ = private
    else:
        gsm, dp_opt, _ = private

    def step():
        criterion(forward(gsm, x), y).backward()
        dp_opt.step()
        dp_opt.zero_grad(set_to_none=True)

    return step, lambda: list(model.parameters())


METHODS = {
    "nonprivate": nonprivate,
    "nonprivate_compiled": lambda m, x, y: nonprivate(m, x, y, compile=True),
    "dpfunc_vmap": lambda m, x, y: dpfunc_step(m, x, y, "vmap"),
    "dpfunc_vmap_compiled": lambda m, x, y: dpfunc_step(m, x, y, "vmap", compile=True),
    "dpfunc_ghost": lambda m, x, y: dpfunc_step(m, x, y, "auto"),
    "dpfunc_ghost_only": lambda m, x, y: dpfunc_step(m, x, y, "ghost"),
    "dpfunc_ghost_compiled": lambda m, x, y: dpfunc_step(m, x, y, "auto", compile=True),
    "dpfunc_batched": lambda m, x, y: dpfunc_step(m, x, y, "auto", batch_loss=True),
    "dpfunc_batched_compiled": lambda m, x, y: dpfunc_step(
        m, x, y, "auto", compile=True, batch_loss=True
    ),
    **{f"opacus_{m}": (lambda model, x, y, m=m: opacus(model, x, y, m)) for m in OPACUS_MODES},
}


# --- measuring ----------------------------------------------------------------


def short(e: BaseException, limit: int = 140) -> str:
    """``Type: first sentence`` of an exception, unwrapped from Opacus' error lists."""
    text = re.sub(r"^\[?\w+Error\(['\"]", "", " ".join(str(e).split()))
    text = f"{type(e).__name__}: " + re.split(r"(?<=\.)\s", text, maxsplit=1)[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def timed(step) -> float:
    """Seconds one call of ``step`` takes."""
    sync()
    start = time.perf_counter()
    step()
    sync()
    return time.perf_counter() - start


def _proc_status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


def peak_mb(step) -> float:
    """Extra memory (MiB) one call of ``step`` needs above what is held before it."""
    sync()
    gc.collect()
    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        sync()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap pages back, so reuse counts
    before = _proc_status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set size (VmHWM) to the current size
    step()
    return (_proc_status_kb("VmHWM") - before) / 1024


def cpu_ticks() -> tuple[int, int] | None:
    """(clock ticks all CPUs spent busy or stolen, ticks this process used); None off Linux."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
        with open("/proc/self/stat") as f:
            own = f.read().rpartition(")")[2].split()
    except (OSError, ValueError):
        return None
    busy = sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait; includes steal
    return busy, int(own[11]) + int(own[12])  # utime + stime, all threads


def other_cores(before, after, seconds: float) -> float | None:
    """CPU cores other processes (and the hypervisor) took between two cpu_ticks()."""
    if before is None or after is None:
        return None
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, others / os.sysconf("SC_CLK_TCK") / seconds)


def bench_workload(
    name, methods, warmup: int, repeats: int, memory_steps: int, skip: dict,
    workloads=None, builders=None,
):  # fmt: skip
    """Builds, warms up, times (round-robin) and measures every method on one workload.

    ``workloads`` and ``builders`` default to WORKLOADS and METHODS (bench/hf.py passes its own).
    """
    workloads = WORKLOADS if workloads is None else workloads
    builders = METHODS if builders is None else builders
    torch.manual_seed(SEED)
    model, x, y = workloads[name]()
    model, x, y = model.to(DEVICE), to_device(x), y.to(DEVICE)
    info = {
        "batch_size": len(y),
        "params": sum(p.numel() for p in model.parameters()),
        "methods": {},
    }
    steps = {}
    for method in methods:
        out = info["methods"][method] = {"status": "ok"}
        if method in skip:
            out["status"] = skip[method]
            continue
        try:
            step, params = builders[method](copy.deepcopy(model), x, y)
            out["first_call_s"] = timed(step)  # compiles here for compiled methods
            for _ in range(warmup - 1):
                step()
        except Exception as e:  # noqa: BLE001 - a method that fails is a result
            out["status"] = f"unsupported: {short(e)}"
        else:
            steps[method] = (step, params)
        print(f"  {name}/{method}: {out['status']}", flush=True)

    samples, loads = {method: [] for method in steps}, []
    order = list(steps)
    for r in range(repeats):
        ticks, start = cpu_ticks(), time.perf_counter()
        for method in order[r % len(order) :] + order[: r % len(order)]:  # rotate the start
            samples[method].append(timed(steps[method][0]) * 1000)
        loads.append(other_cores(ticks, cpu_ticks(), time.perf_counter() - start))
    quiet = [r for r, load in enumerate(loads) if load is None or load < QUIET_LOAD]
    used = quiet if len(quiet) >= MIN_QUIET else list(range(repeats))
    info.update(other_cores_per_repeat=loads, quiet_repeats=len(quiet), used_repeats=len(used))

    for method, (step, params) in steps.items():
        out, ms = info["methods"][method], sorted(samples[method][r] for r in used)
        quartiles = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3
        out.update(
            median_ms=statistics.median(ms), q1_ms=quartiles[0], q3_ms=quartiles[2],
            min_ms=ms[0], max_ms=ms[-1], samples_ms=[round(t, 3) for t in samples[method]],
            median_all_repeats_ms=statistics.median(samples[method]),
        )  # fmt: skip
        out["iqr_ms"] = out["q3_ms"] - out["q1_ms"]
        if method in COMPILED:
            out["compile_s"] = max(0.0, out["first_call_s"] - out["median_ms"] / 1000)
        try:
            out["peak_mb"] = max(peak_mb(step) for _ in range(memory_steps))
        except OSError as e:
            out["peak_mb"] = None
            out["memory_note"] = short(e)
        if not all(torch.isfinite(p).all() for p in params()):
            out["status"] = "ok, but parameters became non-finite"
        print(f"  {name}/{method}: {out['median_ms']:.2f} ms, {out['peak_mb']} MB", flush=True)
    del steps
    gc.collect()
    return info


# --- reporting ----------------------------------------------------------------


def fastest_opacus(methods: dict) -> str | None:
    ran = [m for m in methods if m.startswith("opacus_") and "median_ms" in methods[m]]
    return min(ran, key=lambda m: methods[m]["median_ms"]) if ran else None


def ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def header(results: dict, title: str) -> list[str]:
    """The title, the machine and settings, how to read the tables (the quick-mode note)."""
    machine = results["machine"]
    load = f"{machine['load_average_at_start'][0]:.1f}, {machine['load_average_at_end'][0]:.1f}"
    lines = [
        f"# {title}",
        "",
        f"torch {machine['torch']}, opacus {machine['opacus']}, dpfunc {machine['dpfunc']}, "
        f"python {machine['python']}; device {machine['device']} "
        f"({machine['cpu_count']} CPU cores, {machine['torch_threads']} torch threads). "
        f"Mode `{results['mode']}`: {results['settings']['warmup']} warm-up steps, "
        f"{results['settings']['repeats']} timed steps per method, round-robin; "
        f"total {results['total_s']:.0f} s; load average {load} (start, end).",
        "",
        f"A repeat (one step of every method) is quiet if other processes took under "
        f"{QUIET_LOAD} cores meanwhile; with at least {MIN_QUIET} quiet repeats the statistics "
        "use only those. "
        "ms/step: median (interquartile range); min ms: the fastest step. x non-private: "
        "over the eager non-private step. x best Opacus: over the fastest Opacus mode that "
        "ran. peak MB: extra memory one step needs above what the process held before it. "
        "compile s: first call minus a steady step (cold inductor cache).",
        "",
    ]
    if results["mode"] == "quick":
        lines += ["**Quick mode: compiled methods skipped (torch.compile takes 10-30 s per "
                  "graph on this machine); run without --quick for them.**", ""]  # fmt: skip
    return lines


AUTO_SLACK = 1.10  # eager method="auto" at most this over the faster of "ghost" and "vmap"


def auto_table(results: dict) -> list[str]:
    """Eager ``method="auto"`` (``dpfunc_ghost``) against the faster of the two paths it
    chooses between, ``dpfunc_ghost_only`` (method "ghost") and ``dpfunc_vmap``, by median."""
    lines = [
        "## method='auto' against the faster path (eager)",
        "",
        f'Target: `dpfunc_ghost` (method "auto") at most {AUTO_SLACK:g}x the faster of '
        '`dpfunc_ghost_only` (method "ghost") and `dpfunc_vmap`, by median ms.',
        "",
        "| workload | auto ms | ghost ms | vmap ms | auto / faster (target) | met |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, info in results["workloads"].items():
        m = info["methods"]
        auto, ghost, plain = (m.get(k, {}).get("median_ms") for k in
                              ("dpfunc_ghost", "dpfunc_ghost_only", "dpfunc_vmap"))  # fmt: skip
        if auto is None or (ghost is None and plain is None):
            continue
        ratio = auto / min(v for v in (ghost, plain) if v is not None)
        met = "yes" if ratio <= AUTO_SLACK else "**no**"
        row = [name, fmt(auto, ".2f"), fmt(ghost, ".2f"), fmt(plain, ".2f"),
               f"{ratio:.2f}x (<= {AUTO_SLACK:g}x)", met]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    return lines + [""]


def workload_tables(results: dict) -> list[str]:
    """One section per workload: a summary line and a row per method."""
    lines = []
    for name, info in results["workloads"].items():
        methods = info["methods"]
        base = methods.get("nonprivate", {})
        best = fastest_opacus(methods)
        best_ms = methods[best]["median_ms"] if best else None
        ran = {m: v for m, v in methods.items() if "median_ms" in v}
        dp = [m for m in ran if m.startswith("dpfunc")]
        trained = info.get("trainable_params", info["params"])
        counts = f"{info['params']:,} parameters" + (
            f", {trained:,} trainable" if trained != info["params"] else ""
        )
        summary = f"**{name}** (batch {info['batch_size']}, {counts}): "
        if dp:
            fast = min(dp, key=lambda m: ran[m]["median_ms"])
            summary += (
                f"fastest dpfunc is `{fast}` at {ran[fast]['median_ms']:.1f} ms, "
                f"{ratio(ran[fast]['median_ms'], base.get('median_ms'))} the non-private step"
            )
            summary += (
                f" and {ratio(ran[fast]['median_ms'], best_ms)} `{best}` "
                f"({best_ms:.1f} ms), the fastest Opacus mode."
                if best
                else "; no Opacus mode runs this model."
            )
        else:
            summary += "no dpfunc method ran."
        if ran:
            repeats, used = results["settings"]["repeats"], info["used_repeats"]
            if used < repeats:
                summary += f" Statistics over the {used} quiet repeats of {repeats}."
            elif info["quiet_repeats"] < MIN_QUIET:
                summary += (
                    f" Busy machine: only {info['quiet_repeats']} of {repeats} repeats "
                    "were quiet, so these times are inflated; rerun when it is idle."
                )
            else:
                summary += f" All {repeats} repeats were quiet."
        if any(v["iqr_ms"] > 0.5 * v["median_ms"] for v in ran.values()):
            summary += (" Noisy: some interquartile range exceeds half the median (a busy "
                        "machine); the min column is closer to the unloaded speed.")  # fmt: skip
        lines += [
            f"## {name}",
            "",
            summary,
            "",
            "| method | ms/step | min ms | x non-private | x best Opacus | peak MB "
            "| x non-private memory | compile s | status |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for method, v in methods.items():
            ms = v.get("median_ms")
            cells = [
                f"`{method}`",
                f"{ms:.2f} ({v['iqr_ms']:.2f})" if ms is not None else "-",
                fmt(v.get("min_ms"), ".2f"),
                ratio(ms, base.get("median_ms")),
                ratio(ms, best_ms),
                fmt(v.get("peak_mb"), ".1f"),
                ratio(v.get("peak_mb"), base.get("peak_mb")),
                fmt(v.get("compile_s"), ".1f"),
                v["status"].replace("|", "/"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def new_results(quick: bool, settings: dict) -> dict:
    """The results record before any workload: machine, mode, settings."""
    import opacus

    return {
        "machine": {
            "torch": torch.__version__, "opacus": opacus.__version__,
            "dpfunc": dpfunc.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu",
            "load_average_at_start": os.getloadavg(),
        },
        "mode": "quick" if quick else "full",
        "settings": {
            **settings, "lr": LR, "clip_norm": CLIP_NORM, "noise_multiplier": NOISE_MULTIPLIER,
            "dtype": "float32", "quiet_load": QUIET_LOAD, "min_quiet": MIN_QUIET,
        },
        "workloads": {},
    }  # fmt: skip


NOTES = "<!-- notes: kept when the tables above are written again -->"


def write_results(results: dict, out: Path, stem: str, text: str) -> None:
    """Writes out/STEM.json (every number) and out/STEM.md (``text``), and prints the latter.

    What an earlier STEM.md holds below the :data:`NOTES` line (the reading of
    the figures, written by hand) is kept after ``text``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1, allow_nan=False) + "\n")
    md = out / f"{stem}.md"
    notes = md.read_text().partition(NOTES)[2] if md.exists() else ""
    md.write_text(text if not notes else text.rstrip("\n") + "\n\n" + NOTES + notes)
    print(text)
    print(f"wrote {out / stem}.json and {out / stem}.md in {results['total_s']:.0f} s")
