"""CUDA IPC's sending end: the ZMQ sender with, in place of each bucket's bytes, the CUDA IPC handle
of a slot of a ring on the tensors' GPU (see cuda_ipc for which engine workers it feeds).

The sender copies each bucket into a free slot of a ring of RING_SLOTS on that GPU and sends a
HANDLE message: the bucket's specs and segments, the sender's GPU UUID, and the slot's handle
(handles.handle_of). The engine maps the slot, copies the bucket out and answers FREE; a slot is
refilled only once every engine freed it, so the trainer holds a few buckets, never a copy of the
model. No bytes of weights travel over the socket."""

from __future__ import annotations

import itertools
import json
import time

import torch

from agentgym_mega.weight_sync.auth import ipc_path
from agentgym_mega.weight_sync.base import SyncError
from agentgym_mega.weight_sync.buckets import bucket_header, fill, pack
from agentgym_mega.weight_sync.handles import device_uuid, handle_of
from agentgym_mega.weight_sync.zmq_sender import ZmqWeightSender, default_address, peer_name

RING_SLOTS = 3  # buckets in flight between the trainer and its engines


class CudaIpcSender(ZmqWeightSender):
    """A ZmqWeightSender that shares bucket slots on the GPU instead of sending bytes; it binds an
    ipc:// socket file only, since engines refuse handles on any other transport."""

    def __init__(self, address: str | None = None, bucket_bytes: int = 256 << 20, timeout_s: float = 120.0,
                 secret: str | bytes | None = None):
        address = address or default_address()
        if ipc_path(address) is None:
            raise SyncError(f"CUDA IPC handles travel over an ipc:// socket file only, not {address}; "
                            "engines refuse them on any other transport")
        super().__init__(address, bucket_bytes, timeout_s, secret)

    def _buckets(self, peers: list[bytes], named_tensors):
        """CUDA IPC through a ring of RING_SLOTS buckets on the tensors' device: each bucket is
        copied into a free slot and the slot's handle sent; an engine copies the bucket out and
        answers FREE, and a slot is filled again only once every engine freed it. The trainer
        holds a few buckets, never a copy of the model."""
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
            message = bucket_header("HANDLE", bucket, slot=slot, slot_bytes=self.bucket_bytes, nbytes=offset,
                             device_uuid=uuid)
            self._send(peers, [json.dumps(message).encode(), handle_of(ring[slot])])
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
                raise SyncError(f"engine {peer_name(identity)} stopped receiving: {body.get('message')}")
            else:
                raise SyncError(f"engine {peer_name(identity)} answered a bucket with {op or 'a malformed message'}")
