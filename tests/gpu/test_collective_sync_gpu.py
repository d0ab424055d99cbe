"""The collective weight sync on NCCL: the library's broadcast from a GPU sender into receivers
on other GPUs, the tensors arriving on the receivers' GPUs, and the all-or-nothing vote. NCCL
refuses two ranks on one GPU, so this needs at least two (skipped otherwise; CI has none)."""

import pytest
import torch

from tests.unit.test_collective_sync import run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


def test_nccl_broadcast_delivers_every_byte_on_the_receivers_gpus():
    receivers = min(3, torch.cuda.device_count() - 1)
    out, _ = run(receivers, algorithm="broadcast", backend="nccl", bucket_bytes=1 << 20)
    assert out[("sender", 0)][0] == "ok", out
    for rank in range(1, receivers + 1):
        assert out[("receiver", rank)] == ("ok", {"equal": True, "error": None}), out


def test_nccl_vote_rolls_every_receiver_back_when_one_refuses():
    out, _ = run(1 if torch.cuda.device_count() < 3 else 2, algorithm="broadcast", backend="nccl",
                 receiver_kw={1: {"reject": True}})
    assert out[("sender", 0)][0] == "error", out
    assert all(status == "rolled back" for (role, _), (status, _) in out.items() if role == "receiver"), out
