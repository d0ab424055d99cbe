"""slurm/train_scalinginter.sh without Slurm: stand-in `srun` (runs the command here) and
`scontrol` (lists the node names) on PATH, so the script's own Ray bring-up (a head and a worker
node joining it, both on this machine), wait and teardown really run, with `agentgym-mega config`
in place of train. sbatch's directives and separate machines are left to a real cluster."""

import os
import subprocess
import sys
import tempfile

import pytest

from agentgym_mega.network import free_port
from tests.conftest import REPO

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(REPO, "slurm", "train_scalinginter.sh")
SRUN = """#!/bin/bash
# srun stand-in: drop the step options, run the command on this machine.
while [[ $# -gt 0 && $1 == -* ]]; do
    case $1 in -w|--nodelist|-N|-n) shift 2 ;; *) shift ;; esac
done
exec "$@"
"""
SCONTROL = """#!/bin/bash
[[ $1 == show && $2 == hostnames ]] && tr ',' '\\n' <<< "$3"
"""


def _launch(tmp_path, ray_dir, *args, nodes="node-a"):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
               SLURM_JOB_NODELIST=nodes, SLURM_GPUS_PER_NODE="h100:2", SLURM_CPUS_PER_TASK="2",
               RAY_PORT=str(free_port()), RAY_TMPDIR=ray_dir,  # this Ray only: not /tmp/ray's current cluster
               AGM_SUBCOMMAND="config")
    env.pop("RAY_ADDRESS", None)
    return subprocess.run(["bash", SCRIPT, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_script_parses():
    assert subprocess.run(["bash", "-n", SCRIPT]).returncode == 0


def test_brings_ray_up_runs_the_command_with_the_overrides_and_tears_down(tmp_path):
    ray_dir = tempfile.mkdtemp(prefix="agm-ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    result = _launch(tmp_path, ray_dir, "babyai", "trainer.total_steps=7", "cluster.placement=split",
                     nodes="node-a,node-b")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "2 nodes, 2 GPUs and 2 CPUs each" in result.stdout  # printed once both nodes are alive
    assert "total_steps: 7" in result.stdout and "placement: split" in result.stdout
    assert "caps:\n  - 6\n  - 13\n  - 20" in result.stdout  # configs/babyai_scalinginter.yaml
    left = subprocess.run(["pgrep", "-f", ray_dir], capture_output=True, text=True).stdout.split()
    assert not left, f"Ray processes left running: {left}"


def test_a_bad_override_stops_before_ray_starts(tmp_path):
    result = _launch(tmp_path, "/tmp/agm-ray-unused", "babyai", "trainer.total_stepz=7")
    assert result.returncode == 2 and "trainer.total_stepz" in result.stderr
    assert "Ray cluster up" not in result.stdout
