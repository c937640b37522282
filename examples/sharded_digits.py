"""Sharded private training: each rank holds 1/world of the model, under torchrun.

What it shows: ``dpfunc.Trainer(..., shard=True)``. Every rank runs this
same script. Each rank keeps only its rows (dim 0) of every parameter, of
Adam's two moments and (with ``BANDS > 1``) of the correlated-noise history;
for each logical step it gathers the whole model once, computes the clipped
gradient sum of its share of the Poisson batch, and the ranks reduce-scatter
the sums, so each rank adds the noise to its own rows only. The noise each
rank draws is exactly its rows of what one process would draw, so the run
is the single-process run, with the same accounting. Checkpoints are
``torch.distributed.checkpoint`` directories: every rank writes its rows,
and a run saved on 2 ranks resumes on 4. Rank 0 prints the results and what
each rank holds.

The data: scikit-learn's 1797 8x8 digits (no download), pixels /16, 80%
train / 20% test. The model: an MLP 64 -> 256 -> 256 -> 10 (tanh), trained
with Adam to a target epsilon at delta = 1e-5.

Run (about 15 seconds on 2 CPU cores; test accuracy about 0.88 at epsilon 2):

    torchrun --nproc-per-node 2 examples/sharded_digits.py                 # full run
    torchrun --nproc-per-node 2 examples/sharded_digits.py --smoke         # a few steps
    torchrun --nproc-per-node 4 examples/sharded_digits.py --out ckpt      # resumes ckpt

Rerunning with the same ``--out`` resumes the checkpoint there, on any
number of ranks. On several machines, start the same command on each with
torchrun's rendezvous (see docs/sharded.md).
"""

from __future__ import annotations

import argparse
import os

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
PHYSICAL_BATCH_SIZE = 48  # rows per micro-batch; fixed, so a checkpoint resumes on any rank count
CLIP_NORM = 1.0  # the per-example gradient bound C
LEARNING_RATE = 1e-2  # Adam's step size
HIDDEN = 256  # width of the two hidden layers
BANDS = 2  # correlated noise with this many bands (1: DP-SGD's independent noise)
SEED = 0  # fixes the split and the initial model (public); batches and noise use a secret
TIMEOUT_S = 120.0  # a collective waiting longer than this means a rank died or hangs


def state_bytes(tree) -> int:
    return sum(x.numel() * x.element_size() for x in dpfunc.tree.tree_leaves(tree))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a few steps, to check it runs")
    parser.add_argument("--out", default=None, help="checkpoint directory (resumed if present)")
    args = parser.parse_args()

    info = dpfunc.distributed.init(timeout_s=TIMEOUT_S)  # reads torchrun's environment
    torch.set_num_threads(1)  # one core per rank

    digits = load_digits()  # the same data, split and model on every rank (checked)
    x = torch.tensor(digits.data, dtype=torch.float32).to(info.device) / 16.0  # NCCL: a GPU
    y = torch.tensor(digits.target, dtype=torch.int64).to(info.device)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(SEED))
    test, train = order[: len(x) // 5], order[len(x) // 5 :]

    torch.manual_seed(SEED)  # rank 0's initial parameters are the ones sharded
    model = nn.Sequential(
        nn.Linear(64, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
        nn.Linear(HIDDEN, 10),
    ).to(info.device)  # fmt: skip
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(params, example):  # ONE example, no batch dimension; params are whole
        xi, yi = example
        logits = functional_call(model, (params, buffers), (xi.unsqueeze(0),))
        return F.cross_entropy(logits, yi.unsqueeze(0))

    def accuracy(params) -> dict[str, float]:  # the Trainer passes the whole parameters
        logits = functional_call(model, (params, buffers), (x[test],))
        return {"accuracy": float((logits.argmax(1) == y[test]).float().mean())}

    options = {}
    if args.out is not None:
        options["checkpoint_path"] = os.path.abspath(args.out)  # a directory, every rank writes
    trainer = dpfunc.Trainer(
        loss_fn,
        params,
        (x[train], y[train]),
        optimizer=dpfunc.optim.adam(lr=LEARNING_RATE),
        epochs=0.5 if args.smoke else EPOCHS,
        expected_batch_size=EXPECTED_BATCH_SIZE,
        physical_batch_size=PHYSICAL_BATCH_SIZE,
        clip_norm=CLIP_NORM,
        target_epsilon=TARGET_EPSILON,
        delta=DELTA,
        bands=BANDS,
        model=model,  # ghost clipping for the linear layers
        shard=True,  # each rank: its rows of the parameters, of Adam's moments, of the history
        eval_fn=accuracy,
        progress=info.rank == 0,
        **options,
    )
    del params  # this rank's copy of the whole model: the trainer keeps rows only
    trainer.fit()

    state = trainer.state
    held = state_bytes((state.params, state.opt_state, state.noise_state))
    everyone = [0] * info.world_size
    torch.distributed.all_gather_object(everyone, held)
    whole = trainer.full_params()  # collective: every rank gathers
    final = accuracy(whole)["accuracy"]
    if info.rank == 0:
        total = sum(everyone)
        print(
            f"ranks {info.world_size}, steps {trainer.steps_done}, sigma "
            f"{trainer.noise_multiplier:.3f}: epsilon = {trainer.epsilon():.3f} at delta = "
            f"{trainer.delta:g}, test accuracy = {final:.3f}\n"
            f"state held per rank (params + Adam + noise history): "
            f"{', '.join(f'{b / 1e6:.2f} MB' for b in everyone)} of {total / 1e6:.2f} MB"
        )
    dpfunc.distributed.shutdown()


if __name__ == "__main__":
    main()
