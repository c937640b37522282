"""Learning-rate schedules against torch.optim.lr_scheduler, in optimizers, compiled, validated."""

import math

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.optim import lr_scheduler

from dpfunc import optim, schedules
from dpfunc.optim import adamw, apply_updates, sgd
from dpfunc.tree import tree_leaves

LR = 0.1
STEPS = 50

# (name, our schedule, torch's scheduler for an optimizer whose lr is LR); torch's rates
# are compared for update numbers 0 .. STEPS - 1
ORACLES = [
    ("constant", lambda: schedules.constant(LR), lambda o: lr_scheduler.LambdaLR(o, lambda k: 1.0)),
    (
        "linear_warmup",
        lambda: schedules.linear_warmup(LR, 10),
        lambda o: lr_scheduler.LinearLR(o, total_iters=10),
    ),
    (
        "linear_warmup start_factor",
        lambda: schedules.linear_warmup(LR, 7, start_factor=0.05),
        lambda o: lr_scheduler.LinearLR(o, start_factor=0.05, total_iters=7),
    ),
    (
        "cosine_decay",
        lambda: schedules.cosine_decay(LR, STEPS - 1),
        lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=STEPS - 1),
    ),
    (
        "cosine_decay final_lr",
        lambda: schedules.cosine_decay(LR, STEPS, final_lr=0.01),
        lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=STEPS, eta_min=0.01),
    ),
    (
        "warmup_cosine",
        lambda: schedules.warmup_cosine(LR, 8, STEPS - 1, start_factor=0.1, final_lr=0.002),
        lambda o: lr_scheduler.SequentialLR(
            o,
            [
                lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=8),
                lr_scheduler.CosineAnnealingLR(o, T_max=STEPS - 1 - 8, eta_min=0.002),
            ],
            milestones=[8],
        ),
    ),
    (
        "step_decay",
        lambda: schedules.step_decay(LR, 7, gamma=0.5),
        lambda o: lr_scheduler.StepLR(o, step_size=7, gamma=0.5),
    ),
    (
        "piecewise_constant as MultiStepLR",
        lambda: schedules.piecewise_constant([5, 20, 21], [LR * 0.3**j for j in range(4)]),
        lambda o: lr_scheduler.MultiStepLR(o, milestones=[5, 20, 21], gamma=0.3),
    ),
    (
        "piecewise_constant as ConstantLR",
        lambda: schedules.piecewise_constant([12], [0.25 * LR, LR]),
        lambda o: lr_scheduler.ConstantLR(o, factor=0.25, total_iters=12),
    ),
    (
        "a callable of our own as ExponentialLR",
        lambda: lambda count: LR * 0.93 ** count.double(),
        lambda o: lr_scheduler.ExponentialLR(o, gamma=0.93),
    ),
]
IDS = [o[0] for o in ORACLES]


def torch_rates(make_scheduler, steps=STEPS):
    """The rate torch.optim applies at update 0, 1, ...: scheduler.step() after optimizer.step()."""
    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    opt = torch.optim.SGD([p], lr=LR)
    scheduler = make_scheduler(opt)
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        p.grad = torch.ones_like(p)
        opt.step()
        scheduler.step()
    return torch.tensor(rates, dtype=torch.float64)


@pytest.mark.parametrize("ours, theirs", [o[1:] for o in ORACLES], ids=IDS)
def test_each_schedule_gives_the_rate_of_its_torch_scheduler(ours, theirs):
    schedule = ours()
    want = torch_rates(theirs)
    from_tensor = torch.stack(
        [schedule(torch.tensor(k, dtype=torch.int64)) for k in range(STEPS)]
    ).to(torch.float64)
    torch.testing.assert_close(from_tensor, want, rtol=1e-12, atol=1e-15)
    assert want.min() < want.max() or "constant" in repr(schedule)  # the oracle moves
    if isinstance(schedule, schedules.Schedule):
        rates = [schedule(k) for k in range(STEPS)]
        assert all(type(r) is float for r in rates)
        assert rates == from_tensor.tolist()  # an int and a tensor count give the same rate
        one = schedule(torch.tensor(3, dtype=torch.int64))
        assert one.shape == () and one.dtype == torch.float64


