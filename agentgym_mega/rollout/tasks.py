"""Which tasks a run uses (`select_tasks`) and which each step trains on (`TaskSampler`: a seeded
shuffle of them, walked in order, resumable)."""

from __future__ import annotations

import random

from agentgym_mega.errors import BadInput
from envs.environment import Task


def select_tasks(catalogue: list[Task], split: str, task_ids: list[int] | None,
                 categories: list[str] | None, key: str = "env.categories") -> list[Task]:
    """The tasks of ``split`` from an environment's catalogue, or the explicit ``task_ids`` (any
    id, keeping the environment's meaning), kept to ``categories``. An unknown category is bad
    input, named in the error as ``key`` (the setting it came from)."""
    by_id = {t.id: t for t in catalogue}
    if task_ids is None:
        tasks = [t for t in catalogue if t.split == split]
    else:
        tasks = [by_id.get(i, Task(i)) for i in task_ids]
    if categories is None:
        return tasks
    known = sorted({t.category for t in catalogue})
    unknown = [c for c in categories if c not in known]
    if unknown:
        raise BadInput(f"{key}: unknown {unknown}; this environment's categories: {', '.join(known)}")
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
