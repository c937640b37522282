"""DP-SGD in Hugging Face's ``transformers.Trainer``: change the class, add ``privacy=``.

:class:`PrivateTrainer` is a ``transformers.Trainer`` whose training step is
:class:`dpfunc.PrivateGradients`: Poisson-sampled logical batches replace the
train dataloader, each example's loss comes from the model's own logits
(:mod:`dpfunc.losses`), and the optimizer and scheduler that ``Trainer``
builds step the private gradient. Evaluation, prediction, callbacks,
logging and saving are the ``Trainer``'s own::

    trainer = PrivateTrainer(model=model, args=args, train_dataset=train,
                             eval_dataset=valid, data_collator=collator,
                             privacy=dpfunc.DPConfig(expected_batch_size=64, clip_norm=1.0,
                                                     target_epsilon=3.0, delta=1e-5))
    trainer.train()                      # epsilon in every log, a stop at epsilon_budget
    trainer.save_model()                 # the model, and privacy_report.json beside it

What changes against a ``Trainer``, and what is refused and why, is in
docs/huggingface.md, "PrivateTrainer".

Privacy:
    The epsilon logged and saved covers the training steps. A checkpoint
    holds the run's SECRET seed (``dpfunc_privacy.pt``): it is as sensitive
    as the training data, so pushing checkpoints to the Hub is refused.
    ``nonprivate/loss`` (the logged training loss) reads the data without
    noise, as do evaluations on private data.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import shutil
import warnings
from collections.abc import Callable
from typing import Any

import torch
import transformers
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.data import DataLoader, IterableDataset
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .. import checkpoint as _checkpoint
from .. import losses
from ..accounting import epsilon as _epsilon
from ..config import DPConfig, SpeedConfig
from ..datasets import Collated
from ..losses import IGNORE_INDEX, batched_loss
from ..private import LogicalBatch, PrivateGradients
from ..users import index_users, read_user_column

__all__ = [
    "PRIVACY_REPORT",
    "PRIVACY_STATE",
    "BucketPadding",
    "PrivateTrainer",
    "bucket_length",
    "per_example_loss",
]


def _check_version(version: str) -> None:
    """Refuses a transformers release this integration was not built and tested for.

    Raises:
        ImportError: ``version`` is not 5.x. transformers 4.x checkpoints
            activations reentrantly by default (refused by the private step),
            and its ``Trainer`` internals that ``PrivateTrainer`` overrides
            differ; the ``hf`` extra installs 5.x.
    """
    major = version.split(".", 1)[0]
    if major != "5":
        raise ImportError(
            f"dpfunc.integrations.transformers needs transformers 5.x, found {version}: "
            "install the hf extra (pip install 'dpfunc[hf]'), which pins transformers>=5,<6. "
            "transformers 4.x is not supported (its checkpointing is reentrant by default and "
            "its Trainer internals differ); dpfunc's own loop (PrivateGradients) runs any model"
        )


_check_version(transformers.__version__)

PRIVACY_STATE = "dpfunc_privacy.pt"
"""The file in each checkpoint that resumes the private run. SECRET: it holds the seed."""

PRIVACY_REPORT = "privacy_report.json"
"""The file beside a saved model (and in each checkpoint) with the run's privacy report."""

Head = Callable[[Tensor, Tensor], Tensor]  # (logits, labels) -> one loss per example


class PrivateTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` that trains with DP-SGD (see the module docstring).

    It takes the arguments of ``transformers.Trainer`` (``model``, ``args``,
    ``train_dataset``, ``eval_dataset``, ``data_collator``,
    ``processing_class``, ``callbacks``, ``optimizers``, ...) and these:

    Args:
        privacy: the privacy settings, a :class:`dpfunc.DPConfig`. Without
            ``epochs`` it plans ``args.num_train_epochs`` passes (or
            ``args.max_steps`` steps); with them, the ``TrainingArguments``
            must agree or be left at their defaults.
            ``args.per_device_train_batch_size`` is the physical
            (micro-)batch size; the logical batch is
            ``privacy.expected_batch_size`` examples on average.
        speed: a :class:`dpfunc.SpeedConfig` (``method="auto"`` by default:
            ghost clipping where it is cheaper; ``compile=True`` compiles the
            step). Its ``physical_batch_size`` is the ``TrainingArguments``'.
        seed: ``None`` (default): a secret seed drawn from the OS. An int
            makes the run reproducible and NOT private (research only); it
            is not ``args.seed``, which seeds the model's initialisation.
        loss: ``loss(logits, labels) -> Tensor[B]``, one loss per example;
            by default :func:`per_example_loss` of the model's head.
        users: with ``privacy.privacy_unit="user"`` (and only then), the
            name of ``train_dataset``'s column that holds each example's
            user id (``"author"``), or the ids themselves, one per example.
            The column is read here and never reaches the model.

    Raises:
        ValueError: a setting that would change the accounting or the
            update unseen (each named, with the reason and what to use).
        TypeError: ``privacy`` is not a :class:`dpfunc.DPConfig`.
    """

    def __init__(
        self,
        *args: Any,
        privacy: DPConfig,
        speed: SpeedConfig | None = None,
        seed: int | None = None,
        loss: Head | None = None,
        users: Any = None,
        **kwargs: Any,
    ):
        if not isinstance(privacy, DPConfig):
            raise TypeError(
                f"privacy must be a dpfunc.DPConfig, got {type(privacy).__name__}: "
                "PrivateTrainer(..., privacy=dpfunc.DPConfig(expected_batch_size=..., "
                "clip_norm=..., target_epsilon=..., delta=...))"
            )
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError(
                "compute_loss_func reduces the loss over the batch, and a batch's gradient cannot "
                "be clipped per example: pass loss=fn(logits, labels) -> Tensor[B] (one loss per "
                "example; dpfunc.losses has the usual heads)"
            )
        if kwargs.get("model_init") is not None:
            raise ValueError(
                "model_init builds a new model at train(), which the private step, built on the "
                "model here, would not follow: pass model= instead"
            )
        given = kwargs.get("args", args[1] if len(args) > 1 else None)
        if given is not None:  # before Trainer's __init__, which may reach the Hub
            _check_arguments(given)
        _check_train_dataset(kwargs.get("train_dataset", args[3] if len(args) > 3 else None))
        super().__init__(*args, **kwargs)
        _check_arguments(self.args)
        if speed is not None and speed.physical_batch_size is not None:
            raise ValueError(
                "speed.physical_batch_size is args.per_device_train_batch_size in a "
                f"PrivateTrainer, got {speed.physical_batch_size}: set it in TrainingArguments"
            )
        speed = dataclasses.replace(
            speed or SpeedConfig(), physical_batch_size=self.args.per_device_train_batch_size
        )
        head = loss or per_example_loss(self.model, self.args.label_smoothing_factor)
        self._user_column = users if isinstance(users, str) else None
        if self._user_column is not None:  # read once; _train_rows drops it before the model
            users, _ = read_user_column("PrivateTrainer", self.train_dataset, users)
        rows = self._train_rows()
        users = None if users is None else index_users(users, len(rows))  # indexed once
        units = len(rows) if users is None else users.num_users
        self.private = PrivateGradients(
            self.model,
            _model_loss(self.model, head),
            rows,
            config=self._planned(privacy, units),
            speed=speed,
            seed=seed,
            users=users,
        )
        if self._user_column is not None:  # the report names the column
            self.private.plan.user_column = self._user_column
        self._batches: Any = None  # the private sampler's iterator, made at the first batch
        self._loaded_best: str | None = None  # the checkpoint load_best_model_at_end loaded
        self.nonprivate_total_flos = 0.0  # the operations counted: NOT private (store_flos)
        self._save_total_limit = self.args.save_total_limit  # applied by the run itself
        self._warn_logical_steps(len(rows))
        if self.args.max_grad_norm > 0:
            warnings.warn(
                f"max_grad_norm={self.args.max_grad_norm} is not used: it would clip the noisy "
                "average, not each example. Each example's gradient is clipped to "
                f"privacy.clip_norm={privacy.clip_norm}; set max_grad_norm=0 in TrainingArguments "
                "to silence this warning",
                stacklevel=2,
            )

    def _train_rows(self) -> Collated:
        """The training set, read and collated one micro-batch at a time when a step uses it.

        Columns the model does not take are removed as ``transformers.Trainer``
        removes them; each micro-batch goes through the data collator (afresh
        at every step: random masks are drawn per step), then its sequence
        columns are padded to one of a few lengths (:func:`bucket_length`).
        One small batch is collated here, to check its columns.
        """
        dataset = self.train_dataset
        if dataset is None:
            raise ValueError("PrivateTrainer trains on train_dataset, got None")
        _check_train_dataset(dataset)
        collator = self.data_collator
        if self._user_column in (getattr(dataset, "column_names", None) or ()):
            dataset = dataset.remove_columns(self._user_column)  # read once; never the model's
        if _is_hf_dataset(dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        if isinstance(self.data_collator, transformers.DataCollatorWithFlattening):
            raise ValueError(
                "data_collator is a DataCollatorWithFlattening, which packs a batch's examples "
                "into one row: each example must be a row of its own, since each is clipped "
                "alone (per-document clipping on a packed row is not supported). Use "
                "DataCollatorWithPadding or DataCollatorForLanguageModeling(mlm=False); "
                "PrivateTrainer pads each micro-batch to its own length, so short examples "
                "cost little"
            )
        tokenizer = self.processing_class or getattr(self.data_collator, "tokenizer", None)
        padded = BucketPadding(
            collator,
            pad_token_id=_pad_token_id(tokenizer, self.model),
            padding_side=getattr(tokenizer, "padding_side", "right"),
            max_length=_max_positions(self.model),
        )
        rows = Collated(dataset, padded)
        _check_columns(rows)
        _warn_if_blocks(dataset)
        return rows

    def _planned(self, privacy: DPConfig, n: int) -> DPConfig:
        """``privacy`` with the epochs the ``TrainingArguments`` plan, or checked against them."""
        per_epoch = privacy.steps_per_epoch(n)
        args, defaults = self.args, type(self.args)
        asked = args.max_steps / per_epoch if args.max_steps > 0 else args.num_train_epochs
        if privacy.epochs is None:
            return dataclasses.replace(privacy, epochs=asked)
        untouched = args.max_steps == _default(defaults, "max_steps") and (
            args.num_train_epochs == _default(defaults, "num_train_epochs")
        )
        if not untouched and privacy.total_steps(n) != dataclasses.replace(
            privacy, epochs=asked
        ).total_steps(n):
            raise ValueError(
                f"privacy.epochs={privacy.epochs} plans {privacy.total_steps(n)} steps, but "
                f"TrainingArguments ask for num_train_epochs={args.num_train_epochs}, "
                f"max_steps={args.max_steps}: set the length of the run in one place (leave "
                "privacy.epochs out, and it follows the TrainingArguments)"
            )
        return privacy

    def _warn_logical_steps(self, n: int) -> None:
        """Warns, naming them, that the step-based arguments count logical batches."""
        args, private = self.args, self.private
        physical = args.per_device_train_batch_size * args.world_size
        expected = private.config.expected_batch_size
        if round(expected) == physical:
            return
        defaults = type(args)
        named = {  # the ones set, as their strategies read them
            steps: getattr(args, steps)
            for steps, strategy in _STEP_ARGUMENTS.items()
            if getattr(args, steps, None) not in (None, _default(defaults, steps))
            and (strategy is None or str(getattr(args, strategy)).lower().endswith("steps"))
        }
        if not named:
            return
        settings = ", ".join(f"{key}={value}" for key, value in named.items())
        warnings.warn(
            f"{settings} count logical steps: each step of this run is one Poisson-sampled "
            f"batch of {expected:g} {private.config.privacy_unit}s on average "
            "(privacy.expected_batch_size), run as "
            f"micro-batches of per_device_train_batch_size={args.per_device_train_batch_size}"
            f"{f' on {args.world_size} processes' if args.world_size > 1 else ''}. An epoch "
            f"is {private.steps_per_epoch} steps, where transformers.Trainer would take "
            f"{math.ceil(n / physical)}; the run takes {private.total_steps}",
            stacklevel=3,
        )

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``: the private run, once (a resume goes on from its checkpoint).

        Raises:
            RuntimeError: this trainer has already taken private steps and no
                checkpoint is named: ``Trainer`` would restart its loop at step 0
                while the private run (its accountant, its sampler) is past it.
        """
        if self.private.steps_done and not resume_from_checkpoint:
            raise RuntimeError(
                f"this PrivateTrainer has taken {self.private.steps_done} private steps (epsilon "
                f"{self.private.epsilon():.4g}); a second train() would restart "
                "transformers.Trainer's loop at step 0 while the private run is at step "
                f"{self.private.steps_done}. To continue a run, build a new PrivateTrainer "
                "and call train(resume_from_checkpoint=...); for a new run, build a new one"
            )
        saving = self.args.save_strategy != "no"
        lock = os.path.join(self.args.output_dir, "dpfunc_run")  # .dpfunc_run.lock inside it
        if saving:
            self._hold_output_dir(lock)
        # save_total_limit is applied here to this run's own checkpoints (_rotate_own_checkpoints):
        # transformers' rotation, and its deletion at the end of train(), delete any run's
        limit, self._save_total_limit = self.args.save_total_limit, self.args.save_total_limit
        self.args.save_total_limit = None
        try:
            output = super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self.args.save_total_limit = limit
            if saving:  # the run ends with train(): another may use the folder after it
                _checkpoint._release(self.private, lock)
        if limit == 1 and self.args.should_save and self.state.best_model_checkpoint:
            self._rotate_own_checkpoints(self._get_output_dir(trial=None), keep_best_only=True)
        return output

    def _hold_output_dir(self, lock: str) -> None:
        """Makes this trainer the one live run saving checkpoints in ``args.output_dir``.

        Held for the time of :meth:`train`. Two live runs in one
        ``output_dir`` would write each other's ``checkpoint-N`` folders and
        privacy states (one run's record of what it released replaced by
        another's).
        """
        output_dir = self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        try:
            _checkpoint.hold(self.private, lock)
        except ValueError:
            gc.collect()  # a trainer dropped but not yet collected (a notebook cell run again)
            try:
                _checkpoint.hold(self.private, lock)
            except ValueError as error:
                raise ValueError(
                    f"output_dir={output_dir!r} is held by another PrivateTrainer training "
                    "now (in this or another process): two runs in one output_dir would replace "
                    "each other's checkpoints and their record of accounted steps. Give this "
                    "run another output_dir, or wait until the other one's train() ends"
                ) from error

    def hyperparameter_search(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: each trial trains on the private data, and no epsilon covers the choice.

        Raises:
            RuntimeError: always; :mod:`dpfunc.tune` runs a search whose epsilon covers it.
        """
        raise RuntimeError(
            "Trainer.hyperparameter_search trains on the private data once per trial and "
            "chooses among the runs, which no printed epsilon covers (the choice is a release "
            "too). Run the search with dpfunc.tune (docs/tuning.md): its trial count is random "
            "and its one epsilon covers every trial and the choice"
        )

    def get_train_dataloader(self) -> DataLoader:
        """One item per logical step: the next Poisson-sampled batch of the private run.

        A ``DataLoader`` over the steps of an epoch, so ``Trainer``'s resume
        (which skips the steps done) works unchanged; each item is drawn by
        the private sampler when the loop asks for it.
        """
        steps = range(self.private.steps_per_epoch)
        return DataLoader(steps, batch_size=1, collate_fn=self._next_batch)

    def _next_batch(self, _: Any) -> LogicalBatch | None:
        if self._batches is None:
            self._batches = iter(self.private.batches())
        return next(self._batches, None)  # None: the plan or the budget is used up

    def training_step(
        self, model: nn.Module, inputs: LogicalBatch | None, num_items_in_batch: Any = None
    ) -> Tensor:
        """Writes the private gradient of one logical batch into ``.grad``; returns its loss.

        The loss returned (and logged as ``nonprivate/loss``) is the mean of
        the batch's per-example losses, read without noise.
        """
        if inputs is None:  # the sampler has no step left within the plan or the budget
            self.control.should_training_stop = True
            return torch.zeros((), device=self.args.device)
        if self.private.steps_done != self.state.global_step:
            raise RuntimeError(
                f"the Trainer is at step {self.state.global_step} but the private run at step "
                f"{self.private.steps_done}: a checkpoint whose {PRIVACY_STATE} is of another "
                "step than its trainer_state.json, or a second train() without "
                "resume_from_checkpoint. A private run goes on only from its own checkpoint: "
                "build a new PrivateTrainer and call train(resume_from_checkpoint=...)"
            )
        model.train()
        try:
            with self.compute_loss_context_manager():
                metrics = self.private.backward(inputs)
        except RuntimeError as error:
            if self.args.bf16 and "BFloat16" in str(error):
                raise RuntimeError(
                    "the per-example gradients failed under bf16 autocast (torch's vmap of "
                    "scaled_dot_product_attention's CPU kernel does, for one): use ghost clipping, "
                    "speed=dpfunc.SpeedConfig(model=model, method='ghost'), or the model's eager "
                    "attention (attn_implementation='eager')"
                ) from error
            raise
        last = self.private.plan.last_step()
        if last is not None and self.private.steps_done >= last:
            self.control.should_training_stop = True
        return torch.tensor(metrics["loss"], device=self.args.device)

    def floating_point_ops(self, inputs: Any) -> int:
        """The forward and backward operations of a logical batch's micro-batches."""
        if inputs is None:  # no step was taken
            return 0
        if not isinstance(inputs, LogicalBatch):
            return super().floating_point_ops(inputs)
        return sum(super(PrivateTrainer, self).floating_point_ops(batch)
                   for batch, _ in inputs.micro_batches)  # fmt: skip

    def store_flos(self) -> None:
        """Keeps the operation count as ``nonprivate/total_flos``; ``state.total_flos`` stays 0.

        The count is a function of each step's sampled batch size and padded
        lengths, read without noise: it is logged labelled (at the end of
        ``train()``), never in ``trainer_state.json`` or a model card.
        """
        public = self.state.total_flos
        super().store_flos()  # (distributed: summed over the ranks)
        self.nonprivate_total_flos += self.state.total_flos - public
        self.state.total_flos = public

    def _get_num_items_in_batch(self, batch_samples: list, device: Any) -> None:
        return None  # each example's loss is its own mean: nothing is scaled by the batch

    def _clip_grad_norm(self, model: nn.Module) -> None:
        return None  # each example is clipped by the private step; the average is not

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """``Trainer.log`` with ``epsilon`` added and the non-private training loss labelled.

        Beside ``grad_norm`` (the norm of the private gradient, noise included),
        ``noise_norm`` is the norm the noise alone has, ``sigma * C * sqrt(d) /
        B`` for ``d`` trainable entries (a public constant): a ``grad_norm``
        close to it is mostly noise (docs/huggingface.md, "Choosing the settings").
        """
        logs = {_LABELS.get(key, key): value for key, value in logs.items()}
        if "total_flos" in logs:  # state.total_flos: 0 (store_flos)
            logs["total_flos"] = self.state.total_flos
            logs["nonprivate/total_flos"] = self.nonprivate_total_flos
        if self.private.steps_done:
            logs["epsilon"] = self.private.epsilon()
            if "grad_norm" in logs:
                logs["noise_norm"] = self._noise_norm()
        super().log(logs, start_time)

    def _noise_norm(self) -> float:
        private = self.private
        entries = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        std = private.noise_multiplier * private.clip_norm / private.expected_batch_size
        return std * math.sqrt(entries)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model``, with :data:`PRIVACY_REPORT` beside the model."""
        super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.args.should_save:
            report = self.private.privacy_report().as_dict()
            report["saved_weights"] = self._saved_weights()
            with open(os.path.join(output_dir, PRIVACY_REPORT), "w") as f:
                json.dump(report, f, indent=2)

    def _saved_weights(self) -> dict[str, Any]:
        """Which step's weights a save holds, their epsilon, and how they were chosen."""
        private, args = self.private, self.args
        step, chosen = private.steps_done, None
        best = self._loaded_best
        if best is not None:
            step = int(os.path.basename(os.path.normpath(best)).rsplit("-", 1)[-1])
            chosen = (
                f"the checkpoint of step {step} ({best}), chosen by {args.metric_for_best_model} "
                "on the eval set (load_best_model_at_end): the choice read the eval set, which "
                "the epsilon does not cover if that set is private"
            )
        config = private.config
        # chosen among checkpoints by their evaluations, the weights depend on every step up to
        # the last one evaluated: their epsilon is the whole run's, not that of the chosen step
        return {
            "after_step": step,
            "epsilon": _epsilon(
                config.accounted_noise_multiplier,
                private.plan.sample_rate,
                private.steps_done if best is not None else step,
                config.delta,
                config.accounting,
                bands=config.bands,
            ),  # fmt: skip
            "chosen_by": chosen or "the last step's weights",
            "note": (
                f"the saved weights are step {step}'s, chosen by comparing every evaluated "
                f"checkpoint, up to step {private.steps_done}: they depend on all of those "
                "steps, so their epsilon is the run's"
                if best is not None
                else f"the saved weights are a function of the first {step} steps"
            ),
        }

    def _load_best_model(self) -> None:
        super()._load_best_model()
        self._loaded_best = self.state.best_model_checkpoint  # the weights are now its

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """``Trainer._save_checkpoint`` with the privacy state, never over another run's line.

        A ``checkpoint-N`` folder is written only if it is new or this run's
        own, and ``save_total_limit`` deletes only this run's own checkpoints
        (transformers' rotation would delete any run's in ``output_dir``).
        """
        run_dir = self._get_output_dir(trial=trial)
        path = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self._check_not_another_line(run_dir, [path])
        super()._save_checkpoint(model, trial)  # (save_total_limit is None in train())
        if self.args.should_save and os.path.isdir(path):
            state = self.private.state_dict()
            _checkpoint._atomic_write(os.path.join(path, PRIVACY_STATE),
                                      lambda f: torch.save(state, f))  # fmt: skip
            self._rotate_own_checkpoints(run_dir)

    def _check_not_another_line(self, run_dir: str, paths: list[str] | None = None) -> None:
        """Refuses to go on where a save would replace a checkpoint of another line.

        ``paths``: the checkpoint folders about to be written; by default
        every ``checkpoint-N`` in ``run_dir`` with ``N`` past this run's step
        (any of them could be written by a later save). Another line is a
        checkpoint not written by this run: another run's, an earlier
        continuation's, or one without a privacy state. Rank 0 (the one that
        saves) decides; distributed, every rank raises with it.
        """
        error = None
        if self.args.should_save:
            if paths is None:
                paths = [path for step, path in _checkpoint_folders(run_dir)
                         if step > self.private.steps_done]  # fmt: skip
            mine = self.private.plan.lineage
            other = [p for p in paths if os.path.isdir(p) and _folder_lineage(p) != mine]
            if other:
                error = ValueError(
                    f"{other[0]!r} is a checkpoint of another run, or of another continuation "
                    "of this one, which a save of this run would replace, with that run's "
                    f"record of accounted steps ({PRIVACY_STATE}). Give this run another "
                    f"output_dir (now {self.args.output_dir!r}), or move that checkpoint away"
                )
        _checkpoint._rank0_outcome(self.private, error, f"the checkpoints in {run_dir!r}")

    def _rotate_own_checkpoints(self, run_dir: str, keep_best_only: bool = False) -> None:
        """``save_total_limit``, applied to the checkpoints of this run and of those it continues.

        The latest and the best are kept; ``keep_best_only`` (the end of a
        run with ``save_total_limit=1``, as transformers does) keeps the best
        alone. Checkpoints of other lines are never deleted (a continued
        run's checkpoints past the step it was resumed from are another
        line's: a run does not start where they exist).
        """
        limit = self._save_total_limit
        if not limit or limit <= 0:
            return
        mine = self.private.plan.lineage
        own = [path for _, path in _checkpoint_folders(run_dir)
               if (line := _folder_lineage(path)) and line == mine[: len(line)]]  # fmt: skip
        best = self.state.best_model_checkpoint
        keep = {os.path.normpath(best)} if best else set()
        if not keep_best_only and own:
            keep.add(os.path.normpath(own[-1]))
        doomed = own if keep_best_only else own[: max(0, len(own) - max(limit, len(keep)))]
        for path in doomed:
            if os.path.normpath(path) not in keep:
                shutil.rmtree(path, ignore_errors=True)

    def set_initial_training_values(self, args: Any, dataloader: Any) -> tuple:
        """The loop's lengths from the private plan (its steps, not the dataloader's).

        Called once the run is what it will be (a checkpoint loaded): a
        checkpoint of another line that a later save would replace is
        refused here, before the first step, not when the save comes.
        """
        if self.args.save_strategy != "no":
            self._check_not_another_line(self._get_output_dir(trial=None))
        private = self.private
        last = private.plan.last_step()
        max_steps = private.total_steps if last is None else min(private.total_steps, last)
        per_epoch = private.steps_per_epoch
        epochs = max(1, math.ceil(max_steps / per_epoch))
        batch = round(private.config.expected_batch_size)
        samples = round(max_steps * private.config.expected_batch_size)
        return epochs, per_epoch, private.num_examples, samples, batch, per_epoch, max_steps

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Loads the checkpoint's privacy state, checked, and only then its weights.

        Raises:
            ValueError: the checkpoint has no privacy state, or one that
                cannot continue this run (each reason named); nothing is
                loaded then, the model is as it was.
        """
        path = os.path.join(resume_from_checkpoint, PRIVACY_STATE)
        if not os.path.isfile(path):
            raise ValueError(
                f"resume_from_checkpoint={resume_from_checkpoint!r} has no {PRIVACY_STATE}: it "
                "was not saved by a PrivateTrainer, and resuming from it would start the "
                "accounting at step 0 for a model that has already trained"
            )
        try:
            self.private.load_state_dict(torch.load(path, weights_only=True, map_location="cpu"))
        except Exception as error:
            raise ValueError(
                f"resume_from_checkpoint={resume_from_checkpoint!r}: its {PRIVACY_STATE} cannot "
                f"continue this run, and nothing was loaded (the model is as it was): {error}"
            ) from error
        super()._load_from_checkpoint(resume_from_checkpoint, model)


_LABELS = {"loss": "nonprivate/loss", "train_loss": "nonprivate/train_loss"}
_STEP_ARGUMENTS = {
    "logging_steps": "logging_strategy",
    "eval_steps": "eval_strategy",
    "save_steps": "save_strategy",
    "warmup_steps": None,
    "max_steps": None,
}
"""The TrainingArguments that count steps, with the strategy that reads each (if any)."""


def per_example_loss(model: nn.Module, label_smoothing: float = 0.0) -> Head:
    """The per-example loss of a Hugging Face model's head, from its class name.

    ``*ForSequenceClassification``: :func:`dpfunc.losses.classification`;
    ``*ForCausalLM`` and ``*LMHeadModel``: :func:`dpfunc.losses.causal_lm`
    (the shift, and ``-100`` labels left out); ``*ForMaskedLM``:
    :func:`dpfunc.losses.masked_lm`. A PEFT model is read through its base
    model. Each example's loss is its mean over its own labelled tokens.

    Raises:
        ValueError: another head (pass ``loss=`` to :class:`PrivateTrainer`),
            a regression or multi-label classifier, or ``label_smoothing``
            on a language-model head.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = type(base).__name__
    config = getattr(base, "config", None)
    if name.endswith("ForSequenceClassification"):
        problem = getattr(config, "problem_type", None)
        single = problem in (None, "single_label_classification")
        if getattr(config, "num_labels", 2) == 1 or not single:
            raise ValueError(
                f"{name} is set up for problem_type={problem!r} (num_labels="
                f"{getattr(config, 'num_labels', None)}); the built-in head is single-label "
                "classification: pass loss=fn(logits, labels) -> Tensor[B]"
            )
        return lambda logits, labels: losses.classification(
            logits, labels, label_smoothing=label_smoothing
        )
    lm = {"ForCausalLM": losses.causal_lm, "LMHeadModel": losses.causal_lm,
          "ForMaskedLM": losses.masked_lm}  # fmt: skip
    for suffix, head in lm.items():
        if name.endswith(suffix):
            if label_smoothing:
                raise ValueError(
                    f"label_smoothing_factor={label_smoothing} is supported for sequence "
                    f"classification only; {name} would train without it: set it to 0, or pass "
                    "loss=fn(logits, labels) -> Tensor[B]"
                )
            return head
    raise ValueError(
        f"no built-in per-example loss for {name}: the heads are *ForSequenceClassification, "
        "*ForCausalLM / *LMHeadModel and *ForMaskedLM. Pass loss=fn(logits, labels) -> "
        "Tensor[B], one loss per example (dpfunc.losses has the usual ones)"
    )


def _model_loss(model: nn.Module, head: Head) -> Any:
    """The batched loss the private step clips: the model's logits through ``head``."""

    @batched_loss
    def loss(params: dict[str, Tensor], batch: dict[str, Tensor]) -> Tensor:
        inputs = {key: value for key, value in batch.items() if key != "labels"}
        logits = functional_call(model, params, (), inputs, strict=False).logits
        return head(logits, batch["labels"])

    return loss


def _check_arguments(args: Any) -> None:
    """Refuses the ``TrainingArguments`` that would change the accounting or the update unseen."""
    refused = {
        "gradient_accumulation_steps": (
            args.gradient_accumulation_steps != 1,
            "the logical batch is privacy.expected_batch_size examples, accumulated over "
            "micro-batches of per_device_train_batch_size by the private step; leave it at 1",
        ),
        "fp16": (
            args.fp16,
            "its GradScaler would unscale a private gradient that was never scaled; use bf16",
        ),
        "torch_compile": (
            args.torch_compile,
            "the private step runs the model itself; compile it with "
            "speed=dpfunc.SpeedConfig(compile=True)",
        ),
        "auto_find_batch_size": (
            args.auto_find_batch_size,
            "the physical batch size is fixed when the private step is planned; set "
            "per_device_train_batch_size",
        ),
        "group_by_length": (
            getattr(args, "group_by_length", False),
            "batches are Poisson samples, which the accounting assumes",
        ),
        "neftune_noise_alpha": (
            args.neftune_noise_alpha is not None,
            "its embedding noise is drawn inside the per-example pass, outside the private step",
        ),
        "activation_checkpointing_kwargs": (
            getattr(args, "activation_checkpointing", False)
            and (getattr(args, "activation_checkpointing_kwargs", None) or {}).get(
                "use_reentrant", False
            ),
            "reentrant checkpointing backpropagates through each block on its own, where the "
            "per-example gradients cannot be taken; leave use_reentrant out (False)",
        ),
        "fsdp": (bool(args.fsdp), "shard with dpfunc.sharding instead (docs/sharded.md)"),
        "deepspeed": (bool(args.deepspeed), "DeepSpeed runs its own backward"),
        "include_num_input_tokens_seen": (
            args.include_num_input_tokens_seen not in ("no", False, None),
            "the number of tokens in each Poisson sample is a count of the private data, "
            "logged without noise",
        ),
        "push_to_hub": (
            args.push_to_hub
            and str(getattr(args.hub_strategy, "value", args.hub_strategy))
            in ("checkpoint", "all_checkpoints"),
            f"each checkpoint holds the run's secret seed ({PRIVACY_STATE}); push the saved "
            "model at the end instead (hub_strategy='end')",
        ),
    }
    for name, (bad, why) in refused.items():
        if bad:
            raise ValueError(f"{name}={getattr(args, name)!r} is not supported: {why}")
    if args.n_gpu > 1:
        raise ValueError(
            f"n_gpu={args.n_gpu}: torch.nn.DataParallel is not supported; run one process per "
            "device with torchrun (DDP)"
        )


def _checkpoint_folders(run_dir: str) -> list[tuple[int, str]]:
    """``(N, path)`` of each ``checkpoint-N`` folder in ``run_dir``, by ``N``."""
    folders = []
    if os.path.isdir(run_dir):
        for name in os.listdir(run_dir):
            path = os.path.join(run_dir, name)
            step = name.removeprefix(f"{PREFIX_CHECKPOINT_DIR}-")
            if step != name and step.isdigit() and os.path.isdir(path):
                folders.append((int(step), path))
    return sorted(folders)


def _folder_lineage(path: str) -> list[str] | None:
    """The lineage of the run that wrote checkpoint folder ``path`` (``None``: no readable one)."""
    try:
        saved = torch.load(os.path.join(path, PRIVACY_STATE), weights_only=True,
                           map_location="cpu", mmap=True)  # fmt: skip
        return _checkpoint._lineage(path, saved)
    except Exception:
        return None


def _default(cls: type, name: str) -> Any:
    return next(field.default for field in dataclasses.fields(cls) if field.name == name)


def _is_hf_dataset(dataset: Any) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(dataset, datasets.Dataset)


# ------------------------------------------------------------------------- the training rows

PAD_VALUES = {"attention_mask": 0, "labels": IGNORE_INDEX, "token_type_ids": 0,
              "special_tokens_mask": 1}  # fmt: skip
"""What each sequence column is padded with (``input_ids``: the tokenizer's pad token)."""


def bucket_length(length: int, max_length: int | None = None) -> int:
    """The padded length of a micro-batch whose longest example has ``length`` tokens.

    The next of 8, 12, 16, 24, 32, 48, ... (powers of two and one and a half
    times them), at most ``max_length`` (the model's positions) unless
    ``length`` itself is longer: a compiled step sees a few lengths (two per
    doubling), and a micro-batch is padded by at most half its length again.

    >>> [bucket_length(n) for n in (1, 9, 13, 33, 500, 513)]
    [8, 12, 16, 48, 512, 768]
    >>> bucket_length(500, max_length=510)
    510
    """
    size = 8
    while size < length:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    if max_length is not None and size > max_length >= length:
        return max_length
    return size


class BucketPadding:
    """A data collator whose batches' sequence columns are then padded to :func:`bucket_length`.

    The collator pads a micro-batch to its own longest example; this pads
    it further, to a length from a small fixed set, so that the step meets
    few shapes (each new one is planned, checked and, compiled, traced once).
    ``input_ids`` take ``pad_token_id``, ``attention_mask`` 0, ``labels``
    -100 (no loss), ``token_type_ids`` 0, ``special_tokens_mask`` 1, on the
    tokenizer's padding side; the attention mask keeps the new positions out
    of every example's loss. A batch without an ``attention_mask``, or with
    another column of the sequence's length, is left as the collator made it
    (a warning names the column once).
    """

    def __init__(
        self, collator: Callable, *, pad_token_id: int, padding_side: str = "right",
        max_length: int | None = None,
    ):  # fmt: skip
        self.collator = collator
        self.pad_token_id = pad_token_id
        self.padding_side = padding_side
        self.max_length = max_length
        self._warned = False

    def __call__(self, items: list) -> dict[str, Any]:
        batch = dict(self.collator(items))
        mask = batch.get("attention_mask")
        if not isinstance(mask, Tensor) or mask.dim() != 2:
            return batch
        length = mask.shape[1]
        target = bucket_length(length, self.max_length)
        sequences = [
            key
            for key, value in batch.items()
            if isinstance(value, Tensor) and value.dim() >= 2 and value.shape[1] == length
        ]
        unknown = [key for key in sequences if key not in PAD_VALUES and key != "input_ids"]
        if target == length or unknown:
            if unknown and not self._warned:
                self._warned = True
                warnings.warn(
                    f"the collated batches have sequence columns {unknown} whose padding value "
                    "is unknown; micro-batches keep the collator's own lengths (a compiled step "
                    "compiles once per length)",
                    stacklevel=2,
                )
            return batch
        for key in sequences:
            value = batch[key]
            fill = self.pad_token_id if key == "input_ids" else PAD_VALUES[key]
            extra = value.new_full((value.shape[0], target - length, *value.shape[2:]), fill)
            parts = (extra, value) if self.padding_side == "left" else (value, extra)
            batch[key] = torch.cat(parts, dim=1)
        return batch

    def __repr__(self) -> str:
        return f"BucketPadding({self.collator!r})"


def _check_train_dataset(dataset: Any) -> None:
    if dataset is None:
        return  # transformers' own error, or PrivateTrainer's when train_dataset is read
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise ValueError(
            f"train_dataset is a {type(dataset).__name__} without a length: Poisson sampling "
            "includes each example with probability expected_batch_size / len(dataset), so it "
            "needs random access to every example and their number; give a map-style dataset "
            "(datasets.Dataset, memory-mapped and read one micro-batch at a time; a list; a "
            "torch Dataset with __len__)"
        )


def _check_columns(rows: Collated) -> None:
    """Collates a batch of the first examples (its random draws undone) and checks its columns."""
    n = min(2, len(rows))
    with torch.random.fork_rng(devices=[]):
        batch = rows.collate_fn([rows[i] for i in range(n)])
    packed = sorted(k for k, v in batch.items() if isinstance(v, Tensor) and v.dim()
                    and v.shape[0] != n)  # fmt: skip
    if n > 1 and packed:
        shown = "input_ids" if "input_ids" in packed else packed[0]
        raise ValueError(
            f"the data collator ({type(rows.collate_fn.collator).__name__}) made {n} examples "
            f"into {batch[shown].shape[0]} row(s) of {shown!r}: it packs examples together "
            "(padding-free packing: DataCollatorWithFlattening, trl's SFTConfig(packing=True) "
            "or padding_free=True). Each example must be a row of its own, since each is "
            "clipped alone: pad instead (PrivateTrainer pads each micro-batch to its own length)"
        )
    other = sorted(k for k, v in batch.items() if not isinstance(v, Tensor))
    if other:
        raise ValueError(
            f"the collated training batches have columns that are not tensors: {other}; the "
            "model is called with every column of a batch: drop them (Dataset."
            "remove_columns, or remove_unused_columns=True) or make the collator return "
            "tensors"
        )
    if "labels" not in batch:
        raise ValueError(
            f"the collated training batches have no 'labels' (columns {sorted(batch)}): each "
            "example's loss needs its labels (a 'label' or 'labels' column, or a collator "
            "that makes them, such as DataCollatorForLanguageModeling)"
        )


def _warn_if_blocks(dataset: Any, rows: int = 64) -> None:
    """Warns when the training rows look like blocks cut from concatenated documents."""
    size = len(dataset)
    if size < 2:
        return
    picks = sorted({round(k * (size - 1) / (rows - 1)) for k in range(rows)})
    lengths, unpadded = set(), True
    for i in picks:
        item = dataset[i]
        ids = item.get("input_ids") if isinstance(item, dict) else None
        if ids is None or isinstance(ids, str) or "label" in item:  # a classifier's examples
            return
        lengths.add(len(ids))
        mask = item.get("attention_mask")
        if mask is not None and not all(int(v) == 1 for v in mask):
            unpadded = False
    if len(lengths) == 1 and unpadded:
        (length,) = lengths
        warnings.warn(
            f"every training row sampled holds exactly {length} tokens with no padding, as "
            "block packing (concatenating documents and cutting blocks, e.g. group_texts) "
            "makes: if so, the privacy unit is a block of tokens, not a document, and a "
            "document spread over several blocks is protected as several examples, more weakly "
            "than the printed epsilon says. For a document's guarantee, make each document one "
            "example (truncated or split within itself only) or see docs/huggingface.md, "
            '"Packing"',
            stacklevel=4,
        )


def _pad_token_id(tokenizer: Any, model: nn.Module) -> int:
    """The pad token's id: the tokenizer's, else the model config's, else 0 (masked anyway)."""
    for source in (tokenizer, getattr(model, "config", None)):
        value = getattr(source, "pad_token_id", None)
        if isinstance(value, int):
            return value
    return 0


def _max_positions(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
