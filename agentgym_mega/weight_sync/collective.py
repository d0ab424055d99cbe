"""Weight sync over a collective: one process group per pipeline stage, joining that stage's
sending trainer rank and every engine worker, so the bytes leaving a sender do not grow with
the number of receivers. Only for engines on GPUs of their own (split placement): an engine on a
member's GPU would hold that GPU twice in one communicator, which NCCL refuses, so colocated
engines are fed per GPU instead (topology checks the groups before any is formed). A worker
receives the stages one after another (see CollectiveReceiver.stream), and a stage's sender
names the members that did not join in time.

Groups. Built from torch's own process-group classes (ProcessGroupGloo on CPU, ProcessGroupNCCL
on GPU) over a torch TCPStore that the stage's sender hosts, not through torch.distributed's
default group, which the trainer ranks (megatron) and the vLLM workers (vLLM) each already have.
Every rendezvous key sits under a prefix derived from the run's secret and the group's random id
(HMAC), and the secret reaches the engines through Ray only, so a peer without it can neither
read nor write the addresses the members exchange. The store itself is torch's: it listens on
every interface for as long as the group lives, like torch.distributed's own stores (keep nodes
on a private network, as for the trainer's own groups). Rank 0 is the sender; receivers follow in
the order given (the trainer lists engines by node, so a chain crosses each node boundary once).

Algorithms. ``broadcast``: the library's own; NCCL pipelines it along a ring, so the sender sends
each byte once. ``chain``: a pipelined relay over send/recv, chunk by chunk, each receiver
forwarding to the next. Used on gloo, whose broadcast is a binomial tree: its root sends the
payload once per subtree, so its bytes grow with the receivers (`bench sync --transport`).

Stream, per stage group, every message from rank 0 (a length, then that many bytes of JSON):

    BUCKET {specs of tensors it introduces, segments, nbytes}, then the bucket's nbytes
    ... the sender packs the next bucket while this one is in flight (two buffers) ...
    COMMIT {version, stage, tensors, bytes, proof: HMAC(secret, group id, stage, version)}

then a vote: an all-reduce (MIN) of every member's verdict, 1 when every tensor of every stage
arrived and loaded. A receiver commits the new version only when the vote is 1, so either every
engine in the group commits it or none does; after an error, a dead member (its peers' sends and
receives fail) or a 0, no engine serves the version: one that loaded tensors is dirty (refuses
to generate until a re-send commits), one that loaded none still serves its previous version.
A group that saw a failure is not reused.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import queue
import secrets
import threading
import time
from typing import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from agentgym_mega.weight_sync.auth import collective_key, collective_key_ok, secret_bytes
from agentgym_mega.weight_sync.base import STAGE, Incoming, Receiver, SyncError, SyncStats, WeightSynchronizer, timed
from agentgym_mega.weight_sync.buckets import TensorSpec, bucket_header, fill, pack
from agentgym_mega.weight_sync.ranks import engine_ids, gather_json, sync_from_ranks

CHUNK_BYTES = 4 << 20  # chain relay: a receiver forwards each chunk as soon as it arrived
MAX_HEADER_BYTES = 16 << 20  # a header lists a bucket's segments: far below this
_TAG = 7


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """Everything a member needs to join (plain data: it travels through Ray, with the secret)."""

    id: str  # random per group
    stores: tuple[tuple[str, int], ...]  # (host, port) of each stage sender's store
    world: int  # the sender and every receiver
    backend: str  # "gloo" or "nccl"
    algorithm: str  # "chain" or "broadcast"
    bucket_bytes: int
    timeout_s: float

    def __post_init__(self):
        if self.algorithm not in ("chain", "broadcast"):
            raise ValueError(f"collective sync algorithm {self.algorithm!r}: allowed chain, broadcast")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"collective sync backend {self.backend!r}: allowed gloo, nccl")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def of(cls, data: dict) -> "GroupSpec":
        return cls(**dict(data, stores=tuple(tuple(s) for s in data["stores"])))


def default_backend() -> tuple[str, str]:
    """(backend, algorithm) for this machine."""
    return ("nccl", "broadcast") if torch.cuda.is_available() else ("gloo", "chain")


def open_store(host: str, world: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store a stage's sender hosts, on a port the OS picks."""
    return dist.TCPStore(host, 0, world, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def _process_group(spec: GroupSpec, store, rank: int, stage: int, secret: bytes,
                   member_name: Callable[[int], str] = lambda rank: f"rank {rank}"):
    """This member's process group of `stage`; the sender (rank 0) first waits for every receiver
    to check in, so one that never comes is named instead of hanging torch's own rendezvous."""
    prefixed = dist.PrefixStore(collective_key(secret, "store", spec.id, stage) + "/", store)
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    prefixed.set(f"member/{rank}", "1")
    if rank == 0:
        keys = [f"member/{r}" for r in range(1, spec.world)]
        try:
            prefixed.wait(keys, timeout)
        except Exception:  # noqa: BLE001 - torch's store timeout: name who is missing instead
            missing = [member_name(r) for r in range(1, spec.world) if not prefixed.check([f"member/{r}"])]
            raise SyncError(f"weight-sync group of stage {stage}: {', '.join(missing) or 'a member'} did not join "
                            f"within {spec.timeout_s:.0f} s (weight_sync.timeout_s)") from None
    if spec.backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, spec.world, options)
    return dist.ProcessGroupGloo(prefixed, rank, spec.world, timeout)


