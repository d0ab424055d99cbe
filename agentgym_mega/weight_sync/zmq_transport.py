"""Streaming named tensors from the trainer to inference engines over ZMQ, in buckets.

Protocol (trainer = ROUTER, bound; each engine worker = DEALER, connected):

    engine  -> READY
    trainer -> META    {version, specs, buckets}
    trainer -> BUCKET  {bucket: i, segments} + one raw frame per segment   (repeated)
    trainer -> COMMIT  {version}
    engine  -> ACK     {version} | ERROR {message}

Frames are sent with ``copy=False`` (zero-copy from the tensor's memory). The receiver stages
every byte before it hands anything over, so an interrupted stream (timeout, dead peer) leaves
the engine's weights untouched: an update is all-or-nothing.

CUDA IPC (GPU, engines colocated with the trainer on the same devices): when the sender is
built with ``cuda_ipc=True`` and every tensor lives on a GPU, no bytes travel. META says so and
a single HANDLES message carries, per tensor, the pickled CUDA IPC handle from
``torch.multiprocessing.reductions.reduce_tensor``; the engine maps the trainer's memory with it
and its loader copies from there. The trainer keeps the tensors alive until every ACK arrived.
Handles are pickles: use this only on ipc:// endpoints of one node, which is where it applies.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Sequence

import torch
import zmq

from agentgym_mega.rollout.engines import call_async
from agentgym_mega.weight_sync.base import WeightSynchronizer
from agentgym_mega.weight_sync.buckets import TensorSpec, plan_buckets, to_dtype


class SyncError(RuntimeError):
    """A weight sync that did not complete; the engine keeps serving its previous weights."""


@dataclasses.dataclass
class SyncStats:
    version: int
    tensors: int
    params: int
    bytes: int
    buckets: int
    receivers: int
    seconds: float

    @property
    def gbps(self) -> float:
        """Gigabytes per second of payload, per receiver."""
        return self.bytes / max(self.seconds, 1e-9) / 1e9


def default_address() -> str:
    """An ipc:// endpoint for engines on this node (use tcp://HOST:PORT across nodes)."""
    return f"ipc://{tempfile.gettempdir()}/agentgym-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor (no copy when already so)."""
    return tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8)


def _send_json(sock, identity: bytes, op: str, **payload) -> None:
    sock.send_multipart([identity, json.dumps({"op": op, **payload}).encode()])


class ZmqWeightSender:
    """Trainer side: binds `address` and streams a version of the weights to every engine."""

    def __init__(self, address: str | None = None, bucket_bytes: int = 256 << 20, timeout_s: float = 120.0,
                 cuda_ipc: bool = False):
        self.bucket_bytes = bucket_bytes
        self.cuda_ipc = cuda_ipc
        self.timeout_ms = int(timeout_s * 1000)
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        # Fail loudly instead of dropping messages for a peer that went away or stopped reading.
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        self._sock.setsockopt(zmq.LINGER, 0)
        address = address or default_address()
        if address.startswith("tcp://") and address.endswith(":0"):
            port = self._sock.bind_to_random_port(address.rsplit(":", 1)[0])
            address = f"{address.rsplit(':', 1)[0]}:{port}".replace("*", "127.0.0.1")
        else:
            self._sock.bind(address)
        self.address = address

    def _recv(self, what: str) -> tuple[bytes, dict]:
        if not self._sock.poll(self.timeout_ms):
            raise SyncError(f"no {what} from an engine within {self.timeout_ms / 1000:.0f}s")
        identity, body = self._sock.recv_multipart()
        return identity, json.loads(body)

    def push(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        receivers: int = 1,
        progress: Callable[[int, int], None] | None = None,
    ) -> SyncStats:
        """Sends every tensor to `receivers` engines and returns once all of them acknowledged.
        `progress(buckets_sent, buckets_total)` is called after each bucket."""
        start = time.perf_counter()
        named = [(name, t.detach().contiguous()) for name, t in named_tensors]
        specs = [TensorSpec.of(name, t) for name, t in named]
        cuda_ipc = self.cuda_ipc and all(t.is_cuda for _, t in named)
        flat = [] if cuda_ipc else [_as_bytes(t) for _, t in named]
        buckets = [] if cuda_ipc else plan_buckets(specs, self.bucket_bytes)
        peers = [self._recv("READY")[0] for _ in range(receivers)]
        try:
            for peer in peers:
                _send_json(self._sock, peer, "META", version=version, buckets=len(buckets),
                           specs=[dataclasses.astuple(s) for s in specs], cuda_ipc=cuda_ipc)
            if cuda_ipc:
                from torch.multiprocessing.reductions import reduce_tensor

                handles = pickle.dumps([reduce_tensor(t) for _, t in named])
                for peer in peers:
                    self._sock.send_multipart([peer, handles])
            for i, bucket in enumerate(buckets):
                header = json.dumps({"op": "BUCKET", "bucket": i,
                                     "segments": [dataclasses.astuple(s) for s in bucket]}).encode()
                frames = [flat[s.index][s.offset : s.offset + s.nbytes].numpy() for s in bucket]
                for peer in peers:
                    self._sock.send_multipart([peer, header, *frames], copy=False)
                if progress:
                    progress(i + 1, len(buckets))
            for peer in peers:
                _send_json(self._sock, peer, "COMMIT", version=version)
        except zmq.ZMQError as exc:
            raise SyncError(f"sending version {version} failed ({exc}); engines keep their previous weights") from None
        for _ in peers:
            identity, reply = self._recv("ACK")
            if reply["op"] != "ACK":
                raise SyncError(f"engine {identity!r} rejected version {version}: {reply.get('message')}")
        return SyncStats(
            version, len(specs), sum(s.numel for s in specs), sum(s.nbytes for s in specs),
            len(buckets), receivers, time.perf_counter() - start,
        )

    def close(self) -> None:
        self._sock.close(linger=0)


