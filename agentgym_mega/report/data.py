"""What a run directory holds (docs: the run-directory contract of issue #43), read for the report:
metrics per step, the config, evaluations and episodes. Missing pieces read as empty; a directory
with neither metrics nor episodes is not a run."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

import yaml

from agentgym_mega.errors import BadInput

_STEP_FILE = re.compile(r"^step_(\d+)\.(json|jsonl)$")


@dataclass
class Run:
    """A run directory's contents, each piece empty where the run has none."""

    path: str
    config: dict = field(default_factory=dict)
    metrics: dict[int, dict] = field(default_factory=dict)  # step -> merged metrics (a step's last line wins)
    evals: dict[int, dict] = field(default_factory=dict)  # step -> eval/step_N.json
    episodes: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what could not be read, shown on the page


def read_run(path: str) -> Run:
    """Reads RUN_DIR; raises BadInput when it is not a run (no metrics.jsonl and no episodes/)."""
    if not os.path.isdir(path):
        raise BadInput(f"RUN_DIR {path!r} is not a directory")
    has_metrics = os.path.isfile(os.path.join(path, "metrics.jsonl"))
    if not has_metrics and not os.path.isdir(os.path.join(path, "episodes")):
        raise BadInput(f"RUN_DIR {path!r} is not a training run: it has neither metrics.jsonl nor episodes/ "
                       "(give trainer.output_dir of a run)")
    run = Run(path=os.path.abspath(path))
    run.config = _read_config(path, run.notes)
    if not has_metrics:
        run.notes.append("no metrics.jsonl: no step's metrics, so no curves")
    else:
        for record in _json_lines(os.path.join(path, "metrics.jsonl"), run.notes):
            if isinstance(record.get("step"), int):
                run.metrics[record["step"]] = run.metrics.get(record["step"], {}) | record
    for step, file in _step_files(os.path.join(path, "eval"), "json"):
        try:
            with open(file) as f:
                run.evals[step] = json.load(f)
        except (OSError, ValueError) as exc:
            run.notes.append(f"eval/{os.path.basename(file)} unreadable: {exc}")
    for step, file in _step_files(os.path.join(path, "episodes"), "jsonl"):
        run.episodes.extend(e for e in _json_lines(file, run.notes) if isinstance(e, dict))
    return run


def _read_config(path: str, notes: list[str]) -> dict:
    file = os.path.join(path, "config.yaml")
    if not os.path.isfile(file):
        notes.append("no config.yaml: the run's settings are unknown")
        return {}
    try:
        with open(file) as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        notes.append(f"config.yaml unreadable: {exc}")
        return {}
    return data if isinstance(data, dict) else {}


def _step_files(folder: str, ext: str) -> list[tuple[int, str]]:
    """(step, path) of folder/step_N.<ext>, by step."""
    if not os.path.isdir(folder):
        return []
    found = [(_STEP_FILE.match(name), name) for name in os.listdir(folder)]
    return sorted((int(m.group(1)), os.path.join(folder, name)) for m, name in found if m and m.group(2) == ext)


def _json_lines(file: str, notes: list[str]) -> list:
    """The JSON objects of a JSONL file; a line that does not parse (a run killed mid-write of a
    file not written atomically) is skipped and noted."""
    records, bad = [], 0
    with open(file) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except ValueError:
                bad += 1
    if bad:
        notes.append(f"{os.path.relpath(file, os.path.dirname(os.path.dirname(file)))}: "
                     f"skipped {bad} line(s) that are not JSON")
    return records


def summary(run: Run) -> list[tuple[str, str]]:
    """The run at a glance: (label, value) rows."""
    cfg = run.config
    get = lambda section, key: (cfg.get(section) or {}).get(key)  # noqa: E731
    train_steps = [s for s, m in run.metrics.items() if s > 0 and "reward/mean" in m]
    total = get("trainer", "total_steps")
    horizon = cfg.get("horizon") or {}
    categories = get("env", "categories") or sorted({e.get("category") for e in run.episodes if e.get("category")})
    wall = wall_time(run)
    rows = [
        ("run directory", run.path),
        ("experiment", get("logging", "experiment")),
        ("model", get("model", "path")),
        ("env", get("env", "name") or next((e.get("env") for e in run.episodes if e.get("env")), None)),
        ("categories", ", ".join(map(str, categories)) if categories else None),
        ("estimator", get("algorithm", "estimator")),
        ("steps done", f"{max(train_steps, default=0)} of {total if total is not None else '?'}"),
        ("turn cap", f"{horizon.get('schedule')} {horizon.get('caps')}" if horizon else None),
        ("batch", f"{get('trainer', 'batch_size')} tasks x {get('rollout', 'n_per_task')} samples"
         if get("trainer", "batch_size") else None),
        ("wall time", f"{wall:,.1f} s (sum of the timed phases)" if wall else None),
        ("evaluations", ", ".join(f"step {s}" for s in sorted(run.evals)) or "none"),
        ("episodes saved", f"{len(run.episodes):,}"),
    ]
    return [(label, "?" if value is None else str(value)) for label, value in rows]


# Busy times measured inside another phase (the engines generating, the env servers stepping,
# during the rollout): shown under it, not added to the run's total.
WITHIN = {"generate": "rollout", "env": "rollout"}


def phase_times(run: Run) -> list[dict]:
    """Seconds per phase (the time/<phase>_s metrics) over all steps: phase, total, mean per step,
    share of the timed total and the phase it is part of (WITHIN), largest first, each phase's
    parts right after it."""
    totals: dict[str, list[float]] = {}
    for metrics in run.metrics.values():
        for key, value in metrics.items():
            if key.startswith("time/") and key.endswith("_s") and isinstance(value, (int, float)):
                totals.setdefault(key[5:-2], []).append(float(value))
    grand = sum(sum(v) for p, v in totals.items() if p not in WITHIN) or 1.0
    rows = [{"phase": p, "total": sum(v), "mean": sum(v) / len(v), "share": sum(v) / grand, "within": WITHIN.get(p)}
            for p, v in totals.items()]
    top = sorted((r for r in rows if not r["within"]), key=lambda r: -r["total"])
    return [x for r in top for x in [r, *sorted((c for c in rows if c["within"] == r["phase"]),
                                                key=lambda c: -c["total"])]] + [
        r for r in rows if r["within"] and r["within"] not in totals]


def wall_time(run: Run) -> float:
    return sum(r["total"] for r in phase_times(run) if not r["within"])


def eval_tables(run: Run) -> list[dict]:
    """Per evaluation step: its settings and one row per scope (overall, then each category)."""
    tables = []
    for step in sorted(run.evals):
        report = run.evals[step]
        scopes = [("overall", report.get("overall") or {})]
        scopes += sorted((report.get("categories") or {}).items())
        rows = [{"scope": name, **{k: values.get(k) for k in ("tasks", "success", "avg", "pass", "valid")}}
                for name, values in scopes]
        tables.append({"step": step, "n": report.get("n"), "max_turns": report.get("max_turns"),
                       "env_errors": report.get("env_errors"), "timeouts": report.get("timeouts"), "rows": rows})
    return tables


def steps_without_metrics(run: Run) -> list[int]:
    """Steps that have episodes or an evaluation but no line in metrics.jsonl."""
    seen = {e.get("step") for e in run.episodes} | set(run.evals)
    return sorted(s for s in seen if isinstance(s, int) and s not in run.metrics)
