"""What every environment kind provides to the common server: episodes behind one small interface,
a task catalogue with the original id semantics, what one instance costs, and how the server
should parse actions."""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Protocol


class InvalidTask(ValueError):
    """A data_idx the environment cannot load; the message names the valid range."""


class InvalidCreate(ValueError):
    """A /create body the environment does not accept; the message names what it accepts."""


class InstanceFailed(RuntimeError):
    """The instance is unusable (e.g. its JVM died); only closing it helps."""


class Environment(Protocol):
    """One episode at a time. reset/step return dicts with at least observation, reward, done,
    episode_score (the episode's score so far, on [0, 1]) and success (a bool: what the
    environment means by success); see `envs` for each environment's definition."""

    def reset(self, data_idx: int) -> dict: ...

    def step(self, action: str) -> dict: ...

    def observation(self) -> str: ...

    def close(self) -> None: ...


def no_create_fields(body: dict) -> None:
    """The original clients of most kinds send /create without a body; an empty object is fine."""
    if body:
        raise InvalidCreate(f"/create takes no fields, given {sorted(body)}; send no body or {{}}")


@dataclasses.dataclass(frozen=True)
class Task:
    """One task of an environment's catalogue: the data_idx its reset takes, its category (BabyAI
    level, TextCraft depth, SciWorld task type) and split. The trainer uses the same record; a
    task id given explicitly and absent from the catalogue has category and split ""."""

    id: int
    category: str = ""
    split: str = ""


_ACTION = re.compile(r"Action\s*:", re.IGNORECASE)


def extract_action(text: str) -> str:
    """The action in a model reply: what follows the last `Action:`, first line only, trimmed.

    Original AgentGym clients send the action bare (`get 1 oak log`), which passes unchanged.
    """
    parts = _ACTION.split(text)
    if len(parts) > 1:
        text = parts[-1].strip().split("\n", 1)[0]
    return text.strip()


@dataclasses.dataclass(frozen=True)
class Kind:
    """An environment kind as the server hosts it.

    `index_range`: the valid data_idx values in words, for error messages.
    `batch_threads`: how many instances of one batched request run at once. Pure-Python games
    hold the GIL, so threads only add switching (1); JVM-backed ones wait on sockets (many).
    `instance_bytes`: what one live instance adds to the server's memory, measured (the module of
    each kind says how); the memory cap on instances divides by it.
    `check_create`: validates the body of AgentGym's `POST /create` (raises InvalidCreate).
    `starts_on_create`: the original server's /create with a body also started the episode
    data_idx = id and answered its first observation (TextCraft).
    `parse_action`: the action in a step's text (default: what follows `Action:`); the identity
    for a kind whose environment reads the whole reply (Deep Search's tags).
    `env_idx_task`: the kind also serves AgentGym's env_idx dialect (Deep Search's client, WebArena's):
    requests name the instance `env_idx`, a reset names its task by this field, and /create with
    a body starts the episode of that task and answers the bare instance id.
    `health`: the kind's own figures for `GET /health` (WebArena: its browser's open pages).
    """

    name: str
    make: Callable[[], Environment]
    tasks: Callable[[], list[Task]]
    index_range: str
    instance_bytes: int
    size: Callable[[], int | None] = lambda: None  # data_idx must be below it, when not None
    batch_threads: int = 1
    check_create: Callable[[dict], None] = no_create_fields
    starts_on_create: bool = False
    parse_action: Callable[[str], str] = extract_action
    env_idx_task: str | None = None
    health: Callable[[], dict] = dict

    def check_data_idx(self, value) -> int:
        """data_idx must be an int (bool is no index) in range; large ids keep each env's meaning."""
        bad_type = isinstance(value, bool) or not isinstance(value, int)
        size = None if bad_type else self.size()
        if bad_type or value < 0 or (size is not None and value >= size):
            raise InvalidTask(f"data_idx={value!r} is not allowed; allowed: {self.index_range}")
        return value
