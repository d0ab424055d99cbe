"""CUDA IPC per GPU, for engines colocated with the trainer, on one node or many: each engine
worker takes the weights from the trainer rank on its own physical GPU, paired by device UUID
(indices differ from process to process under Ray's per-actor CUDA_VISIBLE_DEVICES; UUIDs do not).
No process group joins an engine worker, so none holds a GPU twice (topology).

Every trainer rank exports the whole model over megatron's own groups (TP shards all-gathered,
other stages' tensors broadcast: weights.export_hf(to="every")), and a rank with engine workers
on its GPU streams it to them through a ring of CUDA IPC bucket slots on that GPU (ipc_ring: a few
buckets, never a copy of the model), at ipc://<run directory>/<GPU UUID>.sock on its node. The
engines get that address with ``{uuid}`` in place of the UUID and each worker fills in its own,
so a worker connects to the socket of its own GPU and nothing else. Without GPUs (tests), the
devices are the logical ones the placement hands out and the slots are host memory."""

from __future__ import annotations

import os
from typing import Sequence

import torch
import torch.distributed as dist

from agentgym_mega.weight_sync.base import EVERY, SyncError, SyncStats, WeightSynchronizer
from agentgym_mega.weight_sync.handles import device_id
from agentgym_mega.weight_sync.ipc_ring import CudaIpcSender
from agentgym_mega.weight_sync.ranks import engine_devices, engine_ids, gather_json, sync_from_ranks
from agentgym_mega.weight_sync.topology import SyncLayout, choose_transport, sync_groups
from agentgym_mega.weight_sync.zmq_transport import UUID_FIELD, ZmqReceiver


def feeds(trainer: Sequence[str], workers: Sequence[str], workers_per_engine: int, cuda: bool) -> list[int]:
    """How many engine workers each trainer rank feeds (by device: a GPU's UUID, or a logical
    device): those on its own GPU, from the lowest rank should two ranks share one. A worker on a
    GPU no trainer rank uses cannot be fed through CUDA IPC: a SyncError names it."""
    missing = [f"trainer rank {r}" for r, d in enumerate(trainer) if d is None] + \
        [f"engine worker {w}" for w, d in enumerate(workers) if d is None]
    if missing:
        raise SyncError(f"CUDA IPC pairs processes by device, but {', '.join(missing)} has none (no GPU, and no "
                        "logical device from a placement): use weight_sync.transport=ipc or collective")
    layout = SyncLayout.of(trainer, workers, workers_per_engine, pp=1)
    choose_transport("cuda_ipc", layout, cuda)
    counts = [0] * len(trainer)
    for group in sync_groups("cuda_ipc", layout, cuda):
        counts[layout.trainer.index(group.members[0])] = len(group.members) - 1
    return counts


def ensure_directory(directory: str) -> None:
    """The per-GPU sockets' directory on this rank's node: rank 0 made it on its own; on another
    node the first rank to bind there does, 0700 as socket_directory's. One that exists must be
    this user's and closed to others (sockets bound in it accept connections from its users)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    info = os.stat(directory)
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise SyncError(f"the CUDA IPC socket directory {directory} belongs to another user or is open to "
                        "others; refusing to bind weight sockets in it")


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
        self._cuda = torch.cuda.is_available()

    @property
    def template(self) -> str:
        return f"ipc://{os.path.join(self.directory, UUID_FIELD)}.sock"

    def _pair(self, engines: Sequence) -> None:
        """Every rank's device, every engine worker's (asked by rank 0, which pairs them and tells
        every rank its share)."""
        gpus = gather_json(device_id(), self.group)
        counts, error = None, None
        if dist.get_rank(self.group) == 0:
            try:
                devices = engine_devices(engines, self.timeout_s)
                counts = feeds(gpus, [d for each in devices for d in each], len(devices[0]) if devices else 1,
                               self._cuda)
            except Exception as exc:  # noqa: BLE001 - raised on every rank below
                error = f"{type(exc).__name__}: {exc}"
        counts, error = gather_json((counts, error), self.group)[0]
        if error is not None:
            raise SyncError(f"CUDA IPC pairing failed: {error}")
        self._receivers = counts[dist.get_rank(self.group)]
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        if self._receivers:
            ensure_directory(self.directory)
            address = self.template.replace(UUID_FIELD, device_id())
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
                                  self.group, self.timeout_s)
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
