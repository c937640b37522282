"""Benchmark privacy accounting as a run pays for it: imports, calibration, epsilon per epoch.

Run from the repository root:

    .venv/bin/python bench/accounting.py              # writes bench/accounting.{json,md}
    .venv/bin/python bench/accounting.py --repeats 3 --out DIR
    .venv/bin/python bench/accounting.py --no-before  # only the working tree's module

Every measurement runs in a fresh process (``sys.executable -c ...``), so nothing cached
by an earlier measurement helps it; each is repeated ``--repeats`` times (default 5) and
the table gives the median and the fastest of the repeats. Inside a process the imports
come first and are timed apart from the work.

* imports: ``import dp_accounting`` alone, and ``import dpfunc`` (torch included), each
  in its own process;
* calibration: ``calibrate_noise_multiplier(3.0, 1e-5, q, steps)`` (PLD) for the digits
  run (1437 examples, expected batch 128, 10 epochs: q = 128/1437, 110 steps), the
  digits example's defaults (full batch, q = 1, 40 steps) and a 20-epoch run at
  q = 0.005 (3900 steps);
* epsilon per epoch: an ``Accountant`` records one epoch of steps, then ``epsilon(1e-5)``
  is timed, 20 times: 195 steps per epoch at q = 0.005 (sigma 0.78) and 11 steps per
  epoch at q = 0.09 (sigma 2.2). The figure is the median over the 20 epochs of a
  process (the first epoch, which builds the one-step distribution, is reported apart).

"before" is ``dpfunc/accounting.py`` as of commit ``BEFORE`` (loaded from a temporary
copy with its ``checks.py``); "after" is the working tree's. Targets: epsilon per epoch
at most 50 ms (median), digits calibration at most 200 ms, or at most a quarter of
Opacus' PRV calibration (``get_noise_multiplier(..., accountant="prv")``, timed the same
way, in fresh processes, alternating with dpfunc's). The load column is the CPU cores
other processes took meanwhile (median over the repeats): on a shared machine the
figures rise with it.

``--grid N`` (default 240; 0 skips it) also checks the promises on a seeded random grid
against ``dp_accounting``'s ``PLDAccountant`` (grid 1e-4) run from scratch on the same
events: single runs (a quarter of them in the region of sigma 4.5-6.5, q 0.04-0.3,
1e4-5e4 steps, delta 1e-11..1e-7, just above the hand-over to the library), and one in
eight a history of 2-4 runs. Each case records dpfunc's epsilon (caches cleared), the
library's, who decided (fast composition, library, coarse grid or RDP with a warning,
or a ``ValueError``), and both times; the table gives the count below the library (the
promise: none) and the largest ratio dpfunc / library per delta band.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "7d605da"  # the last commit with the uncached accountant
TARGET_EPOCH_S = 0.050
TARGET_CALIBRATION_S = 0.200
DELTA = 1e-5
CALIBRATIONS = {  # name -> (target epsilon, sample rate, steps)
    "digits, batch 128, 10 epochs": (3.0, 128 / 1437, 110),
    "digits example defaults (full batch, 40 steps)": (3.0, 1.0, 40),
    "20 epochs at q = 0.005": (3.0, 0.005, 3900),
}
EPOCHS = {  # name -> (noise multiplier, sample rate, steps per epoch)
    "q = 0.005, 195 steps/epoch": (0.78, 0.005, 195),
    "q = 0.09, 11 steps/epoch": (2.2, 0.09, 11),
}
EPOCH_COUNT = 20
OPACUS_RUN = "digits, batch 128, 10 epochs"  # the calibration also timed with Opacus' PRV
GRID_SEED = 20240611
DELTA_BANDS = ((1e-6, 1.0), (1e-8, 1e-6), (1e-10, 1e-8), (0.0, 1e-10))

IMPORT_CODE = """
import json, time
t = time.perf_counter()
import {module}
print(json.dumps({{"seconds": time.perf_counter() - t}}))
"""

CALIBRATION_CODE = """
import json, sys, time
sys.path.insert(0, {path!r})
t = time.perf_counter()
import {module} as accounting
imported = time.perf_counter() - t
t = time.perf_counter()
sigma = accounting.calibrate_noise_multiplier({target!r}, {delta!r}, {rate!r}, {steps!r})
seconds = time.perf_counter() - t
print(json.dumps({{"seconds": seconds, "import": imported, "sigma": sigma}}))
"""

OPACUS_CODE = """
import json, time, warnings
t = time.perf_counter()
from opacus.accountants.utils import get_noise_multiplier
imported = time.perf_counter() - t
warnings.simplefilter("ignore")
t = time.perf_counter()
sigma = get_noise_multiplier(
    target_epsilon={target!r}, target_delta={delta!r}, sample_rate={rate!r}, steps={steps!r},
    accountant="prv",
)
seconds = time.perf_counter() - t
print(json.dumps({{"seconds": seconds, "import": imported, "sigma": sigma}}))
"""

EPOCH_CODE = """
import json, sys, time
sys.path.insert(0, {path!r})
import {module} as accounting
acc = accounting.Accountant()
times, eps = [], []
for _ in range({epochs!r}):
    acc.step({sigma!r}, {rate!r}, steps={steps!r})
    t = time.perf_counter()
    eps.append(acc.epsilon({delta!r}))
    times.append(time.perf_counter() - t)
