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
  not success. Deep Search: 1.0 once an answer matches a golden answer (exact match after SQuAD
  normalisation), else 0; success means that match. WebArena: 0 until `stop [answer]`, then the
  product of the task's evaluators (each 0 or 1 for the shipped tasks); success means 1.

Every step answer also carries `valid_action`: whether the reply parsed as an action of the
environment (a command form of TextCraft, BabyAI or ScienceWorld's parser; a Deep Search tag pair;
a WebArena action). An action that parsed but failed (an unseen object, a missing item) is valid.
And `action`: the action the server read from the reply (what follows `Action:`, the whole reply
for Deep Search), which saved episodes show beside the reply. AgentGym's original clients ignore
both extra fields.

`instruction(name)` is the text that opens an episode for the model: the reply format and the
environment's commands and rules, read from `envs/<name>/instruction.txt` without importing the
environment (no minigrid, no JVM in the trainer). `eval_max_turns(name)` is the turn limit the
AgentGym-RL paper evaluates the environment with.

A kind that takes options (Deep Search: its question files and its retriever; WebArena: its sites,
tasks, browser and judge) has a light
`envs/<name>/options.py` with `check(options) -> dataclass`; `check_options` validates a run's
`env.options` with it before any server starts, and `load_kind(name, options)` hands them on.
"""

from __future__ import annotations

import importlib
import os

KINDS = ("textcraft", "babyai", "sciworld", "deepsearch", "webarena")
# The AgentGym-RL paper's evaluation turn limits.
EVAL_MAX_TURNS = {"babyai": 20, "textcraft": 30, "sciworld": 30, "deepsearch": 30, "webarena": 15}
_HERE = os.path.dirname(os.path.abspath(__file__))


def _check_name(name: str) -> None:
    if name not in KINDS:
        raise ValueError(f"unknown environment {name!r}; allowed: {', '.join(KINDS)}")


def load_kind(name: str, options: dict | None = None):
    """Returns the environment's `Kind` (its factory, catalogue and batching policy), configured
    with `options` for a kind that takes them. Raises ValueError for options it does not take."""
    checked = check_options(name, options)
    module = importlib.import_module(f"envs.{name}")
    return module.KIND if checked is None else module.configure(checked)


def check_options(name: str, options: dict | None):
    """`options` validated by the kind's own schema (None for a kind that takes none), without
    importing the environment; raises ValueError naming an unknown or bad option."""
    _check_name(name)
    if not os.path.exists(os.path.join(_HERE, name, "options.py")):
        if options:
            raise ValueError(f"environment {name!r} takes no options; given {sorted(options)}")
        return None
    return importlib.import_module(f"envs.{name}.options").check(options or {})


def instruction(name: str) -> str:
    """The environment's instruction for the model: reply format, command forms and rules."""
    _check_name(name)
    with open(os.path.join(_HERE, name, "instruction.txt"), encoding="utf-8") as f:
        return f.read().strip()


def eval_max_turns(name: str) -> int:
    """Assistant turns an evaluation episode may take in this environment (the paper's setting)."""
    _check_name(name)
    return EVAL_MAX_TURNS[name]
