"""nn.EmbeddingBag's ghost rule against a float64 batch-size-1 autograd loop."""

import math

import pytest
import torch
from torch import nn
from torch.func import functional_call

import dpfunc
from dpfunc.ghost import GhostClipper, analyse

B = 6
CALLS = {
    # one example: fixed-size bags [bags, L] (a single bag: x.unsqueeze(0))
    "2d": lambda call, ex: call(ex["idx"], per_sample_weights=ex.get("w")),
    "one_bag": lambda call, ex: call(
        ex["idx"].unsqueeze(0), per_sample_weights=ex["w"].unsqueeze(0) if "w" in ex else None
    ),
    # one example: a 1-D index list cut into bags by offsets
    "offsets": lambda call, ex: call(ex["idx"], ex["offsets"], per_sample_weights=ex.get("w")),
}


class Model(nn.Module):
    """An EmbeddingBag and a head, so the loss weighs every bag and coordinate differently."""

    def __init__(self, call, **kw):
        super().__init__()
        self.bag = nn.EmbeddingBag(9, 3, **kw)
        self.head = nn.Linear(3, 2)
        self.call = call

    def forward(self, ex):
        out = self.call(self.bag, ex)  # [bags, 3]
        return self.head(torch.tanh(out)).pow(2).sum() + out.sum()


def batch_for(kind, weighted, padding):
    """Repeated indices within a bag and across bags, padding entries, an empty bag."""
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, 9, (B, 8), generator=g)
    idx[:, 1] = idx[:, 0]  # a repeat within the first bag
    idx[:, 6] = idx[:, 0]  # the same row in another bag
    if padding:
        idx[:, 3] = 0
        idx[0, :4] = 0  # a bag of padding only
    ex = {"idx": idx}
    if kind == "2d":
        ex["idx"] = idx.reshape(B, 2, 4)
    if kind == "offsets":  # bags [0, 3), [3, 3) (empty), [3, 8)
        ex["offsets"] = torch.tensor([0, 3, 3]).expand(B, 3)
    if weighted:
        ex["w"] = torch.randn(B, *ex["idx"].shape[1:], generator=g, dtype=torch.float64)
    return ex


def oracle(model, params, batch, clip_norm):
    """The clipped sum and norms from one float64 backward per example."""
    summed = {k: torch.zeros_like(v) for k, v in params.items()}
    norms = []
    for i in range(B):
        p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        ex = {k: v[i] for k, v in batch.items()}
        grads = torch.autograd.grad(functional_call(model, p, (ex,)), list(p.values()))
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        factor = min(1.0, clip_norm / norm.item())
        for k, g in zip(p, grads):
            summed[k] += factor * g
        norms.append(norm)
    return summed, torch.stack(norms)


def ghost_clip(model, batch, method="ghost", clip_norm=None):
    """``(plan, summed, norms, oracle_summed, oracle_norms)`` of one no-noise step."""
    model.double()
    params, _ = dpfunc.functionalize(model)

    def loss_fn(p, ex):
        return functional_call(model, p, (ex,))

    if clip_norm is None:  # between the middle norms: some examples clipped, some not
        norms = oracle(model, params, batch, math.inf)[1].sort().values
        clip_norm = norms[B // 2 - 1 : B // 2 + 1].mean().item()
    plan = GhostClipper(model, loss_fn, method).plan(params, batch)
    args = dict(clip_norm=clip_norm, noise_multiplier=0.0, expected_batch_size=B)
    step = dpfunc.make_train_step(
        loss_fn, dpfunc.optim.sgd(lr=1.0), model=model, method=method, **args
    )
    got, stats = step.clip(params, batch, torch.ones(B))
    want, want_norms = oracle(model, params, batch, clip_norm)
    return plan, got, stats, want, want_norms


def assert_matches(got, stats, want, want_norms):
    # the step's norms carry a rounding margin (about 1e-10 relative in float64), so its
    # clip factors are a hair below the loop's
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-7, atol=1e-10, msg=k)
    torch.testing.assert_close(stats.norm, want_norms, rtol=1e-8, atol=1e-12)
    assert stats.scaled.any() and not stats.scaled.all()  # clipped and unclipped examples


@pytest.mark.parametrize(
    "kind, mode, weighted, padding",
    [
        ("2d", "sum", False, False),
        ("2d", "sum", True, True),
        ("2d", "mean", False, True),
        ("one_bag", "sum", True, False),
        ("one_bag", "mean", False, False),
        ("offsets", "sum", False, True),
        ("offsets", "sum", True, False),
        ("offsets", "mean", False, True),
    ],
)
def test_ghost_clipped_sum_equals_a_float64_loop(kind, mode, weighted, padding):
    torch.manual_seed(0)
    kw = dict(mode=mode, padding_idx=0 if padding else None)
    model = Model(CALLS[kind], **kw)
    plan, got, stats, want, want_norms = ghost_clip(model, batch_for(kind, weighted, padding))
    assert [m.path for m in plan.modules] == ["bag", "head"] and not plan.reasons
    assert_matches(got, stats, want, want_norms)