print(json.dumps({{"times": times, "epsilons": eps}}))
"""


def busy_ticks() -> int | None:
    """Clock ticks all CPUs spent busy (or stolen) so far; None off Linux."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return sum(ticks) - ticks[3] - ticks[4]


def run(code: str) -> tuple[dict, float | None]:
    """Runs ``code`` in a fresh interpreter; its JSON line, and the cores others took."""
    before, children = busy_ticks(), resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    wall = time.perf_counter() - start
    after, done = busy_ticks(), resource.getrusage(resource.RUSAGE_CHILDREN)
    load = None
    if before is not None and after is not None:
        child = (done.ru_utime + done.ru_stime) - (children.ru_utime + children.ru_stime)
        others = (after - before) / os.sysconf("SC_CLK_TCK") - child
        load = max(0.0, others / wall)
    return json.loads(out.strip().splitlines()[-1]), load


def summary(values: list[float], loads: list) -> dict:
    known = [x for x in loads if x is not None]
    return {
        "median_s": statistics.median(values),
        "min_s": min(values),
        "samples_s": values,
        "other_cores": statistics.median(known) if known else None,
    }


def before_package(tmp: Path) -> str:
    """Writes commit BEFORE's accounting module (and its checks) as package ``before``."""
    package = tmp / "before"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in ("accounting.py", "checks.py"):
        text = subprocess.run(
            ["git", "show", f"{BEFORE}:dpfunc/{name}"],
            capture_output=True, text=True, check=True, cwd=ROOT,
        ).stdout  # fmt: skip
        (package / name).write_text(text)
    return "before.accounting"


def measure(versions: dict[str, tuple[str, str]], repeats: int) -> dict:
    """All measurements, ``versions`` mapping a label to (sys.path entry, module name)."""
    results: dict = {"imports": {}, "calibration": {}, "epoch": {}}
    for module in ("dp_accounting", "dpfunc"):
        samples = [run(IMPORT_CODE.format(module=module)) for _ in range(repeats)]
        results["imports"][module] = summary(
            [s["seconds"] for s, _ in samples], [x for _, x in samples]
        )
    for label, (path, module) in versions.items():
        for name, (target, rate, steps) in CALIBRATIONS.items():
            code = CALIBRATION_CODE.format(
                path=path, module=module, target=target, delta=DELTA, rate=rate, steps=steps
            )
            samples = [run(code) for _ in range(repeats)]
            entry = summary([s["seconds"] for s, _ in samples], [x for _, x in samples])
            entry["sigma"] = samples[0][0]["sigma"]
            entry["import_median_s"] = statistics.median(s["import"] for s, _ in samples)
            results["calibration"].setdefault(name, {})[label] = entry
            print(f"calibration {label:6} {name}: {entry['median_s']:.3f} s", flush=True)
        for name, (sigma, rate, steps) in EPOCHS.items():
            code = EPOCH_CODE.format(
                path=path, module=module, epochs=EPOCH_COUNT, sigma=sigma, rate=rate,
                steps=steps, delta=DELTA,
            )  # fmt: skip
            samples = [run(code) for _ in range(repeats)]
            per_process = [statistics.median(s["times"]) for s, _ in samples]
            entry = summary(per_process, [x for _, x in samples])
            entry["first_epoch_median_s"] = statistics.median(s["times"][0] for s, _ in samples)
            entry["last_epsilon"] = samples[0][0]["epsilons"][-1]
            entry["times_s"] = [s["times"] for s, _ in samples]
            results["epoch"].setdefault(name, {})[label] = entry
            print(f"epoch       {label:6} {name}: {entry['median_s']:.4f} s", flush=True)
    return results


