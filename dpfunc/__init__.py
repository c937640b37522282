"""dpfunc: differentially private training for PyTorch, in a functional style.

The model becomes a pytree of parameters; each example's gradient comes from
``torch.func.vmap(torch.func.grad(loss))``; small pure functions clip, sum,
noise and average them; the step compiles with ``torch.compile``.
"""

from . import (
    accounting,
    audit,
    callbacks,
    data,
    distributed,
    losses,
    matrix_factorization,
    optim,
    report,
    schedules,
    tune,
)
from .clipper import ExampleStats, summarize
from .clipping import clip_factors, clipped_sum, groups_by_module, per_sample_norms, total_clip_norm
from .config import DPConfig, SpeedConfig
from .functional import check_per_example, functionalize, replace_batchnorm
from .losses import BatchedLoss, batched_loss
from .noise import add_noise, average, secret_seed, standard_normal_like
from .per_sample import per_sample_grads, per_sample_grads_and_losses
from .private import LogicalBatch, PrivateGradients
from .report import PrivacyReport, privacy_report
from .step import TrainState, TrainStep, make_train_step
from .trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "BatchedLoss",
    "DPConfig",
    "ExampleStats",
    "LogicalBatch",
    "PrivacyReport",
    "PrivateGradients",
    "SpeedConfig",
    "TrainState",
    "TrainStep",
    "Trainer",
    "accounting",
    "audit",
    "callbacks",
    "data",
    "distributed",
    "add_noise",
    "average",
    "batched_loss",
    "check_per_example",
    "clip_factors",
    "clipped_sum",
    "functionalize",
    "groups_by_module",
    "losses",
    "make_train_step",
    "matrix_factorization",
    "optim",
    "per_sample_grads",
    "per_sample_grads_and_losses",
    "per_sample_norms",
    "privacy_report",
    "replace_batchnorm",
    "report",
    "schedules",
    "secret_seed",
    "standard_normal_like",
    "summarize",
    "total_clip_norm",
    "tune",
]
