"""Streaming named tensors from the trainer to inference engines over ZMQ, in buckets.

Protocol (trainer = ROUTER, bound; each engine worker = DEALER, connected):

    engine  -> READY
    trainer -> BUCKET  {specs of tensors it introduces, segments} + one raw frame per segment
               ... repeated while the trainer's tensor iterator yields ...
    trainer -> COMMIT  {version, tensors, bytes}
    engine  -> ACK     {version} | ERROR {message}

The trainer streams: it packs tensors as its iterator produces them (e.g. gathered from
megatron TP/PP shards one at a time), so it never holds the whole model. Frames are sent with
``copy=False``, straight from the tensors' memory. The engine receives every byte straight into
its staging buffers (kept between syncs, see StagingArea) and hands the tensors over only after
a COMMIT that matches what arrived, so an interrupted stream (timeout, dead peer) leaves its
weights untouched: an update is all-or-nothing.

CUDA IPC (GPU, engines colocated with the trainer on the same devices): with ``cuda_ipc=True``
and tensors on a GPU, no bytes travel. Each tensor goes as a HANDLE message carrying the pickled
CUDA IPC handle from ``torch.multiprocessing.reductions.reduce_tensor``; the engine maps the
trainer's memory with it and its loader copies from there. The trainer keeps those tensors alive
until every ACK arrived. Handles are pickles: only for ipc:// endpoints on one node.
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
from agentgym_mega.weight_sync.buckets import TensorSpec, pack, to_dtype


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
    seconds: float  # from every engine ready to every engine loaded
    source_seconds: float = 0.0  # spent producing the tensors (e.g. the TP/PP gather)
    load_seconds: float = 0.0  # slowest engine's time to swap the received tensors in

    @property
    def gbps(self) -> float:
        """Gigabytes per second of payload, per receiver."""
        return self.bytes / max(self.seconds, 1e-9) / 1e9


def default_address() -> str:
    """An ipc:// endpoint for engines on this node (use tcp://HOST:PORT across nodes)."""
    return f"ipc://{tempfile.gettempdir()}/agentgym-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def endpoint(transport: str, trainer_node: str, engine_nodes: Sequence[str], cuda: bool) -> tuple[str, bool]:
    """Where the trainer binds its sender, and whether it sends CUDA IPC handles, for engines on
    `engine_nodes` (see config.WeightSyncConfig for what `transport` means)."""
    remote = sorted(set(engine_nodes) - {trainer_node})
    if transport == "auto":
        transport = "tcp" if remote else "cuda_ipc" if cuda else "ipc"
    if transport in ("ipc", "cuda_ipc") and remote:
        raise SyncError(f"weight_sync.transport={transport} reaches engines on the trainer's node "
                        f"({trainer_node}) only, but engines run on {', '.join(remote)}: use tcp or auto")
    if transport == "cuda_ipc" and not cuda:
        raise SyncError("weight_sync.transport=cuda_ipc needs GPUs; this trainer has none: use ipc or auto")
    if transport == "tcp":
        return f"tcp://{trainer_node}:0", False
    return default_address(), transport == "cuda_ipc"


def _timed(iterable, clock: list[float]):
    """Yields from `iterable`, adding the time spent waiting for each item to clock[0]."""
    it = iter(iterable)
    while True:
        start = time.perf_counter()
        try:
            item = next(it)
        except StopIteration:
            return
        finally:
            clock[0] += time.perf_counter() - start
        yield item


def _send_json(sock, identity: bytes, op: str, **payload) -> None:
    sock.send_multipart([identity, json.dumps({"op": op, **payload}).encode()])