class ZmqWeightReceiver:
    """Engine side: pulls one complete version of the weights, or raises SyncError."""

    def __init__(self, address: str, timeout_s: float = 120.0):
        self.timeout_ms = int(timeout_s * 1000)
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        self._sock.connect(address)
        self.address = address

    def _recv(self, copy: bool = True):
        if not self._sock.poll(self.timeout_ms):
            raise SyncError(
                f"weight stream from {self.address} stalled for {self.timeout_ms / 1000:.0f}s; "
                "keeping the previous weights"
            )
        return self._sock.recv_multipart(copy=copy)

    def receive(self) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """Returns (version, [(name, tensor), ...]) once every byte of the version arrived."""
        self._sock.send(json.dumps({"op": "READY"}).encode())
        meta = json.loads(self._recv()[0])
        if meta["op"] != "META":
            raise SyncError(f"expected META from the trainer, got {meta['op']}")
        specs = [TensorSpec(name, dtype, tuple(shape)) for name, dtype, shape in meta["specs"]]
        if meta.get("cuda_ipc"):
            tensors = [fn(*args) for fn, args in pickle.loads(self._recv()[0])]
            self._expect_commit(meta["version"])
            return meta["version"], [(s.name, t) for s, t in zip(specs, tensors)]
        staged: list[torch.Tensor | None] = [None] * len(specs)
        received = [0] * len(specs)
        keep_alive = []  # frames backing tensors that arrived whole (zero-copy)
        for _ in range(meta["buckets"]):
            header, *frames = self._recv(copy=False)
            header = json.loads(header.bytes)
            for (index, offset, nbytes), frame in zip(header["segments"], frames):
                data = torch.frombuffer(frame.buffer, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
                if offset == 0 and nbytes == specs[index].nbytes:
                    staged[index] = data
                    keep_alive.append(frame)
                else:
                    if staged[index] is None:
                        staged[index] = torch.empty(specs[index].nbytes, dtype=torch.uint8)
                    staged[index][offset : offset + nbytes] = data
                received[index] += nbytes
        self._expect_commit(meta["version"])
        missing = [s.name for s, got in zip(specs, received) if got != s.nbytes]
        if missing:
            raise SyncError(f"version {meta['version']} incomplete: {len(missing)} tensors short, e.g. {missing[0]}")
        tensors = []
        for spec, data in zip(specs, staged):
            data = data if data is not None else torch.empty(0, dtype=torch.uint8)
            tensors.append((spec.name, data.view(to_dtype(spec.dtype)).view(spec.shape)))
        self._keep_alive = keep_alive
        return meta["version"], tensors

    def _expect_commit(self, version: int) -> None:
        commit = json.loads(self._recv()[0])
        if commit["op"] != "COMMIT" or commit["version"] != version:
            raise SyncError(f"stream ended without a commit for version {version}")

    def reply(self, version: int, error: str | None = None) -> None:
        body = {"op": "ACK", "version": version} if error is None else {"op": "ERROR", "message": error}
        self._sock.send(json.dumps(body).encode())

    def close(self) -> None:
        self._sock.close(linger=0)



class ZmqWeightSynchronizer(WeightSynchronizer):
    """Trainer-side sync over ZMQ: one sender socket, every engine worker pulls from it."""

    def __init__(self, address: str | None = None, bucket_bytes: int = 256 << 20, timeout_s: float = 120.0,
                 workers_per_engine: int = 1, cuda_ipc: bool = False):
        self.sender = ZmqWeightSender(address, bucket_bytes=bucket_bytes, timeout_s=timeout_s, cuda_ipc=cuda_ipc)
        self.timeout_s = timeout_s
        self.workers_per_engine = workers_per_engine  # vLLM TP workers each pull a full copy

    def sync(self, named_tensors, engines: Sequence, version: int, progress=None) -> SyncStats:
        with ThreadPoolExecutor(max_workers=max(1, len(engines))) as pool:
            waits = [call_async(pool, e, "update_weights", self.sender.address, version, self.timeout_s)
                     for e in engines]
            try:
                stats = self.sender.push(named_tensors, version, len(engines) * self.workers_per_engine, progress)
            finally:
                errors = []
                for wait in waits:
                    try:
                        wait()
                    except Exception as exc:  # each engine reports its own failure
                        errors.append(f"{type(exc).__name__}: {exc}")
            if errors:
                raise SyncError(f"{len(errors)} engine(s) did not take version {version}: {errors[0]}")
        return stats

    def close(self) -> None:
        self.sender.close()
