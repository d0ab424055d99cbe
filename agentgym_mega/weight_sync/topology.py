"""Where every member of a weight sync runs, which transport `auto` picks for that layout, and the
groups the sync forms. Pure data: the trainer ranks (at their first sync, from the devices they
and the engines report) and the memory planner (from the layout a config asks for) both call it,
so `agentgym-mega plan` lists the groups a run will form.

The invariant this module keeps: no process group that weight sync forms holds two members on
one (node, GPU). NCCL refuses such a communicator ("Duplicate GPU detected", ncclInvalidUsage),
and colocated engines sit on the trainer's GPUs, so a group of a sending trainer rank and every
engine worker breaks it as soon as an engine shares the sender's GPU. Colocated engines are
therefore fed per GPU (CUDA IPC from the trainer rank on that GPU, on any node: every rank
exports the whole model over megatron's own groups), and the collective joins only engines on
GPUs of their own (split placement).

A device is a GPU's identity as a process sees it: its UUID on CUDA, or, on a cluster without
GPUs, the logical "node:gpu" the placement hands each process in AGM_DEVICES (see cluster), which
is how CPU tests stand in for GPUs."""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

from agentgym_mega.weight_sync.base import SyncError

DEVICES_ENV = "AGM_DEVICES"  # logical devices of a process without GPUs: "node:gpu", one per worker
PROCESS_GROUPS = ("nccl", "gloo")  # what a communicator is; the per-GPU feeds and ZMQ sockets are not


def logical_device(worker: int = 0) -> str | None:
    """This process's logical device (the `worker`-th of AGM_DEVICES), None when it has none."""
    devices = [d for d in os.environ.get(DEVICES_ENV, "").split(",") if d]
    return devices[worker] if worker < len(devices) else (devices[0] if devices else None)


@dataclasses.dataclass(frozen=True)
class Member:
    node: int | str  # node index in rank order, or (where the device is a GPU UUID) the node's id
    gpu: int | str  # GPU index within the node, or its UUID
    role: str  # "trainer rank 3", "engine 1 worker 0"

    @property
    def device(self) -> tuple:
        return (self.node, self.gpu)

    @classmethod
    def at(cls, device: str, role: str, node: str = "") -> "Member":
        """From a device identity: a logical "node:gpu", else a GPU UUID on `node`."""
        index, _, gpu = device.partition(":")
        if index.isdigit() and gpu.isdigit():
            return cls(int(index), int(gpu), role)
        return cls(node, device, role)


@dataclasses.dataclass(frozen=True)
class SyncGroup:
    name: str
    backend: str  # nccl | gloo: a process group; cuda_ipc | host_ipc: a per-GPU feed; zmq: rank 0's sockets
    members: tuple[Member, ...]

    def as_dict(self) -> dict:
        return {"name": self.name, "backend": self.backend, "members": [dataclasses.asdict(m) for m in self.members]}

    def shared_devices(self) -> dict[tuple, list[str]]:
        """Devices that hold more than one member of the group, with those members' roles."""
        by_device: dict[tuple, list[str]] = {}
        for member in self.members:
            by_device.setdefault(member.device, []).append(member.role)
        return {device: roles for device, roles in by_device.items() if len(roles) > 1}


