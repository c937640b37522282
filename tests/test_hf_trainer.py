"""PrivateTrainer: a transformers.Trainer that trains with DP-SGD.

Its update equals PrivateGradients with torch.optim.AdamW; its noise has std
sigma * C / B; LoRA trains the adapters alone; a resume equals the run it
continues; the epsilon it logs is dp_accounting's; and the settings that
would change the accounting or the update unseen are refused.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings

import pytest
import ranks
import torch
from test_noise import ks_critical, ks_statistic
from torch.func import functional_call

import dpfunc

peft = pytest.importorskip("peft", reason="needs the 'hf' extra (peft is not installed)")
transformers = pytest.importorskip(
    "transformers", reason="needs the 'hf' extra (transformers is not installed)"
)
datasets = pytest.importorskip("datasets", reason="needs the 'hf' extra")
from dpfunc.integrations.transformers import (  # noqa: E402
    PRIVACY_REPORT,
    PRIVACY_STATE,
    PrivateTrainer,
    per_example_loss,
)

N, VOCAB, B = 48, 40, 16.0
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")


def gpt2_lora(dropout: float = 0.1):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=16, bos_token_id=0,
        eos_token_id=0, pad_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout,
        attn_pdrop=dropout,
    )  # fmt: skip
    lora = peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True)
    return peft.get_peft_model(transformers.GPT2LMHeadModel(config), lora)


def texts():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 12, (N,), generator=g)
    return datasets.Dataset.from_list(
        [{"input_ids": torch.randint(1, VOCAB, (int(n),), generator=g).tolist()} for n in lengths]
    )


def pad(features):
    """Right padding, with the padded positions labelled -100."""
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    for i, f in enumerate(features):
        ids[i, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
    mask = (ids != 0).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)}


def arguments(out, **kwargs):
    settings = dict(output_dir=str(out), per_device_train_batch_size=8, learning_rate=1e-2,
                    logging_steps=1, save_strategy="no", report_to=[], max_grad_norm=0.0,
                    use_cpu=True, disable_tqdm=True, lr_scheduler_type="constant")  # fmt: skip
    settings.update(kwargs)
    return transformers.TrainingArguments(**settings)


def saving(out):
    return arguments(out, save_steps=2, save_strategy="steps")


def privacy(**kwargs):
    settings = dict(expected_batch_size=B, clip_norm=1.0, noise_multiplier=1.0, delta=1e-5,
                    epochs=1.0)  # fmt: skip
    settings.update(kwargs)
    return dpfunc.DPConfig(**settings)


def lm_trainer(out, *, model=None, args=None, seed=1, config=None, **kwargs):
    return PrivateTrainer(
        model=model if model is not None else gpt2_lora(),
        args=args if args is not None else arguments(out),
        train_dataset=texts(),
        data_collator=kwargs.pop("data_collator", pad),
        privacy=config if config is not None else privacy(),
        seed=seed,
        **kwargs,
    )


def trainable(model):
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def test_the_update_equals_private_gradients_with_torch_adamw(tmp_path):
    trainer = lm_trainer(tmp_path, model=gpt2_lora(dropout=0.0))
    trainer.train()
    assert trainer.state.global_step == trainer.private.total_steps == 3

    model = gpt2_lora(dropout=0.0)
    columns = pad([texts()[i] for i in range(N)])
    rows = [{key: column[i] for key, column in columns.items()} for i in range(N)]

    @dpfunc.batched_loss
    def loss(params, batch):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = functional_call(model, params, (), inputs, strict=False).logits
        return dpfunc.losses.causal_lm(logits, batch["labels"])

    private = dpfunc.PrivateGradients(model, loss, rows, config=privacy(), seed=1,
                                      physical_batch_size=8)  # fmt: skip
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0
    )
    for batch in private.batches():
        private.backward(batch)
        optimizer.step()
        optimizer.zero_grad()
    ours, theirs = trainable(trainer.model), trainable(model)
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-7)


def test_an_author_column_makes_the_run_user_level(tmp_path):
    """``users="author"``: users sampled, the update PrivateGradients' on the same users."""
    authors = [f"writer{i % 7 if i % 3 else 0}" for i in range(N)]  # one author of 19 texts
    corpus = texts().add_column("author", authors)
    config = privacy(privacy_unit="user", max_examples_per_user=2, expected_batch_size=3.0)
    trainer = PrivateTrainer(
        model=gpt2_lora(dropout=0.0), args=arguments(tmp_path, per_device_train_batch_size=4),
        train_dataset=corpus, data_collator=pad, privacy=config, seed=1, users="author",
    )  # fmt: skip
    assert trainer.private.num_units == 7 and trainer.private.total_steps == 2  # 7 / 3 users
    trainer.train()
    trainer.save_model()
    report = json.loads((tmp_path / PRIVACY_REPORT).read_text())
    assert report["privacy_unit"] == "user" and report["num_examples"] == 7
    assert "7 users (column 'author') over 48 examples, at most 2" in report["users"]
    assert report["epsilon"] == trainer.private.epsilon()

    model = gpt2_lora(dropout=0.0)
    columns = pad([texts()[i] for i in range(N)])
    rows = [{key: column[i] for key, column in columns.items()} for i in range(N)]

    @dpfunc.batched_loss
    def loss(params, batch):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = functional_call(model, params, (), inputs, strict=False).logits
        return dpfunc.losses.causal_lm(logits, batch["labels"])

    private = dpfunc.PrivateGradients(model, loss, rows, config=config, seed=1, users=authors,
                                      physical_batch_size=4)  # fmt: skip
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0
    )
    for batch in private.batches():
        private.backward(batch)
        optimizer.step()
        optimizer.zero_grad()
    ours, theirs = trainable(trainer.model), trainable(model)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="users='writer' names a column, but the dataset has"):
        PrivateTrainer(model=gpt2_lora(), args=arguments(tmp_path), train_dataset=corpus,
                       data_collator=pad, privacy=config, users="writer")  # fmt: skip


