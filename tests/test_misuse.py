"""Ordinary mistakes never break the printed guarantee: each is refused, or gives the right result.

Each test is a habit of a user porting a loop from another library, or a slip
anyone makes (resuming one checkpoint twice, two runs on one path, editing the
batch they were handed), measured with the noise either off (so any
non-private leak shows exactly) or on (so shared noise shows as a noiseless
difference).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import dpfunc

CLIP = 1.05
EXPECTED = 20.0


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def data(n: int = 60):
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 5, generator=g) * 3, torch.randint(0, 3, (n,), generator=g)


def loss_for(model):
    def loss_fn(params, example):
        x, y = example
        return F.cross_entropy(functional_call(model, params, (x[None],)), y[None])

    return loss_fn


def private_for(model, noise_multiplier=0.0, **overrides):
    settings = dict(
        expected_batch_size=EXPECTED, clip_norm=CLIP, noise_multiplier=noise_multiplier,
        delta=1e-5, epochs=2, method="vmap",
    )  # fmt: skip
    settings.update(overrides)
    return dpfunc.PrivateGradients(model, loss_for(model), data(), **settings)


def grad_norm(model):
    return float(
        torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm()
    )


# ------------------------------------------------------------------ p.grad belongs to the step


def test_a_later_loss_backward_is_refused_before_it_reaches_the_private_gradient():
    """Opacus habit: backward of the private step, then loss.backward(), then step."""
    model = mlp()
    private = private_for(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = next(private.batches())
    private.backward(batch)
    written = {name: p.grad.clone() for name, p in model.named_parameters()}
    bound = CLIP * private.plan.batches.indices(0).numel() / EXPECTED
    assert grad_norm(model) <= bound * (1 + 1e-6)
    x, y = data()
    loss = F.cross_entropy(model(x[:8]), y[:8])
    with pytest.raises(RuntimeError, match="under torch.no_grad.*before private.backward"):
        loss.backward()
    for name, p in model.named_parameters():  # nothing was added
        assert torch.equal(p.grad, written[name]), name
    optimizer.step()  # the private gradient alone: allowed
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x[:8]), y[:8])
    loss.backward()  # after zero_grad autograd may write again...
    with pytest.raises(RuntimeError, match="SGD.step.. refused.*not the private gradient"):
        optimizer.step()  # ...but its gradient is never stepped


def test_the_opacus_order_loss_backward_then_private_backward_steps_the_private_gradient():
    model = mlp()
    private = private_for(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data()
    for batch in private.batches(3):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()  # overwritten by the private gradient
        private.backward(batch)
        optimizer.step()
    assert private.steps_done == 3


def test_a_stale_gradient_on_a_frozen_parameter_never_moves_it():
    model = mlp()
    x, y = data()
    F.cross_entropy(model(x), y).backward()  # a non-private gradient everywhere
    model[0].bias.requires_grad_(False)  # then frozen, its .grad left behind
    frozen = model[0].bias.detach().clone()
    private = private_for(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # holds the frozen bias too
    with pytest.warns(UserWarning, match="cleared the .grad of frozen parameters"):
        for batch in private.batches(2):  # the README loop
            private.backward(batch)
            optimizer.step()
            optimizer.zero_grad()
    assert torch.equal(model[0].bias.detach(), frozen)
    private.backward(next(private.batches(1)))
    model[0].bias.grad = torch.ones_like(frozen)  # set by hand after backward
    with pytest.raises(RuntimeError, match="frozen parameter .* holds a .grad"):
        optimizer.step()


def test_the_guard_holds_nothing_once_the_run_is_gone():
    model = mlp()
    private = private_for(model)
    private.backward(next(private.batches(1)))
    del private
    gc.collect()
    x, y = data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    F.cross_entropy(model(x), y).backward()  # the model is the user's again
    optimizer.step()


# ------------------------------------------------------------------ forks never share noise


def first_grads_after_resume(saved, seed):
    model = mlp()
    private = private_for(model, noise_multiplier=1.0, seed=seed)
    private.load_state_dict(saved)
    private.backward(next(private.batches(1)))
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.filterwarnings("ignore:the private gradient of step")
def test_two_continuations_of_one_state_dict_release_different_noise():
    model = mlp()
    private = private_for(model, noise_multiplier=1.0)
    for batch in private.batches(2):
        private.backward(batch)
    saved = private.state_dict()
    a, b = first_grads_after_resume(saved, None), first_grads_after_resume(saved, None)
    std = 1.0 * CLIP / EXPECTED  # of each release's noise
    assert float((a - b).abs().max()) > std  # the difference holds two independent noises
    report = str(private.privacy_report())
    assert "continuations" in report


def test_a_fixed_seed_resumes_bit_identically():
    model = mlp()
    private = private_for(model, noise_multiplier=1.0, seed=99)
    private.backward(next(private.batches(1)))
    saved = private.state_dict()
    assert torch.equal(first_grads_after_resume(saved, 99), first_grads_after_resume(saved, 99))


def test_two_trainers_resuming_one_checkpoint_draw_their_own_noise(tmp_path, tiny_problem):
    loss_fn, params, dataset, _ = tiny_problem(60)

    def trainer():
        return dpfunc.Trainer(
            loss_fn, params, dataset, optimizer=dpfunc.optim.sgd(lr=0.5), epochs=2,
            expected_batch_size=10, clip_norm=1.0, noise_multiplier=1.0, delta=1e-5,
            progress=False,
        )  # fmt: skip

    first = trainer()
    first.fit(max_steps=4)
    first.save(tmp_path / "run.pt")
    forks = [trainer(), trainer()]
    for fork in forks:
        fork.load(tmp_path / "run.pt")
        fork.fit(max_steps=1)
    assert forks[0].seed == forks[1].seed == first.seed  # the run's partitions
    assert forks[0].stream_seed != forks[1].stream_seed
    assert any(not torch.equal(forks[0].params[k], forks[1].params[k]) for k in params)


# ------------------------------------------------------------------ one live run per path


def make_trainer(tiny_problem, **options):
    loss_fn, params, dataset, _ = tiny_problem(60)
    settings = dict(
        optimizer=dpfunc.optim.sgd(lr=0.5), epochs=2, expected_batch_size=10, clip_norm=1.0,
        noise_multiplier=1.0, delta=1e-5, progress=False,
    )  # fmt: skip
    return dpfunc.Trainer(loss_fn, params, dataset, **{**settings, **options})


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_run_in_a_forked_child_after_a_run_in_its_parent_finishes(monkeypatch, tiny_problem):
    """A sweep that forks after a first run: the parent's draw-ahead worker has no thread in
    the child, whose Trainer waited forever on its first draw ahead; it gets a new one."""
    import signal

    monkeypatch.setattr(dpfunc.step, "_spare_core", lambda params: True)  # always draw ahead
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # no OpenMP team in the child (not fork-safe)
    try:
        make_trainer(tiny_problem, epochs=1).fit()
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if its run finishes
            code = 1
            try:
                signal.alarm(60)  # a hang fails the test instead of stalling the suite
                trainer = make_trainer(tiny_problem, epochs=1)
                trainer.fit()
                code = 0 if trainer.steps_done > 1 else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        torch.set_num_threads(before)


def test_a_second_run_on_a_live_path_is_refused_before_any_step(tmp_path, tiny_problem):
    path = tmp_path / "run.pt"
    a = make_trainer(tiny_problem, checkpoint_path=path)
    with pytest.raises(ValueError, match="held by another live run"):
        make_trainer(tiny_problem, checkpoint_path=path)
    a.fit(max_steps=4)
    b = make_trainer(tiny_problem)  # no path of its own: a manual save is refused too
    with pytest.raises(ValueError, match="held by another live run"):
        b.save(path)
    del a
    gc.collect()
    with pytest.warns(UserWarning, match="resumed"):
        c = make_trainer(tiny_problem, checkpoint_path=path)
    assert c.steps_done == 4


def test_a_killed_process_leaves_no_lock(tmp_path, tiny_problem):
    path = tmp_path / "run.pt"
    script = textwrap.dedent(
        f"""
        import os, torch, dpfunc
        x, y = torch.randn(60, 4), torch.randint(0, 3, (60,))
        params = {{"w": torch.zeros(4, 3)}}
        loss = lambda p, e: torch.nn.functional.cross_entropy((e[0] @ p["w"])[None], e[1][None])
        t = dpfunc.Trainer(loss, params, (x, y), optimizer=dpfunc.optim.sgd(lr=0.1), epochs=1,
                           expected_batch_size=10, clip_norm=1.0, noise_multiplier=1.0,
                           delta=1e-5, progress=False, checkpoint_path={str(path)!r})
        t.save({str(path)!r})
        os.kill(os.getpid(), 9)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert done.returncode == -9, done.stderr.decode()[-2000:]
    assert path.exists()
    loss_fn = lambda p, e: F.cross_entropy((e[0] @ p["w"])[None], e[1][None])  # noqa: E731
    with pytest.warns(UserWarning, match="resumed"):
        dpfunc.Trainer(
            loss_fn, {"w": torch.zeros(4, 3)}, (torch.randn(60, 4), torch.randint(0, 3, (60,))),
            optimizer=dpfunc.optim.sgd(lr=0.1), epochs=1, expected_batch_size=10, clip_norm=1.0,
            noise_multiplier=1.0, delta=1e-5, progress=False, checkpoint_path=path,
        )  # fmt: skip


