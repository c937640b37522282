"""A resumed run continues the saved one, with the partitions of the adopted secret.

A run takes 6 steps and saves; it then takes 10 more. A fresh Trainer loads the
checkpoint and takes 10 steps: with a given seed its parameters, optimizer state,
clip norm, noise history and accountant equal the uninterrupted run's, bit for
bit; with a drawn (secret) seed its samples and noise are drawn afresh (the fork
rule) and its accountant equals the uninterrupted run's; for DP-SGD and correlated
noise, with several micro-batches per step, and with adaptive clipping. With bands,
every example's participations stay at least ``bands`` steps apart across
the boundary, which the amplification theorem behind the printed epsilon needs.
"""

import gc

import optree
import pytest
import torch

import dpfunc

N = 160


@pytest.fixture
def build(tiny_problem):
    """A Trainer on ``tiny_problem(N)`` with these tests' settings and ``seed``, ``overrides``
    replacing them."""

    def build(seed=None, **overrides):
        loss_fn, params, dataset, _ = tiny_problem(N)
        settings = dict(
            optimizer=dpfunc.optim.adam(lr=0.05),
            epochs=2,
            expected_batch_size=8,
            clip_norm=1.0,
            noise_multiplier=0.9,
            delta=1e-4,
            physical_batch_size=8,
            progress=False,
            accounting="rdp",
            seed=seed,
        )
        settings.update(overrides)
        return dpfunc.Trainer(loss_fn, params, dataset, **settings)

    return build


def same_state(a, b):
    leaves_a, leaves_b = optree.tree_leaves(a.state), optree.tree_leaves(b.state)
    return len(leaves_a) == len(leaves_b) and all(
        torch.equal(u, v) for u, v in zip(leaves_a, leaves_b)
    )


CASES = [
    dict(bands=1),
    dict(bands=4),
    dict(bands=16),
    dict(bands=4, physical_batch_size=3),  # several micro-batches per step
    dict(bands=1, target_quantile=0.5, clip_norm=0.5),  # adaptive clipping
    # user-level: 40 users of 4 examples, at most 2 a step, slots of 2 rows
    dict(privacy_unit="user", max_examples_per_user=2, users=[i % 40 for i in range(N)]),
]


def case_id(case):
    return ",".join(f"{k}={v}"[:20] for k, v in case.items())


