"""Optimizers against torch.optim step by step, composition, compilation, validation."""

import math

import pytest
import torch
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

from dpfunc.optim import (
    AdamState,
    EmptyState,
    GradientTransformation,
    SgdState,
    adam,
    adamw,
    apply_updates,
    chain,
    scale,
    sgd,
    state_dtype,
)
from dpfunc.tree import tree_leaves, tree_map

SHAPES = {"layer.weight": (4, 3), "layer.bias": (4,), "temperature": (), "conv": (2, 1, 3, 3)}


def make_params(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g, dtype=dtype) for k, s in SHAPES.items()}


def make_grads(params, step, seed=100):
    g = torch.Generator().manual_seed(seed + step)
    return {k: torch.randn(p.shape, generator=g, dtype=p.dtype) for k, p in params.items()}


def clone(tree):
    return tree_map(torch.clone, tree)


def assert_trees_equal(a, b):
    for x, y in zip(tree_leaves(a), tree_leaves(b), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


ORACLES = [
    ("sgd plain", lambda: sgd(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    (
        "sgd momentum",
        lambda: sgd(lr=0.1, momentum=0.9),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    ),
    (
        "sgd dampening",
        lambda: sgd(lr=0.1, momentum=0.9, dampening=0.3),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.3),
    ),
    (
        "sgd nesterov",
        lambda: sgd(lr=0.1, momentum=0.8, nesterov=True),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.8, nesterov=True),
    ),
    (
        "sgd weight_decay",
        lambda: sgd(lr=0.1, momentum=0.5, weight_decay=0.05),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5, weight_decay=0.05),
    ),
    (
        "sgd weight_decay no momentum",
        lambda: sgd(lr=0.1, weight_decay=0.05),
        lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.05),
    ),
    ("adam", lambda: adam(lr=0.01), lambda p: torch.optim.Adam(p, lr=0.01)),
    (
        "adam betas eps",
        lambda: adam(lr=0.05, betas=(0.5, 0.99), eps=1e-3),
        lambda p: torch.optim.Adam(p, lr=0.05, betas=(0.5, 0.99), eps=1e-3),
    ),
    (
        "adam weight_decay",
        lambda: adam(lr=0.01, weight_decay=0.1),
        lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1),
    ),
    ("adamw", lambda: adamw(lr=0.01), lambda p: torch.optim.AdamW(p, lr=0.01)),
    (
        "adamw large decay",
        lambda: adamw(lr=0.05, betas=(0.8, 0.9), weight_decay=0.5),
        lambda p: torch.optim.AdamW(p, lr=0.05, betas=(0.8, 0.9), weight_decay=0.5),
    ),
]


@pytest.mark.parametrize("ours, theirs", [o[1:] for o in ORACLES], ids=[o[0] for o in ORACLES])
def test_matches_torch_optim_step_by_step_in_float64(ours, theirs):
    params = make_params()
    reference = {k: torch.nn.Parameter(p.clone()) for k, p in params.items()}
    torch_opt = theirs(list(reference.values()))
    opt = ours()
    state = opt.init(params)
    for step in range(6):
        grads = make_grads(params, step)
        updates, state = opt.update(grads, state, params)
        params = apply_updates(params, updates)
        for k, p in reference.items():
            p.grad = grads[k].clone()
        torch_opt.step()
        for k, p in reference.items():
            assert params[k].dtype == torch.float64
            torch.testing.assert_close(params[k], p.detach(), rtol=1e-6, atol=1e-12)
    for leaf in tree_leaves(state):
        assert leaf.dtype in (torch.float64, torch.int64)
    assert int(state.count) == 6


def test_state_layouts():
    params = make_params()
    sgd_state = sgd(lr=0.1, momentum=0.9).init(params)
    assert isinstance(sgd_state, SgdState)
    assert sgd_state.count.shape == () and sgd_state.count.dtype == torch.int64
    assert sgd_state.momentum.keys() == params.keys()
    assert all(torch.all(b == 0) for b in sgd_state.momentum.values())
    assert sgd(lr=0.1).init(params).momentum is None

    adam_state = adam().init(params)
    assert isinstance(adam_state, AdamState)
    assert adam_state.count.shape == () and adam_state.count.dtype == torch.int64
    for k, p in params.items():
        assert adam_state.exp_avg[k].shape == p.shape
        assert adam_state.exp_avg_sq[k].dtype == p.dtype


