"""CUDA IPC per GPU, for engines colocated with the trainer: each engine worker takes the weights
from the trainer rank on its own physical GPU, paired by device UUID (indices differ from process
to process under Ray's per-actor CUDA_VISIBLE_DEVICES; UUIDs do not).

Every trainer rank exports the whole model (TP shards all-gathered, other stages' tensors
broadcast: weights.export_hf(to="every")), and a rank with engine workers on its GPU streams it
to them through a ring of CUDA IPC bucket slots on that GPU (ipc_ring: a few buckets, never a
copy of the model), at ipc://<run directory>/<GPU UUID>.sock. The engines get
that address with ``{uuid}`` in place of the UUID and each worker fills in its own, so a worker
connects to the socket of its own GPU and nothing else."""

from __future__ import annotations

import collections
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch.distributed as dist

from agentgym_mega.remote import call_async
from agentgym_mega.weight_sync.base import EVERY, SyncError, SyncStats, WeightSynchronizer
from agentgym_mega.weight_sync.handles import device_uuid
from agentgym_mega.weight_sync.ipc_ring import CudaIpcSender
from agentgym_mega.weight_sync.ranks import engine_ids, gather_json, sync_from_ranks
from agentgym_mega.weight_sync.zmq_transport import UUID_FIELD, ZmqReceiver


def pair_by_gpu(trainer_gpus: Sequence[str], worker_gpus: Sequence[str]) -> list[int]:
    """How many engine workers each trainer rank feeds: those on its own GPU (the lowest rank,
    should two ranks share a GPU). A worker on a GPU that no trainer rank uses cannot be fed
    through CUDA IPC: a SyncError names it."""
    first_rank = {}
    for rank, gpu in enumerate(trainer_gpus):
        first_rank.setdefault(gpu, rank)
    stranded = sorted(set(worker_gpus) - set(first_rank))
    if stranded:
        raise SyncError(f"weight_sync.transport=cuda_ipc: engine workers on GPU(s) {', '.join(stranded)} share no "
                        "GPU with a trainer rank; CUDA IPC pairs each worker with the trainer rank on its own GPU: "
                        "use weight_sync.transport=collective")
    counts = collections.Counter(first_rank[gpu] for gpu in worker_gpus)
    return [counts.get(rank, 0) for rank in range(len(trainer_gpus))]


class CudaIpcWeightSynchronizer(WeightSynchronizer):
    """The trainer's side, on every trainer rank (all call :meth:`sync` together). `directory`:
    a fresh 0700 directory on the node, the same on every rank (rank 0 made it); `group`: the
    trainer's process group."""

    export = EVERY

    def __init__(self, directory: str, secret: str, *, bucket_bytes: int, timeout_s: float, group=None):
        self.directory, self._secret = directory, secret
        self.bucket_bytes, self.timeout_s, self.group = bucket_bytes, timeout_s, group
        self._paired_for: tuple | None = None  # the engines the pairing was made for
        self._receivers = 0  # engine workers on this rank's GPU
        self._sender: CudaIpcSender | None = None

    @property
    def template(self) -> str:
        return f"ipc://{os.path.join(self.directory, UUID_FIELD)}.sock"

    def _pair(self, engines: Sequence) -> None:
        """Every rank's GPU, every engine worker's (asked by rank 0), and this rank's share."""
        gpus = gather_json(device_uuid(None), self.group)
        workers, error = None, None
        if dist.get_rank(self.group) == 0:
            try:
                with ThreadPoolExecutor(max_workers=max(1, len(engines))) as pool:
                    waits = [call_async(pool, e, "device_uuids") for e in engines]
                    workers = [u for wait in waits for u in wait()]
                pair_by_gpu(gpus, workers)
            except Exception as exc:  # noqa: BLE001 - raised on every rank below
                error = f"{type(exc).__name__}: {exc}"
        workers, error = gather_json((workers, error), self.group)[0]
        if error is not None:
            raise SyncError(f"CUDA IPC pairing failed: {error}")
        self._receivers = pair_by_gpu(gpus, workers)[dist.get_rank(self.group)]
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        if self._receivers:
            address = self.template.replace(UUID_FIELD, device_uuid(None))
            self._sender = CudaIpcSender(address, bucket_bytes=self.bucket_bytes, timeout_s=self.timeout_s,
                                         secret=self._secret)
        self._paired_for = engine_ids(engines)

    def sync(self, named_tensors, engines: Sequence, version: int, progress=None) -> SyncStats | None:
        """Returns rank 0's view of the sync (one sender's stats; every worker counted as a
        receiver), None elsewhere; raises SyncError on rank 0 when an engine did not take it."""
        if self._paired_for != engine_ids(engines):
            self._pair(engines)

        def push() -> SyncStats:
            return self._sender.push(named_tensors, version, self._receivers, progress)

        receiver = ZmqReceiver(version, self.template, self.timeout_s, self._secret)
        outcome = sync_from_ranks(engines, lambda i: receiver, push if self._receivers else None, named_tensors,
                                  self.group)
        if dist.get_rank(self.group) != 0:
            return None
        if outcome.errors:
            raise SyncError(f"{len(outcome.errors)} sender(s) or engine(s) did not get through version {version}: "
                            f"{outcome.errors[0]}")
        stats = outcome.stats
        return SyncStats(version, stats[0].tensors, stats[0].params, stats[0].bytes, stats[0].buckets,
                         sum(s.receivers for s in stats), max(s.seconds for s in stats),
                         max(s.source_seconds for s in stats), max(s.load_seconds for s in stats))

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
