"""Per-example gradients before and after clipping, flat and per layer.

What it shows: every box of DP-SGD's data flow is a public function, so the
per-example gradients of one batch can be inspected at each stage:

    grads   = dpfunc.per_sample_grads(loss_fn, params, batch)    # leaves [B, ...]
    norms   = dpfunc.per_sample_norms(grads)                     # [B], flat norms
    factors = dpfunc.clip_factors(norms, clip_norm)              # [B], min(1, C / norm)
    clipped = grads scaled example by example by factors         # post-clip grads
    summed  = dpfunc.clipped_sum(grads, factors)                 # what the noise is added to

For one batch of the digits data (sklearn's ``load_digits``, 8x8 images, 10
classes) and a small untrained MLP, it prints a table with one row per
example: its loss, the flat gradient norm before clipping, the clip factor,
the norm after clipping, and the norm of each layer's part of the gradient
(``per_sample_norms(grads, groups_by_module(grads))``); then the fraction of
the batch that was clipped. A second table does the same for per-layer
clipping, where each layer's part is clipped separately to
``clip_norm / sqrt(num_layers)`` so that the whole example is still bounded by
``clip_norm``.

It also checks the two facts users ask about: ``grads[k][i]`` is exactly the
gradient of a batch-size-1 backward of example ``i`` (no rescaling by the
batch size), and ``clipped_sum`` equals the sum of the post-clip per-example
gradients. No training, no noise: it only prints (nothing is written, so
``--out`` is accepted for a uniform command line and ignored).

Run (a few seconds):

    python examples/inspect_clipping.py
    python examples/inspect_clipping.py --smoke   # the same, with a smaller batch
"""

from __future__ import annotations

import argparse
from collections import OrderedDict

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.func import functional_call

import dpfunc

# --- settings ---------------------------------------------------------------
BATCH_SIZE = 16  # examples in the inspected batch
SMOKE_BATCH_SIZE = 8  # --smoke: a smaller batch (the script is fast either way)
HIDDEN = 32  # hidden units of the MLP
CLIP_NORM = 2.0  # the clip norm C; near the median norm of this batch, so about half clip
SEED = 0  # fixes the initialisation and which examples form the batch


