"""Correlated noise (banded square root factorization) against DP-SGD, measured on digits.

What it does: for each target epsilon in 1, 3 and 8 (delta 1e-5), each task and each
b in ``BANDS``, ``dpfunc.Trainer(target_epsilon=..., bands=b)`` calibrates the noise
multiplier and trains on the 1437 training images of sklearn's digits, three times
(public seeds 0, 1, 2); the table reports the test accuracy on the 360 held-out images,
mean +- std over the seeds. ``b = 1`` is DP-SGD (Poisson sampling from all the data);
``b > 1`` is DP-BandMF with the banded square root strategy (Kalinin and Lampert 2024) and
cyclic Poisson sampling: the data is split once into b partitions, step t samples
partition t mod b at rate b * batch / n, and the run is accounted as DP-SGD with
ceil(steps / b) participations at that rate (Choquette-Choo et al. 2023). Every run's
accountant epsilon (``trainer.epsilon()``, PLD) is checked to be at most its target.

The tasks, both on digits (the same stratified 80/20 train/test split as
``examples/digits.py``; pixels mapped to [-1, 1] and centred on each image's own mean,
functions of one image that need no accounting):

- ``linear``: softmax regression on the 64 pixels (650 parameters), convex;
- ``cnn``: a small CNN (3x3 conv 8, GroupNorm, tanh, 3x3 conv 16 stride 2, GroupNorm,
  tanh, linear; 3,866 parameters): non-convex, six times the parameters, in the same
  multi-epoch regime (220 to 440 steps of expected batch 64), about 4 s a run on one
  CPU core. GroupNorm because BatchNorm has no per-example gradient; tanh as tempered
  sigmoids suit DP (Papernot et al. 2021). Digits is the only real data set bundled
  with sklearn (no download) big enough for hundreds of steps, so the second task
  changes the model, not the data.

Both: normalized (automatic) clipping with C = 1, and SGD with heavy-ball momentum 0.9
(``dpfunc.optim.sgd``). The factorization is the banded square root of the prefix-sum
workload, i.e. of plain SGD; momentum is post-processing of the released noisy sums, so
it costs no privacy, but it is not the workload the strategy was built for.

How the settings were chosen (``--tune``; the test split is never loaded): the training
80% is split again, stratified, into 1149 tuning-train and 288 validation images, three
times (split r trains with public seed r), and each candidate is scored by its mean
validation accuracy. Per task, epsilon and b: the schedule (expected batch, epochs) from
``TUNE_SCHEDULES`` and the learning rate from ``TUNE_LRS``; b itself is chosen as the
one with the best validation accuracy (``*`` below). Ties go to the earlier candidate
(the smaller b, the earlier schedule and rate in the grids). The tuning runs keep the
full run's sample rate and number of steps, hence its noise multiplier. 280 candidates,
840 runs: about 50 minutes on 2 shared CPU cores. The learning rates first tried were each 3 per
epsilon; where the best sat on the edge of its grid (linear: eps 1 at 0.1, eps 3 at
0.03, eps 8 DP-SGD at 0.1; CNN: eps 8 at 0.1) the grid was extended by one rate, which
never won, so every chosen rate is inside its grid. The standard error of a validation
score (three splits) is 0.1 to 1.4 points.

Results (full run, 2 CPU cores shared with other work: 317 s). "val" is the validation
accuracy that chose the setting; "sum noise" is ``running_sum_noise``: the predicted
standard deviation of the noise that plain SGD's running sum of updates carries (RMS over
the steps, per coordinate, in units of C), computed from public settings alone:

    task   eps   b   sigma batch epochs steps sum noise   lr    val   test accuracy
    linear   1   1   2.668    64     10   220    0.4383  0.1  0.9016  0.9046 +- 0.0125 *
    linear   1   2   3.698    64     10   220    0.4547  0.1  0.9016  0.9056 +- 0.0083
    linear   1   4   5.159    64     10   220    0.4802  0.1  0.8958  0.9046 +- 0.0105
    linear   1   8   7.265    64     10   220    0.5198  0.1  0.8947  0.8954 +- 0.0125
    linear   1  16  10.088    64     10   220    0.5714  0.1  0.8819  0.8935 +- 0.0089
    linear   3   1   1.535    64     20   440    0.3563  0.1  0.9306  0.9352 +- 0.0042
    linear   3   2   1.548    32     20   900    0.7661 0.03  0.9317  0.9361 +- 0.0028
    linear   3   4   2.073    32     20   900    0.7700 0.03  0.9352  0.9343 +- 0.0016 *
    linear   3   8   2.837    32     20   900    0.7936 0.03  0.9306  0.9333 +- 0.0028
    linear   3  16   3.925    32     20   900    0.8327 0.03  0.9306  0.9306 +- 0.0028
    linear   8   1   0.751    32     20   900    0.4983  0.1  0.9444  0.9417 +- 0.0111
    linear   8   2   1.082    64     20   440    0.1875  0.3  0.9514  0.9444 +- 0.0048
    linear   8   4   1.374    64     20   440    0.1793  0.3  0.9537  0.9509 +- 0.0042 *
    linear   8   8   1.791    64     20   440    0.1773  0.3  0.9491  0.9472 +- 0.0100
    linear   8  16   2.368    64     20   440    0.1806  0.3  0.9537  0.9472 +- 0.0096
    cnn      1   1   3.632    64     20   440    0.8428 0.01  0.8819  0.8861 +- 0.0048 *
    cnn      1   2   5.082    64     20   440    0.8809 0.01  0.8785  0.8870 +- 0.0070
    cnn      1   4   7.137    64     20   440    0.9310 0.01  0.8727  0.8787 +- 0.0042
    cnn      1   8  10.027    64     20   440    0.9924 0.01  0.8692  0.8815 +- 0.0032
    cnn      1  16  14.172    64     20   440    1.0804 0.01  0.8611  0.8778 +- 0.0073
    cnn      3   1   1.535    64     20   440    0.3563 0.03  0.9387  0.9352 +- 0.0085 *
    cnn      3   2   2.055    64     20   440    0.3561 0.03  0.9352  0.9333 +- 0.0111
    cnn      3   4   2.804    64     20   440    0.3658 0.03  0.9352  0.9315 +- 0.0116
    cnn      3   8   3.861    64     20   440    0.3822 0.03  0.9340  0.9287 +- 0.0064
    cnn      3  16   5.349    64     20   440    0.4078 0.03  0.9294  0.9306 +- 0.0096
    cnn      8   1   0.883    64     20   440    0.2049 0.03  0.9514  0.9481 +- 0.0058
    cnn      8   2   1.082    64     20   440    0.1875 0.03  0.9479  0.9481 +- 0.0058
    cnn      8   4   1.374    64     20   440    0.1793  0.1  0.9514  0.9528 +- 0.0100
    cnn      8   8   1.791    64     20   440    0.1773  0.1  0.9502  0.9537 +- 0.0032
    cnn      8  16   1.734    64     10   220    0.0982  0.1  0.9525  0.9574 +- 0.0016 *

What it shows. On digits, correlated noise does not help at epsilon 1 and 3 and helps a
little at epsilon 8:

- epsilon 1: validation picks DP-SGD for both tasks. b = 2 ties it (+0.1 point on test),
  larger b lose (linear b = 8, 16: -0.9 and -1.1 points; CNN b = 4 to 16: -0.5 to -0.8).
- epsilon 3: a tie. Linear: validation picks b = 4, which tests 0.1 point below DP-SGD;
  every b is within 0.5 point of it. CNN: validation picks DP-SGD, and every b > 1 tests
  0.2 to 0.7 point lower.
- epsilon 8: the validation-picked b gains about 0.9 point on both tasks: linear b = 4,
  0.9509 against 0.9417; CNN b = 16, 0.9574 against 0.9481 (all b > 2 gain 0.5 to 0.9).
  That is about 3 of the 360 test images, of the order of the spread between seeds.

Why: on 1437 examples, cyclic Poisson sampling pays heavily for its partitions. Each
step samples one partition of n / b images at rate b * 64 / n (0.71 for b = 16), so
amplification by sampling nearly vanishes and the calibrated sigma grows nearly like
sqrt(b) (epsilon 3, 440 steps: 1.54, 2.06, 2.80, 3.86, 5.35 for b = 1, 2, 4, 8, 16).
The cancellation of correlated noise in the running sum must beat that. The sum-noise
column tells in advance where it does: at one schedule, b > 1 carries 4 to 30% more noise
than DP-SGD at epsilon 1, about as much to 15% more at epsilon 3, and 8 to 14% less at
epsilon 8, the only budget where accuracy improved. Correlated noise should do better
where n is much larger than b times the batch (the sampling rate within a partition
stays small), with more steps per participation; that regime is not measured here.
For scale: full-batch DP-SGD with 20 to 40 steps (``examples/digits.py`` at commit
bd7f88a, same split and pixels) reported 0.902, 0.941 and 0.950 at epsilon 1, 3 and 8;
on digits the many-step regime is not better, with or without correlated noise.

Plain SGD (momentum 0, learning rates 3, 10 and 30 times the chosen ones, at the chosen
schedules, epsilon 3 and 8, b = 1, 4, 16; validation only, not in ``--tune``) changed
nothing: every score within 1.0 point of momentum 0.9's (higher twice, by 0.1 point), and
correlated noise gained no more than with momentum (best b = 4 on linear at 0.9363 and
0.9525 against DP-SGD's 0.9317 and 0.9444; on the CNN DP-SGD stayed best or tied).

The seeds are public so that the table reproduces bit for bit: these runs are
reproducible research on public data, not private releases (whoever knows a run's seed
can regenerate its noise and remove it). A private run keeps ``dpfunc.Trainer``'s
default ``seed=None``; the accuracy is the same in distribution.

Output: the table on stdout, ``<out>/correlated_noise.json`` (one record per task,
epsilon and b: the accountant's epsilon, sigma, schedule, participations, sum noise,
learning rate, validation and test accuracies, seconds) and ``<out>/correlated_noise.png``
(test accuracy against epsilon, one line per b, one panel per task), copied to
``docs/correlated_noise.png``.

Run:

    python examples/correlated_noise.py                 # about 5 minutes on 2 CPU cores
    python examples/correlated_noise.py --out DIR       # write the results to DIR
    python examples/correlated_noise.py --smoke         # one seed, a few steps, seconds
    python examples/correlated_noise.py --tune          # the validation search, ~50 min
    python examples/correlated_noise.py --tune --smoke  # one candidate each, seconds
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import statistics
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.func import functional_call

import dpfunc

# --- settings ---------------------------------------------------------------
TARGET_EPSILONS = [1.0, 3.0, 8.0]  # privacy budgets, each calibrated by the Trainer ...
DELTA = 1e-5  # ... at this delta (well below 1 / 1437 training examples)
BANDS = [1, 2, 4, 8, 16]  # b: 1 is DP-SGD, b > 1 the banded square root with b bands
SEEDS = [0, 1, 2]  # public seeds (initialisation, partitions, batches, noise): NOT private
SPLIT_SEED = 0  # the stratified 80/20 train/test split of examples/digits.py ...
TEST_FRACTION = 0.2  # ... whose test share is never used to choose anything
CLIPPING = "normalized"  # automatic clipping: every per-example gradient scaled to norm ~C
CLIP_NORM = 1.0  # C (with normalized clipping only learning rate * C matters)
MOMENTUM = 0.9  # heavy-ball momentum of dpfunc.optim.sgd (post-processing of the noisy sums)
THREADS = 1  # torch CPU threads
TASKS = {"linear": "softmax regression", "cnn": "small CNN"}  # the models (see build)
# chosen on validation (--tune): task -> target epsilon -> bands -> (expected batch on the
# 1437 training images, epochs, SGD learning rate, validation accuracy that chose them)
SETTINGS = {
    "linear": {
        1.0: {1: (64, 10, 0.1, 0.9016), 2: (64, 10, 0.1, 0.9016), 4: (64, 10, 0.1, 0.8958),
              8: (64, 10, 0.1, 0.8947), 16: (64, 10, 0.1, 0.8819)},
        3.0: {1: (64, 20, 0.1, 0.9306), 2: (32, 20, 0.03, 0.9317), 4: (32, 20, 0.03, 0.9352),
              8: (32, 20, 0.03, 0.9306), 16: (32, 20, 0.03, 0.9306)},
        8.0: {1: (32, 20, 0.1, 0.9444), 2: (64, 20, 0.3, 0.9514), 4: (64, 20, 0.3, 0.9537),
              8: (64, 20, 0.3, 0.9491), 16: (64, 20, 0.3, 0.9537)},
    },
    "cnn": {
        1.0: {1: (64, 20, 0.01, 0.8819), 2: (64, 20, 0.01, 0.8785), 4: (64, 20, 0.01, 0.8727),
              8: (64, 20, 0.01, 0.8692), 16: (64, 20, 0.01, 0.8611)},
        3.0: {1: (64, 20, 0.03, 0.9387), 2: (64, 20, 0.03, 0.9352), 4: (64, 20, 0.03, 0.9352),
              8: (64, 20, 0.03, 0.934), 16: (64, 20, 0.03, 0.9294)},
        8.0: {1: (64, 20, 0.03, 0.9514), 2: (64, 20, 0.03, 0.9479), 4: (64, 20, 0.1, 0.9514),
              8: (64, 20, 0.1, 0.9502), 16: (64, 10, 0.1, 0.9525)},
    },
}  # fmt: skip
JSON_NAME, PLOT_NAME = "correlated_noise.json", "correlated_noise.png"  # files in --out
DOCS_PLOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", PLOT_NAME)

# --tune: the validation search (training data only; the test split is never touched)
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

# --smoke: one seed, one budget, two band counts, a few steps; checks that the script runs
SMOKE = dict(TARGET_EPSILONS=[3.0], BANDS=[1, 4], SEEDS=[0], EPOCHS=0.2, REPEATS=1)


# --- the pipeline -----------------------------------------------------------


def load_data():
    """(x_train, y_train), (x_test, y_test): the 64 pixels, scaled by public constants only.

    Pixels 0..16 go to [-1, 1] and each image is centred on its own mean
    pixel: functions of one image, no training-set statistic, nothing to account.
    """
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 8.0 - 1.0
    x = x - x.mean(1, keepdim=True)
    y = torch.tensor(digits.target, dtype=torch.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=TEST_FRACTION, stratify=y, random_state=SPLIT_SEED
    )
    return (x_train, y_train), (x_test, y_test)


@torch.no_grad()
def accuracy(net: nn.Module, data) -> float:
    x, y = data
    return float((net(x).argmax(1) == y).float().mean())


def make_cnn() -> nn.Module:
    """A small CNN on the 8x8 images: two 3x3 convolutions, GroupNorm, tanh (3,866 params)."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 8, 3, padding=1),
        nn.GroupNorm(2, 8),
        nn.Tanh(),
        nn.Conv2d(8, 16, 3, padding=1, stride=2),  # -> 16 x 4 x 4
        nn.GroupNorm(4, 16),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 10),
    )


