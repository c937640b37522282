"""A small Transformer encoder trained with DP-SGD through dpfunc.Trainer.

What it shows: ``nn.TransformerEncoder`` (with ``nn.MultiheadAttention`` inside)
needs no changes for per-example gradients in dpfunc: the loss sees one
sequence, ``torch.func.vmap(grad(loss))`` maps it over the batch, and the
stock module is used as is. (Opacus computes per-sample gradients with hooks
per layer type and supports MultiheadAttention only after swapping in its own
``DPMultiheadAttention``.)

The task, generated here: each example is a sequence of SEQ_LEN tokens drawn
uniformly from VOCAB_SIZE tokens; the label says whether token A occurs more
often in it than token B (a vote between two candidates among distractor
tokens; ties are redrawn). The model has to count two tokens among the others
across the whole sequence and compare the counts. The task is deliberately
easy (a non-private model solves it in a few dozen steps): the point is the
stock attention module under DP-SGD, in about a minute on a CPU.

The model: token and learned position embeddings, a TransformerEncoder
(``batch_first=True``, dropout 0, ``enable_nested_tensor=False``), mean
pooling over positions and a linear classifier. It is trained privately with
Adam (noise calibrated to a target epsilon at delta = 1e-5), then the script
prints the test accuracy and the epsilon spent, and writes them to
``<out>/transformer_classify.json``.

Run (about 20 seconds on a CPU):

    python examples/transformer_classify.py           # full run
    python examples/transformer_classify.py --smoke   # a few steps, a few seconds
"""

from __future__ import annotations

import argparse
import os
import time

import report  # examples/report.py: tables, JSON and plots
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

import dpfunc

# The noise calibration's first guess (dp-accounting's RDP accountant) logs harmless
# "failed to converge ... Excluding this order" warnings for some settings; hide them.

# --- settings ---------------------------------------------------------------
VOCAB_SIZE = 8  # tokens 0 .. VOCAB_SIZE - 1
SEQ_LEN = 16  # tokens per sequence
TOKEN_A, TOKEN_B = 1, 2  # label 1 iff token A occurs more often than token B (ties redrawn)
NUM_TRAIN = 20_000  # private training sequences
NUM_TEST = 2_000  # held-out sequences for the accuracy
D_MODEL = 32  # embedding width
NUM_HEADS = 4  # attention heads per layer
NUM_LAYERS = 1  # encoder layers
DIM_FEEDFORWARD = 64  # hidden width of each layer's MLP
EXPECTED_BATCH_SIZE = 500  # sample_rate * NUM_TRAIN
EPOCHS = 2  # planned passes over the training data
LEARNING_RATE = 3e-3  # Adam step size
CLIP_NORM = 1.0  # per-example gradient bound C
TARGET_EPSILON = 8.0  # privacy budget ...
DELTA = 1e-5  # ... at this delta (below 1 / NUM_TRAIN)
SEED = 0  # fixes the data and the initialisation (public); batches and noise use a fresh secret
THREADS = 1  # torch CPU threads: these small ops gain nothing from more, and on busy
# cores extra threads wait for each other (2 threads ran 10x slower on 2 busy cores here)

SMOKE_NUM_TRAIN = 400  # --smoke: a little data ...
SMOKE_BATCH_SIZE = 100  # ... small batches ...
SMOKE_EPOCHS = 0.5  # ... two steps ...
SMOKE_NOISE_MULTIPLIER = 1.0  # ... and a fixed sigma (calibrating takes seconds): checks it runs