def _device(spec: GroupSpec) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if spec.backend == "nccl" else torch.device("cpu")


class _Link:
    """One stage group seen from one member: moves byte tensors from rank 0 to everyone."""

    def __init__(self, pg, rank: int, spec: GroupSpec):
        self.pg, self.rank, self.spec = pg, rank, spec

    def shutdown(self) -> None:
        """Closes this member's connections now, so that peers blocked on it fail at once instead
        of at the group's timeout (a broken link is never used again)."""
        if self.pg is not None:
            try:
                self.pg.shutdown()
            except Exception:  # noqa: BLE001 - already broken
                pass
            self.pg = None

    def relay(self, data: torch.Tensor) -> list:
        """Rank 0 sends `data`, every other member receives it into `data`. Returns when a
        receiver's `data` is complete; the works returned (sends still in flight) must finish
        before `data` is written again."""
        if self.pg is None:
            raise SyncError("the collective link was shut after a failure")
        if self.spec.algorithm == "broadcast":
            options = dist.BroadcastOptions()
            options.rootRank = 0
            work = self.pg.broadcast([data], options)
            if self.rank == 0:
                return [work]
            work.wait()
            return []
        chunks = [data[o : o + CHUNK_BYTES] for o in range(0, data.numel(), CHUNK_BYTES)]
        last = self.rank == self.spec.world - 1
        if self.rank == 0:
            return [self.pg.send([c], 1, _TAG) for c in chunks]
        receives = [self.pg.recv([c], self.rank - 1, _TAG) for c in chunks]  # matched in order
        sends = []
        for chunk, work in zip(chunks, receives):
            work.wait()
            if not last:
                sends.append(self.pg.send([chunk], self.rank + 1, _TAG))
        return sends

    def send_header(self, header: dict) -> None:
        data = json.dumps(header).encode()
        size = torch.tensor([len(data)], dtype=torch.int64, device=_device(self.spec))
        body = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(_device(self.spec))
        for work in self.relay(size.view(torch.uint8)) + self.relay(body):
            work.wait()

    def recv_header(self) -> dict:
        size = torch.zeros(1, dtype=torch.int64, device=_device(self.spec))
        for work in self.relay(size.view(torch.uint8)):
            work.wait()
        n = int(size.item())
        if not 0 < n <= MAX_HEADER_BYTES:
            raise SyncError(f"malformed collective weight stream: a header of {n} bytes")
        body = torch.empty(n, dtype=torch.uint8, device=_device(self.spec))
        for work in self.relay(body):
            work.wait()
        try:
            header = json.loads(bytes(body.cpu().numpy()))
        except ValueError:
            header = None
        if not isinstance(header, dict):
            raise SyncError("malformed collective weight stream: a header is not a JSON object")
        return header

    def vote(self, ok: bool) -> bool:
        """True when every member voted ok; False when any voted no or the vote failed."""
        if self.pg is None:
            return False
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=_device(self.spec))
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        try:
            self.pg.allreduce([flag], options).wait()
        except Exception:  # a member died or the link broke: nobody may keep the version
            self.shutdown()
            return False
        return bool(flag.item())


