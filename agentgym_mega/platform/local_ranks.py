"""Runs a function on N local ranks (processes joined over env:// like torchrun would) and
returns each rank's result: for tests, benchmarks and tools run on one machine without torchrun."""

from __future__ import annotations

import os
import pickle
import tempfile

import torch
import torch.multiprocessing as mp

from agentgym_mega import platform
from agentgym_mega.network import host_rendezvous


def _rank_main(rank: int, world: int, rendezvous: dict, threads: int, out: str, fn, args):
    os.environ.update(rendezvous, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(threads)
    try:
        result = fn(*args)
        with open(f"{out}.{rank}", "wb") as f:
            pickle.dump(result, f)
    finally:
        platform.shutdown()


def run_on_local_ranks(fn, world: int, *args, threads: int = 1) -> list:
    """``fn(*args)`` on ``world`` spawned ranks; ``fn`` must be importable and its result
    picklable. Each rank calls :func:`agentgym_mega.platform.init_distributed` itself (inside ``fn``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        store, rendezvous = host_rendezvous()  # held here until every rank is done
        mp.spawn(_rank_main, args=(world, rendezvous, threads, out, fn, args), nprocs=world)
        del store
        results = []
        for rank in range(world):
            with open(f"{out}.{rank}", "rb") as f:
                results.append(pickle.load(f))
    return results
