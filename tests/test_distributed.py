"""Data-parallel DP-SGD on torch.distributed: two gloo processes on 127.0.0.1.

Each test launches this file as a script on 2 ranks (``python
test_distributed.py SCENARIO OUTDIR TIMEOUT_S ...`` with MASTER_ADDR,
MASTER_PORT, RANK and WORLD_SIZE set, as torchrun would) and compares what
the ranks wrote with a single-process run computed here. Every launch has an
overall guard: processes still alive after it are killed and the test fails.
Starting a rank (imports, vmap's first call) takes seconds on 2 cores, so one
launch ("main") serves both the step test and the first half of the trainer
resume test.
"""

from __future__ import annotations

import math
import os
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import dpfunc
from dpfunc import data
from dpfunc.step import StepNoise

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ranks  # noqa: E402 (the launcher beside this file)
from ranks import assert_ok, free_port, load_rank  # noqa: E402

N = 48  # examples
SAMPLE_RATE = 0.06  # expected batch 2.88: shares of 0, 1, 2, 3 examples per rank
PHYSICAL = 2  # rows per micro-batch, so a share of 3 needs 2 micro-batches
STEPS = 5
GUARD_S = 60.0  # an overall limit on every launch

TRAINER = dict(
    epochs=1,  # 8 steps of expected size 6
    expected_batch_size=6,
    clip_norm=0.5,
    noise_multiplier=1.0,
    delta=1e-3,
    physical_batch_size=2,
    accounting="rdp",
    seed=3,  # a public seed: reproducible test runs, no privacy
)
RESUME_AT = 3
# user-level: 10 users of 2 examples and one of 28; 3 users a step, 2 a micro-batch
USERS = dict(privacy_unit="user", max_examples_per_user=2, expected_batch_size=3,
             physical_batch_size=4, users=[min(i // 2, 10) for i in range(N)])  # fmt: skip


def problem(model_seed: int = 0):
    torch.manual_seed(model_seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    params, buffers = dpfunc.functionalize(model)
    g = torch.Generator().manual_seed(123)
    x = torch.randn(N, 4, generator=g) * 2
    y = torch.randint(0, 3, (N,), generator=g)

    def loss_fn(p, example):
        xi, yi = example
        return F.cross_entropy(functional_call(model, (p, buffers), (xi.unsqueeze(0),)), yi[None])

    return loss_fn, params, (x, y)


def make_step(loss_fn, make):
    return make(
        loss_fn,
        dpfunc.optim.sgd(lr=0.5, momentum=0.5),
        clip_norm=0.5,
        noise_multiplier=0.7,
        expected_batch_size=SAMPLE_RATE * N,
    )


def make_trainer(**overrides):
    loss_fn, params, dataset = problem()
    kwargs = dict(TRAINER, optimizer=dpfunc.optim.adam(lr=0.05), progress=False)
    kwargs.update(overrides)
    return dpfunc.Trainer(loss_fn, params, dataset, **kwargs)


def choose_seed() -> int:
    """A sampling seed whose first STEPS steps split unevenly in the ways tested."""
    for seed in range(10_000):
        sizes = [
            data.poisson_sample(N, SAMPLE_RATE, seed=seed, step=t).numel() for t in range(STEPS)
        ]
        one_empty = 1 in sizes  # rank 0 gets the only example, rank 1 nothing
        # 5 = 3 + 2 examples: rank 0 needs 2 micro-batches, rank 1 one (padded to 2)
        different_counts = 5 in sizes
        last_fits = sizes[-1] <= 2 * PHYSICAL  # one micro-batch per rank: the one-call step
        if one_empty and different_counts and last_fits:
            return seed
    raise AssertionError("no seed gives the uneven splits this test needs")


# --------------------------------------------------------------------------- workers


def worker(scenario: str, outdir: str, timeout_s: float, *args: str) -> int:
    torch.set_num_threads(1)
    # the rendezvous honours timeout_s too: start it together, whatever the import times
    ready = [
        os.path.join(outdir, f"ready-{os.environ['MASTER_PORT']}-{r}")
        for r in range(int(os.environ["WORLD_SIZE"]))
    ]
    open(ready[int(os.environ["RANK"])], "w").close()
    while not all(os.path.exists(path) for path in ready):
        time.sleep(0.01)
    info = dpfunc.distributed.init("gloo", timeout_s=timeout_s)  # CPU tensors, GPU or not
    rank, world_size = info.rank, info.world_size
    try:
        if scenario == "main":
            result = {
                "steps": steps_worker(rank, world_size, int(args[0])),
                "trainer": trainer_first(outdir),
                "private": private_run(model_seed=rank),  # rank 1 starts elsewhere
                "users": private_run(model_seed=rank, **USERS),
            }
        elif scenario in ("die", "hang"):
            return failing_worker(scenario, rank, world_size, outdir)
        elif scenario == "resume":
            result = trainer_resume(rank, outdir)
        else:
            raise ValueError(f"unknown scenario {scenario!r}")
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dpfunc.distributed.shutdown()
    return 0


def steps_worker(rank: int, world_size: int, seed: int) -> dict:
    loss_fn, params, dataset = problem(model_seed=rank)  # rank 1 starts elsewhere...
    step = make_step(loss_fn, dpfunc.distributed.make_train_step)
    state = step.init(params)  # ...and gets rank 0's parameters
    initial = {k: v.clone() for k, v in state.params.items()}
    batches = data.PoissonBatches(
        dataset, SAMPLE_RATE, PHYSICAL, seed=seed, rank=rank, world_size=world_size
    )
    counts, micro_counts, metrics = [], [], []
    for t in range(STEPS):
        micro, count = batches.logical_batch(t)
        counts.append(count)
        micro_counts.append(sum(1 for _, mask in micro if mask.sum() > 0))
        noise = dpfunc.standard_normal_like(state.params, seed=seed, step=t)
        if t == STEPS - 1:  # one micro-batch on each rank: the one-call step
            ((batch, mask),) = micro
            state, m = step(state, batch, mask, noise)
        else:
            state, stats = step.logical_step(state, micro, StepNoise(noise, None))
            m = dpfunc.summarize(stats)
        metrics.append({k: float(v) for k, v in m.items()})
    return {
        "initial": initial,
        "params": state.params,
        "step": int(state.step),
        "counts": counts,
        "micro_counts": micro_counts,
        "metrics": metrics,
    }


def failing_worker(scenario: str, rank: int, world_size: int, outdir: str) -> int:
    loss_fn, params, _ = problem()
    step = make_step(loss_fn, dpfunc.distributed.make_train_step)
    state = step.init(params)
    for t in range(STEPS):
        if rank == 1 and t == 2:
            if scenario == "die":
                os._exit(17)  # dies without a word to the others
            time.sleep(GUARD_S * 2)  # hangs; the test kills it
        # an empty share (skips vmap's slow first call; the collectives are what is tested)
        noise = StepNoise(dpfunc.standard_normal_like(state.params, seed=0, step=t), None)
        started = time.monotonic()
        try:
            state, _ = step.logical_step(state, [], noise)
        except RuntimeError as error:
            report = f"{type(error).__name__}\n{time.monotonic() - started:.3f}\n{error}"
            with open(os.path.join(outdir, f"rank{rank}.err"), "w") as f:
                f.write(report)
            return 3
    return 0


def private_run(model_seed: int = 0, **overrides) -> dict:
    """PrivateGradients with torch.optim.SGD (momentum) through the planned steps."""
    torch.manual_seed(model_seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    _, _, dataset = problem()

    def loss_fn(p, example):
        xi, yi = example
        return F.cross_entropy(functional_call(model, p, (xi.unsqueeze(0),)), yi[None])

    settings = {k: v for k, v in TRAINER.items()}
    settings.update(overrides)
    private = dpfunc.PrivateGradients(model, loss_fn, dataset, **settings)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    for batch in private.batches():
        private.backward(batch)
        optimizer.step()
        optimizer.zero_grad()
    return {
        "params": {k: v.detach().clone() for k, v in model.named_parameters()},
        "steps": private.steps_done,
        "epsilon": private.epsilon(),
    }


def trainer_first(outdir: str) -> dict:
    """An uninterrupted 2-rank run, and one that stops at RESUME_AT and checkpoints."""
    whole = make_trainer(progress=True, checkpoint_path=os.path.join(outdir, "whole.pt"))
    saves = []
    real_save = torch.save
    torch.save = lambda *a, **k: saves.append(1) or real_save(*a, **k)
    try:
        whole.fit()
    finally:
        torch.save = real_save
    first = make_trainer()
    first.fit(max_steps=RESUME_AT)
    first.save(os.path.join(outdir, "run.pt"))
    return {
        "whole": whole.params,
        "history": whole.history,
        "epsilon": whole.epsilon(),
        "saves": len(saves),
        "first_steps": first.steps_done,
    }


def trainer_resume(rank: int, outdir: str) -> dict:
    """A fresh 2-rank run continues from trainer_first's checkpoint."""
    checkpoint = os.path.join(outdir, "run.pt")
    resumed = make_trainer()
    resumed.load(checkpoint)
    loaded_steps = resumed.steps_done
    resumed.fit()
    errors = {}
    try:  # ranks that disagree on the seed would add different noise
        make_trainer(seed=rank)
    except ValueError as error:
        errors["seed"] = str(error)
    drawn = make_trainer(seed=None)  # rank 0 draws the secret and broadcasts it
    adaptive = make_trainer(target_quantile=0.5, count_noise_multiplier=3.0, clip_norm=0.05)
    adaptive.fit(max_steps=3)  # the count comes from every rank's examples, noised once
    banded = make_trainer(bands=2)  # correlated noise: the same draws and history everywhere
    banded.fit(max_steps=4)
    try:  # the checkpoint's seed is a fixed one: a seed=None trainer must not adopt it
        make_trainer(seed=None).load(checkpoint)
    except ValueError as error:
        errors["adopt"] = str(error)
    fresh = make_trainer()
    try:  # rank 1 cannot read its file: every rank raises, nobody changes
        fresh.load(checkpoint if rank == 0 else os.path.join(outdir, "missing.pt"))
    except ValueError as error:
        errors["load"] = str(error)
    return {
        "params": resumed.params,
        "history": resumed.history,
        "epsilon": resumed.epsilon(),
        "loaded_steps": loaded_steps,
        "errors": errors,
        "fresh_steps": fresh.steps_done,
        "drawn_seed": drawn.seed,
        "adaptive": (adaptive.params, adaptive.clip_norm),
        "banded": (banded.params, banded.state.noise_state.history, banded.epsilon()),
    }


# --------------------------------------------------------------------------- launching


def launch(scenario, outdir, *args, timeout_s=20.0, wait_for=(0, 1)):
    """Runs the scenario on 2 ranks; returns [(returncode, output)] for the ranks in wait_for.

    Ranks not in ``wait_for`` are killed once those are done.
    """
    args = (scenario, outdir, timeout_s, *args)
    return ranks.launch(__file__, args, outdir, 2, guard_s=GUARD_S, wait_for=wait_for)


# --------------------------------------------------------------------------- tests

pytestmark = ranks.NEEDS_GLOO


@pytest.fixture(scope="module")
def main_run(tmp_path_factory):
    """One 2-rank launch: the step scenario, then the trainer's first run."""
    outdir = tmp_path_factory.mktemp("main")
    seed = choose_seed()
    logs = [log for _, log in assert_ok(launch("main", outdir, str(seed)))]
    return outdir, seed, [load_rank(outdir, r) for r in range(2)], logs


def test_two_ranks_equal_one_process_on_the_whole_batch(main_run):
    _, seed, results, _ = main_run
    ranks = [result["steps"] for result in results]

    # the single-process reference: the whole logical batch on one rank
    loss_fn, params, dataset = problem(model_seed=0)
    step = make_step(loss_fn, dpfunc.make_train_step)
    state = step.init(params)
    batches = data.PoissonBatches(dataset, SAMPLE_RATE, PHYSICAL, seed=seed)
    sizes, reference_metrics = [], []
    for t in range(STEPS):
        micro, count = batches.logical_batch(t)
        sizes.append(count)
        noise = StepNoise(dpfunc.standard_normal_like(params, seed=seed, step=t), None)
        state, stats = step.logical_step(state, micro, noise)
        reference_metrics.append(dpfunc.summarize(stats))

    # the shares were uneven in the ways the test is about
    counts = list(zip(ranks[0]["counts"], ranks[1]["counts"]))
    assert [a + b for a, b in counts] == sizes
    assert (1, 0) in counts  # rank 1's share empty, rank 0's not
    assert any(a != b and b > 0 for a, b in counts)  # uneven, both non-empty
    assert any(m0 != m1 for m0, m1 in zip(ranks[0]["micro_counts"], ranks[1]["micro_counts"]))

    for r in ranks:  # rank 1 started from other parameters and got rank 0's
        for k in params:
            assert torch.equal(r["initial"][k], params[k])
        assert r["step"] == STEPS
    for k in params:
        assert torch.equal(ranks[0]["params"][k], ranks[1]["params"][k])  # bit-identical
        torch.testing.assert_close(ranks[0]["params"][k], state.params[k], rtol=0, atol=1e-6)
        assert not torch.equal(state.params[k], params[k])
    for t in range(STEPS):  # metrics cover the whole logical batch on every rank
        assert ranks[0]["metrics"][t] == ranks[1]["metrics"][t]
        for name, value in reference_metrics[t].items():
            got = ranks[0]["metrics"][t][name]
            assert (math.isnan(got) and math.isnan(value)) or abs(got - float(value)) < 1e-6, (
                t,
                name,
            )


def test_private_gradients_on_two_ranks_equal_one_process(main_run):
    _, _, results, _ = main_run
    ranks = [result["private"] for result in results]
    alone = private_run(distributed=False)  # the single-process reference
    assert ranks[0]["steps"] == ranks[1]["steps"] == alone["steps"] == 8
    assert ranks[0]["epsilon"] == alone["epsilon"]
    for name, value in alone["params"].items():
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name])  # bit-identical
        torch.testing.assert_close(ranks[0]["params"][name], value, rtol=0, atol=1e-6)


def test_user_level_private_gradients_on_two_ranks_equal_one_process(main_run):
    _, _, results, _ = main_run
    ranks = [result["users"] for result in results]
    alone = private_run(distributed=False, **USERS)
    assert ranks[0]["steps"] == ranks[1]["steps"] == alone["steps"] == 4  # 11 users / 3
    assert ranks[0]["epsilon"] == alone["epsilon"]
    for name, value in alone["params"].items():
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name])  # bit-identical
        torch.testing.assert_close(ranks[0]["params"][name], value, rtol=0, atol=1e-6)


def _failure(tmp_path, scenario, timeout_s):
    started = time.monotonic()
    ((code, log),) = launch(scenario, tmp_path, timeout_s=timeout_s, wait_for=(0,))
    assert code == 3, f"rank 0 exited with {code}, expected the caught error:\n{log[-3000:]}"
    kind, waited, message = (tmp_path / "rank0.err").read_text().split("\n", 2)
    return kind, float(waited), message, time.monotonic() - started


def test_a_dead_rank_makes_the_other_fail_with_a_clear_error(tmp_path):
    kind, waited, message, total = _failure(tmp_path, "die", timeout_s=8.0)
    assert kind == "CollectiveError"
    assert "all_gather of the per-example stats (metrics) at step 2" in message
    assert "rank 0 of 2" in message and "died" in message and "timeout_s=8" in message
    assert waited < 8.0 + 2.0  # within the timeout, not a hang
    assert total < GUARD_S


def test_a_hung_rank_makes_the_other_fail_after_the_timeout(tmp_path):
    kind, waited, message, total = _failure(tmp_path, "hang", timeout_s=4.0)
    assert kind == "CollectiveError"
    assert "all_gather of the per-example stats (metrics) at step 2" in message
    assert "hangs" in message and "timeout_s=4" in message
    assert 4.0 - 0.5 < waited < 4.0 + 3.0  # the timeout fired, not an early error
    assert total < GUARD_S


def test_trainer_resumes_a_two_rank_run_bit_identically(main_run):
    outdir, _, results, logs = main_run
    whole = [result["trainer"] for result in results]
    assert "eps=" in logs[0] and "eps=" not in logs[1]  # rank 0's bar only
    assert whole[0]["saves"] >= 1 and whole[1]["saves"] == 0  # rank 0 writes, rank 1 doesn't
    assert whole[0]["first_steps"] == RESUME_AT
    assert (outdir / "whole.pt").exists() and (outdir / "run.pt").exists()

    assert_ok(launch("resume", outdir))
    resumed = [load_rank(outdir, r) for r in range(2)]

    single = make_trainer(distributed=False)
    single.fit()
    for k in single.params:
        for r in range(2):
            assert torch.equal(resumed[r]["params"][k], whole[0]["whole"][k])
        assert torch.equal(whole[0]["whole"][k], whole[1]["whole"][k])
        torch.testing.assert_close(whole[0]["whole"][k], single.params[k], rtol=0, atol=1e-6)
    for r in range(2):
        assert resumed[r]["loaded_steps"] == RESUME_AT
        assert resumed[r]["epsilon"] == whole[0]["epsilon"] == single.epsilon()
        # the paused run recorded its last step; then the epoch's record
        assert [h["steps"] for h in resumed[r]["history"]] == [RESUME_AT, 8]
        # the epoch's loss of a resumed run covers only the steps since the pause
        for key in ("epoch", "steps", "epsilon"):
            assert resumed[r]["history"][-1][key] == whole[0]["history"][-1][key]
        assert "seed differs across ranks" in resumed[r]["errors"]["seed"]
        assert "seed=<secret>" in resumed[r]["errors"]["seed"]  # never printed
        assert "fixed seed, which is not a secret" in resumed[r]["errors"]["adopt"]
        assert resumed[r]["fresh_steps"] == 0  # a failed load changes nothing
    assert resumed[0]["drawn_seed"] == resumed[1]["drawn_seed"] != TRAINER["seed"]
    alone = make_trainer(
        distributed=False, target_quantile=0.5, count_noise_multiplier=3.0, clip_norm=0.05
    )
    alone.fit(max_steps=3)
    assert alone.clip_norm != 0.05
    for r in range(2):
        params, clip_norm = resumed[r]["adaptive"]
        assert clip_norm == pytest.approx(alone.clip_norm, rel=1e-12)
        for k in params:
            torch.testing.assert_close(params[k], alone.params[k], rtol=0, atol=1e-6)
    banded = make_trainer(distributed=False, bands=2)
    banded.fit(max_steps=4)
    for r in range(2):
        params, history, epsilon = resumed[r]["banded"]
        assert epsilon == banded.epsilon()
        for k in params:
            torch.testing.assert_close(params[k], banded.params[k], rtol=0, atol=1e-6)
            assert torch.equal(history[k], resumed[0]["banded"][1][k])
            torch.testing.assert_close(history[k], banded.state.noise_state.history[k])
    assert resumed[0]["drawn_seed"].bit_length() > 200
    assert "could not be loaded on ranks [1]" in resumed[0]["errors"]["load"]
    assert (
        "missing.pt" in resumed[1]["errors"]["load"]
        and "unreadable" in resumed[1]["errors"]["load"]
    )
    assert single.history[0]["loss"] == pytest.approx(whole[0]["history"][0]["loss"], abs=1e-6)


def test_boundaries_and_a_one_rank_group_in_this_process(monkeypatch):
    with pytest.raises(ValueError, match="distributed=True needs an initialised"):
        make_trainer(distributed=True)
    with pytest.raises(RuntimeError, match=r"dpfunc.distributed.init\(\) first"):
        make_step(problem()[0], dpfunc.distributed.make_train_step)
    with pytest.raises(ValueError, match="timeout_s=0"):
        dpfunc.distributed.init(timeout_s=0)
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        dpfunc.distributed.init()

    address = f"tcp://127.0.0.1:{free_port()}"
    info = dpfunc.distributed.init("gloo", init_method=address, rank=0, world_size=1, timeout_s=10)
    try:
        assert info == (0, 1, torch.device("cpu"))
        with pytest.raises(RuntimeError, match="already initialised"):
            dpfunc.distributed.init(init_method=address, rank=0, world_size=1)
        detected = make_trainer(epochs=0.5)  # a process group exists: distributed
        alone = make_trainer(epochs=0.5, distributed=False)
        assert detected.distributed and not alone.distributed
        detected.fit()
        alone.fit()
        assert detected.steps_done == alone.steps_done == 4
        for k in alone.params:  # one rank: the all-reduce is the identity
            assert torch.equal(detected.params[k], alone.params[k])
        one_example_sum_stays_within_the_clip_norm()
    finally:
        dpfunc.distributed.shutdown()
    assert not dpfunc.distributed.is_initialized()


def one_example_sum_stays_within_the_clip_norm():
    """The all-reduced running sum (float32, within the margin): one example near C stays
    within C, and the one-call step (a float64 sum) releases the same bits."""
    size, clip_norm = 5000, 0.3
    params = {"w": torch.zeros(size)}

    def loss_fn(p, example):
        return (p["w"] * example).sum()  # the example's gradient is the example

    step = dpfunc.distributed.make_train_step(
        loss_fn, dpfunc.optim.sgd(lr=1.0), clip_norm=clip_norm, noise_multiplier=0.0,
        expected_batch_size=1.0,
    )  # fmt: skip
    x = torch.ones(size) * (clip_norm / math.sqrt(size))  # constant: the worst accumulation
    micro = []
    for real in (False, True):
        batch, mask = torch.randn(4, size), torch.zeros(4)
        if real:
            batch[2], mask[2] = x, 1.0
        micro.append((batch, mask))
    zeros = StepNoise({"w": torch.zeros(size)}, None)
    state = step.init(params)
    private, _, _ = step.logical_gradient(state, micro, zeros)  # the reduced sum, released
    assert private["w"].dtype == torch.float32
    assert float(torch.linalg.vector_norm(private["w"].double())) <= clip_norm
    one_call, _ = step(state, batch, mask, zeros.params)
    long_way, _ = step.logical_step(state, [(batch, mask)], zeros)
    assert torch.equal(one_call.params["w"], long_way.params["w"])


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1], sys.argv[2], float(sys.argv[3]), *sys.argv[4:]))