def measure_opacus(repeats: int) -> dict:
    """``OPACUS_RUN``'s calibration by dpfunc and by Opacus' PRV accountant, alternating."""
    target, rate, steps = CALIBRATIONS[OPACUS_RUN]
    codes = {
        "dpfunc (PLD)": CALIBRATION_CODE.format(
            path=str(ROOT), module="dpfunc.accounting", target=target, delta=DELTA, rate=rate,
            steps=steps,
        ),
        "Opacus 1.6 (PRV)": OPACUS_CODE.format(target=target, delta=DELTA, rate=rate, steps=steps),
    }  # fmt: skip
    samples: dict = {name: [] for name in codes}
    for _ in range(repeats):
        for name, code in codes.items():
            samples[name].append(run(code))
    results = {}
    for name, runs in samples.items():
        entry = summary([s["seconds"] for s, _ in runs], [x for _, x in runs])
        entry["sigma"] = runs[0][0]["sigma"]
        entry["import_median_s"] = statistics.median(s["import"] for s, _ in runs)
        results[name] = entry
        print(f"calibration {name}: {entry['median_s']:.3f} s", flush=True)
    return results


def grid_cases(count: int, seed: int) -> list[tuple[tuple[tuple[float, float, int], ...], float]]:
    """``count`` seeded ``(runs, delta)``: single runs (a quarter near the old hand-over), and
    one in eight a history of 2-4 runs; only cases whose RDP epsilon is in [0.02, 150]."""
    import numpy as np

    from dpfunc import accounting

    rng = np.random.default_rng(seed)

    def general(max_steps: float) -> tuple[float, float, int]:
        sigma = float(np.exp(rng.uniform(np.log(0.5), np.log(10.0))))
        rate = 1.0 if rng.random() < 0.1 else float(np.exp(rng.uniform(np.log(1e-3), 0.0)))
        return sigma, rate, int(np.exp(rng.uniform(0.0, np.log(max_steps))))

    cases: list = []
    while len(cases) < count:
        kind = len(cases) % 8
        if kind == 7:
            runs = tuple(general(1e4) for _ in range(int(rng.integers(2, 5))))
            delta = float(np.exp(rng.uniform(np.log(1e-12), np.log(1e-3))))
        elif kind % 4 == 0:
            runs = (
                (float(rng.uniform(4.5, 6.5)), float(rng.uniform(0.04, 0.3)),
                 int(rng.uniform(1e4, 5e4))),
            )  # fmt: skip
            delta = float(np.exp(rng.uniform(np.log(1e-11), np.log(1e-7))))
        else:
            runs = (general(5e4),)
            delta = float(np.exp(rng.uniform(np.log(1e-12), np.log(1e-3))))
        acc = accounting.Accountant(method="rdp")
        for run_ in runs:
            acc.step(*run_)
        if 0.02 < acc.epsilon(delta) < 150:
            cases.append((runs, delta))
    return cases


