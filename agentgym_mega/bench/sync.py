"""Weight sync throughput: megatron-core shards -> HF tensors -> ZMQ buckets -> a vLLM engine,
against the raw ZMQ rate of the same bytes measured in the same run, plus log-prob parity of
the engine with the trainer after the last sync.

As in training, a sync follows each optimizer step. The first sync into a fresh engine also pays
one-time costs (the engine allocates its staging memory, and vLLM's CPU kernels repack the
weights into newly allocated memory), so it is reported apart (`first_*`); `seconds` and `gbps`
are the median of the syncs after it, each carrying the new weights of another optimizer step.
The ceiling is the best of as many raw transfers, so the ratio is not flattered by one slow raw
run."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import time

import torch
import zmq

from agentgym_mega.rollout.engines import SamplingConfig
from agentgym_mega.weight_sync.zmq_transport import default_address

# ~104M parameters: 12 layers of hidden 768 with a 3072-wide MLP (the vocabulary is tiny).
BENCH_MODEL = dict(layers=12, hidden=768, heads=12, kv_heads=4, ffn=3072)


def _drain(address: str, frames: int, done) -> None:
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.connect(address)
    for _ in range(frames + 1):
        sock.recv(copy=False)
    done.set()


def raw_zmq_gbps(total_bytes: int, frame_bytes: int) -> float:
    """Zero-copy PUSH of `total_bytes` (distinct memory, like the weights) in frames of
    `frame_bytes` to another process over ipc://."""
    data = torch.ones(total_bytes, dtype=torch.uint8).numpy()
    frames = -(-total_bytes // frame_bytes)
    address = default_address()
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.bind(address)
    ctx = mp.get_context("spawn")
    done = ctx.Event()
    proc = ctx.Process(target=_drain, args=(address, frames, done))
    proc.start()
    sock.send(b"", copy=False)  # waits for the connection, untimed
    start = time.perf_counter()
    for i in range(frames):
        sock.send(data[i * frame_bytes : (i + 1) * frame_bytes], copy=False)
    done.wait()
    seconds = time.perf_counter() - start
    proc.join()
    sock.close(linger=0)
    shutil.rmtree(os.path.dirname(address.removeprefix("ipc://")), ignore_errors=True)  # default_address's directory
    return total_bytes / seconds / 1e9


def config(trained: str, tp: int, bucket_mb: int):
    """The run the benchmark starts: the actor at TP=`tp` holding `trained`, one engine, no env
    servers, no reference policy."""
    from agentgym_mega.config import load_config

    return load_config(None, [f"model.path={trained}", f"parallel.world_size={tp}", f"parallel.tp={tp}",
                              "model.dtype=float32", "trainer.lr=1e-4", "algorithm.kl_coef=0.0",
                              "rollout.max_model_len=512", "rollout.max_tokens_per_turn=64",
                              "weight_sync.transport=ipc", f"weight_sync.bucket_mb={bucket_mb}"])


def run(tp: int = 2, bucket_mb: int = 64, repeats: int = 3) -> dict:
    import statistics

    from agentgym_mega.models.tiny import TinySpec, make_tiny_model
    from agentgym_mega.stack import Stack

    with tempfile.TemporaryDirectory() as tmp:
        start_model = make_tiny_model(f"{tmp}/start", TinySpec(arch="qwen2", seed=0, **BENCH_MODEL))
        trained = make_tiny_model(f"{tmp}/trained", TinySpec(arch="qwen2", seed=1, **BENCH_MODEL))
        cfg = config(trained, tp, bucket_mb)
        # The trainer holds different weights than the engine started with, so the sync must
        # really move them for the log-probs to agree afterwards. The engine has started before
        # the first sync: the clock times the sync, not vLLM's start-up.
        with Stack.start(cfg, env=False, engine_model=start_model) as stack:
            actor, engine = stack.actor, stack.engines[0]
            first = actor.sync_weights([engine], 0)
            syncs = []
            for version in range(1, repeats + 1):
                actor.update(_random_batch(version), 1.0)  # new weights to send
                syncs.append(actor.sync_weights([engine], version))
            ceiling = max(raw_zmq_gbps(first.bytes, bucket_mb << 20) for _ in range(repeats))
            diff = _logprob_gap(actor, engine)
    stats = sorted(syncs, key=lambda s: s.seconds)[len(syncs) // 2]
    return {
        "model": f"qwen2 {BENCH_MODEL}", "trainer_tp": tp, "bucket_mb": bucket_mb, "repeats": repeats,
        "params": stats.params, "bytes": stats.bytes, "seconds": stats.seconds,
        "gbps": stats.gbps, "ceiling_gbps": ceiling, "fraction_of_ceiling": stats.gbps / ceiling,
        "all_seconds": [s.seconds for s in syncs],
        "gbps_spread": [min(s.gbps for s in syncs), max(s.gbps for s in syncs)],
        # Where the seconds went: producing tensors (the TP gather on the trainer ranks, which
        # overlaps streaming) and the engine's in-place reload after the last byte.
        "gather_seconds": stats.source_seconds, "engine_load_seconds": stats.load_seconds,
        "first_seconds": first.seconds, "first_gbps": first.gbps, "first_engine_load_seconds": first.load_seconds,
        "median_engine_load_seconds": statistics.median(s.load_seconds for s in syncs),
        "logprob_mean_abs_diff": diff.mean().item(), "logprob_max_abs_diff": diff.max().item(),
    }


def _random_batch(seed: int, size: int = 2, length: int = 32) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 500, (size, length), generator=g)
    return {"input_ids": ids, "loss_mask": torch.ones(size, length), "old_logprobs": torch.zeros(size, length),
            "advantages": torch.randn(size, length, generator=g)}


def _logprob_gap(actor, engine) -> torch.Tensor:
    """|vLLM - trainer| log-probs of the tokens the engine samples from a few prompts."""
    import ray

    prompts = [[1, 5, 9, 20, 33, 7], [1, 7, 7, 7], [1, 300, 12, 40]]
    generations = ray.get(engine.generate.remote(prompts, SamplingConfig(max_tokens=16), [0] * len(prompts)))
    width = max(len(p) + len(g.token_ids) for p, g in zip(prompts, generations))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for i, (p, g) in enumerate(zip(prompts, generations)):
        ids[i, : len(p) + len(g.token_ids)] = torch.tensor(p + g.token_ids)
        mask[i, len(p) : len(p) + len(g.token_ids)] = True
    megatron = actor.logprobs(ids, 1.0)[mask]
    return (megatron - torch.tensor([lp for g in generations for lp in g.logprobs])).abs()
