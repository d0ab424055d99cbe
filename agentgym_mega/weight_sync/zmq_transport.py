"""Streaming named tensors from trainer rank 0 to inference engines over ZMQ, in buckets: the
synchronizer (trainer side) and the receiver it hands each engine (engine side). The two ends are
zmq_sender and zmq_receiver; auth holds the proofs; ipc_ring and handles are CUDA IPC's variant.

Protocol (trainer = ROUTER, bound; each engine worker = DEALER, connected):

    engine  -> HELLO     {nonce: engine nonce}
    trainer -> CHALLENGE {nonce: trainer nonce, version, proof: HMAC("trainer", nonces, version)}
    engine  -> READY     {proof: HMAC("engine", nonces, version)}
    trainer -> BUCKET  {specs of tensors it introduces, segments} + one raw frame per segment
               ... repeated while the trainer's tensor iterator yields ...
    trainer -> COMMIT  {version, tensors, bytes}
    engine  -> ACK     {version} | ERROR {message}

An engine serves a version only once the stream ends in a COMMIT that matches what arrived (see
vllm_loader), so it never serves a mix of versions. No copy of the previous weights is kept: an
update that fails before any tensor reached the model leaves the engine serving its version, one
that fails after leaves it dirty (it refuses to generate) until a re-send commits. The trainer
checks that every ACK names the version it sent. The trainer streams only to peers that proved
they hold the run's secret, and an engine reads no weights from a trainer that did not prove it
(a process that took over the address). The handshake authenticates the ends of a connection;
it does not encrypt or MAC the weight bytes themselves (someone who can sniff or rewrite packets
between the nodes sees and could alter them: keep trainer and engines on a private network).

Why HMAC and not ZMQ CURVE (which would also encrypt): CURVE encrypts every byte and made a
sync an order of magnitude slower here, and even an HMAC over the payload would about halve the
sync rate on one core (docs/results.md); the handshake costs one round trip per sync and nothing
per byte.

CUDA IPC (CudaIpcSender, HANDLE messages in place of BUCKET): no bytes travel, the engine maps
a slot of the sender's ring on the same GPU and answers FREE (see ipc_ring). Handles are
pickles, so an engine accepts them only over an ipc:// socket file it connected to, and reads
them with an unpickler that resolves nothing but the few torch names a handle consists of.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from agentgym_mega.remote import call_async
from agentgym_mega.weight_sync.base import FIRST, Incoming, Receiver, SyncError, SyncStats, WeightSynchronizer
from agentgym_mega.weight_sync.handles import device_id
from agentgym_mega.weight_sync.ranks import await_answer, engine_name
from agentgym_mega.weight_sync.zmq_receiver import ZmqWeightReceiver
from agentgym_mega.weight_sync.zmq_sender import ZmqWeightSender

UUID_FIELD = "{uuid}"  # in a receiver's address: each worker's own device (CUDA IPC's socket per GPU)


@dataclasses.dataclass(frozen=True)
class ZmqReceiver(Receiver):
    """Pull `version` from the sender at `address` (``{uuid}`` in it: this worker's GPU)."""

    kind = "zmq"
    address: str
    timeout_s: float
    secret: str | None = None

    def open(self, worker_rank: int, state: dict) -> Incoming:
        address = self.address
        if UUID_FIELD in address:  # CUDA IPC per GPU: the trainer rank on this worker's own GPU
            device = device_id(worker_rank)
            if device is None:
                raise SyncError("a per-GPU weight feed, but this engine worker has no GPU and no logical device "
                                "(cluster.Placement gives one to every process on a cluster without GPUs)")
            address = address.replace(UUID_FIELD, device)
        # Refuses tcp:// without a secret, and CUDA IPC handles anywhere but over ipc://.
        return _Pull(ZmqWeightReceiver(address, self.timeout_s, secret=self.secret), self.version)


class _Pull(Incoming):
    def __init__(self, receiver: ZmqWeightReceiver, version: int):
        self.receiver, self.version = receiver, version

    def stream(self, expected):
        return self.receiver.stream(self.version, expected)

    def finish(self, error: Exception | None) -> None:
        try:
            if error is not None:
                self.receiver.reply(self.version, error=f"{type(error).__name__}: {error}")
            else:
                self.receiver.reply(self.version, load_seconds=time.perf_counter() - self.receiver.committed_at)
        finally:
            self.receiver.close()


class ZmqWeightSynchronizer(WeightSynchronizer):
    """Trainer-side sync over ZMQ bytes: one sender socket on trainer rank 0, every engine worker
    pulls from it (CUDA IPC has a sender per GPU instead: cuda_ipc.CudaIpcWeightSynchronizer).
    The other ranks (`sends=False`) only take part in the export. The `secret` (see
    auth.new_secret; required for tcp://) goes to each engine inside its receiver, through Ray,
    and authenticates both ends of every connection."""

    export = FIRST

    def __init__(self, address: str | None = None, bucket_bytes: int = 256 << 20, timeout_s: float = 120.0,
                 workers_per_engine: int = 1, secret: str | None = None, *, sends: bool = True):
        self.sender = (ZmqWeightSender(address, bucket_bytes=bucket_bytes, timeout_s=timeout_s, secret=secret)
                       if sends else None)
        self._secret = secret
        self.timeout_s = timeout_s
        self.workers_per_engine = workers_per_engine  # vLLM TP workers each pull a full copy

    def sync(self, named_tensors, engines: Sequence, version: int, progress=None) -> SyncStats | None:
        try:
            return self._send(named_tensors, engines, version, progress) if self.sender is not None else None
        finally:
            for _ in named_tensors:  # the export is collective: the other ranks, or a sync that ended early
                pass

    def _send(self, named_tensors, engines: Sequence, version: int, progress) -> SyncStats:
        receiver = ZmqReceiver(version, self.sender.address, self.timeout_s, self._secret)
        with ThreadPoolExecutor(max_workers=max(1, len(engines))) as pool:
            waits = [call_async(pool, e, "receive_weights", receiver) for e in engines]
            try:
                stats = self.sender.push(named_tensors, version, len(engines) * self.workers_per_engine, progress)
            finally:
                errors = []
                for i, wait in enumerate(waits):
                    try:
                        await_answer(wait, self.timeout_s, engine_name(engines[i], i), "receive_weights")
                    except Exception as exc:  # each engine reports its own failure
                        errors.append(f"{type(exc).__name__}: {exc}")
            if errors:
                raise SyncError(f"{len(errors)} engine(s) did not take version {version}: {errors[0]}")
        return stats

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
