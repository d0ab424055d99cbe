"""Multi-turn episodes in bulk, in one of two modes (`rollout.mode`):

- lockstep: one batched generate per round for every running episode, then one batched env step
  per server; each round waits for its slowest generation and its slowest env step.
- async: every episode advances on its own thread: its env step is sent as soon as its
  generation returns, its next request goes to its engine (which batches whatever is in flight)
  as soon as the observation is back.

Both sample every request with the same seed and token budget, so for the same weights they
return the same trajectories.

Token bookkeeping is the point of this module. The ids a rollout returns are exactly what the
engine saw and sampled: assistant tokens are kept as sampled (never re-tokenised from text), and
only the observation turns in between are tokenised here, with the model's own chat template.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

import envs
from agentgym_mega.config import INSTRUCTION_ROLES
from agentgym_mega.remote import call_async
from agentgym_mega.rollout.batch import Episode, TrajectoryBatch
from agentgym_mega.rollout.engines import SamplingConfig
from agentgym_mega.rollout.env_client import TIMEOUT_STATUS, StepGroups
from agentgym_mega.rollout.status import UNTRAINED, Status
from envs.environment import Task

if TYPE_CHECKING:
    from agentgym_mega.config import Config


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
    max_turns: int
    sample: int = 0  # which of its task's samples
    ids: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)  # weights version per token, -1 unsampled
    turns: int = 0
    valid_actions: int = 0  # replies the env server parsed as an action
    score: float = 0.0
    success: bool = False
    status: Status | None = None  # set when the episode ends
    error: str | None = None
    deadline: float | None = None  # time.monotonic() past which it ends as Status.TIMEOUT; set at its first turn
    transcript: dict = dataclasses.field(default_factory=lambda: {"turns": [], "weight_version": -1})
    clock: float = 0.0  # perf_counter() when its last request went out, then when its last reply came back
    started: float | None = None  # perf_counter() at its first request
    ended: float | None = None  # perf_counter() at its last env answer

    def add(self, ids, sampled: bool, logprobs=None, version: int = -1):
        self.ids += ids
        self.mask += [1 if sampled else 0] * len(ids)
        self.logprobs += logprobs if sampled else [0.0] * len(ids)
        self.versions += [version if sampled else -1] * len(ids)


_REPLY = "\x00REPLY\x00"
# A finished exchange to render the template around: what follows it is the next turn's markup.
_PROBE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _REPLY}]


MODES = ("lockstep", "async")
MAX_EPISODE_THREADS = 512  # an async collect's episodes in flight at once; more wait their turn


class BusyClock:
    """Wall time during which at least one call of each key is in flight (an engine generating,
    an env server stepping), over overlapping calls from many threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open: dict[object, tuple[int, float]] = {}  # key -> (calls in flight, since)
        self.busy: dict[object, float] = {}

    def start(self, *keys) -> None:
        with self._lock:
            for key in keys:
                n, since = self._open.get(key, (0, time.perf_counter()))
                self._open[key] = (n + 1, since)

    def stop(self, *keys) -> None:
        with self._lock:
            for key in keys:
                n, since = self._open.pop(key)
                if n > 1:
                    self._open[key] = (n - 1, since)
                else:
                    self.busy[key] = self.busy.get(key, 0.0) + time.perf_counter() - since

    @contextlib.contextmanager
    def span(self, *keys):
        self.start(*keys)
        try:
            yield
        finally:
            self.stop(*keys)


