"""Start-up that fails halfway leaves nothing running: the env servers already started are
stopped and the placement groups removed, and the error that stopped it reaches the caller. With
offload on, the engines sleep while the trainer roles load, every role in one process per rank."""

import time

import pytest
import ray
import requests
import torch

from agentgym_mega.config import load_config
from agentgym_mega.errors import BadInput
from agentgym_mega.stack import Stack

pytestmark = pytest.mark.slow  # a Ray and an env server, or an engine and an actor: 15-60 s


def server_gone(url: str, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # ray.kill returns before the process has exited
        try:
            requests.get(url + "/health", timeout=2)
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError):
            return True  # refused, or cut off mid-answer by the exit
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


def test_with_offload_the_engines_sleep_while_the_trainer_roles_load_in_one_process_per_rank(tiny_qwen2):
    # Colocated on GPUs the roles' weights (and a resume's Adam state) would otherwise load on
    # top of the engines' whole share of each GPU: the start-up peak `agentgym-mega plan` found.
    cfg = load_config(None, [f"model.path={tiny_qwen2}", "model.dtype=float32", "algorithm.kl_coef=0.001",
                             "algorithm.estimator=gae", "parallel.world_size=1", "parallel.tp=1",
                             "parallel.sequence_parallel=false", "rollout.max_model_len=512",
                             "rollout.max_tokens_per_turn=64", "cluster.offload=true"])
    with Stack.start(cfg, env=False) as stack:
        assert all(ray.get(e.health.remote())["sleeping"] for e in stack.engines)
        # every role's model lives in the one trainer process of the rank
        procs = stack.actor.rank_procs
        assert len(procs) == 1 and procs == stack.ref.rank_procs == stack.critic.rank_procs
        # ... as models of their own: released and restored role by role, the reference scores
        # as the starting actor does, and the critic answers with its value head
        stack.trainers_release()
        stack.trainers_restore()
        ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
        actor, ref = stack.actor.logprobs(ids, 1.0), stack.ref.logprobs(ids, 1.0)
        assert torch.equal(actor, ref) and actor[:, 1:].abs().min() > 0
        assert stack.critic.values(ids).shape == ids.shape


def test_a_recipe_naming_another_model_than_its_checkpoint_is_refused_before_anything_starts(tiny_qwen2):
    cfg = load_config(None, [f"model.path={tiny_qwen2}", 'model.architecture={"hidden_size": 3584}'])
    with pytest.raises(BadInput, match=r"model.architecture.hidden_size=3584 disagrees with .*config.json \(128\)"):
        with Stack.start(cfg):
            pass
    assert not ray.is_initialized()
