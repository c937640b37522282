"""Running a test script on several local ranks, as torchrun would (gloo on 127.0.0.1).

Each rank is ``python SCRIPT ARGS...`` with MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE and LOCAL_RANK set and one thread; its output goes to a log in
the test's folder. Every launch has an overall guard: ranks still alive
after it are killed and the test fails, so a hung collective cannot hang
the suite.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

NEEDS_GLOO = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available",
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script, args, outdir, world_size, *, guard_s, wait_for=None, log_prefix=""):
    """Runs ``script args`` on ``world_size`` ranks; ``[(returncode, log)]`` of ``wait_for``.

    ``wait_for``: the ranks waited for (default: all); the others are
    killed once those are done.
    """
    port = free_port()
    procs, logs = [], []
    for rank in range(world_size):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            OMP_NUM_THREADS="1",
        )
        log = open(os.path.join(outdir, f"{log_prefix}rank{rank}.log"), "w+")  # noqa: SIM115
        command = [sys.executable, str(script), *[str(a) for a in args]]
        procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
        logs.append(log)
    deadline = time.monotonic() + guard_s
    try:
        results = []
        for rank in range(world_size) if wait_for is None else wait_for:
            try:
                procs[rank].wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {rank} of {args[0]!r} still runs after {guard_s}s")
            logs[rank].seek(0)
            results.append((procs[rank].returncode, logs[rank].read()))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()


def assert_ok(results):
    for rank, (code, log) in enumerate(results):
        assert code == 0, f"rank {rank} exited with {code}:\n{log[-4000:]}"
    return results


def load_rank(outdir, rank):
    """What rank ``rank`` saved as ``rank{rank}.pt`` in ``outdir``."""
    return torch.load(os.path.join(outdir, f"rank{rank}.pt"), weights_only=False)
