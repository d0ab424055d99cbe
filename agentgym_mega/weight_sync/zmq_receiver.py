"""The engine worker's end of the ZMQ transport: a DEALER socket that authenticates the trainer,
then takes a version of the weights tensor by tensor (see zmq_transport for the protocol).

Each byte is received straight into the memory of the tensor it belongs to, and each tensor is
handed to the loader once complete (vLLM's loaders then keep only the worker's TP shard), so no
worker holds a full copy of the model. A stream counts only once it ends in a COMMIT that
matches what arrived. CUDA IPC handles (HANDLE messages) are accepted only when the address
*this engine connected to* is an ipc:// socket file, whatever the trainer's messages say, and
are read by the restricted unpickler of handles.py."""

from __future__ import annotations

import json
import secrets
import time
from typing import Iterator

import torch
import zmq

from agentgym_mega.weight_sync.auth import ipc_path, local_only, proof, proof_ok, scheme, secret_bytes
from agentgym_mega.weight_sync.base import SyncError
from agentgym_mega.weight_sync.buckets import TensorSpec
from agentgym_mega.weight_sync.handles import load_handle
from agentgym_mega.weight_sync.zmq_sender import NONCE_HEX, json_message


def _checked(spec: TensorSpec, expected: dict[str, tuple[int, ...]] | None) -> TensorSpec:
    if expected is not None:
        if spec.name not in expected:
            raise SyncError(f"weight update rejected: {spec.name} is not a tensor of the served checkpoint")
        if expected[spec.name] != spec.shape:
            raise SyncError(f"weight update rejected: {spec.name} has shape {spec.shape}, "
                            f"expected {expected[spec.name]}")
    return spec


class ZmqWeightReceiver:
    """Engine side: pulls one version of the weights, tensor by tensor (:meth:`stream`), or all
    of it (:meth:`receive`); raises SyncError on anything short of a complete, committed version.
    `secret`: the run's secret, which the trainer must prove it holds; required for any address
    but a local one (an ipc:// socket file, inproc://)."""

    def __init__(self, address: str, timeout_s: float = 120.0, secret: str | bytes | None = None):
        self.timeout_ms = int(timeout_s * 1000)
        self.version = None  # of the last complete stream
        self.committed_at = None  # perf_counter() when its COMMIT arrived
        self._secret = secret_bytes(secret)
        if self._secret is None and not local_only(address):
            raise SyncError(f"refusing to take weights from {address} without a secret to authenticate "
                            "the trainer; pass the run's secret with the receiver")
        # Decided here, from where this engine connects, never from what the peer says: CUDA IPC
        # handles are pickles, so only a socket file on this node may carry them.
        self.handles_allowed = ipc_path(address) is not None
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        # A random routing id: a peer cannot claim this engine's identity at the trainer.
        self._sock.setsockopt(zmq.ROUTING_ID, b"E" + secrets.token_bytes(15))
        self._sock.connect(address)
        self.address = address

    def _recv_header(self) -> dict:
        if not self._sock.poll(self.timeout_ms):
            raise SyncError(f"weight stream from {self.address} stalled for {self.timeout_ms / 1000:.0f}s")
        frame = self._sock.recv()
        try:
            header = json.loads(frame)
        except ValueError:
            header = None
        if not isinstance(header, dict):
            raise SyncError(f"malformed weight stream: expected a header, got {len(frame)} bytes")
        if header.get("op") == "ERROR":
            raise SyncError(f"the trainer at {self.address} refused or ended the sync: {header.get('message')}")
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
        ours = secrets.token_hex(NONCE_HEX // 2)
        self._sock.send(json_message("HELLO", nonce=ours))
        challenge = self._recv_header()
        theirs, offered = challenge.get("nonce"), challenge.get("version")
        if challenge.get("op") != "CHALLENGE" or not isinstance(theirs, str):
            raise SyncError(f"malformed weight stream: expected a CHALLENGE, got {challenge.get('op')}")
        if self._secret is not None and not proof_ok(self._secret, challenge.get("proof"), "trainer",
                                                      ours, theirs, offered):
            raise SyncError(f"the weight sender at {self.address} did not prove it holds the run's secret; "
                            "refusing its weights")
        if version is not None and offered != version:
            raise SyncError(f"the trainer at {self.address} is sending version {offered}, "
                            f"this engine expects version {version}")
        ready = {} if self._secret is None else {"proof": proof(self._secret, "engine", ours, theirs, offered)}
        self._sock.send(json_message("READY", **ready))

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
                            f"refusing a CUDA IPC HANDLE frame over {scheme(self.address)}:// (from {self.address}): "
                            "handles are pickles and are accepted only from an ipc:// socket file on this node")
                    slot = int(message["slot"])
                    self._more("a CUDA IPC handle")
                    source = load_handle(self._sock.recv(), TensorSpec(f"bucket slot {slot}", "uint8",
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
                self._sock.send(json_message("FREE", slot=slot))
            for index in done:
                spec = specs[index]
                yield spec.name, spec.view_of(partial.pop(index)[0])
        self.committed_at = time.perf_counter()
        if order is not None:
            order.update((spec.name, index) for index, spec in specs.items())
        got = message.get("version")
        if version is not None and got != version:
            raise SyncError(f"the trainer committed version {got}, this engine expects version {version}")
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

