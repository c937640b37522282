"""The validation search behind the settings of ``examples/correlated_noise.py``.

It never loads the test split. The training 80% of digits (1437 images, the split of
``examples/correlated_noise.py`` and ``examples/digits.py``) is split again, stratified,
into 1149 tuning-train and 288 validation images, ``REPEATS`` times (split r trains with
public seed r), and each candidate is scored by its mean validation accuracy. For every
task, target epsilon and band count b: the schedule (expected batch, epochs) from
``TUNE_SCHEDULES`` and the learning rate from ``TUNE_LRS``, trained with that script's
own ``train`` (``dpfunc.Trainer``) at the full run's sample rate and number of steps,
hence its noise multiplier. Ties go to the earlier candidate (the smaller b, the earlier
schedule and rate). 280 candidates, 840 runs: about 50 minutes on 2 shared CPU cores.
The learning rates first tried were 3 per epsilon; where the best sat on the edge of its
grid (linear: eps 1 at 0.1, eps 3 at 0.03, eps 8 DP-SGD at 0.1; CNN: eps 8 at 0.1) the
grid was extended by one rate, which never won. The standard error of a validation
score (three splits) is 0.1 to 1.4 points.

Like the digits search, this one is NOT accounted: choosing hyperparameters on private
data leaks about it too (Papernot & Steinke 2022). Here the data is public.

Output: every candidate on stdout, the best of each (task, epsilon, b) as the
``SETTINGS`` dict that ``examples/correlated_noise.py`` holds, and every candidate in
``<out>/correlated_noise_tune.json``.

Run:

    python examples/tune_correlated_noise.py          # ~50 min
    python examples/correlated_noise.py --tune        # the same
    python examples/tune_correlated_noise.py --smoke  # one candidate each, seconds
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time

import correlated_noise as cn  # examples/correlated_noise.py: data, models, training
import report  # examples/report.py: tables, JSON and plots
import torch
from sklearn.model_selection import train_test_split

# --- settings ---------------------------------------------------------------
VALIDATION_FRACTION = 0.2  # stratified share of the training 80% held out for validation
REPEATS = 3  # repeat r: validation split r and public seed r; the score is their mean
TUNE_SCHEDULES = {  # (expected batch on the 1437 images, epochs) candidates per task
    "linear": [(32, 20), (64, 10), (64, 20)],
    "cnn": [(64, 10), (64, 20)],
}
TUNE_LRS = {  # SGD learning rates per task and target epsilon (more noise, smaller steps)
    "linear": {1.0: [0.01, 0.03, 0.1, 0.3], 3.0: [0.01, 0.03, 0.1, 0.3], 8.0: [0.03, 0.1, 0.3, 1]},
    "cnn": {1.0: [0.003, 0.01, 0.03], 3.0: [0.01, 0.03, 0.1], 8.0: [0.01, 0.03, 0.1, 0.3]},
}

# --smoke: one budget, two band counts, one split, one candidate of a few steps each
SMOKE = dict(TARGET_EPSILONS=[3.0], BANDS=[1, 4], REPEATS=1, EPOCHS=cn.SMOKE["EPOCHS"])


def main(smoke: bool, out: str) -> None:
    """The validation search: prints every candidate and the ``SETTINGS`` it chooses."""
    targets, bands_list, repeats = cn.TARGET_EPSILONS, cn.BANDS, REPEATS
    if smoke:
        targets, bands_list, repeats = SMOKE["TARGET_EPSILONS"], SMOKE["BANDS"], SMOKE["REPEATS"]
    (x, y), _ = cn.load_data()  # the test split is not used here
    splits = []  # r -> (tuning-train, validation), stratified splits of the training set
    for r in range(repeats):
        parts = train_test_split(x, y, test_size=VALIDATION_FRACTION, stratify=y, random_state=r)
        splits.append(((parts[0], parts[2]), (parts[1], parts[3])))
    print(
        f"validation search: {len(splits[0][0][0])} tuning-train and {len(splits[0][1][0])} "
        f"validation images per split, {repeats} splits (public seeds 0..{repeats - 1})"
    )
    results, settings, started = [], {}, time.perf_counter()
    for task, target, bands in itertools.product(cn.TASKS, targets, bands_list):
        schedules, lrs = TUNE_SCHEDULES[task], TUNE_LRS[task][target]
        if smoke:  # one candidate of a few steps
            schedules, lrs = [(schedules[0][0], SMOKE["EPOCHS"])], lrs[:1]
        candidates = []
        for (batch, epochs), lr in itertools.product(schedules, lrs):
            if batch * bands > len(x):  # a partition must hold the expected batch
                continue
            t0, scores = time.perf_counter(), []
            for r, (fit_set, val_set) in enumerate(splits):  # the full run's rate and steps
                trainer, net = cn.train(
                    fit_set, model=task, seed=r, target_epsilon=target, bands=bands,
                    sample_rate=batch / len(x), epochs=epochs, lr=lr,
                )  # fmt: skip
                scores.append(cn.accuracy(net, val_set))
            sigma, score = trainer.noise_multiplier, statistics.fmean(scores)
            candidates.append(
                dict(
                    task=task, target_epsilon=target, bands=bands, expected_batch_size=batch,
                    epochs=epochs, steps=trainer.total_steps, lr=lr, noise_multiplier=sigma,
                    validation_accuracy=score, scores=scores, seconds=time.perf_counter() - t0,
                )
            )  # fmt: skip
            print(
                f"  {task:>6} eps {target:g} b {bands:>2} batch {batch:>3} epochs {epochs:>2g} "
                f"lr {lr:<5g} sigma {sigma:6.3f}: validation {score:.4f}",
                flush=True,
            )
        results += candidates
        if candidates:
            best = max(candidates, key=lambda r: r["validation_accuracy"])
            edge = best["lr"] in (min(lrs), max(lrs))
            print(f"  best lr {best['lr']:g}{' (at the edge of the grid)' if edge else ''}")
            chosen = [best[k] for k in ("expected_batch_size", "epochs", "lr")]
            score = round(best["validation_accuracy"], 4)
            settings.setdefault(task, {}).setdefault(target, {})[bands] = (*chosen, score)
    print(f"\n{len(results)} candidates, {time.perf_counter() - started:.0f} s")
    print(f"SETTINGS = {settings!r}")
    report.save_json(results, os.path.join(out, "correlated_noise_tune.json"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one candidate each, seconds")
    parser.add_argument("--out", default="results", help="directory for the JSON")
    args = parser.parse_args()
    torch.set_num_threads(cn.THREADS)
    main(args.smoke, args.out)
