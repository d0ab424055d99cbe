"""CUDA IPC weight transfer: the engine process maps the trainer's GPU tensors, no bytes copied
through ZMQ. Skipped where CUDA is absent (CI has no GPU)."""

import multiprocessing as mp

import pytest
import torch

from agentgym_mega.weight_sync.auth import new_secret
from agentgym_mega.weight_sync.ipc_ring import CudaIpcSender
from agentgym_mega.weight_sync.zmq_receiver import ZmqWeightReceiver

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _engine_side(address, queue, secret):
    receiver = ZmqWeightReceiver(address, timeout_s=60, secret=secret)
    version, tensors = receiver.receive(3)
    queue.put((version, [(n, t.is_cuda, t.sum().item()) for n, t in tensors]))
    receiver.reply(version)
    receiver.close()


# Without a secret as before on ipc://, and with one as cluster.RankProcess syncs (both ends
# authenticated before the engine unpickles a handle).
@pytest.mark.parametrize("secret", [None, new_secret()], ids=["no-secret", "secret"])
def test_cuda_tensors_travel_as_ipc_handles(secret):
    tensors = [("a", torch.arange(12.0, device="cuda").view(3, 4)),
               ("b", torch.ones(5, device="cuda", dtype=torch.bfloat16))]
    # 16-byte slots: the 58 bytes take 4 buckets through the ring of 3, which is reused
    sender = CudaIpcSender(bucket_bytes=16, timeout_s=60, secret=secret)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_engine_side, args=(sender.address, queue, secret))
    proc.start()
    stats = sender.push(tensors, version=3)
    version, seen = queue.get(timeout=60)
    proc.join(timeout=60)
    sender.close()
    assert stats.buckets == 4  # bucket slots' handles, the ring wrapping around
    assert version == 3
    assert seen == [("a", True, 66.0), ("b", True, 5.0)]


def test_a_rank_feeds_the_engine_worker_on_its_own_gpu_by_uuid():
    # the per-GPU synchronizer end to end on GPU 0: pairing by the real device UUID, the
    # socket named by it, CUDA tensors through the ring of slots
    from tests.unit.test_cuda_ipc_pairing import run

    out = run(None, None)
    status, stats, got, socket = out[0]
    assert status == "ok" and got == [{"a": True, "b": True}] and socket, out
