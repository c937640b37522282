"""User-level privacy: users sampled, each user's mean gradient clipped once, accounted over users.

The oracles: a float64 loop over users (each user's gradient is the mean of
its examples' batch-size-1 gradients, clipped to ``C``), dp_accounting's
PLD over the user-level event, and the neighbouring relation itself (adding
or removing one user with all its examples moves the clipped sum by at most
``C``).
"""

import collections
import math
import warnings

import dp_accounting
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_batched_loss import LAYERS, projected_rows
from test_clip_bound import gradient, norm64
from test_compiled_layers import CASES, projected
from torch import nn
from torch.func import functional_call

import dpfunc
from dpfunc.step import StepNoise
from dpfunc.users import UserBatches, UserGroups, index_users, sample_user_rows

K = 2  # rows of a user's slot in the layer cases: B = 6 rows are 3 users
SLOTS = torch.tensor([1, 1, 1, 0, 1, 1], dtype=torch.bool)  # users of 2, 1 and 2 examples


def user_config(**kw):
    settings = dict(clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=2.0,
                    privacy_unit="user", max_examples_per_user=K)  # fmt: skip
    return dpfunc.DPConfig(**{**settings, **kw})


# --------------------------------------------------------------------------- the ids


def test_users_are_indexed_in_order_of_first_appearance():
    index = index_users(["bo", "al", "bo", "cy", "al", "bo"], 6)
    assert index.num_users == 3
    assert index.counts.tolist() == [3, 2, 1]
    assert index.rows.tolist() == [0, 2, 5, 1, 4, 3]
    for ids in (torch.tensor([7, 3, 7, 9, 3, 7]), np.array([7, 3, 7, 9, 3, 7]), [7, 3, 7, 9, 3, 7]):
        same = index_users(ids, 6)
        assert torch.equal(same.rows, index.rows) and torch.equal(same.offsets, index.offsets)


@pytest.mark.parametrize(
    "ids, match",
    [
        ([1, 2], "one user id per example: the dataset has 3 rows, got 2 ids"),
        ([1, None, 2], r"users\[1\] is None"),
        ([1, float("nan"), 2], r"users\[1\] is nan"),
        ([True, False, True], r"users\[0\] is True"),
        (torch.tensor([1.0, 2.0, 1.0]), "integer or string ids"),
        (torch.zeros(3, 2, dtype=torch.int64), "1-D"),
        ("abc", "a 1-D sequence of user ids"),
        ([np.float32(1.0), np.float32(2.0), np.float32("nan")], r"users\[0\] is 1.0: a float"),
        ([np.bool_(True), np.bool_(False), np.bool_(True)], r"users\[0\] is True"),
        ([1, "1", 2], r"mixes ints and strings \(users\[1\] is '1'\)"),
        ([(1,), (2,), (1,)], r"users\[0\] is \(1,\): ids are ints or strings"),
        ([b"a", b"b", b"a"], "ids are ints or strings"),
    ],
)
def test_bad_ids_are_refused(ids, match):
    with pytest.raises(ValueError, match=match):
        index_users(ids, 3)


def test_ids_as_zero_d_tensors_or_numpy_scalars_are_read_as_their_values():
    """Iterating a tensor (or a torch-format column) gives 0-d tensors, which hash by identity:
    read as objects, every row would be a user of its own."""
    ids = torch.tensor([4, 7, 4, 4, 7, 9])
    expected = index_users(ids, 6)
    for form in (list(ids), [np.int64(i) for i in ids.tolist()], [str(i) for i in ids.tolist()],
                 list(ids.numpy())):  # fmt: skip
        got = index_users(form, 6)
        assert got.num_users == 3
        assert torch.equal(got.rows, expected.rows) and torch.equal(got.offsets, expected.offsets)


# --------------------------------------------------------------------------- the sample


