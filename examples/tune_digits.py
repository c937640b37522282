"""The validation search behind the defaults of ``examples/digits.py``.

No test data is used. The demo's training 80% of digits (1437 images, the
same split as the demo) is split again, stratified, into a tuning-train part
(80%, 1149 images) and a validation part (20%, 288 images), ``REPEATS``
times: repeat ``r`` uses split ``r`` and the public training seed ``r``
(reproducible research: a private run keeps the Trainer's secret default). Every candidate
trains on the tuning-train part with the demo's own pipeline (``digits.train``,
i.e. ``dpfunc.Trainer``) and is scored by its validation accuracy, averaged
over the repeats (standard error about 0.4 points at 0.93).

Settings are in terms that carry over to the full training set: the sample
rate (the expected batch is ``sample_rate * n``) and the number of steps.
The noise multiplier depends only on (epsilon, delta, sample rate, steps),
so it is the same on the full training set, where the noise of the averaged
gradient, ``sigma * C / (sample_rate * n)``, is then 20% smaller.

Two stages:

1. the schedule, for the default model (softmax regression on [-1, 1]
   pixels, normalized clipping, SGD with momentum 0.9): sample rate x steps x
   learning rate, for each target epsilon and for the non-private baseline;
2. everything else, at the demo's schedule (``digits.SCHEDULE``): pixel
   scaling, optimizer (momentum, weight decay, Adam), clipping (flat with two
   clip norms), model (tanh MLPs), each over learning rates
   ``LR_FACTORS x`` the schedule's learning rate (times its own scale).

Prints the candidates sorted by validation accuracy and writes every result
to ``<out>/tune_digits.json``.

Run (one thread each, so the two stages can run side by side on 2 CPU cores;
stage 1 takes about 15 minutes, stage 2 about 25, most of it the non-private
320-step MLP candidates):

    python examples/tune_digits.py --stage 1      # the schedule search
    python examples/tune_digits.py --stage 2      # the other choices
    python examples/tune_digits.py                # both, one after the other
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time

import digits  # examples/digits.py: the demo's data, model and training pipeline
import torch
from sklearn.model_selection import train_test_split

# --- settings ---------------------------------------------------------------
TARGET_EPSILONS = [1.0, 3.0, 8.0, None]  # the demo's budgets (delta = digits.DELTA); None: no DP
REPEATS = 10  # repeat r: validation split r and training seed r; the score is the mean
VALIDATION_FRACTION = 0.2  # share of the training 80% held out for validation
# stage 1: the schedule (for None, the non-private baseline: NONPRIVATE_STEPS at digits' rate)
SAMPLE_RATES = [0.25, 0.5, 1.0]  # Poisson sampling rates (1.0 is full batch)
STEPS = [10, 20, 40, 80]  # numbers of private steps
NONPRIVATE_STEPS = [80, 160, 320]  # numbers of non-private steps
LRS = [0.5, 1.0, 2.0, 4.0, 8.0]  # SGD learning rates (normalized clipping: unit-norm gradients)
# stage 2: one change at a time from the demo's defaults; "lr_scale" times the schedule's lr
VARIANTS = [
    dict(name="default"),
    dict(name="pixels in [-1, 1], not centred", pixels="symmetric"),
    dict(name="pixels in [0, 1]", pixels="unit"),
    dict(name="momentum 0.5", momentum=0.5),
    dict(name="momentum 0.95", momentum=0.95),
    dict(name="weight decay 0.01", weight_decay=0.01),
    dict(name="adam", optimizer="adam", lr_scale=0.025),
    dict(name="flat clipping C=1", clipping="flat", clip_norm=1.0),
    dict(name="flat clipping C=3", clipping="flat", clip_norm=3.0, lr_scale=1 / 3),
    dict(name="mlp, 16 tanh units", model="mlp", hidden=16, lr_scale=0.5),
    dict(name="mlp, 32 tanh units", model="mlp", hidden=32, lr_scale=0.5),
]
LR_FACTORS = [0.5, 1.0, 2.0]  # stage 2 learning-rate grid, relative to lr_scale * schedule lr
# --smoke: two repeats, one budget, a two-point grid; checks that the script runs
SMOKE = dict(
    TARGET_EPSILONS=[3.0], REPEATS=2, SAMPLE_RATES=[1.0], STEPS=[4], LRS=[2.0],
    VARIANTS=VARIANTS[:2], LR_FACTORS=[1.0],
)  # fmt: skip


def split(train_set, repeat: int):
    """The tuning-train and validation parts of the demo's training set, split ``repeat``."""
    x, y = train_set
    x_fit, x_val, y_fit, y_val = train_test_split(
        x, y, test_size=VALIDATION_FRACTION, stratify=y, random_state=repeat
    )
    return (x_fit, y_fit), (x_val, y_val)


