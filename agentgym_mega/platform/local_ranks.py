"""Runs a function on N local ranks (processes joined over env:// like torchrun would) and
returns each rank's result: for tests, benchmarks and tools run on one machine without torchrun."""

from __future__ import annotations

import os
import pickle
import tempfile

import torch
import torch.multiprocessing as mp

from agentgym_mega import platform
from agentgym_mega.network import free_port


def _rank_main(rank: int, world: int, port: int, threads: int, out: str, fn, args):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
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
        mp.spawn(_rank_main, args=(world, free_port(), threads, out, fn, args), nprocs=world)
        results = []
        for rank in range(world):
            with open(f"{out}.{rank}", "rb") as f:
                results.append(pickle.load(f))
    return results