def test_first_momentum_step_takes_the_gradient_undamped():
    params = make_params()
    grads = make_grads(params, 0)
    opt = sgd(lr=0.5, momentum=0.9, dampening=0.6)
    updates, state = opt.update(grads, opt.init(params), params)
    for k in params:
        torch.testing.assert_close(state.momentum[k], grads[k], rtol=0, atol=0)
        torch.testing.assert_close(updates[k], -0.5 * grads[k], rtol=0, atol=0)


def test_scale_multiplies_and_is_stateless():
    params = make_params()
    grads = make_grads(params, 0)
    opt = scale(-3.0)
    state = opt.init(params)
    assert state == EmptyState()
    updates, new_state = opt.update(grads, state, params)
    assert new_state == EmptyState()
    for k in params:
        torch.testing.assert_close(updates[k], -3.0 * grads[k], rtol=0, atol=0)


def test_chain_of_scale_and_sgd_is_sgd_on_the_scaled_gradient():
    params = make_params()
    chained = chain(scale(2.0), sgd(lr=0.1, momentum=0.9, dampening=0.2))
    plain = sgd(lr=0.1, momentum=0.9, dampening=0.2)
    chained_state, plain_state = chained.init(params), plain.init(params)
    assert isinstance(chained_state, tuple) and len(chained_state) == 2
    assert chained_state[0] == EmptyState() and isinstance(chained_state[1], SgdState)
    p_chain, p_plain = params, params
    for step in range(4):
        grads = make_grads(params, step)
        u, chained_state = chained.update(grads, chained_state, p_chain)
        p_chain = apply_updates(p_chain, u)
        doubled = tree_map(lambda g: 2.0 * g, grads)
        v, plain_state = plain.update(doubled, plain_state, p_plain)
        p_plain = apply_updates(p_plain, v)
        for k in params:
            torch.testing.assert_close(p_chain[k], p_plain[k], rtol=1e-12, atol=0)
    assert int(chained_state[1].count) == 4


def test_chain_applies_transforms_in_order():
    params = make_params()
    grads = make_grads(params, 0)
    # adam is not linear in its input, so scaling before or after differs
    before = chain(scale(10.0), adam(lr=0.1))
    after = chain(adam(lr=0.1), scale(10.0))
    u_before, _ = before.update(grads, before.init(params), params)
    u_after, _ = after.update(grads, after.init(params), params)
    u_adam, _ = adam(lr=0.1).update(grads, adam(lr=0.1).init(params), params)
    for k in params:
        torch.testing.assert_close(u_after[k], 10.0 * u_adam[k], rtol=1e-12, atol=0)
        # Adam's first step is scale-invariant up to eps: it ignores the 10x in front
        torch.testing.assert_close(u_before[k], u_adam[k], rtol=1e-6, atol=0)


def test_empty_chain_is_identity():
    params = make_params()
    grads = make_grads(params, 0)
    opt = chain()
    state = opt.init(params)
    assert state == ()
    updates, state = opt.update(grads, state, params)
    assert_trees_equal(updates, grads)


@pytest.mark.parametrize("bad", [sgd, "sgd", (lambda p: p, lambda u, s, p: (u, s)), None])
def test_chain_rejects_non_transforms(bad):
    with pytest.raises(TypeError, match="GradientTransformation"):
        chain(scale(1.0), bad)


def test_apply_updates_adds_and_returns_new_tensors():
    params = make_params()
    updates = make_grads(params, 0)
    before = clone(params)
    new = apply_updates(params, updates)
    for k in params:
        torch.testing.assert_close(new[k], before[k] + updates[k], rtol=0, atol=0)
        assert new[k] is not params[k]
    assert_trees_equal(params, before)


def test_apply_updates_rejects_mismatched_trees():
    params = make_params()
    updates = make_grads(params, 0)
    del updates["temperature"]
    with pytest.raises(ValueError, match="updates"):
        apply_updates(params, updates)
    with pytest.raises(ValueError, match="shape"):
        apply_updates(params, {**make_grads(params, 0), "layer.bias": torch.zeros(5)})


