"""BabyAI (minigrid grid worlds in text): 40 levels, level = idx % 40 + 1, seed = idx // 40.

One instance holds one minigrid level, measured as the RSS growth of 800 instances over all 40
levels after a reset and three steps each (docs/results.md); counted as 64 KiB for the cap.
"""

from envs.babyai.levels import LEVELS
from envs.babyai.text import BabyAIEnv
from envs.environment import Kind, Task

SEEDS_LISTED = 100  # /tasks lists seeds 0-99 of every level; any id >= 0 can be reset
TEST_SEEDS = 10  # seeds 0-9 (ids 0-399) are the test split, the rest train


def _tasks() -> list[Task]:
    return [Task(i, LEVELS[i % len(LEVELS)], "test" if i // len(LEVELS) < TEST_SEEDS else "train")
            for i in range(SEEDS_LISTED * len(LEVELS))]


KIND = Kind(name="babyai", make=BabyAIEnv, tasks=_tasks, instance_bytes=64 << 10,
            index_range="an integer >= 0 (level = id % 40 + 1, seed = id // 40)")