def build(model: str) -> nn.Module:
    """``"linear"``: softmax regression on the 64 pixels; ``"cnn"``: :func:`make_cnn`."""
    if model == "linear":
        return nn.Linear(64, 10)
    if model == "cnn":
        return make_cnn()
    raise ValueError(f"model must be 'linear' or 'cnn', got model={model!r}")


def train(
    train_set,
    *,
    model: str,
    seed: int,
    target_epsilon: float,
    bands: int,
    sample_rate: float,
    epochs: float,
    lr: float,
    momentum: float = MOMENTUM,
):
    """One private run with ``dpfunc.Trainer``; returns ``(trainer, net)``.

    ``sample_rate`` is the overall rate ``expected_batch_size / n``; with
    ``bands = b`` each step samples one of b partitions at ``b * sample_rate``.
    """
    n = len(train_set[0])
    torch.manual_seed(seed)  # the initialisation
    net = build(model)
    params, buffers = dpfunc.functionalize(net)

    def loss_fn(params, example):
        """ONE image's cross-entropy."""
        xi, yi = example
        logits = functional_call(net, (params, buffers), (xi.unsqueeze(0),))
        return F.cross_entropy(logits, yi.unsqueeze(0))

    trainer = dpfunc.Trainer(
        loss_fn,
        params,
        train_set,
        optimizer=dpfunc.optim.sgd(lr=lr, momentum=momentum),
        epochs=epochs,
        expected_batch_size=sample_rate * n,
        clip_norm=CLIP_NORM,
        target_epsilon=target_epsilon,
        delta=DELTA,
        clipping=CLIPPING,
        bands=bands,
        seed=seed,
        progress=False,
    )
    for _ in range(trainer.total_steps):  # fit() would evaluate epsilon after every epoch
        trainer.train_step()
    epsilon = trainer.epsilon()  # the accountant's, after every step
    if not epsilon <= target_epsilon:
        raise RuntimeError(f"accountant epsilon {epsilon} exceeds target {target_epsilon}")
    net.load_state_dict(trainer.params, strict=False)
    return trainer, net


