"""Differentially private physics-informed network for the 2-D Poisson equation.

What it shows: DP-SGD on a per-example loss that contains derivatives of the
network with respect to its INPUT: the Laplacian, the trace of the input
Hessian ``torch.func.jacrev(jacrev(u))(x)``. Hook-based per-sample gradients
(Opacus) cannot do this; in dpfunc the loss is any function ``torch.func`` can
differentiate, so ``vmap(grad(loss))`` gives each example's gradient of its
own physics residual.

The problem: find u on the unit square with

    Laplacian u = f  in (0, 1)^2,    u = 0 on the boundary,

for f = -5 pi^2 sin(2 pi x) sin(pi y), whose exact solution is
u*(x, y) = sin(2 pi x) sin(pi y) (one positive and one negative bump).

The private data: the collocation points are the locations of sensors that
measured the source term f (think of devices carried by people). Each example
is one sensor's (location, measured f). DP-SGD bounds what the trained network
reveals about any single sensor; the equation and the boundary condition are
public.

Boundary condition by construction: the model is

    u(x, y) = 16 x (1 - x) y (1 - y) * net(x, y),

which is 0 on the boundary whatever ``net`` is. So every example is an
interior point with loss ``(trace(Hessian u)(x_i) - f_i)**2``, and there are
no boundary examples and no weight between two kinds of loss to tune. The
factor 16 keeps ``net``'s target of order 1. (With u* = sin(pi x) sin(pi y)
this factor alone, times a constant, is already within a few percent of the
answer (5% relative error), which is why this example uses a solution with a
sign change.)

The script trains the same tanh MLP twice with Adam through ``dpfunc.Trainer``:
privately (target epsilon at delta = 1e-5) and non-privately (the limit case
clip_norm = inf, noise_multiplier = 0 of the same trainer: plain Adam on
Poisson batches of the mean loss). It prints the relative L2 error
||u - u*|| / ||u*|| on a test grid every few epochs and at the end, and saves
the exact, private and non-private solutions, their errors and the error by
epoch to ``<out>/pinn_laplacian.png``.

Run (about a minute on a CPU):

    python examples/pinn_laplacian.py             # full run, writes results/
    python examples/pinn_laplacian.py --smoke     # a few steps, a few seconds
    python examples/pinn_laplacian.py --out DIR   # write the plot to DIR
"""

from __future__ import annotations

import argparse
import math
import os
import time

import report  # examples/report.py: tables, JSON and plots
import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap

import dpfunc

# The noise calibration's first guess (dp-accounting's RDP accountant) logs harmless
# "failed to converge ... Excluding this order" warnings for some settings; hide them.

# --- settings ---------------------------------------------------------------
NUM_SENSORS = 20_000  # private collocation points (sensor locations), uniform in the square
WIDTH = 32  # hidden units per layer of the tanh MLP
DEPTH = 2  # hidden layers
EXPECTED_BATCH_SIZE = 1000  # sample_rate * NUM_SENSORS; each step's expected Poisson batch
EPOCHS = 30  # planned passes over the data (steps = EPOCHS * NUM_SENSORS / batch)
LEARNING_RATE = 2e-3  # Adam step size (both runs; constant: dpfunc.optim has no schedules)
CLIP_NORM = 1.0  # per-example gradient bound C (below most gradient norms: Adam rescales)
TARGET_EPSILON = 5.0  # privacy budget of the private run ...
DELTA = 1e-5  # ... at this delta (well below 1 / NUM_SENSORS)
PRINT_EVERY = 5  # print the error every this many epochs (the plot has all of them)
TEST_GRID = 101  # the error is measured on a TEST_GRID x TEST_GRID grid
SEED = 0  # fixes the data and the initialisation (public); batches and noise use a fresh secret
THREADS = 1  # torch CPU threads: these small ops gain nothing from more, and on busy
# cores extra threads wait for each other (2 threads ran 10x slower on 2 busy cores here)

SMOKE_NUM_SENSORS = 400  # --smoke: a little data ...
SMOKE_BATCH_SIZE = 100  # ... small batches ...
SMOKE_EPOCHS = 0.5  # ... two steps ...
SMOKE_GRID = 21  # ... a coarse test grid ...
SMOKE_NOISE_MULTIPLIER = 1.0  # ... and a fixed sigma (calibrating takes seconds): checks it runs


def exact_solution(z: torch.Tensor) -> torch.Tensor:
    """u*(x, y) = sin(2 pi x) sin(pi y) for points ``z[..., 2]``."""
    return torch.sin(2 * math.pi * z[..., 0]) * torch.sin(math.pi * z[..., 1])


def source(z: torch.Tensor) -> torch.Tensor:
    """f = Laplacian u* = -5 pi^2 u*."""
    return -5 * math.pi**2 * exact_solution(z)


def make_net(width: int, depth: int) -> nn.Module:
    layers, inputs = [], 2
    for _ in range(depth):
        layers += [nn.Linear(inputs, width), nn.Tanh()]
        inputs = width
    return nn.Sequential(*layers, nn.Linear(inputs, 1))


