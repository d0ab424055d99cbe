"""Multi-turn episodes in bulk: one batched generate per round, one batched env step per server.

Token bookkeeping is the point of this module. The ids a rollout returns are exactly what the
engine saw and sampled: assistant tokens are kept as sampled (never re-tokenised from text), and
only the observation turns in between are tokenised here, with the model's own chat template.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from agentgym_mega.remote import call_async
from agentgym_mega.rollout.batch import Episode, TrajectoryBatch
from agentgym_mega.rollout.engines import SamplingConfig
from envs.environment import Task


def request_seed(seed: tuple[int, ...], episode: int, turn: int) -> int:
    """The sampling seed of one request: a hash of the collect's seed, the episode's position in
    it and the turn, so every sample draws its own stream and a repeated collect (a resumed run)
    draws the same ones whatever the engine sampled before."""
    digest = hashlib.blake2b(repr((tuple(seed), episode, turn)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF


@dataclasses.dataclass
class _Live:
    task: Task
    group_id: int
    engine: int
    index: int  # position in its collect()
    ids: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    turns: int = 0
    score: float = 0.0
    success: bool = False
    status: str | None = None  # set when the episode ends
    error: str | None = None

    def add(self, ids, sampled: bool, logprobs=None):
        self.ids += ids
        self.mask += [1 if sampled else 0] * len(ids)
        self.logprobs += logprobs if sampled else [0.0] * len(ids)


_REPLY = "\x00REPLY\x00"
# A finished exchange to render the template around: what follows it is the next turn's markup.
_PROBE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _REPLY}]


class ChatTurns:
    """Token pieces of a chat template around the sampled replies, found by rendering a probe
    conversation: the prompt of the first turn, what closes an assistant turn, and an
    observation turn up to the next assistant reply."""

    def __init__(self, tokenizer, instruction: str | None = None):
        self.tokenizer = tokenizer
        self.instruction = instruction
        closed = tokenizer.apply_chat_template(_PROBE, tokenize=False)
        self._close = closed[closed.rindex(_REPLY) + len(_REPLY):]  # e.g. "<|im_end|>\n"
        self._closed_probe = closed
        self.eos_id = tokenizer.eos_token_id
        self._eos_text = tokenizer.decode([self.eos_id])

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def first(self, observation: str) -> list[int]:
        content = f"{self.instruction}\n\n{observation}" if self.instruction else observation
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        return self._encode(text)

    def reply(self, text: str) -> list[int]:
        """A reply as the engine would sample it: its tokens, then the end-of-turn token."""
        return self._encode(text) + [self.eos_id]

    def after_reply(self, reply_ids: list[int], observation: str) -> list[int]:
        """Closes the assistant turn (the part the engine did not sample) and opens the next."""
        close = self._close
        if reply_ids and reply_ids[-1] == self.eos_id and close.startswith(self._eos_text):
            close = close[len(self._eos_text):]
        probe = self.tokenizer.apply_chat_template(
            _PROBE + [{"role": "user", "content": observation}], tokenize=False, add_generation_prompt=True
        )
        return self._encode(close + probe[len(self._closed_probe):])


def instruction_for(env_cfg) -> str | None:
    """The text opening every episode: `env.instruction` when set ("" for none), else the
    environment's own."""
    if env_cfg.instruction is not None:
        return env_cfg.instruction or None
    import envs

    return envs.instruction(env_cfg.name)