@pytest.mark.parametrize(
    "opt",
    [
        sgd(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.1),
        sgd(lr=0.1, momentum=0.9, nesterov=True),
        adam(lr=0.1, weight_decay=0.1),
        adamw(lr=0.1, weight_decay=0.1),
        chain(scale(2.0), sgd(lr=0.1, weight_decay=0.1)),
    ],
    ids=["sgd", "nesterov", "adam", "adamw", "chain"],
)
def test_update_does_not_modify_inputs(opt):
    params = make_params()
    state = opt.init(params)
    for step in range(2):  # the second step reads non-zero state
        grads = make_grads(params, step)
        copies = clone((grads, state, params))
        updates, new_state = opt.update(grads, state, params)
        assert_trees_equal((grads, state, params), copies)
        params, state = apply_updates(params, updates), new_state


@pytest.mark.parametrize(
    "factory, kwargs, name",
    [
        (sgd, dict(lr=0.0), "lr"),
        (sgd, dict(lr=-0.1), "lr"),
        (sgd, dict(lr=math.nan), "lr"),
        (sgd, dict(lr=math.inf), "lr"),
        (sgd, dict(lr="0.1"), "lr"),
        (sgd, dict(lr=0.1, momentum=1.0), "momentum"),
        (sgd, dict(lr=0.1, momentum=-0.1), "momentum"),
        (sgd, dict(lr=0.1, momentum=0.9, dampening=1.5), "dampening"),
        (sgd, dict(lr=0.1, weight_decay=-1e-4), "weight_decay"),
        (sgd, dict(lr=0.1, nesterov=True), "nesterov"),
        (sgd, dict(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), "nesterov"),
        (sgd, dict(lr=0.1, momentum=0.9, nesterov=1), "nesterov"),
        (adam, dict(lr=0.0), "lr"),
        (adam, dict(betas=(1.0, 0.999)), "betas"),
        (adam, dict(betas=(0.9, -0.5)), "betas"),
        (adam, dict(betas=(0.9,)), "betas"),
        (adam, dict(eps=0.0), "eps"),
        (adam, dict(weight_decay=-0.1), "weight_decay"),
        (adamw, dict(lr=-1.0), "lr"),
        (adamw, dict(betas=(0.9, 1.0)), "betas"),
        (adamw, dict(eps=-1e-8), "eps"),
        (adamw, dict(weight_decay=math.nan), "weight_decay"),
        (scale, dict(factor=math.inf), "factor"),
    ],
)
def test_invalid_hyperparameters_raise_value_error_naming_the_argument(factory, kwargs, name):
    with pytest.raises(ValueError, match=name):
        factory(**kwargs)


@pytest.mark.parametrize("factory", [sgd, adam])
def test_weight_decay_without_params_raises(factory):
    params = make_params()
    opt = factory(lr=0.1, weight_decay=0.1)
    with pytest.raises(ValueError, match="params"):
        opt.update(make_grads(params, 0), opt.init(params), None)


def test_valid_edge_hyperparameters_are_accepted():
    assert isinstance(sgd(lr=1e-12, momentum=0.0, dampening=1.0), GradientTransformation)
    assert isinstance(adam(betas=(0.0, 0.0)), GradientTransformation)
    assert isinstance(adamw(weight_decay=0.0), GradientTransformation)
    assert isinstance(scale(0.0), GradientTransformation)


def run_compiled_and_eager(opt, backend, steps=3):
    """Runs ``steps`` updates eagerly and through ``torch.compile``; returns both final results."""

    def train(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return apply_updates(params, updates), state

    compiled = torch.compile(train, backend=backend, fullgraph=True)
    params = make_params()
    eager, comp = (params, opt.init(params)), (params, opt.init(params))
    frames_after_first_step = None
    for step in range(steps):
        grads = make_grads(params, step)
        eager = train(*eager, grads)
        comp = compiled(*comp, grads)
        if frames_after_first_step is None:
            frames_after_first_step = backend.frame_count
    return eager, comp, frames_after_first_step


def assert_close_trees(a, b, rtol, atol):
    for x, y in zip(tree_leaves(a), tree_leaves(b), strict=True):
        assert x.dtype == y.dtype
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "opt",
    [
        chain(scale(0.5), sgd(lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.01)),
        adamw(lr=0.05, weight_decay=0.1),
    ],
    ids=["chain-sgd", "adamw"],
)
def test_compiled_update_equals_eager_and_compiles_once(opt):
    torch._dynamo.reset()
    counter = CompileCounter()
    eager, comp, _ = run_compiled_and_eager(opt, counter)
    assert_close_trees(comp, eager, rtol=1e-12, atol=1e-14)
    assert counter.frame_count == 1


