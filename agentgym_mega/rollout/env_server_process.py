"""An environment server inside a Ray process: uvicorn runs in a thread of that process."""

from __future__ import annotations

import threading
import time

from agentgym_mega.network import reachable_ip
from envs.server import make_server

START_TIMEOUT_S = 120.0


class EnvServerProcess:
    def __init__(self, env: str, max_instances: int, idle_timeout: float, env_options: dict | None = None):
        # Loopback on one machine, the node's IP on a cluster; port 0: the OS picks a free port,
        # read back once uvicorn is listening.
        host = reachable_ip()
        self._server = make_server(env, host, 0, max_instances, idle_timeout, env_options=env_options)
        self._thread = threading.Thread(target=self._server.run, name=f"{env}-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the {env} server did not start")
            time.sleep(0.05)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self._url = f"http://{host}:{port}"

    def url(self) -> str:
        return self._url

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
