"""The interface every inference backend implements, in token ids end to end.

The rollout manager keeps the exact ids an engine sampled (never re-tokenised text) and the
log-probs the engine assigned them, so a backend takes token-id prompts and returns token ids.
"""

from __future__ import annotations

import abc
import dataclasses

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
        takes; an aborted call returns []."""

    @abc.abstractmethod
    def abort(self, key: str) -> None:
        """Stops the generate call named `key` (one whose caller gave up on it, e.g. at an
        episode's wall-clock limit), freeing its share of the running batch; an abort that
        arrives before its call starts the call at once."""

    @abc.abstractmethod
    def receive_weights(self, receiver: Receiver) -> int:
        """Takes a complete new version of the weights into every worker of the engine, as
        `receiver` describes it (made by the trainer's synchronizer: the transport, where, the
        version and the run's secret, which arrives through Ray, never over a weight socket), and
        swaps it in all-or-nothing; returns the version now served. On failure the engine serves
        its previous weights."""

    @abc.abstractmethod
    def device_uuids(self) -> list[str | None]:
        """The physical GPU (CUDA device UUID) of each of the engine's workers, None on CPU:
        CUDA IPC pairs each worker with the trainer rank on the same GPU."""

    @abc.abstractmethod
    def sleep(self) -> None:
        """Releases accelerator memory (weights, KV cache) while the trainer uses the device."""

    @abc.abstractmethod
    def wake(self, tags: tuple[str, ...] | None = None) -> None:
        """Takes the memory back before generation: all of it, or only `tags` ("weights" before
        a weight sync, "kv_cache" after it, so the trainer's memory is gone before the cache
        grows back)."""

    @abc.abstractmethod
    def health(self) -> dict:
        """At least {"alive": bool, "version": int, "sleeping": bool, "running": int, "node": str,
        "node_id": str}; "running" is how many requests it is generating, "node" the address
        trainers on other nodes reach it by (network.reachable_ip), "node_id" the Ray node it runs on
        (None outside Ray)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Ends the engine's processes."""
