"""User-level privacy on a corpus of heavy-tailed users: ULS, ELS and example-level, side by side.

Run from the repository root (about 15 minutes on 2 CPU cores):

    .venv/bin/python bench/user_level.py --timing   # the step times: bench/user_level_timing.json
    .venv/bin/python bench/user_level.py            # the table: bench/user_level.json and .md
    .venv/bin/python bench/user_level.py --smoke    # one budget, one seed, few steps

Run ``--timing`` first, alone on the machine: the table's run reads its file.

The corpus: 40,000 examples of ``USERS`` = 5,000 users, grouped synthetically from
scikit-learn's digits. User ``u`` (1-based) holds one example plus a share of the other
35,000 proportional to ``u ** -ZIPF``: the heaviest holds 2,500 examples, the median user 3
(2,180 users hold 4 or more, 306 hold 16 or more). Each user draws a preference over the ten
digits (Dirichlet(``CONCENTRATION``)) and
a stroke weight (pixel scale in [0.7, 1.3]); each of their examples is a training-split
image of a digit drawn from that preference, shifted by at most one pixel and given pixel
noise, then featurized as the digits demo does (a function of the one image). The test
set: the held-out digits, 5 noisy copies each (1,800 examples, no user). The model:
softmax regression, normalized clipping (C = 1), SGD with momentum 0.9 at lr
``LR``, ``STEPS`` steps; every run's noise is calibrated to its row's epsilon at
delta 1e-5 by bisection.

* ULS (``privacy_unit="user"``): ``EXPECTED_USERS`` users a step (q = 0.05, 15 passes over
  the users), at most k examples each, each user's mean gradient clipped once. Its epsilon
  is per user (dpfunc's accountant over users).
* ELS: each user's examples cut to at most k once (``dpfunc.users.bound_contributions``),
  then example-level DP-SGD, ``EXPECTED_EXAMPLES`` examples a step; its epsilon per user is
  ``dpfunc.accounting.example_sampling_user_epsilon`` (the mixture-of-Gaussians accountant
  of example-level sampling; Charles et al. 2024), calibrated to the row's epsilon.
* example-level: all 40,000 examples, the same batch and steps, calibrated to the row's
  epsilon PER EXAMPLE as printed; beside it, what that run guarantees per user: the same
  accountant with k = the median user's and the heaviest user's count.
* no privacy: the example-level run and the ULS k = 16 run without noise (clipping kept).

The step time: one micro-batch of ``TIMING_ROWS`` rows (a user-level one holds
``TIMING_ROWS / k`` users), the median of 30 steps after 5, against the example-level
step on the same rows, for the MLP 784-512-256-10 (vmap and ghost) and a 2-layer
transformer encoder (width 256, T 64, ghost).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))

import digits  # noqa: E402  examples/digits.py: the images and the features

import dpfunc  # noqa: E402
from dpfunc.accounting import calibrate_noise_multiplier, example_sampling_user_epsilon  # noqa: E402

# --- settings ---------------------------------------------------------------
USERS, EXAMPLES = 5_000, 40_000  # the corpus
ZIPF = 0.9  # user u holds a share proportional to u ** -ZIPF
CONCENTRATION = 0.5  # Dirichlet concentration of each user's digit preference (non-iid)
CORPUS_SEED = 0  # public: fixes the corpus, the users and the test set
EPSILONS = [1.0, 3.0, 8.0]  # per user (ULS, ELS) or per example as printed (example-level)
DELTA = 1e-5
KS = [1, 4, 16]  # max_examples_per_user
EXPECTED_USERS = 250  # ULS: users a step (q = 0.05)
EXPECTED_EXAMPLES = 500  # ELS and example-level: examples a step
STEPS = 300
LR, MOMENTUM, CLIP_NORM = 2.0, 0.9, 1.0
SEEDS = [0, 1, 2]  # public seeds: reproducible research on public data, NOT private
ELS_GRID = 1e-2  # the mixture accountant's PLD grid for calibration (an upper bound)
TIMING_ROWS, TIMING_KS = 256, [1, 4, 16]
SMOKE = dict(EPSILONS=[3.0], SEEDS=[0], STEPS=10, KS=[4])


def corpus():
    """(x [N, d], y [N], users [N]), (x_test, y_test): the grouped digits (see the docstring)."""
    g = torch.Generator().manual_seed(CORPUS_SEED)
    torch.manual_seed(CORPUS_SEED)  # the Dirichlet draw reads the global generator
    (x_train, y_train), (x_test, y_test) = digits.load_images()
    share = torch.arange(1, USERS + 1, dtype=torch.float64) ** -ZIPF
    exact = 1 + share / share.sum() * (EXAMPLES - USERS)  # one each, the rest by Zipf
    counts = exact.floor().long()
    remainders = torch.argsort(exact - counts, descending=True)
    counts[remainders[: EXAMPLES - int(counts.sum())]] += 1  # largest remainders
    users = torch.repeat_interleave(torch.arange(USERS), counts)
    preference = torch.distributions.Dirichlet(torch.full((10,), CONCENTRATION)).sample((USERS,))
    labels = torch.multinomial(preference, int(counts.max()), replacement=True, generator=g)
    within = torch.arange(EXAMPLES) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    y = labels[users, within]
    by_class = [torch.nonzero(y_train == c).flatten() for c in range(10)]
    picks = torch.empty(EXAMPLES, dtype=torch.int64)
    for c in range(10):
        rows = torch.nonzero(y == c).flatten()
        picks[rows] = by_class[c][torch.randint(len(by_class[c]), (rows.numel(),), generator=g)]
    stroke = 0.7 + 0.6 * torch.rand(USERS, generator=g)
    images = x_train[picks] * stroke[users, None, None]
    x = features(noisy(images, g))
    test = features(noisy(x_test.repeat(5, 1, 1), g))
    return (x, y, users), (test, y_test.repeat(5))


def noisy(images, g):
    """Each image shifted by at most one pixel (zero fill) with Gaussian pixel noise."""
    shifts = torch.randint(-1, 2, (len(images), 2), generator=g)
    padded = F.pad(images, (1, 1, 1, 1))
    out = torch.stack([padded[i, 1 - a : 9 - a, 1 - b : 9 - b] for i, (a, b) in
                       enumerate(shifts.tolist())])  # fmt: skip
    return (out + 0.1 * torch.randn(out.shape, generator=g)).clamp(0, 1.3)


def features(images):
    return digits.featurize(images, augmentations=1)[:, 0]


def loss_and_model(dim):
    model = nn.Linear(dim, 10)
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        x, y = example
        return F.cross_entropy(functional_call(model, (p, buffers), (x[None],)), y[None])

    return model, params, loss_fn


def accuracy(params, model, test):
    x, y = test
    with torch.no_grad():
        return float((functional_call(model, params, (x,)).argmax(1) == y).float().mean())


def epochs_for(units, expected):
    """The epochs that make the Trainer plan exactly STEPS steps (an epoch: round(units / E))."""
    return STEPS / max(1, round(units / expected))


def calibrate_els(epsilon, rate, k):
    """The smallest sigma (bisection, 1% of it) whose ELS user-level epsilon is <= epsilon."""

    def eps(sigma):
        return example_sampling_user_epsilon(sigma, rate, STEPS, DELTA, k,
                                             value_discretization_interval=ELS_GRID)  # fmt: skip

    low, high = 0.3, 1.0
    while eps(high) > epsilon:
        low, high = high, high * 2
    while high / low > 1.01:
        mid = math.sqrt(low * high)
        low, high = (low, mid) if eps(mid) <= epsilon else (mid, high)
    return high


def run(kind, epsilon, k, seed, data, test):
    x, y, users = data
    torch.manual_seed(seed)
    model, params, loss_fn = loss_and_model(x.shape[1])
    per_user = None  # ULS: the printed epsilon is per user; example-level: see the table
    settings = dict(optimizer=dpfunc.optim.sgd(LR, momentum=MOMENTUM), clip_norm=CLIP_NORM,
                    clipping="normalized", delta=DELTA, progress=False, seed=seed)  # fmt: skip
    if kind in ("uls", "none_uls"):
        rate = EXPECTED_USERS / USERS
        sigma = (
            0.0 if kind == "none_uls" else calibrate_noise_multiplier(epsilon, DELTA, rate, STEPS)
        )
        trainer = dpfunc.Trainer(
            loss_fn, params, (x, y), noise_multiplier=sigma, expected_batch_size=EXPECTED_USERS,
            epochs=epochs_for(USERS, EXPECTED_USERS), privacy_unit="user", max_examples_per_user=k,
            users=users, **settings,
        )  # fmt: skip
    else:
        rows = (dpfunc.users.bound_contributions(users, k, seed=seed) if kind == "els"
                else torch.arange(len(y)))  # fmt: skip
        rate = EXPECTED_EXAMPLES / rows.numel()
        if kind == "none":
            sigma = 0.0
        elif kind == "els":
            sigma = calibrate_els(epsilon, rate, k)
            per_user = example_sampling_user_epsilon(
                sigma, rate, STEPS, DELTA, k, value_discretization_interval=ELS_GRID
            )
        else:
            sigma = calibrate_noise_multiplier(epsilon, DELTA, rate, STEPS)
        trainer = dpfunc.Trainer(
            loss_fn, params, (x[rows], y[rows]), noise_multiplier=sigma,
            expected_batch_size=EXPECTED_EXAMPLES,
            epochs=epochs_for(rows.numel(), EXPECTED_EXAMPLES), **settings,
        )  # fmt: skip
    assert trainer.total_steps == STEPS, (kind, trainer.total_steps)
    start = time.perf_counter()
    trainer.fit()
    seconds = time.perf_counter() - start
    record = dict(kind=kind, epsilon=epsilon, k=k, seed=seed, sigma=sigma, seconds=seconds,
                  accuracy=accuracy(trainer.params, model, test),
                  printed=trainer.epsilon())  # fmt: skip
    record["per_user"] = record["printed"] if kind in ("uls", "none_uls") else per_user
    return record


def per_user_of_example_level(sigma, counts):
    """What an example-level run guarantees its median and its heaviest user."""
    rate = EXPECTED_EXAMPLES / EXAMPLES
    median, heaviest = int(counts.median()), int(counts.max())
    return {
        "median_count": median,
        "median_user": example_sampling_user_epsilon(sigma, rate, STEPS, DELTA, median,
                                                     value_discretization_interval=ELS_GRID),
        "heaviest_count": heaviest,
        "heaviest_user": example_sampling_user_epsilon(sigma, rate, STEPS, DELTA, heaviest,
                                                       value_discretization_interval=1.0),
    }  # fmt: skip


# --- the step time ------------------------------------------------------------


def mlp_problem():
    model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                          nn.Linear(256, 10))  # fmt: skip
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        x, y = example
        return F.cross_entropy(functional_call(model, (p, buffers), (x[None],)), y[None])

    g = torch.Generator().manual_seed(0)
    batch = (
        torch.randn(TIMING_ROWS, 784, generator=g),
        torch.randint(0, 10, (TIMING_ROWS,), generator=g),
    )
    return model, params, loss_fn, batch


def transformer_problem():
    width, length = 256, 64
    model = nn.Sequential(
        nn.Embedding(1000, width),
        nn.TransformerEncoder(
            nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True), 2
        ),  # fmt: skip
        nn.Linear(width, 1000),
    )
    params, buffers = dpfunc.functionalize(model)

    @dpfunc.batched_loss
    def loss_fn(p, batch):
        tokens, targets = batch
        logits = functional_call(model, (p, buffers), (tokens,))
        return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(1)

    g = torch.Generator().manual_seed(0)
    rows = TIMING_ROWS // 4  # 64 sequences of 64 tokens
    tokens = torch.randint(0, 1000, (rows, length), generator=g)
    return model, params, loss_fn, (tokens, tokens.roll(-1, 1))


def step_time(problem, method, k):
    model, params, loss_fn, batch = problem()
    rows = len(batch[0])
    unit = dict(privacy_unit="user", max_examples_per_user=k) if k else {}
    step = dpfunc.make_train_step(
        loss_fn, dpfunc.optim.sgd(0.1), clip_norm=1.0, noise_multiplier=1.0,
        expected_batch_size=rows / (k or 1), model=model, method=method, **unit,
    )  # fmt: skip
    state = step.init(params)
    mask = torch.ones(rows)
    noise = dpfunc.standard_normal_like(params, seed=0, step=0)
    times = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(35):
            start = time.perf_counter()
            step(state, batch, mask, noise)
            if i >= 5:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def timing():
    rows = []
    for name, problem, methods in (("mlp", mlp_problem, ("vmap", "ghost")),
                                   ("transformer", transformer_problem, ("ghost",))):  # fmt: skip
        for method in methods:
            base = step_time(problem, method, 0)
            for k in TIMING_KS:
                if name == "transformer" and (TIMING_ROWS // 4) % k:
                    continue
                user = step_time(problem, method, k)
                rows.append(dict(model=name, method=method, k=k, example_ms=1e3 * base,
                                 user_ms=1e3 * user, ratio=user / base))  # fmt: skip
                print(rows[-1], flush=True)
    return rows


# --- the table ----------------------------------------------------------------


def table(records, extra, timings):
    def cell(kind, epsilon, k):
        accs = [
            r["accuracy"]
            for r in records
            if (r["kind"], r["epsilon"], r["k"]) == (kind, epsilon, k)
        ]
        if not accs:
            return "-"
        spread = statistics.stdev(accs) if len(accs) > 1 else 0.0
        return f"{statistics.mean(accs):.3f} ± {spread:.3f}"

    baseline, users_baseline = cell("none", None, 0), cell("none_uls", None, 16)
    epsilons = sorted({r["epsilon"] for r in records if r["epsilon"] is not None})
    ks = sorted({r["k"] for r in records if r["kind"] in ("uls", "els")})
    lines = ["| epsilon | " + " | ".join(f"ULS k={k}" for k in ks) + " | "
             + " | ".join(f"ELS k={k}" for k in ks)
             + " | example-level (per example) | its median user | its heaviest user |",
             "| ---: |" + " --- |" * (2 * len(ks) + 1) + " ---: | ---: |"]  # fmt: skip
    for epsilon in epsilons:
        e = extra[str(epsilon)]
        lines.append(
            f"| {epsilon:g} | " + " | ".join(cell("uls", epsilon, k) for k in ks) + " | "
            + " | ".join(cell("els", epsilon, k) for k in ks) + f" | {cell('example', epsilon, 0)}"
            + f" | {e['median_user']:.3g} ({e['median_count']} examples)"
            + f" | {e['heaviest_user']:.4g} ({e['heaviest_count']} examples) |"
        )  # fmt: skip
    lines += ["", f"No privacy (no noise, clipping kept): example-level {baseline}; "
              f"each user's mean gradient (ULS k=16) {users_baseline}."]  # fmt: skip
    if timings:
        lines += ["", "| model | method | k | example-level ms | user-level ms | ratio |",
                  "| --- | --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
        lines += [f"| {t['model']} | {t['method']} | {t['k']} | {t['example_ms']:.1f} | "
                  f"{t['user_ms']:.1f} | {t['ratio']:.2f}x |" for t in timings]  # fmt: skip
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--timing", action="store_true")
    parser.add_argument("--out", default=str(HERE))
    args = parser.parse_args()
    if args.smoke:
        globals().update(SMOKE)
    torch.set_num_threads(2)
    if args.timing:
        timings = timing()
        (Path(args.out) / "user_level_timing.json").write_text(json.dumps(timings, indent=1))
        return
    data, test = corpus()
    counts = torch.bincount(data[2])
    print(f"{len(data[1])} examples, {len(counts)} users, median {int(counts.median())}, "
          f"max {int(counts.max())}", flush=True)  # fmt: skip
    records, extra = [], {}
    for seed in SEEDS:
        records.append(run("none", None, 0, seed, data, test))
        records.append(run("none_uls", None, 16, seed, data, test))
        print(records[-2:], flush=True)
    for epsilon in EPSILONS:
        for seed in SEEDS:
            for k in KS:
                for kind in ("uls", "els"):
                    records.append(run(kind, epsilon, k, seed, data, test))
                    print(records[-1], flush=True)
            records.append(run("example", epsilon, 0, seed, data, test))
            print(records[-1], flush=True)
        sigma = next(
            r["sigma"] for r in records if r["kind"] == "example" and r["epsilon"] == epsilon
        )
        extra[str(epsilon)] = per_user_of_example_level(sigma, counts)
        print(extra[str(epsilon)], flush=True)
    out = Path(args.out)
    saved = out / "user_level_timing.json"
    timings = json.loads(saved.read_text()) if saved.exists() and not args.smoke else []
    name = "user_level_smoke" if args.smoke else "user_level"
    (out / f"{name}.json").write_text(
        json.dumps(
            {"records": records, "example_level_per_user": extra, "timing": timings}, indent=1
        )
    )
    (out / f"{name}.md").write_text(table(records, extra, timings) + "\n")
    print(table(records, extra, timings))


if __name__ == "__main__":
    main()
