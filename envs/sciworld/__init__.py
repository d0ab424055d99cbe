"""SciWorld (ScienceWorld): a flat list of (task, variation); one JVM per instance."""

from envs.environment import InvalidTask, Kind, Task
from envs.sciworld.env import SciWorldEnv
from envs.sciworld.tasks import catalogue


def _tasks() -> list[Task]:
    return [Task(i, e["task"], e["split"]) for i, e in enumerate(catalogue())]


def _validate(data_idx: int) -> None:
    if data_idx >= len(catalogue()):
        raise InvalidTask(f"data_idx={data_idx} is not allowed; allowed: 0 to {len(catalogue()) - 1}")


# JVM calls wait on sockets, so a batch steps many instances at once.
KIND = Kind(name="sciworld", make=SciWorldEnv, tasks=_tasks, validate_idx=_validate, batch_threads=16)