class RolloutManager:
    @classmethod
    def from_config(cls, cfg, engines: list, env, tokenizer) -> "RolloutManager":
        """The manager a run's config describes: its sampling, context limit and instruction
        (training and evaluation build theirs here, so both see the same episodes)."""
        sampling = SamplingConfig(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.max_tokens_per_turn)
        return cls(engines, env, tokenizer, sampling, cfg.rollout.max_model_len, instruction_for(cfg.env))

    def __init__(self, engines: list, env, tokenizer, sampling: SamplingConfig, max_model_len: int,
                 instruction: str | None = None):
        if not engines:
            raise ValueError("RolloutManager needs at least one engine")
        self.engines = engines
        self.env = env
        self.turns = ChatTurns(tokenizer, instruction)
        self.tokenizer = tokenizer
        stop = tuple(sorted(set(sampling.stop_token_ids) | {self.turns.eos_id}))
        self.sampling = dataclasses.replace(sampling, stop_token_ids=stop)
        self.max_model_len = max_model_len
        self._pool = ThreadPoolExecutor(len(engines))
        self._seed: tuple[int, ...] | None = None  # of the collect() running
        self.timings: dict[str, float] = {}  # seconds per phase of the last collect()


    def use_engines(self, engines: list) -> None:
        """The engines in rotation from the next round on (a failed engine taken out)."""
        if not engines:
            raise ValueError("RolloutManager needs at least one engine")
        self.engines = list(engines)
    def collect(self, tasks: list[Task], n_per_task: int, max_turns: int,
                seed: tuple[int, ...] | None = None) -> TrajectoryBatch:
        """Runs `n_per_task` episodes of every task, each capped at `max_turns` assistant turns.
        With a `seed` (e.g. (trainer seed, step)) every request is sampled with its own
        :func:`request_seed`: the same weights then give the same episodes."""
        self.timings = {"time/generate_s": 0.0, "time/env_s": 0.0}
        self._seed = seed
        live = [_Live(task, group, i % len(self.engines), i)
                for i, (group, task) in enumerate((g, t) for g, t in enumerate(tasks) for _ in range(n_per_task))]
        handles = self.env.create(len(live))
        try:
            for ep, result in zip(live, self.env.reset(handles, [ep.task.id for ep in live])):
                if "error" in result:
                    ep.status, ep.error = "env_error", result["error"]
                else:
                    ep.add(self.turns.first(result["observation"]), sampled=False)
            for turn in range(max_turns):
                running = [i for i, ep in enumerate(live) if ep.status is None]
                if not running:
                    break
                self._round([live[i] for i in running], [handles[i] for i in running], last=turn == max_turns - 1)
        finally:
            self.env.close(handles)
        return self._to_batch(live)

    def _generate(self, episodes: list[_Live]) -> list:
        """Every engine's share of the round at once; each episode stays on its engine so its
        growing prompt keeps hitting that engine's prefix cache."""
        groups: dict[int, list[int]] = {}
        for pos, ep in enumerate(episodes):
            groups.setdefault(ep.engine, []).append(pos)
        waits = []
        for engine, positions in groups.items():
            # One token budget per request batch: what is left of its fullest context.
            room = min(self.max_model_len - len(episodes[p].ids) for p in positions)
            sampling = dataclasses.replace(self.sampling, max_tokens=min(self.sampling.max_tokens, room))
            prompts = [episodes[p].ids for p in positions]
            seeds = (None if self._seed is None else
                     [request_seed(self._seed, episodes[p].index, episodes[p].turns) for p in positions])
            wait = call_async(self._pool, self.engines[engine], "generate", prompts, sampling, seeds)
            waits.append((positions, wait))
        out = [None] * len(episodes)
        for positions, wait in waits:
            for p, generation in zip(positions, wait()):
                out[p] = generation
        return out

    def _round(self, episodes: list[_Live], handles: list, last: bool) -> None:
        """One assistant turn for every running episode; on the `last` allowed turn an episode
        that is not done ends at the horizon (no observation is appended that nobody answers)."""
        for ep in episodes:
            if len(ep.ids) >= self.max_model_len:
                ep.status = "truncated"
        keep = [i for i, ep in enumerate(episodes) if ep.status is None]
        if not keep:
            return
        episodes, handles = [episodes[i] for i in keep], [handles[i] for i in keep]
        start = time.perf_counter()
        generations = self._generate(episodes)
        self.timings["time/generate_s"] += time.perf_counter() - start
        replies = []
        for ep, gen in zip(episodes, generations):
            ep.add(gen.token_ids, sampled=True, logprobs=gen.logprobs)
            ep.turns += 1
            replies.append(self.tokenizer.decode(gen.token_ids, skip_special_tokens=True))
        start = time.perf_counter()
        results = self.env.step(handles, replies)
        self.timings["time/env_s"] += time.perf_counter() - start
        for ep, gen, result in zip(episodes, generations, results):
            if "error" in result:
                ep.status, ep.error = "env_error", result["error"]
                continue
            # The server's episode score on [0, 1] and its own success verdict (a SciWorld step's
            # reward is only the score's change).
            ep.score, ep.success = float(result["episode_score"]), bool(result["success"])
            if result["done"] or last:
                ep.status = "done" if result["done"] else "horizon"
                continue
            ep.add(self.turns.after_reply(gen.token_ids, result["observation"]), sampled=False)
            if len(ep.ids) >= self.max_model_len:
                ep.status = "truncated"
                ep.ids, ep.mask, ep.logprobs = (x[: self.max_model_len] for x in (ep.ids, ep.mask, ep.logprobs))

    def _to_batch(self, live: list[_Live]) -> TrajectoryBatch:
        width = max(1, max(len(ep.ids) for ep in live))
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(live), width), pad, dtype=torch.long)
        attention, mask = torch.zeros(len(live), width, dtype=torch.long), torch.zeros(len(live), width)
        logprobs, rewards = torch.zeros(len(live), width), torch.zeros(len(live), width)
        for row, ep in enumerate(live):
            n = len(ep.ids)
            ids[row, :n] = torch.tensor(ep.ids, dtype=torch.long)
            attention[row, :n] = 1
            if ep.status != "env_error":  # a broken episode says nothing about the policy
                mask[row, :n] = torch.tensor(ep.mask, dtype=torch.float)
            logprobs[row, :n] = torch.tensor(ep.logprobs)
            trained = torch.tensor(ep.mask).nonzero()
            if len(trained):
                rewards[row, trained[-1, 0]] = ep.score  # terminal reward on the last assistant token
        episodes = [Episode(ep.task.id, ep.task.category, ep.group_id, ep.score, ep.success, ep.turns,
                            ep.status, sum(ep.mask), ep.error) for ep in live]
        return TrajectoryBatch(
            input_ids=ids, attention_mask=attention, loss_mask=mask, rollout_logprobs=logprobs,
            rewards=rewards, group_ids=torch.tensor([ep.group_id for ep in live]),
            scores=torch.tensor([ep.score for ep in live]), episodes=episodes,
        )
