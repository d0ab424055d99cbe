"""How an episode ended, in a module of its own: the CLI's evaluation and the metrics compare
statuses without importing torch, which the rollout record needs."""

from __future__ import annotations

import enum


class Status(enum.StrEnum):
    """How an episode ended. A str enum: it compares equal to, prints and saves as its value
    ("done", ...), so metrics keys, JSON reports and saved rollouts read the same plain strings."""

    DONE = "done"  # the env said done
    HORIZON = "horizon"  # the turn cap ended it
    TRUNCATED = "truncated"  # the context limit (max_model_len) ended it
    ENV_ERROR = "env_error"  # the env server failed
    TIMEOUT = "timeout"  # the episode's wall-clock limit or an env step's timeout ended it


# Every status as its saved string (a CLI's choices, a filter of saved episodes).
STATUSES = tuple(str(s) for s in Status)
# Statuses of episodes that say nothing about the policy: counted, never trained on.
UNTRAINED = (Status.ENV_ERROR, Status.TIMEOUT)