def test_inductor_update_equals_eager_without_recompiling():
    torch._dynamo.reset()
    # inductor may restart its first analysis (counted as a frame), so count recompiles instead
    counter = CompileCounterWithBackend("inductor")
    opt = chain(scale(0.5), sgd(lr=0.1, momentum=0.9, dampening=0.2), adam(lr=0.05))
    eager, comp, first = run_compiled_and_eager(opt, counter)
    assert_close_trees(comp, eager, rtol=1e-12, atol=1e-14)
    assert counter.frame_count == first


# --- half precision: float32 state, one rounding, no NaN from a zero gradient -------------

HALF_ORACLES = [
    (
        "sgd momentum",
        lambda: sgd(lr=0.01, momentum=0.9),
        lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
    ),
    (
        "sgd nesterov weight_decay",
        lambda: sgd(lr=0.01, momentum=0.9, nesterov=True, weight_decay=0.1),
        lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, nesterov=True, weight_decay=0.1),
    ),
    ("adam", lambda: adam(lr=1e-3), lambda p: torch.optim.Adam(p, lr=1e-3)),
    (
        "adam weight_decay",
        lambda: adam(lr=1e-3, weight_decay=0.1),
        lambda p: torch.optim.Adam(p, lr=1e-3, weight_decay=0.1),
    ),
    ("adamw", lambda: adamw(lr=1e-3), lambda p: torch.optim.AdamW(p, lr=1e-3)),
]
HALF_SHAPES = {"weight": (64, 32), "bias": (64,)}


def sparse_grads(step, dtype, seed=7):
    """Gradients with about 60% exact zeros, and a first row that is 0 at every step."""
    g = torch.Generator().manual_seed(seed + step)
    grads = {}
    for k, shape in HALF_SHAPES.items():
        values = torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) < 0.4)
        values[0] = 0.0
        grads[k] = values.to(dtype)
    return grads