class ZmqWeightSender:
    """Trainer side: binds `address` and streams a version of the weights to every engine."""

    def __init__(self, address: str | None = None, bucket_bytes: int = 256 << 20, timeout_s: float = 120.0,
                 cuda_ipc: bool = False):
        self.bucket_bytes = bucket_bytes
        self.cuda_ipc = cuda_ipc
        self.timeout_ms = int(timeout_s * 1000)
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        # Fail loudly instead of dropping messages for a peer that went away or stopped reading.
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        self._sock.setsockopt(zmq.LINGER, 0)
        address = address or default_address()
        if address.startswith("tcp://") and address.endswith(":0"):
            host = address.rsplit(":", 1)[0]
            address = f"{host}:{self._sock.bind_to_random_port(host)}".replace("*", "127.0.0.1")
        else:
            self._sock.bind(address)
        self.address = address

    def _recv(self, what: str) -> tuple[bytes, dict]:
        if not self._sock.poll(self.timeout_ms):
            raise SyncError(f"no {what} from an engine within {self.timeout_ms / 1000:.0f}s")
        identity, body = self._sock.recv_multipart()
        return identity, json.loads(body)

    def _send(self, peers: list[bytes], frames: list) -> None:
        for peer in peers:
            self._sock.send_multipart([peer, *frames], copy=False)

    def push(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        receivers: int = 1,
        progress: Callable[[int, int], None] | None = None,
    ) -> SyncStats:
        """Streams every tensor to `receivers` engines; returns once all of them acknowledged.
        `progress(bytes_sent, messages_sent)` is called after each bucket or handle."""
        peers = [self._recv("READY")[0] for _ in range(receivers)]
        start = time.perf_counter()
        source = [0.0]
        named_tensors = _timed(named_tensors, source)
        count = params = sent = messages = 0
        held = []  # CUDA IPC: engines map these tensors until they acknowledge
        try:
            if self.cuda_ipc:
                from torch.multiprocessing.reductions import reduce_tensor

                for index, (name, tensor) in enumerate(named_tensors):
                    tensor = tensor.detach().contiguous()
                    held.append(tensor)
                    spec = TensorSpec.of(name, tensor)
                    meta = json.dumps({"op": "HANDLE", "index": index, "spec": dataclasses.astuple(spec)})
                    self._send(peers, [meta.encode(), pickle.dumps(reduce_tensor(tensor))])
                    count, params, sent, messages = count + 1, params + spec.numel, sent + spec.nbytes, messages + 1
                    if progress:
                        progress(sent, messages)
            else:
                for bucket in pack(named_tensors, self.bucket_bytes):
                    header = json.dumps({
                        "op": "BUCKET",
                        "specs": {i: dataclasses.astuple(s) for i, s in bucket.specs.items()},
                        "segments": [dataclasses.astuple(s) for s in bucket.segments],
                    }).encode()
                    self._send(peers, [header, *(p.numpy() for p in bucket.payloads)])
                    count += len(bucket.specs)
                    params += sum(s.numel for s in bucket.specs.values())
                    sent += sum(s.nbytes for s in bucket.segments)
                    messages += 1
                    if progress:
                        progress(sent, messages)
            for peer in peers:
                _send_json(self._sock, peer, "COMMIT", version=version, tensors=count, bytes=sent)
        except zmq.ZMQError as exc:
            raise SyncError(f"sending version {version} failed ({exc}); engines keep their previous weights") from None
        load = 0.0
        for _ in peers:
            identity, reply = self._recv("ACK")
            if reply["op"] != "ACK":
                raise SyncError(f"engine {identity!r} rejected version {version}: {reply.get('message')}")
            load = max(load, reply.get("load_seconds", 0.0))
        del held
        return SyncStats(version, count, params, sent, 0 if self.cuda_ipc else messages, receivers,
                         time.perf_counter() - start, source[0], load)

    def close(self) -> None:
        self._sock.close(linger=0)


class StagingArea:
    """Per-tensor byte buffers an engine receives into, kept from one sync to the next.

    Each sync carries the same tensors, so after the first one every byte lands in memory that
    is already mapped. Receiving into fresh memory instead page-faults a model's worth of pages
    per sync, which on the CPU machines we measured made receiving 2-4x slower than the wire.
    Costs one copy of the model in host memory per engine worker for the engine's lifetime."""

    def __init__(self):
        self._buffers: dict[int, torch.Tensor] = {}

    def buffer(self, index: int, spec: TensorSpec) -> torch.Tensor:
        """The bytes of the `index`-th tensor of the stream, reused while its size stays put."""
        if index not in self._buffers or self._buffers[index].numel() != spec.nbytes:
            self._buffers[index] = torch.empty(spec.nbytes, dtype=torch.uint8)
        return self._buffers[index]

    def tensor(self, index: int, spec: TensorSpec) -> torch.Tensor:
        return self.buffer(index, spec).view(to_dtype(spec.dtype)).view(spec.shape)