def running_sum_noise(noise_multiplier: float, bands: int, steps: int, batch: float) -> float:
    """The noise in the running sum of the updates, predicted from public settings alone.

    Plain SGD moves the model by the running sum of the averaged noisy
    gradients, whose noise after step ``t`` is ``sigma * C / batch`` times row
    ``t`` of ``A C^-1`` applied to standard normals (``A`` the prefix-sum
    matrix, ``C`` the normalised strategy; ``C = I`` for DP-SGD). Returns the
    root mean square over the ``steps`` rows of that standard deviation, per
    coordinate, in units of the clip norm: lower is less noise for the same
    schedule. It ignores momentum and what the optimiser does with the noise.
    """
    c = dpfunc.matrix_factorization.normalized_coefficients(bands)
    u = []  # the first column of C^-1 (a lower-triangular Toeplitz matrix)
    for t in range(steps):
        earlier = sum(c[j] * u[t - j] for j in range(1, min(bands, t + 1)))
        u.append(((1.0 if t == 0 else 0.0) - earlier) / c[0])
    column = list(itertools.accumulate(u))  # the first column of A C^-1, also Toeplitz
    rows = list(itertools.accumulate(v * v for v in column))  # squared row norms
    return noise_multiplier * CLIP_NORM * math.sqrt(statistics.fmean(rows)) / batch


