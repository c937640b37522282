"""Sharded DP-SGD on torch.distributed: 2 and 4 gloo processes equal one process.

Each test launches this file as a script on W ranks (``python test_sharding.py
SCENARIO OUTDIR TIMEOUT_S`` with MASTER_ADDR, MASTER_PORT, RANK and
WORLD_SIZE set, as torchrun would); the ranks write what they computed, and
the test compares it with a single-process run computed here. One launch
per world size serves several checks: starting a rank costs seconds here.
"""

from __future__ import annotations

import math
import os
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import dpfunc
from dpfunc import data
from dpfunc.sharding import Sharding, check_elementwise, state_dims

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ranks  # noqa: E402 (the launcher beside this file)
from ranks import assert_ok, free_port, load_rank  # noqa: E402

N = 40  # examples
SAMPLE_RATE = 0.15  # expected batch 6: several micro-batches of PHYSICAL rows per rank
PHYSICAL = 2
STEPS = 3
SEED = 11  # a public seed: reproducible test runs, no privacy
GUARD_S = 240.0  # an overall limit on every launch
CONFIGS = {  # the privacy mechanisms a sharded step must carry over
    "plain": {},
    "adaptive": dict(target_quantile=0.5, count_noise_multiplier=2.0, clip_norm=0.1),
    "bands": dict(bands=2),
}
TRAINER = dict(
    epochs=1,  # 7 steps of expected size 6
    optimizer=dpfunc.optim.adam(lr=0.05),
    expected_batch_size=6,
    clip_norm=0.5,
    noise_multiplier=1.0,
    delta=1e-3,
    physical_batch_size=2,
    accounting="rdp",
    seed=3,
    progress=False,
)
RESUME_AT = 3
# user-level: 13 users of 3 examples (the last of 4), at most 2 a step, 3 users a step
USERS = dict(bands=1, privacy_unit="user", max_examples_per_user=2, expected_batch_size=3,
             users=[min(i // 3, 12) for i in range(N)])  # fmt: skip


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.block = nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens):
        return self.head(self.block(self.embed(tokens)).mean(dim=1))


def problem(kind: str, model_seed: int = 0, device: str = "cpu"):
    """(model, loss_fn, params, dataset, method) of one model family, on ``device``."""
    torch.manual_seed(model_seed)
    g = torch.Generator().manual_seed(123)
    y = torch.randint(0, 3, (N,), generator=g)
    if kind == "mlp":
        model = nn.Sequential(nn.Linear(4, 9), nn.Tanh(), nn.Linear(9, 3))
        x, method = torch.randn(N, 4, generator=g) * 2, "ghost"
    elif kind == "cnn":
        model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(48, 3))
        x, method = torch.randn(N, 1, 6, 6, generator=g), "auto"
    else:
        model = Transformer()
        x, method = torch.randint(0, 10, (N, 5), generator=g), "vmap"
    model.to(device)
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        xi, yi = example
        return F.cross_entropy(functional_call(model, (p, buffers), (xi.unsqueeze(0),)), yi[None])

    return model, loss_fn, params, (x.to(device), y.to(device)), method


def run_steps(
    kind: str, config: str, make, rank: int = 0, world_size: int = 1, device="cpu", **shard
):
    """STEPS logical steps of the functional step; returns the step and its last state."""
    model, loss_fn, params, dataset, method = problem(kind, rank, device)
    settings = dict(clip_norm=0.5, noise_multiplier=0.8, expected_batch_size=SAMPLE_RATE * N)
    settings.update(CONFIGS[config])
    optimizer = dpfunc.optim.adam(lr=0.05)
    step = make(loss_fn, optimizer, model=model, method=method, **settings, **shard)
    state = step.init(params)
    batches = data.PoissonBatches(
        dataset, SAMPLE_RATE, PHYSICAL, seed=SEED, rank=rank, world_size=world_size
    )
    for t in range(STEPS):
        micro, _ = batches.logical_batch(t)
        noise = step.draw_noise(state.params, seed=SEED, step=t)
        state, _ = step.logical_step(state, micro, noise)
    return step, state


def one_call_steps(rank: int = 0, world_size: int = 1, **shard) -> dict:
    """Two steps of ``step(state, batch, mask, noise)``: no accumulation, each rank's rows."""
    make = dpfunc.distributed.make_train_step if shard else dpfunc.make_train_step
    step, state = run_steps("mlp", "adaptive", make, rank, world_size, **shard)
    _, _, _, (x, y), _ = problem("mlp")
    mine = slice(rank, 12, world_size)  # this rank's share of the first 12 examples
    for t in range(STEPS, STEPS + 2):
        noise = step.draw_noise(state.params, seed=SEED, step=t)
        batch, mask = (x[mine], y[mine]), torch.ones(12 // world_size, dtype=torch.bool)
        state, metrics = step(state, batch, mask, *noise)
    return {"params": step.full_params(state), "loss": float(metrics["loss"])}


def state_bytes(tree) -> int:
    return sum(x.numel() * x.element_size() for x in dpfunc.tree.tree_leaves(tree))


# --------------------------------------------------------------------------- workers


def worker(scenario: str, outdir: str, timeout_s: float) -> int:
    torch.set_num_threads(1)
    backend = "nccl" if scenario == "cuda" else "gloo"
    info = dpfunc.distributed.init(backend, timeout_s=timeout_s)
    rank, world_size = info.rank, info.world_size
    try:
        if scenario == "equal":
            result = equal_worker(rank, world_size, outdir)
        elif scenario == "cuda":  # NCCL, one GPU per rank
            make = dpfunc.distributed.make_train_step
            result = {
                config: run_steps("mlp", config, make, rank, world_size, info.device, shard=True)
                for config in CONFIGS
            }
            result = {k: step.full_params(state) for k, (step, state) in result.items()}
        elif scenario == "compiled":  # the step's local pieces through torch.compile
            settings = {**TRAINER, "epochs": 0.5}
            trainer = dpfunc.Trainer(*trainer_problem(), shard=True, compile=True, **settings)
            trainer.fit()
            result = trainer.full_params()
        elif scenario == "resume":
            result = resume_worker(outdir)
        elif scenario == "die":
            return die_worker(rank, outdir)
        else:
            raise ValueError(f"unknown scenario {scenario!r}")
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dpfunc.distributed.shutdown()
    return 0


def equal_worker(rank: int, world_size: int, outdir: str) -> dict:
    result = {}
    make = dpfunc.distributed.make_train_step
    for kind in ("mlp", "cnn", "transformer"):
        for config in CONFIGS:
            step, state = run_steps(kind, config, make, rank, world_size, shard=True)
            result[kind, config] = {
                "params": step.full_params(state),
                "rows": state.params,
                "bytes": {
                    "params": state_bytes(state.params),
                    "opt_state": state_bytes(state.opt_state),
                    "noise_state": state_bytes(state.noise_state.history),
                },
            }
    # each weight gathered and reduced by its own collective (as large layers are), biases together
    alone, dpfunc.sharding.GATHER_ALONE_BYTES = dpfunc.sharding.GATHER_ALONE_BYTES, 64
    try:
        step, state = run_steps("mlp", "plain", make, rank, world_size, shard=True)
        gathers = step.collectives.layout()._gathers(dpfunc.tree.tree_leaves(state.params))
        result["alone"] = {"params": step.full_params(state), "gathers": gathers}
        # rows that divide evenly (sent as they are), rows that do not (padded), a small leaf
        base = {"even": torch.arange(24.0).view(8, 3), "odd": torch.arange(18.0).view(9, 2),
                "small": torch.arange(3.0)}  # fmt: skip
        layout = Sharding(base, rank, world_size)
        mine = layout.reduce_scatter({k: v * (rank + 1) for k, v in base.items()})
        result["alone"] |= {"reduced": layout.unshard(mine), "layout_gathers": layout._gathers(
            dpfunc.tree.tree_leaves(base))}  # fmt: skip
    finally:
        dpfunc.sharding.GATHER_ALONE_BYTES = alone
    result["one_call"] = one_call_steps(rank, world_size, shard=True)
    result["private"] = private_run(rank, shard=True)
    result["users"] = private_run(rank, shard=True, **USERS)
    # the Trainer, sharded, with a sharded checkpoint at RESUME_AT
    first = dpfunc.Trainer(*trainer_problem(), shard=True, **TRAINER)
    first.fit(max_steps=RESUME_AT)
    first.save(os.path.join(outdir, f"run{world_size}"))
    first.fit()
    result["trainer"] = {"params": first.full_params(), "epsilon": first.epsilon()}
    return result


def private_run(model_seed: int = 0, bands: int = 2, **more) -> dict:
    """PrivateGradients with torch.optim.Adam; FSDP2 shards the model when shard=True.

    The first layer's bias is frozen: the loss reads it from the model, whole.
    Every rank starts from its own model; rank 0's, frozen parts included, is
    copied to every rank.
    """
    model, loss_fn, _, dataset, _ = problem("mlp", model_seed)
    model[0].bias.requires_grad_(False)
    settings = {k: v for k, v in TRAINER.items() if k not in ("optimizer", "progress")}
    settings.update(more)
    private = dpfunc.PrivateGradients(model, loss_fn, dataset, bands=bands, **settings)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=0.05)  # after the sharding
    for batch in private.batches():
        private.backward(batch)
        optimizer.step()
        optimizer.zero_grad()
    x = dataset[0][:5]
    whole = private.full_params()
    return {
        "params": whole,
        "forward": model(x).detach(),  # the model's own forward: FSDP2's hooks still work
        "functional": functional_call(model, whole, (x,)).detach()
        if not more.get("shard")
        else None,
        "optimizer_bytes": sum(
            state_bytes([t.to_local() if hasattr(t, "to_local") else t for t in v.values()])
            for v in optimizer.state.values()
        ),
        "epsilon": private.epsilon(),
    }


def trainer_problem():
    _, loss_fn, params, dataset, _ = problem("mlp")
    return loss_fn, params, dataset


def resume_worker(outdir: str) -> dict:
    """A fresh sharded Trainer continues each saved run (2 ranks' and, on 4, 4 ranks')."""
    out = {}
    for saved in sorted(f for f in os.listdir(outdir) if os.path.isdir(os.path.join(outdir, f))):
        resumed = dpfunc.Trainer(*trainer_problem(), shard=True, **TRAINER)
        resumed.load(os.path.join(outdir, saved))
        loaded = resumed.steps_done
        resumed.fit()
        out[saved] = {"params": resumed.full_params(), "loaded": loaded}
    return out


def die_worker(rank: int, outdir: str) -> int:
    """Rank 1 dies after the first checkpoint; rank 0 must fail with a clear error."""
    path = os.path.join(outdir, "dying")
    trainer = dpfunc.Trainer(*trainer_problem(), shard=True, **TRAINER)
    trainer.fit(max_steps=2)
    trainer.save(path)
    if rank == 1:
        os._exit(17)  # dies without a word to the others
    started = time.monotonic()
    try:
        trainer.fit()
    except RuntimeError as error:
        report = f"{type(error).__name__}\n{time.monotonic() - started:.3f}\n{error}"
        with open(os.path.join(outdir, "rank0.err"), "w") as f:
            f.write(report)
        return 3
    return 0


# --------------------------------------------------------------------------- launching


def launch(scenario, outdir, world_size, timeout_s=60.0, wait_for=None):
    """Runs the scenario on ``world_size`` ranks; returns [(returncode, log)] of ``wait_for``."""
    args = (scenario, outdir, timeout_s)
    return ranks.launch(
        __file__, args, outdir, world_size, guard_s=GUARD_S, wait_for=wait_for,
        log_prefix=f"{scenario}{world_size}-",
    )  # fmt: skip


def load_ranks(outdir, world_size):
    return [load_rank(outdir, r) for r in range(world_size)]


# --------------------------------------------------------------------------- tests

pytestmark = ranks.NEEDS_GLOO


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 'equal' scenario on 2 and on 4 ranks, sharing one folder of checkpoints."""
    outdir = tmp_path_factory.mktemp("sharded")
    out = {}
    for world_size in (2, 4):
        assert_ok(launch("equal", outdir, world_size))
        out[world_size] = load_ranks(outdir, world_size)
    return outdir, out


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("kind", ["mlp", "cnn", "transformer"])
def test_sharded_steps_equal_one_process(runs, world_size, kind):
    ranks = runs[1][world_size]
    for config in CONFIGS:
        step, alone = run_steps(kind, config, dpfunc.make_train_step)
        for name, value in alone.params.items():
            got = [r[kind, config]["params"][name] for r in ranks]
            for other in got[1:]:  # every rank gathers the same whole parameters
                assert torch.equal(other, got[0])
            torch.testing.assert_close(got[0], value, rtol=0, atol=2e-6, msg=(kind, config, name))
            assert not torch.equal(value, problem(kind)[2][name])  # it trained
            rows = torch.cat([r[kind, config]["rows"][name].reshape(-1) for r in ranks])
            assert torch.equal(rows, got[0].reshape(-1))  # the rows are the parameter, cut


@pytest.mark.parametrize("world_size", [2, 4])
def test_parameters_gathered_and_reduced_alone_or_together_agree(runs, world_size):
    for r in runs[1][world_size]:
        # leaves in key order (0.bias, 0.weight, 2.bias, 2.weight): the weights alone, biases shared
        assert r["alone"]["gathers"] == [[1], [3], [0, 2]]
        for name, value in r["alone"]["params"].items():
            together = r["mlp", "plain"]["params"][name]
            if world_size == 2:  # a + b either way: the same bits
                assert torch.equal(value, together), name
            else:  # gloo's ring adds 3+ ranks in an order that follows a value's place
                torch.testing.assert_close(value, together, rtol=0, atol=2e-6, msg=name)
        # even, odd, small (key order): the two 8- and 9-row leaves alone, the small one shared
        assert r["alone"]["layout_gathers"] == [[0], [1], [2]]
        base = {"even": torch.arange(24.0).view(8, 3), "odd": torch.arange(18.0).view(9, 2),
                "small": torch.arange(3.0)}  # fmt: skip
        ranks_sum = world_size * (world_size + 1) // 2  # rank r sent (r + 1) x base
        for name, value in base.items():
            assert torch.equal(r["alone"]["reduced"][name], value * ranks_sum), name


@pytest.mark.parametrize("world_size", [2, 4])
def test_one_call_steps_without_accumulation_equal_one_process(runs, world_size):
    alone = one_call_steps()
    for r in runs[1][world_size]:
        assert r["one_call"]["loss"] == pytest.approx(alone["loss"], abs=1e-6)  # all examples
        for name, value in alone["params"].items():
            torch.testing.assert_close(r["one_call"]["params"][name], value, rtol=0, atol=2e-6)


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_rank_holds_its_share_of_the_state(runs, world_size):
    ranks = runs[1][world_size]
    for kind in ("mlp", "transformer"):
        for config in ("plain", "bands"):
            step, alone = run_steps(kind, config, dpfunc.make_train_step)
            layout = Sharding(alone.params, 0, world_size)
            inits = {
                "params": lambda rows: rows,
                "opt_state": step.optimizer.init,
                "noise_state": step.noise_mechanism.init,
            }
            parts = {
                "params": alone.params,
                "opt_state": alone.opt_state,
                "noise_state": alone.noise_state,
            }
            for part, tree in parts.items():
                dims = state_dims(inits[part], layout)
                for rank, r in enumerate(ranks):
                    expected = 0  # the rows of each cut leaf, every leaf held whole
                    for leaf, dim in zip(dpfunc.tree.tree_leaves(tree), dims):
                        size = leaf.numel() * leaf.element_size()
                        if dim is None:
                            expected += size
                            continue
                        (shape, axis), chunk = dim, math.ceil(dim[0][dim[1]] / world_size)
                        held = max(0, min(shape[axis], (rank + 1) * chunk) - rank * chunk)
                        expected += size // shape[axis] * held
                    assert r[kind, config]["bytes"][part] == expected, (kind, config, part, rank)
                whole = state_bytes(tree)
                held = [r[kind, config]["bytes"][part] for r in ranks]
                if whole:  # about 1/world each: at most one more row of every leaf
                    assert max(held) < whole / world_size * 1.5 + 200, (kind, part, held, whole)


@pytest.mark.parametrize("world_size", [2, 4])
def test_private_gradients_sharded_by_fully_shard_equal_one_process(runs, world_size):
    ranks = [r["private"] for r in runs[1][world_size]]
    alone = private_run(0)
    for r in ranks:
        assert r["epsilon"] == alone["epsilon"]
        for name, value in alone["params"].items():
            torch.testing.assert_close(r["params"][name], value, rtol=0, atol=2e-6)
        torch.testing.assert_close(r["forward"], alone["forward"], rtol=0, atol=1e-5)
    held = [r["optimizer_bytes"] for r in ranks]  # Adam's moments: this rank's rows
    assert sum(held) <= alone["optimizer_bytes"] + 8 * 4 * world_size  # + the step counts
    assert max(held) < alone["optimizer_bytes"] * 0.75


@pytest.mark.parametrize("world_size", [2, 4])
def test_user_level_private_gradients_sharded_equal_one_process(runs, world_size):
    ranks = [r["users"] for r in runs[1][world_size]]
    alone = private_run(0, **USERS)
    assert alone["epsilon"] > 0
    for r in ranks:
        assert r["epsilon"] == alone["epsilon"]
        for name, value in alone["params"].items():
            torch.testing.assert_close(r["params"][name], value, rtol=0, atol=2e-6)


def test_trainer_resumes_sharded_bit_identically_and_on_more_ranks(runs):
    outdir, out = runs
    single = dpfunc.Trainer(*trainer_problem(), distributed=False, **TRAINER)
    single.fit()
    for world_size in (2, 4):
        for r in out[world_size]:
            assert r["trainer"]["epsilon"] == single.epsilon()
            for name, value in single.params.items():
                torch.testing.assert_close(r["trainer"]["params"][name], value, rtol=0, atol=2e-6)
    for world_size in (2, 4):
        assert_ok(launch("resume", outdir, world_size))
        resumed = load_ranks(outdir, world_size)
        for r in resumed:
            for saved, saved_world in (("run2", 2), ("run4", 4)):
                assert r[saved]["loaded"] == RESUME_AT
                uninterrupted = out[saved_world][0]["trainer"]["params"]
                for name, value in r[saved]["params"].items():
                    if saved_world == world_size:  # the same ranks: bit-identical
                        assert torch.equal(value, uninterrupted[name]), (saved, world_size, name)
                    else:  # another number of ranks: the sums round differently
                        torch.testing.assert_close(value, uninterrupted[name], rtol=0, atol=2e-6)


def test_a_dead_rank_fails_the_other_clearly_and_the_checkpoint_survives(tmp_path):
    started = time.monotonic()
    ((code, log),) = launch("die", tmp_path, 2, timeout_s=10.0, wait_for=(0,))
    assert code == 3, f"rank 0 exited with {code}, expected the caught error:\n{log[-3000:]}"
    kind, waited, message = (tmp_path / "rank0.err").read_text().split("\n", 2)
    assert kind == "CollectiveError" and "rank 0 of 2" in message
    assert float(waited) < 10.0 + 3.0 and time.monotonic() - started < GUARD_S
    assert_ok(launch("resume", tmp_path, 2))  # the last checkpoint loads
    resumed = load_ranks(tmp_path, 2)
    assert resumed[0]["dying"]["loaded"] == 2


@pytest.mark.slow
def test_a_compiled_sharded_trainer_equals_one_eager_process(tmp_path):
    assert_ok(launch("compiled", tmp_path, 2))
    alone = dpfunc.Trainer(*trainer_problem(), distributed=False, **{**TRAINER, "epochs": 0.5})
    alone.fit()
    for r in load_ranks(tmp_path, 2):
        for name, value in alone.params.items():
            torch.testing.assert_close(r[name], value, rtol=0, atol=2e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sharded_steps_on_cuda_equal_one_process(tmp_path):
    """NCCL on up to 2 GPUs (one rank per GPU; one GPU: a world of one, still sharded)."""
    world_size = min(torch.cuda.device_count(), 2)
    assert_ok(launch("cuda", tmp_path, world_size))
    ranks = load_ranks(tmp_path, world_size)
    for config in CONFIGS:
        _, alone = run_steps("mlp", config, dpfunc.make_train_step, device="cuda")
        for name, value in alone.params.items():
            for r in ranks:
                got = r[config][name]
                assert got.device.type == "cuda"
                torch.testing.assert_close(got, value, rtol=0, atol=2e-5, msg=(config, name))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_noise_rows_are_rows_of_the_whole_draw():
    params = {"w": torch.zeros(7, 300, device="cuda"), "b": torch.zeros(5, device="cuda")}
    whole = dpfunc.standard_normal_like(params, seed=5, step=2)
    for world_size in (2, 3):
        for rank in range(world_size):
            layout = Sharding(params, rank, world_size)
            mine = dpfunc.standard_normal_like(
                layout.shard(params), seed=5, step=2, rows=layout.noise_rows()
            )
            for i, name in enumerate(sorted(params)):
                start, stop = layout.rows(i)
                assert torch.equal(mine[name], whole[name][start:stop])


@pytest.fixture
def one_rank():
    """A gloo group of one rank in this process: sharded code paths, no launch."""
    address = f"tcp://127.0.0.1:{free_port()}"
    dpfunc.distributed.init("gloo", init_method=address, rank=0, world_size=1, timeout_s=30)
    try:
        yield
    finally:
        dpfunc.distributed.shutdown()


def test_a_sharded_step_refuses_noise_it_did_not_draw(one_rank):
    _, loss_fn, params, dataset, _ = problem("mlp")
    step = dpfunc.distributed.make_train_step(
        loss_fn, dpfunc.optim.sgd(lr=0.1), clip_norm=1.0, noise_multiplier=1.0,
        expected_batch_size=4.0, shard=True,
    )  # fmt: skip
    state = step.init(params)
    batch, mask = (dataset[0][:4], dataset[1][:4]), torch.ones(4, dtype=torch.bool)
    # every rank would draw the same first rows: differences of sums without noise
    plain = dpfunc.standard_normal_like(state.params, seed=SEED, step=0)
    with pytest.raises(ValueError, match="takes the noise of step 0 from step.draw_noise"):
        step(state, batch, mask, plain)
    drawn = step.draw_noise(state.params, seed=SEED, step=0)
    with pytest.raises(ValueError, match="takes the noise of step 0 from step.draw_noise"):
        step.logical_gradient(state, [(batch, mask)], drawn._replace(params=plain))
    with pytest.raises(ValueError, match="takes the noise of step 0 from step.draw_noise"):
        step.logical_step(state, [(batch, mask)], drawn._replace(params=plain))
    state, _ = step.logical_step(state, [(batch, mask)], drawn)  # drawn here: taken
    assert int(state.step) == 1
    with pytest.raises(ValueError, match="takes the noise of step 1"):  # step 0's, again
        step.logical_step(state, [(batch, mask)], drawn)
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    with pytest.raises(Exception) as caught:  # a user's own compile cannot skip the check
        compiled(state, batch, mask, plain)
    assert "step.compile()" in str(caught.value) or "Observed exception" in str(caught.value)


def test_sharded_boundaries_name_what_to_do(one_rank, tmp_path):
    model, loss_fn, params, dataset, _ = problem("mlp")
    step = dpfunc.distributed.make_train_step(
        loss_fn, dpfunc.optim.sgd(lr=0.1), clip_norm=1.0, noise_multiplier=1.0,
        expected_batch_size=4.0, shard=True, model=model,
    )  # fmt: skip
    state = step.init(params)
    batch = (dataset[0][:4], dataset[1][:4])
    assert step.explain(step.full_params(state), batch) == step.explain(params, batch)
    (tmp_path / "file.pt").write_bytes(b"")
    trainer = dpfunc.Trainer(*trainer_problem(), shard=True, **TRAINER)
    with pytest.raises(ValueError, match="must be a directory for a sharded run"):
        trainer.save(tmp_path / "file.pt")  # every rank raises; none waits
    trainer.save(tmp_path / "sharded")
    alone = dpfunc.Trainer(*trainer_problem(), distributed=False, **TRAINER)
    with pytest.raises(ValueError, match="is a sharded checkpoint"):
        alone.load(tmp_path / "sharded")


def test_check_elementwise_refuses_a_leaf_wise_optimizer_at_the_real_widths():
    def leaf_norm_scaled(lr):  # reads the whole leaf, but only from width 8 on
        def init(params):
            return dpfunc.optim.EmptyState()

        def update(grads, state, params=None):
            def one(g):
                wide = g.dim() > 1 and g.shape[1] >= 8
                return -lr * (g / g.norm() if wide else g)

            return dpfunc.tree.tree_map(one, grads), state

        return dpfunc.optim.GradientTransformation(init, update)

    params = {"w": torch.zeros(6, 16), "b": torch.zeros(6)}
    with pytest.raises(ValueError, match="updates a parameter's rows differently"):
        check_elementwise(leaf_norm_scaled(0.1), params, world_size=2)
    for optimizer in (
        dpfunc.optim.adamw(lr=lambda t: 0.1 / (1 + t), weight_decay=0.1),
        dpfunc.optim.chain(dpfunc.optim.scale(0.5), dpfunc.optim.sgd(lr=0.1, momentum=0.9)),
    ):
        check_elementwise(optimizer, params, world_size=3)  # element-wise: accepted


def test_sharded_checkpoints_are_private_checked_and_never_half_loaded(
    one_rank, tmp_path, monkeypatch
):
    path = tmp_path / "ckpt"
    run = dpfunc.Trainer(*trainer_problem(), shard=True, bands=2, **TRAINER)
    run.fit(max_steps=2)
    run.save(path)
    (save,) = [d for d in path.iterdir() if d.name.startswith("step-")]
    assert (path / "latest").read_text() == save.name
    assert path.stat().st_mode & 0o077 == 0 and save.stat().st_mode & 0o077 == 0
    assert all(f.stat().st_mode & 0o077 == 0 for f in save.iterdir())  # the noise history too

    wide_params = {k: v.double() for k, v in problem("mlp")[2].items()}
    wide = dpfunc.Trainer(problem("mlp")[1], wide_params, problem("mlp")[3], shard=True,
                          bands=2, **TRAINER)  # fmt: skip
    with pytest.raises(ValueError, match="params tensors do not match"):
        wide.load(path)  # float32 rows into a float64 run
    assert wide.steps_done == 0

    fresh = dpfunc.Trainer(*trainer_problem(), shard=True, bands=2, **TRAINER)
    before = {k: v.clone() for k, v in fresh.params.items()}

    def torn_load(state_dict, **kwargs):  # writes some of what it loads, then fails
        from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

        for part in state_dict.values():
            for tensor in part.values():
                getattr(tensor, "_local_tensor", tensor).fill_(7.0)
        raise CheckpointException("a torn shard file", {0: _wrap_exception(ValueError("torn"))})

    monkeypatch.setattr(torch.distributed.checkpoint, "load", torn_load)
    with pytest.raises(ValueError, match="torch.distributed.checkpoint load"):
        fresh.load(path)
    assert fresh.steps_done == 0
    for k, v in before.items():  # nothing was written into the trainer's state
        assert torch.equal(fresh.params[k], v)


def test_private_gradients_shard_follows_the_models_own_forward(one_rank):
    settings = {k: v for k, v in TRAINER.items() if k not in ("optimizer", "progress")}
    model, loss_fn, _, dataset, _ = problem("mlp")
    private = dpfunc.PrivateGradients(model, loss_fn, dataset, shard=True, **settings)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in private.batches(3):
        with torch.no_grad():
            model(dataset[0][:3])  # an evaluation between steps: FSDP2 gathers the root
        private.backward(batch)
        optimizer.step()
    assert private.steps_done == 3


def test_a_first_sharded_save_that_never_completed_does_not_block_a_rerun(tmp_path):
    path = tmp_path / "ckpt"
    (path / "step-000000002-0a1b2c3d").mkdir(parents=True)  # no `latest`: never completed
    callback = dpfunc.callbacks.Checkpoint(path)  # accepted; nothing to resume
    assert not dpfunc.checkpoint.exists(path)
    (path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="must name a file"):
        dpfunc.callbacks.Checkpoint(path)  # a directory of other files is not a checkpoint
    assert callback.path == path


def test_shard_needs_a_distributed_run():
    with pytest.raises(ValueError, match="shard=True splits the model over the ranks"):
        dpfunc.Trainer(*trainer_problem(), shard=True, **TRAINER)
    with pytest.raises(TypeError, match="shard must be a bool"):
        dpfunc.Trainer(*trainer_problem(), shard="yes", **TRAINER)
    model, loss_fn, _, dataset, _ = problem("mlp")
    settings = {k: v for k, v in TRAINER.items() if k not in ("optimizer", "progress")}
    with pytest.raises(ValueError, match="shard=True splits the model over the ranks"):
        dpfunc.PrivateGradients(model, loss_fn, dataset, shard=True, **settings)
    assert not any(hasattr(p, "placements") for p in model.parameters())  # left as it was


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1], sys.argv[2], float(sys.argv[3])))
