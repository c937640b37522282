"""The same private training run with Opacus 1.6, as its examples write it (bench/whole_run.py).

    .venv/bin/python bench/runs/opacus_run.py --workload digits
    .venv/bin/python bench/runs/opacus_run.py --workload mnist --data FILE --examples 6000

``PrivacyEngine()`` (its default accountant, PRV, as Opacus' examples use it), the model
wrapped with the default ``grad_sample_mode="hooks"``, Poisson sampling from a DataLoader
of ``batch`` rows; digits: ``make_private_with_epsilon`` (calibrates sigma for the target
with that accountant), mnist: ``make_private`` with sigma 1.0 as Opacus' MNIST example.
The loop is the examples' loop: zero_grad, forward, cross-entropy, backward, step; and
``privacy_engine.get_epsilon(delta)`` after every epoch. Prints the JSON line that
bench/runs/dpfunc_run.py prints.
"""

import time

START = time.perf_counter()  # before the imports: they are part of the run

import sys  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import opacus.privacy_engine  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from opacus import PrivacyEngine  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads  # noqa: E402  (bench/runs/workloads.py: data, models, clock)

SETTINGS = {
    "digits": dict(
        batch=128, epochs=10, target_epsilon=3.0, delta=1e-5, clip_norm=1.0, lr=0.5, momentum=0.9
    ),
    "mnist": dict(
        batch=64, epochs=10, noise_multiplier=1.0, delta=1e-5, clip_norm=1.0, lr=0.1, momentum=0.0
    ),
}  # fmt: skip  (the same as bench/runs/dpfunc_run.py)

warnings.filterwarnings("ignore")  # Opacus warns about the secure RNG and the delta


def main(args) -> None:
    clock = workloads.Clock(START)
    clock.lap("imports")
    if args.threads:
        torch.set_num_threads(args.threads)
    s = SETTINGS[args.workload]
    train_set, test_set, model, epochs = workloads.problem(s, args)
    optimizer = torch.optim.SGD(model.parameters(), lr=s["lr"], momentum=s["momentum"])
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(*train_set), batch_size=s["batch"]
    )
    calibration = []
    get_noise_multiplier = opacus.privacy_engine.get_noise_multiplier

    def timed_calibration(**kwargs):  # the instrument: make_private_with_epsilon calls it
        started = time.perf_counter()
        value = get_noise_multiplier(**kwargs)
        calibration.append(time.perf_counter() - started)
        return value

    opacus.privacy_engine.get_noise_multiplier = timed_calibration
    privacy_engine = PrivacyEngine()
    common = dict(module=model, optimizer=optimizer, data_loader=loader,
                  max_grad_norm=s["clip_norm"])  # fmt: skip
    if "target_epsilon" in s:
        model, optimizer, loader = privacy_engine.make_private_with_epsilon(
            **common, target_epsilon=s["target_epsilon"], target_delta=s["delta"], epochs=epochs
        )
    else:
        model, optimizer, loader = privacy_engine.make_private(
            **common, noise_multiplier=s["noise_multiplier"]
        )
    clock.lap("setup")
    clock.phases["setup"] -= sum(calibration)
    clock.phases["calibration"] = sum(calibration)
    epsilons, epsilon_seconds, steps, first_step = [], [], 0, None
    for _ in range(epochs):
        model.train()
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            steps += 1
            if first_step is None:  # the instrument: when the first step ended
                first_step = time.perf_counter() - clock.last
        clock.lap("steps")
        epsilons.append(privacy_engine.get_epsilon(s["delta"]))
        epsilon_seconds.append(clock.lap("epsilon"))
    test_accuracy = workloads.accuracy(model, test_set)
    clock.lap("evaluation")
    clock.report(
        library="opacus", workload=args.workload, steps=steps,
        noise_multiplier=optimizer.noise_multiplier, epsilon=epsilons[-1],
        epsilon_each_epoch=epsilons, epsilon_calls=epsilon_seconds, accuracy=test_accuracy,
        threads=torch.get_num_threads(), accountant=f"{privacy_engine.accountant.mechanism()}",
        first_step=first_step,
    )  # fmt: skip


if __name__ == "__main__":
    main(workloads.arguments(__doc__.splitlines()[0], sorted(SETTINGS)))
