"""A weight sync that an engine does not take: the engine is retried once, then taken out of
rotation (weight_sync.on_engine_failure=drop) or the run stops with an error naming it (stop);
either way every engine left serves the new version, and the trainer goes on syncing."""

import pytest
import ray

from agentgym_mega.config import load_config
from agentgym_mega.stack import EngineSyncError, Stack

pytestmark = pytest.mark.slow  # an actor rank and two CPU vLLM engines, and two 15 s sync timeouts


def versions(stack: Stack) -> list[int]:
    return [h["version"] for h in ray.get([e.health.remote() for e in stack.engines])]


def test_a_dead_engine_stops_the_run_or_leaves_rotation_and_the_rest_stay_current(tiny_qwen2):
    cfg = load_config(None, [f"model.path={tiny_qwen2}", "model.dtype=float32", "algorithm.kl_coef=0.0",
                             "parallel.world_size=1", "parallel.tp=1", "parallel.sequence_parallel=false",
                             "rollout.num_engines=2", "rollout.max_model_len=512", "rollout.max_tokens_per_turn=64",
                             "cluster.placement=split", "weight_sync.timeout_s=15",
                             "weight_sync.on_engine_failure=stop"])
    with Stack.start(cfg, env=False) as stack:
        assert stack.sync_engines(1).receivers == 2 and versions(stack) == [1, 1]
        dead = stack.engines[1]
        ray.kill(dead)
        with pytest.raises(EngineSyncError, match=r"engine 1 did not take weights version 2 after a retry \(1 dead\)"):
            stack.sync_engines(2)
        assert ray.get(stack.engines[0].health.remote())["version"] == 2  # the live engine took the retry
        stack.cfg.weight_sync.on_engine_failure = "drop"
        stack.sync_engines(3)
        assert stack.engines == [stack.engines[0]] and dead not in stack.engines
        assert versions(stack) == [3] and stack.dropped_engines == 1
        assert stack.sync_engines(4).receivers == 1 and versions(stack) == [4]
