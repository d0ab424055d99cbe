"""`agentgym-mega bench train`: forward+backward tokens per second of the megatron actor
against Hugging Face transformers, same model and batch, at TP=1 and TP=2 on this machine.

Both sides compute the mean next-token negative log-likelihood of the batch and backpropagate it
(no optimizer step). Every process runs one torch thread: transformers and megatron TP=1 use one
core, TP=2 two ranks of one core each. (On a shared 2-core machine, two threads per process
measured up to 10x slower from oversubscription, which would compare schedulers, not code.)
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import torch

from agentgym_mega.models.tiny import TinySpec, make_tiny_model


@dataclasses.dataclass
class BenchSpec:
    batch: int = 4
    seq: int = 256
    # Steps of ~0.4 s: 2 warm-up and 5 timed steps read megatron 0.84-0.90 of transformers and 5
    # and 10 read 0.90-0.94 on the same code (its first steps still allocate).
    warmup: int = 5
    iters: int = 10
    threads: int = 1  # per process
    model: TinySpec = dataclasses.field(
        default_factory=lambda: TinySpec(arch="qwen2", layers=4, hidden=256, heads=8, kv_heads=2, vocab=2048))


def _batch(spec: BenchSpec, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (spec.batch, spec.seq), generator=torch.Generator().manual_seed(0))


def _timed(step, spec: BenchSpec) -> float:
    """Tokens per second over ``iters`` calls of ``step`` after ``warmup`` calls."""
    for _ in range(spec.warmup):
        step()
    start = time.perf_counter()
    for _ in range(spec.iters):
        step()
    return spec.batch * spec.seq * spec.iters / (time.perf_counter() - start)


def hf_tokens_per_s(hf_dir: str, spec: BenchSpec) -> float:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(spec.threads)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.train()
    ids = _batch(spec, model.config.vocab_size)

    def step():
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()

    return _timed(step, spec)


def megatron_tokens_per_s(hf_dir: str, tp: int, spec: BenchSpec) -> float:
    """Runs on each of ``tp`` ranks; every rank returns the same (rank 0's clock decides)."""
    from agentgym_mega import platform
    from agentgym_mega.config import validate
    from agentgym_mega.models.actor import MegatronActor, token_logprobs_and_entropy

    platform.init_distributed(tp=tp, pp=1, seed=0)
    actor = MegatronActor(hf_dir, validate({"parallel": {"world_size": tp, "tp": tp}}))
    vocab = actor.hf_config.vocab_size
    ids = _batch(spec, vocab)

    def head(logits, mb):
        logp, _ = token_logprobs_and_entropy(logits, mb["input_ids"], vocab)
        return -logp[:, 1:].mean(), {}

    def step():
        actor.zero_grad()
        actor.run({"input_ids": ids}, head, forward_only=False)

    return _timed(step, spec)


def run(spec: BenchSpec | None = None) -> dict:
    from agentgym_mega.platform.local_ranks import run_on_local_ranks

    spec = spec or BenchSpec()
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = make_tiny_model(os.path.join(tmp, "model"), spec.model)
        hf = hf_tokens_per_s(hf_dir, spec)
        megatron = {}
        for tp in (1, 2):
            megatron[f"tp{tp}"] = run_on_local_ranks(
                megatron_tokens_per_s, tp, hf_dir, tp, spec, threads=spec.threads)[0]
    report = {
        "what": "forward+backward tokens/s, mean next-token NLL, fp32, CPU",
        "model": dataclasses.asdict(spec.model),
        "batch": spec.batch, "seq": spec.seq, "iters": spec.iters, "threads_per_process": spec.threads,
        "hf_tokens_per_s": round(hf, 1),
        "megatron_tokens_per_s": {k: round(v, 1) for k, v in megatron.items()},
        "ratio_megatron_over_hf": {k: round(v / hf, 3) for k, v in megatron.items()},
    }
    for layout, tps in report["megatron_tokens_per_s"].items():
        print(f"bench train: megatron {layout} {tps:.0f} tokens/s vs transformers {hf:.0f} tokens/s "
              f"(ratio {report['ratio_megatron_over_hf'][layout]:.2f})")
    return report