def main(stage: int | None, out: str, smoke: bool = False) -> None:
    if smoke:
        globals().update(SMOKE)
    torch.set_num_threads(digits.THREADS)
    os.makedirs(out, exist_ok=True)
    data = {  # the demo's training 80% only: no test data
        pixels: [split(digits.load_data(pixels)[0], r) for r in range(REPEATS)]
        for pixels in ("centered", "symmetric", "unit")
    }
    sigmas = {}  # (epsilon, sample_rate, steps) -> calibrated noise multiplier
    results = []

    def score(stage, name, epsilon, sample_rate, steps, lr, pixels=digits.PIXELS, **config):
        """Mean validation accuracy over the REPEATS of one candidate."""
        key = (epsilon, sample_rate, steps)
        if epsilon is None:
            sigmas[key] = 0.0
        accuracies = []
        started = time.perf_counter()
        for repeat, (fit_set, val_set) in enumerate(data[pixels]):
            trainer, net = digits.train(
                fit_set,
                seed=repeat,
                steps=steps,
                lr=lr,
                sample_rate=sample_rate,
                noise_multiplier=sigmas.get(key),
                target_epsilon=None if key in sigmas else epsilon,
                use_fit=False,  # no per-epoch epsilon: only the final one matters here
                **config,
            )
            sigmas[key] = trainer.noise_multiplier
            accuracies.append(digits.accuracy(net, val_set))
        results.append(
            dict(
                stage=stage,
                name=name,
                epsilon=epsilon,
                sample_rate=sample_rate,
                steps=steps,
                lr=lr,
                pixels=pixels,
                **config,
                noise_multiplier=sigmas[key],
                val_accuracy=statistics.fmean(accuracies),
                val_accuracy_sem=statistics.stdev(accuracies) / len(accuracies) ** 0.5,
                val_accuracies=accuracies,
                seconds=time.perf_counter() - started,
            )
        )
        r = results[-1]
        print(
            f"[{stage}] eps={epsilon} q={sample_rate} steps={steps} lr={lr:.4g} {name}: "
            f"sigma={r['noise_multiplier']:.2f} val={r['val_accuracy']:.4f} "
            f"({r['seconds']:.1f} s)",
            flush=True,
        )

    def report(stage, epsilon, top):
        rows = [r for r in results if r["stage"] == stage and r["epsilon"] == epsilon]
        rows.sort(key=lambda r: r["val_accuracy"], reverse=True)
        print(f"\nstage {stage}, epsilon {epsilon}: best {top} of {len(rows)}")
        for r in rows[:top]:
            print(
                f"  {r['val_accuracy']:.4f} +- {r['val_accuracy_sem']:.4f}  q={r['sample_rate']:<5}"
                f" steps={r['steps']:<4} lr={r['lr']:<7.4g} {r['name']}"
            )
        print()

    if stage in (None, 1):
        for epsilon in TARGET_EPSILONS:
            if epsilon is None:
                grid = itertools.product([digits.SAMPLE_RATE], NONPRIVATE_STEPS, LRS)
            else:
                grid = itertools.product(SAMPLE_RATES, STEPS, LRS)
            for sample_rate, steps, lr in grid:
                score(1, "default", epsilon, sample_rate, steps, lr)
            report(1, epsilon, top=10)

    if stage in (None, 2):
        for epsilon in TARGET_EPSILONS:
            steps, lr = digits.SCHEDULE[epsilon]
            steps = STEPS[0] if smoke else steps
            for variant in VARIANTS:
                config = {k: v for k, v in variant.items() if k not in ("name", "lr_scale")}
                for factor in LR_FACTORS:
                    candidate_lr = lr * variant.get("lr_scale", 1.0) * factor
                    score(
                        2,
                        variant["name"],
                        epsilon,
                        digits.SAMPLE_RATE,
                        steps,
                        candidate_lr,
                        **config,
                    )
            report(2, epsilon, top=len(VARIANTS) * len(LR_FACTORS))

    name = "tune_digits.json" if stage is None else f"tune_digits_stage{stage}.json"
    path = os.path.join(out, name)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"saved {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, choices=[1, 2], help="run only this stage")
    parser.add_argument("--out", default="results", help="directory for the JSON results")
    parser.add_argument("--smoke", action="store_true", help="two repeats, a tiny grid")
    args = parser.parse_args()
    main(args.stage, args.out, args.smoke)
