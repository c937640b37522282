"""Benchmark one training step on Hugging Face models: plain PyTorch vs dpfunc vs Opacus.

Run from the repository root:

    .venv/bin/python bench/hf.py            # full run (15-25 minutes on 2 CPU cores)
    .venv/bin/python bench/hf.py --quick    # smoke run (a few minutes; skips torch.compile)
    .venv/bin/python bench/hf.py --out DIR  # write DIR/hf.json and DIR/hf.md

Five workloads, each a model built from a small config (nothing is downloaded), float32,
batch 32 of 64 tokens with right padding (every sequence keeps between 32 and 64 tokens;
the attention_mask marks the rest):

- ``bert_masked``: BertForSequenceClassification (hidden 128, 2 layers, 2 heads,
  intermediate 512, vocabulary 1000), 2 labels, cross-entropy on the logits.
- ``gpt2_full``: GPT2LMHeadModel (n_embd 128, 2 layers, 2 heads, vocabulary 1000; the
  LM head is tied to the token embedding, as in GPT-2), every parameter trained. The loss
  of a sequence is the mean next-token cross-entropy over its labelled tokens (labels are
  the input ids, -100 at padding; for one sequence this is the model's own ``labels=``
  loss); the batch loss is the mean over sequences, so all methods do the same math.
- ``gpt2_labels``: the same GPT-2 called with ``labels=``, transformers' own loss (for one
  sequence, the same loss as ``gpt2_full``'s; the non-private step averages the batch's
  tokens instead of its sequences, at the same cost). No Opacus rows: its ghost mode needs
  one loss per example.
- ``llama``: LlamaForCausalLM (hidden 128, 2 layers, 4 heads, 2 key-value heads: grouped-
  query attention, RoPE, RMSNorm, SwiGLU with intermediate 512), loss as ``gpt2_full``.
- ``gpt2_lora``: the same GPT-2 under ``peft.get_peft_model`` with ``LoraConfig(r=8,
  target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)``: only the adapters train.

Dropout probabilities are 0 and the models stay in train mode. The methods are
bench/harness.py's builders (same names) with a forward that calls the model on
``(input_ids, attention_mask)`` and the workload's loss: ``nonprivate`` (eager PyTorch,
mean loss, SGD), ``dpfunc_ghost`` (dpfunc's default step, ``make_train_step(...,
model=model)``, method "auto"), ``dpfunc_vmap`` (method "vmap"), each eager and under
``torch.compile(fullgraph=True)`` as dpfunc compiles (``dpfunc._compiling.compile_fullgraph``),
``dpfunc_ghost_only`` (method "ghost", eager: with ``dpfunc_vmap``, what "auto" chooses
between), ``dpfunc_batched`` and ``dpfunc_batched_compiled`` (the default step with the
workload's loss as a batched loss, ``dpfunc.batched_loss``: one loss per sequence for the
whole batch, so the ghost pass runs the model batched; not for ``gpt2_labels``, whose
``labels=`` loss averages the batch's tokens), and Opacus 1.6 in ``hooks`` and ``ghost`` mode.
Out of the box Opacus fails on BERT and the fully trained GPT-2: the position ids (and
BERT's token type ids) that the models build for themselves have batch size 1, so the
per-sample gradients of those embeddings come out with 1 row. ``opacus_hooks_ids`` and
``opacus_ghost_ids`` pass them in explicitly with a batch dimension (the usual workaround;
same math), so there are Opacus numbers to compare with (Opacus' ghost mode still refuses
GPT-2's tied embedding).
Timing, memory and the tables are bench/harness.py's. A method that raises is a result: its
row says ``failed:`` with the exception type and the first line of its message (the
traceback goes to hf.json and stdout). Warnings raised while a method is built and
warmed up are recorded too; hf.md quotes dpfunc's own (and vmap's fallbacks).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

# A fresh inductor cache for this run, so "compile s" is a cold compile (set before torch loads).
FRESH_CACHE = None
if __name__ == "__main__" and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    FRESH_CACHE = os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp("-inductor")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (bench/harness.py: builders, timing, memory, tables)
import peft  # noqa: E402

# Two compiled methods can trace to the same graph (method "auto" that settles on plain vmap);
# without these the second would hit the first one's cached graph and "compile s" would not
# be a cold compile. (Kernels already built in this process are still reused.)
torch._inductor.config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False
import transformers  # noqa: E402

# --- settings -----------------------------------------------------------------

B, T, VOCAB = 32, 64, 1000  # batch, tokens per sequence (padded), vocabulary
WIDTH = 128  # hidden size; intermediate 4 * WIDTH, heads of 64 (Llama's of 32)
MIN_LENGTH = T // 2  # each sequence keeps between MIN_LENGTH and T tokens
PAD_ID = 0  # token id at padding positions
# targets for dpfunc's default step (make_train_step(..., model=model)) over `nonprivate`
TARGETS = {
    "compiled_x_time": 1.2,  # the faster of dpfunc_ghost_compiled, dpfunc_batched_compiled
    "compiled_x_memory": 1.5,  # the same step's peak memory
    "eager_x_time": 1.5,  # dpfunc_batched (dpfunc_ghost where a batched loss does not apply)
}
# warnings whose text contains one of these are quoted in hf.md (all go to hf.json)
NOTABLE_WARNINGS = ("dpfunc", "batching rule")


# --- workloads: name -> () -> (model, (input_ids, attention_mask), labels) ---------------


def padded_tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids [B, T] and an attention mask [B, T] (1 for the first 32..64 tokens)."""
    lengths = torch.randint(MIN_LENGTH, T + 1, (B,))
    mask = (torch.arange(T) < lengths[:, None]).long()
    ids = torch.randint(1, VOCAB, (B, T)).masked_fill(mask == 0, PAD_ID)
    return ids, mask


