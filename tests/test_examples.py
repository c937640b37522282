"""Every example runs top to bottom in its --smoke mode."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from extras import missing_in_output  # noqa: E402 (beside this file)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# under torchrun; the shared tables and plots module
NOT_SINGLE = ("ddp_digits.py", "sharded_digits.py", "report.py")
SINGLE_PROCESS = sorted(p.name for p in EXAMPLES.glob("*.py") if p.name not in NOT_SINGLE)


def run(command, tmp_path):
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0 and (reason := missing_in_output(done.stderr)) is not None:
        pytest.skip(reason)  # an optional extra this environment lacks
    assert done.returncode == 0, f"{command} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.slow
@pytest.mark.parametrize("name", SINGLE_PROCESS)
def test_example_smoke(name, tmp_path):
    run([sys.executable, str(EXAMPLES / name), "--smoke", "--out", str(tmp_path)], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp_digits.py", "sharded_digits.py"])
def test_distributed_example_smoke(name, tmp_path):
    script = EXAMPLES / name
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    run([*torchrun, str(script), "--smoke"], tmp_path)
