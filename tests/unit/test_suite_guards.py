"""The suite's own guards (tests/conftest.py, pytest.ini), run on a pytest session of their own:
a hung test fails at its timeout with its traceback and the processes it started are ended before
the next test; slow tests get the larger ceiling; a test that swallows its timeout is unstuck by
killing what it waits on, and still fails; a test the signal cannot stop ends the run with every
thread's stack; the shell's steering variables are cleared."""

import contextlib
import os
import subprocess
import sys

import psutil

from tests.conftest import REPO, SLOW_TIMEOUT_S

SESSION = '''
import os, signal, subprocess, sys, time
import psutil, pytest
import tests.conftest

tests.conftest.UNSTICK_S, tests.conftest.CLEANUP_GRACE_S = 2.0, 6.0  # short for this session


def start_tree(name):
    """A child that starts a grandchild, both sleeping, as a hung Ray or vLLM call leaves them."""
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '600']); "
                              "time.sleep(600)"])
    while not psutil.Process(child.pid).children():
        time.sleep(0.05)
    with open(os.path.join(os.environ["GUARD_DIR"], name), "w") as f:
        f.write(" ".join(str(p.pid) for p in [psutil.Process(child.pid)] + psutil.Process(child.pid).children()))
    return child


@pytest.mark.timeout(4)
def test_hangs():
    start_tree("hung").wait()


def test_next():
    pids = [int(p) for p in open(os.path.join(os.environ["GUARD_DIR"], "hung")).read().split()]
    assert len(pids) == 2 and not [p for p in pids if psutil.pid_exists(p)
                                   and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


@pytest.mark.slow
def test_slow(request):
    assert request.node.get_closest_marker("timeout").args == ({slow},)


def test_environment():
    assert [k for k in ("AGENTGYM_MEGA_SECRET", "RAY_ADDRESS", "MASTER_PORT", "VLLM_CPU_KVCACHE_SPACE",
                        "SLURM_JOB_ID", "GCS_PORT") if k in os.environ] == []
    assert (os.environ["CUDA_VISIBLE_DEVICES"], os.environ["HF_HUB_OFFLINE"]) == ("", "1")


@pytest.mark.timeout(4)
def test_swallowed():
    child = start_tree("swallowed")
    try:
        child.wait()
    except BaseException:  # the timeout's exception swallowed, as ray.get does
        pass
    child.wait()  # returns once the guard kills the tree


@pytest.mark.timeout(4)
def test_stuck():
    signal.signal(signal.SIGALRM, signal.SIG_IGN)  # as a call stuck in C: the timeout's signal does nothing
    start_tree("stuck").wait()
'''


def _ended(path) -> bool:
    """Both processes of the tree a test wrote to `path` are gone (given a moment to be reaped)."""
    pids = [int(p) for p in path.read_text().split()]
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    return len(pids) == 2 and not psutil.wait_procs(procs, timeout=10)[1]


def _session(tmp_path, *select: str) -> str:
    """The session's tests `select` run by tests/conftest.py (as a plugin) and the suite's pytest.ini,
    with steering variables set as a shell might; returns its output (a failed run)."""
    steering = {"AGENTGYM_MEGA_SECRET": "s" * 32, "RAY_ADDRESS": "10.0.0.1:6379", "MASTER_PORT": "29500",
                "VLLM_CPU_KVCACHE_SPACE": "40", "SLURM_JOB_ID": "7", "GCS_PORT": "6390"}
    env = dict(os.environ, **steering, GUARD_DIR=str(tmp_path), CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1",
               PYTHONPATH=REPO)
    (tmp_path / "test_session.py").write_text(SESSION.format(slow=SLOW_TIMEOUT_S))
    command = [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-c", os.path.join(REPO, "pytest.ini"),
               "--rootdir", str(tmp_path), "-v", "-p", "no:cacheprovider",
               *(f"{tmp_path / 'test_session.py'}::test_{name}" for name in select)]
    run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    return run.stdout + run.stderr


def test_a_hung_test_fails_with_its_traceback_and_the_next_finds_its_processes_ended(tmp_path):
    out = _session(tmp_path, "hangs", "next", "slow", "environment")
    for name, outcome in (("hangs", "FAILED"), ("next", "PASSED"), ("slow", "PASSED"), ("environment", "PASSED")):
        assert f"test_session.py::test_{name} {outcome}" in out, out
    assert "Timeout (>4.0s) from pytest-timeout" in out and 'start_tree("hung").wait()' in out, out
    assert _ended(tmp_path / "hung")


def test_a_test_that_swallows_its_timeout_is_unstuck_and_still_fails(tmp_path):
    out = _session(tmp_path, "swallowed", "slow")
    assert "test_session.py::test_swallowed FAILED" in out and "test_session.py::test_slow PASSED" in out, out
    assert "timed out, swallowed the timeout's exception" in out, out
    assert _ended(tmp_path / "swallowed")


def test_a_test_the_signal_cannot_stop_ends_the_run_with_every_stack(tmp_path):
    out = _session(tmp_path, "stuck", "next")
    assert "test_stuck did not stop 6 s after its 4 s timeout" in out and "Stack of MainThread" in out, out
    assert 'start_tree("stuck").wait()' in out and "test_next" not in out, out
    assert _ended(tmp_path / "stuck")
