"""Privacy-utility trade-off of DP-SGD on scikit-learn's handwritten digits.

The data: the 1797 8x8 digit images bundled with scikit-learn (no download); a
stratified 20% test split is held out once, the other 1437 images are private. The
features (``featurize``) are functions of ONE image and public constants: centred
pixels and edge energies from a fixed filter bank, rescaled to L2 norm 6 (as Tramer &
Boneh 2021 do). No statistic of the training set enters, so they need no accounting.

For each target epsilon the first seed's ``dpfunc.Trainer(target_epsilon=...)``
calibrates the noise multiplier and the other seeds reuse it; each trains with
``trainer.fit()`` and is scored on the test set. The epsilon reported is the trainer's
accountant value (PLD), checked against the target; a non-private baseline runs the
same pipeline with ``noise_multiplier=0``. The seeds are public so that the table
reproduces: research on public data, not a private release (a seed regenerates the
noise); a private run keeps the Trainer's default ``seed=None``.

The defaults were chosen on validation splits of the training set by
``examples/tune_digits.py``, never on the test set; the settings left off below (EMA,
adaptive clipping, random features, an MLP, augmentations, a smaller sample rate) are
what it tried. docs/examples.md has this script's table and that search's ablation.

Output: the table on stdout, ``<out>/digits.json`` (one record per budget: epsilon,
noise multiplier, test accuracy over the seeds, the seeds, the schedule, the seconds) and
``<out>/digits.png``. docs/digits.json is the one the docs quote (tests/test_demo_results.py).

Run (about 20 s on 2 idle CPU cores, longer when other work shares them):

    make demo                                  # = python examples/digits.py
    python examples/digits.py --out DIR        # write the results to DIR (docs: the quoted ones)
    python examples/digits.py --smoke          # one seed, a few steps, seconds
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import report  # examples/report.py: tables, JSON and plots
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import Tensor, nn
from torch.func import functional_call

import dpfunc

# --- settings ---------------------------------------------------------------
TARGET_EPSILONS = [1.0, 3.0, 8.0]  # private runs, one per privacy budget ...
DELTA = 1e-5  # ... at this delta (well below 1 / 1437 training examples)
SEEDS = [0, 1, 2]  # public seeds (initialisation, batches, noise): reproducible, NOT private
SPLIT_SEED = 0  # fixes the stratified 80/20 train/test split, the same for every seed
TEST_FRACTION = 0.2  # held-out test share; never used to choose anything
# "pixels": the pixels scaled to [-1, 1], centred on the image's own mean; "pixels+edges": and
# oriented edge energies (Sobel, rectified, averaged over 2x2 cells: a fixed filter bank)
FEATURES = "pixels+edges"
EDGE_ORIENTATIONS = 4  # directions of the edge filters (4: every 90 degrees)
EDGE_WEIGHT = 0.25  # scale of the edge block (each image's edge energies have unit std) ...
FEATURE_NORM = 6.0  # ... then each example's feature vector rescaled to this L2 norm (None: not)
RANDOM_FEATURES = 0  # width of fixed random ReLU features on top (0: none), drawn from ...
RANDOM_FEATURES_SEED = 1234  # ... this PUBLIC seed: data-independent, so it leaks nothing
AUGMENTATIONS = 1  # augmentation multiplicity: 1 (off), 5 or 9 one-pixel shifts per example
MODEL = "linear"  # "linear" (softmax regression) or "mlp" (one tanh hidden layer)
HIDDEN = 32  # hidden units of the "mlp" model
CLIPPING = "normalized"  # automatic clipping (Bu et al. 2022): each gradient scaled to norm ~C
CLIP_NORM = 1.0  # C; with normalized clipping only learning rate * C matters
TARGET_QUANTILE = None  # adaptive clipping (Andrew et al. 2021; needs CLIPPING "flat"): None = off
OPTIMIZER = "sgd"  # "sgd" (with MOMENTUM) or "adam"
MOMENTUM = 0.9  # heavy-ball momentum of "sgd"
SAMPLE_RATE = 1.0  # Poisson inclusion probability; 1.0: every example in every step
EMA_DECAY = None  # EMA of the iterates (post-processing, free); None: the last iterate
# target epsilon (None: non-private) -> (steps, learning rate); epochs = steps * SAMPLE_RATE
SCHEDULE = {1.0: (20, 1.0), 3.0: (40, 2.0), 8.0: (40, 4.0), None: (320, 4.0)}
THREADS = 1  # torch CPU threads; tiny models run fastest on one
PLOT_NAME, JSON_NAME = "digits.png", "digits.json"  # files written to --out

# --smoke: one seed, one target, a few steps; checks that the script runs
SMOKE = dict(TARGET_EPSILONS=[3.0], SEEDS=[0], STEPS=4)


# --- the pipeline (also used by examples/tune_digits.py) --------------------


def load_images():
    """(x_train, y_train), (x_test, y_test): images [n, 8, 8] in [0, 1], labels [n]."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32).reshape(-1, 8, 8) / 16.0  # public constant
    y = torch.tensor(digits.target, dtype=torch.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=TEST_FRACTION, stratify=y, random_state=SPLIT_SEED
    )
    return (x_train, y_train), (x_test, y_test)


