"""The interface every inference backend implements, in token ids end to end.

The rollout manager keeps the exact ids an engine sampled (never re-tokenised text) and the
log-probs the engine assigned them, so a backend takes token-id prompts and returns token ids.
"""

from __future__ import annotations

import abc
import dataclasses
import enum

from agentgym_mega.weight_sync.base import Receiver


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 512
    stop_token_ids: tuple[int, ...] = ()


@dataclasses.dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]  # log-prob of each sampled token under the sampling distribution
    version: int = 0  # the weights version that sampled it (weights change only between requests)


class Weights(str, enum.Enum):
    """What an engine's weights are: only a complete, committed version is served."""

    SERVING = "serving"  # a complete version (health's "version")
    DISCARDED = "discarded"  # slept without keeping them: the next weight sync brings a whole version
    DIRTY = "dirty"  # an update that did not commit wrote part of a version into them


class NotServing(RuntimeError):
    """generate() on an engine whose weights are not a complete version (Weights.DISCARDED or DIRTY)."""


class InferenceEngine(abc.ABC):
    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                 seeds: list[int] | None = None, max_tokens: list[int] | None = None,
                 key: str | None = None) -> list[Generation]:
        """One completion per prompt, in order; `seeds`: one sampling seed per prompt (the same
        prompt, weights and seed sample the same completion, whatever else the engine is
        generating), or None for the engine's own; `max_tokens`: a cap per prompt below
        `sampling.max_tokens` (what is left of its context). Safe to call from several threads at
        once: their requests are batched together. `key`: a name for this call that `abort`
        takes; an aborted call returns []. Raises NotServing unless the weights are a complete
        version (Weights.SERVING)."""

    @abc.abstractmethod
    def abort(self, key: str) -> None:
        """Stops the generate call named `key` (one whose caller gave up on it, e.g. at an
        episode's wall-clock limit), freeing its share of the running batch; an abort that
        arrives before its call starts the call at once."""

    @abc.abstractmethod
    def receive_weights(self, receiver: Receiver) -> int:
        """Takes a complete new version of the weights into every worker of the engine, as
        `receiver` describes it (made by the trainer's synchronizer: the transport, where, the
        version and the run's secret, which arrives through Ray, never over a weight socket);
        returns the version now served. On failure (SyncError) no full copy of the previous
        weights is kept to fall back on: an update that reached none of them leaves them serving,
        one that wrote any part leaves them Weights.DIRTY, and the engine refuses to generate
        until a later update commits a whole version (the trainer, which holds the weights,
        re-sends it). So no engine ever serves a mix of versions."""

    @abc.abstractmethod
    def device_uuids(self) -> list[str | None]:
        """The physical GPU (CUDA device UUID) of each of the engine's workers, None on CPU:
        CUDA IPC pairs each worker with the trainer rank on the same GPU."""

    @abc.abstractmethod
    def sleep(self, keep_weights: bool) -> None:
        """Releases accelerator memory (weights, KV cache) while the trainer uses the device.
        `keep_weights`: copy the weights to host memory and back at wake (vLLM's level 1), for
        an engine that must serve them again as they are (evaluation only, or started from the
        checkpoint it serves first); without it they are discarded (level 2: no copy either way),
        for an engine whose next weight sync rewrites every weight, and the engine refuses to
        generate until a sync commits. Weights that are not a complete version are never kept."""

    @abc.abstractmethod
    def wake(self, tags: tuple[str, ...] | None = None) -> None:
        """Takes the memory back before generation: all of it, or only `tags` ("weights" before
        a weight sync, "kv_cache" after it, so the trainer's memory is gone before the cache
        grows back)."""

    @abc.abstractmethod
    def take_host_copy_bytes(self) -> int:
        """Bytes copied device<->host or host<->host for the weights since the last call (then
        reset): sleep and wake, and weight-sync tensors received into host memory (sync/host_copy_bytes)."""

    @abc.abstractmethod
    def health(self) -> dict:
        """At least {"alive": bool, "version": int, "weights": Weights value, "sleeping": bool,
        "sleep_level": int, "running": int, "node": str, "node_id": str}; "version" is the latest
        version committed, served only while "weights" is "serving"; "sleep_level" the level of
        the latest sleep (0: never slept; 2: weights discarded); "running" is how many requests it
        is generating, "node" the address trainers on other nodes reach it by
        (network.reachable_ip), "node_id" the Ray node it runs on (None outside Ray)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Ends the engine's processes."""