@dataclasses.dataclass(frozen=True)
class SyncLayout:
    """The device of every trainer rank (by rank) and every engine worker (engine after engine)."""

    trainer: tuple[Member, ...]
    workers: tuple[Member, ...]
    pp: int

    @classmethod
    def of(cls, trainer: Sequence[str], workers: Sequence[str], workers_per_engine: int, pp: int,
           nodes: Sequence[str] | None = None) -> "SyncLayout":
        """From each process's device identity; `nodes`: each one's node id (trainer ranks, then
        workers), which places the devices that are not logical ones."""
        nodes = list(nodes or [""] * (len(trainer) + len(workers)))
        return cls(tuple(Member.at(d, f"trainer rank {r}", nodes[r]) for r, d in enumerate(trainer)),
                   tuple(Member.at(d, f"engine {i // workers_per_engine} worker {i % workers_per_engine}",
                                   nodes[len(trainer) + i]) for i, d in enumerate(workers)), pp)

    @property
    def colocated(self) -> bool:
        """Every engine worker shares its GPU with a trainer rank."""
        devices = {m.device for m in self.trainer}
        return bool(self.workers) and all(w.device in devices for w in self.workers)

    @property
    def remote(self) -> bool:
        """Some engine worker is on another node than trainer rank 0."""
        return any(w.node != self.trainer[0].node for w in self.workers)

    def stage_sender(self, stage: int) -> Member:
        """The rank that sends a pipeline stage over the collective: TP rank 0 of the first
        data-parallel replica (megatron's rank order is tp, then dp, then pp)."""
        return self.trainer[stage * (len(self.trainer) // self.pp)]


def planned_layout(world_size: int, pp: int, num_engines: int, engine_tp: int, colocated: bool,
                   gpus_per_node: int) -> SyncLayout:
    """The layout cluster.Placement gives a run on whole nodes: trainer ranks on GPUs 0..world-1
    in node order; colocated engine workers on trainer GPUs 0.., split ones on the GPUs after."""
    first = 0 if colocated else world_size

    def device(gpu: int) -> str:
        return f"{gpu // gpus_per_node}:{gpu % gpus_per_node}"

    return SyncLayout.of([device(g) for g in range(world_size)],
                         [device(first + w) for w in range(num_engines * engine_tp)], engine_tp, pp)


def choose_transport(transport: str, layout: SyncLayout, cuda: bool) -> str:
    """weight_sync.transport with `auto` resolved for `layout`; a transport the layout cannot
    carry is a SyncError that says which to use (see config.WeightSyncConfig)."""
    if transport == "auto" and layout.colocated:  # per GPU; on one CPU node rank 0's stream costs less
        transport = "cuda_ipc" if cuda or layout.remote else "ipc"  # than a whole export on every rank
    elif transport == "auto":
        transport = "collective" if cuda or layout.remote else "ipc"
    if transport == "ipc" and layout.remote:
        nodes = sorted({str(w.node) for w in layout.workers} - {str(layout.trainer[0].node)})
        raise SyncError(f"weight_sync.transport=ipc reaches engines on trainer rank 0's node only, but engine "
                        f"workers run on node(s) {', '.join(nodes)}: use auto, collective or tcp")
    trainer_devices = {m.device for m in layout.trainer}
    stranded = [w.role for w in layout.workers if w.device not in trainer_devices]
    if transport == "cuda_ipc" and stranded:
        raise SyncError(f"weight_sync.transport=cuda_ipc: {', '.join(stranded)} share(s) no "
                        "GPU with a trainer rank; CUDA IPC feeds each worker from the trainer rank on its own GPU: "
                        "use auto or collective")
    check(sync_groups(transport, layout, cuda))
    return transport


def sync_groups(transport: str, layout: SyncLayout, cuda: bool) -> list[SyncGroup]:
    """The groups a sync over resolved `transport` forms for `layout`."""
    if transport == "cuda_ipc":
        on_device: dict[tuple, list[Member]] = {}
        for worker in layout.workers:
            on_device.setdefault(worker.device, []).append(worker)
        groups = []
        for rank in layout.trainer:  # the lowest rank on a GPU feeds it
            workers = tuple(on_device.pop(rank.device, ()))
            if workers:
                groups.append(SyncGroup(f"feed on node {rank.node} GPU {rank.gpu}", "cuda_ipc" if cuda else "host_ipc",
                                        (rank,) + workers))
        return groups
    if transport == "collective":
        return [SyncGroup(f"stage {stage}", "nccl" if cuda else "gloo", (layout.stage_sender(stage),) + layout.workers)
                for stage in range(layout.pp)]
    return [SyncGroup(f"{transport} from trainer rank 0", "zmq", (layout.trainer[0],) + layout.workers)]


def check(groups: Sequence[SyncGroup]) -> None:
    """Refuses a process group holding one GPU twice, naming the group and its members there."""
    for group in groups:
        shared = group.shared_devices() if group.backend in PROCESS_GROUPS else {}
        for (node, gpu), roles in shared.items():
            raise SyncError(f"weight-sync group {group.name} ({group.backend}) would hold {' and '.join(roles)}, "
                            f"all on node {node} GPU {gpu}: NCCL refuses a communicator with one GPU twice. With "
                            "colocated engines use weight_sync.transport=auto or cuda_ipc (each worker fed by "
                            "the rank on its GPU)")