def main(smoke: bool, out: str) -> None:
    n, batch, epochs, grid = NUM_SENSORS, EXPECTED_BATCH_SIZE, EPOCHS, TEST_GRID
    if smoke:
        n, batch, epochs, grid = SMOKE_NUM_SENSORS, SMOKE_BATCH_SIZE, SMOKE_EPOCHS, SMOKE_GRID
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(THREADS)
    torch.manual_seed(SEED)

    # The private dataset: sensor locations and the source they measured.
    points = torch.rand(n, 2)
    measured = source(points)

    # The public test grid, on which we compare with the exact solution.
    axis = torch.linspace(0, 1, grid)
    gx, gy = torch.meshgrid(axis, axis, indexing="ij")
    test_points = torch.stack([gx.flatten(), gy.flatten()], dim=1)
    u_exact = exact_solution(test_points)

    net = make_net(WIDTH, DEPTH)
    params, buffers = dpfunc.functionalize(net)

    def u(params, z):
        """The solution at ONE point z[2]; zero on the boundary by construction."""
        x, y = z[0], z[1]
        value = functional_call(net, (params, buffers), (z,)).squeeze(-1)
        return 16 * x * (1 - x) * y * (1 - y) * value

    def loss_fn(params, example):
        """ONE sensor's squared PDE residual: Laplacian of u at its location minus f."""
        z, f = example
        hessian = jacrev(jacrev(u, argnums=1), argnums=1)(params, z)  # [2, 2], d2u / dz dz
        return (torch.trace(hessian) - f) ** 2

    def solution_on_grid(params) -> torch.Tensor:
        return vmap(u, in_dims=(None, 0))(params, test_points)

    def relative_error(params) -> float:
        error = torch.linalg.vector_norm(solution_on_grid(params) - u_exact)
        return float(error / torch.linalg.vector_norm(u_exact))

    print(f"{n} private sensor points, expected batch {batch}, {epochs} epochs")
    print(f"relative L2 error on a {grid}x{grid} grid of the initial network: ", end="")
    print(f"{relative_error(params):.3f} (of u = 0: 1.000)")

    runs, curves = {}, {}
    private = dict(clip_norm=CLIP_NORM, target_epsilon=TARGET_EPSILON)
    if smoke:
        private = dict(clip_norm=CLIP_NORM, noise_multiplier=SMOKE_NOISE_MULTIPLIER)
    for name, privacy in [
        ("private", private),
        ("non-private", dict(clip_norm=math.inf, noise_multiplier=0.0)),
    ]:
        started = time.perf_counter()
        trainer = dpfunc.Trainer(
            loss_fn,
            params,
            (points, measured),
            **privacy,
            optimizer=dpfunc.optim.adam(lr=LEARNING_RATE),
            epochs=epochs,
            expected_batch_size=batch,
            delta=DELTA,
            eval_fn=lambda p: {"rel_l2": relative_error(p)},
            progress=not smoke,
        )
        print(
            f"\n[{name}] clip_norm {trainer.step_fn.clip_norm}, noise_multiplier "
            f"{trainer.noise_multiplier:.3f}, {trainer.total_steps} steps"
        )
        # The training loss in the history reads the data without noise: it is for
        # debugging, not part of the private release. The test error only reads the
        # (private) parameters and the public grid.
        for record in trainer.fit():
            if record["epoch"] % PRINT_EVERY and record["steps"] < trainer.total_steps:
                continue
            print(
                f"  epoch {record['epoch']:5.2f}  step {record['steps']:4d}  "
                f"loss {record['loss']:9.4f}  rel L2 error {record['rel_l2']:.4f}  "
                f"epsilon {record['epsilon']:.2f}"
            )
        seconds = time.perf_counter() - started
        runs[name] = trainer.params
        curves[name] = [(r["epoch"], r["rel_l2"]) for r in trainer.history]
        print(
            f"[{name}] relative L2 error {relative_error(trainer.params):.4f}, "
            f"epsilon {trainer.epsilon():.2f} at delta {trainer.delta:g}, {seconds:.1f} s"
        )

    # Plot: the exact solution, both trained solutions, their errors, error by epoch.
    with torch.no_grad():
        fields = {name: solution_on_grid(p).reshape(grid, grid) for name, p in runs.items()}
    exact = u_exact.reshape(grid, grid)
    errors = {name: (field - exact).abs() for name, field in fields.items()}
    error_max = max(float(e.max()) for e in errors.values())
    panels = [
        ("exact u*", exact, "RdBu_r", (-1, 1)),
        (f"private (epsilon = {TARGET_EPSILON:g})", fields["private"], "RdBu_r", (-1, 1)),
        ("non-private", fields["non-private"], "RdBu_r", (-1, 1)),
        ("|private - exact|", errors["private"], "magma", (0, error_max)),
        ("|non-private - exact|", errors["non-private"], "magma", (0, error_max)),
    ]
    fig, axes = report.pyplot().subplots(2, 3, figsize=(13, 8))
    for ax, (title, values, cmap, (low, high)) in zip(axes.flat, panels):
        image = ax.imshow(
            values.T, origin="lower", extent=(0, 1, 0, 1), cmap=cmap, vmin=low, vmax=high
        )
        ax.set_title(title)
        ax.set_xlabel("x")
        ax.set_ylabel("y")
        fig.colorbar(image, ax=ax, fraction=0.046)
    ax = axes.flat[5]
    for name, curve in curves.items():
        ax.plot(*zip(*curve), marker="o", label=name)
    ax.set_yscale("log")
    ax.set_xlabel("epoch")
    ax.set_ylabel("||u - u*|| / ||u*||")
    ax.set_title("relative L2 error on the test grid")
    ax.legend()
    fig.suptitle("DP-SGD PINN: Laplacian u = -5 pi^2 sin(2 pi x) sin(pi y), u = 0 on the boundary")
    print()
    report.save_figure(fig, os.path.join(out, "pinn_laplacian.png"), dpi=100)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few steps, to check it runs")
    parser.add_argument("--out", default="results", help="directory for the plot")
    args = parser.parse_args()
    main(args.smoke, args.out)