def test_the_noise_has_std_sigma_c_over_b(tmp_path):
    grads = []

    class Capture(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()
                                    if p.requires_grad]))  # fmt: skip

    config = privacy(noise_multiplier=2.0, clip_norm=0.5)
    trainer = lm_trainer(tmp_path, config=config, callbacks=[Capture()],
                         loss=lambda logits, labels: 0.0 * logits.sum((1, 2)))  # fmt: skip
    trainer.train()
    noise = torch.cat(grads)  # every example's gradient is 0: the gradient is the noise
    assert noise.numel() >= 768
    assert ks_statistic(noise, 2.0 * 0.5 / B) < ks_critical(noise.numel())


def test_lora_trains_the_adapters_and_nothing_else(tmp_path):
    model = gpt2_lora()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    before = trainable(model)
    assert before and all("lora_" in name for name in before)
    trainer = lm_trainer(tmp_path, model=model)
    trainer.train()
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name
            assert p.grad is None, name
        else:
            assert not torch.equal(p, before[name]), name


def test_a_resume_equals_the_run_it_continues(tmp_path):
    whole = lm_trainer(tmp_path / "a", args=saving(tmp_path / "a"))
    whole.train()
    assert os.path.isfile(tmp_path / "a" / "checkpoint-2" / PRIVACY_STATE)
    resumed = lm_trainer(tmp_path / "b", args=arguments(tmp_path / "b"))
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    assert resumed.private.steps_done == whole.private.steps_done == 3
    for name, p in trainable(whole.model).items():  # dropout included: the same masks
        assert torch.equal(p, trainable(resumed.model)[name]), name
    assert resumed.private.epsilon() == whole.private.epsilon()


def test_a_resume_follows_the_seed_rule(tmp_path):
    first = lm_trainer(tmp_path / "a", args=saving(tmp_path / "a"), seed=None)
    first.train()
    checkpoint = str(tmp_path / "a" / "checkpoint-2")
    assert torch.load(os.path.join(checkpoint, PRIVACY_STATE), weights_only=True)
    one, two = (lm_trainer(tmp_path / k, args=arguments(tmp_path / k), seed=None) for k in "bc")
    one.train(resume_from_checkpoint=checkpoint)
    two.train(resume_from_checkpoint=checkpoint)
    assert one.private.steps_done == 3
    changed = [not torch.equal(p, trainable(two.model)[name])
               for name, p in trainable(one.model).items()]  # fmt: skip
    assert all(changed)  # two continuations of one checkpoint never share noise
    fixed = lm_trainer(tmp_path / "d", args=arguments(tmp_path / "d"), seed=1)
    with pytest.raises(ValueError, match="seed"):
        fixed.train(resume_from_checkpoint=checkpoint)


