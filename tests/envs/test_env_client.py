"""The trainer's client: servers started as Ray actors on CPU, batched calls fanned out over them."""

import time

import pytest
import ray
import requests

from agentgym_mega.rollout.env_client import EnvClient, Handle, start_servers
from envs.textcraft.game import TextCraftEnv


@pytest.mark.slow
def test_ray_actor_servers_and_batched_fan_out():
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        actors, urls = start_servers("textcraft", workers=2, num_cpus=0.5)
        assert len(set(urls)) == 2
        client = EnvClient(urls)
        handles = client.create(8)
        assert sorted({h.server for h in handles}) == [0, 1]
        idxs = [3, 130, 420, 540, 3, 130, 420, 540]
        first = client.reset(handles, idxs)
        replies = [f"Thought: step {k}.\nAction: get {k + 1} oak logs" for k in range(8)]
        steps = client.step(handles, replies)
        for k, (idx, obs, out) in enumerate(zip(idxs, first, steps)):
            alone = TextCraftEnv()
            assert obs["observation"] == alone.reset(idx)["observation"]
            assert out["observation"] == f"Got {k + 1} oak logs"
        broken = client.step([Handle(handles[0].server, 10**9)], ["inventory"])
        assert broken[0]["status"] == 404
        assert client.close(handles) == [{"closed": True}] * 8
        assert [h["instances"] for h in client.health()] == [0, 0]
        # A server that is gone at create time: its instances fail per item, the others work.
        ray.kill(actors[1])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # ray.kill returns before the process is gone
            try:
                requests.get(urls[1] + "/health", timeout=2)
            except requests.ConnectionError:
                break
            time.sleep(0.1)
        handles = client.create(4)
        results = client.reset(handles, [3, 3, 130, 130])
        assert [h.id >= 0 for h in handles] == [True, False, True, False]
        assert all("error" not in r for r in results[0::2])
        assert all("unavailable" in r["error"] for r in results[1::2])
        client.close(handles[0::2])
        client.shutdown()
    finally:
        ray.shutdown()
