"""On a CUDA machine the platform layer stays out of the way and megatron-core trains on NCCL.
Skipped where CUDA is absent (CI); run on a GPU host with `pytest tests/gpu`."""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_cpu_layer_is_not_installed_with_cuda():
    from agentgym_mega import platform
    from agentgym_mega.platform import cpu_megatron

    assert cpu_megatron.enable() is False and not cpu_megatron.is_enabled()
    assert platform.device().type == "cuda" and platform.dist_backend() == "nccl"
    assert torch.zeros(1, device="cuda").device.type == "cuda"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (1, 1)], ids=["tp2", "pp2", "dp2"])
def test_tiny_gpt_trains_on_two_nccl_ranks(tp, pp, tmp_path):
    from agentgym_mega.doctor import run_megatron_check

    first, second = run_megatron_check(world=2, tp=tp, pp=pp, steps=6, workdir=str(tmp_path))
    assert first.losses == second.losses
    assert first.losses[-1] < first.losses[0]
