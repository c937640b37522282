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
at most 50 ms (median), digits calibration at most 200 ms. The load column is the CPU
cores other processes took meanwhile (median over the repeats): on a shared machine the
figures rise with it.
"""

from __future__ import annotations

import argparse
import json
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
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench")
    parser.add_argument("--no-before", action="store_true", help="skip commit BEFORE's module")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        versions = {}
        if not args.no_before:
            versions["before"] = (tmp, before_package(Path(tmp)))
        versions["after"] = (str(ROOT), "dpfunc.accounting")
        results = measure(versions, args.repeats)
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
