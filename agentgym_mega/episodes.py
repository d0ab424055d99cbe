"""Episodes saved as text: `episodes/step_N.jsonl` under a run's output_dir, one JSON line per
episode, what `agentgym-mega report` and `agentgym-mega show` read.

A step's file holds the training episodes sampled at step N (`"split": "train"`, the batch's
first `logging.episodes.train_per_step`, every `train_every` steps) and every held-out episode of
the evaluation at step N (`"split": "eval"`; step 0 is the one before training). Each line:

    step, split, env, task_id, category, group (the task's index in its collect), sample (which of
    its samples), weight_version (the weights that sampled its first reply; -1: none sampled),
    status, score, success, error, rewards (one per turn), observation (the first), turns: [{text,
    action (what the env server read from the reply), valid_action, action_error (why it was not
    an action), observation (the env's answer), reward, tokens, observation_tokens, generate_s,
    env_s}], tokens: {prompt, response, total}, time_s

A step's lines are written once, whole, by a background thread (serialising and writing stay off
the training path), into a temporary file renamed over `step_N.jsonl`: a killed run leaves complete
files only, and a resumed run that redoes a step replaces its file rather than appending to it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

from agentgym_mega import files

SPLITS = ("train", "eval")


def episode_line(episode, step: int, split: str, env: str) -> dict:
    """One saved episode (a rollout.batch.Episode) as its JSON object."""
    transcript = episode.transcript or {}
    turns = transcript.get("turns", [])
    return {
        "step": step, "split": split, "env": env, "task_id": episode.task_id, "category": episode.category,
        "group": episode.group_id, "sample": transcript.get("sample", 0),
        "weight_version": transcript.get("weight_version", -1), "status": str(episode.status),
        "score": episode.score, "success": episode.success, "error": episode.error,
        "rewards": [t.get("reward", 0.0) for t in turns], "observation": transcript.get("observation"),
        "turns": turns, "tokens": transcript.get("tokens", {}), "time_s": transcript.get("time_s"),
    }


class EpisodeWriter:
    """Collects a step's episodes (`add`) and writes them as one file (`flush`) on its own thread.
    `cfg` is the run's logging.episodes; past its `max_mb` nothing more is written (one warning)."""

    def __init__(self, output_dir: str, cfg, env: str):
        self.dir = os.path.join(output_dir, "episodes")
        self.cfg, self.env = cfg, env
        self._pending: dict[int, list] = {}  # step -> [(split, episodes)] not yet written
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="episode-writer")
        self._writes: list[Future] = []
        self._sizes = {name: os.path.getsize(os.path.join(self.dir, name))
                       for name in (os.listdir(self.dir) if os.path.isdir(self.dir) else []) if name.endswith(".jsonl")}
        self._warned = False
        self.write_s = 0.0  # the writer thread's seconds so far (serialising and writing)

    def add(self, step: int, split: str, episodes: list) -> None:
        """Keeps `episodes` of `step` for its file: all eval ones (with logging.episodes.eval), the
        first train_per_step train ones of every train_every-th step."""
        if split not in SPLITS:
            raise ValueError(f"split {split!r}: expected one of {', '.join(SPLITS)}")
        if split == "eval" and not self.cfg.eval:
            return
        if split == "train":
            every = self.cfg.train_every
            if not every or step % every:
                return
            episodes = episodes[: self.cfg.train_per_step]
        if episodes:
            self._pending.setdefault(step, []).append((split, list(episodes)))

    def flush(self, step: int) -> None:
        """Hands step `step`'s episodes to the writer thread (nothing when none were kept)."""
        parts = self._pending.pop(step, None)
        self._report_failures()
        if parts:
            self._writes.append(self._thread.submit(self._write, step, parts))

    def close(self) -> None:
        """Waits for the files handed over so far."""
        for step in sorted(self._pending):
            self.flush(step)
        self._thread.shutdown(wait=True)
        self._report_failures()

    def _report_failures(self) -> None:
        """A failed write (a full disk) is a warning, not the end of the run: episodes are a view of it."""
        for future in [f for f in self._writes if f.done()]:
            self._writes.remove(future)
            if future.exception() is not None:
                print(f"warning: saving episodes failed: {future.exception()}", file=sys.stderr)

    def _write(self, step: int, parts: list) -> None:
        start = time.perf_counter()
        text = "".join(json.dumps(episode_line(e, step, split, self.env)) + "\n"
                       for split, episodes in parts for e in episodes)
        name = f"step_{step}.jsonl"
        cap = self.cfg.max_mb * 1e6
        if cap and sum(self._sizes.values()) - self._sizes.get(name, 0) + len(text.encode()) > cap:
            if not self._warned:
                print(f"warning: {self.dir} reached logging.episodes.max_mb={self.cfg.max_mb:g}; no more episodes "
                      f"are saved from step {step} on", file=sys.stderr)
                self._warned = True
            return
        os.makedirs(self.dir, exist_ok=True)
        files.write_text_atomic(os.path.join(self.dir, name), text)
        self._sizes[name] = len(text.encode())
        self.write_s += time.perf_counter() - start