def shifted(images: Tensor, augmentations: int) -> Tensor:
    """[n, 8, 8] -> [n, K, 8, 8]: the image itself first, then its one-pixel shifts (zero fill)."""
    offsets = [(0, 0), (1, 0), (-1, 0), (0, 1), (0, -1), (1, 1), (1, -1), (-1, 1), (-1, -1)]
    if augmentations not in (1, 5, 9):
        raise ValueError(f"augmentations must be 1, 5 or 9, got augmentations={augmentations!r}")
    padded = F.pad(images, (1, 1, 1, 1))
    return torch.stack(
        [padded[:, 1 - i : 9 - i, 1 - j : 9 - j] for i, j in offsets[:augmentations]], 1
    )


def edge_energies(images: Tensor, orientations: int = EDGE_ORIENTATIONS) -> Tensor:
    """[..., 8, 8] -> [..., 16 + 16 * orientations]: a fixed filter bank, per image.

    The 2x2-cell mean intensity and, for each direction, the rectified directional
    derivative (Sobel) averaged over 2x2 cells; standardised by the image's own stats.
    """
    shape = images.shape[:-2]
    x = images.reshape(-1, 1, 8, 8)
    sobel = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]]) / 8
    gradient = F.conv2d(x, torch.stack([sobel, sobel.T])[:, None], padding=1)  # [N, 2, 8, 8]
    angles = torch.arange(orientations) * (2 * math.pi / orientations)
    cos, sin = torch.cos(angles)[:, None, None], torch.sin(angles)[:, None, None]
    directional = F.relu(cos * gradient[:, :1] + sin * gradient[:, 1:])  # [N, orientations, 8, 8]
    f = torch.cat([F.avg_pool2d(x, 2), F.avg_pool2d(directional, 2)], 1).flatten(1)
    f = (f - f.mean(1, keepdim=True)) / (f.std(1, keepdim=True) + 1e-6)  # this image's own stats
    return f.reshape(*shape, -1)


def featurize(
    images: Tensor, features: str = FEATURES, *, edge_orientations: int = EDGE_ORIENTATIONS,
    edge_weight: float = EDGE_WEIGHT, feature_norm: float | None = FEATURE_NORM,
    random_features: int = RANDOM_FEATURES, augmentations: int = AUGMENTATIONS,
) -> Tensor:  # fmt: skip
    """[n, 8, 8] images -> [n, K, d] features of each image's K augmented copies.

    Each step is a function of one image and public constants: nothing to account.
    """
    x = shifted(images, augmentations)  # [n, K, 8, 8]
    pixels = (2.0 * x - 1.0).flatten(-2)  # [-1, 1]
    f = pixels - pixels.mean(-1, keepdim=True)  # centred on the image's own mean
    if features == "pixels+edges":
        f = torch.cat([f, edge_weight * edge_energies(x, edge_orientations)], -1)
    elif features != "pixels":
        raise ValueError(f"features must be 'pixels' or 'pixels+edges', got features={features!r}")
    if random_features:
        generator = torch.Generator().manual_seed(RANDOM_FEATURES_SEED)  # public
        w = torch.randn(f.shape[-1], random_features, generator=generator)
        f = F.relu(f @ w / f.shape[-1] ** 0.5)
    if feature_norm is not None:
        f = feature_norm * f / (f.norm(dim=-1, keepdim=True) + 1e-6)
    return f