def test_decays_hold_their_final_rate_where_torch_cosine_climbs_back():
    cosine = schedules.cosine_decay(LR, 10, final_lr=0.01)
    warm = schedules.warmup_cosine(LR, 3, 13, final_lr=0.01)
    for k in (10, 11, 25, 10**6):
        assert cosine(k) == pytest.approx(0.01, rel=1e-15, abs=0)
        assert warm(k + 3) == pytest.approx(0.01, rel=1e-15, abs=0)
    # torch's CosineAnnealingLR is periodic: past T_max its rate rises again
    assert torch_rates(lambda o: lr_scheduler.CosineAnnealingLR(o, 10, 0.01), 15)[14] > 0.02
    assert schedules.warmup_cosine(LR, 0, 10)(4) == schedules.cosine_decay(LR, 10)(4)
    assert schedules.linear_warmup(LR, 4, start_factor=0.0)(0) == 0.0


SHAPES = {"w": (5, 3), "b": (5,)}


def trajectory(make_ours, make_theirs, make_scheduler, steps=30):
    """Parameters after each of ``steps`` updates, ours and torch.optim's, in float64."""
    g = torch.Generator().manual_seed(0)
    params = {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in SHAPES.items()}
    reference = {k: torch.nn.Parameter(p.clone()) for k, p in params.items()}
    torch_opt = make_theirs(list(reference.values()))
    scheduler = make_scheduler(torch_opt)
    opt = make_ours()
    state = opt.init(params)
    for _ in range(steps):
        grads = {k: torch.randn(p.shape, generator=g, dtype=p.dtype) for k, p in params.items()}
        assert optim.learning_rate(opt, state) == pytest.approx(
            torch_opt.param_groups[0]["lr"], rel=1e-12
        )
        updates, state = opt.update(grads, state, params)
        params = apply_updates(params, updates)
        for k, p in reference.items():
            p.grad = grads[k].clone()
        torch_opt.step()
        scheduler.step()
        for k, p in reference.items():
            torch.testing.assert_close(params[k], p.detach(), rtol=1e-10, atol=1e-12)


def test_sgd_with_momentum_and_warmup_cosine_follows_torch_optim_and_its_scheduler():
    trajectory(
        lambda: sgd(
            schedules.warmup_cosine(0.05, 5, 30, start_factor=0.2), momentum=0.9, nesterov=True
        ),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
        lambda o: lr_scheduler.SequentialLR(
            o,
            [
                lr_scheduler.LinearLR(o, start_factor=0.2, total_iters=5),
                lr_scheduler.CosineAnnealingLR(o, T_max=25),
            ],
            milestones=[5],
        ),
    )


def test_adamw_decays_with_the_scheduled_rate_as_torch_optim_does():
    trajectory(
        lambda: adamw(schedules.step_decay(0.05, 4, gamma=0.5), weight_decay=0.3),
        lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.3),
        lambda o: lr_scheduler.StepLR(o, step_size=4, gamma=0.5),
    )


def test_adamw_with_zero_gradients_shrinks_the_parameters_by_the_scheduled_rate():
    schedule = schedules.piecewise_constant([2], [0.1, 0.02])
    opt = adamw(schedule, weight_decay=0.5)
    params = {"w": torch.tensor([1.0, -2.0], dtype=torch.float64)}
    state = opt.init(params)
    for k in range(4):
        updates, state = opt.update({"w": torch.zeros(2, dtype=torch.float64)}, state, params)
        torch.testing.assert_close(updates["w"], -schedule(k) * 0.5 * params["w"])


