"""Environment servers: one common framework (`envs.server`, `envs.pool`) and one package per
environment kind. `load_kind(name)` imports an environment's package only when it is served, so a
TextCraft server never starts a JVM or imports minigrid."""

from __future__ import annotations

import importlib

KINDS = ("textcraft", "babyai", "sciworld")


def load_kind(name: str):
    """Returns the environment's `Kind` (its factory, catalogue and batching policy)."""
    if name not in KINDS:
        raise ValueError(f"unknown environment {name!r}; allowed: {', '.join(KINDS)}")
    return importlib.import_module(f"envs.{name}").KIND
