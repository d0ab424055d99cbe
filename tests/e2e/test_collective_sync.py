"""The collective weight sync end to end on gloo: a megatron-core actor at TP=2 x PP=2 (four
ranks, each stage sending its own tensors over its own group) into two vLLM engines of two
workers each. After a sync both engines serve the version and match the actor's log-probs; a
receiver killed in the middle of a sync leaves no engine on the new version (one whose weights
it wrote refuses to generate), and the trainer syncs again afterwards."""

import os
import threading

import pytest

from agentgym_mega.config import load_config
from agentgym_mega.rollout.batch import PolicyUpdateBatch
from agentgym_mega.rollout.engines import SamplingConfig
from tests.e2e.test_megatron_to_vllm import logprob_gap, sequences

pytestmark = pytest.mark.slow  # four trainer ranks and two TP=2 CPU engines: about two minutes

MEAN_TOLERANCE = 1e-5  # mean |logprob diff| over sampled tokens, fp32
PROMPTS = [[1, 5, 9, 20, 33, 7], [1, 7, 7, 7], [1, 300, 12, 40], [1, 2, 3, 4, 5]]
SAMPLING = SamplingConfig(temperature=1.0, max_tokens=12)
SEEDS = [3, 4, 5, 6]


class DyingEngine:
    """An engine of two workers whose first worker dies after the first tensor of a sync."""

    def __init__(self, model_dir: str):
        from agentgym_mega.weight_sync.vllm_loader import checkpoint_shapes

        self.shapes = checkpoint_shapes(model_dir)

    def receive_weights(self, join) -> int:
        from agentgym_mega.weight_sync.collective import CollectiveReceiver, GroupSpec

        group, first_rank, version, secret = join.group, join.first_rank, join.version, join.secret

        def worker(rank: int):
            receiver = CollectiveReceiver(GroupSpec.of(group), rank, secret)
            for _ in receiver.stream(version, self.shapes):
                if rank == first_rank:
                    os._exit(1)

        threads = [threading.Thread(target=worker, args=(first_rank + i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return version


def test_tp2_pp2_stages_sync_two_tp2_engines_all_or_nothing(tmp_path):
    import ray

    from agentgym_mega.cluster import PolicyGroup
    from agentgym_mega.models.tiny import TinySpec, make_tiny_model
    from agentgym_mega.rollout.engines.vllm_engine import launch_remote

    model = make_tiny_model(str(tmp_path / "qwen2"), TinySpec(arch="qwen2", kv_heads=2))
    cfg = load_config(None, [
        "parallel.world_size=4", "parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=false",
        "model.dtype=float32", "trainer.lr=0.01", "trainer.batch_size=4", "trainer.mini_batch_size=4",
        "algorithm.kl_coef=0", "algorithm.entropy_coef=0", "rollout.engine_tp=2",
        "weight_sync.transport=collective", "weight_sync.bucket_mb=1", "weight_sync.timeout_s=60",
    ])
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    try:
        group = PolicyGroup(cfg, model)
        engines = [launch_remote(model, tp=2, max_model_len=256) for _ in range(2)]

        def step():
            generated = ray.get(engines[0].generate.remote(PROMPTS, SAMPLING, SEEDS))
            ids, mask = sequences(PROMPTS, generated)
            old = group.logprobs(ids, 1.0)
            group.update(PolicyUpdateBatch(ids, loss_mask=mask, old_logprobs=old, advantages=mask.clone()), 1.0)

        def parity(engine) -> list:
            generated = ray.get(engine.generate.remote(PROMPTS, SAMPLING, SEEDS))
            diff = logprob_gap(group, PROMPTS, generated)
            print(f"megatron TP=2 PP=2 -> vLLM TP=2 (collective): mean |dlogp| {diff.mean():.2e}, max {diff.max():.2e}")
            assert diff.mean() <= MEAN_TOLERANCE and diff.max() <= 100 * MEAN_TOLERANCE
            return generated

        step()
        stats = group.sync_weights(engines, 1)
        model_bytes = sum(p.numel() * 4 for p in _hf_tensors(model))
        assert stats.receivers == 4 and stats.bytes == model_bytes  # each byte sent once, by one stage
        assert [ray.get(e.health.remote())["version"] for e in engines] == [1, 1]
        for engine in engines:
            parity(engine)

        # A receiver killed mid-sync: the engine that received everything does not take the
        # version either, and, its weights written without a commit, serves nothing until a re-send.
        step()
        dying = ray.remote(num_cpus=0)(DyingEngine).remote(model)
        with pytest.raises(ray.exceptions.RayTaskError, match="not taken"):
            group.sync_weights([engines[0], dying], 2)
        health = ray.get(engines[0].health.remote())
        assert health["version"] == 1 and health["weights"] == "dirty"
        with pytest.raises(ray.exceptions.RayTaskError, match="NotServing"):
            ray.get(engines[0].generate.remote(PROMPTS, SAMPLING, SEEDS))

        # The trainer is usable: a fresh group, and both engines take the next version.
        stats = group.sync_weights(engines, 2)
        assert stats.version == 2 and [ray.get(e.health.remote())["version"] for e in engines] == [2, 2]
        for engine in engines:
            parity(engine)
    finally:
        ray.shutdown()


def _hf_tensors(model_dir: str):
    from safetensors.torch import load_file

    return list(load_file(os.path.join(model_dir, "model.safetensors")).values())