def make_data(num: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``num`` sequences [num, SEQ_LEN] (int64) and labels [num]: more A's than B's?"""
    tokens = torch.randint(VOCAB_SIZE, (num, SEQ_LEN), generator=generator)
    margin = (tokens == TOKEN_A).sum(1) - (tokens == TOKEN_B).sum(1)
    while (tie := margin == 0).any():  # redraw ties, so every label is defined
        tokens[tie] = torch.randint(VOCAB_SIZE, (int(tie.sum()), SEQ_LEN), generator=generator)
        margin = (tokens == TOKEN_A).sum(1) - (tokens == TOKEN_B).sum(1)
    return tokens, (margin > 0).long()


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB_SIZE, D_MODEL)
        self.position = nn.Parameter(0.02 * torch.randn(SEQ_LEN, D_MODEL))
        layer = nn.TransformerEncoderLayer(
            D_MODEL, NUM_HEADS, DIM_FEEDFORWARD, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, NUM_LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(D_MODEL, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [N, SEQ_LEN] -> [N, 2]
        h = self.encoder(self.embed(tokens) + self.position)
        return self.head(h.mean(dim=1))


def main(smoke: bool, out: str) -> None:
    num_train, batch, epochs = NUM_TRAIN, EXPECTED_BATCH_SIZE, EPOCHS
    privacy = dict(target_epsilon=TARGET_EPSILON)
    if smoke:
        num_train, batch, epochs = SMOKE_NUM_TRAIN, SMOKE_BATCH_SIZE, SMOKE_EPOCHS
        privacy = dict(noise_multiplier=SMOKE_NOISE_MULTIPLIER)
    torch.set_num_threads(THREADS)
    torch.manual_seed(SEED)
    generator = torch.Generator().manual_seed(SEED)
    x_train, y_train = make_data(num_train, generator)
    x_test, y_test = make_data(NUM_TEST, generator)

    model = Classifier()
    params, buffers = dpfunc.functionalize(model)
    num_params = sum(p.numel() for p in params.values())

    def loss_fn(params, example):
        """ONE sequence's cross-entropy; the module sees a batch of 1."""
        tokens, label = example
        logits = functional_call(model, (params, buffers), (tokens.unsqueeze(0),))
        return F.cross_entropy(logits, label.unsqueeze(0))

    def evaluate(params) -> dict[str, float]:
        with torch.no_grad():
            logits = functional_call(model, (params, buffers), (x_test,))
        return {"test_accuracy": float((logits.argmax(1) == y_test).float().mean())}

    trainer = dpfunc.Trainer(
        loss_fn,
        params,
        (x_train, y_train),
        optimizer=dpfunc.optim.adam(lr=LEARNING_RATE),
        epochs=epochs,
        expected_batch_size=batch,
        clip_norm=CLIP_NORM,
        delta=DELTA,
        eval_fn=evaluate,
        progress=not smoke,
        **privacy,
    )
    print(
        f"{num_train} training sequences of {SEQ_LEN} tokens (vocabulary {VOCAB_SIZE}), "
        f"label: more {TOKEN_A}s than {TOKEN_B}s; {num_params} parameters"
    )
    print(
        f"noise_multiplier {trainer.noise_multiplier:.3f}, clip_norm {CLIP_NORM}, "
        f"expected batch {batch}, {trainer.total_steps} steps"
    )
    print(f"before training: test accuracy {evaluate(params)['test_accuracy']:.3f}")
    started = time.perf_counter()
    # torch's fused CPU attention kernel has no vmap batching rule: under vmap it falls
    # back to a slow per-example loop (with a warning). The math kernel is made of
    # batchable ops: same result, about 1.5x faster per-example gradients here.
    with sdpa_kernel(SDPBackend.MATH):
        history = trainer.fit()
    for record in history:
        print(
            f"  epoch {record['epoch']:4.1f}  step {record['steps']:4d}  "
            f"train loss {record['loss']:.4f}  test accuracy {record['test_accuracy']:.3f}  "
            f"epsilon {record['epsilon']:.2f}"
        )
    seconds = time.perf_counter() - started
    accuracy = evaluate(trainer.params)["test_accuracy"]
    epsilon = trainer.epsilon()
    print(f"test accuracy {accuracy:.3f} at epsilon {epsilon:.2f}, delta {trainer.delta:g}")
    print(f"training took {seconds:.1f} s")
    summary = {
        "test_accuracy": accuracy,
        "epsilon": epsilon,
        "delta": trainer.delta,
        "noise_multiplier": trainer.noise_multiplier,
        "steps": trainer.steps_done,
        "seconds": seconds,
    }
    report.save_json(summary, os.path.join(out, "transformer_classify.json"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few steps, to check it runs")
    parser.add_argument("--out", default="results", help="output directory (created)")
    args = parser.parse_args()
    main(args.smoke, args.out)