def test_a_model_wrapped_after_the_trainer_was_built_is_refused(tmp_path):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2,
                                     n_positions=16, pad_token_id=0)  # fmt: skip
    gpt2 = transformers.GPT2LMHeadModel(config)
    trainer = lm_trainer(tmp_path, model=gpt2)
    lora = peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True)
    peft.get_peft_model(gpt2, lora)  # injects adapters into gpt2 and freezes the rest
    with pytest.raises(ValueError, match="trainable"):
        trainer.train()
    assert trainer.private.steps_done == 0


def test_a_second_train_call_does_not_train_again(tmp_path):
    trainer = lm_trainer(tmp_path)
    trainer.train()
    after, logged = trainable(trainer.model), list(trainer.state.log_history)
    with pytest.raises(RuntimeError, match="3 private steps.*resume_from_checkpoint"):
        trainer.train()  # transformers' loop would restart at step 0, and log a fake run
    assert trainer.private.steps_done == 3 and trainer.state.log_history == logged
    assert all(torch.equal(p, after[n]) for n, p in trainable(trainer.model).items())


def test_a_checkpoint_without_the_privacy_state_is_refused(tmp_path):
    trainer = lm_trainer(tmp_path / "a", args=saving(tmp_path / "a"))
    trainer.train()
    os.remove(tmp_path / "a" / "checkpoint-2" / PRIVACY_STATE)
    again = lm_trainer(tmp_path / "b", args=arguments(tmp_path / "b"))
    with pytest.raises(ValueError, match=PRIVACY_STATE):
        again.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))


def test_the_logged_epsilon_is_dp_accounting(tmp_path):
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    config = privacy(accounting="rdp", epochs=2.0)
    trainer = lm_trainer(tmp_path, config=config)
    trainer.train()
    logged = [(row["step"], row["epsilon"]) for row in trainer.state.log_history
              if "nonprivate/loss" in row]  # fmt: skip
    assert [step for step, _ in logged] == list(range(1, 7))
    event = dp_accounting.PoissonSampledDpEvent(B / N, dp_accounting.GaussianDpEvent(1.0))
    for step, epsilon in logged:
        accountant = RdpAccountant()
        accountant.compose(event, step)
        assert epsilon == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)


def test_training_stops_at_the_epsilon_budget(tmp_path):
    config = privacy(epochs=3.0, epsilon_budget=None)
    planned = lm_trainer(tmp_path / "a", config=config)
    planned.train()
    budget = 0.5 * (planned.private.epsilon() + _epsilon_after(planned, 1))
    config = privacy(epochs=3.0, epsilon_budget=budget)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the plan overruns the budget: said at construction
        trainer = lm_trainer(tmp_path / "b", config=config)
    trainer.train()
    assert 0 < trainer.state.global_step == trainer.private.steps_done < planned.private.steps_done
    assert trainer.private.epsilon() <= budget
    assert trainer.state.log_history[-1]["epsilon"] <= budget


def _epsilon_after(trainer, steps):
    from dpfunc.accounting import epsilon

    config = trainer.private.config
    return epsilon(config.noise_multiplier, trainer.private.sample_rate, steps, config.delta)


def test_save_model_writes_the_privacy_report(tmp_path):
    trainer = lm_trainer(tmp_path)
    trainer.train()
    trainer.save_model()
    with open(tmp_path / PRIVACY_REPORT) as f:
        report = json.load(f)
    assert report["steps"] == 3 and report["epsilon"] == trainer.private.epsilon()
    assert not os.path.exists(tmp_path / PRIVACY_STATE)  # the secret is in checkpoints only


def test_sequence_classification_is_ghost_clipped_and_trains(tmp_path):
    torch.manual_seed(0)
    bert = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, num_labels=3))  # fmt: skip
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(1, VOCAB, (8,), generator=g).tolist(),
             "label": int(torch.randint(3, (), generator=g))} for _ in range(N)]  # fmt: skip
    before = trainable(bert)
    trainer = PrivateTrainer(model=bert, args=arguments(tmp_path), privacy=privacy(),
                             train_dataset=datasets.Dataset.from_list(rows), seed=2,
                             speed=dpfunc.SpeedConfig(model=bert, method="ghost"))  # fmt: skip
    micro, _ = trainer.private.plan.batches.logical_batch(0)
    batch = micro[0][0]
    plan = trainer.private.step_fn.explain(trainer.private.full_params(), batch)
    assert set(plan.values()) == {"ghost"}
    trainer.train()
    assert all(not torch.equal(p, before[n]) for n, p in trainable(bert).items())


