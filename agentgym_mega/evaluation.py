"""`agentgym-mega eval`: the AgentGym protocol. n samples per task at the run's temperature,
the environment's evaluation turn cap, and Avg@n (mean score over all samples) and Pass@n
(share of tasks with a sample scoring above 0), overall and per category."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

# Evaluation turn caps of the AgentGym-RL paper per environment.
EVAL_TURN_CAPS = {"babyai": 20, "textcraft": 30, "sciworld": 30}


def _scores(episodes) -> dict:
    by_task: dict[int, list[float]] = {}
    for e in episodes:
        by_task.setdefault(e.task_id, []).append(e.score)
    samples = [s for scores in by_task.values() for s in scores]
    return {
        "tasks": len(by_task),
        "avg": sum(samples) / len(samples),
        "pass": sum(any(s > 0 for s in scores) for scores in by_task.values()) / len(by_task),
    }


def summarize(episodes, n: int) -> dict:
    """Avg@n and Pass@n over `episodes` (n per task), overall and per task category."""
    categories: dict[str, list] = {}
    for e in episodes:
        categories.setdefault(e.category or "all", []).append(e)
    return {
        "n": n,
        "overall": _scores(episodes),
        "categories": {c: _scores(eps) for c, eps in sorted(categories.items())},
        "env_errors": sum(e.status == "env_error" for e in episodes),
    }


def table(report: dict) -> str:
    n = report["n"]
    lines = [f"{'category':<24}{'tasks':>7}{f'Avg@{n}':>10}{f'Pass@{n}':>10}"]
    rows = list(report["categories"].items()) + [("overall", report["overall"])]
    for name, row in rows:
        lines.append(f"{name:<24}{row['tasks']:>7}{row['avg']:>10.4f}{row['pass']:>10.4f}")
    return "\n".join(lines)


def export_checkpoint(ckpt: str, out: str) -> str:
    """A megatron checkpoint as an HF directory vLLM can load (checkpoint_tools' export)."""
    result = subprocess.run([sys.executable, "-m", "checkpoint_tools.convert", "export", "--ckpt", ckpt,
                             "--out", out], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"exporting {ckpt} failed: {result.stderr.strip()[-500:]}")
    return out


def evaluate(cfg, model_dir: str, n: int, split: str, limit: int | None, max_turns: int | None) -> dict:
    import ray
    from transformers import AutoTokenizer

    from agentgym_mega.rollout.engines import SamplingConfig
    from agentgym_mega.rollout.engines.vllm_engine import VLLMEngine
    from agentgym_mega.rollout.env_client import EnvClient, start_servers
    from agentgym_mega.rollout.manager import RolloutManager, Task

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    servers, urls = ([], list(cfg.env.server_urls)) if cfg.env.server_urls else start_servers(cfg.env.name, cfg.env.workers)
    env = EnvClient(urls)
    engine = None
    try:
        tasks = [Task(t["id"], t["category"]) for t in env.tasks(split)][:limit]
        engine = VLLMEngine(model_dir, max_model_len=cfg.rollout.max_model_len, seed=cfg.trainer.seed)
        sampling = SamplingConfig(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.max_tokens_per_turn)
        manager = RolloutManager([engine], env, AutoTokenizer.from_pretrained(model_dir), sampling,
                                 cfg.rollout.max_model_len)
        batch = manager.collect(tasks, n, max_turns or EVAL_TURN_CAPS[cfg.env.name])
    finally:
        if engine is not None:
            engine.shutdown()
        env.shutdown()
        for server in servers:
            ray.kill(server)
    report = summarize(batch.episodes, n)
    report.update(env=cfg.env.name, split=split, model=model_dir, max_turns=max_turns or EVAL_TURN_CAPS[cfg.env.name])
    return report


def run(cfg, hf: str | None, ckpt: str | None, n: int, split: str, limit: int | None,
        max_turns: int | None) -> dict:
    if hf:
        return evaluate(cfg, hf, n, split, limit, max_turns)
    with tempfile.TemporaryDirectory() as tmp:
        return evaluate(cfg, export_checkpoint(ckpt, os.path.join(tmp, "hf")), n, split, limit, max_turns)
