"""The one place that knows every transport: it resolves weight_sync.transport (`auto`
included) for the trainer ranks and for the memory planner alike, builds each trainer rank's
synchronizer, and reads an engine worker's receiver back from the dict it travelled as.
Adding a transport means a module of its own, an entry here, and nothing outside weight_sync/."""

from __future__ import annotations

import socket
from typing import Sequence

import torch.distributed as dist

from agentgym_mega.network import reachable_ip
from agentgym_mega.weight_sync.auth import new_secret
from agentgym_mega.weight_sync.base import Receiver, SyncError, WeightSynchronizer
from agentgym_mega.weight_sync.collective import CollectiveJoin, CollectiveWeightSynchronizer
from agentgym_mega.weight_sync.cuda_ipc import CudaIpcWeightSynchronizer
from agentgym_mega.weight_sync.handles import device_id
from agentgym_mega.weight_sync.ipc_ring import RING_SLOTS
from agentgym_mega.weight_sync.ranks import engine_devices, gather_json
from agentgym_mega.weight_sync.topology import SyncLayout, choose_transport, sync_groups
from agentgym_mega.weight_sync.zmq_sender import endpoint, socket_directory
from agentgym_mega.weight_sync.zmq_transport import ZmqReceiver, ZmqWeightSynchronizer

# ray is imported where used: the planner and the vLLM workers import this module without Ray.

RECEIVERS: dict[str, type[Receiver]] = {cls.kind: cls for cls in (ZmqReceiver, CollectiveJoin)}


def device_buckets(transport: str) -> tuple[int, int]:
    """Buckets a resolved `transport` holds in device memory: (on a sending trainer rank, on an
    engine worker). The collective packs into two on each side (one filling, one in flight);
    CUDA IPC lends the engines a ring of them; ZMQ moves bytes through host memory."""
    return {"collective": (2, 2), "cuda_ipc": (RING_SLOTS, 0)}.get(transport, (0, 0))


def receiver_of(data: dict) -> Receiver:
    """A receiver from its as_dict() form (how it reaches each vLLM worker)."""
    fields = dict(data)
    kind = fields.pop("kind", None)
    if kind not in RECEIVERS:
        raise SyncError(f"unknown weight-sync receiver {kind!r}: known {', '.join(sorted(RECEIVERS))}")
    return RECEIVERS[kind](**fields)


def _node() -> str:
    """This process's node: its Ray node id (a test's ranks without Ray: the host)."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else socket.gethostname()


def run_layout(ranks: Sequence, engines: Sequence, engine_nodes: Sequence[str] | None, workers_per_engine: int,
               pp: int, timeout_s: float) -> SyncLayout:
    """Where this run's trainer ranks (`ranks`: each one's node and device, gathered) and engine
    workers (asked here) are. A process without a device (a CPU test run without a placement)
    counts as a device of its own on its node."""
    devices = engine_devices(engines, timeout_s)
    if engine_nodes is None:  # an engine's workers share its node (cluster.check_within_nodes)
        import ray

        nodes = ray.get([e.health.remote() for e in engines], timeout=timeout_s)
        engine_nodes = [h["node_id"] for h, d in zip(nodes, devices) for _ in d]
    workers = zip(engine_nodes, [d for each in devices for d in each])
    return SyncLayout.of([device or f"{node}/trainer rank {r}" for r, (node, device) in enumerate(ranks)],
                         [device or f"{node}/worker {w}" for w, (node, device) in enumerate(workers)],
                         workers_per_engine, pp, nodes=[n for n, _ in ranks] + list(engine_nodes))


def for_trainer_rank(options, engines: Sequence, engine_nodes: Sequence[str] | None, *, workers_per_engine: int,
                     stage: int | None, pp: int, cuda: bool) -> WeightSynchronizer | None:
    """This trainer rank's synchronizer; every rank calls it at once (the first sync, when the
    engines' nodes are known). Rank 0 resolves the transport (`options`: config.WeightSyncConfig)
    for where the ranks and the engine workers are (topology), and draws the run's secret (it
    reaches the engines through Ray inside their receivers, never over a weight socket), then
    tells the other ranks. `stage`: this rank's pipeline stage if it sends that stage over the
    collective transport (its first TP rank of the first data-parallel replica), else None.
    When rank 0 cannot set the sync up it raises why, and the other ranks get None: they skip
    this sync (rank 0 exports nothing for them to join) and try again at the next one, as rank 0
    does."""
    choice, error = None, None
    ranks = gather_json((_node(), device_id()))
    if dist.get_rank() == 0:
        try:
            layout = run_layout(ranks, engines, engine_nodes, workers_per_engine, pp, options.timeout_s)
            transport = choose_transport(options.transport, layout, cuda)
            directory = socket_directory() if transport == "cuda_ipc" else None  # of the per-GPU sockets
            groups = [g.as_dict() for g in sync_groups(transport, layout, cuda)]
            choice = (transport, new_secret(), directory, groups)
        except Exception as exc:  # noqa: BLE001 - raised below, once the other ranks know
            error, choice = exc, (None, None, None, None)
    transport, secret, directory, groups = gather_json(choice)[0]  # every rank gets here, even when rank 0 failed
    if error is not None:
        raise error
    if transport is None:
        return None
    synchronizer = _build(transport, options, secret, directory, workers_per_engine, stage)
    synchronizer.groups = groups
    return synchronizer


def _build(transport: str, options, secret: str, directory: str | None, workers_per_engine: int,
           stage: int | None) -> WeightSynchronizer:
    bucket_bytes, timeout_s = options.bucket_mb << 20, options.timeout_s
    if transport == "collective":
        return CollectiveWeightSynchronizer(stage, reachable_ip(), secret, bucket_bytes=bucket_bytes,
                                            timeout_s=timeout_s, workers_per_engine=workers_per_engine)
    if transport == "cuda_ipc":
        return CudaIpcWeightSynchronizer(directory, secret, bucket_bytes=bucket_bytes, timeout_s=timeout_s)
    sends = dist.get_rank() == 0
    return ZmqWeightSynchronizer(endpoint(transport, reachable_ip()) if sends else None, bucket_bytes=bucket_bytes,
                                 timeout_s=timeout_s, workers_per_engine=workers_per_engine, secret=secret,
                                 sends=sends)