def make_model(inputs: int, model: str = MODEL, hidden: int = HIDDEN) -> nn.Module:
    """Softmax regression or a one-hidden-layer tanh MLP on ``inputs`` features."""
    if model == "linear":
        return nn.Linear(inputs, 10)
    if model == "mlp":
        return nn.Sequential(nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, 10))
    raise ValueError(f"model must be 'linear' or 'mlp', got model={model!r}")


def make_optimizer(lr: float):
    """The dpfunc optimizer of ``OPTIMIZER``: SGD with heavy-ball ``MOMENTUM``, or Adam."""
    if OPTIMIZER == "sgd":
        return dpfunc.optim.sgd(lr=lr, momentum=MOMENTUM)
    if OPTIMIZER == "adam":
        return dpfunc.optim.adam(lr=lr)
    raise ValueError(f"OPTIMIZER must be 'sgd' or 'adam', got OPTIMIZER={OPTIMIZER!r}")


def train(
    train_set, *, seed: int, steps: int, lr: float, sample_rate: float = SAMPLE_RATE,
    noise_multiplier: float | None = None, target_epsilon: float | None = None,
    model: str = MODEL, hidden: int = HIDDEN, clipping: str = CLIPPING,
    target_quantile: float | None = TARGET_QUANTILE, ema_decay: float | None = EMA_DECAY,
    use_fit: bool = True,
):  # fmt: skip
    """Trains one model with ``dpfunc.Trainer``; returns ``(trainer, net)``.

    ``train_set`` is ``(features [n, K, d], labels [n])``: an example's loss is averaged
    over its K augmented copies (one example, one gradient, clipped once). Give
    ``noise_multiplier`` or ``target_epsilon``. ``net`` holds the EMA of the iterates
    if ``ema_decay`` is given (post-processing: free), else the last iterate.
    ``use_fit=False`` steps by hand, without ``fit()``'s per-epoch epsilon.
    """
    x, _ = train_set
    n, copies, inputs = x.shape
    torch.manual_seed(seed)  # the initialisation
    net = make_model(inputs, model, hidden)
    params, buffers = dpfunc.functionalize(net)

    def loss_fn(params, example):
        """ONE example's cross-entropy, averaged over its augmented copies."""
        xi, yi = example  # [K, d], []
        logits = functional_call(net, (params, buffers), (xi,))
        return F.cross_entropy(logits, yi.expand(copies))

    expected_batch_size = sample_rate * n
    adaptive = {}
    if target_quantile is not None:  # the unclipped count's noise is accounted with the sum
        adaptive = dict(target_quantile=target_quantile, quantile_learning_rate=0.2)
    trainer = dpfunc.Trainer(
        loss_fn, params, train_set, optimizer=make_optimizer(lr),
        epochs=steps / max(1, round(n / expected_batch_size)),  # steps = epochs * steps/epoch
        expected_batch_size=expected_batch_size, clip_norm=CLIP_NORM, clipping=clipping,
        noise_multiplier=noise_multiplier, target_epsilon=target_epsilon, delta=DELTA,
        seed=seed, progress=False, **adaptive,
    )  # fmt: skip
    if trainer.total_steps != steps:
        raise ValueError(f"planned {trainer.total_steps} steps, wanted {steps}")
    average = None  # the EMA of the iterates: reads only released parameters
    if use_fit and ema_decay is None:
        trainer.fit()
    else:
        for _ in range(trainer.total_steps):
            trainer.train_step()
            if ema_decay is not None:
                new = trainer.params
                average = dict(new) if average is None else {
                    k: ema_decay * average[k] + (1 - ema_decay) * v for k, v in new.items()
                }  # fmt: skip
    net.load_state_dict(trainer.params if average is None else average, strict=False)
    return trainer, net


@torch.no_grad()
def accuracy(net: nn.Module, data) -> float:
    """Accuracy on ``(features [n, K, d], labels)``, on each example's un-augmented copy."""
    x, y = data
    return float((net(x[:, 0]).argmax(1) == y).float().mean())


# --- the demo ---------------------------------------------------------------


