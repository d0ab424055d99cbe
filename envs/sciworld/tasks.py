"""SciWorld's task catalogue: a flat list of (task, variation) over ScienceWorld's task types, in
ScienceWorld's task-id order, leaving out the types the original leaves out. Each variation keeps
ScienceWorld's own train/dev/test assignment. The list needs a JVM to build, so it ships as
`tasks.json`; `python -m envs.sciworld.tasks` rebuilds it from the installed scienceworld."""

from __future__ import annotations

import functools
import json
import os

from scienceworld import ScienceWorldEnv
from scienceworld.constants import ID2TASK

EXCLUDED = ("5-1", "5-2", "9-1", "9-2", "9-3", "10-1", "10-2")
PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks.json")


@functools.cache
def catalogue() -> list[dict]:
    """[{"task": name, "task_id": "1-1", "variation": v, "split": "train"|"dev"|"test"}, ...]"""
    with open(PATH) as f:
        return json.load(f)


def build() -> list[dict]:
    env = ScienceWorldEnv()
    try:
        entries = []
        for task_id, name in ID2TASK.items():
            if task_id in EXCLUDED:
                continue
            env.load(name, 0, "")
            split_of = {v: s for s, vs in (("train", env.get_variations_train()), ("dev", env.get_variations_dev()),
                                           ("test", env.get_variations_test())) for v in vs}
            entries += [{"task": name, "task_id": task_id, "variation": v, "split": split_of[v]}
                        for v in range(env.get_max_variations(name))]
        return entries
    finally:
        env.close()


if __name__ == "__main__":
    with open(PATH, "w") as f:  # one task a line: readable diffs when scienceworld changes
        f.write("[\n" + ",\n".join(json.dumps(entry) for entry in build()) + "\n]\n")
    print(f"wrote {len(catalogue())} tasks to {PATH}")