class ChatTurns:
    """Token pieces of a chat template around the sampled replies, found by rendering a probe
    conversation: the prompt of the first turn, what closes an assistant turn, and an
    observation turn up to the next assistant reply. The instruction goes where
    `instruction_role` says: a system turn of its own, or ahead of the first observation in the
    first user turn. The probe starts with the same system turn, so templates that always render
    a system header (Llama-3.1's dates, Qwen2.5's default prompt) are cut at the same place."""

    def __init__(self, tokenizer, instruction: str | None = None, instruction_role: str = "user"):
        if instruction_role not in INSTRUCTION_ROLES:
            raise ValueError(f"instruction_role {instruction_role!r}: expected one of {', '.join(INSTRUCTION_ROLES)}")
        self.tokenizer = tokenizer
        self.instruction = instruction
        as_system = bool(instruction) and instruction_role == "system"
        self._system = [{"role": "system", "content": instruction}] if as_system else []
        self._inline = instruction if instruction and not as_system else None
        closed = tokenizer.apply_chat_template(self._system + _PROBE, tokenize=False)
        self._close = closed[closed.rindex(_REPLY) + len(_REPLY):]  # e.g. "<|im_end|>\n"
        self._closed_probe = closed
        if not self._next_turn("x").startswith(closed):  # after_reply cuts there
            raise ValueError("this chat template renders earlier turns differently once another turn follows, "
                             "so observation turns cannot be appended to the sampled ids")
        self.eos_id = tokenizer.eos_token_id
        self._eos_text = tokenizer.decode([self.eos_id])

    def _encode(self, text: str) -> list[int]:
        # The rendered text already holds the template's special tokens (a bos included): the
        # tokenizer must not add its own.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def first(self, observation: str) -> list[int]:
        content = f"{self._inline}\n\n{observation}" if self._inline else observation
        text = self.tokenizer.apply_chat_template(
            self._system + [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
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
        return self._encode(close + self._next_turn(observation)[len(self._closed_probe):])

    def _next_turn(self, observation: str) -> str:
        """The probe conversation with `observation` answering it, up to the next reply."""
        return self.tokenizer.apply_chat_template(
            self._system + _PROBE + [{"role": "user", "content": observation}], tokenize=False,
            add_generation_prompt=True,
        )


def instruction_for(env_cfg) -> str | None:
    """The text opening every episode: `env.instruction` when set ("" for none), else the
    environment's own (sent as `env.instruction_role` says)."""
    if env_cfg.instruction is not None:
        return env_cfg.instruction or None
    return envs.instruction(env_cfg.name)


class RolloutManager:
    @classmethod
    def from_config(cls, cfg: Config, engines: list, env, tokenizer) -> "RolloutManager":
        """The manager a run's config describes: its sampling, context limit, instruction, mode
        and time limits (training and evaluation build theirs here, so both see the same
        episodes)."""
        r = cfg.rollout
        sampling = SamplingConfig(r.temperature, r.top_p, r.max_tokens_per_turn)
        return cls(engines, env, tokenizer, sampling, r.max_model_len, instruction_for(cfg.env), mode=r.mode,
                   episode_timeout_s=r.episode_timeout_s, env_step_timeout_s=r.env_step_timeout_s,
                   env_group_window_s=r.env_group_window_ms / 1000, instruction_role=cfg.env.instruction_role)

    def __init__(self, engines: list, env, tokenizer, sampling: SamplingConfig, max_model_len: int,
                 instruction: str | None = None, mode: str = "async", episode_timeout_s: float | None = None,
                 env_step_timeout_s: float | None = None, env_group_window_s: float = 0.0,
                 instruction_role: str = "user"):
        if not engines:
            raise ValueError("RolloutManager needs at least one engine")
        if mode not in MODES:
            raise ValueError(f"rollout mode {mode!r}: expected one of {', '.join(MODES)}")
        self.engines = engines
        self.env = env
        self.turns = ChatTurns(tokenizer, instruction, instruction_role)
        self.tokenizer = tokenizer
        stop = tuple(sorted(set(sampling.stop_token_ids) | {self.turns.eos_id}))
        self.sampling = dataclasses.replace(sampling, stop_token_ids=stop)
        self.max_model_len = max_model_len
        self.mode = mode
        self.episode_timeout_s, self.env_step_timeout_s = episode_timeout_s, env_step_timeout_s
        self._steps = StepGroups(env, env_group_window_s)  # async episodes' steps, grouped per server
        # In-process engines run here: one thread per call in flight (an async collect has many).
        self._pool = ThreadPoolExecutor(MAX_EPISODE_THREADS)
        self._tokenizing = threading.Lock()  # one tokenizer shared by the episodes' threads
        self._seed: tuple[int, ...] | None = None  # of the collect() running
        self._clock = BusyClock()
        self.timings: dict[str, float] = {}  # the last collect(): seconds and the engines' busy share

    def use_engines(self, engines: list) -> None:
        """The engines in rotation from the next collect on (a failed engine taken out)."""
        if not engines:
            raise ValueError("RolloutManager needs at least one engine")
        self.engines = list(engines)

    def collect(self, tasks: list[Task], n_per_task: int, max_turns: int | list[int],
                seed: tuple[int, ...] | None = None) -> TrajectoryBatch:
        """Runs `n_per_task` episodes of every task, each capped at `max_turns` assistant turns
        (one cap for all, or one per task). With a `seed` (e.g. (trainer seed, step)) every
        request is sampled with its own :func:`request_seed`: the same weights then give the
        same episodes, in either mode."""
        caps = [max_turns] * len(tasks) if isinstance(max_turns, int) else list(max_turns)
        if len(caps) != len(tasks):
            raise ValueError(f"{len(caps)} turn caps for {len(tasks)} tasks")
        self._seed, self._clock = seed, BusyClock()
        engines = list(self.engines)
        live = [_Live(task, group, i % len(engines), i, caps[group], sample)
                for i, (group, task, sample) in enumerate((g, t, s) for g, t in enumerate(tasks)
                                                          for s in range(n_per_task))]
        start = time.perf_counter()
        handles = self.env.create(len(live))
        try:
            for ep, result in zip(live, self.env.reset(handles, [ep.task.id for ep in live])):
                if "error" in result:
                    ep.status, ep.error = Status.ENV_ERROR, result["error"]
                else:
                    ep.add(self.turns.first(result["observation"]), sampled=False)
                    ep.transcript |= {"observation": result["observation"], "prompt_tokens": len(ep.ids)}
            if self.mode == "async":
                with ThreadPoolExecutor(max(1, min(len(live), MAX_EPISODE_THREADS))) as episodes:
                    running = [episodes.submit(self._episode, engines, ep, h) for ep, h in zip(live, handles)]
                for done in running:
                    done.result()  # an engine's failure ends the collect, as in lockstep
            else:
                for _ in range(max(caps, default=0)):
                    running = [i for i, ep in enumerate(live) if ep.status is None]
                    if not running:
                        break
                    self._round(engines, [live[i] for i in running], [handles[i] for i in running])
        finally:
            self.env.close(handles)
        wall = max(time.perf_counter() - start, 1e-9)
        busy = self._clock.busy
        self.timings = {"time/generate_s": busy.get("generate", 0.0), "time/env_s": busy.get("env", 0.0),
                        "rollout/engine_busy_fraction":
                            sum(busy.get(e, 0.0) for e in range(len(engines))) / (len(engines) * wall)}
        return self._to_batch(live)

    # -- both modes ---------------------------------------------------------------------------
    def _ready(self, ep: _Live) -> bool:
        """Whether the episode takes another turn: not ended, not out of context, not past its
        wall-clock limit (which starts at its first turn: async episodes may wait for a thread)."""
        if ep.deadline is None:
            ep.deadline = time.monotonic() + self.episode_timeout_s if self.episode_timeout_s else math.inf
        if ep.status is None and len(ep.ids) >= self.max_model_len:
            ep.status = Status.TRUNCATED
        if ep.status is None and time.monotonic() >= ep.deadline:
            ep.status, ep.error = Status.TIMEOUT, f"the episode's {self.episode_timeout_s:g} s wall-clock limit passed"
        return ep.status is None

    def _request(self, ep: _Live) -> tuple[int | None, int]:
        """The episode's next request: its seed and its token budget (what is left of its context)."""
        seed = None if self._seed is None else request_seed(self._seed, ep.index, ep.turns)
        return seed, min(self.sampling.max_tokens, self.max_model_len - len(ep.ids))

    def _send(self, engines: list, engine: int, episodes: list[_Live], key: str | None = None):
        """Starts one engine's generate for `episodes` (named `key`, for an abort); returns its
        wait(timeout=None)."""
        seeds, budgets = zip(*(self._request(ep) for ep in episodes))
        seeds = None if self._seed is None else list(seeds)
        for ep in episodes:
            ep.clock = time.perf_counter()
            ep.started = ep.started or ep.clock
        wait = call_async(self._pool, engines[engine], "generate", [ep.ids for ep in episodes], self.sampling,
                          seeds, list(budgets), key=key)
        self._clock.start(engine, "generate")

        def finished(timeout=None):
            try:
                return wait(timeout)
            finally:
                self._clock.stop(engine, "generate")

        return finished

    def _take_reply(self, ep: _Live, generation) -> str:
        ep.add(generation.token_ids, sampled=True, logprobs=generation.logprobs, version=generation.version)
        ep.turns += 1
        with self._tokenizing:
            text = self.tokenizer.decode(generation.token_ids, skip_special_tokens=True)
        now = time.perf_counter()
        if not ep.transcript["turns"]:
            ep.transcript["weight_version"] = generation.version
        ep.transcript["turns"].append({"text": text, "tokens": len(generation.token_ids),
                                       "generate_s": round(now - ep.clock, 4)})
        ep.clock = now
        return text

    def _take_result(self, ep: _Live, generation, result: dict) -> None:
        """The env's answer to a turn; at the episode's turn cap an episode that is not done ends
        at the horizon (no observation is appended that nobody answers)."""
        ep.ended = time.perf_counter()
        _transcribe(ep.transcript["turns"][-1], result, ep.ended - ep.clock)
        if "error" in result:
            ep.status = Status.TIMEOUT if result.get("status") == TIMEOUT_STATUS else Status.ENV_ERROR
            ep.error = result["error"]
            return
        # The server's episode score on [0, 1] and its own success verdict (a SciWorld step's
        # reward is only the score's change).
        ep.score, ep.success = float(result["episode_score"]), bool(result["success"])
        ep.valid_actions += bool(result["valid_action"])
        if result["done"] or ep.turns >= ep.max_turns:
            ep.status = Status.DONE if result["done"] else Status.HORIZON
            return
        with self._tokenizing:
            added = self.turns.after_reply(generation.token_ids, result["observation"])
        ep.add(added, sampled=False)
        ep.transcript["turns"][-1]["observation_tokens"] = len(added)
        if len(ep.ids) >= self.max_model_len:
            ep.status = Status.TRUNCATED
            ep.ids, ep.mask, ep.logprobs, ep.versions = (x[: self.max_model_len] for x in
                                                         (ep.ids, ep.mask, ep.logprobs, ep.versions))

    def _env_step(self, handles: list, replies: list[str]) -> list[dict]:
        """A round's env step; rollout.env_step_timeout_s bounds each server's answer (the
        episodes' wall-clock limits are checked between rounds)."""
        with self._clock.span("env"):
            return self.env.step(handles, replies, timeout=self.env_step_timeout_s)

    # -- lockstep -----------------------------------------------------------------------------
    def _round(self, engines: list, episodes: list[_Live], handles: list) -> None:
        """One assistant turn for every running episode: every engine's share generated at once
        (each episode stays on its engine, so its growing prompt keeps hitting that engine's
        prefix cache), then one env step for all."""
        keep = [i for i, ep in enumerate(episodes) if self._ready(ep)]
        episodes, handles = [episodes[i] for i in keep], [handles[i] for i in keep]
        if not episodes:
            return
        by_engine: dict[int, list[_Live]] = {}
        for ep in episodes:
            by_engine.setdefault(ep.engine, []).append(ep)
        waits = [(group, self._send(engines, engine, group)) for engine, group in by_engine.items()]
        generations = {}
        for group, wait in waits:
            generations |= {id(ep): gen for ep, gen in zip(group, wait())}
        replies = [self._take_reply(ep, generations[id(ep)]) for ep in episodes]
        for ep, result in zip(episodes, self._env_step(handles, replies)):
            self._take_result(ep, generations[id(ep)], result)

    # -- async --------------------------------------------------------------------------------
    def _episode(self, engines: list, ep: _Live, handle) -> None:
        """One episode to its end on its own: generate, step, repeat."""
        while self._ready(ep):
            key = f"{uuid.uuid4().hex}-{ep.index}-{ep.turns}"
            wait = self._send(engines, ep.engine, [ep], key)
            try:
                generation = wait(None if ep.deadline == math.inf else max(ep.deadline - time.monotonic(), 0))[0]
            except TimeoutError:
                ep.status = Status.TIMEOUT
                ep.error = f"the episode's {self.episode_timeout_s:g} s wall-clock limit passed while generating"
                call_async(self._pool, engines[ep.engine], "abort", key)  # its tokens would only be thrown away
                return
            reply = self._take_reply(ep, generation)
            # rollout.env_step_timeout_s, and no longer than the episode's wall-clock limit leaves
            limit = min(self.env_step_timeout_s or math.inf, ep.deadline - time.monotonic())
            with self._clock.span("env"):
                result = self._steps.step(handle, reply, timeout=None if limit == math.inf else max(limit, 1e-3))
            self._take_result(ep, generation, result)

    def _to_batch(self, live: list[_Live]) -> TrajectoryBatch:
        width = max(1, max(len(ep.ids) for ep in live))
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(live), width), pad, dtype=torch.long)
        attention, mask = torch.zeros(len(live), width, dtype=torch.long), torch.zeros(len(live), width)
        logprobs, rewards = torch.zeros(len(live), width), torch.zeros(len(live), width)
        versions = torch.full((len(live), width), -1, dtype=torch.long)
        for row, ep in enumerate(live):
            n = len(ep.ids)
            ids[row, :n] = torch.tensor(ep.ids, dtype=torch.long)
            attention[row, :n] = 1
            if ep.status not in UNTRAINED:  # a broken or cut-off episode says nothing about the policy
                mask[row, :n] = torch.tensor(ep.mask, dtype=torch.float)
            logprobs[row, :n] = torch.tensor(ep.logprobs)
            versions[row, :n] = torch.tensor(ep.versions, dtype=torch.long)
            trained = torch.tensor(ep.mask).nonzero()
            if len(trained):
                rewards[row, trained[-1, 0]] = ep.score  # terminal reward on the last assistant token
        episodes = [Episode(ep.task.id, ep.task.category, ep.group_id, ep.score, ep.success, ep.turns,
                            ep.status, sum(ep.mask), ep.error, ep.valid_actions, _finished(ep)) for ep in live]
        return TrajectoryBatch(
            input_ids=ids, attention_mask=attention, loss_mask=mask, rollout_logprobs=logprobs,
            rewards=rewards, group_ids=torch.tensor([ep.group_id for ep in live]),
            scores=torch.tensor([ep.score for ep in live]), episodes=episodes, weight_versions=versions,
        )


