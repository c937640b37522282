"""An Opacus training script ported to dpfunc line by line, and both timed as fresh processes.

The script is the shape of Opacus' own MNIST example (a small convolutional
network, ``torch.optim.SGD``, ``make_private_with_epsilon``, a loop over the
private DataLoader, ``get_epsilon`` after each epoch), run on scikit-learn's
bundled 8x8 digits (1437 training images after a stratified 20% split; no
download). ``train_opacus`` and ``train_dpfunc`` are the two versions, line
for line: the comments in ``train_dpfunc`` name the Opacus line each replaces.
What changes:

* the loss is written for ONE example (``loss_fn(params, example)``), which is
  what per-example clipping differentiates, instead of a batch loss;
* ``PrivacyEngine.make_private_with_epsilon`` becomes ``dpfunc.PrivateGradients``
  (same settings: expected batch size, clip norm, target epsilon, delta,
  epochs), which leaves the model and the optimizer as they are;
* the DataLoader loop becomes ``private.batches(...)``, and the three lines
  ``output = model(x); loss = criterion(output, y); loss.backward()`` become
  ``private.backward(batch)``;
* ``privacy_engine.get_epsilon(delta)`` becomes ``private.epsilon(delta)``.

Both train with Poisson sampling at the same rate, the same clip norm and a
noise multiplier each calibrated for epsilon 3 at delta 1e-5 (dpfunc with
dp-accounting's PLD accountant, Opacus with its default PRV accountant), and
are scored on the held-out test images. Each run is a fresh process (imports,
data, calibration, training, epsilon after every epoch), the two libraries
alternating; the table gives the median wall time and the test accuracy.
The seeds are public (reproducible research on public data).

Run (about 2 minutes on 2 CPU cores; needs ``opacus``, the ``bench`` extra):

    python examples/opacus_port.py                 # 3 runs of each, the table
    python examples/opacus_port.py --smoke         # 1 run of each, 1 epoch
    python examples/opacus_port.py --run dpfunc    # one run, its JSON record
    python examples/opacus_port.py --device cuda   # on a GPU (data moved there once)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

STARTED = time.perf_counter()

import torch  # noqa: E402 (imports are part of what is timed)
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

EPOCHS = 10  # passes over the training data
BATCH_SIZE = 64  # expected (Poisson) batch size
LR = 0.5  # SGD learning rate, no momentum
MAX_GRAD_NORM = 1.0  # per-example clip norm C
EPSILON = 3.0  # target epsilon ...
DELTA = 1e-5  # ... at this delta
SEED = 0  # public: model initialisation and the test split
DEVICE = "cpu"  # where the model trains ("cuda" with a GPU: --device cuda)


class SampleConvNet(nn.Module):
    """Opacus' MNIST example network, sized for 8x8 images."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 2 * 2, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)  # 16 x 4 x 4
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # 32 x 2 x 2
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def digits():
    """(train_x, train_y, test_x, test_y): 8x8 images in [0, 1], a stratified 20% test split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target)
    split = train_test_split(range(len(y)), test_size=0.2, stratify=y, random_state=SEED)
    train, test = (torch.tensor(part) for part in split)
    return x[train], y[train], x[test], y[test]


def accuracy(model, x, y) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def train_opacus(epochs: int, device: str = DEVICE) -> dict:
    """The Opacus script."""
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    train_x, train_y, test_x, test_y = digits()
    torch.manual_seed(SEED)
    train_loader = DataLoader(TensorDataset(train_x, train_y), batch_size=BATCH_SIZE)
    model = SampleConvNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0)
    criterion = nn.CrossEntropyLoss()
    setup = time.perf_counter()
    privacy_engine = PrivacyEngine()
    model, optimizer, train_loader = privacy_engine.make_private_with_epsilon(
        module=model,
        optimizer=optimizer,
        data_loader=train_loader,
        target_epsilon=EPSILON,
        target_delta=DELTA,
        epochs=EPOCHS,
        max_grad_norm=MAX_GRAD_NORM,
    )
    calibrated = time.perf_counter()
    epsilon_s = 0.0
    for _ in range(epochs):
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            output = model(x)
            loss = criterion(output, y)
            loss.backward()
            optimizer.step()
        before = time.perf_counter()
        epsilon = privacy_engine.get_epsilon(DELTA)
        epsilon_s += time.perf_counter() - before
    return _record(model, test_x.to(device), test_y.to(device), epsilon, optimizer.noise_multiplier,
                   setup, calibrated, epsilon_s)  # fmt: skip


def train_dpfunc(epochs: int, device: str = DEVICE) -> dict:
    """The same script in dpfunc; each comment names the Opacus line it replaces."""
    from torch.func import functional_call

    import dpfunc

    train_x, train_y, test_x, test_y = digits()
    torch.manual_seed(SEED)
    # train_loader = DataLoader(...): dpfunc samples itself, gathering rows where they live
    dataset = (train_x.to(device), train_y.to(device))
    model = SampleConvNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0)

    def loss_fn(params, example):  # criterion = nn.CrossEntropyLoss(), for ONE example
        x, y = example
        return F.cross_entropy(functional_call(model, params, (x[None],)), y[None])

    setup = time.perf_counter()
    private = dpfunc.PrivateGradients(  # privacy_engine.make_private_with_epsilon(...)
        model,
        loss_fn,
        dataset,
        expected_batch_size=BATCH_SIZE,
        target_epsilon=EPSILON,
        delta=DELTA,
        epochs=EPOCHS,
        clip_norm=MAX_GRAD_NORM,
    )
    calibrated = time.perf_counter()
    epsilon_s = 0.0
    for _ in range(epochs):
        for batch in private.batches(private.steps_per_epoch):  # for x, y in train_loader:
            optimizer.zero_grad()
            private.backward(batch)  # output = model(x); loss = criterion(...); loss.backward()
            optimizer.step()
        before = time.perf_counter()
        epsilon = private.epsilon(DELTA)  # privacy_engine.get_epsilon(DELTA)
        epsilon_s += time.perf_counter() - before
    return _record(model, test_x.to(device), test_y.to(device), epsilon, private.noise_multiplier,
                   setup, calibrated, epsilon_s)  # fmt: skip


def _record(model, test_x, test_y, epsilon, sigma, setup, calibrated, epsilon_s) -> dict:
    if test_x.is_cuda:
        torch.cuda.synchronize()
    done = time.perf_counter()
    return {
        "accuracy": accuracy(model, test_x, test_y),
        "epsilon": epsilon,
        "noise_multiplier": sigma,
        "seconds": done - STARTED,
        "imports_and_data_s": setup - STARTED,
        "calibration_s": calibrated - setup,
        "epsilon_s": epsilon_s,
        "training_s": done - calibrated - epsilon_s,
    }


def compare(repeats: int, epochs: int, device: str) -> list[dict]:
    """Each library's script ``repeats`` times as a fresh process, alternating."""
    runs = {"opacus": [], "dpfunc": []}
    for _ in range(repeats):
        for library in runs:
            command = [sys.executable, __file__, "--run", library, "--epochs", str(epochs),
                       "--device", device]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:  # its own error, where the reader sees it
                sys.exit(f"the {library} run failed:\n{done.stderr[-3000:]}")
            runs[library].append(json.loads(done.stdout.strip().splitlines()[-1]))
    rows = []
    for library, records in runs.items():
        row = {"library": library, "runs": len(records)}
        for key in records[0]:
            row[key] = statistics.median(r[key] for r in records)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", choices=("opacus", "dpfunc"), help="one run, as JSON")
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--device", default=DEVICE, help="cpu or cuda")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="1 run each, 1 epoch")
    parser.add_argument("--out", default="results", help="where opacus_port.json goes")
    args = parser.parse_args()
    if args.run:
        train = train_opacus if args.run == "opacus" else train_dpfunc
        print(json.dumps(train(args.epochs, args.device)))
        return
    repeats, epochs = (1, 1) if args.smoke else (args.repeats, args.epochs)
    rows = compare(repeats, epochs, args.device)
    print(f"| library | epsilon | sigma | test accuracy | seconds (median of {repeats}) | "
          "imports+data | calibration | training | epsilon each epoch |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['library']} | {r['epsilon']:.3f} | {r['noise_multiplier']:.3f} | "
            f"{r['accuracy']:.3f} | {r['seconds']:.2f} | {r['imports_and_data_s']:.2f} | "
            f"{r['calibration_s']:.2f} | {r['training_s']:.2f} | {r['epsilon_s']:.2f} |"
        )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "opacus_port.json"), "w") as f:
        json.dump({"epochs": epochs, "repeats": repeats, "device": args.device, "rows": rows}, f,
                  indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