def bert_masked():
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2,
        num_attention_heads=WIDTH // 64, intermediate_size=4 * WIDTH,
        max_position_embeddings=T, num_labels=2, pad_token_id=PAD_ID,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = transformers.BertForSequenceClassification(config).train()
    ids, mask = padded_tokens()
    return model, (ids, mask), torch.randint(2, (B,))


def gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=WIDTH, n_layer=2, n_head=WIDTH // 64, n_positions=T,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=PAD_ID, eos_token_id=PAD_ID, pad_token_id=PAD_ID,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).train()


def gpt2_full():
    ids, mask = padded_tokens()
    return gpt2(), (ids, mask), ids.masked_fill(mask == 0, -100)


def gpt2_lora():
    lora = peft.LoraConfig(r=8, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
    model = peft.get_peft_model(gpt2(), lora).train()
    ids, mask = padded_tokens()
    return model, (ids, mask), ids.masked_fill(mask == 0, -100)


def gpt2_labels():
    """GPT-2 called as people call it: ``model(..., labels=labels).loss``, transformers' own
    loss (the mean over the labelled tokens of what it is given: for one sequence, the same
    loss as ``gpt2_full``'s). The labels travel with the inputs: x = (ids, mask, labels)."""
    ids, mask = padded_tokens()
    labels = ids.masked_fill(mask == 0, -100)
    return gpt2(), (ids, mask, labels), labels


def llama():
    """A Llama-style decoder: grouped-query attention (4 heads, 2 key-value heads), RoPE,
    RMSNorm, SwiGLU; LM head not tied."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2,
        num_attention_heads=WIDTH // 32, num_key_value_heads=WIDTH // 64,
        intermediate_size=4 * WIDTH, max_position_embeddings=T,
        pad_token_id=PAD_ID, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).train()
    ids, mask = padded_tokens()
    return model, (ids, mask), ids.masked_fill(mask == 0, -100)


class LanguageModelLoss(nn.Module):
    """Next-token cross-entropy: each sequence's mean over its labelled tokens (label -100:
    none), then the mean over sequences (``reduction="mean"``) or one per sequence
    (``"none"``, as Opacus' ghost mode sets it)."""

    def __init__(self):
        super().__init__()
        self.reduction = "mean"

    def forward(self, logits, labels):
        logits, labels = logits[:, :-1], labels[:, 1:]
        tokens = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none"
        ).view(labels.shape)  # 0 where the label is -100
        per_sequence = tokens.sum(1) / (labels != -100).sum(1).clamp(min=1)
        return per_sequence if self.reduction == "none" else per_sequence.mean()


def logits(call, x):
    """The model's logits on x = (input_ids, attention_mask)."""
    ids, mask = x
    return call(input_ids=ids, attention_mask=mask).logits


