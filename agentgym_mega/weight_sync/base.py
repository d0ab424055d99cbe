"""The weight-synchronisation interface: what the trainer ranks call once per step, what a
transport needs exported from the trainer's shards, the description of an engine worker's side of
one sync (a receiver), and the errors and statistics every transport shares."""

from __future__ import annotations

import abc
import dataclasses
import time
from typing import ClassVar, Iterable, Iterator, Sequence

import torch

# What a synchronizer needs from the trainer's export (models.weights.export_hf's `to`): the
# model-parallel group's first rank holds every tensor (FIRST), the first TP rank of every
# pipeline stage holds its stage's (STAGE), or every rank holds every tensor (EVERY).
FIRST, STAGE, EVERY = "first", "stage", "every"


class SyncError(RuntimeError):
    """A weight sync that did not complete. An engine that failed before any tensor reached its
    model still serves its version; one that failed after is dirty (it refuses to generate) until
    a re-send commits: no copy of the previous weights is kept."""


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


class WeightSynchronizer(abc.ABC):
    """The trainer's side of a transport, on every trainer rank: all ranks call :meth:`sync`
    together, each with the export of form :attr:`export` (the export is collective)."""

    export: ClassVar[str] = FIRST
    groups: list[dict] = []  # the groups it formed (topology.SyncGroup.as_dict each), set by the factory

    @abc.abstractmethod
    def sync(self, named_tensors: Iterable[tuple[str, torch.Tensor]], engines: Sequence, version: int,
             progress=None) -> SyncStats | None:
        """Delivers one complete version of the weights (Hugging Face names, full tensors) to
        every engine and drains this rank's part of the export. Returns transfer statistics on
        global rank 0 (None elsewhere); raises SyncError if any engine did not take the update,
        in which case that engine serves its previous version if no tensor reached its model, and
        is dirty (refuses to generate until a re-send commits) otherwise."""

    def close(self) -> None:
        """Releases the transport's sockets or groups."""


class Incoming(abc.ABC):
    """One sync as an engine worker receives it (made by :meth:`Receiver.open`)."""

    @abc.abstractmethod
    def stream(self, expected: dict[str, tuple[int, ...]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each (name, tensor) of the version as soon as it arrived; `expected`: the served
        checkpoint's names and shapes (anything else is a SyncError)."""

    def keep(self, loaded: bool) -> bool:
        """Whether to keep the version once this worker loaded it (`loaded`) or failed to."""
        return loaded

    def finish(self, error: Exception | None) -> None:
        """Reports the outcome to the trainer and lets go of what this sync alone used."""


@dataclasses.dataclass(frozen=True)
class Receiver(abc.ABC):
    """An engine worker's side of one sync, as plain data: the synchronizer makes it, the engine
    takes it through Ray (the run's secret travels in it, never over a weight socket) and hands
    it to each of its workers as a dict (:meth:`as_dict`; weight_sync.factory.receiver_of reads
    it back), where the vLLM loader asks it to :meth:`open` the stream. `kind` names the
    transport."""

    kind: ClassVar[str]
    version: int

    def as_dict(self) -> dict:
        return {"kind": self.kind, **dataclasses.asdict(self)}

    @abc.abstractmethod
    def open(self, worker_rank: int, state: dict) -> Incoming:
        """This worker's side of the sync; `state`: a dict the worker keeps from sync to sync
        (a transport may keep a connection or a group in it)."""


def timed(iterable, clock: list[float]):
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
