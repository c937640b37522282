"""Data-parallel private training: scikit-learn's digits on two processes.

What it shows: ``dpfunc.Trainer`` under ``torchrun``. Every rank runs this
same script; ``dpfunc.distributed.init()`` joins them into one process group
(gloo on CPU, NCCL on GPU), and the Trainer then detects it: each Poisson
batch is split across the ranks, the clipped gradient sums are all-reduced,
the Gaussian noise is added once to the global sum (every rank draws the
same noise from one secret seed, which rank 0 draws and broadcasts), and
every rank applies the same update, so the ranks' parameters stay
bit-identical. The privacy accounting
is that of one process training on the whole dataset: one step per logical
batch, at the whole dataset's sample rate. Rank 0 shows the progress bar and
prints the results.

The data: 1797 8x8 images of handwritten digits (bundled with scikit-learn,
no download), pixels scaled to [0, 1] by /16, 80% train / 20% test. The
model: a small MLP (64 -> 64 -> 10, tanh), trained with Adam to a target
epsilon at delta = 1e-5.

Run (about 15 seconds on 2 CPU cores; test accuracy about 0.9 at epsilon 2):

    torchrun --nproc-per-node 2 examples/ddp_digits.py            # full run
    torchrun --nproc-per-node 2 examples/ddp_digits.py --smoke    # a few steps

If a rank dies or hangs, the others stop with a ``CollectiveError`` after at
most ``TIMEOUT_S`` seconds instead of waiting forever.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.func import functional_call

import dpfunc

# --- settings ---------------------------------------------------------------
TARGET_EPSILON = 2.0  # the privacy budget of the whole run ...
DELTA = 1e-5  # ... at this delta (well below 1 / num_train_examples)
EPOCHS = 10  # planned passes over the training set (smoke: a few steps)
EXPECTED_BATCH_SIZE = 128  # of the whole logical batch, over all ranks
CLIP_NORM = 1.0  # the per-example gradient bound C
LEARNING_RATE = 2e-2  # Adam's step size
HIDDEN = 64  # width of the hidden layer
SEED = 0  # fixes the split and the initial model (public); batches and noise use a secret
TIMEOUT_S = 120.0  # a collective waiting longer than this means a rank died or hangs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a few steps, to check it runs")
    args = parser.parse_args()

    info = dpfunc.distributed.init(timeout_s=TIMEOUT_S)  # reads torchrun's environment
    torch.set_num_threads(1)  # one core per rank

    # the same data, split and model on every rank (the Trainer checks the settings agree)
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32).to(info.device) / 16.0  # NCCL: a GPU
    y = torch.tensor(digits.target, dtype=torch.int64).to(info.device)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(SEED))
    test, train = order[: len(x) // 5], order[len(x) // 5 :]

    torch.manual_seed(SEED)  # rank 0's initial parameters are broadcast anyway
    model = nn.Sequential(nn.Linear(64, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 10))
    model.to(info.device)
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(params, example):  # ONE example, no batch dimension
        xi, yi = example
        logits = functional_call(model, (params, buffers), (xi.unsqueeze(0),))
        return F.cross_entropy(logits, yi.unsqueeze(0))

    def accuracy(params) -> float:
        logits = functional_call(model, (params, buffers), (x[test],))
        return float((logits.argmax(1) == y[test]).float().mean())

    trainer = dpfunc.Trainer(
        loss_fn,
        params,
        (x[train], y[train]),
        optimizer=dpfunc.optim.adam(lr=LEARNING_RATE),
        epochs=0.5 if args.smoke else EPOCHS,
        expected_batch_size=EXPECTED_BATCH_SIZE,
        clip_norm=CLIP_NORM,
        target_epsilon=TARGET_EPSILON,
        delta=DELTA,
        # seed=None: a fresh secret from rank 0, shared by all ranks
        # distributed: detected from the process group initialised above
    )
    trainer.fit()

    if info.rank == 0:
        print(
            f"ranks {info.world_size}, steps {trainer.steps_done}, "
            f"sigma {trainer.noise_multiplier:.3f}: epsilon = {trainer.epsilon():.3f} "
            f"at delta = {trainer.delta:g}, test accuracy = {accuracy(trainer.params):.3f}"
        )
    dpfunc.distributed.shutdown()


if __name__ == "__main__":
    main()