def test_the_record_of_accounted_steps_is_never_overwritten_by_another_run(tmp_path, tiny_problem):
    path = tmp_path / "run.pt"
    a = make_trainer(tiny_problem)
    a.fit(max_steps=4)
    a.save(path)
    del a
    gc.collect()
    b = make_trainer(tiny_problem)  # another run, not resumed from the file
    b.fit(max_steps=2)
    with pytest.raises(ValueError, match=r"another run's checkpoint \(4 accounted steps\)"):
        b.save(path)
    fork1, fork2 = make_trainer(tiny_problem), make_trainer(tiny_problem)
    fork1.load(path)
    fork2.load(path)
    fork1.fit(max_steps=1)
    fork1.save(path)  # a continuation may replace what it continued
    del fork1  # (its lock would refuse fork2 first)
    gc.collect()
    fork2.fit(max_steps=3)
    with pytest.raises(ValueError, match="another run's checkpoint"):
        fork2.save(path)  # but not its sibling's record, even with more steps
    (tmp_path / "notes.txt").write_text("my data")
    with pytest.raises(ValueError, match="not a readable dpfunc checkpoint"):
        fork2.save(tmp_path / "notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "my data"


def test_a_damaged_checkpoint_says_what_it_is(tmp_path, tiny_problem):
    path = tmp_path / "run.pt"
    path.write_bytes(b"PK\x03\x04 not really")
    with pytest.raises(ValueError, match="damaged .* Resume from an intact copy") as caught:
        make_trainer(tiny_problem).load(path)
    assert "weights_only=False" not in str(caught.value).split("torch.load said")[0]


# ------------------------------------------------------------------ a batch is what was drawn


@pytest.mark.parametrize(
    "tamper",
    [
        lambda b: b.micro_batches[0][1].fill_(1),  # padding rows counted
        lambda b: b.micro_batches[0][0][0].mul_(10),  # examples edited in place
        lambda b: b.micro_batches.__setitem__(0, b.micro_batches[-1]),  # a micro-batch replaced
        lambda b: b.micro_batches.append(b.micro_batches[0]),  # one added
    ],
    ids=["mask", "examples", "replaced", "added"],
)
def test_a_changed_batch_is_refused(tamper):
    model = mlp()
    private = private_for(model, physical_batch_size=8)  # a few micro-batches
    batch = next(private.batches(1))
    assert len(batch.micro_batches) > 1
    tamper(batch)
    with pytest.raises(ValueError, match="changed after batches.. yielded it"):
        private.backward(batch)
    assert private.steps_done == 0


def test_a_change_torch_cannot_see_still_releases_the_sampled_batch():
    """Through .data the version counter stays: backward reads its own copy, not the yielded one."""
    released = []
    for tamper in (False, True):
        model = mlp()
        private = private_for(model, physical_batch_size=30, seed=5)
        batch = next(private.batches(1))
        if tamper:
            batch.micro_batches[0][1].data.fill_(1)
            batch.micro_batches[0][0][0].data.mul_(10)
        private.backward(batch)
        released.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.equal(*released)


def test_a_batch_of_ones_own_is_refused():
    private = private_for(mlp())
    batch = next(private.batches(1))
    forged = dpfunc.LogicalBatch(batch.step, list(batch.micro_batches), batch.size)
    with pytest.raises(ValueError, match="not the one batches.. yielded"):
        private.backward(forged)


def test_steps_per_epoch_rounds_and_says_so():
    """1437 examples at 128 a batch: round(1437 / 128) = 11 steps an epoch, not len(loader) = 12."""
    x, y = torch.randn(1437, 5), torch.randint(0, 3, (1437,))
    model = mlp()
    private = dpfunc.PrivateGradients(
        model, loss_for(model), (x, y), expected_batch_size=128, clip_norm=1.0,
        noise_multiplier=1.0, delta=1e-5, epochs=10,
    )  # fmt: skip
    assert private.steps_per_epoch == 11 and private.total_steps == 110


if os.name != "posix":  # the lock is flock's
    pytestmark = pytest.mark.skip("POSIX only")


def test_a_private_gradient_never_stepped_is_not_dropped_silently():
    """Opacus' virtual steps habit: several backward calls, one optimizer step."""
    model = mlp()
    private = private_for(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = private.batches(3)
    private.backward(next(batches))
    with pytest.warns(UserWarning, match="never applied by an optimizer step"):
        private.backward(next(batches))
    optimizer.step()  # no zero_grad: the next backward overwrites a gradient already applied
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        private.backward(next(batches))


def test_a_parameter_resized_before_the_first_backward_is_named():
    model = mlp()
    private = private_for(model)
    with torch.no_grad():
        model[2].bias.data = torch.zeros(2)  # resized in place: the same Parameter object
    with pytest.raises(ValueError, match=r"'2.bias' changed shape from \(3,\) to \(2,\)"):
        private.backward(next(private.batches(1)))
    assert private.steps_done == 0


def test_the_loop_runs_under_inference_mode():
    model = mlp()
    private = private_for(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.inference_mode():
        for batch in private.batches(2):
            private.backward(batch)
            optimizer.step()
            optimizer.zero_grad()
    assert private.steps_done == 2


def test_loading_into_a_run_that_already_wrote_gradients_is_refused():
    model = mlp()
    private = private_for(model, noise_multiplier=1.0)
    private.backward(next(private.batches(1)))
    saved = private.state_dict()
    other = private_for(mlp(), noise_multiplier=1.0)
    other.backward(next(other.batches(1)))  # its own step, in its model
    with pytest.raises(ValueError, match="already written 1 private gradients"):
        other.load_state_dict(saved)
    assert other.steps_done == 1


def test_a_second_run_on_a_trained_model_says_its_epsilon_does_not_count_the_first():
    model = mlp()

    def train_once():  # a helper that builds its run inside: the run is gone after it
        private = private_for(model, noise_multiplier=1.0)
        private.backward(next(private.batches(1)))
        return private.state_dict()

    saved = train_once()
    gc.collect()
    with pytest.warns(UserWarning, match="already received 1 private gradients"):
        train_once()
    resumed = private_for(model, noise_multiplier=1.0)  # continues the last run: no warning
    resumed.load_state_dict(saved)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # the record is of the second run, which resumed does not continue
        with pytest.raises(UserWarning, match="already received"):
            resumed.backward(next(resumed.batches(1)))


def test_a_continuation_of_the_run_that_trained_the_model_is_not_warned():
    model = mlp()
    first = private_for(model, noise_multiplier=1.0)
    first.backward(next(first.batches(1)))
    saved = first.state_dict()
    resumed = private_for(model, noise_multiplier=1.0)
    resumed.load_state_dict(saved)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.backward(next(resumed.batches(1)))


def test_autograd_after_the_step_is_let_through_but_never_stepped():
    """zero_grad at the top of the loop, then an adversarial-example pass after it."""
    model = mlp()
    private = private_for(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data()
    for batch in private.batches(2):
        optimizer.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()  # overwritten by the private gradient
        private.backward(batch)
        optimizer.step()
    F.cross_entropy(model(x), y).backward()  # e.g. FGSM: allowed, the step was applied
    with pytest.raises(RuntimeError, match="not the private gradient"):
        optimizer.step()


def test_a_parameter_unfrozen_after_the_run_was_built_is_not_stepped():
    model = mlp()
    model[0].weight.requires_grad_(False)
    private = private_for(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    private.backward(next(private.batches(1)))
    optimizer.step()
    optimizer.zero_grad()
    model[0].weight.requires_grad_(True)  # gradual unfreezing
    x, y = data()
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="frozen when PrivateGradients was built"):
        optimizer.step()


def test_close_ends_the_guard_and_keeps_the_accounting():
    model = mlp()
    private = private_for(model, noise_multiplier=1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    private.backward(next(private.batches(1)))
    optimizer.step()
    epsilon = private.epsilon()
    private.close()
    x, y = data()
    F.cross_entropy(model(x), y).backward()  # public fine-tuning, say
    optimizer.step()
    assert private.epsilon() == epsilon > 0
    with pytest.raises(RuntimeError, match="closed"):
        private.backward(next(private.batches(1)))


def test_a_model_once_guarded_converts_with_swapped_tensors():
    model = mlp()
    private = private_for(model)
    private.backward(next(private.batches(1)))
    del private
    gc.collect()
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.double()  # swap_tensors refuses a parameter that has a weak reference
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    assert model[0].weight.dtype == torch.float64


def test_a_trainable_tensor_outside_the_model_is_refused():
    model = mlp()
    temperature = torch.ones((), requires_grad=True)  # the optimizer holds it too

    def loss_fn(params, example):
        x, y = example
        out = functional_call(model, params, (x[None],)) / temperature
        return F.cross_entropy(out, y[None])

    private = dpfunc.PrivateGradients(
        model, loss_fn, data(), expected_batch_size=EXPECTED, clip_norm=CLIP,
        noise_multiplier=1.0, delta=1e-5, epochs=1, method="vmap",
    )  # fmt: skip
    with pytest.raises(ValueError, match="requires grad but is not a trainable parameter"):
        private.backward(next(private.batches(1)))
    assert private.steps_done == 0


def test_a_rollback_to_an_earlier_copy_never_overwrites_the_longer_record(tmp_path, tiny_problem):
    path, copy = tmp_path / "run.pt", tmp_path / "copy.pt"
    a = make_trainer(tiny_problem)
    a.fit(max_steps=2)
    a.save(copy)
    a.fit(max_steps=4)
    a.save(path)
    a.close()
    rolled = make_trainer(tiny_problem)
    rolled.load(copy)
    rolled.fit(max_steps=1)  # 3 steps, on the line of the 6 saved at path
    with pytest.raises(ValueError, match="holds 6 accounted steps of this run's line"):
        rolled.save(path)


def test_a_refused_resume_and_close_leave_the_path_free(tmp_path, tiny_problem):
    path = tmp_path / "run.pt"
    a = make_trainer(tiny_problem, checkpoint_path=path)
    a.fit(max_steps=2)
    a.close()
    with pytest.raises(RuntimeError, match="closed"):
        a.fit(max_steps=1)
    with pytest.raises(RuntimeError, match="closed"):
        a.save(path)
    with pytest.raises(ValueError, match="other settings"):
        make_trainer(tiny_problem, checkpoint_path=path, clip_norm=2.0)  # its traceback lives
    with pytest.warns(UserWarning, match="resumed"):
        make_trainer(tiny_problem, checkpoint_path=path)  # the corrected cell


def test_a_relative_checkpoint_path_stays_the_same_file_after_chdir(tmp_path, tiny_problem):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    here = os.getcwd()
    os.chdir(tmp_path / "a")
    try:
        t = make_trainer(tiny_problem, checkpoint_path="run.pt")
        os.chdir(tmp_path / "b")
        t.fit(max_steps=2)
    finally:
        os.chdir(here)
    assert (tmp_path / "a" / "run.pt").exists() and not (tmp_path / "b" / "run.pt").exists()


# ------------------------------------------------------------------ batched losses


@pytest.mark.parametrize("reduce, match", [
    (lambda each: each.mean(), "a 0-d loss is a reduction over the batch"),  # Opacus' default
    (lambda each: each / each.mean(), "mixes the examples of a batch"),  # a [B] that mixes
])  # fmt: skip
def test_a_batched_loss_that_reduces_or_mixes_is_refused_before_anything_is_accounted(
    reduce, match
):
    """A batched loss written with a habit from Opacus or HF (the batch's mean loss, or
    losses normalised by it) is refused at the first backward, naming the fix; the step is
    not accounted and no gradient is written."""
    model = mlp()

    @dpfunc.batched_loss
    def losses(params, batch):
        x, y = batch
        each = F.cross_entropy(functional_call(model, params, (x,)), y, reduction="none")
        return reduce(each)

    private = dpfunc.PrivateGradients(
        model, losses, data(), expected_batch_size=EXPECTED, clip_norm=CLIP,
        noise_multiplier=1.0, delta=1e-5, epochs=2,
    )  # fmt: skip
    with pytest.raises(ValueError, match=match):
        private.backward(next(iter(private.batches())))
    assert private.epsilon(1e-5) == 0.0
    assert all(p.grad is None for p in model.parameters())


# ------------------------------------------------------------------ compiled and closure steps


def test_a_step_with_a_closure_is_refused_before_the_closure_runs():
    """LBFGS habit: step(closure), whose loss.backward() would be stepped un-noised."""
    model = mlp()
    private = private_for(model)
    x, y = data()
    for optimizer in (torch.optim.SGD(model.parameters(), lr=0.1),
                      torch.optim.LBFGS(model.parameters(), lr=0.1)):  # fmt: skip
        private.backward(next(private.batches(1)))
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        ran = []

        def closure(optimizer=optimizer, ran=ran):
            ran.append(True)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        with pytest.raises(RuntimeError, match=r"step\(closure\) refused.*without a closure"):
            optimizer.step(closure)
        assert not ran
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), before[name]), name
        if isinstance(optimizer, torch.optim.SGD):
            optimizer.step()  # the control: the private gradient, without a closure
            assert not torch.equal(model[0].weight.detach(), before["0.weight"])


def test_a_compiled_optimizer_step_is_checked_at_every_call():
    """PyTorch's recipe, torch.compile(optimizer.step): checked after tracing too."""
    model, reference = mlp(), mlp()
    private = private_for(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    step = torch.compile(optimizer.step)
    eager = torch.optim.SGD(reference.parameters(), lr=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # each private gradient counts as applied
        for batch in private.batches(3):
            private.backward(batch)
            for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                q.grad = p.grad.clone()
            step()
            eager.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach())  # compiled, the same update
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    x, y = data()
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()  # the whole dataset, no clipping, no noise
    with pytest.raises(RuntimeError, match="SGD.step.. refused.*not the private gradient"):
        step()
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name]), name


# ------------------------------------------------------------------ what the forward moves


def test_a_batchnorm_added_after_the_build_is_refused_at_the_next_backward():
    """BatchNorm1d(affine=False) adds no parameter, so the live-parameter check passes."""
    model = mlp()

    @dpfunc.batched_loss
    def losses(params, batch):
        x, y = batch
        return F.cross_entropy(functional_call(model, params, (x,)), y, reduction="none")

    private = dpfunc.PrivateGradients(
        model, losses, data(), expected_batch_size=EXPECTED, clip_norm=CLIP,
        noise_multiplier=1.0, delta=1e-5, epochs=2, method="ghost",
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    private.backward(next(private.batches(1)))  # the control: one step as built
    optimizer.step()
    model[1] = nn.Sequential(nn.BatchNorm1d(8, affine=False), nn.Tanh())  # no new parameter
    with pytest.raises(ValueError, match="module '1.0' is BatchNorm1d.*replace_batchnorm"):
        private.backward(next(private.batches(1)))
    assert private.steps_done == 1
    assert model[1][0].num_batches_tracked == 0  # no statistic of the data was kept


@pytest.mark.parametrize(
    "layer, match",
    [
        (nn.InstanceNorm1d(8, track_running_stats=True), "track_running_stats=True.*running"),
        (nn.Embedding(10, 8, max_norm=1.0), r"max_norm=1.0.*renormalises the rows"),
    ],
    ids=["instance-norm-running-stats", "embedding-max-norm"],
)
def test_a_layer_that_writes_the_data_into_its_state_is_refused_before_any_forward(layer, match):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer, self.head = layer, nn.Linear(8, 3)

        def forward(self, x):
            if isinstance(self.layer, nn.Embedding):
                return self.head(self.layer(x).mean(-2))
            return self.head(self.layer(x[..., None].expand(*x.shape, 4)).mean(-1))

    model = Model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 10, (40, 8), generator=g)
    x = x if isinstance(layer, nn.Embedding) else x.float()
    rows = (x, torch.randint(0, 3, (40,), generator=g))

    def loss_fn(params, example):
        inputs, y = example
        return F.cross_entropy(functional_call(model, params, (inputs[None],)), y[None])

    settings = dict(expected_batch_size=8.0, clip_norm=1.0, noise_multiplier=1.0, delta=1e-5,
                    epochs=1, method="vmap")  # fmt: skip
    with pytest.raises(ValueError, match=match):
        dpfunc.PrivateGradients(model, loss_fn, rows, **settings)
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name
    model.layer = nn.Identity() if not isinstance(layer, nn.Embedding) else nn.Embedding(10, 8)
    private = dpfunc.PrivateGradients(model, loss_fn, rows, **settings)  # the control
    private.backward(next(private.batches(1)))
    model.layer = layer  # put back after the build
    with pytest.raises(ValueError, match=match):
        private.backward(next(private.batches(1)))
    assert private.steps_done == 1


def test_a_forward_that_updates_its_own_state_is_refused_and_put_back():
    """A custom layer keeping a running mean of its inputs: caught at the first step's check."""

    class RunningMean(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("mean", torch.zeros(5))

        def forward(self, x):
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * x.detach().reshape(-1, 5).mean(0))
            return x - self.mean

    model = nn.Sequential(RunningMean(), mlp())
    private = private_for(model, noise_multiplier=1.0)
    with pytest.raises(ValueError, match=r"(?s)changed \[\"buffer '0.mean'\"\] in place.*put back"):
        private.backward(next(private.batches(1)))
    assert torch.equal(model[0].mean, torch.zeros(5))
    assert private.epsilon(1e-5) == 0.0
    assert all(p.grad is None for p in model.parameters())


# ------------------------------------------------------------------ errors that name the fix


def test_random_augmentation_in_a_batched_loss_is_named_as_such():
    model = mlp()

    @dpfunc.batched_loss
    def augmented(params, batch):
        x, y = batch
        x = x + 0.1 * torch.randn_like(x)  # per-example noise, drawn inside the loss
        return F.cross_entropy(functional_call(model, params, (x,)), y, reduction="none")

    private = dpfunc.PrivateGradients(
        model, augmented, data(), expected_batch_size=EXPECTED, clip_norm=CLIP,
        noise_multiplier=1.0, delta=1e-5, epochs=2, method="ghost",
    )  # fmt: skip
    with pytest.raises(ValueError, match="draws random numbers.*Augment in the dataset"):
        private.backward(next(private.batches(1)))
    assert private.epsilon(1e-5) == 0.0


def test_a_list_of_two_lists_is_not_read_as_two_examples():
    x, y = data()
    model = mlp()
    with pytest.raises(ValueError, match=r"list of 2 lists that all have length 60.*two ways"):
        dpfunc.PrivateGradients(model, loss_for(model), [x.tolist(), y.tolist()],
                                expected_batch_size=EXPECTED, clip_norm=CLIP,
                                noise_multiplier=1.0, delta=1e-5, epochs=1)  # fmt: skip
    rows = list(zip(x, y))  # the control: a list of (x, y) examples
    private = dpfunc.PrivateGradients(
        model, loss_for(model), rows, expected_batch_size=EXPECTED, clip_norm=CLIP,
        noise_multiplier=1.0, delta=1e-5, epochs=1,
    )  # fmt: skip
    assert private.num_examples == 60


def test_a_compiled_loop_body_runs_the_private_step_eagerly():
    """torch.compile around backward and step: the same update as the loop written plainly."""
    results = []
    for compiled in (False, True):
        model = mlp()
        private = private_for(model, noise_multiplier=1.0, seed=5)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)

        def body(batch, private=private, optimizer=optimizer):
            private.backward(batch)
            optimizer.step()
            optimizer.zero_grad()

        run = torch.compile(body) if compiled else body
        for batch in private.batches(2):
            run(batch)
        results.append({name: p.detach().clone() for name, p in model.named_parameters()})
        assert private.steps_done == 2
    for name, p in results[0].items():
        torch.testing.assert_close(results[1][name], p)


def test_a_forward_that_replaces_its_buffer_is_refused_and_put_back():
    """Not in place: a new tensor assigned to the buffer (its old one's version never moves)."""

    class Centred(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("mean", torch.zeros(5))

        def forward(self, x):
            self.mean = 0.9 * self.mean + 0.1 * x.detach().reshape(-1, 5).mean(0)
            return x - self.mean

    model = nn.Sequential(Centred(), mlp())
    original = model[0].mean
    private = private_for(model, noise_multiplier=1.0)
    with pytest.raises(ValueError, match=r"buffer '0.mean'.*put back"):
        private.backward(next(private.batches(1)))
    assert model[0].mean is original and torch.equal(original, torch.zeros(5))
    assert private.epsilon(1e-5) == 0.0


def test_a_tensor_outside_the_model_in_the_same_optimizer_is_not_stepped():
    model = mlp()
    private = private_for(model)
    temperature = torch.ones((), requires_grad=True)  # kept outside the model
    optimizer = torch.optim.SGD([*model.parameters(), temperature], lr=0.1)
    x, y = data()
    (F.cross_entropy(model(x) / temperature, y)).backward()  # before the private step
    private.backward(next(private.batches(1)))
    with pytest.raises(RuntimeError, match="1 tensor.* outside that model holding a gradient"):
        optimizer.step()
    assert float(temperature) == 1.0
    temperature.grad = None
    optimizer.step()  # the control: its gradient cleared, the private step is taken


# ------------------------------------------------------------------ the review of round two


class BatchStandardise(nn.Module):
    """Batch statistics written by hand, in training mode only: no nn BatchNorm to find."""

    def forward(self, h):
        return (h - h.mean(0)) / (h.std(0) + 1e-5) if self.training and h.shape[0] > 1 else h


def test_a_layer_that_mixes_the_batch_only_in_training_mode_is_refused():
    """The batched check compares the passes in eval mode, where this layer does nothing; the
    check in the steps' own mode sees one example move the others' losses."""

    def build(norm):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 8), norm, nn.Tanh(), nn.Linear(8, 3))

    for norm, refused in ((BatchStandardise(), True), (nn.LayerNorm(8), False)):  # and the control
        model = build(norm)

        @dpfunc.batched_loss
        def losses(params, batch, model=model):
            x, y = batch
            return F.cross_entropy(functional_call(model, params, (x,)), y, reduction="none")

        private = dpfunc.PrivateGradients(
            model, losses, data(), expected_batch_size=EXPECTED, clip_norm=CLIP,
            noise_multiplier=1.0, delta=1e-5, epochs=2, method="ghost", seed=0,
        )  # fmt: skip
        if refused:
            with pytest.raises(ValueError, match="mixes the examples of a batch in training mode"):
                private.backward(next(private.batches(1)))
            assert private.epsilon(1e-5) == 0.0 and all(p.grad is None for p in model.parameters())
        else:
            private.backward(next(private.batches(1)))
            assert private.steps_done == 1


