"""Process body for the CUDA IPC pairing test (spawned: it must be importable). Two gloo ranks
stand for trainer ranks on two GPUs; device UUIDs are faked, CPU tensors stand for GPU ones (a
CPU tensor's "handle" carries its bytes), so the pairing, the per-GPU sockets and the ranks'
exchange run for real."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

SECRET = "p" * 64
MODEL = [("a", torch.arange(40.0)), ("b", torch.ones(3, 5, dtype=torch.bfloat16))]


class Engine:
    """An engine of one worker on fake GPU `gpu`: receives from the socket of its own GPU."""

    def __init__(self, gpu: str):
        self.gpu, self.got = gpu, None

    def device_uuids(self) -> list[str]:
        return [self.gpu]

    def receive_weights(self, receiver) -> int:
        from agentgym_mega.weight_sync.zmq_receiver import ZmqWeightReceiver
        from agentgym_mega.weight_sync.zmq_transport import UUID_FIELD

        address, version = receiver.address.replace(UUID_FIELD, self.gpu), receiver.version
        receiver = ZmqWeightReceiver(address, receiver.timeout_s, secret=receiver.secret)
        try:
            got, tensors = receiver.receive(version)
            receiver.reply(got)
        finally:
            receiver.close()
        self.got = {name: t.clone() for name, t in tensors}
        return got


def job(rank: int, rendezvous: dict, directory: str, gpus: list[str] | None, engine_gpus: list[str] | None,
        results) -> None:
    """`gpus`: each rank's fake GPU UUID; None: one rank on the real GPU 0, feeding one engine
    worker there from CUDA tensors (tests/gpu)."""
    from agentgym_mega.weight_sync import DEVICES_ENV, cuda_ipc, handles

    os.environ.update(rendezvous)
    dist.init_process_group("gloo", rank=rank, world_size=len(gpus) if gpus else 1)
    model = MODEL
    if gpus is None:
        torch.cuda.set_device(0)
        gpus = engine_gpus = [handles.device_uuid(None)]
        model = [(n, t.cuda()) for n, t in MODEL]
    else:
        os.environ[DEVICES_ENV] = gpus[rank]  # this rank's (fake) GPU, as a placement gives it without GPUs
    engines = [Engine(gpu) for gpu in engine_gpus]
    synchronizer = cuda_ipc.CudaIpcWeightSynchronizer(directory, SECRET, bucket_bytes=64, timeout_s=20.0)
    try:
        stats = synchronizer.sync(iter(model), engines, 3)
        got = [{n: torch.equal(t.cpu(), dict(MODEL)[n]) for n, t in e.got.items()} for e in engines] \
            if rank == 0 else None
        results.put((rank, "ok", None if stats is None else (stats.receivers, stats.bytes), got,
                     os.path.exists(os.path.join(directory, f"{gpus[rank]}.sock"))))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put((rank, "error", f"{type(exc).__name__}: {exc}", None, None))
    finally:
        synchronizer.close()
        dist.destroy_process_group()
