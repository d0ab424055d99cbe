"""One sender and N receivers of a transport with no trainer and no engine in between: the raw
transports as `bench sync`'s transport mode times them (agentgym_mega.bench.sync holds the
processes, the model and the measurements). `zmq`: ZmqWeightSender / ZmqWeightReceiver over
tcp://, a connection per sync; `collective`: the gloo chain of CollectiveSender /
CollectiveReceiver over one group kept for every sync."""

from __future__ import annotations

import datetime
from typing import Callable

import torch
import torch.distributed as dist

from agentgym_mega.weight_sync.base import SyncStats
from agentgym_mega.weight_sync.collective import (
    CollectiveReceiver,
    CollectiveSender,
    GroupSpec,
    new_group_id,
    open_store,
)
from agentgym_mega.weight_sync.zmq_receiver import ZmqWeightReceiver
from agentgym_mega.weight_sync.zmq_sender import ZmqWeightSender

TRANSPORTS = ("zmq", "collective")


def open_group(receivers: int, bucket_bytes: int, timeout_s: float) -> tuple[dist.TCPStore, dict]:
    """The collective's rendezvous store, hosted by the caller for as long as the group lives, and
    the group's spec (a dict) that its sender and receivers join."""
    store = open_store("127.0.0.1", 1 + receivers, timeout_s)
    spec = GroupSpec(new_group_id(), (("127.0.0.1", store.port),), 1 + receivers, "gloo", "chain", bucket_bytes,
                     timeout_s)
    return store, spec.as_dict()


class LoopbackSender:
    """`target`: what the receivers need to reach it (the ZMQ address; the group spec given)."""

    def __init__(self, transport: str, receivers: int, bucket_bytes: int, timeout_s: float, secret: str,
                 spec: dict | None = None):
        self.transport, self.receivers = transport, receivers
        if transport == "zmq":
            self._sender = ZmqWeightSender("tcp://127.0.0.1:0", bucket_bytes=bucket_bytes, timeout_s=timeout_s,
                                           secret=secret)
            self.target = self._sender.address
        else:
            group = GroupSpec.of(spec)
            host, port = group.stores[0]
            store = dist.TCPStore(host, port, group.world, is_master=False,
                                  timeout=datetime.timedelta(seconds=group.timeout_s))
            self._sender = CollectiveSender(group, 0, store, secret)  # waits for every receiver to join
            self.target = spec

    def push(self, model: list[tuple[str, torch.Tensor]], version: int) -> SyncStats:
        """One sync; returns once every receiver acknowledged (zmq) or voted (collective)."""
        if self.transport == "zmq":
            return self._sender.push(model, version, self.receivers)
        return self._sender.push(model, version)

    def close(self) -> None:
        self._sender.close()


class LoopbackReceiver:
    """Receiver `rank` (1..N) of the sender at `target`; the collective's joins the group now."""

    def __init__(self, transport: str, rank: int, target, timeout_s: float, secret: str):
        self.transport, self.target, self.timeout_s, self._secret = transport, target, timeout_s, secret
        self._member = CollectiveReceiver(GroupSpec.of(target), rank, secret) if transport == "collective" else None
        self._connection: ZmqWeightReceiver | None = None

    def take(self, version: int, expected: dict[str, tuple[int, ...]], check: Callable[[str, torch.Tensor], None],
             complete: Callable[[], None]) -> None:
        """Receives `version`, calling `check(name, tensor)` on each tensor and `complete()` at the
        end (either raises ValueError to reject the version); raises RuntimeError if rejected."""
        if self._member is None:
            self._connection = ZmqWeightReceiver(self.target, self.timeout_s, secret=self._secret)  # one per sync
            got, tensors = self._connection.receive(version)
            error = None
            try:
                for name, tensor in tensors:
                    check(name, tensor)
                complete()
            except ValueError as exc:
                error = str(exc)
            self._connection.reply(got, error)
            if error is not None:
                raise RuntimeError(error)
            return
        error, stream = None, self._member.stream(version, expected)
        try:
            for name, tensor in stream:
                check(name, tensor)
            complete()
        except Exception as exc:  # noqa: BLE001 - voted down, then reported
            error = f"{type(exc).__name__}: {exc}"
        finally:
            stream.close()
        if not self._member.vote(error is None):
            raise RuntimeError(error or f"version {version} rolled back: another member voted no")

    def release(self) -> None:
        """Lets go of this sync's connection (zmq: once the sender has measured it)."""
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def close(self) -> None:
        self.release()
        if self._member is not None:
            self._member.close()