def _transcribe(turn: dict, result: dict, env_s: float) -> None:
    """The env's answer to a turn, as its transcript keeps it: the action the server read from
    the reply (or why there was none), the observation and the reward."""
    if "error" in result:
        turn.update(action=None, valid_action=False, action_error=f"env error: {result['error']}", observation=None,
                    reward=0.0, observation_tokens=0, env_s=round(env_s, 4))
        return
    action, valid = result.get("action", ""), bool(result["valid_action"])
    why = None if valid else ("no action in the reply" if not action else "not an action this environment accepts")
    turn.update(action=action, valid_action=valid, action_error=why, observation=result.get("observation"),
                reward=float(result.get("reward", 0.0)), observation_tokens=0, env_s=round(env_s, 4))


def _finished(ep: _Live) -> dict:
    """An episode's transcript as saved episodes read it (agentgym_mega.episodes)."""
    prompt = ep.transcript.get("prompt_tokens", 0)
    ran = (ep.ended or ep.started or 0.0) - (ep.started or 0.0)
    return {**{k: v for k, v in ep.transcript.items() if k != "prompt_tokens"}, "sample": ep.sample,
            "tokens": {"prompt": prompt, "response": sum(ep.mask), "total": len(ep.ids)}, "time_s": round(ran, 4)}