# -- sender --------------------------------------------------------------------------------------


class CollectiveSender:
    """A stage's sending trainer rank (rank 0 of its stage group). Build it with the store it
    opened (see open_store) once every receiver was told to join; construction waits for them."""

    def __init__(self, spec: GroupSpec, stage: int, store, secret: str | bytes,
                 member_name: Callable[[int], str] = lambda rank: f"rank {rank}"):
        self.spec, self.stage = spec, stage
        self._secret = secret_bytes(secret)
        self._store = store  # kept alive with the group
        self.link = _Link(_process_group(spec, store, 0, stage, self._secret, member_name), 0, spec)
        device = _device(spec)
        self._buffers = [torch.empty(spec.bucket_bytes, dtype=torch.uint8, device=device) for _ in range(2)]

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
             progress: Callable[[int, int], None] | None = None) -> SyncStats:
        """Streams this stage's tensors, commits, and returns once every member voted; raises
        SyncError (and no receiver commits the version) if any did not take them."""
        start = time.perf_counter()
        source = [0.0]
        named_tensors = timed(named_tensors, source)
        in_flight: list[list] = [[], []]
        count = params = sent = buckets = 0
        try:
            for bucket in pack(named_tensors, self.spec.bucket_bytes, device=_device(self.spec)):
                slot = buckets % 2
                for work in in_flight[slot]:  # double buffering: this buffer's previous bucket is out
                    work.wait()
                nbytes = fill(self._buffers[slot], bucket)
                self.link.send_header(bucket_header("BUCKET", bucket, nbytes=nbytes))
                in_flight[slot] = self.link.relay(self._buffers[slot][:nbytes]) if nbytes else []
                count += len(bucket.specs)
                params += sum(s.numel for s in bucket.specs.values())
                sent, buckets = sent + nbytes, buckets + 1
                if progress:
                    progress(sent, buckets)
            for works in in_flight:
                for work in works:
                    work.wait()
        except Exception as exc:
            self._abort(exc)
            raise
        self.link.send_header({"op": "COMMIT", "version": version, "stage": self.stage, "tensors": count,
                               "bytes": sent, "proof": collective_key(self._secret, "commit", self.spec.id, self.stage,
                                                            version)})
        if not self.link.vote(True):
            raise SyncError(f"version {version} not taken: an engine worker failed or left during the sync "
                            f"(stage {self.stage}); no engine of the group commits it")
        return SyncStats(version, count, params, sent, buckets, self.spec.world - 1, time.perf_counter() - start,
                         source[0])


    def _abort(self, exc: Exception) -> None:
        """The tensors stopped coming (a failed gather, say): tells the receivers, so they give
        up the version now rather than at their timeout. Best effort: the link may be what failed."""
        try:
            self.link.send_header({"op": "ABORT", "message": f"{type(exc).__name__}: {exc}"[:1000]})
            self.link.vote(False)
        except Exception:  # noqa: BLE001 - the link itself broke: close it, so nobody waits on it
            self.link.shutdown()

    def close(self) -> None:
        self.link.shutdown()


# -- receiver ------------------------------------------------------------------------------------