def validation_splits(train_set, repeats: int):
    """``repeats`` stratified (tuning-train, validation) splits of the TRAINING set."""
    x, y = train_set
    for r in range(repeats):
        x_fit, x_val, y_fit, y_val = train_test_split(
            x, y, test_size=VALIDATION_FRACTION, stratify=y, random_state=r
        )
        yield r, (x_fit, y_fit), (x_val, y_val)


# --- the validation search ---------------------------------------------------


def tune(smoke: bool, out: str) -> None:
    """The validation search behind ``SETTINGS``: prints it and writes every candidate.

    For every task, target epsilon and b: every schedule in ``TUNE_SCHEDULES``
    and learning rate in ``TUNE_LRS``, trained on the tuning-train part of
    ``REPEATS`` stratified splits of the training set and scored on their
    validation part (mean accuracy); the test split is never loaded.
    """
    targets, bands_list, repeats = TARGET_EPSILONS, BANDS, REPEATS
    if smoke:
        targets, bands_list, repeats = SMOKE["TARGET_EPSILONS"], SMOKE["BANDS"], SMOKE["REPEATS"]
    train_set, _ = load_data()  # the test split is not used here
    n_full = len(train_set[0])
    splits = list(validation_splits(train_set, repeats))
    print(
        f"validation search: {len(splits[0][1][0])} tuning-train and {len(splits[0][2][0])} "
        f"validation images per split, {repeats} splits (public seeds 0..{repeats - 1})"
    )
    results, started = [], time.perf_counter()
    for task, target, bands in itertools.product(TASKS, targets, bands_list):
        schedules, lrs = TUNE_SCHEDULES[task], TUNE_LRS[task][target]
        if smoke:  # one candidate of a few steps
            schedules, lrs = [(schedules[0][0], SMOKE["EPOCHS"])], lrs[:1]
        for (batch, epochs), lr in itertools.product(schedules, lrs):
            if batch * bands > n_full:  # a partition must hold the expected batch
                continue
            t0, scores = time.perf_counter(), []
            for r, fit_set, val_set in splits:
                trainer, net = train(
                    fit_set,
                    model=task,
                    seed=r,
                    target_epsilon=target,
                    bands=bands,
                    sample_rate=batch / n_full,  # the full run's rate and steps, so its sigma
                    epochs=epochs,
                    lr=lr,
                )
                scores.append(accuracy(net, val_set))
            results.append(
                dict(
                    task=task,
                    target_epsilon=target,
                    bands=bands,
                    expected_batch_size=batch,
                    epochs=epochs,
                    steps=trainer.total_steps,
                    lr=lr,
                    noise_multiplier=trainer.noise_multiplier,
                    validation_accuracy=statistics.fmean(scores),
                    scores=scores,
                    seconds=time.perf_counter() - t0,
                )
            )
            r = results[-1]
            print(
                f"  {task:>6} eps {target:g} b {bands:>2} batch {batch:>3} epochs {epochs:>2g} "
                f"lr {lr:<5g} sigma {r['noise_multiplier']:6.3f}: validation "
                f"{r['validation_accuracy']:.4f} ({r['seconds']:.1f} s)",
                flush=True,
            )
    seconds = time.perf_counter() - started
    print(f"\nthe best of each (task, epsilon, b), {len(results)} candidates, {seconds:.0f} s:")
    settings = {}
    for task, target, bands in itertools.product(TASKS, targets, bands_list):
        key = (task, target, bands)
        cands = [r for r in results if (r["task"], r["target_epsilon"], r["bands"]) == key]
        if not cands:
            continue
        best = max(cands, key=lambda r: r["validation_accuracy"])
        edge = best["lr"] in (min(TUNE_LRS[task][target]), max(TUNE_LRS[task][target]))
        print(
            f"  {task:>6} eps {target:g} b {bands:>2}: batch {best['expected_batch_size']:>3}, "
            f"epochs {best['epochs']:>2g}, lr {best['lr']:<5g} -> validation "
            f"{best['validation_accuracy']:.4f}{'  (lr at the edge of the grid)' if edge else ''}"
        )
        settings.setdefault(task, {}).setdefault(target, {})[bands] = (
            best["expected_batch_size"],
            best["epochs"],
            best["lr"],
            round(best["validation_accuracy"], 4),
        )
    print(f"\nSETTINGS = {settings!r}")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "correlated_noise_tune.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"saved {path}")


