"""The trainer's client: servers started as Ray actors on CPU, batched calls fanned out over them."""

import pytest
import ray

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
        client.shutdown()
    finally:
        ray.shutdown()
