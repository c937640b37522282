"""One whole private run, user-level or example-level, as a fresh process (for farm-bench).

    python bench/user_level_run.py user 4     # ULS, k = 4: 64 users a step, 256 rows
    python bench/user_level_run.py example    # example-level: 256 examples a step

The MLP 784-512-256-10 by ghost clipping on 20,000 random examples (2,500 users of 8),
``STEPS`` steps of one micro-batch of 256 rows each (padding included: the logical
batch's expected size is the physical one minus 3 standard deviations), imports and
the first step's planning included.
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import dpfunc

STEPS, ROWS, EXAMPLES, PER_USER = 40, 256, 20_000, 8

torch.set_num_threads(2)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                      nn.Linear(256, 10))  # fmt: skip
params, buffers = dpfunc.functionalize(model)


def loss_fn(p, example):
    x, y = example
    return F.cross_entropy(functional_call(model, (p, buffers), (x[None],)), y[None])


data = (torch.randn(EXAMPLES, 784), torch.randint(0, 10, (EXAMPLES,)))
k = int(sys.argv[2]) if sys.argv[1] == "user" else 1
units = EXAMPLES // PER_USER if k > 1 else EXAMPLES
slots = ROWS // k
expected = slots - 3 * slots**0.5  # mean + 3 std fills the physical batch
unit = dict(privacy_unit="user", max_examples_per_user=k,
            users=torch.arange(EXAMPLES) // PER_USER) if k > 1 else {}  # fmt: skip
trainer = dpfunc.Trainer(
    loss_fn, params, data, optimizer=dpfunc.optim.sgd(0.1), clip_norm=1.0, noise_multiplier=1.0,
    expected_batch_size=expected, epochs=STEPS / round(units / expected), physical_batch_size=ROWS,
    model=model, method="ghost", progress=False, delta=1e-5, **unit,
)  # fmt: skip
trainer.fit()
assert trainer.steps_done == STEPS, trainer.steps_done
