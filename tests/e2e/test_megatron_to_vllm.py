"""A megatron-core actor trained at TP=2 (two gloo ranks in Ray processes) streams its weights into
a vLLM engine; vLLM's log-probs then match the actor's recomputed ones (fp32)."""

import pytest
import torch

from agentgym_mega.config import load_config
from agentgym_mega.rollout.batch import PolicyUpdateBatch
from agentgym_mega.rollout.engines import SamplingConfig

pytestmark = pytest.mark.slow

MEAN_TOLERANCE = 1e-4  # mean |logprob diff| over generated tokens, fp32


def padded(rows: list[list[int]], pad: int = 0) -> torch.Tensor:
    out = torch.full((len(rows), max(map(len, rows))), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row)
    return out


def sequences(prompts, generations):
    ids = padded([p + g.token_ids for p, g in zip(prompts, generations)])
    mask = torch.zeros(ids.shape)
    for i, (p, g) in enumerate(zip(prompts, generations)):
        mask[i, len(p) : len(p) + len(g.token_ids)] = 1
    return ids, mask


def logprob_gap(group, prompts, generations) -> torch.Tensor:
    """|trainer - engine| log-probs of the tokens the engine generated (temperature 1)."""
    ids, mask = sequences(prompts, generations)
    megatron = group.logprobs(ids, 1.0)[mask.bool()]
    return (megatron - torch.tensor([lp for g in generations for lp in g.logprobs])).abs()


class Gone:
    """An actor killed before the sync: calling it fails as a crashed engine does."""

    def health(self):
        return {}

    def device_uuids(self):
        return []


def test_trained_tp2_weights_reach_vllm_with_logprob_parity(tmp_path):
    import ray

    from agentgym_mega.models.tiny import TinySpec, make_tiny_model

    # two KV heads: TP=2 gives each rank whole query groups
    tiny_qwen2 = make_tiny_model(str(tmp_path / "qwen2"), TinySpec(arch="qwen2", kv_heads=2))

    from agentgym_mega.cluster import PolicyGroup
    from agentgym_mega.rollout.engines.vllm_engine import launch_remote

    cfg = load_config(None, [
        "parallel.world_size=2", "parallel.tp=2", "model.dtype=float32", "trainer.lr=0.01",
        "trainer.batch_size=4", "trainer.mini_batch_size=4", "algorithm.kl_coef=0", "algorithm.entropy_coef=0",
        "weight_sync.bucket_mb=1", "weight_sync.transport=tcp",  # the other tests sync over ipc://
    ])
    prompts = [[1, 5, 9, 20, 33, 7], [1, 7, 7, 7], [1, 300, 12, 40], [1, 2, 3, 4, 5]]
    sampling = SamplingConfig(temperature=1.0, max_tokens=12)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        group = PolicyGroup(cfg, tiny_qwen2)
        engine = launch_remote(tiny_qwen2, max_model_len=256)
        before = ray.get(engine.generate.remote(prompts, sampling, [3] * len(prompts)))
        ids, mask = sequences(prompts, before)
        # Three PPO steps that push up the sampled tokens (advantage +1 on every one).
        for _ in range(3):
            old = group.logprobs(ids, 1.0)
            batch = PolicyUpdateBatch(ids, loss_mask=mask, old_logprobs=old, advantages=mask.clone())
            metrics = group.update(batch, 1.0)
            assert metrics["grad_norm"] > 0
        trained = group.logprobs(ids, 1.0)
        assert (trained - old)[mask.bool()].mean() > 0  # the update moved the policy

        # A sync that fails on rank 0 before streaming (here: a dead engine) raises there, and
        # rank 1 still gets through the collective gather instead of waiting in it forever.
        gone = ray.remote(num_cpus=0)(Gone).remote()
        ray.kill(gone)
        failed = [r.sync_weights.remote([gone], 1) for r in group.rank_procs]
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(failed[0], timeout=120)
        assert ray.get(failed[1], timeout=120) is None

        stats = group.sync_weights([engine], 1)
        assert stats.version == 1 and stats.buckets > 1
        assert ray.get(engine.health.remote())["version"] == 1

        after = ray.get(engine.generate.remote(prompts, sampling, [3] * len(prompts)))
        diff = logprob_gap(group, prompts, after)
        print(f"megatron TP=2 -> vLLM: mean |dlogp| {diff.mean():.2e}, max {diff.max():.2e}")
        assert diff.mean() <= MEAN_TOLERANCE and diff.max() <= 10 * MEAN_TOLERANCE
    finally:
        ray.shutdown()
