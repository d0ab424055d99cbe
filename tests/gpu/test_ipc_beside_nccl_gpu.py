"""The same-GPU CUDA IPC feed next to a collective group: the trainer rank on GPU 0 feeds a
receiver process on its own GPU through CUDA IPC handles (weight_sync.ipc_ring), that receiver
kept out of the rank's NCCL group (NCCL refuses two members on one GPU), while the group
broadcasts the same tensors to the ranks on the other GPUs (with one GPU the group is the rank
alone, and its communicator still lives on the GPU the handles point into). Skipped without CUDA."""

import multiprocessing as mp

import pytest
import torch

from agentgym_mega.platform.local_ranks import run_on_local_ranks
from agentgym_mega.weight_sync.auth import new_secret
from tests.gpu.test_cuda_ipc_sync import _engine_side

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

VERSION = 3  # the version _engine_side receives
MODEL = {"a": torch.arange(4096.0).view(64, 64), "b": torch.full((1000,), 2.0, dtype=torch.bfloat16)}


def rank_job(secret: str) -> dict:
    """Rank 0 pushes MODEL through CUDA IPC to a receiver process on its GPU while its NCCL
    broadcast of MODEL is in flight; every rank reports what it holds afterwards."""
    import torch.distributed as dist

    from agentgym_mega import platform
    from agentgym_mega.weight_sync.ipc_ring import CudaIpcSender

    platform.init_distributed()
    rank = dist.get_rank()
    tensors = [(n, (t if rank == 0 else torch.zeros_like(t)).cuda()) for n, t in MODEL.items()]
    broadcasts = [dist.broadcast(t, src=0, async_op=True) for _, t in tensors]
    out = {"backend": dist.get_backend(), "ipc": None}
    if rank == 0:
        # 4 KiB slots: the 18 KB take several buckets through the ring of 3, which is reused
        sender = CudaIpcSender(bucket_bytes=4096, timeout_s=60, secret=secret)
        queue = mp.get_context("spawn").Queue()
        receiver = mp.get_context("spawn").Process(target=_engine_side, args=(sender.address, queue, secret))
        receiver.start()
        try:
            stats = sender.push(tensors, version=VERSION)
            out["ipc"] = (stats.buckets, *queue.get(timeout=60))
        finally:
            receiver.join(timeout=60)
            sender.close()
    for work in broadcasts:
        work.wait()
    out["held"] = [(n, t.float().sum().item()) for n, t in tensors]
    return out


def test_the_ipc_feed_on_the_senders_gpu_works_beside_its_nccl_group():
    world = min(2, torch.cuda.device_count())
    out = run_on_local_ranks(rank_job, world, new_secret())
    sums = [(n, t.float().sum().item()) for n, t in MODEL.items()]
    assert all(r["backend"] == "nccl" for r in out), out
    buckets, version, seen = out[0]["ipc"]
    assert buckets > 3 and version == VERSION  # the ring wrapped around
    assert seen == [(n, True, s) for n, s in sums]  # on the GPU in the receiver, every byte
    assert all(r["held"] == sums for r in out), out  # and over NCCL on every rank
