"""`agentgym-mega bench startup`: host memory and time of a rank's start-up, building its megatron
model shard and loading it from a Hugging Face directory, at TP=1 and TP=2.

Each rank measures what the start-up itself adds: its peak resident memory (``VmHWM``, reset
just before through ``/proc/self/clear_refs``) minus its resident memory at that moment, after
the imports and the process group. The figure that matters at scale is the TP=2 rank's share of
the TP=1 load: a rank that built full-size matrices, or read whole HF tensors, would stay near 1.
"""

from __future__ import annotations

import os
import tempfile
import time

import torch

from agentgym_mega import platform
from agentgym_mega.config import validate
from agentgym_mega.models import gpt
from agentgym_mega.models.tiny import TinySpec, make_tiny_model
from agentgym_mega.platform.local_ranks import run_on_local_ranks

# megatron (through models.actor) is imported in the ranks, not in the process that spawns them.

# ~95M parameters (380 MB in fp32): weights, not the interpreter, dominate a rank's memory.
MODEL_100M = TinySpec(arch="llama", layers=12, hidden=768, heads=12, kv_heads=4, vocab=8192, init_std=0.02)


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def _reset_peak() -> None:
    """Linux: writing 5 to clear_refs resets the peak resident set size (VmHWM) to the current."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def rank_start_up(hf_dir: str, tp: int, trainable: bool) -> dict:
    """On each of ``tp`` ranks: builds and loads the actor, returns this rank's figures in MB."""
    from agentgym_mega.models.actor import MegatronActor

    platform.init_distributed(tp=tp, pp=1, seed=0)
    gpt.load_hf_config(hf_dir)  # transformers' config classes: an import, not the load
    cfg = validate({"parallel": {"world_size": tp, "tp": tp}, "model": {"dtype": "float32"}})
    cuda = platform.has_cuda()
    if cuda:
        torch.zeros(1, device=platform.device())  # the CUDA context's host memory is not the model's
    _reset_peak()
    before = _status_mb("VmRSS")
    start = time.perf_counter()
    actor = MegatronActor(hf_dir, cfg, trainable=trainable)
    seconds = time.perf_counter() - start
    params = list(actor.model.parameters())
    return {"load_mb": _status_mb("VmHWM") - before,
            "params_mb": sum(p.numel() * p.element_size() for p in params) / 2**20,
            "rss_before_mb": before, "seconds": seconds,
            # where the shard lives: on a GPU, on the device and nowhere on the host
            "device_mb": torch.cuda.memory_allocated() / 2**20 if cuda else 0.0,
            "on_device": all(p.device.type == platform.device().type for p in params)}


def measure(hf_dir: str, tp: int, trainable: bool = False) -> list[dict]:
    """:func:`rank_start_up` on ``tp`` local ranks; one dict per rank."""
    return run_on_local_ranks(rank_start_up, tp, hf_dir, tp, trainable)


def run(model: str | None = None, trainable: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = model or make_tiny_model(os.path.join(tmp, "model"), MODEL_100M)
        single, pair = measure(hf_dir, 1, trainable), measure(hf_dir, 2, trainable)
    full = single[0]["load_mb"]
    return {"model": model or "tiny llama, ~95M parameters, fp32", "trainable": trainable,
            "tp1": single[0], "tp2": pair, "tp2_share_of_tp1": max(r["load_mb"] for r in pair) / full}
