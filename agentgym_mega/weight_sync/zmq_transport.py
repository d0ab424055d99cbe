"""Streaming named tensors from the trainer to inference engines over ZMQ, in buckets.

Protocol (trainer = ROUTER, bound; each engine worker = DEALER, connected):

    engine  -> HELLO     {nonce: engine nonce}
    trainer -> CHALLENGE {nonce: trainer nonce, version, proof: HMAC("trainer", nonces, version)}
    engine  -> READY     {proof: HMAC("engine", nonces, version)}
    trainer -> BUCKET  {specs of tensors it introduces, segments} + one raw frame per segment
               ... repeated while the trainer's tensor iterator yields ...
    trainer -> COMMIT  {version, tensors, bytes}
    engine  -> ACK     {version} | ERROR {message}

The trainer streams: it packs tensors as its iterator produces them (e.g. gathered from
megatron TP/PP shards one at a time), so it never holds the whole model. Frames are sent with
``copy=False``, straight from the tensors' memory. The engine receives every byte straight into
the memory of the tensor it belongs to and hands each tensor to its loader once complete (vLLM's
loaders then keep only the worker's TP shard), so no worker holds a full copy of the model. An
update is all-or-nothing all the same: the loader keeps a snapshot of what it serves and puts it
back unless the stream ends in a COMMIT that matches what arrived (see vllm_loader). The trainer
checks that every ACK names the version it sent.

Authentication. A per-run secret (>= 32 random bytes, see new_secret) reaches the engines through
Ray, as an argument of ``update_weights``, never over the socket. Each side proves it holds the
secret with an HMAC-SHA256 over both sides' fresh nonces, the version and its role (so a proof
cannot be replayed, reflected, or reused for another sync), checked with hmac.compare_digest:

* the trainer streams only to peers whose READY carried a valid proof. Any other peer (no proof,
  a wrong one, a READY without a challenge, garbage) is answered ERROR and never gets a byte of
  weights, does not count as a receiver and does not extend the sync's deadline, so the genuine
  engines' sync completes as if it were not there. Peers connect with random routing ids, and
  the trainer's socket drops peers that send more than a control message's worth of bytes.
* an engine reads no weights from a trainer whose CHALLENGE carried no valid proof (a process
  that took over the address).

tcp:// is refused on both ends without a secret. Without one, ipc:// (a filesystem socket, not
the abstract "@" namespace) keeps working as before: default_address puts the socket in a fresh
0700 directory and the trainer makes the socket file 0600, so only this user's processes can
connect. The handshake authenticates the ends of a connection; it does not encrypt or MAC the
weight bytes themselves (someone who can sniff or rewrite packets on the network between the
nodes sees and could alter them: keep trainer and engines on a private network).

Why HMAC and not ZMQ CURVE (which would also encrypt): CURVE's encryption made a sync an order of
magnitude slower, and even an HMAC over the payload runs slower on one core than the stream it
would guard (docs/results.md). The handshake costs one round trip per sync and nothing per byte.

CUDA IPC (GPU, engines colocated with the trainer on the same devices; see cuda_ipc for the
pairing): with ``cuda_ipc=True`` and tensors on a GPU, no bytes travel. The sender copies each
bucket into a free slot of a ring of RING_SLOTS on that GPU and sends a HANDLE message: the
bucket's specs and segments, the sender's GPU UUID, and the slot's pickled CUDA IPC handle from
``torch.multiprocessing.reductions.reduce_tensor``. The engine maps the slot (its device index
rewritten for the same GPU in its own process), copies the bucket out and answers FREE; a slot is
refilled only once every engine freed it. Handles are pickles, so an engine unpickles one only when the address
*it connected to* is an ipc:// socket file (never tcp://, whatever the trainer's messages say;
a HANDLE on any other transport is a SyncError and the previous weights keep serving), and then
only with an unpickler that resolves nothing but the few torch names a handle consists of.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import hmac
import io
import itertools
import json
import os
import pickle
import secrets
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
import zmq

from agentgym_mega.remote import call_async
from agentgym_mega.weight_sync.base import WeightSynchronizer
from agentgym_mega.weight_sync.buckets import TensorSpec, fill, pack

MIN_SECRET_BYTES = 32
_DOMAIN = "agentgym-mega weight sync v1"
_NONCE_HEX = 32  # 16 random bytes
_CONTROL_BYTES = 1 << 20  # peers only ever send the trainer small JSON messages (an ERROR at most)
_MAX_PENDING = 4096  # challenges outstanding at once; the oldest is dropped beyond that
_ADDRESS_PREFIX = "agentgym-weights-"
RING_SLOTS = 3  # CUDA IPC: buckets in flight between the trainer and its engines


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


def new_secret() -> str:
    """A fresh per-run secret (32 random bytes, hex) for a sender and the engines it feeds."""
    return secrets.token_hex(MIN_SECRET_BYTES)


def _secret_bytes(secret: str | bytes | None) -> bytes | None:
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"the weight-sync secret must be str or bytes, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the weight-sync secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)} "
                         "(use weight_sync.new_secret())")
    return bytes(secret)


def proof(secret: bytes, role: str, engine_nonce: str, trainer_nonce: str, version) -> str:
    """HMAC-SHA256 by which `role` ("trainer" or "engine") shows it holds the run's secret."""
    message = "\n".join([_DOMAIN, role, engine_nonce, trainer_nonce, str(version)]).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def _proof_ok(secret: bytes, given, role: str, engine_nonce: str, trainer_nonce: str, version) -> bool:
    if not isinstance(given, str):
        return False
    expected = proof(secret, role, engine_nonce, trainer_nonce, version)
    return hmac.compare_digest(expected.encode(), given.encode("utf-8", "replace"))


