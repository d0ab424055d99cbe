"""The trainer's end of the ZMQ transport: a ROUTER socket that streams a version of the
weights, bucket by bucket, to every engine worker that authenticated (see zmq_transport for the
protocol and auth for the proofs).

The trainer streams: it packs tensors as its iterator produces them (e.g. gathered from
megatron TP/PP shards one at a time), so it never holds the whole model. Frames are sent with
``copy=False``, straight from the tensors' memory. Peers that do not prove they hold the run's
secret (no proof, a wrong one, a READY without a challenge, garbage) are answered ERROR and never
get a byte of weights, do not count as receivers and do not extend the sync's deadline, so the
genuine engines' sync completes as if they were not there. Peers connect with random routing
ids, and the socket drops peers that send more than a control message's worth of bytes.

Without a secret, tcp:// is refused; an ipc:// address works as before: default_address puts the
socket in a fresh 0700 directory and the sender makes the socket file 0600, so only this user's
processes can connect."""

from __future__ import annotations

import collections
import json
import os
import secrets
import tempfile
import time
from typing import Callable, Iterable

import numpy as np
import torch
import zmq

from agentgym_mega.weight_sync.auth import ipc_path, local_only, proof, proof_ok, secret_bytes
from agentgym_mega.weight_sync.base import SyncError, SyncStats, timed
from agentgym_mega.weight_sync.buckets import bucket_header, pack

NONCE_HEX = 32  # 16 random bytes
_CONTROL_BYTES = 1 << 20  # peers only ever send the trainer small JSON messages (an ERROR at most)
_MAX_PENDING = 4096  # challenges outstanding at once; the oldest is dropped beyond that
_ADDRESS_PREFIX = "agentgym-weights-"


def socket_directory() -> str:
    """A fresh directory for ipc:// sockets that only this user can enter (mode 0700); a sender
    bound in it removes it on close once it is empty."""
    return tempfile.mkdtemp(prefix=_ADDRESS_PREFIX)


def default_address() -> str:
    """An ipc:// endpoint for engines on this node (use tcp://HOST:PORT across nodes), in a fresh
    socket_directory()."""
    return f"ipc://{socket_directory()}/sock"



def endpoint(transport: str, host: str) -> str:
    """Where trainer rank 0 binds its ZMQ sender for `transport` ipc or tcp (`host`: the
    trainer's address for tcp). CUDA IPC binds one socket per GPU instead (see cuda_ipc)."""
    if transport not in ("ipc", "tcp"):
        raise ValueError(f"a single ZMQ sender serves transport ipc or tcp, not {transport}")
    return f"tcp://{host}:0" if transport == "tcp" else default_address()



def json_message(op: str, **payload) -> bytes:
    return json.dumps({"op": op, **payload}).encode()


def peer_name(identity: bytes) -> str:
    return identity.hex()[:12]



class ZmqWeightSender:
    """Trainer side: binds `address` and streams a version of the weights to every engine that
    proves it holds `secret` (see the module docstring). Without a secret only a local address
    (an ipc:// socket file, inproc://) is accepted."""

    def __init__(self, address: str | None = None, bucket_bytes: int = 256 << 20, timeout_s: float = 120.0,
                 secret: str | bytes | None = None):
        self.bucket_bytes = bucket_bytes
        self.timeout_ms = int(timeout_s * 1000)
        self._secret = secret_bytes(secret)
        address = address or default_address()
        if self._secret is None and not local_only(address):
            raise SyncError(f"refusing to serve weights on {address} without a secret: any peer that connects "
                            "would receive them. Pass secret=new_secret() here and the same secret to the "
                            "engines (in their receiver), or use an ipc:// socket file on one node")
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
        path = ipc_path(address)
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
        self._try_send(identity, json_message("ERROR", message=message))

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
                if not (isinstance(nonce, str) and len(nonce) == NONCE_HEX
                        and all(c in "0123456789abcdef" for c in nonce)):
                    self._refuse(identity, "malformed HELLO")
                    continue
                ours = secrets.token_hex(NONCE_HEX // 2)
                self._pending[identity] = (nonce, ours)
                self._pending.move_to_end(identity)
                while len(self._pending) > _MAX_PENDING:
                    self._pending.popitem(last=False)
                challenge = {"nonce": ours, "version": version}
                if self._secret is not None:
                    challenge["proof"] = proof(self._secret, "trainer", nonce, ours, version)
                self._try_send(identity, json_message("CHALLENGE", **challenge))
            elif op == "READY" and identity in self._pending:
                engine_nonce, ours = self._pending.pop(identity)
                if self._secret is not None and not proof_ok(self._secret, body.get("proof"), "engine",
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
            self._try_send(peer, json_message("ERROR", message=message))

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
        named_tensors = timed(named_tensors, source)
        count = params = sent = messages = 0
        try:
            for bucket in self._buckets(peers, named_tensors):
                count += len(bucket.specs)
                params += sum(s.numel for s in bucket.specs.values())
                sent += sum(s.nbytes for s in bucket.segments)
                messages += 1
                if progress:
                    progress(sent, messages)
            for peer in peers:
                self._sock.send_multipart([peer, json_message("COMMIT", version=version, tensors=count, bytes=sent)])
        except zmq.ZMQError as exc:
            self._abort(peers, f"the trainer stopped sending version {version}")
            raise SyncError(f"sending version {version} failed ({exc}); no engine commits it") from None
        except BaseException:
            self._abort(peers, f"the trainer stopped sending version {version}")
            raise
        load = self._acks(peers, version)
        return SyncStats(version, count, params, sent, messages, len(peers), time.perf_counter() - start, source[0],
                         load)

    def _buckets(self, peers: list[bytes], named_tensors):
        """Sends each bucket's bytes (a subclass may send something else for them, see
        ipc_ring) and yields the bucket once it is out."""
        for bucket in pack(named_tensors, self.bucket_bytes):
            # DLPack, not .numpy(): zero-copy either way, but .numpy() marks the storage
            # unresizable for good, and models.offload frees parameters by resizing theirs
            self._send(peers, [json.dumps(bucket_header("BUCKET", bucket)).encode(),
                               *(np.from_dlpack(p) for p in bucket.payloads)])
            yield bucket

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
                raise SyncError(f"engine {peer_name(identity)} rejected version {version}: {reply.get('message')}")
            if op != "ACK":
                raise SyncError(f"engine {peer_name(identity)} answered version {version} with "
                                f"{op or 'a malformed message'}")
            if reply.get("version") != version:
                raise SyncError(f"engine {peer_name(identity)} acknowledged version {reply.get('version')}, "
                                f"but the trainer sent version {version}")
            waiting.discard(identity)
            load = max(load, float(reply.get("load_seconds") or 0.0))
            deadline = time.monotonic() + self.timeout_ms / 1000
        return load

    def close(self) -> None:
        self._sock.close(linger=0)
        path = ipc_path(self.address) if hasattr(self, "address") else None
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

