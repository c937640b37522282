"""One private training run with dpfunc, as a user writes it (timed by bench/whole_run.py).

    .venv/bin/python bench/runs/dpfunc_run.py --workload digits
    .venv/bin/python bench/runs/dpfunc_run.py --workload mnist --data FILE --examples 6000

``dpfunc.Trainer`` with ``model=`` (the default ``method="auto"``: ghost clipping where it
is cheaper), eager, ``fit()`` (the epsilon after every epoch), a secret seed drawn from the
OS. The logical batch is Opacus' (a DataLoader of ``batch`` rows samples at rate
``1 / len(loader)``): expected batch ``n / ceil(n / batch)``, ``ceil(n / batch)`` steps
per epoch, so both libraries account the same events. Prints one JSON line: seconds per
phase (imports, setup, calibration, steps, epsilon, evaluation), the total since the
first line, the noise multiplier, the final epsilon and the test accuracy.
"""

import time

START = time.perf_counter()  # before the imports: they are part of the run

import math  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.func import functional_call  # noqa: E402

import dpfunc  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads  # noqa: E402  (bench/runs/workloads.py: data, models, clock)

# workload -> its settings; "target_epsilon" calibrates sigma, "noise_multiplier" fixes it
SETTINGS = {
    "digits": dict(batch=128, epochs=10, target_epsilon=3.0, delta=1e-5, clip_norm=1.0,
                   lr=0.5, momentum=0.9),
    "mnist": dict(batch=64, epochs=10, noise_multiplier=1.0, delta=1e-5, clip_norm=1.0,
                  lr=0.1, momentum=0.0),
}  # fmt: skip


def main(args) -> None:
    clock = workloads.Clock(START)
    clock.lap("imports")
    if args.threads:
        torch.set_num_threads(args.threads)
    s = SETTINGS[args.workload]
    train_set, test_set, net, epochs = workloads.problem(s, args)
    params, buffers = dpfunc.functionalize(net)

    def loss_fn(params, example):
        x, y = example
        logits = functional_call(net, (params, buffers), (x.unsqueeze(0),))
        return F.cross_entropy(logits, y.unsqueeze(0))

    n = len(train_set[1])
    config = dpfunc.DPConfig(
        epochs=epochs, expected_batch_size=n / math.ceil(n / s["batch"]),
        clip_norm=s["clip_norm"], delta=s["delta"],
        target_epsilon=s.get("target_epsilon"), noise_multiplier=s.get("noise_multiplier"),
    )  # fmt: skip
    clock.lap("setup")
    config = config.calibrated(n)
    clock.lap("calibration")
    trainer = dpfunc.Trainer(
        loss_fn, params, train_set, config=config, model=net, progress=False,
        optimizer=dpfunc.optim.sgd(lr=s["lr"], momentum=s["momentum"]),
    )  # fmt: skip
    epsilon_seconds = []
    epsilon_of = trainer.epsilon

    def timed_epsilon(*a, **k):  # the instrument: fit() computes epsilon after every epoch
        started = time.perf_counter()
        value = epsilon_of(*a, **k)
        epsilon_seconds.append(time.perf_counter() - started)
        return value

    trainer.epsilon = timed_epsilon
    step_ends = []

    class StepClock:  # the instrument: when the first step ended
        def on_step_end(self, trainer, metrics):
            if not step_ends:
                step_ends.append(time.perf_counter())

    clock.lap("setup")
    history = trainer.fit(callbacks=[StepClock()])
    first_step = step_ends[0] - clock.last
    clock.lap("steps")
    clock.phases["steps"] -= sum(epsilon_seconds)
    clock.phases["epsilon"] = sum(epsilon_seconds)
    net.load_state_dict(trainer.params, strict=False)
    test_accuracy = workloads.accuracy(net, test_set)
    clock.lap("evaluation")
    clock.report(
        library="dpfunc", workload=args.workload, steps=trainer.steps_done,
        noise_multiplier=trainer.noise_multiplier, epsilon=history[-1]["epsilon"],
        epsilon_each_epoch=[r["epsilon"] for r in history], epsilon_calls=epsilon_seconds,
        accuracy=test_accuracy, threads=torch.get_num_threads(), accountant="PLD (dp-accounting)",
        first_step=first_step,
    )  # fmt: skip


if __name__ == "__main__":
    main(workloads.arguments(__doc__.splitlines()[0], sorted(SETTINGS)))
