"""PrivateTrainer's resume and checkpoints, tried as a careless user and as an attacker.

A refused resume leaves the model as it was and names the checkpoint; two live
runs never share an ``output_dir``; a run never replaces a checkpoint of
another line (another run's, or another continuation's), and
``save_total_limit`` deletes only its own.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os

import pytest
import torch

pytest.importorskip("peft", reason="needs the 'hf' extra (peft is not installed)")
transformers = pytest.importorskip("transformers", reason="needs the 'hf' extra")
pytest.importorskip("datasets", reason="needs the 'hf' extra")
from test_hf_trainer import arguments, lm_trainer, privacy, saving, texts  # noqa: E402

from dpfunc.integrations.transformers import PRIVACY_STATE  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")


def every_tensor(model):
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def digest(folder):
    """The bytes of every file under ``folder``: what a replaced checkpoint would change."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                files[os.path.relpath(os.path.join(root, name), folder)] = hashlib.sha256(
                    f.read()
                ).hexdigest()
    return files


class StopAt(transformers.TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def test_a_refused_resume_leaves_the_model_as_it_was_and_names_the_checkpoint(tmp_path):
    first = lm_trainer(tmp_path / "a", args=saving(tmp_path / "a"))
    first.train()
    checkpoint = str(tmp_path / "a" / "checkpoint-2")
    other = lm_trainer(
        tmp_path / "b", args=arguments(tmp_path / "b"), config=privacy(clip_norm=2.0)
    )
    before = every_tensor(other.model)
    with pytest.raises(ValueError, match=f"(?s){checkpoint}.*{PRIVACY_STATE}.*clip_norm"):
        other.train(resume_from_checkpoint=checkpoint)
    for name, t in every_tensor(other.model).items():  # transformers loaded no weight
        assert torch.equal(t, before[name]), name
    other.train()  # the notebook habit: train again, now as a new run from the same model
    assert other.private.steps_done == 3
    fresh = lm_trainer(tmp_path / "c", config=privacy(clip_norm=2.0))
    fresh.train()
    assert other.private.epsilon() == fresh.private.epsilon()  # 3 steps, all of them counted
    for name, t in every_tensor(fresh.model).items():
        assert torch.equal(t, every_tensor(other.model)[name]), name


def test_two_runs_never_share_an_output_dir(tmp_path):
    out = tmp_path / "out"
    refused = []

    class AnotherRunMeanwhile(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:  # a second run into the same folder, while this trains
                other = lm_trainer(out, args=saving(out))
                with pytest.raises(ValueError, match="held by another PrivateTrainer training"):
                    other.train()
                refused.append(other.private.steps_done)

    first = lm_trainer(out, args=saving(out), callbacks=[AnotherRunMeanwhile()])
    first.train()
    assert refused == [0] and first.private.steps_done == 3
    saved = digest(out / "checkpoint-2")
    second = lm_trainer(out, args=saving(out))
    with pytest.raises(ValueError, match="checkpoint-2.*another run.*another output_dir"):
        second.train()  # the first has ended, but a save of this one would replace its own
    assert second.private.steps_done == 0
    assert digest(out / "checkpoint-2") == saved
    third = lm_trainer(tmp_path / "elsewhere", args=saving(tmp_path / "elsewhere"))
    third.train()  # the control: another output_dir
    assert third.private.steps_done == 3


def test_a_continuation_never_replaces_the_checkpoints_of_another_line(tmp_path):
    out = tmp_path / "out"
    first = lm_trainer(out, args=arguments(out, save_steps=1, save_strategy="steps"),
                       config=privacy(epochs=2.0), seed=None)  # fmt: skip
    first.train()
    assert first.private.steps_done == 6
    later = {step: digest(out / f"checkpoint-{step}") for step in (3, 4, 5, 6)}
    first = None
    gc.collect()
    again = lm_trainer(out, args=arguments(out, save_steps=1, save_strategy="steps"),
                       config=privacy(epochs=2.0), seed=None)  # fmt: skip
    with pytest.raises(ValueError, match="checkpoint-3.*another continuation"):
        again.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert again.private.steps_done == 2  # resumed, refused before its first step
    for step, files in later.items():
        assert digest(out / f"checkpoint-{step}") == files, step


def test_save_total_limit_deletes_only_this_lines_checkpoints(tmp_path):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    unrelated = lm_trainer(elsewhere, args=arguments(elsewhere, save_steps=1,
                                                     save_strategy="steps"),
                           callbacks=[StopAt(1)])  # fmt: skip
    unrelated.train()
    first = lm_trainer(out, args=arguments(out, save_steps=3, save_strategy="steps"),
                       config=privacy(epochs=2.0), seed=None, callbacks=[StopAt(3)])  # fmt: skip
    first.train()  # stopped after 3 of its 6 steps: checkpoint-3
    assert first.private.steps_done == 3
    os.rename(elsewhere / "checkpoint-1", out / "checkpoint-1")  # another run's, moved in
    kept = digest(out / "checkpoint-1")
    limited = arguments(out, save_steps=1, save_strategy="steps", save_total_limit=1)
    resumed = lm_trainer(out, args=limited, config=privacy(epochs=2.0), seed=None)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    assert resumed.private.steps_done == 6
    folders = sorted(name for name in os.listdir(out) if name.startswith("checkpoint-"))
    # the line's checkpoints (its own and the one it continued) rotated to the latest;
    # transformers' rotation would have deleted the other run's checkpoint-1 as well
    assert folders == ["checkpoint-1", "checkpoint-6"]
    assert digest(out / "checkpoint-1") == kept


def test_total_flos_is_public_and_the_count_is_labelled(tmp_path):
    """The operation count follows each step's sampled batch size: never unlabelled."""
    counts = []
    for seed in (1, 2):
        out = tmp_path / str(seed)
        trainer = lm_trainer(out, args=saving(out), seed=seed)
        result = trainer.train()
        assert trainer.state.total_flos == result.metrics["total_flos"] == 0
        with open(out / "checkpoint-2" / "trainer_state.json") as f:
            assert json.load(f)["total_flos"] == 0
        end = [row for row in trainer.state.log_history if "total_flos" in row][-1]
        assert end["total_flos"] == 0
        counts.append(end["nonprivate/total_flos"])
    assert all(count > 0 for count in counts) and counts[0] != counts[1]


def test_the_best_kept_at_the_end_never_deletes_another_lines_checkpoints(tmp_path):
    """save_total_limit=1 with load_best_model_at_end: transformers deletes every checkpoint
    in output_dir but the best at the end of train(), whichever run wrote it."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    unrelated = lm_trainer(elsewhere, args=arguments(elsewhere, save_steps=1,
                                                     save_strategy="steps"),
                           callbacks=[StopAt(1)])  # fmt: skip
    unrelated.train()
    args = arguments(out, save_steps=2, save_strategy="steps")
    first = lm_trainer(out, args=args, config=privacy(epochs=2.0), seed=None,
                       callbacks=[StopAt(2)])  # fmt: skip
    first.train()  # checkpoint-2 of this line
    os.rename(elsewhere / "checkpoint-1", out / "checkpoint-1")  # another run's, moved in
    kept = digest(out / "checkpoint-1")
    best = arguments(out, save_steps=1, save_strategy="steps", eval_strategy="steps",
                     eval_steps=1, save_total_limit=1, load_best_model_at_end=True,
                     metric_for_best_model="loss")  # fmt: skip
    resumed = lm_trainer(out, args=best, config=privacy(epochs=2.0), seed=None,
                         eval_dataset=texts())  # fmt: skip
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert resumed.private.steps_done == 6
    folders = sorted(name for name in os.listdir(out) if name.startswith("checkpoint-"))
    chosen = os.path.basename(resumed.state.best_model_checkpoint)
    assert folders == sorted({"checkpoint-1", chosen})  # this line's best, and the other's
    assert digest(out / "checkpoint-1") == kept