def test_a_sampled_user_gives_a_uniform_k_subset_of_its_own_rows():
    index = index_users([0, 1, 0, 0, 2, 0, 1], 7)  # user 0: rows 0, 2, 3, 5
    sampled = torch.tensor([0, 1, 2])
    seen = collections.Counter()
    for step in range(3000):
        rows, mask = sample_user_rows(index, sampled, 2, seed=11, step=step)
        assert mask.tolist() == [True, True, True, True, True, False]
        assert sorted(rows[2:4].tolist()) == [1, 6] and rows[4] == 4  # all of a small user's
        assert len(set(rows[:2].tolist())) == 2 and set(rows[:2].tolist()) <= {0, 2, 3, 5}
        seen[frozenset(rows[:2].tolist())] += 1
    assert len(seen) == 6  # every pair of user 0's four rows, about equally often
    counts = np.array(list(seen.values()))
    chi2 = float(((counts - 500) ** 2 / 500).sum())
    assert chi2 < 20.5  # 5 degrees of freedom: p = 0.001
    again = sample_user_rows(index, sampled, 2, seed=11, step=5)
    assert torch.equal(again[0], sample_user_rows(index, sampled, 2, seed=11, step=5)[0])


def test_micro_batches_hold_whole_users_and_ranks_share_them():
    users = torch.arange(40) % 13  # 13 users of 3 or 4 examples
    x = torch.arange(40.0)
    index = index_users(users, 40)
    whole = UserBatches(x, index, 0.5, 6, 2, seed=3)
    assert whole.expected_batch_size == 6.5
    ranks = [UserBatches(x, index, 0.5, 6, 2, seed=3, rank=r, world_size=2) for r in range(2)]
    for step in range(5):
        sampled = whole.indices(step)
        batches, count = whole.logical_batch(step)
        assert count == sampled.numel()
        rows = torch.cat([b for b, _ in batches]).long()
        mask = torch.cat([m for _, m in batches]).bool()
        slots = [rows[j : j + 2][mask[j : j + 2]] for j in range(0, rows.numel(), 2)]
        real = [s for s in slots if s.numel()]
        assert len(real) == count  # one slot per sampled user, real rows first
        assert all(len(set(users[s].tolist())) == 1 for s in real)  # one user per slot
        assert sorted(int(users[s[0]]) for s in real) == sorted(sampled.tolist())
        shares = [r.logical_batch(step) for r in ranks]
        assert len(shares[0][0]) == len(shares[1][0]) == ranks[0].micro_batch_count(step)
        assert shares[0][1] + shares[1][1] == count
    with pytest.raises(ValueError, match="must be a multiple of max_examples_per_user=2"):
        UserBatches(x, index, 0.5, 5, 2, seed=3)


# --------------------------------------------------------------------------- the clipped sum


def oracle(loss_fn, params, batch, slots, k, clip_norm):
    """Float64: sum over users of min(1, C / |g_u|) g_u, g_u the mean of its examples' grads."""
    total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
    norms = []
    wide = {n: p.double() for n, p in params.items()}
    for start in range(0, slots.numel(), k):
        rows = [j for j in range(start, start + k) if slots[j]]
        if not rows:
            continue
        g = {n: torch.zeros_like(p) for n, p in wide.items()}
        for j in rows:
            example = tuple(t[j].double() if t.is_floating_point() else t[j] for t in batch)
            one = torch.func.grad(loss_fn)(wide, example)
            g = {n: g[n] + one[n] / len(rows) for n in g}
        norm = math.sqrt(sum(float((v * v).sum()) for v in g.values()))
        norms.append(norm)
        factor = min(1.0, clip_norm / norm) if norm > 0 else 1.0
        total = {n: total[n] + factor * g[n] for n in total}
    return total, norms


