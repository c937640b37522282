"""The per-layer choice of a Linear weight's per-example norm: Gram matrices or the direct form.

Run from the repository root (a few minutes on 2 cores):

    .venv/bin/python bench/gram_direct.py          # writes bench/gram_direct.json and .md

For a Linear layer that sees ``T`` positions per example, with inputs ``a [B, T, d_in]``
and output gradients ``g [B, T, d_out]``, the norm of each example's weight gradient
``g_i^T a_i`` comes either from the ``T x T`` Gram matrices (``sum((a a^T) * (g g^T))``,
``2 B T^2 (d_in + d_out)`` multiply-adds' worth of flops, ``2 B T^2`` floats) or from
forming the gradient (``2 B T d_in d_out`` flops, ``B d_in d_out`` floats).
:func:`dpfunc.ghost.bounds.linear_weight_norms` computes both with their rounding bounds;
this script times each form (the fastest of ``REPEATS`` calls, alternating, after a
warm-up) at the widths of the suite's small models (128, 512) and of the models people
fine-tune (768, 3072 and Llama's 4096, 11008 where it fits), at T = 64 and T = 512, and
compares the measured winner with two rules:

- ``size`` (the planner's until 82dfbe5): Gram when ``T^2 < d_in d_out``, the Gram
  matrices smaller than the gradient;
- ``flops`` (the planner's now, :func:`dpfunc.ghost.bounds.gram_is_cheaper`): Gram when
  ``T (d_in + d_out) < d_in d_out``.

Eager, float32, torch's default threads. The table's ratio is direct over Gram (above 1:
Gram faster).

The last columns time each form with the clipped sum it leads to, as the ghost pass runs
them (:func:`dpfunc.ghost.runtime.ghost_clip`, every norm finite): Gram norms, then the
weighted rows' product (``form_sum``, ``2 B T d_in d_out`` flops again), against the formed
gradients (:func:`dpfunc.ghost.bounds.formed_where_cheaper`), their norms and their
weighted sum (``2 B d_in d_out`` flops), and compare the faster with the ghost pass's rule
(:func:`dpfunc.ghost.bounds.forming_is_cheaper`: formed when ``d_in d_out <= 2 T (d_in +
d_out)``, at most twice the rows' floats). Where that rule keeps rows, forming would hold
more than twice their floats: the time is what a memory budget could buy.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere
from dpfunc.ghost import bounds  # noqa: E402
from dpfunc.ghost.bounds import linear_weight_norms  # noqa: E402
from dpfunc.ghost.registry import Outer  # noqa: E402

# (B, T, d_in, d_out). The forms' flops are linear in B, their times not quite: the
# formed gradients, B d_in d_out floats, leave the caches sooner as B grows, so the
# small models' widths at T = 64 are timed at bench/hf.py's B = 32 too.
SHAPES = [
    (8, 64, 128, 128), (8, 64, 128, 512), (8, 64, 512, 128),
    (32, 64, 128, 128), (32, 64, 128, 512), (32, 64, 512, 128),
    (8, 64, 768, 768), (8, 64, 768, 3072), (8, 64, 3072, 768),
    (8, 512, 128, 128), (8, 512, 128, 512), (8, 512, 512, 128),
    (8, 512, 768, 768), (8, 512, 768, 3072), (8, 512, 3072, 768),
    (8, 512, 4096, 4096), (8, 512, 4096, 11008),
]  # fmt: skip
REPEATS = 5
DIRECT_LIMIT = 2**31  # bytes of the direct form's gradients past which it is not timed


def fastest(form: str, a, g) -> float:
    w = torch.full((a.shape[0],), 0.5)
    shape = torch.Size([g.shape[-1], a.shape[-1]])
    started = time.perf_counter()
    if form == "gram_sum":  # the rows kept: Gram norms, then the rows' weighted product
        linear_weight_norms(a, g, form="gram")
        bounds.form_sum(Outer(g, a), w, shape, finite=True)
    elif form == "formed_sum":  # formed once, for the norm and the sum
        formed = bounds.formed_where_cheaper(Outer(g, a), shape)
        if isinstance(formed, Outer):  # the rule keeps rows: form them anyway
            formed = torch.bmm(g.mT, a)
        bounds.formed_norms(formed)
        bounds.weighted_sum(formed, w, finite=True)
    else:
        linear_weight_norms(a, g, form=form)
    return time.perf_counter() - started


def measure(b: int, t: int, d_in: int, d_out: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(b, t, d_in, generator=gen)
    g = torch.randn(b, t, d_out, generator=gen)
    fits = 4 * b * d_in * d_out <= DIRECT_LIMIT
    forms = ["gram", "direct", "gram_sum", "formed_sum"] if fits else ["gram", "gram_sum"]
    times: dict[str, list[float]] = {f: [] for f in forms}
    for f in forms:  # warm-up
        fastest(f, a, g)
    for _ in range(REPEATS):
        for f in forms:
            times[f].append(fastest(f, a, g))
    row = {
        "B": b,
        "T": t,
        "d_in": d_in,
        "d_out": d_out,
        **{f"{f}_ms": min(v) * 1e3 for f, v in times.items()},
    }
    row["size_rule"] = "gram" if t * t < d_in * d_out else "direct"
    row["flops_rule"] = "gram" if t * (d_in + d_out) < d_in * d_out else "direct"
    row["forming_rule"] = "formed" if bounds.forming_is_cheaper(t, d_in, d_out) else "rows"
    if "direct_ms" in row:
        row["measured"] = "gram" if row["gram_ms"] < row["direct_ms"] else "direct"
        row["measured_sum"] = "formed" if row["formed_sum_ms"] < row["gram_sum_ms"] else "rows"
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "# Gram matrices against the direct form: a Linear weight's per-example norms",
        "",
        f"torch {torch.__version__}, python {platform.python_version()}, "
        f"{torch.get_num_threads()} torch threads, {cpu()}; float32, eager; the "
        f"fastest of {REPEATS} alternating calls of `dpfunc.ghost.bounds.linear_weight_norms` "
        "(rounding bounds included). Generated by `bench/gram_direct.py`.",
        "",
        "| B | T | d_in | d_out | Gram ms | direct ms | direct / Gram | faster | size rule "
        "(before) | flops rule (planner) | Gram + sum ms | formed + sum ms | formed / Gram | "
        "faster with the sum | forming rule (ghost pass) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- | ---: | ---: | ---: "
        "| --- | --- |",
    ]  # fmt: skip
    for r in rows:
        direct = r.get("direct_ms")
        ratio = f"{direct / r['gram_ms']:.2f}x" if direct else "-"
        cell = f"{direct:.2f}" if direct else "not timed (over 2 GiB)"

        measured = r.get("measured")
        size, flops = (
            rule + ("" if measured in (None, rule) else " (wrong)")
            for rule in (r["size_rule"], r["flops_rule"])
        )
        formed = r.get("formed_sum_ms")
        with_sum = f"{formed:.2f} | {formed / r['gram_sum_ms']:.2f}x" if formed else "- | -"
        faster = r.get("measured_sum")
        forming = r["forming_rule"] + ("" if faster in (None, r["forming_rule"]) else " (wrong)")
        lines.append(
            f"| {r['B']} | {r['T']} | {r['d_in']} | {r['d_out']} | {r['gram_ms']:.2f} | {cell} "
            f"| {ratio} | {measured or 'gram'} | {size} | {flops} | {r['gram_sum_ms']:.2f} "
            f"| {with_sum} | {faster or 'rows'} | {forming} |"
        )
    return "\n".join(lines) + "\n"


def cpu() -> str:
    """The processor's model name (Linux), or the platform's word for it."""
    try:
        with open("/proc/cpuinfo") as info:
            names = [
                line.split(":", 1)[1].strip() for line in info if line.startswith("model name")
            ]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or "unknown processor"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent))
    args = parser.parse_args()
    rows = []
    for shape in SHAPES:
        rows.append(measure(*shape))
        print(rows[-1], flush=True)
    Path(args.out, "gram_direct.json").write_text(json.dumps(rows, indent=1))
    Path(args.out, "gram_direct.md").write_text(table(rows))
    print(table(rows))


if __name__ == "__main__":
    main()
