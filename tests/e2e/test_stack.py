"""Start-up that fails halfway leaves nothing running: the env servers already started are
stopped and the placement groups removed, and the error that stopped it reaches the caller."""

import time

import pytest
import ray
import requests

from agentgym_mega.config import load_config
from agentgym_mega.errors import BadInput
from agentgym_mega.stack import Stack

pytestmark = pytest.mark.slow  # a Ray and an env server: about 15 s


def server_gone(url: str, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # ray.kill returns before the process has exited
        try:
            requests.get(url + "/health", timeout=2)
        except requests.ConnectionError:
            return True
        time.sleep(1)
    return False


def test_a_start_up_failing_after_the_env_servers_stops_them(monkeypatch):
    # An unknown category is found only once the servers answer with their catalogue, after
    # they and the placement groups exist.
    cfg = load_config(None, ["env.name=textcraft", "env.num_servers=1", "env.categories=[depth-9]",
                             "algorithm.kl_coef=0.0"])
    seen = []
    original = Stack._start
    monkeypatch.setattr(Stack, "_start", lambda stack, *args: (seen.append(stack), original(stack, *args)))
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with pytest.raises(BadInput, match=r"env.categories: unknown \['depth-9'\]"):
            with Stack.start(cfg):
                pass
        stack = seen[0]
        assert len(stack.env_servers) == 1 and stack.engines == [] and stack.actor is None
        assert server_gone(stack.env.urls[0])
        groups = ray.util.placement_group_table()
        assert groups and all(g["state"] == "REMOVED" for g in groups.values())
        assert ray.is_initialized()  # a Ray the caller started is the caller's to stop
    finally:
        ray.shutdown()