def grid(count: int, seed: int = GRID_SEED) -> dict:
    """dpfunc's PLD epsilon against ``dp_accounting``'s ``PLDAccountant`` from scratch."""
    import warnings

    import dp_accounting

    from dpfunc import accounting, pld

    library_calls = []
    library = accounting._library_epsilon

    def counted(*args):  # who decided: dpfunc calls the library where it hands over
        library_calls.append(args)
        return library(*args)

    accounting._library_epsilon = counted
    rows = []
    try:
        for i, (runs, delta) in enumerate(grid_cases(count, seed)):
            for cache in (accounting._runs_result, pld.step_losses, accounting._rdp_orders):
                cache.cache_clear()
            acc = accounting.Accountant()
            for run_ in runs:
                acc.step(*run_)
            library_calls.clear()
            start = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    ours, route = acc.epsilon(delta), "fast"
                except ValueError as error:
                    ours, route = None, f"ValueError: {error}"
            ours_s = time.perf_counter() - start
            if route == "fast" and library_calls:
                route = "library"
            if caught:
                route = "fallback: " + str(caught[0].message)
            start = time.perf_counter()
            theirs = dp_accounting.pld.PLDAccountant(
                dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
                value_discretization_interval=1e-4,
            )
            theirs.compose(
                dp_accounting.ComposedDpEvent(
                    [
                        dp_accounting.SelfComposedDpEvent(
                            dp_accounting.PoissonSampledDpEvent(
                                q, dp_accounting.GaussianDpEvent(s)
                            ),
                            t,
                        )
                        for s, q, t in acc.history
                    ]
                )
            )
            lib = float(theirs.get_epsilon(delta))
            lib_s = time.perf_counter() - start
            ratio = (
                None
                if ours is None
                else (ours / lib if lib > 0 else (1.0 if ours == 0 else math.inf))
            )
            rows.append({
                "runs": [list(r) for r in acc.history], "delta": delta, "dpfunc": ours,
                "library": lib, "ratio": ratio, "route": route, "dpfunc_s": ours_s,
                "library_s": lib_s,
            })  # fmt: skip
            print(
                f"grid {i:3d} {route[:12]:12} ratio {ratio} ({ours_s:.2f} s; library "
                f"{lib_s:.2f} s)",
                flush=True,
            )
    finally:
        accounting._library_epsilon = library
    return {"seed": seed, "cases": rows}


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}" if seconds >= 0.01 else f"{seconds * 1e3:.1f}"


def load(entry: dict) -> str:
    return "" if entry.get("other_cores") is None else f"{entry['other_cores']:.1f}"


