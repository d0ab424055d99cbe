import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs `agentgym-mega ARGS` as a user would, in a fresh process."""
    return subprocess.run(
        [sys.executable, "-m", "agentgym_mega.cli", *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO,
    )


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    from agentgym_mega.models.tiny import TinySpec, make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "qwen2"), TinySpec(arch="qwen2"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    from agentgym_mega.models.tiny import TinySpec, make_tiny_model

    spec = TinySpec(arch="llama", heads=4, kv_heads=2, hidden=128)
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "llama"), spec)