def main(smoke: bool) -> None:
    torch.manual_seed(SEED)
    batch_size = SMOKE_BATCH_SIZE if smoke else BATCH_SIZE

    # One batch of digits: pixels scaled to [0, 1], labels 0-9.
    digits = load_digits()
    rows = torch.randperm(len(digits.target))[:batch_size]
    x = torch.tensor(digits.data, dtype=torch.float32)[rows] / 16.0
    y = torch.tensor(digits.target)[rows]

    model = nn.Sequential(
        OrderedDict(fc1=nn.Linear(64, HIDDEN), act=nn.ReLU(), fc2=nn.Linear(HIDDEN, 10))
    )
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(params, example):
        """ONE example's cross-entropy; the module sees a batch of 1."""
        xi, yi = example
        logits = functional_call(model, (params, buffers), (xi.unsqueeze(0),))
        return F.cross_entropy(logits, yi.unsqueeze(0))

    # 1. Per-example gradients (each leaf [B, *param.shape]) and losses [B].
    grads, losses = dpfunc.per_sample_grads_and_losses(loss_fn, params, (x, y))
    print(f"batch of {batch_size}; parameters and per-example gradient shapes:")
    for name, g in grads.items():
        print(f"  {name:12s} {str(tuple(params[name].shape)):10s} -> {tuple(g.shape)}")

    # grads[k][i] is example i's own gradient: the same as a batch-size-1 backward.
    model.zero_grad()
    loss_fn(dict(model.named_parameters()), (x[0], y[0])).backward()
    same = all(torch.allclose(grads[k][0], p.grad, atol=1e-6) for k, p in model.named_parameters())
    print(f"grads[k][0] equals a batch-size-1 backward of example 0: {same}")

    # 2. Norms before clipping: flat (all parameters as one vector) and per layer.
    groups = dpfunc.groups_by_module(grads)  # {"fc1": ["fc1.weight", "fc1.bias"], "fc2": ...}
    norms = dpfunc.per_sample_norms(grads)  # [B], float64
    layer_norms = dpfunc.per_sample_norms(grads, groups)  # {"fc1": [B], "fc2": [B]}
    clip_norm = CLIP_NORM

    # 3. Flat clipping: factor_i = min(1, C / norm_i); post-clip gradient = factor_i * grad_i.
    factors = dpfunc.clip_factors(norms, clip_norm)

    def scale_examples(g: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        return g * f.to(g.dtype).view(-1, *[1] * (g.dim() - 1))  # f[i] times row i

    clipped = dpfunc.tree.tree_map(lambda g: scale_examples(g, factors), grads)
    clipped_norms = dpfunc.per_sample_norms(clipped)
    clipped_layer_norms = dpfunc.per_sample_norms(clipped, groups)

    print(f"\nFLAT clipping at clip_norm C = {clip_norm:.4f} (whole gradient of an example)")
    layer_columns = "".join(f"{g + ' before':>12s}{g + ' after':>11s}" for g in groups)
    print(
        f"{'ex':>3s} {'label':>5s} {'loss':>7s} {'norm before':>12s} {'factor':>7s} "
        f"{'norm after':>11s} {'clipped':>7s}{layer_columns}"
    )
    for i in range(batch_size):
        layers = "".join(
            f"{layer_norms[g][i]:12.4f}{clipped_layer_norms[g][i]:11.4f}" for g in groups
        )
        print(
            f"{i:3d} {int(y[i]):5d} {losses[i]:7.4f} {norms[i]:12.4f} {factors[i]:7.4f} "
            f"{clipped_norms[i]:11.4f} {'yes' if factors[i] < 1 else 'no':>7s}{layers}"
        )
    print(f"fraction clipped: {float((factors < 1).double().mean()):.3f}")
    print(f"largest norm after clipping: {float(clipped_norms.max()):.4f} <= C = {clip_norm:.4f}")

    # clipped_sum is the sum of the post-clip per-example gradients (it never
    # materialises them; padding rows, mask 0, would contribute exactly 0).
    summed = dpfunc.clipped_sum(grads, factors)
    agree = all(torch.allclose(summed[k], clipped[k].sum(0), atol=1e-6) for k in grads)
    print(f"clipped_sum(grads, factors) == sum over examples of the clipped grads: {agree}")

    # 4. Per-layer clipping: each layer's part is clipped to C_k = C / sqrt(num_layers)
    #    (or give clip_factors a dict {layer: C_k}); an example's whole norm stays <= C.
    layer_factors = dpfunc.clip_factors(layer_norms, clip_norm)  # {"fc1": [B], "fc2": [B]}
    thresholds = clip_norm / len(groups) ** 0.5
    per_param_factor = {name: layer_factors[g] for g, names in groups.items() for name in names}
    layer_clipped = {k: scale_examples(g, per_param_factor[k]) for k, g in grads.items()}
    after = dpfunc.per_sample_norms(layer_clipped, groups)
    total_after = dpfunc.per_sample_norms(layer_clipped)

    print(
        f"\nPER-LAYER clipping at C = {clip_norm:.4f}: each of {len(groups)} layers clipped to "
        f"C / sqrt({len(groups)}) = {thresholds:.4f}"
    )
    layer_columns = "".join(
        f"{g + ' before':>12s}{g + ' factor':>11s}{g + ' after':>11s}" for g in groups
    )
    print(f"{'ex':>3s}{layer_columns}{'total after':>13s}")
    for i in range(batch_size):
        layers = "".join(
            f"{layer_norms[g][i]:12.4f}{layer_factors[g][i]:11.4f}{after[g][i]:11.4f}"
            for g in groups
        )
        print(f"{i:3d}{layers}{total_after[i]:13.4f}")
    for g in groups:
        fraction = float((layer_factors[g] < 1).double().mean())
        print(f"fraction of examples whose {g} part was clipped: {fraction:.3f}")
    print(f"largest total norm after per-layer clipping: {float(total_after.max()):.4f} <= C")
    summed = dpfunc.clipped_sum(grads, layer_factors, groups=groups)
    agree = all(torch.allclose(summed[k], layer_clipped[k].sum(0), atol=1e-6) for k in grads)
    print(f"clipped_sum(grads, layer_factors, groups=groups) == sum of the clipped grads: {agree}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a smaller batch")
    parser.add_argument("--out", default="results", help="ignored: this script only prints")
    args = parser.parse_args()
    main(args.smoke)
