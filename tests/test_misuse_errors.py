"""Misuse that torch reports in its own words is refused in dpfunc's: the message says the fix.

Each case goes through both front doors, ``dpfunc.Trainer`` and
``dpfunc.PrivateGradients``, on both clipping paths (vmap, and ghost, whose
analysis pass runs the loss first and must not warn about a failure that is
the data's). Every refusal comes before the step is accounted: no epsilon is
spent on a step that released nothing.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import dpfunc

SETTINGS = dict(
    expected_batch_size=8.0, clip_norm=1.0, noise_multiplier=1.0, epochs=1, seed=3, delta=1e-5
)
DOORS = ["trainer", "private"]
METHODS = ["vmap", "ghost"]


def mlp(classes: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, classes))


def data(n: int = 40, x_dtype=torch.float32, y_dtype=torch.int64, classes: int = 3):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 5, generator=g).to(x_dtype)
    y = torch.randint(0, classes, (n,), generator=g).to(y_dtype)
    return x, y


def first_step(door: str, model: nn.Module, dataset, method: str):
    """Builds the run through ``door`` and takes one step; returns the run, to read its state."""
    if door == "trainer":
        params, buffers = dpfunc.functionalize(model)

        def loss_fn(p, example):
            x, y = example
            return F.cross_entropy(functional_call(model, (p, buffers), (x[None],)), y[None])

        run = dpfunc.Trainer(loss_fn, params, dataset, optimizer=dpfunc.optim.sgd(lr=0.1),
                             model=model, method=method, progress=False, physical_batch_size=16,
                             **SETTINGS)  # fmt: skip
        try:
            run.fit(max_steps=1)
        finally:
            first_step.run = run
        return run

    def loss_fn(p, example):
        x, y = example
        return F.cross_entropy(functional_call(model, p, (x[None],)), y[None])

    run = dpfunc.PrivateGradients(model, loss_fn, dataset, method=method, physical_batch_size=16,
                                  **SETTINGS)  # fmt: skip
    first_step.run = run
    for batch in run.batches(1):
        run.backward(batch)
    return run


def refused(door, model, dataset, method, kind, *fixes):
    """Asserts the first step raises ``kind`` naming every one of ``fixes``, after no
    warning (the ghost planner's included) and before the step is accounted."""
    first_step.run = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(kind) as info:
            first_step(door, model, dataset, method)
    message = str(info.value)
    for fix in fixes:
        assert fix in message, f"{fix!r} not in {message!r}"
    dpfunc_warnings = [w for w in caught if "dpfunc" in str(w.message)]
    assert not dpfunc_warnings, [str(w.message) for w in dpfunc_warnings]
    if first_step.run is not None:
        assert first_step.run.steps_done == 0 and first_step.run.epsilon() == 0.0
    assert info.value.__cause__ is not None  # torch's own error stays in the chain
    return message


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("door", DOORS)
def test_a_float64_model_with_float32_data_names_both_conversions(door, method):
    message = refused(
        door, mlp().double(), data(), method, TypeError, "x.double()", "model.float()"
    )
    assert "the data is float32 but the model's parameters are float64" in message


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize(
    "dtype, model_fix", [(torch.float16, "model.half()"), (torch.bfloat16, "model.bfloat16()")]
)
def test_half_precision_data_into_a_float32_model_names_both_conversions(
    door, method, dtype, model_fix
):
    message = refused(door, mlp(), data(x_dtype=dtype), method, TypeError, "x.float()", model_fix)
    assert f"the data is {str(dtype)[6:]} but the model's parameters are float32" in message


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("door", DOORS)
def test_integer_inputs_into_a_float_model_name_the_leaf_and_the_conversion(door, method):
    message = refused(door, mlp(), data(x_dtype=torch.int64), method, TypeError, "x.float()")
    assert "batch leaf [0] is int64" in message


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("door", DOORS)
def test_float_labels_name_the_leaf_and_the_conversion(door, method):
    message = refused(door, mlp(), data(y_dtype=torch.float32), method, TypeError, "y.long()")
    assert "batch leaf [1] holds float32 values" in message


@pytest.mark.parametrize("as_numpy", [False, True], ids=["torch", "numpy"])
@pytest.mark.parametrize("door", DOORS)
def test_int32_labels_name_the_leaf_and_the_conversion(door, as_numpy):
    # measured (torch 2.13): the vmap path's nll_loss accepts int32 labels and trains; the
    # ghost path's eager loss raises "expected target dtype to be Long or Byte, but got Int"
    x, y = data(y_dtype=torch.int32)
    dataset = (x.numpy(), y.numpy()) if as_numpy else (x, y)
    message = refused(door, mlp(), dataset, "ghost", TypeError, "y.long()", "y.astype(np.int64)")
    assert "batch leaf [1] is int32" in message


@pytest.mark.parametrize("as_numpy", [False, True], ids=["torch", "numpy"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("door", DOORS)
def test_labels_of_shape_n_by_1_name_the_leaf_and_the_squeeze(door, method, as_numpy):
    x, y = data()
    dataset = (x.numpy(), y[:, None].numpy()) if as_numpy else (x, y[:, None])
    message = refused(door, mlp(), dataset, method, ValueError, "y.squeeze(1)", "y.view(-1)")
    assert "batch leaf [1] has shape (n, 1)" in message and "shape (n,)" in message


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("door", DOORS)
def test_a_label_out_of_range_is_named_without_a_ghost_warning_first(door, method):
    x, y = data(classes=5)  # labels 0..4 for a model of 3 outputs
    y[:] = 4  # every example's: the ghost analysis pass (example 0) fails on it too
    message = refused(door, mlp(classes=3), (x, y), method, ValueError, "y.max() <")
    assert "out of range" in message and "class label" in message


@pytest.mark.parametrize("method", METHODS)
def test_a_parameter_resized_between_steps_is_refused_naming_the_change(method):
    model = mlp()
    run = first_step("private", model, data(classes=2), method)  # one step at the old shape
    with torch.no_grad():
        model[2].weight.data = torch.zeros(2, 8)
        model[2].bias.data = torch.zeros(2)
    batch = next(run.batches(1))
    with pytest.raises(ValueError) as info:
        run.backward(batch)
    message = str(info.value)
    assert "'2.weight' changed shape from (3, 8) to (2, 8)" in message
    assert "build privategradients and the optimizer again" in message.lower()
    assert run.steps_done == 1  # the refused step is not accounted


@pytest.mark.parametrize("method", ["ghost", "auto", "vmap"])
def test_backward_under_inference_mode_works_quietly_and_equals_the_plain_one(method):
    grads = []
    for mode in (False, True):
        model = mlp()

        def loss_fn(p, example, model=model):
            x, y = example
            return F.cross_entropy(functional_call(model, p, (x[None],)), y[None])

        run = dpfunc.PrivateGradients(model, loss_fn, data(), method=method,
                                      physical_batch_size=16, **SETTINGS)  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the ghost planner warned here
            for batch in run.batches(1):
                with torch.inference_mode(mode):
                    run.backward(batch)
        assert all(not p.grad.is_inference() for p in model.parameters())
        grads.append([p.grad.clone() for p in model.parameters()])
    for plain, inferred in zip(*grads):
        torch.testing.assert_close(inferred, plain, rtol=0, atol=0)


def test_errors_that_are_not_the_datas_pass_through_unchanged():
    model = mlp()
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        raise KeyError("the loss's own bug")

    settings = dict(clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)
    step = dpfunc.make_train_step(loss_fn, dpfunc.optim.sgd(lr=0.1), method="vmap", **settings)
    state = step.init(params)
    noise = dpfunc.standard_normal_like(params, seed=1, step=0)
    with pytest.raises(KeyError, match=re.escape("the loss's own bug")):
        step(state, data(4), None, noise)


@pytest.mark.parametrize("door", DOORS)
def test_a_list_of_per_example_tensors_is_refused_naming_both_readings(door):
    # measured: refused with "expected_batch_size must be a number in (0, 5]", as 5 examples
    vectors = [torch.randn(5) for _ in range(200)]
    with pytest.raises(ValueError) as info:
        first_step(door, mlp(), vectors, "vmap")
    message = str(info.value)
    assert "as 200 examples of shape (5,)" in message and "as 5 examples of 200 columns" in message
    assert "torch.stack(dataset)" in message and "tuple(dataset)" in message
