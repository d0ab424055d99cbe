"""`agentgym-mega train` stops on Slurm's signals instead of dying of them: SIGUSR1 (the warning
before the time limit) and SIGTERM (preemption, unless the site sets
PreemptParameters=send_user_signal). Once a step has run, either stops the run after the step
with a checkpoint (the Slurm test in tests/e2e/test_slurm_launch.py); before training starts, at
once with exit 75, the code the Slurm script requeues on."""

import os
import signal
import subprocess
import sys

import pytest

from agentgym_mega.trainer import STOPPED_EXIT_CODE
from tests.conftest import REPO


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["TERM", "USR1"])
def test_a_stop_signal_while_the_config_loads_ends_the_run_with_exit_75(tmp_path, tiny_qwen2, signum):
    # The config is a FIFO: the CLI blocks reading it, after its handlers are installed (they
    # come before any import of its own), and opening it for writing returns only once the CLI
    # has opened it. The signal arrives then, the config after it.
    config = tmp_path / "config.yaml"
    os.mkfifo(config)
    proc = subprocess.Popen([sys.executable, "-m", "agentgym_mega.cli", "train", "--config", str(config)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with open(config, "w") as f:
            proc.send_signal(signum)
            f.write(f"include: {os.path.join(REPO, 'configs', 'demo_cpu.yaml')}\nmodel:\n  path: {tiny_qwen2}\n")
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == STOPPED_EXIT_CODE, (proc.returncode, err)  # not -15 / -10: killed by it
    assert "stopped on request before training started" in err
    assert "placement:" not in out  # nothing started: Ray, the engines and the ranks cost grace time
