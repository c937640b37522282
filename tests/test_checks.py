"""One message style for bad arguments, whichever public function receives them."""

import math

import pytest
import torch

import dpfunc
from dpfunc import accounting, data, optim
from dpfunc._checks import check_choice, check_int, check_number


def loss(p, x):
    return (p["w"] * x).sum()


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: accounting.epsilon(1.0, 1.5, 10, 1e-5),
            "sample_rate must be a number in (0, 1], got sample_rate=1.5",
        ),
        (
            lambda: data.poisson_sample(10, 1.5, seed=1, step=0),  # public: a test
            "sample_rate must be a number in (0, 1], got sample_rate=1.5",
        ),
        (
            lambda: accounting.epsilon(True, 0.5, 10, 1e-5),
            "noise_multiplier must be a finite number >= 0, got noise_multiplier=True",
        ),
        (
            lambda: dpfunc.make_train_step(
                loss, optim.sgd(0.1), clip_norm=-1, noise_multiplier=1.0, expected_batch_size=4
            ),
            "clip_norm must be a number > 0 (inf disables clipping), got clip_norm=-1",
        ),
        (
            lambda: dpfunc.clip_factors(torch.ones(2), clip_norm=0.0),
            "clip_norm must be a number > 0 (inf disables clipping), got clip_norm=0.0",
        ),
        (
            lambda: dpfunc.average({"w": torch.ones(2)}, math.inf),
            "expected_batch_size must be a finite number > 0 (sample_rate * num_examples), "
            "got expected_batch_size=inf",
        ),
        (lambda: optim.sgd(lr=0.0), "lr must be a finite number > 0, got lr=0.0"),
        (
            lambda: data.num_micro_batches(4, True),
            "physical_batch_size must be an int >= 1, got physical_batch_size=True",
        ),
        (
            lambda: accounting.epsilon(1.0, 0.5, 10, 1e-5, method="exact"),
            "method must be one of 'pld', 'rdp', got method='exact'",
        ),
    ],
)
def test_every_module_reports_a_bad_argument_the_same_way(call, message):
    with pytest.raises(ValueError) as caught:
        call()
    assert str(caught.value) == message


def test_the_checks_return_canonical_values_and_refuse_nan():
    assert check_int("n", torch.tensor(3).item()) == 3
    assert check_number("x", 2) == 2.0 and isinstance(check_number("x", 2), float)
    assert check_number("c", math.inf, low=0, low_open=True) == math.inf
    assert check_choice("m", "a", ("a", "b")) == "a"
    for bad in (math.nan, "1", None):
        with pytest.raises(ValueError, match="x must be a finite number"):
            check_number("x", bad, high_open=True)