class ZmqWeightReceiver:
    """Engine side: pulls one complete version of the weights, or raises SyncError. Pass the
    same `staging` to every sync of an engine (see StagingArea); the tensors returned are views
    of it, valid until the next sync."""

    def __init__(self, address: str, timeout_s: float = 120.0, staging: StagingArea | None = None):
        self.timeout_ms = int(timeout_s * 1000)
        self.staging = staging or StagingArea()
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        self._sock.connect(address)
        self.address = address

    def _recv_header(self) -> dict:
        if not self._sock.poll(self.timeout_ms):
            raise SyncError(
                f"weight stream from {self.address} stalled for {self.timeout_ms / 1000:.0f}s; "
                "keeping the previous weights"
            )
        frame = self._sock.recv()
        try:
            return json.loads(frame)
        except ValueError:
            raise SyncError(f"malformed weight stream: expected a header, got {len(frame)} bytes") from None

    def _more(self, what: str) -> None:
        # The frames of a multipart message arrive together, so no wait is needed for them.
        if not self._sock.getsockopt(zmq.RCVMORE):
            raise SyncError(f"malformed weight stream: {what} is missing")

    def _recv_into(self, target: torch.Tensor, what: str) -> None:
        self._more(what)
        size = self._sock.recv_into(target.numpy())
        if size != target.numel():
            raise SyncError(f"malformed weight stream: {what} has {size} bytes, expected {target.numel()}")

    def receive(self) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """Returns (version, [(name, tensor), ...]) once every byte of a version arrived."""
        self._sock.send(json.dumps({"op": "READY"}).encode())
        specs: dict[int, TensorSpec] = {}
        mapped: dict[int, torch.Tensor] = {}  # CUDA IPC: the trainer's tensors themselves
        received: dict[int, int] = {}
        while True:
            message = self._recv_header()
            if message["op"] == "COMMIT":
                break
            if message["op"] == "HANDLE":
                self._more("a CUDA IPC handle")
                fn, args = pickle.loads(self._sock.recv())
                index = message["index"]
                specs[index] = TensorSpec(message["spec"][0], message["spec"][1], tuple(message["spec"][2]))
                mapped[index], received[index] = fn(*args), specs[index].nbytes
                continue
            for index, (name, dtype, shape) in message["specs"].items():
                specs[int(index)] = TensorSpec(name, dtype, tuple(shape))
            for index, offset, nbytes in message["segments"]:
                target = self.staging.buffer(index, specs[index])[offset : offset + nbytes]
                self._recv_into(target, f"bytes {offset}-{offset + nbytes} of {specs[index].name}")
                received[index] = received.get(index, 0) + nbytes
            if self._sock.getsockopt(zmq.RCVMORE):
                raise SyncError("malformed weight stream: a bucket has more frames than segments")
        version = message["version"]
        short = [s.name for i, s in specs.items() if received.get(i, 0) != s.nbytes]
        if len(specs) != message["tensors"] or short:
            raise SyncError(f"version {version} incomplete: got {len(specs)} of {message['tensors']} tensors"
                            + (f", {short[0]} short" if short else ""))
        tensors = [(specs[i].name, mapped[i] if i in mapped else self.staging.tensor(i, specs[i]))
                   for i in sorted(specs)]
        return version, tensors

    def reply(self, version: int, error: str | None = None, load_seconds: float = 0.0) -> None:
        body = ({"op": "ACK", "version": version, "load_seconds": load_seconds} if error is None
                else {"op": "ERROR", "message": error})
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
