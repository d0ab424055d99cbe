"""vLLM's sleep levels on a real GPU, as the training loop uses them: level 1 keeps the weights
through sleep and wake; level 2 discards them, the engine refuses to generate until a weight sync
commits, and then serves the synced weights (rotary caches and other buffers put back by vLLM).
Skipped where CUDA is absent (CI has no GPU)."""

import pytest
import torch

from agentgym_mega.rollout.engines.base import NotServing
from tests.e2e.test_weight_sync_vllm import GREEDY, PROMPTS, TOLERANCE, checkpoint_bytes, hf_logprobs, sync

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from agentgym_mega.models.tiny import TinySpec, make_tiny_model

    root = tmp_path_factory.mktemp("sleep")
    return {seed: make_tiny_model(str(root / f"m{seed}"), TinySpec(seed=seed)) for seed in (0, 1)}


def test_level_1_keeps_the_weights_and_level_2_serves_only_what_the_next_sync_brings(models):
    from agentgym_mega.rollout.engines.vllm_engine import VLLMEngine

    # fp32, to compare with transformers' log-probs at the CPU tests' tolerance
    engine = VLLMEngine(models[0], dtype="float32", max_model_len=512, gpu_memory_utilization=0.3)
    try:
        served = engine.generate(PROMPTS, GREEDY)
        engine.take_host_copy_bytes()
        engine.sleep(keep_weights=True)
        assert engine.health()["sleep_level"] == 1
        engine.wake()
        assert [g.token_ids for g in engine.generate(PROMPTS, GREEDY)] == [g.token_ids for g in served]
        level_1 = engine.take_host_copy_bytes()

        engine.sleep(keep_weights=False)
        health = engine.health()
        assert health["sleep_level"] == 2 and health["weights"] == "discarded", health
        engine.wake(("weights",))
        with pytest.raises(NotServing, match="discarded"):
            engine.generate(PROMPTS, GREEDY)
        sync(engine, models[1], version=1)
        engine.wake(("kv_cache",))
        assert engine.health()["weights"] == "serving"
        diff = hf_logprobs(models[1], PROMPTS, engine.generate(PROMPTS, GREEDY))
        assert diff.mean() <= TOLERANCE and diff.max() <= 10 * TOLERANCE, (diff.mean(), diff.max())
        level_2 = engine.take_host_copy_bytes()

        parameters, buffers = engine._model_bytes
        assert level_1 == 2 * (parameters + buffers)  # to host at sleep, back at wake
        # only the buffers through host memory, and the sync's tensors received there over ZMQ
        assert level_2 == 2 * buffers + checkpoint_bytes(models[1])
    finally:
        engine.shutdown()