def run_budget(train_set, test_set, target: float | None, seeds, steps: int, lr: float) -> dict:
    """One row of the table: every seed at one target epsilon (None: non-private), a record.

    The first seed's trainer calibrates the noise multiplier and the other seeds reuse it.
    tests/test_demo_results.py reruns the private rows against docs/digits.json.
    """
    started, accuracies, epsilons = time.perf_counter(), [], []
    sigma = None if target is not None else 0.0
    for seed in seeds:
        trainer, net = train(
            train_set, seed=seed, steps=steps, lr=lr, noise_multiplier=sigma,
            target_epsilon=target if sigma is None else None,
        )  # fmt: skip
        if TARGET_QUANTILE is None or target is None:  # (adaptive: each seed calibrates)
            sigma = trainer.noise_multiplier  # calibrated by the first seed's trainer, reused
        accuracies.append(accuracy(net, test_set))
        epsilons.append(trainer.epsilon())
    sigma = trainer.noise_multiplier  # the gradient's (adaptive clipping: without the count)
    if target is not None and not max(epsilons) <= target:
        raise RuntimeError(f"accountant epsilon {max(epsilons)} exceeds target {target}")
    epsilon, (mean, std) = statistics.fmean(epsilons), report.mean_std(accuracies)
    return dict(
        epsilon=epsilon if math.isfinite(epsilon) else None, target_epsilon=target, delta=DELTA,
        noise_multiplier=sigma, accuracy=mean, accuracy_std=std, accuracies=accuracies,
        seconds=time.perf_counter() - started, steps=steps, learning_rate=lr,
        sample_rate=SAMPLE_RATE, features=FEATURES, ema_decay=EMA_DECAY, seeds=list(seeds),
    )  # fmt: skip


def main(smoke: bool, out: str) -> None:
    started = time.perf_counter()
    torch.set_num_threads(THREADS)
    targets, seeds = TARGET_EPSILONS, SEEDS
    if smoke:
        targets, seeds = SMOKE["TARGET_EPSILONS"], SMOKE["SEEDS"]
    (x_train, y_train), (x_test, y_test) = load_images()
    train_set, test_set = (featurize(x_train), y_train), (featurize(x_test), y_test)
    print(
        f"digits: {len(x_train)} private training images, {len(x_test)} test images, "
        f"{FEATURES} features (d={train_set[0].shape[-1]}), {MODEL} model, seeds {seeds}\n"
    )
    columns = [("epsilon", 8), ("delta", 7), ("sigma", 7), ("steps", 5), ("lr", 4)]
    columns += [("test accuracy", 17), ("seconds", 7)]
    report.print_header(columns)
    records = []
    for target in [*targets, None]:  # None: the non-private baseline
        steps, lr = SCHEDULE[target]
        r = run_budget(train_set, test_set, target, seeds, SMOKE["STEPS"] if smoke else steps, lr)
        records.append(r)
        epsilon = math.inf if r["epsilon"] is None else r["epsilon"]
        cells = [f"{epsilon:.3f}", f"{DELTA:.0e}", f"{r['noise_multiplier']:.3f}", f"{r['steps']}"]
        cells += [f"{lr:g}", f"{r['accuracy']:.4f} +- {r['accuracy_std']:.4f}"]
        report.print_row(columns, [*cells, f"{r['seconds']:.1f}"])
    report.save_json(records, os.path.join(out, JSON_NAME))

    # The privacy-utility plot.
    private = [r for r in records if r["epsilon"] is not None]
    x, y, err = ([r[k] for r in private] for k in ("epsilon", "accuracy", "accuracy_std"))
    fig, ax = report.pyplot().subplots(figsize=(5.5, 4))
    ax.errorbar(x, y, yerr=err, marker="o", capsize=4, label=f"DP-SGD (delta={DELTA:g})")
    base = records[-1]["accuracy"]  # the non-private baseline, run last
    ax.axhline(base, color="gray", linestyle="--", label=f"non-private ({base:.3f})")
    ylabel = f"test accuracy (mean +- std, {len(seeds)} seeds)"
    report.epsilon_axis(ax, x, xlabel="epsilon (PLD accountant)", ylabel=ylabel,
                        title="dpfunc on sklearn digits")  # fmt: skip
    report.save_figure(fig, os.path.join(out, PLOT_NAME))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan  # other work slows it
    print(f"{time.perf_counter() - started:.1f} s, {os.cpu_count()} CPU cores, load {load:.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one seed, a few steps")
    parser.add_argument("--out", default="results", help="directory for the JSON and the plot")
    args = parser.parse_args()
    main(args.smoke, args.out)