def test_a_compiled_update_with_a_schedule_compiles_once_and_equals_eager():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    opt = adamw(schedules.warmup_cosine(0.1, 2, 5, start_factor=0.25), weight_decay=0.1)

    def train(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return apply_updates(params, updates), state

    compiled = torch.compile(train, backend=counter, fullgraph=True)
    g = torch.Generator().manual_seed(1)
    params = {"w": torch.randn(3, 2, generator=g, dtype=torch.float64)}
    eager = comp = (params, opt.init(params))
    rates, frames = [], []
    for _ in range(5):
        grads = {"w": torch.randn(3, 2, generator=g, dtype=torch.float64)}
        rates.append(optim.learning_rate(opt, comp[1]))
        eager = train(*eager, grads)
        comp = compiled(*comp, grads)
        frames.append(counter.frame_count)
    assert len(set(rates)) == 5  # five different rates ...
    assert frames[-1] == frames[0] >= 1  # ... and no recompile after the first call
    for x, y in zip(tree_leaves(comp), tree_leaves(eager), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: schedules.constant(0.0), "lr must be a finite number > 0, got lr=0.0"),
        (lambda: schedules.constant(math.inf), "lr=inf"),
        (lambda: schedules.constant("0.1"), "lr='0.1'"),
        (lambda: schedules.linear_warmup(0.1, 0), "warmup_steps must be an int >= 1"),
        (lambda: schedules.linear_warmup(0.1, 2.5), "warmup_steps=2.5"),
        (lambda: schedules.linear_warmup(0.1, 5, start_factor=1.5), "start_factor=1.5"),
        (lambda: schedules.linear_warmup(0.1, 5, start_factor=-0.1), "start_factor=-0.1"),
        (lambda: schedules.cosine_decay(-0.1, 5), "lr=-0.1"),
        (lambda: schedules.cosine_decay(0.1, 0), "decay_steps must be an int >= 1"),
        (lambda: schedules.cosine_decay(0.1, 5, final_lr=0.2), "final_lr=0.2"),
        (lambda: schedules.cosine_decay(0.1, 5, final_lr=-1e-3), "final_lr=-0.001"),
        (lambda: schedules.warmup_cosine(0.1, -1, 5), "warmup_steps must be an int >= 0"),
        (lambda: schedules.warmup_cosine(0.1, 5, 5), "total_steps must be > warmup_steps=5"),
        (lambda: schedules.warmup_cosine(0.1, 2, 5, start_factor=2.0), "start_factor=2.0"),
        (lambda: schedules.warmup_cosine(0.1, 2, 5, final_lr=1.0), "final_lr=1.0"),
        (lambda: schedules.piecewise_constant([3, 3], [1.0, 0.5, 0.1]), "increase strictly"),
        (lambda: schedules.piecewise_constant([0], [1.0, 0.5]), "boundaries[0] must be an int"),
        (lambda: schedules.piecewise_constant([4], [1.0]), "values must hold len(boundaries) + 1"),
        (lambda: schedules.piecewise_constant([4], [1.0, -0.5]), "values[1]=-0.5"),
        (lambda: schedules.piecewise_constant([4], [0.0, 0.0]), "a rate > 0"),
        (lambda: schedules.piecewise_constant(4, [0.1, 0.2]), "boundaries=4"),
        (lambda: schedules.piecewise_constant([4], "ab"), "values='ab'"),
        (lambda: schedules.step_decay(0.1, 0), "step_size must be an int >= 1"),
        (lambda: schedules.step_decay(0.1, 3, gamma=0.0), "gamma=0.0"),
        (lambda: schedules.step_decay(0.1, 3, gamma=1.5), "gamma=1.5"),
        (lambda: schedules.constant(0.1)(-1), "count must be an int >= 0, got count=-1"),
        (lambda: schedules.constant(0.1)(2.0), "count=2.0"),
        (lambda: sgd(lambda k: -0.1), "lr(0)=-0.1"),
        (lambda: adamw(lambda k: math.nan), "lr(0)=nan"),
        (lambda: adamw(None), "or a schedule"),
    ],
)
def test_bad_arguments_are_refused_by_name(build, message):
    with pytest.raises(ValueError) as caught:
        build()
    assert message in str(caught.value)


def test_bad_counts_and_bad_rates_are_type_errors():
    with pytest.raises(TypeError, match="0-d integer tensor"):
        schedules.constant(0.1)(torch.tensor(1.0))
    with pytest.raises(TypeError, match="0-d integer tensor"):
        schedules.constant(0.1)(torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="0-d real tensor"):
        sgd(lambda k: torch.full((2,), 0.1))
    with pytest.raises(TypeError, match="got '0.1'"):
        adamw(lambda k: "0.1")


def test_repr_names_the_schedule_and_its_settings():
    assert repr(schedules.step_decay(0.1, 3, 0.5)) == "step_decay(lr=0.1, step_size=3, gamma=0.5)"
    assert "boundaries=[2, 5]" in repr(schedules.piecewise_constant([2, 5], [3, 2, 1]))