class CacheOfTheInput(nn.Module):
    """Keeps a row of its input from the third call on: after the first step's check."""

    def __init__(self):
        super().__init__()
        self.register_buffer("last", torch.zeros(5))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls >= 3:
            self.last = x.detach().reshape(-1, 5)[0].clone()  # a training row, verbatim
        return x


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_a_buffer_written_on_a_later_step_is_refused_and_put_back(method):
    cache = CacheOfTheInput()
    model = nn.Sequential(cache, mlp())

    @dpfunc.batched_loss
    def losses(params, batch):
        x, y = batch
        return F.cross_entropy(functional_call(model, params, (x,)), y, reduction="none")

    loss = loss_for(model) if method == "vmap" else losses
    private = dpfunc.PrivateGradients(
        model, loss, data(), expected_batch_size=EXPECTED, clip_norm=CLIP, noise_multiplier=1.0,
        delta=1e-5, epochs=4, method=method, seed=0,
    )  # fmt: skip
    original = cache.last
    with pytest.raises(ValueError, match=r"buffer '0.last'.*during step \d.*put back"):
        for batch in private.batches(4):
            private.backward(batch)
    assert cache.last is original and torch.equal(original, torch.zeros(5))
    assert torch.equal(model.state_dict()["0.last"], torch.zeros(5))  # nothing of the data
    with pytest.raises(RuntimeError, match="closed"):  # its state stopped at the refused step
        private.backward(next(private.batches(1)))