def _scheme(address: str) -> str:
    return address.split("://", 1)[0] if "://" in address else address


def _ipc_path(address: str) -> str | None:
    """The socket file of an ipc:// address; None for anything else, including the abstract
    namespace (ipc://@name), which has no file permissions to restrict who connects."""
    if not address.startswith("ipc://") or address.startswith("ipc://@"):
        return None
    return address[len("ipc://"):]


def _local_only(address: str) -> bool:
    """Transports on which only this user's processes can reach the socket without a secret."""
    return _ipc_path(address) is not None or address.startswith("inproc://")


def socket_directory() -> str:
    """A fresh directory for ipc:// sockets that only this user can enter (mode 0700); a sender
    bound in it removes it on close once it is empty."""
    return tempfile.mkdtemp(prefix=_ADDRESS_PREFIX)


def default_address() -> str:
    """An ipc:// endpoint for engines on this node (use tcp://HOST:PORT across nodes), in a fresh
    socket_directory()."""
    return f"ipc://{socket_directory()}/sock"


def choose_transport(transport: str, trainer_node: str, engine_nodes: Sequence[str], cuda: bool) -> str:
    """weight_sync.transport with `auto` resolved, for engine workers on `engine_nodes` (node ids,
    compared with the trainer's `trainer_node`); see config.WeightSyncConfig for what each means."""
    remote = sorted(set(engine_nodes) - {trainer_node})
    if transport == "auto":
        transport = "collective" if remote else "cuda_ipc" if cuda else "ipc"
    if transport in ("ipc", "cuda_ipc") and remote:
        raise SyncError(f"weight_sync.transport={transport} reaches engines on the trainer's node "
                        f"({trainer_node}) only, but engine workers run on {', '.join(remote)}: "
                        "use collective, tcp or auto")
    if transport == "cuda_ipc" and not cuda:
        raise SyncError("weight_sync.transport=cuda_ipc needs GPUs; this trainer has none: use ipc or auto")
    return transport


def endpoint(transport: str, host: str) -> str:
    """Where trainer rank 0 binds its ZMQ sender for `transport` ipc or tcp (`host`: the
    trainer's address for tcp). CUDA IPC binds one socket per GPU instead (see cuda_ipc)."""
    if transport not in ("ipc", "tcp"):
        raise ValueError(f"a single ZMQ sender serves transport ipc or tcp, not {transport}")
    return f"tcp://{host}:0" if transport == "tcp" else default_address()


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


def _json(op: str, **payload) -> bytes:
    return json.dumps({"op": op, **payload}).encode()


def _peer(identity: bytes) -> str:
    return identity.hex()[:12]


