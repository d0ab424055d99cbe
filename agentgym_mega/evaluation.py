"""`agentgym-mega eval` and evaluation inside training: the AgentGym protocol. n samples per
task at the run's temperature, the environment's evaluation turn cap, and Avg@n (mean episode
score, on [0, 1] for every environment: the paper's SciWorld figures are these times 100),
Pass@n (share of tasks with a sample scoring above 0, as the paper defines it) and the success
rate (share of samples the environment calls successful), overall and per category, with the
valid-action rate (share of replies the env server parsed as an action). Episodes
that ended on an env error or a timeout are left out of all four and counted in `env_errors`
and `timeouts`."""

from __future__ import annotations

import json
import os
import tempfile
from typing import TYPE_CHECKING

import envs
from agentgym_mega.metrics import valid_action_rate
from agentgym_mega.rollout.status import Status
from agentgym_mega.rollout.tasks import select_tasks

if TYPE_CHECKING:
    from agentgym_mega.config import Config

# The stack (Ray, torch) and the converter are imported where used: the CLI imports this module
# when it starts.


def _scores(episodes) -> dict:
    by_task: dict[int, list] = {}
    for e in episodes:
        if e.trained:
            by_task.setdefault(e.task_id, []).append(e)
    samples = [e for eps in by_task.values() for e in eps]
    n = max(1, len(samples))
    return {
        "tasks": len(by_task),
        "avg": sum(e.score for e in samples) / n,
        "pass": sum(any(e.score > 0 for e in eps) for eps in by_task.values()) / max(1, len(by_task)),
        "success": sum(e.success for e in samples) / n,
        "valid": valid_action_rate(samples),
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
        "env_errors": sum(e.status == Status.ENV_ERROR for e in episodes),
        "timeouts": sum(e.status == Status.TIMEOUT for e in episodes),
    }


def table(report: dict) -> str:
    n = report["n"]
    lines = [f"{'category':<24}{'tasks':>7}{f'Avg@{n}':>10}{f'Pass@{n}':>10}{'success':>10}{'valid':>10}"]
    rows = list(report["categories"].items()) + [("overall", report["overall"])]
    for name, row in rows:
        lines.append(f"{name:<24}{row['tasks']:>7}{row['avg']:>10.4f}{row['pass']:>10.4f}{row['success']:>10.4f}"
                     f"{row['valid']:>10.4f}")
    return "\n".join(lines)


def held_out(rollout, tasks: list, n: int, max_turns: int, cfg: Config) -> tuple[dict, list]:
    """The report (:func:`summarize`) of ``n`` samples of each task through ``rollout`` (a
    rollout manager), and the episodes. With ``rollout.seeded`` every evaluation samples with the
    same request seeds (step -1 of the run's seed, which training never uses), inside training and
    in ``agentgym-mega eval`` alike: evaluations of equal weights, in any run, read the same."""
    seed = (cfg.trainer.seed, -1) if cfg.rollout.seeded else None
    episodes = rollout.collect(tasks, n, max_turns, seed=seed).episodes
    return summarize(episodes, n), episodes


class Evaluator:
    """Evaluation inside a training run, through its rollout manager (so on the weights the
    engines serve now): writes ``eval/step_N.json``, hands the report and the episodes to
    ``keep(step, report, episodes)`` when given (the run's record) and returns ``eval/...`` metrics."""

    def __init__(self, manager, tasks: list, cfg: Config, keep=None):
        if not tasks:
            raise ValueError(f"no {cfg.eval.split} tasks to evaluate on (check env.categories and eval.limit)")
        self.manager, self.tasks, self.n = manager, tasks, cfg.eval.n
        self.max_turns = cfg.eval.max_turns or envs.eval_max_turns(cfg.env.name)
        self.cfg, self.keep = cfg, keep
        self.out = os.path.join(cfg.trainer.output_dir, "eval")
        self.history: list[tuple[int, float]] = []  # (step, success rate) of each evaluation

    def __call__(self, step: int) -> tuple[dict, str]:
        """(metrics, printable table) of the policy the engines serve at ``step``."""
        report, episodes = held_out(self.manager, self.tasks, self.n, self.max_turns, self.cfg)
        report.update(step=step, max_turns=self.max_turns)
        if self.keep:
            self.keep(step, report, episodes)
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, f"step_{step}.json"), "w") as f:
            json.dump(report, f, indent=2)
        metrics = {f"eval/{k}": v for k, v in report["overall"].items() if k != "tasks"}
        for category, row in report["categories"].items():
            metrics |= {f"eval/{category}/{k}": v for k, v in row.items() if k != "tasks"}
        self.history.append((step, report["overall"]["success"]))
        return metrics, table(report)

    def summary(self) -> str:
        (first_step, first), (last_step, last) = self.history[0], self.history[-1]
        return (f"held-out success ({len(self.tasks)} tasks x {self.n}, {self.max_turns} turns): "
                f"{first:.3f} at step {first_step} -> {last:.3f} at step {last_step} ({last - first:+.3f})")


def evaluate(cfg: Config, model_dir: str, n: int, split: str, limit: int | None, max_turns: int | None) -> dict:
    """Avg@n, Pass@n and success of the HF model in `model_dir` on `split` (its first `limit`
    tasks, `max_turns` or the environment's evaluation limit), through the run's env servers and
    engines."""
    from agentgym_mega.stack import Stack

    max_turns = max_turns or envs.eval_max_turns(cfg.env.name)
    with Stack.start(cfg, trainers=False, engine_model=model_dir) as stack:
        tasks = select_tasks(stack.catalogue, split, None, cfg.env.categories)[:limit]
        report, _ = held_out(stack.rollout, tasks, n, max_turns, cfg)
    report.update(env=cfg.env.name, split=split, model=model_dir, max_turns=max_turns)
    return report


def run(cfg: Config, hf: str | None, ckpt: str | None, n: int, split: str, limit: int | None,
        max_turns: int | None) -> dict:
    """`agentgym-mega eval`: an HF directory as it is, a megatron checkpoint exported first."""
    if hf:
        return evaluate(cfg, hf, n, split, limit, max_turns)
    from agentgym_mega.models.conversion import export_hf

    with tempfile.TemporaryDirectory() as tmp:
        return evaluate(cfg, export_hf(ckpt, os.path.join(tmp, "hf")), n, split, limit, max_turns)
