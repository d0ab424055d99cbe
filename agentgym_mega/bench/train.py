"""`agentgym-mega bench train`: forward+backward tokens per second of the megatron actor
against Hugging Face transformers, same model and batch, at TP=1 and TP=2 on this machine; on a
tiny model built for it, or on a given Hugging Face directory (a real model's shape and weights,
at the TP sizes its heads split over).

Both sides compute the mean next-token negative log-likelihood of the batch and backpropagate it
(no optimizer step). Every process runs one torch thread: transformers and megatron TP=1 use one
core, TP=2 two ranks of one core each. (On a shared 2-core machine, two threads per process
oversubscribe the cores and slow down many times over, which would compare schedulers, not code.)

Each side runs in a fresh process, in alternating rounds (transformers, TP=1, TP=2, then again),
and a side's figure comes from the median of its timed steps over all rounds. One round of 10
mean-timed steps is a window of seconds, and on a shared machine its reading drifts by more than
the differences being measured (docs/results.md). The ratio of each round is reported too.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time

import torch

from agentgym_mega import platform
from agentgym_mega.config import validate
from agentgym_mega.models import gpt, mapping
from agentgym_mega.models.tiny import TinySpec, make_tiny_model
from agentgym_mega.platform.local_ranks import run_on_local_ranks

# transformers and megatron (through models.actor) are imported inside each side's function: each
# side is timed in a process of its own, which then loads only its own framework.


@dataclasses.dataclass
class BenchSpec:
    batch: int = 4
    seq: int = 256
    # megatron's first steps still allocate, so 2 warm-up steps read lower than 5
    # (docs/results.md).
    warmup: int = 5
    iters: int = 10
    rounds: int = 3
    threads: int = 1  # per process
    model: TinySpec = dataclasses.field(
        default_factory=lambda: TinySpec(arch="qwen2", layers=4, hidden=256, heads=8, kv_heads=2, vocab=2048))
    model_dir: str | None = None  # a Hugging Face directory measured instead of a tiny model built from `model`
    tps: tuple[int, ...] = (1, 2)  # the megatron layouts


def geometry(model_dir: str) -> mapping.Geometry:
    from transformers import AutoConfig

    return mapping.Geometry.of(AutoConfig.from_pretrained(model_dir), padded_vocab=0)


def _shape(geo: mapping.Geometry) -> dict:
    return {k: v for k, v in dataclasses.asdict(geo).items() if k != "padded_vocab"}


def splits(geo: mapping.Geometry, tps: tuple[int, ...] = (1, 2)) -> tuple[tuple[int, ...], dict[str, str]]:
    """The TP sizes of ``tps`` this model splits over, and why each other one does not."""
    kept, refused = [], {}
    for tp in tps:
        try:
            gpt.check_split(geo.layers, geo.heads, geo.kv_heads, geo.ffn, tp=tp, pp=1)
            kept.append(tp)
        except mapping.MappingError as exc:
            refused[f"tp{tp}"] = str(exc)
    return tuple(kept), refused


def _batch(spec: BenchSpec, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (spec.batch, spec.seq), generator=torch.Generator().manual_seed(0))


def _timed(step, spec: BenchSpec) -> list[float]:
    """Seconds of each of ``iters`` calls of ``step`` after ``warmup`` calls."""
    for _ in range(spec.warmup):
        step()
    times = []
    for _ in range(spec.iters):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def hf_step_times(hf_dir: str, spec: BenchSpec) -> list[float]:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(spec.threads)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.train()
    ids = _batch(spec, model.config.vocab_size)

    def step():
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()

    return _timed(step, spec)


def megatron_step_times(hf_dir: str, tp: int, spec: BenchSpec) -> list[float]:
    """Runs on each of ``tp`` ranks (rank 0's clock is the one reported)."""
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


def run(spec: BenchSpec | None = None, left_out: dict[str, str] | None = None) -> dict:
    """The report. Its headline ratio compares whole layouts, so at TP=2 it sets two cores against
    transformers' one; the per-core figures (`cores`, `*_per_core`) divide each side by its cores.
    ``left_out``: the layouts not run, each with why (reported as given)."""
    spec = spec or BenchSpec()
    sides = {"hf": (hf_step_times, 1, ())} | {f"tp{tp}": (megatron_step_times, tp, (tp,)) for tp in spec.tps}
    times = {name: [] for name in sides}
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = spec.model_dir or make_tiny_model(os.path.join(tmp, "model"), spec.model)
        for _ in range(spec.rounds):
            for name, (fn, ranks, args) in sides.items():
                times[name].append(run_on_local_ranks(fn, ranks, hf_dir, *args, spec, threads=spec.threads)[0])
    tokens = spec.batch * spec.seq

    def tokens_per_s(steps: list[float]) -> float:
        return tokens / statistics.median(steps)

    hf = tokens_per_s([t for r in times["hf"] for t in r])
    megatron = {name: tokens_per_s([t for r in times[name] for t in r]) for name in sides if name != "hf"}
    cores = {name: ranks * spec.threads for name, (_, ranks, _) in sides.items()}
    per_core = {k: v / cores[k] for k, v in megatron.items()}
    report = {
        "what": "forward+backward tokens/s (median step), mean next-token NLL, fp32, CPU; ratio_megatron_over_hf "
                "sets tpN's N cores against transformers' 1, ratio_megatron_over_hf_per_core divides each by its cores",
        "model": ({"path": spec.model_dir, **_shape(geometry(spec.model_dir))} if spec.model_dir
                  else dataclasses.asdict(spec.model)),
        "left_out": left_out or {},
        "batch": spec.batch, "seq": spec.seq, "warmup": spec.warmup, "iters": spec.iters, "rounds": spec.rounds,
        "threads_per_process": spec.threads,
        "hf_tokens_per_s": round(hf, 1),
        "megatron_tokens_per_s": {k: round(v, 1) for k, v in megatron.items()},
        "ratio_megatron_over_hf": {k: round(v / hf, 3) for k, v in megatron.items()},
        "ratio_per_round": {k: [round(tokens_per_s(m) / tokens_per_s(h), 3) for m, h in zip(times[k], times["hf"])]
                            for k in megatron},
        "cores": cores,
        "megatron_tokens_per_s_per_core": {k: round(v, 1) for k, v in per_core.items()},
        "ratio_megatron_over_hf_per_core": {k: round(v / (hf / cores["hf"]), 3) for k, v in per_core.items()},
    }
    for layout, tps in report["megatron_tokens_per_s"].items():
        print(f"bench train: megatron {layout} {tps:.0f} tokens/s vs transformers {hf:.0f} tokens/s "
              f"(ratio {report['ratio_megatron_over_hf'][layout]:.2f} on {cores[layout]} core(s) vs {cores['hf']}, "
              f"{report['ratio_megatron_over_hf_per_core'][layout]:.2f} per core; rounds "
              f"{', '.join(f'{r:.2f}' for r in report['ratio_per_round'][layout])})")
    return report
