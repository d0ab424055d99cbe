"""Calling an object that may be a Ray handle or an in-process instance (an inference
engine in a test or a tool), the same way: rollout and weight sync both drive engines like this."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

# Ray is imported only when a Ray handle is called (a process holding one has loaded it): the
# in-process callers (tools, tests, `pretrain-tiny` through the rollout manager) never load it.


def call_async(pool: ThreadPoolExecutor, target, method: str, *args, **kwargs) -> Callable[..., object]:
    """Starts `target.method(*args, **kwargs)` without waiting; returns a function that waits for
    the result, `wait(timeout=None)`, raising TimeoutError past `timeout` seconds. A Ray
    handle runs it in its own process, an in-process object on `pool`."""
    bound = getattr(target, method)
    remote = getattr(bound, "remote", None)
    if remote is not None:
        import ray

        ref = remote(*args, **kwargs)
        return lambda timeout=None: ray.get(ref, timeout=timeout)  # GetTimeoutError is a TimeoutError
    return pool.submit(bound, *args, **kwargs).result
