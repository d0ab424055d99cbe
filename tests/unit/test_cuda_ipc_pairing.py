"""CUDA IPC per GPU: each engine worker is paired with the trainer rank on its own GPU by device
UUID (pure), and two trainer ranks each feed the engine on their GPU through their own socket
(real processes, fake UUIDs, CPU tensors; the GPU path itself is in tests/gpu)."""

import multiprocessing as mp
import tempfile

import pytest

from agentgym_mega.network import host_rendezvous
from agentgym_mega.weight_sync import SyncError
from agentgym_mega.weight_sync.cuda_ipc import feeds
from tests.unit import cuda_ipc_ranks


@pytest.mark.parametrize("trainer,workers,expected", [
    (["G0", "G1", "G2", "G3"], ["G0", "G1"], [1, 1, 0, 0]),  # two engines of TP 1 on the first GPUs
    (["G0", "G1"], ["G1", "G0", "G1"], [1, 2]),  # two engines' workers sharing a GPU
    (["G0", "G0", "G1"], ["G0", "G1"], [1, 0, 1]),  # two ranks on one GPU: the lower feeds it
    (["G0", "G1"], [], [0, 0]),
])
def test_each_worker_is_fed_by_the_rank_on_its_gpu(trainer, workers, expected):
    assert feeds(trainer, workers, 1, cuda=True) == expected


def test_logical_devices_pair_across_nodes():
    # two nodes of two GPUs, colocated: each rank feeds the engine worker on its own GPU, on either node
    assert feeds(["0:0", "0:1", "1:0", "1:1"], ["1:1", "0:0"], 1, cuda=False) == [1, 0, 0, 1]


def test_a_worker_on_a_gpu_without_a_trainer_rank_is_named():
    with pytest.raises(SyncError, match="engine 1 worker 0 share\\(s\\) no GPU with a trainer rank"):
        feeds(["G0", "G1"], ["G1", "G7"], 1, cuda=True)


def test_a_process_without_a_device_is_named():
    with pytest.raises(SyncError, match="engine worker 0 has none"):
        feeds(["G0"], [None], 1, cuda=False)


def run(gpus, engine_gpus):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as directory:
        store, rendezvous = host_rendezvous()
        procs = [ctx.Process(target=cuda_ipc_ranks.job, args=(r, rendezvous, directory, gpus, engine_gpus, results))
                 for r in range(len(gpus) if gpus else 1)]
        for p in procs:
            p.start()
        out = {}
        for _ in procs:
            rank, status, stats, got, socket = results.get(timeout=120)
            out[rank] = (status, stats, got, socket)
        for p in procs:
            p.join(timeout=30)
    del store  # the rendezvous is held until every rank is done
    return out


def test_two_ranks_each_feed_the_engine_on_their_own_gpu():
    out = run(["GPU-a", "GPU-b"], ["GPU-b", "GPU-a"])
    status, stats, got, socket = out[0]
    assert status == "ok" and out[1][0] == "ok", out
    model_bytes = sum(t.numel() * t.element_size() for _, t in cuda_ipc_ranks.MODEL)
    assert stats == (2, model_bytes)  # two workers, each sent the whole model by its own rank
    assert got == [{"a": True, "b": True}] * 2
    assert socket and out[1][3]  # each rank bound the socket named by its own GPU's UUID
    assert out[1][1] is None  # ranks > 0 report nothing


def test_a_worker_without_a_trainer_rank_on_its_gpu_fails_the_sync_on_every_rank():
    out = run(["GPU-a", "GPU-b"], ["GPU-c"])
    assert all(status == "error" and "no GPU with a trainer rank" in stats
               for status, stats, _, _ in out.values()), out
