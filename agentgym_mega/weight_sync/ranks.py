"""A sync that several trainer ranks send at once (the collective's stage senders, CUDA IPC's
sender on each GPU): global rank 0 tells the engines to receive, each sending rank pushes, every
rank drains its part of the export and learns every sender's outcome."""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from agentgym_mega.remote import call_async
from agentgym_mega.weight_sync.base import Receiver, SyncError, SyncStats


def gather_json(item, group=None) -> list:
    """Every rank's `item` (JSON data), in rank order: all_gather_object without pickles."""
    device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl"
              else torch.device("cpu"))
    world = dist.get_world_size(group)
    data = torch.frombuffer(bytearray(json.dumps(item).encode()), dtype=torch.uint8).to(device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device), group=group)
    lengths = [int(n.item()) for n in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    return [json.loads(bytes(o[:n].cpu().numpy())) for o, n in zip(out, lengths)]


def engine_name(engine, index: int) -> str:
    """An engine as an error names it: its place in the sync and its Ray actor id."""
    actor = getattr(engine, "_actor_id", None)
    return f"engine {index}" + (f" (actor {actor.hex()[:12]})" if actor is not None else "")


def ask_engines(engines: Sequence, method: str, timeout_s: float, *args) -> list:
    """`method(*args)` of every engine at once, each answer within `timeout_s`; an engine that
    does not answer is a SyncError naming it."""
    with ThreadPoolExecutor(max_workers=max(1, len(engines))) as pool:
        waits = [call_async(pool, e, method, *args) for e in engines]
        return [await_answer(wait, timeout_s, engine_name(engines[i], i), method) for i, wait in enumerate(waits)]


def await_answer(wait, timeout_s: float, who: str, method: str):
    try:
        return wait(timeout=timeout_s)
    except TimeoutError:
        raise SyncError(f"{who} did not answer {method} within {timeout_s:.0f} s (weight_sync.timeout_s)") from None


def engine_devices(engines: Sequence, timeout_s: float) -> list[list[str | None]]:
    """Each engine's workers' devices (topology)."""
    return ask_engines(engines, "device_uuids", timeout_s)


def engine_ids(engines: Sequence) -> tuple[str, ...]:
    """Who the engines are, to tell whether a sync goes to the same ones as the last (a group or
    a pairing built for them still holds)."""
    return tuple(e._actor_id.hex() if hasattr(e, "_actor_id") else f"local-{id(e)}" for e in engines)


@dataclasses.dataclass
class Outcome:
    stats: list[SyncStats]  # of every sender that got through
    senders_failed: bool  # known on every rank alike
    errors: list[str]  # the senders' and (on rank 0) the engines'


def sync_from_ranks(engines: Sequence, receiver: Callable[[int], Receiver],
                    push: Callable[[], SyncStats] | None, named_tensors, group=None,
                    timeout_s: float | None = None) -> Outcome:
    """`receiver(i)`: what rank 0 hands engine i's receive_weights, without waiting; `push`:
    this rank's sending (None on a rank that does not send). Every rank must call this. An
    engine that has not answered `timeout_s` after the senders finished is named as failed."""
    outcome, waits = None, []
    with ThreadPoolExecutor(max_workers=max(1, len(engines))) as pool:
        if dist.get_rank(group) == 0:
            waits = [call_async(pool, e, "receive_weights", receiver(i)) for i, e in enumerate(engines)]
        try:
            if push is not None:
                outcome = ("ok", dataclasses.asdict(push()))
        except Exception as exc:  # noqa: BLE001 - every rank learns it below
            outcome = ("error", f"{type(exc).__name__}: {exc}")
        finally:
            for _ in named_tensors:  # the export is collective: the other ranks still need this one
                pass
        outcomes = [o for o in gather_json(outcome, group) if o is not None]
        errors = [o[1] for o in outcomes if o[0] == "error"]
        senders_failed = bool(errors)
        for i, wait in enumerate(waits):
            try:
                await_answer(wait, timeout_s, engine_name(engines[i], i), "receive_weights")
            except Exception as exc:  # noqa: BLE001 - each engine reports its own failure
                errors.append(f"{type(exc).__name__}: {exc}")
    return Outcome([SyncStats(**o[1]) for o in outcomes if o[0] == "ok"], senders_failed, errors)
