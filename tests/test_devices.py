"""Devices: where parameters, batches and noise live, CUDA against a CPU oracle, and clear
errors for data on the wrong device.

The tests marked ``cuda`` skip without a GPU. The others run everywhere, with the ``meta``
device standing in for a second one.
"""

import copy
import warnings

import pytest
import torch

import dpfunc
from dpfunc._checks import check_devices
from dpfunc.data import micro_batches

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SEED = 20240229  # reproducible research only: a private run draws dpfunc.secret_seed()


def on(device, tree):
    return {k: v.to(device) for k, v in tree.items()}


def make_step(loss_fn, model, method, **settings):
    settings = {"clip_norm": 0.5, "noise_multiplier": 0.7, "expected_batch_size": 8, **settings}
    return dpfunc.make_train_step(
        loss_fn, dpfunc.optim.sgd(lr=0.5), model=model, method=method, **settings
    )


# --------------------------------------------------------------------------- everywhere


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_a_batch_on_another_device_is_refused_by_name(classifier, classification_data, method):
    model, params, loss_fn = classifier()
    x, y = classification_data(8)
    step = make_step(loss_fn, model, method)
    state = step.init(params)
    noise = dpfunc.standard_normal_like(params, seed=SEED, step=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused before the ghost path could fall back to vmap
        with pytest.raises(
            ValueError, match=r"batch leaf \[0\] \(shape \(8, 6\)\) is on device meta"
        ):
            step(state, (x.to("meta"), y), torch.ones(8), noise)


def test_per_sample_grads_refuses_a_batch_on_another_device(classifier, classification_data):
    _, params, loss_fn = classifier()
    x, y = classification_data(4)
    with pytest.raises(
        ValueError, match=r"batch leaf \[1\].*on device meta.*parameters are on cpu"
    ):
        dpfunc.per_sample_grads(loss_fn, params, (x, y.to("meta")))


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_parameters_on_meta_are_refused(classifier, classification_data, method):
    model, _, loss_fn = classifier()
    meta = on("meta", dpfunc.functionalize(model)[0])
    x, y = classification_data(8)
    step = make_step(loss_fn, model, method)
    zeros = {k: torch.zeros_like(v) for k, v in meta.items()}
    for batch in [(x, y), (x.to("meta"), y.to("meta"))]:
        with pytest.raises(ValueError, match="meta device, which holds shapes but no values"):
            step(step.init(meta), batch, torch.ones(8), zeros)
    for secure in (False, True):
        with pytest.raises(ValueError, match="meta device"):
            dpfunc.standard_normal_like(meta, seed=SEED, step=0, secure=secure)


def test_the_trainer_refuses_a_dataset_on_another_device(tiny_problem):
    loss_fn, params, (x, y), _ = tiny_problem()
    trainer = dpfunc.Trainer(
        loss_fn, params, (x.to("meta"), y.to("meta")), optimizer=dpfunc.optim.sgd(lr=0.1),
        clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=20, epochs=1, seed=SEED,
        progress=False, method="vmap",
    )  # fmt: skip
    with pytest.raises(ValueError, match="parameters are on cpu; move the data"):
        trainer.train_step()


def test_rows_are_gathered_where_the_dataset_lives():
    x = torch.arange(10.0).reshape(5, 2)
    (batch, mask), *_ = micro_batches((x.to("meta"), x[:, 0]), [3, 1], 4)
    assert batch[0].device.type == "meta" and batch[1].device.type == "cpu"
    assert mask.device.type == "meta"  # the mask follows the batch's first leaf
    (batch, mask), *_ = micro_batches(x, [3, 1], 4)
    assert torch.equal(batch[:2], x[[3, 1]]) and mask.tolist() == [1.0, 1.0, 0.0, 0.0]


def test_check_devices_passes_matching_devices_and_non_tensor_leaves():
    params = {"w": torch.zeros(2)}
    check_devices(params, {"x": torch.zeros(3, 2), "note": "text", "n": 3})
    check_devices({}, torch.zeros(3, 2, device="meta"))  # nothing to compare with


# --------------------------------------------------------------------------- CUDA


def cuda_classifier(classifier, dtype=torch.float64):
    """The classifier on CPU (its params), then moved to the GPU (its params there)."""
    model, cpu_params, loss_fn = classifier(dtype=dtype)
    cuda_params, _ = dpfunc.functionalize(model.to("cuda"))  # after model.to(device)
    return model, cpu_params, cuda_params, loss_fn


@cuda
def test_default_noise_is_drawn_on_the_params_device_and_keyed():
    params = {"w": torch.zeros(300, 400, device="cuda"), "b": torch.zeros(7, device="cuda")}
    z = dpfunc.standard_normal_like(params, seed=SEED, step=3)
    assert {v.device.type for v in z.values()} == {"cuda"}
    again = dpfunc.standard_normal_like(params, seed=SEED, step=3)
    assert all(torch.equal(z[k], again[k]) for k in z)
    other = dpfunc.standard_normal_like(params, seed=SEED, step=4)
    assert not torch.equal(z["w"], other["w"])
    w = z["w"].double().flatten()  # 120,000 draws: mean within 5 standard errors, std within 1%
    assert abs(float(w.mean())) < 5 / w.numel() ** 0.5
    assert abs(float(w.std()) - 1.0) < 0.01
    cpu = dpfunc.standard_normal_like(on("cpu", params), seed=SEED, step=3)
    assert not torch.equal(z["w"].cpu(), cpu["w"])  # Philox on CUDA, a Mersenne Twister on CPU


@cuda
def test_secure_noise_is_the_same_on_cpu_and_cuda():
    params = {"w": torch.zeros(5, 3, device="cuda"), "b": torch.zeros(3)}  # two devices
    z = dpfunc.standard_normal_like(params, seed=SEED, step=1, secure=True)
    assert z["w"].device.type == "cuda" and z["b"].device.type == "cpu"
    cpu = dpfunc.standard_normal_like(on("cpu", params), seed=SEED, step=1, secure=True)
    assert all(torch.equal(z[k].cpu(), cpu[k]) for k in z)
    with pytest.raises(ValueError, match="span the devices.*secure=True"):
        dpfunc.standard_normal_like(params, seed=SEED, step=1)


@cuda
@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_a_cuda_step_equals_the_cpu_step(classifier, classification_data, method):
    model, cpu_params, cuda_params, loss_fn = cuda_classifier(classifier)
    x, y = classification_data(8, scale=3.0)
    noise = dpfunc.standard_normal_like(cpu_params, seed=SEED, step=0)  # one draw, copied
    results = {}
    for device, params in (("cpu", cpu_params), ("cuda", cuda_params)):
        model.to(device)
        step = make_step(loss_fn, model, method)
        if method == "ghost":
            assert set(step.explain(params, (x.to(device), y.to(device))).values()) == {"ghost"}
        mask = torch.tensor([1.0] * 6 + [0.0] * 2, device=device)
        state, metrics = step(step.init(params), (x.to(device), y.to(device)), mask,
                              on(device, noise))  # fmt: skip
        assert {v.device.type for v in state.params.values()} == {device}
        results[device] = state.params, metrics
    (p_cpu, m_cpu), (p_cuda, m_cuda) = results["cpu"], results["cuda"]
    for k in p_cpu:
        torch.testing.assert_close(p_cuda[k].cpu(), p_cpu[k], rtol=1e-10, atol=1e-12)
    assert float(m_cuda["clipped_fraction"]) == float(m_cpu["clipped_fraction"]) > 0


@cuda
def test_mask_none_on_cuda_means_every_row(classifier, classification_data):
    model, _, params, loss_fn = cuda_classifier(classifier)
    x, y = (t.cuda() for t in classification_data(8))
    step = make_step(loss_fn, model, "vmap")
    noise = dpfunc.standard_normal_like(params, seed=SEED, step=0)
    without, _ = step(step.init(params), (x, y), None, noise)
    with_ones, _ = step(step.init(params), (x, y), torch.ones(8, device="cuda"), noise)
    assert all(torch.equal(without.params[k], with_ones.params[k]) for k in params)


@cuda
def test_a_cuda_trainer_equals_the_cpu_trainer(tiny_problem):
    # secure noise is drawn on the CPU and copied, and the Poisson sample is drawn on the CPU,
    # so both runs see the same batches and the same noise
    runs = {}
    for device in ("cpu", "cuda"):
        loss_fn, _, (x, y), model = tiny_problem()
        params, _ = dpfunc.functionalize(model.to(device))
        trainer = dpfunc.Trainer(
            loss_fn, params, (x.to(device), y.to(device)), optimizer=dpfunc.optim.adam(lr=1e-2),
            clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=20, epochs=2, seed=SEED,
            progress=False, model=model, method="vmap", secure_noise=True,
        )  # fmt: skip
        history = trainer.fit()
        assert {v.device.type for v in trainer.params.values()} == {device}
        runs[device] = trainer.params, history
    for k in runs["cpu"][0]:
        torch.testing.assert_close(
            runs["cuda"][0][k].cpu(), runs["cpu"][0][k], rtol=1e-4, atol=1e-5
        )
    assert runs["cuda"][1][-1]["epsilon"] == runs["cpu"][1][-1]["epsilon"]


@cuda
def test_the_trainer_refuses_a_cpu_dataset_for_a_cuda_model(tiny_problem):
    loss_fn, _, dataset, model = tiny_problem()
    params, _ = dpfunc.functionalize(model.to("cuda"))
    trainer = dpfunc.Trainer(
        loss_fn, params, dataset, optimizer=dpfunc.optim.sgd(lr=0.1), clip_norm=1.0,
        noise_multiplier=1.0, expected_batch_size=20, epochs=1, seed=SEED, progress=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match="is on device cpu but the parameters are on cuda:0"):
        trainer.train_step()


@cuda
@pytest.mark.slow
def test_a_compiled_cuda_step_equals_the_eager_one(tiny_problem):
    loss_fn, _, (x, y), model = tiny_problem()
    params, _ = dpfunc.functionalize(model.to("cuda"))
    batches = micro_batches((x.cuda(), y.cuda()), torch.arange(40), 16)
    results = []
    for compiled in (False, True):
        step = make_step(loss_fn, model, "vmap", expected_batch_size=40)
        if compiled:
            step.compile()
        noise = step.draw_noise(params, seed=SEED, step=0)
        state, _ = step.logical_step(step.init(params), batches, noise)
        results.append(state.params)
    for k in params:
        torch.testing.assert_close(results[1][k], results[0][k], rtol=1e-5, atol=1e-6)


@cuda
@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_bf16_on_cuda_clips_in_float32_near_the_float64_oracle(
    classifier, classification_data, method
):
    model, _, params, loss_fn = cuda_classifier(classifier, dtype=torch.bfloat16)
    x, y = classification_data(8, dtype=torch.bfloat16, scale=3.0)
    oracle_model = copy.deepcopy(model).to("cpu", torch.float64)  # the same bf16 values, widened
    oracle_params, _ = dpfunc.functionalize(oracle_model)
    batch, ones = (x.double(), y), torch.ones(8)
    _, unclipped = make_step(loss_fn, oracle_model, "vmap").clip(oracle_params, batch, ones)
    clip_norm = float(unclipped.norm.median())  # about half the examples are clipped
    expected, expected_stats = make_step(loss_fn, oracle_model, "vmap", clip_norm=clip_norm).clip(
        oracle_params, batch, ones
    )
    assert 0 < int(expected_stats.scaled.sum()) < 8
    step = make_step(loss_fn, model, method, clip_norm=clip_norm)
    summed, stats = step.clip(params, (x.cuda(), y.cuda()), torch.ones(8, device="cuda"))
    assert {(v.dtype, v.device.type) for v in summed.values()} == {(torch.float32, "cuda")}
    torch.testing.assert_close(stats.norm.cpu(), expected_stats.norm, rtol=0.03, atol=1e-3)
    for k in summed:
        torch.testing.assert_close(summed[k].cpu().double(), expected[k], rtol=0.05, atol=0.02)


@cuda
def test_a_checkpoint_written_on_cuda_resumes_on_the_cpu(tiny_problem, tmp_path):
    def make(device):
        loss_fn, _, (x, y), model = tiny_problem()
        params, _ = dpfunc.functionalize(model.to(device))
        return dpfunc.Trainer(
            loss_fn, params, (x.to(device), y.to(device)), optimizer=dpfunc.optim.adam(lr=1e-2),
            clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=20, epochs=2, seed=SEED,
            progress=False, method="vmap",
        )  # fmt: skip

    on_gpu = make("cuda")
    on_gpu.fit(max_steps=3)
    on_gpu.save(tmp_path / "run.pt")
    on_cpu = make("cpu")
    on_cpu.load(tmp_path / "run.pt")
    assert on_cpu.steps_done == 3 and int(on_cpu.state.step) == 3
    for k, v in on_gpu.params.items():
        assert on_cpu.params[k].device.type == "cpu" and torch.equal(on_cpu.params[k], v.cpu())
    on_cpu.fit()  # the remaining steps run on the CPU
    assert on_cpu.steps_done == on_cpu.total_steps