def half_params(dtype):
    g = torch.Generator().manual_seed(3)
    return {k: torch.randn(s, generator=g).to(dtype) for k, s in HALF_SHAPES.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name, ours, theirs", HALF_ORACLES, ids=[o[0] for o in HALF_ORACLES])
def test_half_parameters_keep_float32_state_and_updates_match_torch_optim_in_float32(
    name, ours, theirs, dtype
):
    # the oracle: torch.optim on a copy of our parameters at every step, its state carried
    # along, so each of our float32 updates has its counterpart; in float64, so that the
    # update can be read off as the difference of the parameters
    params = half_params(dtype)
    start = clone(params)
    reference = {k: torch.nn.Parameter(p.double()) for k, p in params.items()}
    torch_opt = theirs(list(reference.values()))
    opt = ours()
    state = opt.init(params)
    for step in range(20):
        grads = sparse_grads(step, dtype)
        updates, state = opt.update(grads, state, params)
        with torch.no_grad():
            for k, p in reference.items():
                p.copy_(params[k].double())
                p.grad = grads[k].double()
        torch_opt.step()
        for k, u in updates.items():
            assert u.dtype == torch.float32
            want = (reference[k].detach() - params[k].double()).float()
            atol = 1e-5 * float(want.abs().max())  # float32 rounds the terms, not the result
            torch.testing.assert_close(u, want, rtol=1e-5, atol=atol, msg=f"{name} {k} {step}")
        previous, params = params, apply_updates(params, updates)
        for k, p in params.items():
            assert p.dtype == dtype and torch.isfinite(p).all(), (name, k, step)
            want = (previous[k].double() + updates[k].double()).to(dtype)  # rounded once
            torch.testing.assert_close(p, want, rtol=0, atol=0)
    for leaf in tree_leaves(state):
        assert leaf.dtype in (torch.float32, torch.int64)
    if "weight_decay" not in name and "adamw" not in name:
        for k in params:  # a gradient that is 0 at every step moves nothing
            assert torch.equal(params[k][0], start[k][0])


@pytest.mark.parametrize("name, ours, theirs", HALF_ORACLES, ids=[o[0] for o in HALF_ORACLES])
def test_bf16_parameters_move_as_with_torch_optim(name, ours, theirs):
    params = half_params(torch.bfloat16)
    start = clone(params)
    reference = {k: torch.nn.Parameter(p.clone()) for k, p in params.items()}
    torch_opt = theirs(list(reference.values()))
    opt = ours()
    state = opt.init(params)
    for step in range(20):
        grads = sparse_grads(step, torch.bfloat16)
        updates, state = opt.update(grads, state, params)
        params = apply_updates(params, updates)
        for k, p in reference.items():
            p.grad = grads[k].clone()
        torch_opt.step()
    assert all(torch.isfinite(p).all() for p in params.values())
    moved = sum(int((params[k] != start[k]).sum()) for k in params)
    theirs_moved = sum(int((reference[k].detach() != start[k]).sum()) for k in params)
    # an entry whose total update sits at half a bf16 step rounds either way, and the two
    # round their sums in different orders: at most 1% of the entries may differ
    assert moved >= 0.99 * theirs_moved > 0, (name, moved, theirs_moved)


def test_apply_updates_rounds_a_wider_update_once_to_the_parameter_dtype():
    p = {"w": torch.tensor([1.0, 1.0, 256.0], dtype=torch.bfloat16)}
    u = {"w": torch.tensor([2.0**-9 + 2.0**-12, -(2.0**-10), 0.75], dtype=torch.float32)}
    got = apply_updates(p, u)["w"]
    assert got.dtype == torch.bfloat16
    want = (p["w"].double() + u["w"].double()).to(torch.bfloat16)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # float64 updates to float32 parameters leave them float32
    q = apply_updates({"w": torch.ones(2)}, {"w": torch.ones(2, dtype=torch.float64)})
    assert q["w"].dtype == torch.float32


# --- learning-rate schedules and the rate of the next update --------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "make",
    [
        lambda lr: sgd(lr, momentum=0.9, nesterov=True, weight_decay=0.01),
        lambda lr: sgd(lr),
        lambda lr: adam(lr, weight_decay=0.1),
        lambda lr: adamw(lr, weight_decay=0.1),
    ],
    ids=["sgd nesterov", "sgd plain", "adam", "adamw"],
)
def test_a_constant_schedule_moves_the_parameters_bit_for_bit_as_the_float_rate(make, dtype):
    from dpfunc.schedules import constant

    params = tree_map(lambda p: p.to(dtype), make_params())
    runs = []
    for opt in (make(0.05), make(constant(0.05)), make(lambda count: 0.05)):
        p, state = params, opt.init(params)
        for step in range(5):
            updates, state = opt.update(make_grads(p, step), state, p)
            p = apply_updates(p, updates)
        runs.append((p, state))
    assert_trees_equal(runs[1], runs[0])
    assert_trees_equal(runs[2], runs[0])
    assert all(leaf.dtype in (state_dtype(dtype), torch.int64) for leaf in tree_leaves(runs[1][1]))


def test_learning_rate_reads_the_rate_of_the_next_update():
    from dpfunc.optim import learning_rate
    from dpfunc.schedules import piecewise_constant

    params = make_params()
    schedule = piecewise_constant([1, 2], [0.3, 0.2, 0.1])
    for opt in (sgd(schedule, momentum=0.5), adam(schedule), chain(scale(2.0), adamw(schedule))):
        state = opt.init(params)
        for step, want in enumerate([0.3, 0.2, 0.1, 0.1]):
            assert learning_rate(opt, state) == want
            _, state = opt.update(make_grads(params, step), state, params)
    assert learning_rate(adamw(lr=0.01), adamw(lr=0.01).init(params)) == 0.01
    assert learning_rate(chain(sgd(0.1), adam(0.2)), chain(sgd(0.1), adam(0.2)).init(params)) == 0.1
    assert learning_rate(scale(-0.1), EmptyState()) is None
    assert learning_rate(chain(scale(2.0), scale(0.5)), (EmptyState(), EmptyState())) is None
    assert learning_rate(chain(), ()) is None
    with pytest.raises(TypeError, match="GradientTransformation"):
        learning_rate((sgd(0.1).init, sgd(0.1).update), None)


def test_a_transformation_of_two_fields_has_no_learning_rate():
    opt = sgd(lr=0.1)
    bare = GradientTransformation(opt.init, opt.update)
    assert bare.learning_rate is None and bare.init is opt.init
    init, update, rate = opt
    assert rate(opt.init(make_params())) == 0.1
