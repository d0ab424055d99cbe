"""SciWorld (ScienceWorld): a flat list of (task, variation); one JVM per instance."""

from envs.environment import Kind, Task
from envs.sciworld.env import SciWorldEnv
from envs.sciworld.tasks import catalogue


def _tasks() -> list[Task]:
    return [Task(i, e["task"], e["split"]) for i, e in enumerate(catalogue())]


# JVM calls wait on sockets, so a batch steps many instances at once.
KIND = Kind(name="sciworld", make=SciWorldEnv, tasks=_tasks, size=lambda: len(catalogue()),
            index_range=f"an integer from 0 to {len(catalogue()) - 1}", batch_threads=16)