class ZmqWeightSender:
    """Trainer side: binds `address` and streams a version of the weights to every engine that
    proves it holds `secret` (see the module docstring). Without a secret only a local address
    (an ipc:// socket file, inproc://) is accepted."""

    def __init__(self, address: str | None = None, bucket_bytes: int = 256 << 20, timeout_s: float = 120.0,
                 cuda_ipc: bool = False, secret: str | bytes | None = None):
        self.bucket_bytes = bucket_bytes
        self.cuda_ipc = cuda_ipc
        self.timeout_ms = int(timeout_s * 1000)
        self._secret = _secret_bytes(secret)
        address = address or default_address()
        if self._secret is None and not _local_only(address):
            raise SyncError(f"refusing to serve weights on {address} without a secret: any peer that connects "
                            "would receive them. Pass secret=new_secret() here and the same secret to the "
                            "engines' update_weights, or use an ipc:// socket file on one node")
        if cuda_ipc and _ipc_path(address) is None:
            raise SyncError(f"CUDA IPC handles travel over an ipc:// socket file only, not {address}; "
                            "engines refuse them on any other transport")
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        # Fail loudly instead of dropping messages for a peer that went away or stopped reading.
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, _CONTROL_BYTES)
        self._pending: collections.OrderedDict[bytes, tuple[str, str]] = collections.OrderedDict()
        self.refused = 0  # peers answered ERROR instead of weights, over this sender's life
        if address.startswith("tcp://") and address.endswith(":0"):
            host = address.rsplit(":", 1)[0]
            address = f"{host}:{self._sock.bind_to_random_port(host)}".replace("*", "127.0.0.1")
        else:
            self._sock.bind(address)
        path = _ipc_path(address)
        if path is not None:
            os.chmod(path, 0o600)  # connecting to a unix socket needs write permission on it
        self.address = address

    # -- peers ------------------------------------------------------------------------------

    def _recv_any(self, wait_ms: int) -> tuple[bytes, dict | None] | None:
        """One message from any peer: (identity, body) with body None if it is not a control
        message; None after `wait_ms` without one."""
        if not self._sock.poll(max(wait_ms, 0)):
            return None
        frames = self._sock.recv_multipart()
        identity = frames[0]
        if len(frames) != 2:
            return identity, None
        try:
            body = json.loads(frames[1])
        except ValueError:
            return identity, None
        return identity, body if isinstance(body, dict) else None

    def _try_send(self, identity: bytes, body: bytes) -> None:
        """To a peer that has not proven anything: never blocks, never fails the sync."""
        try:
            self._sock.send_multipart([identity, body], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _refuse(self, identity: bytes, message: str) -> None:
        self.refused += 1
        self._pending.pop(identity, None)
        self._try_send(identity, _json("ERROR", message=message))

    def _handshake(self, version: int, receivers: int) -> list[bytes]:
        """Waits for `receivers` authenticated engines; other peers get an ERROR and nothing else.
        The deadline restarts at each engine admitted, never for anyone else."""
        peers: list[bytes] = []
        deadline = time.monotonic() + self.timeout_ms / 1000
        while len(peers) < receivers:
            got = self._recv_any(int((deadline - time.monotonic()) * 1000))
            if got is None:
                refused = f", {self.refused} peer(s) refused so far" if self.refused else ""
                self._abort(peers, f"not every engine got ready for version {version}")
                raise SyncError(f"no READY from an engine within {self.timeout_ms / 1000:.0f}s "
                                f"({len(peers)} of {receivers} ready{refused})")
            identity, body = got
            op = body.get("op") if body else None
            if identity in peers:
                self._refuse(identity, f"unexpected {op} during the handshake")
            elif op == "HELLO":
                nonce = body.get("nonce")
                if not (isinstance(nonce, str) and len(nonce) == _NONCE_HEX
                        and all(c in "0123456789abcdef" for c in nonce)):
                    self._refuse(identity, "malformed HELLO")
                    continue
                ours = secrets.token_hex(_NONCE_HEX // 2)
                self._pending[identity] = (nonce, ours)
                self._pending.move_to_end(identity)
                while len(self._pending) > _MAX_PENDING:
                    self._pending.popitem(last=False)
                challenge = {"nonce": ours, "version": version}
                if self._secret is not None:
                    challenge["proof"] = proof(self._secret, "trainer", nonce, ours, version)
                self._try_send(identity, _json("CHALLENGE", **challenge))
            elif op == "READY" and identity in self._pending:
                engine_nonce, ours = self._pending.pop(identity)
                if self._secret is not None and not _proof_ok(self._secret, body.get("proof"), "engine",
                                                              engine_nonce, ours, version):
                    self._refuse(identity, "authentication failed: no valid proof of the run's secret")
                    continue
                peers.append(identity)
                deadline = time.monotonic() + self.timeout_ms / 1000
            else:
                self._refuse(identity, f"unexpected {op or 'message'}: a peer starts with HELLO")
        return peers

    def _abort(self, peers: list[bytes], message: str) -> None:
        """Tells admitted engines the sync is off, so they fail now instead of at their timeout."""
        for peer in peers:
            self._try_send(peer, _json("ERROR", message=message))

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
        """Streams every tensor to `receivers` authenticated engines; returns once all of them
        acknowledged this version. `progress(bytes_sent, messages_sent)` is called after each
        bucket or handle."""
        peers = self._handshake(version, receivers)
        start = time.perf_counter()
        source = [0.0]
        named_tensors = _timed(named_tensors, source)
        count = params = sent = messages = 0
        try:
            send = self._ring_buckets if self.cuda_ipc else self._byte_buckets
            buckets = send(peers, named_tensors)
            for bucket in buckets:
                count += len(bucket.specs)
                params += sum(s.numel for s in bucket.specs.values())
                sent += sum(s.nbytes for s in bucket.segments)
                messages += 1
                if progress:
                    progress(sent, messages)
            for peer in peers:
                self._sock.send_multipart([peer, _json("COMMIT", version=version, tensors=count, bytes=sent)])
        except zmq.ZMQError as exc:
            self._abort(peers, f"the trainer stopped sending version {version}")
            raise SyncError(f"sending version {version} failed ({exc}); engines keep their previous weights") from None
        except BaseException:
            self._abort(peers, f"the trainer stopped sending version {version}")
            raise
        load = self._acks(peers, version)
        return SyncStats(version, count, params, sent, messages, len(peers), time.perf_counter() - start, source[0],
                         load)

    @staticmethod
    def _bucket_header(op: str, bucket, **extra) -> dict:
        return {"op": op, "specs": {i: dataclasses.astuple(s) for i, s in bucket.specs.items()},
                "segments": [dataclasses.astuple(s) for s in bucket.segments], **extra}

    def _byte_buckets(self, peers: list[bytes], named_tensors):
        for bucket in pack(named_tensors, self.bucket_bytes):
            # DLPack, not .numpy(): zero-copy either way, but .numpy() marks the storage
            # unresizable for good, and models.offload frees parameters by resizing theirs
            self._send(peers, [json.dumps(self._bucket_header("BUCKET", bucket)).encode(),
                               *(np.from_dlpack(p) for p in bucket.payloads)])
            yield bucket

    def _ring_buckets(self, peers: list[bytes], named_tensors):
        """CUDA IPC through a ring of RING_SLOTS buckets on the tensors' device: each bucket is
        copied into a free slot and the slot's handle sent; an engine copies the bucket out and
        answers FREE, and a slot is filled again only once every engine freed it. The trainer
        holds a few buckets, never a copy of the model."""
        from torch.multiprocessing.reductions import reduce_tensor

        tensors = iter(named_tensors)
        first = next(tensors, None)
        if first is None:
            return
        device = first[1].device
        ring = [torch.empty(self.bucket_bytes, dtype=torch.uint8, device=device) for _ in range(RING_SLOTS)]
        uuid = device_uuid(device.index) if device.type == "cuda" else None
        busy: list[set] = [set() for _ in ring]  # engines that still read each slot
        for index, bucket in enumerate(pack(itertools.chain([first], tensors), self.bucket_bytes, device=device)):
            slot = index % len(ring)
            self._wait_free(busy, slot)
            offset = fill(ring[slot], bucket)
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()  # the bytes are in the slot before it is shared
            header = self._bucket_header("HANDLE", bucket, slot=slot, slot_bytes=self.bucket_bytes, nbytes=offset,
                                         device_uuid=uuid)
            self._send(peers, [json.dumps(header).encode(), pickle.dumps(reduce_tensor(ring[slot]))])
            busy[slot] = set(peers)
            yield bucket
        for slot in range(len(ring)):  # the ring is reused (or freed) only once nobody reads it
            self._wait_free(busy, slot)

    def _wait_free(self, busy: list[set], slot: int) -> None:
        deadline = time.monotonic() + self.timeout_ms / 1000
        while busy[slot]:
            got = self._recv_any(int((deadline - time.monotonic()) * 1000))
            if got is None:
                raise SyncError(f"no engine freed bucket slot {slot} within {self.timeout_ms / 1000:.0f}s")
            identity, body = got
            op = body.get("op") if body else None
            holders = [s for s in busy if identity in s]
            if not holders:
                self._refuse(identity, "a sync is in progress: start with HELLO once it is over")
            elif op == "FREE" and isinstance(body.get("slot"), int) and 0 <= body["slot"] < len(busy):
                busy[body["slot"]].discard(identity)
            elif op == "ERROR":
                raise SyncError(f"engine {_peer(identity)} stopped receiving: {body.get('message')}")
            else:
                raise SyncError(f"engine {_peer(identity)} answered a bucket with {op or 'a malformed message'}")

    def _acks(self, peers: list[bytes], version: int) -> float:
        """Waits for an ACK of `version` from every engine streamed to; returns the slowest load."""
        waiting, load = set(peers), 0.0
        deadline = time.monotonic() + self.timeout_ms / 1000
        while waiting:
            got = self._recv_any(int((deadline - time.monotonic()) * 1000))
            if got is None:
                raise SyncError(f"no ACK from an engine within {self.timeout_ms / 1000:.0f}s "
                                f"({len(peers) - len(waiting)} of {len(peers)} acknowledged version {version})")
            identity, reply = got
            if identity not in waiting:
                self._refuse(identity, "a sync is in progress: start with HELLO once it is over")
                continue
            op = reply.get("op") if reply else None
            if op == "FREE":  # CUDA IPC: a late release of a bucket slot
                continue
            if op == "ERROR":
                raise SyncError(f"engine {_peer(identity)} rejected version {version}: {reply.get('message')}")
            if op != "ACK":
                raise SyncError(f"engine {_peer(identity)} answered version {version} with "
                                f"{op or 'a malformed message'}")
            if reply.get("version") != version:
                raise SyncError(f"engine {_peer(identity)} acknowledged version {reply.get('version')}, "
                                f"but the trainer sent version {version}")
            waiting.discard(identity)
            load = max(load, float(reply.get("load_seconds") or 0.0))
            deadline = time.monotonic() + self.timeout_ms / 1000
        return load

    def close(self) -> None:
        self._sock.close(linger=0)
        path = _ipc_path(self.address) if hasattr(self, "address") else None
        if path is not None:
            try:
                os.unlink(path)
            except OSError:
                pass
            directory = os.path.dirname(path)
            if os.path.basename(directory).startswith(_ADDRESS_PREFIX):  # made by socket_directory
                try:
                    os.rmdir(directory)
                except OSError:
                    pass


def _storage_from_bytes(data: bytes):
    """What a pickled CPU storage loads through (torch.storage._load_from_bytes), with torch's
    weights-only loader instead of an unrestricted one."""
    return torch.load(io.BytesIO(data), weights_only=True)


class _HandleUnpickler(pickle.Unpickler):
    """Resolves only the names `reduce_tensor` output consists of: a handle that names anything
    else (os.system, builtins, ...) is refused before any of it runs."""

    ALLOWED = {
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
        ("torch.multiprocessing.reductions", "rebuild_tensor"),
        ("torch", "Tensor"),
        ("torch._tensor", "Tensor"),
        ("torch.nn.parameter", "Parameter"),
        ("torch", "Size"),
        ("torch", "TypedStorage"),
        ("torch", "UntypedStorage"),
        ("torch.storage", "TypedStorage"),
        ("torch.storage", "UntypedStorage"),
    }

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _storage_from_bytes
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise SyncError(f"refusing a CUDA IPC handle that names {module}.{name}")


def _checked(spec: TensorSpec, expected: dict[str, tuple[int, ...]] | None) -> TensorSpec:
    if expected is not None:
        if spec.name not in expected:
            raise SyncError(f"weight update rejected: {spec.name} is not a tensor of the served checkpoint")
        if expected[spec.name] != spec.shape:
            raise SyncError(f"weight update rejected: {spec.name} has shape {spec.shape}, "
                            f"expected {expected[spec.name]}")
    return spec


def device_uuid(index: int | None) -> str:
    """The physical identity of a CUDA device of this process (its index depends on the process's
    CUDA_VISIBLE_DEVICES; the UUID does not)."""
    return str(torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index).uuid)


_STORAGE_DEVICE = 6  # rebuild_cuda_tensor's argument naming the sender's device index


def rewrite_device(args: tuple, sender_uuid: str | None, local_uuids: Sequence[str]) -> tuple:
    """rebuild_cuda_tensor's arguments with the sender's device index replaced by this process's
    index of the same physical GPU: under Ray each process sees its own CUDA_VISIBLE_DEVICES, so
    the trainer's cuda:0 can be the engine's cuda:3. A GPU this process cannot see is an error."""
    if sender_uuid is None:
        raise SyncError("a CUDA IPC handle without the sender's device UUID: cannot tell which GPU it is on")
    if sender_uuid not in local_uuids:
        raise SyncError(f"CUDA IPC handle on GPU {sender_uuid}, which this engine worker cannot see "
                        f"(it sees {', '.join(local_uuids) or 'none'}): CUDA IPC needs the trainer rank and the "
                        "engine worker on the same GPU; use weight_sync.transport=collective")
    args = list(args)
    args[_STORAGE_DEVICE] = list(local_uuids).index(sender_uuid)
    return tuple(args)


def _load_handle(data: bytes, spec: TensorSpec, sender_uuid: str | None) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, rebuild_tensor

    try:
        loaded = _HandleUnpickler(io.BytesIO(data)).load()
    except SyncError:
        raise
    except Exception as exc:
        raise SyncError(f"malformed CUDA IPC handle for {spec.name}: {type(exc).__name__}: {exc}") from None
    if not (isinstance(loaded, tuple) and len(loaded) == 2 and loaded[0] in (rebuild_cuda_tensor, rebuild_tensor)
            and isinstance(loaded[1], tuple)):
        raise SyncError(f"malformed CUDA IPC handle for {spec.name}")
    fn, args = loaded
    if fn is rebuild_cuda_tensor:
        args = rewrite_device(args, sender_uuid, [device_uuid(i) for i in range(torch.cuda.device_count())])
    tensor = fn(*args)
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != spec.shape \
            or str(tensor.dtype).removeprefix("torch.") != spec.dtype:
        raise SyncError(f"CUDA IPC handle for {spec.name} does not match its spec {spec.dtype}{list(spec.shape)}")
    return tensor


class ZmqWeightReceiver:
    """Engine side: pulls one version of the weights, tensor by tensor (:meth:`stream`), or all
    of it (:meth:`receive`); raises SyncError on anything short of a complete, committed version.
    `secret`: the run's secret, which the trainer must prove it holds; required for any address
    but a local one (an ipc:// socket file, inproc://)."""

    def __init__(self, address: str, timeout_s: float = 120.0, secret: str | bytes | None = None):
        self.timeout_ms = int(timeout_s * 1000)
        self.version = None  # of the last complete stream
        self.committed_at = None  # perf_counter() when its COMMIT arrived
        self._secret = _secret_bytes(secret)
        if self._secret is None and not _local_only(address):
            raise SyncError(f"refusing to take weights from {address} without a secret to authenticate "
                            "the trainer; pass the run's secret to update_weights")
        # Decided here, from where this engine connects, never from what the peer says: CUDA IPC
        # handles are pickles, so only a socket file on this node may carry them.
        self.handles_allowed = _ipc_path(address) is not None
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        # A random routing id: a peer cannot claim this engine's identity at the trainer.
        self._sock.setsockopt(zmq.ROUTING_ID, b"E" + secrets.token_bytes(15))
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
            header = json.loads(frame)
        except ValueError:
            header = None
        if not isinstance(header, dict):
            raise SyncError(f"malformed weight stream: expected a header, got {len(frame)} bytes")
        if header.get("op") == "ERROR":
            raise SyncError(f"the trainer at {self.address} refused or ended the sync: {header.get('message')}; "
                            "keeping the previous weights")
        return header

    def _more(self, what: str) -> None:
        # The frames of a multipart message arrive together, so no wait is needed for them.
        if not self._sock.getsockopt(zmq.RCVMORE):
            raise SyncError(f"malformed weight stream: {what} is missing")

    def _recv_into(self, target: torch.Tensor, what: str) -> None:
        self._more(what)
        size = self._sock.recv_into(target.numpy())
        if size != target.numel():
            raise SyncError(f"malformed weight stream: {what} has {size} bytes, expected {target.numel()}")

    def _handshake(self, version: int | None) -> None:
        ours = secrets.token_hex(_NONCE_HEX // 2)
        self._sock.send(_json("HELLO", nonce=ours))
        challenge = self._recv_header()
        theirs, offered = challenge.get("nonce"), challenge.get("version")
        if challenge.get("op") != "CHALLENGE" or not isinstance(theirs, str):
            raise SyncError(f"malformed weight stream: expected a CHALLENGE, got {challenge.get('op')}")
        if self._secret is not None and not _proof_ok(self._secret, challenge.get("proof"), "trainer",
                                                      ours, theirs, offered):
            raise SyncError(f"the weight sender at {self.address} did not prove it holds the run's secret; "
                            "refusing its weights")
        if version is not None and offered != version:
            raise SyncError(f"the trainer at {self.address} is sending version {offered}, "
                            f"this engine expects version {version}")
        ready = {} if self._secret is None else {"proof": proof(self._secret, "engine", ours, theirs, offered)}
        self._sock.send(_json("READY", **ready))

    def _unpack(self, message: dict, specs: dict, partial: dict, expected, source: torch.Tensor | None) -> list:
        """Takes in one bucket: its new tensors' specs (checked, then memory set aside for each,
        on the slot's device for CUDA IPC) and its segments, from the socket's frames or from
        the mapped slot `source`. Returns the indices of the tensors it completed."""
        device = source.device if source is not None else torch.device("cpu")
        done = []
        for index, (name, dtype, shape) in message["specs"].items():
            spec = _checked(TensorSpec(name, dtype, tuple(shape)), expected)
            specs[int(index)] = spec
            partial[int(index)] = [torch.empty(spec.nbytes, dtype=torch.uint8, device=device), 0]
            if spec.nbytes == 0:  # no segment will come for it
                done.append(int(index))
        position = 0
        for index, offset, nbytes in message["segments"]:
            data, got = partial[index]
            what = f"bytes {offset}-{offset + nbytes} of {specs[index].name}"
            if offset != got or offset + nbytes > data.numel():
                raise SyncError(f"malformed weight stream: {what}")
            if source is None:
                self._recv_into(data[offset : offset + nbytes], what)
            else:
                if position + nbytes > source.numel():
                    raise SyncError(f"malformed weight stream: {what} past the end of its bucket slot")
                data[offset : offset + nbytes].copy_(source[position : position + nbytes])
                position += nbytes
            partial[index][1] = got + nbytes
            if partial[index][1] == data.numel():
                done.append(index)
        return done

    def stream(self, version: int | None = None, expected: dict[str, tuple[int, ...]] | None = None,
               order: dict[str, int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields each (name, tensor) of the version as soon as its last byte arrived, each in
        memory of its own; ends without error only at a COMMIT that matches what arrived. With
        `version`, a stream of any other version is a SyncError; with `expected` (name -> shape),
        so is a tensor the served checkpoint lacks or has in another shape (checked before any
        memory is set aside for it), and a COMMIT before every expected tensor arrived. `order`,
        if given, is filled with each tensor's position in the trainer's stream."""
        self._handshake(version)
        specs: dict[int, TensorSpec] = {}
        partial: dict[int, list] = {}  # index -> [bytes, how many arrived]
        while True:
            message = self._recv_header()
            op = message.get("op")
            if op == "COMMIT":
                break
            source = None  # CUDA IPC: the trainer's bucket slot, mapped
            try:
                if op == "HANDLE":
                    if not self.handles_allowed:
                        raise SyncError(
                            f"refusing a CUDA IPC HANDLE frame over {_scheme(self.address)}:// (from {self.address}): "
                            "handles are pickles and are accepted only from an ipc:// socket file on this node; "
                            "keeping the previous weights")
                    slot = int(message["slot"])
                    self._more("a CUDA IPC handle")
                    source = _load_handle(self._sock.recv(), TensorSpec(f"bucket slot {slot}", "uint8",
                                                                        (int(message["slot_bytes"]),)),
                                          message.get("device_uuid"))
                elif op != "BUCKET":
                    raise SyncError(f"malformed weight stream: unexpected {op!r} message")
                done = self._unpack(message, specs, partial, expected, source)
            except (KeyError, TypeError, ValueError, IndexError) as exc:
                raise SyncError(f"malformed weight stream: bad {op} header ({type(exc).__name__}: {exc})") from None
            if self._sock.getsockopt(zmq.RCVMORE):
                raise SyncError(f"malformed weight stream: a {op} message has more frames than it announced")
            if source is not None:
                if source.is_cuda:
                    torch.cuda.current_stream(source.device).synchronize()  # copied out before FREE
                del source
                self._sock.send(_json("FREE", slot=slot))
            for index in done:
                spec = specs[index]
                yield spec.name, spec.view_of(partial.pop(index)[0])
        self.committed_at = time.perf_counter()
        if order is not None:
            order.update((spec.name, index) for index, spec in specs.items())
        got = message.get("version")
        if version is not None and got != version:
            raise SyncError(f"the trainer committed version {got}, this engine expects version {version}; "
                            "keeping the previous weights")
        if len(specs) != message.get("tensors") or partial:
            raise SyncError(f"version {got} incomplete: got {len(specs)} of {message.get('tensors')} tensors"
                            + (f", {specs[next(iter(partial))].name} short" if partial else ""))
        missing = sorted(set(expected or ()) - {s.name for s in specs.values()})
        if missing:
            raise SyncError(f"weight update rejected: {len(missing)} missing (e.g. {missing[0]})")
        self.version = got

    def receive(self, version: int | None = None) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """Returns (version, [(name, tensor), ...]) once every byte of a version arrived; with
        `version`, a stream of any other version is a SyncError."""
        order = {}  # tensors complete out of order (a zero-size one before a split one): keep the stream's
        tensors = [(name, tensor) for name, tensor in self.stream(version, order=order)]
        return self.version, sorted(tensors, key=lambda item: order[item[0]])

    def reply(self, version: int, error: str | None = None, load_seconds: float = 0.0) -> None:
        body = ({"op": "ACK", "version": version, "load_seconds": load_seconds} if error is None
                else {"op": "ERROR", "message": error})
        self._sock.send(json.dumps(body).encode())

    def close(self) -> None:
        self._sock.close(linger=0)


class ZmqWeightSynchronizer(WeightSynchronizer):
    """Trainer-side sync over ZMQ bytes: one sender socket, every engine worker pulls from it (CUDA
    IPC has a sender per GPU instead: cuda_ipc.CudaIpcWeightSynchronizer). The
    `secret` (see new_secret; required for tcp://) goes to each engine as the `secret=` argument
    of its update_weights call, through Ray, and authenticates both ends of every connection."""

    def __init__(self, address: str | None = None, bucket_bytes: int = 256 << 20, timeout_s: float = 120.0,
                 workers_per_engine: int = 1, secret: str | bytes | None = None):
        self.sender = ZmqWeightSender(address, bucket_bytes=bucket_bytes, timeout_s=timeout_s, secret=secret)
        self._secret = secret
        self.timeout_s = timeout_s
        self.workers_per_engine = workers_per_engine  # vLLM TP workers each pull a full copy

    def sync(self, named_tensors, engines: Sequence, version: int, progress=None) -> SyncStats:
        # Engines that predate authentication keep working over ipc:// without a secret.
        auth = {} if self._secret is None else {"secret": self._secret}
        with ThreadPoolExecutor(max_workers=max(1, len(engines))) as pool:
            waits = [call_async(pool, e, "update_weights", self.sender.address, version, self.timeout_s, **auth)
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
