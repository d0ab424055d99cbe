"""A weight sync that an engine does not take: a dead engine is not waited for, a live one is
retried once; then it is taken out of rotation (weight_sync.on_engine_failure=drop) or the run
stops with an error naming it (stop). Either way every engine left serves the new version, and the
trainer goes on syncing."""

import pytest
import ray

from agentgym_mega.config import load_config
from agentgym_mega.stack import EngineSyncError, Stack

pytestmark = pytest.mark.slow  # an actor rank and two CPU vLLM engines: about a minute


def versions(stack: Stack) -> list[int]:
    return [h["version"] for h in ray.get([e.health.remote() for e in stack.engines])]


def test_a_dead_engine_stops_the_run_or_leaves_rotation_and_the_rest_stay_current(tiny_qwen2):
    cfg = load_config(None, [f"model.path={tiny_qwen2}", "model.dtype=float32", "algorithm.kl_coef=0.0",
                             "parallel.world_size=1", "parallel.tp=1", "parallel.sequence_parallel=false",
                             "rollout.num_engines=2", "rollout.max_model_len=512", "rollout.max_tokens_per_turn=64",
                             "cluster.placement=split", "weight_sync.timeout_s=15",
                             "weight_sync.on_engine_failure=stop"])
    with Stack.start(cfg, env=False) as stack:
        assert stack.sync_engines(1).receivers == 2 and versions(stack) == [1, 1]
        dead = stack.engines[1]
        ray.kill(dead)
        with pytest.raises(EngineSyncError, match=r"engine 1 did not take weights version 2 \(1 dead"):
            stack.sync_engines(2)
        assert ray.get(stack.engines[0].health.remote())["version"] == 2  # the live engine is current
        stack.cfg.weight_sync.on_engine_failure = "drop"
        stack.sync_engines(3)
        assert stack.engines == [stack.engines[0]] and dead not in stack.engines
        assert versions(stack) == [3] and stack.dropped_engines == 1
        assert stack.sync_engines(4).receivers == 1 and versions(stack) == [4]


@ray.remote
class VersionedEngine:
    """An engine's version bookkeeping alone, to make a live engine miss a sync on demand (the
    real engines above can only be made to fail by dying)."""

    def __init__(self):
        self.version = 0

    def health(self) -> dict:
        return {"version": self.version}

    def load(self, version: int) -> None:
        self.version = version

    def ping(self) -> None:
        pass


class MissingActor:
    """The actor group's sync, which leaves engine i behind `misses[i]` times."""

    def __init__(self, engines: list, misses: dict):
        self.misses = {engines[i]: n for i, n in misses.items()}
        self.calls: list[int] = []

    def sync_weights(self, engines: list, version: int) -> str:
        from agentgym_mega.weight_sync import SyncError

        self.calls.append(len(engines))
        missed = [e for e in engines if self.misses.get(e, 0)]
        for engine in engines:
            if engine in missed:
                self.misses[engine] -= 1
            else:
                ray.get(engine.load.remote(version))
        if missed:
            raise SyncError(f"{len(missed)} engine(s) did not take version {version}")
        return f"stats of {len(engines)}"


@pytest.fixture
def engines():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    handles = [VersionedEngine.remote() for _ in range(3)]
    ray.get([h.ping.remote() for h in handles])
    yield handles
    ray.shutdown()


def stack_with(engines: list, misses: dict, on_failure: str) -> Stack:
    stack = Stack(load_config(None, [f"weight_sync.on_engine_failure={on_failure}"]))
    stack.engines, stack.actor = list(engines), MissingActor(engines, misses)
    return stack


def test_an_engine_that_misses_once_is_retried_alone_and_catches_up(engines):
    stack = stack_with(engines, {1: 1}, "stop")
    assert stack.sync_engines(5) == "stats of 1"  # the retry's transfer
    assert stack.actor.calls == [3, 1] and versions(stack) == [5, 5, 5] and stack.dropped_engines == 0


@pytest.mark.parametrize("on_failure", ["drop", "stop"])
def test_an_engine_that_misses_twice_leaves_rotation_or_stops_the_run(engines, on_failure):
    stack = stack_with(engines, {2: 2}, on_failure)
    if on_failure == "stop":
        with pytest.raises(EngineSyncError, match=r"engine 2 did not take weights version 5 \(0 dead, the rest after a "
                                                  r"retry\); first error: .*1 engine\(s\) did not take version 5"):
            stack.sync_engines(5)
        return
    stack.sync_engines(5)
    assert stack.engines == engines[:2] and versions(stack) == [5, 5] and stack.dropped_engines == 1