def test_bf16_autocast_trains_with_ghost_clipping(tmp_path):
    model = gpt2_lora()
    speed = dpfunc.SpeedConfig(model=model, method="ghost")
    trainer = lm_trainer(tmp_path, model=model, args=arguments(tmp_path, bf16=True), speed=speed)
    trainer.train()
    assert all(torch.isfinite(p).all() for p in trainable(trainer.model).values())


def test_max_grad_norm_warns_and_is_not_applied(tmp_path):
    with pytest.warns(UserWarning, match="max_grad_norm=1.0 is not used"):
        trainer = lm_trainer(tmp_path, args=arguments(tmp_path, max_grad_norm=1.0))
    assert trainer._clip_grad_norm(trainer.model) is None


REFUSED = {
    "gradient_accumulation_steps": 2,
    "fp16": True,
    "torch_compile": True,
    "auto_find_batch_size": True,
    "neftune_noise_alpha": 5.0,
    "include_num_input_tokens_seen": "all",
    "activation_checkpointing_kwargs": {"use_reentrant": True},
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_settings_that_change_the_accounting_or_the_update_are_refused(tmp_path, name):
    args = arguments(tmp_path, activation_checkpointing=name.startswith("activation"))
    setattr(args, name, REFUSED[name])
    with pytest.raises(ValueError, match=name):
        lm_trainer(tmp_path, args=args)


def test_other_refusals_name_what_to_use(tmp_path):
    with pytest.raises(TypeError, match="dpfunc.DPConfig"):
        lm_trainer(tmp_path, config={"clip_norm": 1.0})
    with pytest.raises(ValueError, match="loss="):
        lm_trainer(tmp_path, compute_loss_func=lambda outputs, labels, num_items_in_batch: 0)
    with pytest.raises(ValueError, match="one place"):
        lm_trainer(tmp_path, args=arguments(tmp_path, num_train_epochs=5))
    args = arguments(tmp_path)
    args.push_to_hub, args.hub_strategy = True, "checkpoint"
    with pytest.raises(ValueError, match="secret seed"):
        lm_trainer(tmp_path, args=args)
    with pytest.raises(ValueError, match=r"not tensors: \['text'\]"):
        PrivateTrainer(model=gpt2_lora(), args=arguments(tmp_path), train_dataset=texts(),
                       data_collator=lambda f: {**pad(f), "text": ["a"] * len(f)},
                       privacy=privacy())  # fmt: skip
    with pytest.raises(ValueError, match="no 'labels'"):
        PrivateTrainer(model=gpt2_lora(), args=arguments(tmp_path), train_dataset=texts(),
                       data_collator=lambda f: {"input_ids": pad(f)["input_ids"]},
                       privacy=privacy())  # fmt: skip


def test_each_micro_batch_is_collated_when_used_and_a_random_collator_draws_per_step(tmp_path):
    calls = []

    class Masking:  # draws a random mask per call, as DataCollatorForLanguageModeling(mlm=True)
        def __call__(self, features):
            batch = pad(features)
            keep = torch.rand(batch["labels"].shape) < 0.5
            calls.append((len(features), [f["input_ids"][:3] for f in features], keep))
            batch["labels"] = torch.where(keep, batch["labels"], -100)
            return batch

    trainer = lm_trainer(tmp_path, data_collator=Masking())
    built = len(calls)
    assert built == 1 and calls[0][0] <= 2  # one small batch checks the columns; nothing else
    trainer.train()
    used = calls[built:]
    assert len(used) >= trainer.private.total_steps  # at least one micro-batch per step
    assert all(n == 8 for n, _, _ in used)  # the physical batch, never the corpus (N = 48)
    # an example drawn at two steps got two independent masks
    seen = {}
    for _, heads, keep in used:
        for head, row in zip(heads, keep):
            seen.setdefault(str(head), []).append(row[: len(head)])
    again = [rows for rows in seen.values() if len(rows) > 1]
    assert again and any(not torch.equal(rows[0], rows[1]) for rows in again)


def test_micro_batches_are_padded_to_a_bucket_length_with_the_right_values():
    from dpfunc.integrations.transformers import BucketPadding

    padding = BucketPadding(pad, pad_token_id=7, max_length=16)
    batch = padding([{"input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9]}, {"input_ids": [5, 6]}])
    assert batch["input_ids"].shape == (2, 12)  # 9 tokens: the next bucket, 12
    assert batch["input_ids"][0, 9:].tolist() == [7, 7, 7]
    assert batch["attention_mask"][0].tolist() == [1] * 9 + [0] * 3
    assert batch["labels"][1].tolist() == [5, 6] + [-100] * 10
    left = BucketPadding(pad, pad_token_id=7, padding_side="left")
    assert left([{"input_ids": [1] * 9}])["input_ids"][0, :3].tolist() == [7, 7, 7]

    def odd(features):  # a sequence column whose padding value is unknown
        batch = pad(features)
        return {**batch, "positions": torch.zeros_like(batch["input_ids"])}

    with pytest.warns(UserWarning, match="positions"):
        kept = BucketPadding(odd, pad_token_id=0)([{"input_ids": [1] * 9}])
    assert kept["input_ids"].shape == (1, 9)


def test_a_packing_collator_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="DataCollatorWithFlattening.*clipped"):
        lm_trainer(tmp_path, data_collator=transformers.DataCollatorWithFlattening())


def test_block_packed_rows_are_warned_about(tmp_path):
    g = torch.Generator().manual_seed(0)
    blocks = datasets.Dataset.from_list(
        [{"input_ids": torch.randint(1, VOCAB, (8,), generator=g).tolist()} for _ in range(N)]
    )
    with pytest.warns(UserWarning, match="privacy unit is a block"):
        PrivateTrainer(model=gpt2_lora(), args=arguments(tmp_path), train_dataset=blocks,
                       data_collator=pad, privacy=privacy(), seed=1)  # fmt: skip


def test_an_iterable_dataset_is_refused_with_dpfuncs_reason_first(tmp_path):
    stream = datasets.Dataset.from_list([{"input_ids": [1, 2]}] * 4).to_iterable_dataset()
    with pytest.raises(ValueError, match="Poisson sampling"):
        PrivateTrainer(model=gpt2_lora(), args=arguments(tmp_path), train_dataset=stream,
                       data_collator=pad, privacy=privacy(), seed=1)  # fmt: skip


def test_hugging_faces_unaccounted_search_is_refused_for_dpfunc_tune(tmp_path):
    trainer = lm_trainer(tmp_path)
    with pytest.raises(RuntimeError, match="dpfunc.tune"):
        trainer.hyperparameter_search(n_trials=3)
    assert trainer.private.steps_done == 0


def test_the_length_of_the_run_follows_the_training_arguments(tmp_path):
    config = dpfunc.DPConfig(expected_batch_size=B, clip_norm=1.0, noise_multiplier=1.0,
                             delta=1e-5)  # fmt: skip
    trainer = lm_trainer(tmp_path, args=arguments(tmp_path, max_steps=5), config=config)
    trainer.train()
    assert trainer.state.global_step == trainer.private.steps_done == 5
    assert trainer.private.total_steps == 5


def test_the_heads_by_model_class():
    logits, labels = torch.randn(2, 3), torch.tensor([0, 2])
    bert = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=8, num_labels=3))  # fmt: skip
    head = per_example_loss(bert)
    torch.testing.assert_close(
        head(logits, labels), torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    )
    assert per_example_loss(gpt2_lora()) is dpfunc.losses.causal_lm
    masked = transformers.BertForMaskedLM(bert.config)
    assert per_example_loss(masked) is dpfunc.losses.masked_lm
    with pytest.raises(ValueError, match="label_smoothing"):
        per_example_loss(gpt2_lora(), label_smoothing=0.1)
    with pytest.raises(ValueError, match="no built-in per-example loss for BertModel"):
        per_example_loss(bert.bert)
    bert.config.problem_type = "regression"
    with pytest.raises(ValueError, match="regression"):
        per_example_loss(bert)
    assert math.isfinite(float(head(logits, labels).sum()))


def run_for_ranks(out):
    """A run whose update does not depend on the number of processes (no dropout)."""
    trainer = lm_trainer(out, model=gpt2_lora(dropout=0.0), args=arguments(out))
    trainer.train()
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return {"params": trainable(trainer.model), "epsilon": trainer.private.epsilon(),
            "steps": trainer.private.steps_done, "world": world,
            "wrapped": type(trainer.model_wrapped).__name__}  # fmt: skip


@ranks.NEEDS_GLOO
def test_two_gloo_ranks_equal_one_process(tmp_path):
    ranks.assert_ok(ranks.launch(__file__, [tmp_path], tmp_path, 2, guard_s=240))
    alone = run_for_ranks(tmp_path / "alone")
    results = [ranks.load_rank(tmp_path, rank) for rank in range(2)]
    assert [r["world"] for r in results] == [2, 2]
    assert [r["wrapped"] for r in results] == ["DistributedDataParallel"] * 2  # as HF runs it
    assert results[0]["steps"] == results[1]["steps"] == alone["steps"] == 3
    assert results[0]["epsilon"] == alone["epsilon"]
    for name, value in alone["params"].items():
        assert torch.equal(results[0]["params"][name], results[1]["params"][name])
        torch.testing.assert_close(results[0]["params"][name], value, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":  # one rank of test_two_gloo_ranks_equal_one_process
    warnings.simplefilter("ignore")
    out = sys.argv[1]
    result = run_for_ranks(os.path.join(out, f"run{os.environ['RANK']}"))
    torch.save(result, os.path.join(out, f"rank{os.environ['RANK']}.pt"))
    # transformers started the group and leaves it open: a rank that exits with gloo's
    # threads still running can abort ("terminate called without an active exception")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def test_step_based_arguments_are_said_to_count_logical_steps(tmp_path):
    args = arguments(tmp_path, eval_strategy="steps", eval_steps=40, warmup_steps=3)
    with pytest.warns(UserWarning, match=r"eval_steps=40.*warmup_steps=3.*logical steps") as got:
        lm_trainer(tmp_path, args=args, eval_dataset=texts())
    message = next(str(w.message) for w in got if "logical steps" in str(w.message))
    assert "batch of 16 examples" in message and "per_device_train_batch_size=8" in message
    assert "An epoch is 3 steps, where transformers.Trainer would take 6" in message
    with warnings.catch_warnings():  # a physical batch equal to the expected one: nothing to say
        warnings.simplefilter("error", UserWarning)
        lm_trainer(tmp_path, args=arguments(tmp_path, per_device_train_batch_size=16))


def test_the_length_of_the_run_has_one_answer_with_a_target_epsilon(tmp_path):
    args = arguments(tmp_path, num_train_epochs=2)
    with pytest.raises(ValueError, match="leave privacy.epochs out"):
        lm_trainer(tmp_path, args=args, config=privacy(epochs=1.0))
    # the advice, taken: a target epsilon is calibrated for the TrainingArguments' length
    target = privacy(noise_multiplier=None, target_epsilon=3.0, epochs=None)
    trainer = lm_trainer(tmp_path, args=args, config=target)
    assert trainer.private.total_steps == 6  # 2 epochs of 3 steps
    n, steps = trainer.private.num_examples, trainer.private.total_steps
    spent = dpfunc.accounting.epsilon(trainer.private.noise_multiplier, B / n, steps, 1e-5)
    assert spent <= 3.0


def test_the_saved_report_names_the_step_of_the_weights_and_how_they_were_chosen(tmp_path):
    args = arguments(tmp_path, eval_strategy="steps", eval_steps=1, save_strategy="steps",
                     save_steps=1, load_best_model_at_end=True, num_train_epochs=2,
                     metric_for_best_model="eval_loss", greater_is_better=True)  # fmt: skip
    trainer = lm_trainer(tmp_path, args=args, eval_dataset=texts(),
                         config=privacy(epochs=None))  # fmt: skip
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    report = json.loads((tmp_path / "final" / PRIVACY_REPORT).read_text())
    saved = report["saved_weights"]
    best = int(trainer.state.best_model_checkpoint.rsplit("-", 1)[-1])
    assert saved["after_step"] == best and report["steps"] == 6
    assert "eval_loss on the eval set" in saved["chosen_by"] and "private" in saved["chosen_by"]
    config = trainer.private.config
    # the choice compared the checkpoints of all 6 steps: the weights of step `best` depend on
    # every one of them, so their epsilon is the run's, not that of the first `best` steps
    assert (
        saved["epsilon"]
        == report["epsilon"]
        == dpfunc.accounting.epsilon(
            config.noise_multiplier, trainer.private.plan.sample_rate, 6, 1e-5
        )
    )
    assert "up to step 6" in saved["note"]
    plain = lm_trainer(tmp_path / "plain")
    plain.train()
    plain.save_model(str(tmp_path / "plain"))
    saved = json.loads((tmp_path / "plain" / PRIVACY_REPORT).read_text())["saved_weights"]
    assert saved["after_step"] == 3 and saved["chosen_by"] == "the last step's weights"
    assert (
        saved["epsilon"] == json.loads((tmp_path / "plain" / PRIVACY_REPORT).read_text())["epsilon"]
    )


def test_gradient_checkpointing_trains_as_without_it(tmp_path):
    args = arguments(tmp_path / "a", max_steps=2)
    plain = lm_trainer(tmp_path / "a", model=gpt2_lora(dropout=0.0), args=args,
                       config=privacy(epochs=None))  # fmt: skip
    plain.train()
    args = arguments(tmp_path / "b", max_steps=2, gradient_checkpointing=True)
    checkpointed = lm_trainer(tmp_path / "b", model=gpt2_lora(dropout=0.0), args=args,
                              config=privacy(epochs=None))  # fmt: skip
    checkpointed.train()
    assert dpfunc._activation_checkpointing.activation_checkpointing(checkpointed.model)
    ours, theirs = trainable(checkpointed.model), trainable(plain.model)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-7)


def word_tokenizer():
    """A word-level tokenizer built in code (no download): trl's SFTTrainer needs one."""
    tokenizers = pytest.importorskip("tokenizers")
    words = ["the", "a", "cat", "dog", "sat", "ran", "on", "mat", "log", "fast", "slow", "red"]
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=model, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    g = torch.Generator().manual_seed(0)
    texts = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (int(n),), generator=g))
             for n in torch.randint(3, 12, (N,), generator=g)]  # fmt: skip
    return tokenizer, datasets.Dataset.from_dict({"text": texts})