def labels_loss(call, x):
    """transformers' own loss on x = (input_ids, attention_mask, labels)."""
    ids, mask, labels = x
    return call(input_ids=ids, attention_mask=mask, labels=labels).loss


class ModelLoss(nn.Module):
    """The criterion of ``gpt2_labels``: the model already returned its loss."""

    reduction = "mean"

    def forward(self, loss, labels):
        return loss


def logits_explicit_ids(call, x, token_types=False):
    """``logits`` with the ids the model would default to passed in with a batch dimension:
    position_ids (and BERT's token_type_ids). The defaults are buffers of batch 1, which
    Opacus' per-sample hooks cannot split into examples; the math is the same."""
    ids, mask = x
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids).contiguous()
    types = {"token_type_ids": torch.zeros_like(ids)} if token_types else {}
    return call(input_ids=ids, attention_mask=mask, position_ids=positions, **types).logits


def bert_explicit_ids(call, x):
    return logits_explicit_ids(call, x, token_types=True)


# name -> (build, loss module type, forward with explicit ids for the opacus_*_ids rows,
# forward of the other rows)
WORKLOADS = {
    "bert_masked": (bert_masked, nn.CrossEntropyLoss, bert_explicit_ids, logits),
    "gpt2_full": (gpt2_full, LanguageModelLoss, logits_explicit_ids, logits),
    "gpt2_labels": (gpt2_labels, ModelLoss, None, labels_loss),
    "gpt2_lora": (gpt2_lora, LanguageModelLoss, logits_explicit_ids, logits),
    "llama": (llama, LanguageModelLoss, logits_explicit_ids, logits),
}
# Opacus needs one loss per example in ghost mode, which transformers' labels= loss does not
# give (it averages the batch's tokens): gpt2_labels has no Opacus rows
NO_OPACUS = {"gpt2_labels"}


# --- methods: bench/harness.py's builders on this forward and loss ------------------------


def builders(criterion, explicit_ids=logits_explicit_ids, forward=logits) -> dict:
    """name -> builder(model, x, y) -> (step, params); ``criterion()`` makes a fresh loss.
    The ``opacus_*_ids`` rows call the model through ``explicit_ids``, the rest through
    ``forward``."""

    def kw(call=forward):
        return {"forward": call, "criterion": criterion()}

    def dp(method, compile=False, batch_loss=False):
        return lambda m, x, y: harness.dpfunc_step(
            m, x, y, method, compile=compile, batch_loss=batch_loss, **kw()
        )

    def opacus(mode, call=forward):
        return lambda m, x, y: harness.opacus(m, x, y, mode, **kw(call))

    return {
        "nonprivate": lambda m, x, y: harness.nonprivate(m, x, y, **kw()),
        "dpfunc_vmap": dp("vmap"),
        "dpfunc_vmap_compiled": dp("vmap", compile=True),
        "dpfunc_ghost": dp("auto"),
        "dpfunc_ghost_compiled": dp("auto", compile=True),
        "dpfunc_ghost_only": dp("ghost"),
        "dpfunc_batched": dp("auto", batch_loss=True),
        "dpfunc_batched_compiled": dp("auto", compile=True, batch_loss=True),
        "opacus_hooks": opacus("hooks"),
        "opacus_ghost": opacus("ghost"),
        "opacus_hooks_ids": opacus("hooks", explicit_ids),
        "opacus_ghost_ids": opacus("ghost", explicit_ids),
    }


METHODS = tuple(builders(nn.CrossEntropyLoss))


def first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0].strip() if lines else ''}"


def recorded(builder, log: dict, watch: int):
    """``builder``, recording into ``log`` the warnings raised while it builds and during the
    step's first ``watch`` calls (the warm-up), and the first exception with its traceback."""

    def run_logged(fn):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                return fn()
            except Exception as e:
                if "error" not in log:
                    log["error"], log["traceback"] = first_line(e), traceback.format_exc()
                    print(log["traceback"], flush=True)
                raise
            finally:
                for w in caught:
                    text = f"{w.category.__name__}: {' '.join(str(w.message).split())}"
                    log["warnings"].setdefault(text, f"{w.filename}:{w.lineno}")

    def build(model, x, y):
        log.update(warnings={}, calls=0)
        step, params = run_logged(lambda: builder(model, x, y))
        log["train_step"] = getattr(step, "train_step", None)

        def watched():
            if log["calls"] >= watch:
                return step()
            log["calls"] += 1
            return run_logged(step)

        return watched, params

    return build


