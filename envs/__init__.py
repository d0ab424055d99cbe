"""Environment servers: one common framework (`envs.server`, `envs.pool`) and one package per
environment kind. `load_kind(name)` imports an environment's package only when it is served, so a
TextCraft server never starts a JVM or imports minigrid.

Every reset and step answer keeps AgentGym's fields (`observation`, `reward`, `done`, and
`score` where the original had it) and adds two on one scale for all environments:

- `episode_score`: the episode's score so far, on [0, 1]. TextCraft: 1.0 once the goal is crafted,
  else 0. BabyAI: minigrid's success reward (1 - 0.9 * steps / max_steps) once the mission is
  accomplished, else 0. SciWorld: ScienceWorld's 0-100 task score / 100, a failed task's negative
  score counted as 0.
- `success`: what the environment means by success. TextCraft: the goal is crafted. BabyAI: the
  episode ended with a positive reward (minigrid's success). SciWorld: the score reached 100, or
  ScienceWorld flags the task completed (a failed task is never completed); a partial score is
  not success.

`instruction(name)` is the text that opens an episode for the model: the reply format and the
environment's commands and rules, read from `envs/<name>/instruction.txt` without importing the
environment (no minigrid, no JVM in the trainer). `eval_max_turns(name)` is the turn limit the
AgentGym-RL paper evaluates the environment with.
"""

from __future__ import annotations

import importlib
import os

KINDS = ("textcraft", "babyai", "sciworld")
# The AgentGym-RL paper's evaluation turn limits.
EVAL_MAX_TURNS = {"babyai": 20, "textcraft": 30, "sciworld": 30}
_HERE = os.path.dirname(os.path.abspath(__file__))


def _check_name(name: str) -> None:
    if name not in KINDS:
        raise ValueError(f"unknown environment {name!r}; allowed: {', '.join(KINDS)}")


def load_kind(name: str):
    """Returns the environment's `Kind` (its factory, catalogue and batching policy)."""
    _check_name(name)
    return importlib.import_module(f"envs.{name}").KIND


def instruction(name: str) -> str:
    """The environment's instruction for the model: reply format, command forms and rules."""
    _check_name(name)
    with open(os.path.join(_HERE, name, "instruction.txt"), encoding="utf-8") as f:
        return f.read().strip()


def eval_max_turns(name: str) -> int:
    """Assistant turns an evaluation episode may take in this environment (the paper's setting)."""
    _check_name(name)
    return EVAL_MAX_TURNS[name]
