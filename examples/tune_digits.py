"""The validation search behind the defaults of ``examples/digits.py``.

This search is itself NOT accounted. It reads the private training set
(through validation splits of it) many times to choose the features, the
schedule and the rest, and choosing hyperparameters on private data leaks
about it too (Papernot & Steinke 2022, "Hyperparameter tuning with Renyi
differential privacy"); the demo's epsilon covers the final training run
only. Read the defaults as a starting point for other data, chosen once on
this public data set, and do not re-run the search on each new private data
set without accounting for it.

No test data is used. The demo's training 80% of digits (1437 images, the
same split as the demo) is split again, stratified, into a tuning-train part
(80%, 1149 images) and a validation part (20%, 288 images), ``REPEATS``
times: repeat ``r`` uses split ``r`` and the public training seed ``r``
(reproducible research: a private run keeps the Trainer's secret default).
Every candidate trains on the tuning-train part with the demo's own pipeline
(``digits.featurize`` and ``digits.train``, i.e. ``dpfunc.Trainer``) and is
scored by its validation accuracy, averaged over the repeats (standard error
about 0.3 to 0.7 points).

Settings are in terms that carry over to the full training set: the sample
rate (the expected batch is ``sample_rate * n``) and the number of steps.
The noise multiplier depends only on (epsilon, delta, sample rate, steps),
so it is the same on the full training set, where the noise of the averaged
gradient, ``sigma * C / (sample_rate * n)``, is then 20% smaller.

Three stages:

1. the schedule, for the demo's defaults (features, model, clipping, SGD
   with momentum 0.9, full batch): steps x learning rate for each target
   epsilon, and for the non-private baseline. A candidate replaces the
   current schedule only if it beats it by more than one standard error
   (none did);
2. the techniques, one change at a time from the demo's defaults at the
   demo's schedule (``digits.SCHEDULE``), each over learning rates
   ``LR_FACTORS x`` the schedule's (times the variant's own scale): the
   features (pixels only, no per-example normalisation, both removed, i.e.
   the old default; 8 edge orientations; fixed random ReLU features of a
   public seed), the model's width (an MLP), the EMA of the iterates,
   adaptive clipping (median), augmentation multiplicity (5 one-pixel shifts
   per example) and a smaller batch with more steps;
3. the ablation: every variant of stage 2 again, at the learning rate stage 2
   chose for it, on ``ABLATION_REPEATS`` fresh splits and seeds that chose
   nothing, so that the selection's luck does not inflate the winner. A
   technique stays in the defaults only if it raises the mean over the
   three budgets in stage 2 and in stage 3.

Prints the candidates sorted by validation accuracy and the ablation table
(fresh-split accuracy, stage 2's in brackets), and writes every result to
``<out>/tune_digits.json`` (``tune_digits_stage<k>.json`` for one stage;
stage 3 alone reads stage 2's file).

Run (one thread each; on 2 CPU cores stages 1 and 2 can run side by side,
about 11 and 19 minutes, then stage 3 about 5: 35 minutes one after the
other, 24 with the first two in parallel):

    python examples/tune_digits.py --stage 1      # the schedule search
    python examples/tune_digits.py --stage 2      # the techniques
    python examples/tune_digits.py --stage 3      # the ablation (after stage 2)
    python examples/tune_digits.py                # all three, one after the other
    python examples/tune_digits.py --smoke        # a tiny grid, seconds
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time

import digits  # examples/digits.py: the demo's data, features, model and training pipeline
import report  # examples/report.py: tables, JSON and plots
import torch
from sklearn.model_selection import train_test_split

# --- settings ---------------------------------------------------------------
TARGET_EPSILONS = [1.0, 3.0, 8.0, None]  # the demo's budgets (delta = digits.DELTA); None: no DP
REPEATS = 10  # repeat r: validation split r and training seed r; the score is the mean
ABLATION_REPEATS = range(10, 20)  # stage 3: fresh splits and seeds, not used to choose anything
VALIDATION_FRACTION = 0.2  # share of the training 80% held out for validation
# stage 1: the schedule at sample rate digits.SAMPLE_RATE (full batch)
STEPS = [10, 20, 40, 80]  # numbers of private steps
NONPRIVATE_STEPS = [160, 320]  # numbers of non-private steps
LRS = [0.5, 1.0, 2.0, 4.0, 8.0]  # SGD learning rates (normalized clipping: unit-norm gradients)
NONPRIVATE_LRS = [2.0, 4.0, 8.0]  # non-private learning rates
# stage 2: one change at a time from the demo's defaults. Feature options go to
# digits.featurize, the rest to digits.train; "lr_scale" multiplies the schedule's learning
# rate and "steps_scale" its steps. The first row is the demo's configuration.
VARIANTS = [
    dict(name="final (the demo's defaults)"),
    dict(name="- edge energies (pixels only)", features="pixels"),
    dict(name="- per-example L2 normalisation", feature_norm=None),
    dict(name="- both: the old default", features="pixels", feature_norm=None, lr_scale=2.0),
    dict(name="8 edge orientations, not 4", edge_orientations=8),
    dict(name="+ random ReLU features, 1024", random_features=1024),
    dict(name="+ width: MLP, 128 tanh units", model="mlp", hidden=128, lr_scale=0.5),
    dict(name="+ EMA of iterates, 0.8", ema_decay=0.8),
    dict(name="+ EMA of iterates, 0.9", ema_decay=0.9),
    dict(name="+ adaptive clipping (median)", clipping="flat", target_quantile=0.5),
    dict(name="+ augmentation multiplicity, 5 shifts", augmentations=5),
    dict(name="sample rate 0.5, twice the steps", sample_rate=0.5, steps_scale=2, lr_scale=0.5),
]
FEATURE_OPTIONS = (
    "features",
    "edge_orientations",
    "feature_norm",
    "random_features",
    "augmentations",
)
LR_FACTORS = [0.5, 1.0, 2.0]  # stage 2 learning-rate grid, relative to lr_scale * schedule lr
# --smoke: two repeats, one budget, a two-point grid; checks that the script runs
SMOKE = dict(
    TARGET_EPSILONS=[3.0], REPEATS=2, ABLATION_REPEATS=range(2, 4), STEPS=[4], LRS=[2.0],
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
    images = digits.load_images()[0]  # the demo's training 80% only: no test data
    repeats = list(range(REPEATS))  # the splits (and seeds) in use: stage 3 switches them
    data = {}  # feature options -> [(fit_set, val_set) for each of the repeats]

    def splits(**feature_options):
        key = json.dumps(feature_options, sort_keys=True)
        if key not in data:
            x, y = images
            features = digits.featurize(x, **feature_options)  # one image at a time
            data[key] = [split((features, y), r) for r in repeats]
        return data[key]

    sigmas = {}  # (epsilon, sample_rate, steps) -> calibrated noise multiplier
    results = []

    def score(stage, name, epsilon, sample_rate, steps, lr, **config):
        """Mean validation accuracy over the repeats of one candidate."""
        feature_options = {k: config.pop(k) for k in FEATURE_OPTIONS if k in config}
        key = (epsilon, sample_rate, steps)
        if epsilon is None:
            sigmas[key] = 0.0
        # adaptive clipping calibrates its own (gradient, count) split for each run
        reuse = key in sigmas and config.get("target_quantile") is None
        accuracies = []
        started = time.perf_counter()
        for repeat, (fit_set, val_set) in zip(repeats, splits(**feature_options)):
            trainer, net = digits.train(
                fit_set,
                seed=repeat,
                steps=steps,
                lr=lr,
                sample_rate=sample_rate,
                noise_multiplier=sigmas[key] if reuse else None,
                target_epsilon=None if reuse else epsilon,
                use_fit=False,  # no per-epoch epsilon: only the final one matters here
                **config,
            )
            if config.get("target_quantile") is None:
                sigmas[key] = trainer.noise_multiplier
                reuse = True
            if epsilon is not None and not trainer.epsilon() <= epsilon:
                raise RuntimeError(f"epsilon {trainer.epsilon()} exceeds the target {epsilon}")
            accuracies.append(digits.accuracy(net, val_set))
        results.append(
            dict(
                stage=stage,
                name=name,
                epsilon=epsilon,
                sample_rate=sample_rate,
                steps=steps,
                lr=lr,
                **feature_options,
                **config,
                noise_multiplier=trainer.noise_multiplier,
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

    def print_best(stage, epsilon, top):
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
                grid = itertools.product(NONPRIVATE_STEPS, NONPRIVATE_LRS)
            else:
                grid = itertools.product(STEPS, LRS)
            for steps, lr in grid:
                score(1, "default", epsilon, digits.SAMPLE_RATE, steps, lr)
            print_best(1, epsilon, top=10)

    if stage in (None, 2):
        epsilons = [e for e in TARGET_EPSILONS if e is not None]  # private budgets only
        for epsilon in epsilons:
            steps, lr = digits.SCHEDULE[epsilon]
            steps = STEPS[0] if smoke else steps
            for variant in VARIANTS:
                config = {
                    k: v
                    for k, v in variant.items()
                    if k not in ("name", "lr_scale", "steps_scale", "sample_rate")
                }
                for factor in LR_FACTORS:
                    score(
                        2,
                        variant["name"],
                        epsilon,
                        variant.get("sample_rate", digits.SAMPLE_RATE),
                        steps * variant.get("steps_scale", 1),
                        lr * variant.get("lr_scale", 1.0) * factor,
                        **config,
                    )
            print_best(2, epsilon, top=len(VARIANTS) * len(LR_FACTORS))

    if stage in (None, 3):  # the ablation, on fresh splits
        epsilons = [e for e in TARGET_EPSILONS if e is not None]
        selection = [r for r in results if r["stage"] == 2]
        if not selection:  # stage 2 ran in another process
            with open(os.path.join(out, "tune_digits_stage2.json")) as f:
                selection = json.load(f)
        data.clear()
        repeats[:] = ABLATION_REPEATS
        table = {}
        for epsilon in epsilons:
            for variant in VARIANTS:
                rows = [
                    r for r in selection if r["epsilon"] == epsilon and r["name"] == variant["name"]
                ]
                best = max(rows, key=lambda r: r["val_accuracy"])  # its lr, chosen in stage 2
                config = {
                    k: v
                    for k, v in variant.items()
                    if k not in ("name", "lr_scale", "steps_scale", "sample_rate")
                }
                score(3, variant["name"], epsilon, best["sample_rate"], best["steps"], best["lr"],
                      **config)  # fmt: skip
                table[variant["name"], epsilon] = (
                    best["val_accuracy"],
                    results[-1]["val_accuracy"],
                )
        print(
            f"\nablation: mean validation accuracy on the fresh splits {list(ABLATION_REPEATS)},"
            " each variant at the learning rate stage 2 chose (in brackets: stage 2's, which"
            " chose it)"
        )
        print(f"  {'variant':<42}" + "".join(f"  {'eps ' + format(e, 'g'):<15}" for e in epsilons))
        for variant in VARIANTS:
            cells = [table[variant["name"], e] for e in epsilons]
            print(
                f"  {variant['name']:<42}"
                + "".join(f"  {fresh:.4f} ({chosen:.4f})" for chosen, fresh in cells)
            )

    name = "tune_digits.json" if stage is None else f"tune_digits_stage{stage}.json"
    report.save_json(results, os.path.join(out, name))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, choices=[1, 2, 3], help="run only this stage")
    parser.add_argument("--out", default="results", help="directory for the JSON results")
    parser.add_argument("--smoke", action="store_true", help="two repeats, a tiny grid")
    args = parser.parse_args()
    main(args.stage, args.out, args.smoke)