# --- the measurement ----------------------------------------------------------


def main(smoke: bool, out: str) -> None:
    """Trains every (task, epsilon, b) at its SETTINGS on the training set; tests each seed."""
    targets, bands_list, seeds = TARGET_EPSILONS, BANDS, SEEDS
    if smoke:
        targets, bands_list, seeds = SMOKE["TARGET_EPSILONS"], SMOKE["BANDS"], SMOKE["SEEDS"]
    os.makedirs(out, exist_ok=True)
    train_set, test_set = load_data()
    n = len(train_set[0])
    print(
        f"digits: {n} training and {len(test_set[0])} test images; {CLIPPING} clipping "
        f"(C={CLIP_NORM}), SGD with momentum {MOMENTUM}, delta {DELTA}, public seeds {seeds}"
    )
    records, started = [], time.perf_counter()
    for task, target, bands in itertools.product(TASKS, targets, bands_list):
        batch, epochs, lr, validation = SETTINGS[task][target][bands]
        if smoke:
            epochs = SMOKE["EPOCHS"]
        t0, accuracies, epsilons = time.perf_counter(), [], []
        for seed in seeds:
            trainer, net = train(
                train_set,
                model=task,
                seed=seed,
                target_epsilon=target,
                bands=bands,
                sample_rate=batch / n,
                epochs=epochs,
                lr=lr,
            )
            accuracies.append(accuracy(net, test_set))
            epsilons.append(trainer.epsilon())
        records.append(
            dict(
                task=task,
                target_epsilon=target,
                epsilon=max(epsilons),  # the trainers' accountant, each checked <= target
                delta=DELTA,
                bands=bands,
                noise_multiplier=trainer.noise_multiplier,
                expected_batch_size=batch,
                partition_sample_rate=trainer.sample_rate,
                epochs=epochs,
                steps=trainer.total_steps,
                participations=dpfunc.accounting.participations(trainer.total_steps, bands),
                running_sum_noise=running_sum_noise(
                    trainer.noise_multiplier, bands, trainer.total_steps, batch
                ),
                lr=lr,
                momentum=MOMENTUM,
                validation_accuracy=validation,
                accuracy=statistics.fmean(accuracies),
                accuracy_std=statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0,
                accuracies=accuracies,
                seconds=time.perf_counter() - t0,
            )
        )
        r = records[-1]
        print(
            f"  {task:>6} eps {target:g} b {bands:>2}: {r['steps']} steps, lr {lr:g}, sigma "
            f"{r['noise_multiplier']:.3f}, test {r['accuracy']:.4f} +- "
            f"{r['accuracy_std']:.4f} ({r['seconds']:.1f} s)",
            flush=True,
        )
    total = time.perf_counter() - started

    # b chosen on validation for each (task, epsilon): the fair "correlated noise" entry
    for task, target in itertools.product(TASKS, targets):
        rs = [r for r in records if (r["task"], r["target_epsilon"]) == (task, target)]
        valid = [r for r in rs if r["validation_accuracy"] is not None]
        if valid:
            max(valid, key=lambda r: r["validation_accuracy"])["chosen_on_validation"] = True
    print(
        f"\n{'task':>6} {'epsilon':>8} {'bands':>5} {'sigma':>7} {'batch':>5} {'epochs':>6} "
        f"{'steps':>5} {'sum noise':>9} {'lr':>5} {'val acc':>7} {'test accuracy':>17} "
        f"{'seconds':>7}"
    )
    for r in records:
        val = "-" if r["validation_accuracy"] is None else f"{r['validation_accuracy']:.4f}"
        mark = " *" if r.get("chosen_on_validation") else ""
        print(
            f"{r['task']:>6} {r['epsilon']:>8.3f} {r['bands']:>5} {r['noise_multiplier']:>7.3f} "
            f"{r['expected_batch_size']:>5} {r['epochs']:>6g} {r['steps']:>5} "
            f"{r['running_sum_noise']:>9.4f} {r['lr']:>5g} "
            f"{val:>7} {r['accuracy']:>8.4f} +- {r['accuracy_std']:.4f} {r['seconds']:>7.1f}{mark}"
        )
    print(f"(* the b with the best validation accuracy; total {total:.0f} s)")
    path = os.path.join(out, JSON_NAME)
    with open(path, "w") as f:
        json.dump(records, f, indent=2)
    print(f"\nsaved {path}")
    plot(records, len(seeds), os.path.join(out, PLOT_NAME))
    if not smoke and os.path.isdir(os.path.dirname(DOCS_PLOT)):
        shutil.copyfile(os.path.join(out, PLOT_NAME), DOCS_PLOT)
        print(f"copied to {os.path.normpath(DOCS_PLOT)}")


