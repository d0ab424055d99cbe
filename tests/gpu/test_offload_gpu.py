"""On a GPU, releasing a role's memory gives the device memory back (cluster.offload), and the
update after restoring it is bitwise the one without. Skipped where CUDA is absent (CI)."""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def release_job(hf_dir: str) -> dict:
    from agentgym_mega import platform
    from agentgym_mega.models.actor import MegatronActor
    from tests.distributed import megatron_jobs as jobs

    platform.init_distributed(tp=1, pp=1, seed=0)
    actor = MegatronActor(hf_dir, jobs.make_config(1, 1, 1))
    batch = {"input_ids": jobs.tokens(512, batch=4, seed=5).cuda()}
    first = actor.update(batch, jobs.sft_loss)
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    actor.release_memory()
    released = torch.cuda.memory_allocated()
    actor.restore_memory()
    restored = torch.cuda.memory_allocated()
    second = actor.update(batch, jobs.sft_loss)
    return {"resident": resident, "released": released, "restored": restored, "losses": [first["loss"], second["loss"]]}


def test_release_returns_the_device_memory(tiny_qwen2):
    from agentgym_mega.platform.local_ranks import run_on_local_ranks

    out = run_on_local_ranks(release_job, 1, tiny_qwen2)[0]
    # parameters, gradient buffer and Adam moments are the bulk of what an idle trainer holds
    assert out["released"] <= 0.1 * out["resident"], out
    assert out["restored"] >= 0.9 * out["resident"], out
    assert out["losses"][1] < out["losses"][0]