def ghost_plan(train_step, names: list[str]) -> str | None:
    """How dpfunc's step clipped each parameter, from the plan(s) its ghost planner made for
    the batches it saw (None where its internals moved). Not ``TrainStep.explain``: called
    eagerly on a step that ran compiled, that plans anew with eager auto's timing, and can
    differ from the plan compiled into the graph."""
    try:
        clipper = train_step.clip.ghost
        if clipper is None:
            return "vmap (no ghost path)"
        out = []
        for plan in clipper.plans.values():
            paths = plan.explain(names)
            why = Counter(v[:160] for v in paths.values() if v != "ghost")
            ghosted = len(paths) - sum(why.values())
            out.append(
                f"ghost for {ghosted} of {len(paths)} parameter tensors"
                + "".join(f"; {n} x {reason}" for reason, n in why.items())
            )
        return " | ".join(out) or None
    except AttributeError:
        return None


# --- reporting ----------------------------------------------------------------


def targets_table(results: dict) -> list[str]:
    """One row per workload: the default step, compiled and eager, against the targets."""
    t, fmt = TARGETS, harness.fmt
    lines = [
        "## Targets for the default step",
        "",
        'The default step is `make_train_step(..., model=model)` (method "auto": ghost '
        "clipping where it covers the model and is cheaper, vmap elsewhere), with the "
        "one-example loss or the batched one (`dpfunc.batched_loss`). Targets over the eager "
        f"non-private step: compiled (the faster of `dpfunc_ghost_compiled` and "
        f"`dpfunc_batched_compiled`, named in the row) at most {t['compiled_x_time']:g}x its "
        f"time and {t['compiled_x_memory']:g}x its peak memory; eager with the batched loss "
        f"(`dpfunc_batched`; `dpfunc_ghost` where it does not apply) at most "
        f"{t['eager_x_time']:g}x its time.",
        "",
        "| workload | non-private ms | compiled | compiled ms | x time (target) "
        "| x memory (target) | compile s | eager ms | x time (target) | x memory | all met |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]

    def check(value, limit):
        if value is None:
            return "-", None
        if limit is None:
            return f"{value:.2f}x", True
        return f"{value:.2f}x (<= {limit:g}x)", value <= limit

    def over(v, base, key):
        return v[key] / base[key] if v.get(key) and base.get(key) else None

    for name, info in results["workloads"].items():
        methods = info["methods"]
        base = methods.get("nonprivate", {})
        ran = {m: v for m, v in methods.items() if v.get("median_ms")}
        compiled = [m for m in ("dpfunc_ghost_compiled", "dpfunc_batched_compiled") if m in ran]
        which = min(compiled, key=lambda m: ran[m]["median_ms"], default="-")
        comp = ran.get(which, {})
        eager = ran.get("dpfunc_batched", ran.get("dpfunc_ghost", {}))
        cells = [
            check(over(comp, base, "median_ms"), t["compiled_x_time"]),
            check(over(comp, base, "peak_mb"), t["compiled_x_memory"]),
            check(over(eager, base, "median_ms"), t["eager_x_time"]),
            check(over(eager, base, "peak_mb"), None),
        ]
        checked = [ok for _, ok in cells[:3] if ok is not None]
        if len(checked) == 3:
            met = "yes" if all(checked) else "**no**"
        else:
            met = ("**no**" if not all(checked) else "so far") + " (not all measured)"
        row = [
            name, fmt(base.get("median_ms"), ".2f"), f"`{which}`",
            fmt(comp.get("median_ms"), ".2f"),
            cells[0][0], cells[1][0], fmt(comp.get("compile_s"), ".1f"),
            fmt(eager.get("median_ms"), ".2f"), cells[2][0], cells[3][0], met,
        ]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    return lines


def notes(results: dict) -> list[str]:
    """What dpfunc's step did on each model, the failures, dpfunc's and vmap's warnings."""
    lines = ["## dpfunc's plan, failures and warnings", ""]
    raised: dict[str, list[str]] = {}  # warning -> the methods that raised it
    for name, info in results["workloads"].items():
        for method, v in info["methods"].items():
            items = [f"plan: {v['plan']}"] if v.get("plan") else []
            if v.get("error"):
                items.append(f"failed: `{v['error'][:300]}`")
            if items:
                lines.append(f"- `{name}/{method}`: " + "; ".join(items))
            for text in v.get("warnings", {}):
                if any(key in text for key in NOTABLE_WARNINGS):
                    raised.setdefault(text, []).append(f"{name}/{method}")
    if raised:
        lines += ["", "Warnings raised while a method was built and warmed up:", ""]
        lines += [f"- `{text[:2000]}` ({', '.join(where)})" for text, where in raised.items()]
    return lines + [""]


def markdown(results: dict) -> str:
    lines = harness.header(results, "dpfunc step benchmark: Hugging Face models")
    lines += [
        f"Batch {B} sequences of {T} tokens, right-padded (lengths {MIN_LENGTH}..{T}), "
        "models from small configs, dropout 0, train mode; see the docstring of "
        '`bench/hf.py`. `dpfunc_ghost` is dpfunc\'s default step (method "auto"), '
        '`dpfunc_vmap` method "vmap"; `*_compiled` under `torch.compile(fullgraph=True)`. '
        "`opacus_*_ids`: Opacus with the position ids (and BERT's token type ids) passed in "
        "with a batch dimension, the usual workaround for the failure of plain `opacus_*` "
        "(those ids default to buffers of batch 1). compile s: the first workload's is from a "
        "cold cache; later workloads reuse kernels that earlier ones built in the same process "
        "(in fresh processes from a cold cache the first compiled call took 68 s for BERT, 61 s "
        "for GPT-2 with labels= and 64 s for Llama, see the closing figures in "
        "docs/performance.md).",
        "",
    ]
    lines += targets_table(results) + [""] + notes(results) + harness.auto_table(results)
    lines += harness.workload_tables(results)
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repeats, no torch.compile")
    parser.add_argument("--out", default="bench", help="folder for hf.json and hf.md")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated")
    args = parser.parse_args()
    settings = harness.QUICK if args.quick else harness.FULL
    workloads, methods = args.workloads.split(","), args.methods.split(",")
    for name in workloads + methods:
        if name not in WORKLOADS and name not in METHODS:
            parser.error(f"unknown workload or method {name!r}")
    skip = {m: "skipped: --quick does not compile" for m in harness.COMPILED} if args.quick else {}

    start = time.perf_counter()
    results = harness.new_results(args.quick, settings)
    results["machine"].update(transformers=transformers.__version__, peft=peft.__version__)
    results["settings"].update(batch=B, tokens=T, vocab=VOCAB, min_length=MIN_LENGTH)
    results["targets"] = TARGETS
    for name in workloads:
        print(f"{name}:", flush=True)
        build, criterion, explicit_ids, forward = WORKLOADS[name]
        logs = {m: {} for m in methods}
        table = builders(criterion, explicit_ids, forward)
        table = {m: recorded(table[m], logs[m], settings["warmup"]) for m in methods}
        skipped = dict(skip)
        if name in NO_OPACUS:  # nor a batched loss: gpt2_full is its batched form
            skipped.update({m: "skipped: no per-example loss" for m in methods
                            if "opacus" in m or "batched" in m})  # fmt: skip
        info = harness.bench_workload(
            name, methods, skip=skipped, **settings, workloads={name: build}, builders=table
        )
        torch.manual_seed(harness.SEED)
        trained = {n: p for n, p in build()[0].named_parameters() if p.requires_grad}
        info["trainable_params"] = sum(p.numel() for p in trained.values())
        for method, log in logs.items():
            out = info["methods"][method]
            if log.get("error"):
                out["status"] = f"failed: {log['error']}"[:200]
                out["error"], out["traceback"] = log["error"], log["traceback"][-6000:]
            if log.get("warnings"):
                out["warnings"] = log["warnings"]
            if method.startswith(("dpfunc_ghost", "dpfunc_batched")) and log.get("train_step"):
                out["plan"] = ghost_plan(log.pop("train_step"), list(trained))
        results["workloads"][name] = info
    results["total_s"] = time.perf_counter() - start
    results["machine"]["load_average_at_end"] = os.getloadavg()
    if FRESH_CACHE:
        shutil.rmtree(FRESH_CACHE, ignore_errors=True)
    harness.write_results(results, Path(args.out), "hf", markdown(results))


if __name__ == "__main__":
    main()