@pytest.mark.parametrize("kind, padding", [("2d", True), ("offsets", True), ("one_bag", False)])
def test_max_mode_sends_each_coordinate_to_the_first_maximum_as_torch_does(kind, padding):
    torch.manual_seed(4)
    model = Model(CALLS[kind], mode="max", padding_idx=0 if padding else None)
    with torch.no_grad():  # ties between different rows: 5 equals 4, 6 equals 4 in one coordinate
        model.bag.weight[5] = model.bag.weight[4]
        model.bag.weight[6, 1] = model.bag.weight[4, 1]
    batch = batch_for(kind, False, padding)
    flat = batch["idx"].reshape(B, 8)
    flat[:, 2], flat[:, 4], flat[:, 5], flat[:, 7] = 5, 6, 4, 4  # ties in both orders
    batch["idx"] = flat.reshape(batch["idx"].shape)
    plan, got, stats, want, want_norms = ghost_clip(model, batch)
    assert [m.path for m in plan.modules] == ["bag", "head"] and not plan.reasons
    assert_matches(got, stats, want, want_norms)


def test_include_last_offset_and_offsets_by_keyword():
    torch.manual_seed(1)
    call = lambda bag, ex: bag(input=ex["idx"], offsets=ex["offsets"])  # noqa: E731
    model = Model(call, include_last_offset=True)
    batch = {"idx": torch.randint(0, 9, (B, 7)), "offsets": torch.tensor([0, 2, 5, 7]).expand(B, 4)}
    plan, got, stats, want, want_norms = ghost_clip(model, batch)
    assert [m.path for m in plan.modules] == ["bag", "head"]
    assert_matches(got, stats, want, want_norms)


@pytest.mark.parametrize(
    "kw, why",
    [
        (dict(scale_grad_by_freq=True), "scale_grad_by_freq has no ghost rule"),
    ],
)
def test_refused_configurations_fall_back_with_their_reason(kw, why):
    torch.manual_seed(2)
    model = Model(CALLS["2d"], **kw)
    batch = batch_for("2d", False, False)
    with pytest.warns(UserWarning, match=why):
        plan, got, stats, want, want_norms = ghost_clip(model, batch)
    assert [m.path for m in plan.modules] == ["head"]
    assert_matches(got, stats, want, want_norms)


@pytest.mark.parametrize(
    "kw, why",
    [
        (dict(max_norm=1.0), "max_norm renormalises its weight in place"),
        (dict(sparse=True), "sparse EmbeddingBag has no ghost rule"),
    ],
)
def test_configurations_vmap_cannot_run_either_are_refused_when_planned(kw, why):
    model = Model(CALLS["2d"], **kw).double()
    # (functionalize refuses max_norm outright; the rule's own reason is checked here)
    params = {name: p.detach() for name, p in model.named_parameters()}
    loss_fn = lambda p, ex: functional_call(model, p, (ex,))  # noqa: E731
    batch = batch_for("2d", False, False)
    with pytest.warns(UserWarning, match=why):
        plan = GhostClipper(model, loss_fn, "ghost").plan(params, batch)
    assert [m.path for m in plan.modules] == ["head"]


def test_auto_ghosts_small_bags_and_leaves_large_ones_to_vmap():
    torch.manual_seed(3)
    model = Model(CALLS["offsets"], mode="sum").double()
    params, _ = dpfunc.functionalize(model)
    loss_fn = lambda p, ex: functional_call(model, p, (ex,))  # noqa: E731
    batch = batch_for("offsets", True, False)
    example = {k: v[0] for k, v in batch.items()}
    clipper = GhostClipper(model, loss_fn, "auto")
    auto = analyse(model, clipper.hooks, loss_fn, params, example, "auto")  # the cost model
    assert "bag" in [m.path for m in auto.modules]  # 8 positions: 8^2 < 16 * 9
    # the step keeps whichever path it measured faster at plan time: either must be right
    _, got, stats, want, want_norms = ghost_clip(model, batch, method="auto")
    assert_matches(got, stats, want, want_norms)
    small = Model(CALLS["offsets"])
    small.bag = nn.EmbeddingBag(2, 3, mode="sum")  # 8 positions: 8^2 > 16 * 2, materialise
    small.double()
    params, _ = dpfunc.functionalize(small)
    loss_fn = lambda p, ex: functional_call(small, p, (ex,))  # noqa: E731
    batch["idx"] = batch["idx"] % 2
    auto = analyse(small, GhostClipper(small, loss_fn, "auto").hooks, loss_fn, params,
                   {k: v[0] for k, v in batch.items()}, "auto")  # fmt: skip
    assert "bag" not in [m.path for m in auto.modules]
