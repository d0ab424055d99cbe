"""SciWorld (ScienceWorld): a flat list of (task, variation); one JVM per instance.

One instance is one JVM with a 256 MiB heap (see `env.JVM_OPTIONS`); the cap counts 384 MiB: the
JVM's peak RSS after playing the gold paths of every task type (docs/results.md), plus the
gateway's threads in the server.
"""

from envs.environment import Kind, Task
from envs.sciworld.env import SciWorldEnv
from envs.sciworld.tasks import catalogue


def _tasks() -> list[Task]:
    return [Task(i, e["task"], e["split"]) for i, e in enumerate(catalogue())]


# JVM calls wait on sockets, so a batch steps many instances at once.
KIND = Kind(name="sciworld", make=SciWorldEnv, tasks=_tasks, size=lambda: len(catalogue()),
            instance_bytes=384 << 20, index_range=f"an integer from 0 to {len(catalogue()) - 1}",
            batch_threads=16)
