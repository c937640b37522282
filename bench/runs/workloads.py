"""What the whole-run scripts in bench/runs/ share: the data, the models, a clock, the report.

Each script in this folder is one private training run written the way a user writes it
for its library (dpfunc or Opacus), run by ``bench/whole_run.py`` as a fresh process. The
pieces here are the same for both libraries, so that only the library differs:

* ``digits``: scikit-learn's 1797 8x8 digits, a stratified 20% test split (seed 0), the
  1437 others private; a GroupNorm CNN (bench/harness.py's ``digits_cnn``).
* ``mnist``: Opacus' MNIST example (its ``SampleConvNet``, SGD lr 0.1, sigma 1.0, C 1.0,
  DataLoader batch 64, delta 1e-5) on the first ``--examples`` images of the file given
  with ``--data`` (a ``torch.save`` of uint8 28x28 images and labels; ``whole_run.py``
  writes Fashion-MNIST's there), normalised with the MNIST constants of that example.

The clock starts in each script's first line, before its imports (``Clock(start)``); the
report is one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # the public constants of Opacus' MNIST example


class Clock:
    """Seconds per phase of a run since ``start`` (a ``time.perf_counter()`` value)."""

    def __init__(self, start: float):
        self.start = self.last = start
        self.phases: dict[str, float] = {}

    def lap(self, phase: str) -> float:
        """Adds the seconds since the previous lap to ``phase``; returns them."""
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds
        return seconds

    def report(self, **fields) -> None:
        """Prints the phases, the total since ``start`` and ``fields`` as one JSON line."""
        total = time.perf_counter() - self.start
        print(json.dumps({"phases": self.phases, "total": total, **fields}))


def digits_data():
    """((x_train [1437, 1, 8, 8], y_train), (x_test [360, 1, 8, 8], y_test)), pixels in [0, 1]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, stratify=y, random_state=0
    )
    return (x_train, y_train), (x_test, y_test)


def digits_cnn() -> nn.Module:
    """Two 3x3 convolutions with GroupNorm and ReLU, average pooling, a linear head (10,026)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.GroupNorm(4, 32), nn.ReLU(),
        nn.AvgPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, 10),
    )  # fmt: skip


def mnist_data(path: str, examples: int):
    """((x_train [examples, 1, 28, 28], y_train), (x_test, y_test)) from ``path``, normalised."""
    data = torch.load(path)

    def images(x):
        return ((x.float() / 255.0 - MNIST_MEAN) / MNIST_STD).unsqueeze(1)

    train = (images(data["train_x"][:examples]), data["train_y"][:examples].long())
    return train, (images(data["test_x"]), data["test_y"].long())


class SampleConvNet(nn.Module):
    """Opacus' MNIST example model: conv 8x8/2, max-pool, conv 4x4/2, max-pool, 2 linear."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 8, 2, padding=3)
        self.conv2 = nn.Conv2d(16, 32, 4, 2)
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2, 1)  # [B, 16, 13, 13]
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2, 1)  # [B, 32, 4, 4]
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


@torch.no_grad()
def accuracy(model: nn.Module, data) -> float:
    """Test accuracy of ``model`` on ``(x, y)``."""
    model.eval()
    x, y = data
    return float((model(x).argmax(1) == y).float().mean())


def problem(settings: dict, args) -> tuple:
    """``(train_set, test_set, model, epochs)`` of a run's workload, the model seeded."""
    if args.workload == "digits":
        train_set, test_set = digits_data()
        torch.manual_seed(args.init_seed)
        model = digits_cnn()
    else:
        train_set, test_set = mnist_data(args.data, args.examples)
        torch.manual_seed(args.init_seed)
        model = SampleConvNet()
    return train_set, test_set, model, args.epochs or settings["epochs"]


def arguments(description: str, workloads: list[str]) -> argparse.Namespace:
    """The command line both run scripts take."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--workload", choices=workloads, default="digits")
    parser.add_argument("--data", help="mnist: a torch.save of train_x/train_y/test_x/test_y")
    parser.add_argument("--examples", type=int, default=6000, help="mnist: training images")
    parser.add_argument("--epochs", type=int, default=None, help="default: the workload's")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--init-seed", type=int, default=0, help="the model's initialisation")
    return parser.parse_args()
