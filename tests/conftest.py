import contextlib
import math
import os
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
