"""Real env servers started through the CLI, as users start them, on ports the OS picks."""

import contextlib
import subprocess

import psutil
import pytest

from agentgym_mega.network import start_server
from agentgym_mega.rollout.env_client import wait_healthy
from tests.conftest import REPO


class Server:
    def __init__(self, env: str, *args: str):
        self.proc, self.url = start_server(["env-server", "--env", env, *args], cwd=REPO)
        wait_healthy(self.url)
        self.process = psutil.Process(self.proc.pid)

    def rss(self) -> int:
        return self.process.memory_info().rss

    def java_children(self) -> list[psutil.Process]:
        return [p for p in self.process.children(recursive=True) if "java" in p.name()]

    def stop(self) -> None:
        self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        if self.proc.poll() is None:
            self.proc.kill()


@contextlib.contextmanager
def running(env: str, *args: str):
    server = Server(env, *args)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def textcraft_server():
    with running("textcraft", "--max-instances", "128") as server:
        yield server


@pytest.fixture(scope="module")
def babyai_server():
    with running("babyai", "--max-instances", "128") as server:
        yield server
