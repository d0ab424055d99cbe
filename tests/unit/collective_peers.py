"""Process bodies for the collective-sync tests (spawned: they must be importable)."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

SECRET = "s" * 64


def model(stage: int = 0, scale: float = 1.0) -> list[tuple[str, torch.Tensor]]:
    """A stage's tensors: sizes that straddle buckets, two dtypes."""
    g = torch.Generator().manual_seed(stage)
    return [(f"stage{stage}.w{i}", (torch.randn(n, generator=g) * scale).to(dtype))
            for i, (n, dtype) in enumerate([(3000, torch.float32), (70, torch.bfloat16), (5000, torch.float32),
                                            (1, torch.float32)])]


def shapes(stages: int) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for s in range(stages) for name, t in model(s)}


def _client(port: int, world: int, timeout_s: float):
    return dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def _place(spec, rank: int) -> None:
    """One thread per process; on NCCL, a GPU per member (NCCL refuses two ranks on one GPU)."""
    torch.set_num_threads(1)
    if spec.backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())


def send(spec_dict: dict, stage: int, version: int, results, fail_after: int | None = None,
         secret: str = SECRET) -> None:
    from agentgym_mega.weight_sync.collective import CollectiveSender, GroupSpec

    spec = GroupSpec.of(spec_dict)
    _place(spec, 0)
    try:
        sender = CollectiveSender(spec, stage, _client(spec.stores[stage][1], spec.world, spec.timeout_s), secret)
    except Exception as exc:  # noqa: BLE001 - reported to the test (a member that never joined)
        results.put(("sender", stage, "error", f"{type(exc).__name__}: {exc}"))
        return
    tensors = model(stage)

    def source():
        for i, item in enumerate(tensors):
            if fail_after is not None and i == fail_after:
                raise RuntimeError("the gather failed")
            yield item

    from agentgym_mega.bench.sync import sent_since, tcp_bytes_sent

    before = tcp_bytes_sent()  # the kernel's count per connection, whatever call wrote the bytes
    try:
        stats = sender.push(source(), version)
        results.put(("sender", stage, "ok", {"bytes": stats.bytes, "buckets": stats.buckets,
                                              "sent": sent_since(before, tcp_bytes_sent())[0]}))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put(("sender", stage, "error", f"{type(exc).__name__}: {exc}"))


def receive(spec_dict: dict, rank: int, version: int, results, stages: int = 1, die_after: int | None = None,
            reject: bool = False, expect: int | None = None, secret: str = SECRET, absent: bool = False) -> None:
    """Receives a version, 'loads' it (checks bytes against model()), votes; `die_after`: exit
    abruptly after that many tensors; `reject`: the load fails (as a vLLM loader error would);
    `expect`: the version this receiver was told to expect, if not `version`; `absent`: never
    joins (an engine that hangs before its first sync)."""
    from agentgym_mega.weight_sync.collective import CollectiveReceiver, GroupSpec

    if absent:
        results.put(("receiver", rank, "absent", None))
        return
    spec = GroupSpec.of(spec_dict)
    _place(spec, rank)
    try:
        receiver = CollectiveReceiver(spec, rank, secret)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put(("receiver", rank, "error", f"{type(exc).__name__}: {exc}"))
        return
    reference = {name: t for s in range(stages) for name, t in model(s)}
    got, loaded, error = {}, False, None  # got: arrival order
    stream = receiver.stream(version if expect is None else expect, shapes(stages))
    try:
        for name, tensor in stream:
            got[name] = tensor.device.type == ("cuda" if spec.backend == "nccl" else "cpu") and torch.equal(
                tensor.cpu(), reference[name])
            if die_after is not None and len(got) == die_after:
                os._exit(3)
            if reject:
                raise ValueError("the loader refused a tensor")
        loaded = True
    except Exception as exc:  # noqa: BLE001 - reported to the test
        error = f"{type(exc).__name__}: {exc}"
    finally:
        stream.close()
    committed = receiver.vote(loaded)
    results.put(("receiver", rank, "ok" if committed else "rolled back",
                 {"equal": all(got.values()) and len(got) == len(reference), "error": error, "order": list(got)}))
