"""`agentgym-mega bench rollout`: episodes per second, lockstep versus async, on a long-tailed
multi-turn workload.

The `mixed` workload: the CPU demo's three BabyAI levels, tasks in catalogue order, each with a
turn cap from CAPS in turn (so episodes end at different turns), played by the demo's tiny base
policy (pretrained first when missing) through a real BabyAI server and one vLLM engine. On
top of each env step's real cost, a stated latency: log-normal with a median of `latency_ms`
and sigma LATENCY_SIGMA, capped at LATENCY_CAP_S, drawn from (episode, turn), so both modes
meet the same delays. A batched step answers when its slowest item is done, as a server's
/batch does. Every mode runs the same tasks with the same seeds, `repeats` times in turn, each
run after vLLM's prefix cache is emptied (as `bench engine` does), so no mode reuses the prompts'
KV blocks of the run before it; the report gives the median and checks that the modes returned
the same tokens.
"""

from __future__ import annotations

import math
import random
import statistics
import time

import torch

from agentgym_mega.bench.engine import reset_prefix_cache
from agentgym_mega.bench.env import serving
from agentgym_mega.bench.learn import DEMO_CONFIG, ensure_base
from agentgym_mega.config import load_config
from agentgym_mega.rollout.engines.vllm_engine import VLLMEngine
from agentgym_mega.rollout.env_client import EnvClient
from agentgym_mega.rollout.manager import RolloutManager
from agentgym_mega.rollout.tasks import select_tasks

# transformers is imported where the tokenizer loads: its import takes seconds, and the unit
# tests import this module for its delayed env alone.

CAPS = (2, 4, 6, 10)
LATENCY_SIGMA = 1.0
LATENCY_CAP_S = 1.0


class DelayedEnv(EnvClient):
    """An EnvClient whose steps take `latency(episode, turn)` seconds more, the slowest of a batch."""

    def __init__(self, urls: list[str], median_s: float, seed: int = 0):
        super().__init__(urls)
        self.median_s, self.seed = median_s, seed
        self._episode: dict = {}  # handle -> its position at create()
        self._turn: dict = {}

    def latency(self, episode: int, turn: int) -> float:
        if self.median_s <= 0:
            return 0.0
        draw = random.Random(f"{self.seed}/{episode}/{turn}").gauss(0.0, LATENCY_SIGMA)
        return min(self.median_s * math.exp(draw), LATENCY_CAP_S)

    def create(self, n: int):
        handles = super().create(n)
        self._episode = {h: i for i, h in enumerate(handles)}
        self._turn = dict.fromkeys(handles, 0)
        return handles

    def step(self, handles, actions, timeout=None):
        delays = []
        for h in handles:
            self._turn[h] += 1
            delays.append(self.latency(self._episode[h], self._turn[h]))
        results = super().step(handles, actions, timeout)
        time.sleep(max(delays, default=0.0))
        return results


def run(modes: list[str], workload: str, tasks: int, n_per_task: int, latency_ms: float, repeats: int,
        model: str | None = None, group_window_ms: float | None = None) -> dict:
    """`group_window_ms`: async's rollout.env_group_window_ms (default: the config's)."""
    from transformers import AutoTokenizer


    if workload != "mixed":
        raise ValueError(f"unknown workload {workload!r}: mixed is the one there is")
    settings = [f"model.path={model}"] if model else []
    if group_window_ms is not None:
        settings.append(f"rollout.env_group_window_ms={group_window_ms}")
    demo = load_config(DEMO_CONFIG, settings)
    ensure_base(demo)
    rows, batches = {m: [] for m in modes}, {}
    with serving(["env-server", "--env", "babyai", "--max-instances", str(4 * tasks * n_per_task)]) as url:
        env = DelayedEnv([url], latency_ms / 1000)
        catalogue = env.tasks()
        chosen = select_tasks(catalogue, "train", None, demo.env.categories)
        # An equal share of each level, in catalogue order.
        by_level = [[t for t in chosen if t.category == c] for c in demo.env.categories]
        picked = [level[i] for i in range(tasks) for level in by_level][:tasks]
        caps = [CAPS[i % len(CAPS)] for i in range(len(picked))]
        engine = VLLMEngine(demo.model.path, max_model_len=demo.rollout.max_model_len)
        tokenizer = AutoTokenizer.from_pretrained(demo.model.path)
        try:
            managers = {}
            for mode in modes:  # the demo's rollout settings, in each mode
                demo.rollout.mode = mode
                managers[mode] = RolloutManager.from_config(demo, [engine], env, tokenizer)
            managers[modes[0]].collect(picked[:2], 1, 1, seed=(0, 0))  # warm-up
            for _ in range(repeats):
                for mode in modes:  # every mode meets a cold prefix cache, as the first one did
                    reset_prefix_cache(engine)
                    start = time.perf_counter()
                    batch = managers[mode].collect(picked, n_per_task, caps, seed=(0, 1))
                    wall = time.perf_counter() - start
                    rows[mode].append({"seconds": wall, "episodes_per_s": len(batch) / wall,
                                       "engine_busy_fraction": managers[mode].timings["rollout/engine_busy_fraction"],
                                       "turns": sum(e.turns for e in batch.episodes)})
                    batches[mode] = batch
        finally:
            engine.shutdown()
    report_rows = []
    for mode in modes:
        median = {k: statistics.median(r[k] for r in rows[mode]) for k in ("seconds", "episodes_per_s",
                                                                         "engine_busy_fraction")}
        report_rows.append({"mode": mode, **median, "episodes": len(batches[mode]),
                            "turns": rows[mode][0]["turns"], "samples": rows[mode]})
    first = batches[modes[0]]
    same = all(torch.equal(first.input_ids, b.input_ids) and torch.equal(first.loss_mask, b.loss_mask)
               for b in batches.values())
    report = {"workload": workload, "levels": demo.env.categories, "tasks": len(picked), "n_per_task": n_per_task,
              "turn_caps": list(CAPS), "model": demo.model.path,
              "env_group_window_ms": demo.rollout.env_group_window_ms,
              "env_latency": {"distribution": "lognormal", "median_ms": latency_ms, "sigma": LATENCY_SIGMA,
                              "cap_s": LATENCY_CAP_S},
              "engines": 1, "repeats": repeats, "same_tokens_in_every_mode": same, "rows": report_rows}
    if "lockstep" in modes and len(modes) > 1:
        base = next(r["episodes_per_s"] for r in report_rows if r["mode"] == "lockstep")
        report["speedup_vs_lockstep"] = {r["mode"]: r["episodes_per_s"] / base for r in report_rows}
    return report
