"""What every environment kind provides to the common server: episodes behind one small interface,
a task catalogue with the original id semantics, and how the server should parse actions."""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Protocol


class InvalidTask(ValueError):
    """A data_idx the environment cannot load; the message names the valid range."""


class InstanceFailed(RuntimeError):
    """The instance is unusable (e.g. its JVM died); only closing it helps."""


class Environment(Protocol):
    """One episode at a time. reset/step return dicts with at least observation, reward, done."""

    def reset(self, data_idx: int) -> dict: ...

    def step(self, action: str) -> dict: ...

    def observation(self) -> str: ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class Task:
    id: int
    category: str
    split: str


@dataclasses.dataclass(frozen=True)
class Kind:
    """An environment kind as the server hosts it.

    `batch_threads`: how many instances of one batched request run at once. Pure-Python games
    hold the GIL, so threads only add switching (1); JVM-backed ones wait on sockets (many).
    """

    name: str
    make: Callable[[], Environment]
    tasks: Callable[[], list[Task]]
    validate_idx: Callable[[int], None]
    batch_threads: int = 1


_ACTION = re.compile(r"Action\s*:", re.IGNORECASE)


def extract_action(text: str) -> str:
    """The action in a model reply: what follows the last `Action:`, first line only, trimmed.

    Original AgentGym clients send the action bare (`get 1 oak log`), which passes unchanged.
    """
    parts = _ACTION.split(text)
    if len(parts) > 1:
        text = parts[-1].strip().split("\n", 1)[0]
    return text.strip()


def check_data_idx(value) -> int:
    """data_idx must be an int >= 0 (bool is no index); large ids keep each env's own meaning."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidTask(f"data_idx={value!r} is not allowed; allowed: an integer >= 0")
    return value
