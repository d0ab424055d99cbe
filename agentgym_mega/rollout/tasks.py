"""Which tasks each step trains on: a seeded shuffle of the split, walked in order, resumable."""

from __future__ import annotations

import random

from agentgym_mega.rollout.manager import Task


class TaskSampler:
    def __init__(self, tasks: list[Task], seed: int, position: int = 0):
        if not tasks:
            raise ValueError("no tasks to sample from (check env.split and env.task_ids)")
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