@pytest.mark.parametrize("given_seed", [False, True], ids=["secret", "given"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_continuation(tmp_path, case, given_seed, build):
    """A fixed seed resumes bit for bit; a secret one continues with fresh draws (the fork rule)."""
    seed = 987654321 if given_seed else None  # a fixed seed: reproducible, not private
    whole = build(seed=seed, **case)
    whole.fit(max_steps=6)
    whole.save(tmp_path / "run.pt")
    whole.fit(max_steps=10)

    resumed = build(seed=seed, **case)
    if not given_seed:
        assert resumed.seed != whole.seed  # a fresh secret, until it adopts the saved one
    resumed.fit(max_steps=1)  # a stale step of its own, then the checkpoint replaces it
    resumed.load(tmp_path / "run.pt")
    assert resumed.seed == whole.seed and resumed.steps_done == 6
    for mine, theirs in zip(resumed.batches.partitions, whole.batches.partitions):
        assert torch.equal(mine, theirs)
    assert (resumed.stream_seed == whole.stream_seed) == given_seed
    resumed.fit(max_steps=10)

    assert same_state(resumed, whole) == given_seed
    assert resumed.accountant.state_dict() == whole.accountant.state_dict()
    assert resumed.epsilon() == whole.epsilon()
    if not given_seed:  # other samples from step 6 on, every example in its partition still
        assert any(
            not torch.equal(resumed.batches.indices(t), whole.batches.indices(t))
            for t in range(6, 16)
        )


@pytest.mark.parametrize("bands", [4, 16])
def test_participations_stay_bands_apart_across_a_resume(tmp_path, bands, build):
    first = build(bands=bands, epochs=3)
    first.fit(max_steps=5)
    first.save(tmp_path / "run.pt")
    resumed = build(bands=bands, epochs=3)
    resumed.load(tmp_path / "run.pt")
    steps = range(resumed.total_steps)
    # steps before the boundary were sampled by the saved run, after it by the resumed one
    batches = [(first if t < 5 else resumed).batches.indices(t) for t in steps]
    last_seen = {}
    for t, batch in enumerate(batches):
        for i in batch.tolist():
            assert t - last_seen.get(i, -bands) >= bands, (i, last_seen.get(i), t)
            last_seen[i] = t
    owner = {}  # every example stays in one partition
    for t, batch in enumerate(batches):
        for i in batch.tolist():
            assert owner.setdefault(i, t % bands) == t % bands


def test_partitions_follow_the_seed_of_the_sampler():
    batches = dpfunc.data.PoissonBatches(torch.arange(40.0), 0.3, 8, bands=4)
    secret = dpfunc.secret_seed()
    expected = dpfunc.data.partitions(40, 4, seed=secret)
    batches.seed = secret
    assert all(torch.equal(a, b) for a, b in zip(batches.partitions, expected))


def test_other_privacy_settings_are_refused_with_every_difference(tmp_path, build):
    path = tmp_path / "run.pt"
    build(bands=4).save(path)
    other = build(bands=2, expected_batch_size=10, clip_norm=2.0, noise_multiplier=1.1)
    with pytest.raises(ValueError, match="other settings") as caught:
        other.load(path)
    message = str(caught.value)
    for name in ["bands=4", "expected_batch_size=8.0", "clip_norm=1.0", "noise_multiplier=0.9"]:
        assert name in message, name
    assert other.steps_done == 0
    with pytest.raises(ValueError, match="accounting='rdp'"):
        build(bands=4, accounting="pld").load(path)
    with pytest.raises(ValueError, match="num_examples=160"):
        x, y = torch.randn(N + 1, 4), torch.zeros(N + 1, dtype=torch.long)
        base = build(bands=4)
        dpfunc.Trainer(
            base.step_fn.loss_fn, base.params, (x, y), optimizer=dpfunc.optim.adam(lr=0.05),
            epochs=2, expected_batch_size=8, clip_norm=1.0, noise_multiplier=0.9, delta=1e-4,
            physical_batch_size=8, progress=False, accounting="rdp", bands=4,
        ).load(path)  # fmt: skip


def test_a_run_does_not_go_back_to_an_earlier_checkpoint(tmp_path, build):
    # loading step 2's checkpoint into a run at step 3 would release step 3 again, with the
    # same noise; a fresh trainer resumes it
    path = tmp_path / "run.pt"
    trainer = build(seed=5)
    trainer.fit(max_steps=2)
    trainer.save(path)
    trainer.fit(max_steps=1)
    with pytest.raises(ValueError, match="does not go back"):
        trainer.load(path)
    assert trainer.steps_done == 3
    fresh = build(seed=5)
    fresh.load(path)
    assert fresh.steps_done == 2


def test_an_existing_checkpoint_path_is_resumed_not_overwritten(tmp_path, build):
    path = tmp_path / "run.pt"
    first = build(bands=4, checkpoint_path=path)
    first.fit(max_steps=7)  # saved at its last step
    before = path.read_bytes()
    seed, state = first.seed, optree.tree_leaves(first.state)
    del first  # its lock goes with it
    gc.collect()
    with pytest.warns(UserWarning, match="resumed from the existing checkpoint_path"):
        again = build(bands=4, checkpoint_path=path)
    assert path.read_bytes() == before
    assert again.steps_done == 7 and again.seed == seed
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(again.state), state))
    again.fit()
    assert again.steps_done == again.total_steps
    del again
    gc.collect()
    with pytest.raises(ValueError, match="other settings"):
        build(bands=2, checkpoint_path=path)  # refused, and the file is kept
    assert path.exists()