def table(results: dict) -> str:
    lines = [
        "# Accounting cost (fresh process per measurement)",
        "",
        f"{results['repeats']} repeats each; median (fastest) in ms. Machine: "
        f"{results['machine']}. Written by `bench/accounting.py`.",
        "",
        "## Imports",
        "",
        "| module | median | fastest | other cores busy |",
        "| --- | ---: | ---: | ---: |",
    ]
    for module, entry in results["imports"].items():
        figures = f"{ms(entry['median_s'])} | {ms(entry['min_s'])} | {load(entry)}"
        lines.append(f"| `import {module}` | {figures} |")
    lines += [
        "",
        "## Calibration, `calibrate_noise_multiplier(3.0, 1e-5, q, steps)` (PLD)",
        "",
        f"Target for the digits runs: at most {ms(TARGET_CALIBRATION_S)} ms, imports excluded.",
        "",
        "| run | version | median | fastest | sigma | other cores busy |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for name, by_version in results["calibration"].items():
        for label, entry in by_version.items():
            lines.append(
                f"| {name} | {label} | {ms(entry['median_s'])} | {ms(entry['min_s'])} | "
                f"{entry['sigma']:.5f} | {load(entry)} |"
            )
    lines += [
        "",
        f"## Epsilon after each epoch, `Accountant.epsilon(1e-5)`, {EPOCH_COUNT} epochs",
        "",
        f"Target: median at most {ms(TARGET_EPOCH_S)} ms. Median over the epochs of a "
        "process, then median (fastest) over the processes; the first epoch builds the "
        "one-step distribution and is shown apart.",
        "",
        "| run | version | median | fastest | first epoch | epsilon after 20 | other cores busy |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, by_version in results["epoch"].items():
        for label, entry in by_version.items():
            lines.append(
                f"| {name} | {label} | {ms(entry['median_s'])} | {ms(entry['min_s'])} | "
                f"{ms(entry['first_epoch_median_s'])} | {entry['last_epsilon']:.6f} | "
                f"{load(entry)} |"
            )
    if results.get("opacus"):
        entries = results["opacus"]
        ours, theirs = entries["dpfunc (PLD)"], entries["Opacus 1.6 (PRV)"]
        lines += [
            "",
            f"## Calibration against Opacus' PRV accountant ({OPACUS_RUN})",
            "",
            f"`calibrate_noise_multiplier(3.0, 1e-5, q, steps)` against Opacus' "
            '`get_noise_multiplier(..., accountant="prv")` for the same run, each in a fresh '
            "process, alternating; imports excluded. Target: at most "
            f"{ms(TARGET_CALIBRATION_S)} ms, or at most a quarter of Opacus'.",
            "",
            "| accountant | median | fastest | sigma | other cores busy |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for name, entry in entries.items():
            lines.append(
                f"| {name} | {ms(entry['median_s'])} | {ms(entry['min_s'])} | "
                f"{entry['sigma']:.5f} | {load(entry)} |"
            )
        lines += [
            "",
            f"dpfunc / Opacus (medians): {ours['median_s'] / theirs['median_s']:.2f}.",
        ]
    if results.get("grid"):
        lines += grid_table(results["grid"])
    return "\n".join(lines) + "\n"


def grid_table(grid_results: dict) -> list[str]:
    """The grid's summary: count below the library, largest ratio per delta band, routes."""
    rows = grid_results["cases"]
    answered = [r for r in rows if r["ratio"] is not None]
    below = [r for r in answered if r["ratio"] < 1]
    routes: dict = {}
    for r in rows:
        key = r["route"].split(":")[0]
        routes[key] = routes.get(key, 0) + 1
    lines = [
        "",
        "## Promises on a random grid, against dp-accounting from scratch",
        "",
        f"{len(rows)} cases (seed {grid_results['seed']}; `grid_cases` says how they are "
        f"drawn), dpfunc's caches cleared before each: {len(below)} below the library's "
        f"`PLDAccountant` (grid 1e-4) run from scratch on the same events; largest ratio "
        f"dpfunc / library {max(r['ratio'] for r in answered):.7f}. Who decided: "
        + ", ".join(f"{k} {v}" for k, v in sorted(routes.items()))
        + ".",
        "",
        "| delta | cases | below | largest ratio - 1 | dpfunc median / max (s) "
        "| library median (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for low, high in DELTA_BANDS:
        band = [r for r in answered if low <= r["delta"] < high]
        if not band:
            continue
        worst = max(r["ratio"] for r in band) - 1
        times = [r["dpfunc_s"] for r in band]
        lines.append(
            f"| [{low:g}, {high:g}) | {len(band)} | {sum(r['ratio'] < 1 for r in band)} | "
            f"{worst:.2e} | {statistics.median(times):.3f} / {max(times):.2f} | "
            f"{statistics.median(r['library_s'] for r in band):.2f} |"
        )
    refused = [r for r in rows if r["ratio"] is None]
    for r in refused:
        lines.append(f"\nRefused: {r['runs']} at delta {r['delta']:.3g}: {r['route']}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench")
    parser.add_argument("--no-before", action="store_true", help="skip commit BEFORE's module")
    parser.add_argument("--grid", type=int, default=240, help="random grid cases (0: none)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        versions = {}
        if not args.no_before:
            versions["before"] = (tmp, before_package(Path(tmp)))
        versions["after"] = (str(ROOT), "dpfunc.accounting")
        results = measure(versions, args.repeats)
    results["opacus"] = measure_opacus(args.repeats)
    if args.grid:
        results["grid"] = grid(args.grid)
    results.update(
        repeats=args.repeats,
        before_commit=BEFORE,
        machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}",
        targets={"epoch_s": TARGET_EPOCH_S, "calibration_s": TARGET_CALIBRATION_S},
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "accounting.json").write_text(json.dumps(results, indent=1) + "\n")
    text = table(results)
    (args.out / "accounting.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
