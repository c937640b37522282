"""Auditing DP-SGD empirically: the lower bound an attacker proves, against the claim.

What it shows: ``dpfunc.audit`` measures privacy instead of arguing it. For
each target epsilon it calibrates the noise of one full-batch DP-SGD step,
then trains many times on a problem with Dirac gradient canaries
(``audit.GradientCanary``: each canary's gradient is a fixed direction that
no other example touches, with a norm far above the clip norm), each canary
present in half of the runs. The score of a canary is the final
parameters' projection on its direction, and ``audit.epsilon_lower_bound``
turns the scores of present and absent canaries into an epsilon that the
runs prove with 95% confidence.

Five implementations are audited against the same claim:

- ``sound``: dpfunc's step, secret seed (the default). Its bound must stay
  below the claim.
- ``noise halved``: the step adds half the noise the claim assumes.
- ``no clipping``: the clip norm is far above the canaries' norm while the
  noise is the claimed multiple of the claimed clip norm.
- ``realised batch``: the noisy sum is divided by the realised batch size
  instead of the expected one (one canary and one real example per run: with
  larger batches the leak is smaller, but it is there).
- ``public seed``: every run keys its noise with ``seed=0`` and the attacker
  regenerates the noise and subtracts it (the old default of many libraries'
  examples).

Each broken variant is caught where its bound rises above the diagonal.
What an audit does NOT show: a bound below the claim is not a proof of
privacy, only the absence of evidence against it for this canary, score
and number of runs (no bound here can exceed about log(runs * canaries)).

Run (about a minute on 2 CPU cores; writes audit.png and audit.json):

    python examples/audit.py
    python examples/audit.py --smoke   # two epsilons, fewer runs, seconds
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
import warnings

import report  # examples/report.py: tables, JSON and plots
import torch

import dpfunc
from dpfunc import accounting, audit, optim

# --- settings ---------------------------------------------------------------
TARGET_EPSILONS = [0.5, 1.0, 2.0, 4.0, 8.0]  # claims to audit, one full-batch step each
DELTA = 1e-5  # the claims' delta
CANARIES = 2000  # canaries per run: each run gives one score per canary
RUNS = 40  # training runs per implementation (40 * 1000 scores per side)
REALISED_RUNS = 2000  # runs of the one-canary realised-batch experiment
CONFIDENCE = 0.95  # of every lower bound
CLIP_NORM = 1.0  # the claimed clip norm C
# --smoke: two claims, few runs; checks that the script runs
SMOKE = {"TARGET_EPSILONS": [1.0, 4.0], "RUNS": 3, "REALISED_RUNS": 200}


class RealisedBatchStep(dpfunc.TrainStep):
    """Broken on purpose: divides the noisy sum by the realised batch size."""

    def logical_step(self, state, micro_batches, noise, *, before_release=None):
        parts = [self.clip(state.params, batch, mask) for batch, mask in micro_batches]
        summed = {k: sum(part[k] for part, _ in parts) for k in state.params}
        realised = sum(float(stats.mask.sum()) for _, stats in parts)
        private = dpfunc.average(dpfunc.add_noise(summed, noise.params, self.noise_std), realised)
        updates, opt_state = self.optimizer.update(private, state.opt_state, state.params)
        params = optim.apply_updates(state.params, updates)
        return state._replace(params=params, opt_state=opt_state, step=state.step + 1), None


def bound(canary, step, runs, *, seed=None, attacker_seed=None):
    """Trains ``runs`` times with ``step`` and returns the audited lower bound.

    ``seed=None`` draws a fresh secret per run; an int keys every run with it
    (public). ``attacker_seed``: the attacker regenerates and removes the
    noise of that seed before scoring.
    """
    size = canary.examples + canary.canaries

    def train(dataset):
        params = audit.train_with_step(
            step,
            canary.params,
            dataset,
            steps=1,
            sample_rate=1.0,
            physical_batch_size=size,
            seed=seed,
        )
        if attacker_seed is None:
            return params
        return audit.remove_known_noise(
            params,
            seed=attacker_seed,
            steps=1,
            noise_std=step.noise_std,
            expected_batch_size=step.expected_batch_size,
            lr=1.0,
        )

    scores = audit.canary_scores(train, canary, runs, seed=next(DESIGNS))
    return audit.epsilon_lower_bound(
        scores.scores_in, scores.scores_out, delta=DELTA, confidence=CONFIDENCE
    )


DESIGNS = itertools.count()  # each experiment's public choice of present canaries


def audit_claim(target: float, runs: int, realised_runs: int) -> dict:
    sigma = accounting.calibrate_noise_multiplier(target, DELTA, sample_rate=1.0, steps=1)
    claim = accounting.epsilon(sigma, 1.0, 1, DELTA)
    canary = audit.GradientCanary(CANARIES)

    def step(clip_norm=CLIP_NORM, noise_multiplier=sigma):
        return dpfunc.make_train_step(
            canary.loss_fn,
            optim.sgd(1.0),
            clip_norm=clip_norm,
            noise_multiplier=noise_multiplier,
            expected_batch_size=float(CANARIES),
            model=canary.model,
        )

    unclipped = 10 * canary.canary_norm  # noise std still sigma * CLIP_NORM
    one = audit.GradientCanary(1, examples=1)
    realised = RealisedBatchStep(
        one.loss_fn,
        optim.sgd(1.0),
        clip_norm=CLIP_NORM,
        noise_multiplier=sigma,
        expected_batch_size=1.0,
    )
    return {
        "target": target,
        "claimed_epsilon": claim,
        "noise_multiplier": sigma,
        "sound": bound(canary, step(), runs),
        "noise halved": bound(canary, step(noise_multiplier=sigma / 2), runs),
        "no clipping": bound(
            canary, step(clip_norm=unclipped, noise_multiplier=sigma * CLIP_NORM / unclipped), runs
        ),
        "realised batch": bound(one, realised, realised_runs),
        "public seed": bound(canary, step(), runs, seed=0, attacker_seed=0),  # broken: public
    }


VARIANTS = ["sound", "noise halved", "no clipping", "realised batch", "public seed"]


def plot(rows: list[dict], path: str) -> None:
    claims = [r["claimed_epsilon"] for r in rows]
    fig, ax = report.pyplot().subplots(figsize=(6, 4.5))
    top = max(max(claims), max(r[v] for r in rows for v in VARIANTS)) * 1.1
    ax.plot([0, top], [0, top], color="grey", linestyle="--", label="claim (accountant)")
    for variant, marker in zip(VARIANTS, "os^Dv"):
        ax.plot(claims, [r[variant] for r in rows], marker=marker, label=variant)
    ax.set_xlabel(f"claimed epsilon (PLD accountant, delta={DELTA:g})")
    ax.set_ylabel(f"audited lower bound ({CONFIDENCE:.0%} confidence)")
    ax.set_title("Canary audit of one full-batch DP-SGD step")
    ax.legend(fontsize=8)
    report.save_figure(fig, path)


def main(smoke: bool, out: str) -> None:
    targets, runs, realised_runs = TARGET_EPSILONS, RUNS, REALISED_RUNS
    if smoke:
        targets, runs, realised_runs = (SMOKE[k] for k in SMOKE)
    rows = []
    print(f"{'claim':>6} " + " ".join(f"{v:>14}" for v in VARIANTS) + "  seconds")
    for target in targets:
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # ghost planning notes
            row = audit_claim(target, runs, realised_runs)
        rows.append(row)
        caught = {v: row[v] > row["claimed_epsilon"] for v in VARIANTS}
        cells = " ".join(f"{row[v]:>12.2f}{' !' if caught[v] else '  '}" for v in VARIANTS)
        print(f"{row['claimed_epsilon']:>6.2f} {cells}  {time.perf_counter() - started:.0f}")
    print("'!' marks a bound above the claim: an implementation proved less private than claimed")
    report.save_json(rows, os.path.join(out, "audit.json"))
    plot(rows, os.path.join(out, "audit.png"))
    sound_ok = all(r["sound"] <= r["claimed_epsilon"] for r in rows)
    print(f"sound implementation within every claim: {sound_ok}")
    if not sound_ok:
        raise SystemExit("the sound implementation audited above its claim")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="two claims, few runs")
    parser.add_argument("--out", default="results", help="folder for audit.json and audit.png")
    args = parser.parse_args()
    torch.manual_seed(0)  # the canary problem's data and initialisation: public
    main(args.smoke, args.out)