class CollectiveReceiver:
    """An engine worker's membership in every stage group of a sync: call :meth:`stream` for a
    version's tensors, load them as they come, then :meth:`vote` whether they all loaded."""

    def __init__(self, spec: GroupSpec, rank: int, secret: str | bytes):
        if not 0 < rank < spec.world:
            raise SyncError(f"receiver rank {rank} outside the group of {spec.world}")
        self.spec, self.rank = spec, rank
        self._secret = secret_bytes(secret)
        self.links = []
        try:
            for stage, (host, port) in enumerate(spec.stores):
                store = dist.TCPStore(host, port, spec.world, is_master=False,
                                      timeout=datetime.timedelta(seconds=spec.timeout_s))
                self.links.append(_Link(_process_group(spec, store, rank, stage, self._secret), rank, spec))
        except Exception:
            self.close()  # the stages joined so far
            raise
        self._received_ok = False

    def stream(self, version: int, expected: dict[str, tuple[int, ...]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields every (name, tensor) of `version` as soon as it is complete, stage after stage;
        raises SyncError on a malformed or incomplete stream, a wrong version or commit proof, or
        a tensor the checkpoint (`expected`: name -> shape) does not have. If the consumer stops
        early, the stages are still drained to their COMMIT so the vote can run.

        One stage at a time, through one pair of buffers: NCCL promises no progress to
        operations on different communicators in flight at once, and a worker stages two
        buckets, not two per stage. Every member takes the stages in the same order, so a
        later stage's sender waits, it does not deadlock."""
        self._received_ok = False
        ready: queue.Queue = queue.Queue(maxsize=64)
        abandon = threading.Event()
        seen: set[str] = set()
        thread = threading.Thread(target=self._receive_stages, args=(version, expected, ready, abandon), daemon=True,
                                  name="agm-collective-stages")
        thread.start()
        try:
            done, error = 0, None
            while done < len(self.links):
                kind, payload = ready.get()
                if kind == "tensor":
                    name, tensor = payload
                    if name in seen:
                        error = error or SyncError(f"{name} arrived twice")
                        continue
                    seen.add(name)
                    if error is None:
                        yield name, tensor
                else:
                    done += 1
                    if kind == "error":
                        error = error or payload
            if error is not None:
                raise error
            missing = sorted(set(expected) - seen)
            if missing:
                raise SyncError(f"version {version} incomplete: {len(missing)} tensor(s) missing (e.g. {missing[0]})")
            self._received_ok = True
        finally:
            abandon.set()
            while thread.is_alive():  # let it drain every stage to its COMMIT
                try:
                    ready.get(timeout=0.05)
                except queue.Empty:
                    pass

    def _receive_stages(self, version: int, expected: dict, ready: queue.Queue, abandon: threading.Event) -> None:
        buffers = [torch.empty(self.spec.bucket_bytes, dtype=torch.uint8, device=_device(self.spec)) for _ in range(2)]
        for stage, link in enumerate(self.links):
            self._receive_stage(link, stage, version, expected, ready, abandon, buffers)

    def _receive_stage(self, link: _Link, stage: int, version: int, expected: dict, ready: queue.Queue,
                       abandon: threading.Event, buffers: list[torch.Tensor]) -> None:
        """Relays and unpacks one stage's stream. A bucket that cannot be used (a tensor the
        checkpoint lacks, a bad segment) fails the version but the stream is still relayed to
        its COMMIT, so members downstream and the vote are not left waiting."""
        device = _device(self.spec)
        in_flight: list[list] = [[], []]
        unpack = _Unpacker(expected, device)
        failure: Exception | None = None
        buckets = 0
        try:
            while True:
                header = link.recv_header()
                op = header.get("op")
                if op in ("COMMIT", "ABORT"):
                    break
                nbytes = header.get("nbytes") if op == "BUCKET" else None
                if not (isinstance(nbytes, int) and 0 <= nbytes <= self.spec.bucket_bytes):
                    raise SyncError(f"malformed collective weight stream: {op!r} with {nbytes!r} bytes")
                slot = buckets % 2
                for work in in_flight[slot]:  # double buffering: the bucket forwarded from here is out
                    work.wait()
                buffer = buffers[slot][:nbytes]
                in_flight[slot] = link.relay(buffer) if nbytes else []
                buckets += 1
                if failure is None:
                    try:
                        for name, tensor in unpack.bucket(header, buffer):
                            if not abandon.is_set():
                                ready.put(("tensor", (name, tensor)))
                    except (SyncError, KeyError, TypeError, ValueError, IndexError) as exc:
                        failure = exc if isinstance(exc, SyncError) else SyncError(
                            f"malformed collective weight stream: {type(exc).__name__}: {exc}")
            for works in in_flight:
                for work in works:
                    work.wait()
        except Exception as exc:  # noqa: BLE001 - the stream itself broke: nothing more comes over it
            link.shutdown()
            ready.put(("error", exc if isinstance(exc, SyncError) else
                       SyncError(f"stage {stage}'s stream broke: {type(exc).__name__}: {exc}")))
            return
        try:
            if op == "ABORT":
                raise SyncError(f"the trainer aborted version {version} on stage {stage}: {header.get('message')}")
            if failure is not None:
                raise failure
            if header.get("version") != version or header.get("stage") != stage:
                raise SyncError(f"stage {stage} committed version {header.get('version')} of stage "
                                f"{header.get('stage')}, this engine expects version {version}")
            if not collective_key_ok(self._secret, header.get("proof"), "commit", self.spec.id, stage, version):
                raise SyncError(f"stage {stage}'s commit carries no valid proof of the run's secret")
            unpack.check_complete(header.get("tensors"), stage)
            ready.put(("done", stage))
        except SyncError as exc:  # the stream is intact: the vote still runs over it
            ready.put(("error", exc))

    def vote(self, loaded: bool) -> bool:
        """Every member's verdict, on every stage group: True only when the whole version
        arrived and loaded everywhere. False means: the version is not committed, and an engine
        that loaded any of it is dirty until a re-send commits."""
        ok = loaded and self._received_ok
        results = [link.vote(ok) for link in self.links]
        return all(results)

    def close(self) -> None:
        for link in self.links:
            link.shutdown()


class _Unpacker:
    """Copies a stage's buckets out into one tensor each, handing a tensor over once complete."""

    def __init__(self, expected: dict[str, tuple[int, ...]], device: torch.device):
        self.expected, self.device = expected, device
        self.specs: dict[int, TensorSpec] = {}
        self.partial: dict[int, list] = {}  # index -> [bytes, how many arrived]
        self.count = 0

    def bucket(self, header: dict, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        for index, (name, dtype, shape) in header["specs"].items():
            spec = TensorSpec(name, dtype, tuple(shape))
            if name not in self.expected:
                raise SyncError(f"weight update rejected: {name} is not a tensor of the served checkpoint")
            if self.expected[name] != spec.shape:
                raise SyncError(f"weight update rejected: {name} has shape {spec.shape}, "
                                f"expected {self.expected[name]}")
            self.specs[int(index)] = spec
            self.partial[int(index)] = [torch.empty(spec.nbytes, dtype=torch.uint8, device=self.device), 0]
            self.count += 1
            if spec.nbytes == 0:  # no segment will come for it
                yield name, spec.view_of(self.partial.pop(int(index))[0])
        offset = 0
        for index, start, size in header["segments"]:
            data, got = self.partial[index]
            if start != got or size < 1 or got + size > data.numel() or offset + size > buffer.numel():
                raise SyncError(f"malformed collective weight stream: segment {start}+{size} of "
                                f"{self.specs[index].name}")
            data[start : start + size].copy_(buffer[offset : offset + size])
            self.partial[index][1] = got + size
            offset += size
            if got + size == data.numel():
                spec = self.specs[index]
                yield spec.name, spec.view_of(self.partial.pop(index)[0])

    def check_complete(self, tensors, stage: int) -> None:
        if self.partial or tensors != self.count:
            raise SyncError(f"stage {stage} incomplete: {self.count} of {tensors} tensors announced, "
                            f"{len(self.partial)} short")


def new_group_id() -> str:
    return secrets.token_hex(16)


@dataclasses.dataclass(frozen=True)
class CollectiveJoin(Receiver):
    """Join the stage groups of `group` (a GroupSpec as a dict) as rank `first_rank` + the worker's
    own rank, receive `version`, and keep it only if every member took it. The membership stays
    in the worker's state from sync to sync, until a failure or a new group."""

    kind = "collective"
    group: dict
    first_rank: int
    secret: str

    def open(self, worker_rank: int, state: dict) -> Incoming:
        spec = GroupSpec.of(self.group)
        member = state.get("collective")
        if member is None or member.spec.id != spec.id:
            if member is not None:
                member.close()
            state.pop("collective", None)
            member = state["collective"] = CollectiveReceiver(spec, self.first_rank + worker_rank, self.secret)
        return _Membership(member, self.version, state)


class _Membership(Incoming):
    def __init__(self, member: CollectiveReceiver, version: int, state: dict):
        self.member, self.version, self.state = member, version, state

    def stream(self, expected):
        return self.member.stream(self.version, expected)

    def keep(self, loaded: bool) -> bool:
        return self.member.vote(loaded)

    def finish(self, error: Exception | None) -> None:
        if error is not None:  # a group that saw a failure is never reused
            self.member.close()
            self.state.pop("collective", None)


class CollectiveWeightSynchronizer(WeightSynchronizer):
    """The trainer's side, on every trainer rank: all ranks call :meth:`sync` together (as they
    do the TP/PP gather that produces the tensors). The first TP rank of each pipeline stage in
    the first data-parallel replica (`stage` set) sends that stage's tensors over its own group;
    global rank 0 also tells the engines to receive. The groups are kept from sync to sync while
    the engines stay the same and nothing failed. `group`: the trainer's own process group, for
    the few objects the ranks exchange (store addresses, outcomes)."""

    export = STAGE

    def __init__(self, stage: int | None, host: str, secret: str, *, bucket_bytes: int, timeout_s: float,
                 workers_per_engine: int, group=None, backend: str | None = None, algorithm: str | None = None):
        default = default_backend()
        self.stage, self.host, self._secret = stage, host, secret
        self.bucket_bytes, self.timeout_s, self.workers_per_engine = bucket_bytes, timeout_s, workers_per_engine
        self.backend, self.algorithm = backend or default[0], algorithm or default[1]
        self.group = group
        self._members: tuple[str, ...] | None = None  # the engines the current groups join
        self._spec: GroupSpec | None = None
        self._sender: CollectiveSender | None = None

    def _member_name(self, rank: int) -> str:
        return f"engine {(rank - 1) // self.workers_per_engine} worker {(rank - 1) % self.workers_per_engine}"

    def sync(self, named_tensors, engines: Sequence, version: int, progress=None) -> SyncStats | None:
        """Returns the stats of every stage together on global rank 0, None elsewhere; raises
        SyncError on rank 0 when any engine did not take the version (then none did)."""
        members = engine_ids(engines)
        world = 1 + len(engines) * self.workers_per_engine
        rebuild = members != self._members
        store = open_store(self.host, world, self.timeout_s) if rebuild and self.stage is not None else None
        lead = dist.get_rank(self.group) == 0
        if rebuild:
            offers = gather_json({"id": new_group_id() if lead else None,
                                   "store": (self.stage, self.host, store.port) if store else None}, self.group)
            stores = sorted(tuple(o["store"]) for o in offers if o["store"])
            if [s[0] for s in stores] != list(range(len(stores))):
                raise SyncError(f"collective sync: expected one sender per pipeline stage, got stages "
                                f"{[s[0] for s in stores]}")
            self._spec = GroupSpec(offers[0]["id"], tuple((h, p) for _, h, p in stores), world, self.backend,
                                   self.algorithm, self.bucket_bytes, self.timeout_s)
            if self._sender is not None:  # the engines changed: the old group goes
                self._sender.close()
            self._sender = None

        def push() -> SyncStats:
            if self._sender is None:
                self._sender = CollectiveSender(self._spec, self.stage, store, self._secret, self._member_name)
            return self._sender.push(named_tensors, version, progress)

        spec = self._spec.as_dict()
        outcome = sync_from_ranks(
            engines, lambda i: CollectiveJoin(version, spec, 1 + i * self.workers_per_engine, self._secret),
            push if self.stage is not None else None, named_tensors, self.group, self.timeout_s)
        if outcome.senders_failed:
            if self._sender is not None:  # a group that failed is not reused
                self._sender.close()
            self._members, self._sender = None, None
        else:
            self._members = members
        if not lead:
            return None
        if outcome.errors:
            raise SyncError(f"version {version} not taken by the engines (none of them keeps it): {outcome.errors[0]}")
        stats = outcome.stats
        return SyncStats(version, sum(s.tensors for s in stats), sum(s.params for s in stats),
                         sum(s.bytes for s in stats), sum(s.buckets for s in stats), world - 1,
                         max(s.seconds for s in stats), max(s.source_seconds for s in stats))
