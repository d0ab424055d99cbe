"""Config files and dotted overrides as plain data, before the schema (agentgym_mega.config)
validates them: `include:` resolution and `a.b.c=value` overrides."""

from __future__ import annotations

import copy
import os

import yaml

from agentgym_mega.errors import ConfigError


def _deep_merge(base: dict, top: dict) -> dict:
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def read_yaml(path: str, _seen: tuple = ()) -> dict:
    """Reads a config file, resolving its `include:` (a path or a list, relative to the file)."""
    path = os.path.abspath(path)
    if path in _seen:
        raise ConfigError(f"include cycle: {' -> '.join(_seen + (path,))}")
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file must be a mapping of sections")
    includes = data.pop("include", [])
    includes = [includes] if isinstance(includes, str) else includes
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise ConfigError(f"{path}: include: must be a path or a list of paths, given {includes!r}")
    merged: dict = {}
    for inc in includes:
        merged = _deep_merge(merged, read_yaml(os.path.join(os.path.dirname(path), inc), _seen + (path,)))
    return _deep_merge(merged, data)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Applies `a.b.c=value` overrides to a copy of ``data``; values are parsed as YAML
    (`[6,13,20]`, `null`, `1e-3`)."""
    data = copy.deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not p for p in key.split(".")):
            raise ConfigError(f"override {item!r}: expected section.key=value, e.g. trainer.total_steps=50")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {key}: value {raw!r} is not valid YAML: {exc}") from None
        node, parts = data, key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {key}: {'.'.join(parts[: i + 1])} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data