def test_a_buffer_the_caller_changes_between_steps_is_kept():
    """A change outside the private forward is the caller's (loading weights, say): kept."""
    model = nn.Sequential(CacheOfTheInput(), mlp())
    model[0].calls = -(10**6)  # never writes in these steps
    private = private_for(model, noise_multiplier=1.0)
    batches = private.batches(2)
    private.backward(next(batches))
    model[0].last.fill_(3.0)  # the caller's own change, between two steps
    private.backward(next(batches))
    assert torch.equal(model[0].last, torch.full((5,), 3.0))


def test_a_gradient_replaced_by_the_optimizers_own_pre_hook_is_not_silent():
    """Per-optimizer pre-step hooks run after the global check: caught after the step."""
    model = mlp()
    private = private_for(model, noise_multiplier=1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data()

    def recompute(optimizer, args, kwargs):  # the data's gradient, un-noised
        for p in model.parameters():
            p.grad = None
        with torch.enable_grad():
            grads = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
        for p, g in zip(model.parameters(), grads):
            p.grad = g

    private.backward(next(private.batches(1)))
    handle = optimizer.register_step_pre_hook(recompute)
    with pytest.raises(RuntimeError, match="not the private gradient it was checked as"):
        optimizer.step()
    handle.remove()
    private.backward(next(private.batches(1)))  # the control: without the hook, no error
    optimizer.step()


def test_randomness_in_a_batched_loss_is_not_taken_for_mixing_in_training_mode():
    """Numpy's global generator is put back for each pass; a generator of the loss's own cannot
    be, and the training-mode check then warns instead of refusing."""
    own = torch.Generator().manual_seed(1)

    class Masking(nn.Module):
        def __init__(self, draw):
            super().__init__()
            self.draw = draw

        def forward(self, h):
            return h * self.draw(h.shape) if self.training else h

    draws = {
        "numpy": lambda shape: torch.from_numpy(np.random.rand(*shape) > 0.2).float(),
        "own": lambda shape: (torch.rand(shape, generator=own) > 0.2).float(),
    }
    for kind, draw in draws.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 8), Masking(draw), nn.Tanh(), nn.Linear(8, 3))

        @dpfunc.batched_loss
        def losses(params, batch, model=model):
            x, y = batch
            return F.cross_entropy(functional_call(model, params, (x,)), y, reduction="none")

        private = dpfunc.PrivateGradients(
            model, losses, data(), expected_batch_size=EXPECTED, clip_norm=CLIP,
            noise_multiplier=1.0, delta=1e-5, epochs=2, method="ghost", seed=0,
        )  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            private.backward(next(private.batches(1)))
        said = [str(w.message) for w in caught if "could not be checked" in str(w.message)]
        assert private.steps_done == 1 and bool(said) == (kind == "own"), kind


def test_an_optimizer_that_copies_the_gradient_it_steps_is_not_refused():
    class Copying(torch.optim.SGD):
        def step(self, closure=None):
            loss = super().step(closure)
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = p.grad.clone()  # the same values, another tensor (before the check
            return loss  # after the step: the private gradient was the one applied)

    model = mlp()
    private = private_for(model, noise_multiplier=1.0)
    optimizer = Copying(model.parameters(), lr=0.1)
    private.backward(next(private.batches(1)))
    optimizer.step()
    assert private.steps_done == 1