def test_trls_sft_trainer_is_made_private_by_the_documented_mixin(tmp_path):
    trl = pytest.importorskip("trl", reason="needs the 'trl' extra")

    class PrivateSFTTrainer(PrivateTrainer, trl.SFTTrainer):  # docs/huggingface.md, "trl"
        pass

    tokenizer, texts = word_tokenizer()
    settings = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=3,
                    max_grad_norm=0.0, report_to=[], use_cpu=True, save_strategy="no",
                    logging_steps=1, max_length=32)  # fmt: skip
    privacy = dpfunc.DPConfig(expected_batch_size=16, clip_norm=1.0, noise_multiplier=1.0,
                              delta=1e-5)  # fmt: skip
    trainer = PrivateSFTTrainer(model=gpt2_lora(), args=trl.SFTConfig(**settings),
                                train_dataset=texts, processing_class=tokenizer,
                                privacy=privacy)  # fmt: skip
    before = trainable(trainer.model)
    trainer.train()
    assert trainer.private.steps_done == 3 and "epsilon" in trainer.state.log_history[-1]
    assert any(not torch.equal(p, before[n]) for n, p in trainable(trainer.model).items())
    packing = trl.SFTConfig(**settings, packing=True)  # padding-free: examples share a row
    with pytest.raises(ValueError, match="packs examples together"):
        PrivateSFTTrainer(model=gpt2_lora(), args=packing, train_dataset=texts,
                          processing_class=tokenizer, privacy=privacy)  # fmt: skip


def test_the_logged_noise_norm_is_what_the_noise_alone_gives(tmp_path):
    trainer = lm_trainer(tmp_path, config=privacy(noise_multiplier=50.0))  # noise dominates
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "grad_norm" in entry]
    entries = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    assert logged and all(e["noise_norm"] == 50.0 * 1.0 / B * math.sqrt(entries) for e in logged)
    assert all(abs(e["grad_norm"] / e["noise_norm"] - 1) < 0.1 for e in logged)


def test_transformers_4_is_refused_at_import_and_5_accepted():
    from dpfunc.integrations.transformers import _check_version

    for version in ("4.57.1", "4.46.0", "6.0.0"):
        with pytest.raises(ImportError, match=f"needs transformers 5.x, found {version}"):
            _check_version(version)
    _check_version("5.0.0")
    _check_version(transformers.__version__)  # the installed one