def clip_users(case, method, batched=False):
    torch.manual_seed(0)
    model = case.model().double()
    params, buffers = dpfunc.functionalize(model)

    def one(p, example):
        return projected(
            functional_call(model, (p, buffers), tuple(t.unsqueeze(0) for t in example))
        )

    @dpfunc.batched_loss
    def rows(p, batch):
        return projected_rows(functional_call(model, (p, buffers), tuple(batch)))

    batch = tuple(t.double() if t.is_floating_point() else t
                  for t in case.example(torch.Generator().manual_seed(0)))  # fmt: skip
    _, norms = oracle(one, params, batch, SLOTS, K, 1.0)
    clip_norm = float(np.median(norms))  # some users clipped, some not
    expected, norms = oracle(one, params, batch, SLOTS, K, clip_norm)
    step = dpfunc.make_train_step(
        rows if batched else one, dpfunc.optim.sgd(lr=1.0), config=user_config(clip_norm=clip_norm),
        model=model, method=method,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # layers without a ghost rule fall back to vmap, saying so
        summed, stats = step.clip(params, batch, SLOTS)
    return summed, stats, expected, norms, clip_norm


@pytest.mark.parametrize("method", ["vmap", "ghost"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_users_clipped_mean_gradient_equals_the_float64_loop(case, method):
    summed, stats, expected, norms, clip_norm = clip_users(case, method)
    assert stats.mask.tolist() == [True, True, True]
    torch.testing.assert_close(
        stats.norm, torch.tensor(norms, dtype=torch.float64), rtol=1e-9, atol=1e-12
    )
    for name, value in expected.items():
        torch.testing.assert_close(summed[name], value, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("case", LAYERS, ids=[c.name for c in LAYERS])
def test_the_batched_ghost_pass_gives_each_users_norm(case):
    summed, stats, expected, norms, _ = clip_users(case, "ghost", batched=True)
    torch.testing.assert_close(
        stats.norm, torch.tensor(norms, dtype=torch.float64), rtol=1e-9, atol=1e-12
    )
    for name, value in expected.items():
        torch.testing.assert_close(summed[name], value, rtol=1e-7, atol=1e-10)


def contribution(step, params, user_rows, seed):
    """What a logical batch whose only real user holds ``user_rows`` releases without noise."""
    g = torch.Generator().manual_seed(seed)
    k = user_rows.shape[0]
    where = int(torch.randint(3 * 2, (1,), generator=g))  # 3 micro-batches of 2 slots
    micro = []
    for m in range(3):
        batch = torch.randn(2 * k, user_rows.shape[1], generator=g, dtype=torch.float64) * 3
        batch, mask = batch.to(user_rows.dtype), torch.zeros(2 * k)
        if where // 2 == m:
            slot = (where % 2) * k
            batch[slot : slot + k], mask[slot : slot + k] = user_rows, 1.0
        micro.append((batch, mask))
    noise = StepNoise({n: torch.zeros_like(p) for n, p in params.items()}, None)
    private, _, _ = step.logical_gradient(step.init(params), micro, noise)
    return private


@pytest.mark.parametrize("method", ["vmap", "ghost"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@settings(max_examples=8, deadline=None)
@given(
    size=st.integers(1_000, 50_000),
    kind=st.sampled_from(["random", "constant", "spread"]),
    log_clip=st.floats(-6, 5),
    near=st.sampled_from([1 - 1e-7, 1.0, 1 + 1e-7, 2.0]),
    k=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_one_users_contribution_is_within_the_clip_norm(method, dtype, size, kind, log_clip,
                                                         near, k, seed):  # fmt: skip
    """Each of the user's examples has gradient ``x_j`` (``loss = W . x``); their mean has norm
    ``near * C``: the released sum of a batch holding that user alone has norm <= C."""
    clip_norm = 10.0**log_clip
    x = gradient(size, kind, clip_norm, near, None, torch.float64, seed)
    parts = torch.linspace(0.5, 1.5, k, dtype=torch.float64)  # the mean of the rows is x
    rows = (x[None] * (parts / parts.mean())[:, None]).to(dtype)
    model = nn.Linear(size, 1, bias=False).to(dtype)
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        return functional_call(model, (p, buffers), (example[None],)).sum()

    step = dpfunc.make_train_step(
        loss_fn, dpfunc.optim.sgd(lr=1.0), config=dpfunc.DPConfig(
            clip_norm=clip_norm, noise_multiplier=0.0, expected_batch_size=1.0,
            privacy_unit="user", max_examples_per_user=k),
        model=model, method=method,
    )  # fmt: skip
    assert norm64(contribution(step, params, rows, seed)) <= clip_norm


def test_adding_a_user_moves_the_clipped_sum_by_at_most_the_clip_norm():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        x, y = example
        out = functional_call(model, (p, buffers), (x[None],))
        return nn.functional.cross_entropy(out, y[None])

    x, y = torch.randn(24, 4, dtype=torch.float64) * 4, torch.randint(0, 3, (24,))
    users = torch.arange(24) // 3  # 8 users of 3 examples
    config = user_config(clip_norm=0.3, max_examples_per_user=3)
    for method in ("vmap", "ghost"):
        step = dpfunc.make_train_step(loss_fn, dpfunc.optim.sgd(lr=1.0), config=config,
                                      model=model, method=method)  # fmt: skip
        with_all, _ = step.clip(params, (x, y), torch.ones(24))
        for user in range(8):
            mask = (users != user).double()
            without, stats = step.clip(params, (x, y), mask)
            moved = norm64({n: with_all[n] - without[n] for n in params})
            assert 0 < moved <= 0.3
            skipped, short = step.clip(params, (x, y), mask, skip_padding=True)  # the empty slot
            for n in params:
                torch.testing.assert_close(skipped[n], without[n], rtol=1e-12, atol=1e-15)
            assert torch.equal(short.mask, stats.mask) and short.mask.sum() == 7
            real = stats.mask
            torch.testing.assert_close(short.norm[real], stats.norm[real], rtol=1e-12, atol=0)


# --------------------------------------------------------------------------- runs


def mlp_problem(n=240, num_users=30, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        x, y = example
        out = functional_call(model, (p, buffers), (x[None],))
        return nn.functional.cross_entropy(out, y[None])

    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)
    zipf = 1.0 / torch.arange(1, num_users + 1) ** 1.1  # heavy-tailed: a few users hold most
    users = torch.multinomial(zipf, n, replacement=True, generator=g)
    return model, params, loss_fn, (x, y), users


def test_the_trainer_accounts_users_and_its_report_says_so():
    model, params, loss_fn, data, users = mlp_problem()
    num_users = int(users.unique().numel())
    trainer = dpfunc.Trainer(
        loss_fn, params, data, optimizer=dpfunc.optim.sgd(0.1), clip_norm=1.0,
        noise_multiplier=1.2, expected_batch_size=6, epochs=2, privacy_unit="user",
        max_examples_per_user=4, users=users, delta=1e-3, progress=False,
    )  # fmt: skip
    assert trainer.num_units == num_users and trainer.num_examples == 240
    assert trainer.sample_rate == 6 / num_users
    assert trainer.total_steps == 2 * round(num_users / 6)  # an epoch is U / expected users
    assert trainer.physical_batch_size % 4 == 0
    trainer.fit()
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(6 / num_users, dp_accounting.GaussianDpEvent(1.2)),
        trainer.total_steps,
    )
    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    expected = pld.compose(event).get_epsilon(1e-3)
    assert expected <= trainer.epsilon() <= expected * (1 + 1e-6)  # never below the library
    report = trainer.privacy_report()
    assert report.epsilon >= expected and report.privacy_unit == "user"
    assert report.num_examples == num_users and report.max_examples_per_user == 4
    text = str(report)
    assert f"-DP per user after {trainer.total_steps}" in text
    assert f"{num_users} users (users=) over 240 examples, at most 4 examples of a user" in text
    assert "add or remove one user with all of their examples" in text
    assert any("user ids" in line for line in report.not_covered)
    assert "-DP per example" in str(dpfunc.Trainer(
        loss_fn, params, data, optimizer=dpfunc.optim.sgd(0.1), clip_norm=1.0,
        noise_multiplier=1.2, expected_batch_size=6, epochs=1, progress=False,
    ).privacy_report())  # fmt: skip


def test_private_gradients_write_the_users_clipped_mean_and_noise():
    model, _, _, data, users = mlp_problem()

    def loss_fn(p, example):  # the model's live parameters
        x, y = example
        return nn.functional.cross_entropy(functional_call(model, p, (x[None],)), y[None])

    private = dpfunc.PrivateGradients(
        model, loss_fn, data, clip_norm=0.5, noise_multiplier=0.0, expected_batch_size=5,
        privacy_unit="user", max_examples_per_user=3, users=users, seed=4, delta=1e-3,
    )  # fmt: skip
    batch = next(private.batches(1))
    micro, count = private.plan.batches.logical_batch(0)
    private.backward(batch)
    params = {n: p.detach() for n, p in model.named_parameters()}
    x, y = data
    expected = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
    for rows, mask in micro:  # the float64 loop over the step's users
        got, _ = oracle(loss_fn, params, rows, mask.bool(), 3, 0.5)
        expected = {n: expected[n] + got[n] for n in expected}
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), expected[name] / 5, rtol=1e-4, atol=1e-6)
    assert count == int(sum(UserGroups.of(m, 3).mask.sum() for _, m in micro))
    assert math.isinf(private.epsilon())  # noise_multiplier=0: no privacy, and it says so
    assert "per user" in str(private.privacy_report())


def test_user_level_settings_come_together_or_not_at_all():
    model, params, loss_fn, data, users = mlp_problem()
    base = dict(optimizer=dpfunc.optim.sgd(0.1), clip_norm=1.0, noise_multiplier=1.0,
                expected_batch_size=6, epochs=1, progress=False)  # fmt: skip
    with pytest.raises(ValueError, match="privacy_unit='user' needs users="):
        dpfunc.Trainer(loss_fn, params, data, privacy_unit="user", max_examples_per_user=2, **base)
    with pytest.raises(ValueError, match="users= groups the examples by user"):
        dpfunc.Trainer(loss_fn, params, data, users=users, **base)
    with pytest.raises(ValueError, match="privacy_unit='user' needs max_examples_per_user"):
        dpfunc.DPConfig(clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=6,
                        privacy_unit="user")  # fmt: skip
    with pytest.raises(ValueError, match="max_examples_per_user bounds a user's examples"):
        dpfunc.DPConfig(clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=6,
                        max_examples_per_user=3)  # fmt: skip
    with pytest.raises(ValueError, match="privacy_unit must be one of"):
        dpfunc.DPConfig(clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=6,
                        privacy_unit="person")  # fmt: skip
    with pytest.raises(ValueError, match="target_quantile=0.5, bands=2"):
        dpfunc.DPConfig(clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=6, bands=2,
                        privacy_unit="user", max_examples_per_user=3,
                        target_quantile=0.5)  # fmt: skip
    multiple = r"physical_batch_size=10 \(.*\) must be a multiple of max_examples_per_user=4"
    with pytest.raises(ValueError, match=multiple):
        dpfunc.Trainer(loss_fn, params, data, privacy_unit="user", max_examples_per_user=4,
                       users=users, physical_batch_size=10, **base)  # fmt: skip
    with pytest.raises(ValueError, match="one user id per example"):
        dpfunc.Trainer(loss_fn, params, data, privacy_unit="user", max_examples_per_user=4,
                       users=users[:-1], **base)  # fmt: skip
    with pytest.raises(ValueError, match="expected_batch_size must be"):
        dpfunc.Trainer(
            loss_fn,
            params,
            data,
            privacy_unit="user",
            max_examples_per_user=4,
            users=torch.zeros(240, dtype=torch.int64),
            **base,
        )  # one user: 6 > 1


def test_a_checkpoint_resumes_only_with_the_same_users(tmp_path):
    model, params, loss_fn, data, users = mlp_problem()
    settings = dict(optimizer=dpfunc.optim.sgd(0.1), clip_norm=1.0, noise_multiplier=1.0,
                    expected_batch_size=6, epochs=1, progress=False, privacy_unit="user",
                    max_examples_per_user=4, checkpoint_path=tmp_path / "run.pt")  # fmt: skip
    first = dpfunc.Trainer(loss_fn, params, data, users=users, **settings)
    first.fit()
    steps, epsilon = first.steps_done, first.epsilon()
    del first
    other = users.roll(1)  # the same counts, other owners
    with pytest.raises(ValueError, match="users="):
        dpfunc.Trainer(loss_fn, params, data, users=other, **settings)
    with pytest.warns(UserWarning, match="resum"):
        again = dpfunc.Trainer(loss_fn, params, data, users=users, **settings)
    assert again.steps_done == steps and again.epsilon() == epsilon


def test_a_compiled_user_level_ghost_step_equals_eager():
    torch._dynamo.reset()
    model, params, loss_fn, (x, y), _ = mlp_problem()
    step = dpfunc.make_train_step(loss_fn, dpfunc.optim.sgd(lr=0.5), config=user_config(
        clip_norm=0.2, max_examples_per_user=3), model=model, method="ghost")  # fmt: skip
    mask = torch.tensor([1, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0], dtype=torch.float32)
    noise = dpfunc.standard_normal_like(params, seed=5, step=0)  # public: a test
    state = step.init(params)
    eager, metrics = step(state, (x[:12], y[:12]), mask, noise)
    compiled, compiled_metrics = torch.compile(step, fullgraph=True)(
        state, (x[:12], y[:12]), mask, noise
    )
    assert float(metrics["batch_size"]) == float(compiled_metrics["batch_size"]) == 3  # users
    for k in eager.params:
        torch.testing.assert_close(compiled.params[k], eager.params[k], rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


def test_habits_from_example_level_training_are_refused_with_the_reason():
    model, params, loss_fn, data, users = mlp_problem()
    num_users = int(users.unique().numel())
    base = dict(optimizer=dpfunc.optim.sgd(0.1), clip_norm=1.0, noise_multiplier=1.0, epochs=1,
                progress=False, privacy_unit="user", max_examples_per_user=4,
                users=users)  # fmt: skip
    # an example count where users are counted: refused, and the message says so
    with pytest.raises(ValueError, match=f"counts users .*at most the {num_users} users"):
        dpfunc.Trainer(loss_fn, params, data, expected_batch_size=64, **base)
    # a search prices examples, not users
    config = dpfunc.DPConfig(clip_norm=1.0, target_epsilon=3.0, expected_batch_size=4,
                             epochs=1, privacy_unit="user", max_examples_per_user=4)  # fmt: skip
    with pytest.raises(ValueError, match="a search over user-level runs is not supported"):
        dpfunc.tune.RandomSearch({"lr": [0.1]}, config, num_examples=num_users, mean_trials=2,
                                 score="public")  # fmt: skip
    # k above every user's count only pads: said, with the k that gives the same updates
    with pytest.warns(UserWarning, match=r"max_examples_per_user=500 is above the largest"):
        dpfunc.Trainer(loss_fn, params, data, expected_batch_size=4,
                       **{**base, "max_examples_per_user": 500})  # fmt: skip


def test_the_user_epsilon_of_example_sampling_is_dp_sgds_for_one_example_and_grows_with_k():
    from dpfunc.accounting import epsilon, example_sampling_user_epsilon

    coarse = dict(value_discretization_interval=1e-3)
    one = example_sampling_user_epsilon(1.1, 0.02, 50, 1e-5, 1, **coarse)
    exact = epsilon(1.1, 0.02, 50, 1e-5)  # the same event on the finer grid
    assert exact <= one <= exact * 1.01
    growing = [example_sampling_user_epsilon(1.1, 0.02, 50, 1e-5, k, **coarse) for k in (2, 4)]
    assert one < growing[0] < growing[1]
    assert example_sampling_user_epsilon(0.0, 0.02, 5, 1e-5, 3) == math.inf
    assert example_sampling_user_epsilon(1.0, 0.02, 0, 1e-5, 3) == 0.0
    with pytest.raises(ValueError, match="max_examples_per_user must be an int >= 1"):
        example_sampling_user_epsilon(1.0, 0.02, 5, 1e-5, 0)


def test_bounded_contributions_keep_at_most_k_rows_of_each_user():
    users = ["a"] * 5 + ["b"] + ["c"] * 3
    kept = dpfunc.users.bound_contributions(users, 2, seed=3)
    owners = collections.Counter(users[i] for i in kept.tolist())
    assert owners == {"a": 2, "b": 1, "c": 2}
    assert torch.equal(kept, dpfunc.users.bound_contributions(users, 2, seed=3))
    assert torch.equal(dpfunc.users.bound_contributions(users, 5), torch.arange(9))


def test_stop_at_epsilon_counts_users():
    model, params, loss_fn, data, users = mlp_problem()
    trainer = dpfunc.Trainer(
        loss_fn, params, data, optimizer=dpfunc.optim.sgd(0.1), clip_norm=1.0,
        noise_multiplier=1.0, expected_batch_size=6, epochs=3, privacy_unit="user",
        max_examples_per_user=4, users=users, delta=1e-3, progress=False,
        callbacks=[dpfunc.callbacks.StopAtEpsilon(1.5)],
    )  # fmt: skip
    trainer.fit()
    assert (
        trainer.epsilon()
        <= 1.5
        < dpfunc.accounting.epsilon(1.0, trainer.sample_rate, trainer.steps_done + 1, 1e-3)
    )


def test_a_user_level_config_never_hands_out_an_example_sampler():
    config = user_config()
    with pytest.raises(ValueError, match="samples users, and a user's examples together"):
        config.poisson_sampler(100)
    with pytest.raises(ValueError, match="give users=, the dataset's dpfunc.users.UserIndex"):
        config.sampler(torch.zeros(100, 2), 4, seed=1)
    model, params, loss_fn, data, _ = mlp_problem()
    step = dpfunc.make_train_step(loss_fn, dpfunc.optim.sgd(0.1), config=config)
    with pytest.raises(ValueError, match="train_with_step samples examples"):
        dpfunc.audit.train_with_step(step, params, data, steps=1, sample_rate=0.1,
                                     physical_batch_size=4)  # fmt: skip
    k = dpfunc.DPConfig(clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=2.0,
                        privacy_unit="user", max_examples_per_user=np.int64(2))  # fmt: skip
    assert type(k.max_examples_per_user) is int  # the report's JSON takes it


def test_a_hugging_face_id_column_is_read_as_values_and_dropped(tmp_path):
    datasets = pytest.importorskip("datasets", reason="needs the 'hf' extra")
    x, y = torch.randn(48, 5), torch.randint(0, 3, (48,))
    authors = [f"author{i % 6}" for i in range(48)]
    table = datasets.Dataset.from_dict({"x": x.tolist(), "y": y.tolist(), "author": authors})
    seen = []
    model = nn.Linear(5, 3)
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, row):
        seen.append(sorted(row))
        out = functional_call(model, (p, buffers), (row["x"][None],))
        return nn.functional.cross_entropy(out, row["y"][None])

    for form in (table, table.with_format("torch")):
        trainer = dpfunc.Trainer(
            loss_fn, params, form, users="author", privacy_unit="user",
            max_examples_per_user=4, optimizer=dpfunc.optim.sgd(0.1), clip_norm=1.0,
            noise_multiplier=1.0, expected_batch_size=3, epochs=1, progress=False,
        )  # fmt: skip
        assert trainer.num_units == 6
        trainer.fit()
        assert "6 users (column 'author') over 48 examples" in str(trainer.privacy_report())
    assert seen and all(keys == ["x", "y"] for keys in seen)  # the ids never reach the loss
    numbered = table.add_column("uid", [i % 6 for i in range(48)]).with_format("torch")
    # a torch-format column iterates as 0-d tensors (datasets 5): read as their values
    assert index_users(list(numbered["uid"]), 48).num_users == 6