def plot(records, num_seeds: int, path: str) -> None:
    """Test accuracy against epsilon, one line per b, one panel per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in records))
    bands_list = list(dict.fromkeys(r["bands"] for r in records))
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4.2), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for i, bands in enumerate(bands_list):
            rs = [r for r in records if (r["task"], r["bands"]) == (task, bands)]
            shift = math.exp(0.025 * (i - (len(bands_list) - 1) / 2))  # keeps error bars apart
            ax.errorbar(
                [r["target_epsilon"] * shift for r in rs],
                [r["accuracy"] for r in rs],
                yerr=[r["accuracy_std"] for r in rs],
                marker="o",
                markersize=4,
                capsize=3,
                color="black" if bands == 1 else None,
                linewidth=2.0 if bands == 1 else 1.2,
                label="DP-SGD (b=1)" if bands == 1 else f"banded sqrt, b={bands}",
            )
        ax.set_xscale("log")
        targets = sorted({r["target_epsilon"] for r in records})
        ax.set_xticks(targets, [f"{t:g}" for t in targets])
        ax.minorticks_off()
        ax.set_xlabel(f"epsilon (delta={DELTA:g})")
        ax.set_ylabel(f"test accuracy (mean +- std, {num_seeds} seeds)")
        ax.set_title(f"digits, {TASKS[task]}")
        ax.legend(loc="lower right")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few steps, seconds")
    parser.add_argument("--tune", action="store_true", help="the validation search")
    parser.add_argument("--out", default="results", help="directory for the JSON and the plot")
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    if args.tune:
        tune(args.smoke, args.out)
    else:
        main(args.smoke, args.out)
