"""On a GPU, a rank builds its shard on the device (no host copy of the model) and resumes the
optimizer that GPU runs use: with Transformer Engine installed, megatron picks TE's FusedAdam,
which keeps Adam's step count in the param group. Skipped where CUDA is absent (CI); the TE test
also where TE is."""

import pytest
import torch

from agentgym_mega.models import gpt
from agentgym_mega.platform.local_ranks import run_on_local_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_the_shard_is_built_on_the_device(tiny_qwen2):
    from agentgym_mega.bench import startup

    out = startup.measure(tiny_qwen2, 1)[0]
    assert out["on_device"]
    assert out["device_mb"] >= out["params_mb"]
    # host memory holds at most a tensor being read, never the model built on the CPU first
    assert out["load_mb"] < out["params_mb"] + 64, out


def resume_job(hf_dir: str, root: str) -> dict:
    from agentgym_mega import platform
    from agentgym_mega.models.actor import MegatronActor
    from tests.distributed import megatron_jobs as jobs

    platform.init_distributed(tp=1, pp=1, seed=0)
    cfg = jobs.make_config(1, 1, 1)
    batch = {"input_ids": jobs.tokens(512, seed=3).cuda()}
    actor = MegatronActor(hf_dir, cfg)
    inner = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])[0].optimizer
    for _ in range(2):
        actor.update(batch, jobs.sft_loss)
    path = actor.save_checkpoint(root, step=2)
    actor.update(batch, jobs.sft_loss)
    continuous = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    resumed = MegatronActor(hf_dir, cfg, load_weights=False)
    resumed.load_checkpoint(path)
    resumed.update(batch, jobs.sft_loss)
    diff = max((continuous[n] - p.detach()).abs().max().item() for n, p in resumed.model.named_parameters())
    return {"optimizer": type(inner).__module__ + "." + type(inner).__name__, "max_diff": diff}


@pytest.mark.skipif(not gpt.te_available(), reason="needs Transformer Engine")
def test_te_fused_adam_resumes_where_it_stopped(tiny_qwen2, tmp_path):
    out = run_on_local_ranks(resume_job, 1, tiny_qwen2, str(tmp_path))[0]
    assert out["optimizer"].startswith("transformer_engine"), out
    # Adam's bias correction depends on the restored count: a count of 0 or 1 moves the weights
    # far more than float noise
    assert out["max_diff"] <= 1e-6, out
