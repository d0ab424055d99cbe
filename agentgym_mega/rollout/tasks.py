"""Which tasks a run uses (`select_tasks`) and which each step trains on (`TaskSampler`: a seeded
shuffle of them, walked in order, resumable)."""

from __future__ import annotations

import random

from agentgym_mega.config import ConfigError
from agentgym_mega.rollout.manager import Task


def select_tasks(catalogue: list[dict], split: str, task_ids: list[int] | None,
                 categories: list[str] | None) -> list[Task]:
    """The tasks of ``split`` from a server's catalogue (``[{id, category, split}]``), or the
    explicit ``task_ids`` (any id, keeping the environment's meaning), kept to ``categories``."""
    category = {t["id"]: t["category"] for t in catalogue}
    if task_ids is None:
        tasks = [Task(t["id"], t["category"]) for t in catalogue if t["split"] == split]
    else:
        tasks = [Task(i, category.get(i, "")) for i in task_ids]
    if categories is None:
        return tasks
    known = sorted(set(category.values()))
    unknown = [c for c in categories if c not in known]
    if unknown:
        raise ConfigError(f"env.categories: unknown {unknown}; this environment's categories: {', '.join(known)}")
    return [t for t in tasks if t.category in categories]


class TaskSampler:
    def __init__(self, tasks: list[Task], seed: int, position: int = 0):
        if not tasks:
            raise ValueError("no tasks to sample from (check env.split, env.task_ids and env.categories)")
        self.tasks = tasks
        self.seed = seed
        self.position = position  # tasks handed out so far; saved in checkpoints

    def _order(self, epoch: int) -> list[Task]:
        order = list(self.tasks)
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self, n: int) -> list[Task]:
        out = []
        while len(out) < n:
            epoch, index = divmod(self.position, len(self.tasks))
            out.append(self._order(epoch)[index])
            self.position += 1
        return out
