"""Generation throughput through our engine wrapper versus vLLM's AsyncLLM called directly.

Both paths drive the same vLLM instance with the same token-id requests and sampling seed, in
alternating rounds with the prefix cache reset before each, so the difference is the wrapper's
own cost (building requests, unpacking ids and log-probs)."""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time

from agentgym_mega.models.tiny import TinySpec, make_tiny_model
from agentgym_mega.rollout.engines import SamplingConfig
from agentgym_mega.rollout.engines.vllm_engine import VLLMEngine

# vLLM is imported where the direct AsyncLLM side needs it: bench rollout imports this module for
# its prefix-cache helper alone.


def reset_prefix_cache(engine) -> None:
    """Empties `engine`'s (a VLLMEngine) prefix cache, so a timed run cannot reuse the KV blocks
    of the run before it: each run starts from the same cold cache, whatever ran earlier."""
    engine.run(engine.llm.reset_prefix_cache())


def run(model: str | None, prompts: int, prompt_len: int, max_tokens: int, rounds: int) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind


    with tempfile.TemporaryDirectory() as tmp:
        model = model or make_tiny_model(f"{tmp}/tiny", TinySpec())
        engine = VLLMEngine(model, max_model_len=prompt_len + max_tokens + 8)
        vocab = engine.llm.tokenizer.vocab_size
        requests = [[(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(prompt_len)] for i in range(prompts)]
        sampling = SamplingConfig(temperature=1.0, max_tokens=max_tokens)
        direct_params = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=0, logprobs=0,
                                       output_kind=RequestOutputKind.FINAL_ONLY)

        def wrapper() -> int:
            return sum(len(g.token_ids) for g in engine.generate(requests, sampling, [0] * len(requests)))

        async def one(i: int) -> int:
            async for out in engine.llm.generate({"prompt_token_ids": requests[i]}, direct_params, f"direct-{i}"):
                final = out
            return len(final.outputs[0].token_ids)

        async def every() -> int:
            return sum(await asyncio.gather(*(one(i) for i in range(len(requests)))))

        def direct() -> int:
            return engine.run(every())

        timings = {"wrapper": [], "direct": []}
        wrapper()  # warm-up
        for r in range(rounds):
            for name, fn in (("wrapper", wrapper), ("direct", direct))[:: 1 if r % 2 == 0 else -1]:
                reset_prefix_cache(engine)
                start = time.perf_counter()
                tokens = fn()
                timings[name].append(tokens / (time.perf_counter() - start))
    wrapper_tps, direct_tps = statistics.median(timings["wrapper"]), statistics.median(timings["direct"])
    return {
        "model": model if "tiny" not in model else "tiny-qwen2 (random init)",
        "prompts": prompts, "prompt_len": prompt_len, "max_tokens": max_tokens, "rounds": rounds,
        "wrapper_tokens_per_s": wrapper_tps,
        "direct_tokens_per_s": direct_tps,
        "overhead_pct": 100.0 * (direct_tps - wrapper_tps) / direct_tps,
        "samples_tokens_per_s": timings,
    }
