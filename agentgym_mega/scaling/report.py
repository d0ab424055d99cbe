"""A sweep's figures, from each point's `metrics.jsonl`: throughput, seconds per phase, efficiency.

Per point, over its steps after the first `warmup` (the first step pays one-time costs: vLLM's
warm-up, the first weight sync's repacking): the mean seconds per step of each phase (rollout;
log-probs, with the critic's values under GAE; train; sync), their sum as the step, and
tokens/s = tokens per step (every token of the batch: prompts, observations, replies) / seconds
per step, as the trainer's `perf/tokens_per_s` counts them. Against the base point (the first
that ran): speedup = tokens/s over the base's, efficiency = speedup / (devices over the base's),
devices being the GPUs (logical CPUs here) the run's bundles hold: with a fixed device count,
efficiency is the speedup itself.
"""

from __future__ import annotations

import json
import os

from agentgym_mega.files import write_text_atomic

# matplotlib is imported by `plot` only: the CLI imports this module at start-up.

# phase -> the trainer's timer metrics it sums
PHASES = {"rollout": ("time/rollout_s",), "logprob": ("time/logprob_s", "time/values_s"),
          "train": ("time/train_s",), "sync": ("time/sync_s",)}
PHASE_LABELS = {"rollout": "rollout", "logprob": "log-probs", "train": "train", "sync": "sync"}


def read_steps(run_dir: str) -> list[dict]:
    """The run's training steps in order (a resumed run's rewritten steps: the last record wins)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    records: dict[int, dict] = {}
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if "perf/tokens_per_s" in record:  # an evaluation-only record (step 0) is not a step
                records[record["step"]] = record
    return [records[s] for s in sorted(records)]


def summarize(run_dir: str, warmup: int) -> dict:
    """A point's figures over its steps after the first `warmup`; `error` when none is left."""
    steps = read_steps(run_dir)
    measured = [s for s in steps if s["step"] > warmup]
    if not measured:
        return {"error": f"no step after the first {warmup} (warm-up) in {run_dir}/metrics.jsonl "
                         f"({len(steps)} step(s) logged)"}
    mean = lambda values: sum(values) / len(measured)  # noqa: E731
    seconds = {phase: mean([sum(s.get(k, 0.0) for k in keys) for s in measured]) for phase, keys in PHASES.items()}
    step_s = sum(seconds.values())
    tokens = mean([s["perf/tokens"] for s in measured])
    return {"steps": len(measured), "first_step": measured[0]["step"], "tokens_per_step": tokens,
            "seconds": seconds, "step_s": step_s, "tokens_per_s": tokens / step_s,
            "nodes_used": measured[0].get("cluster/nodes")}


def build(rows: list[dict]) -> dict:
    """The sweep's report from rows {index, label, devices, nodes, exit, log, figures...}: adds
    speedup and efficiency against the first row that has figures."""
    base = next((r for r in rows if "tokens_per_s" in r), None)
    for row in rows:
        if base is not None and "tokens_per_s" in row:
            row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
            row["efficiency"] = row["speedup"] / (row["devices"] / base["devices"])
    return {"base": None if base is None else base["index"], "points": rows}


def _num(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def table(report: dict) -> str:
    """The report as a Markdown table, one row per point."""
    head = (["point", "devices", "nodes"] + [f"{PHASE_LABELS[p]} s" for p in PHASES]
            + ["step s", "tokens/step", "tokens/s", "speedup", "efficiency"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in report["points"]:
        nodes = row.get("nodes_used") or row.get("nodes") or "-"
        if "tokens_per_s" not in row:
            why = f"failed (exit {row['exit']}, {row['log']})" if row.get("exit") else row.get("error", "no figures")
            lines.append(f"| {row['label']} | {row['devices']} | {nodes} | {why} |" + " |" * (len(head) - 4))
            continue
        cells = ([row["label"], str(row["devices"]), str(nodes)] + [_num(row["seconds"][p]) for p in PHASES]
                 + [_num(row["step_s"]), _num(row["tokens_per_step"], 0), _num(row["tokens_per_s"], 0),
                    _num(row.get("speedup")), _num(row.get("efficiency"))])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(report: dict, path: str, title: str) -> str:
    """Seconds per phase per point (stacked) beside tokens/s with efficiency, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["points"] if "tokens_per_s" in r]
    labels = [r["label"].replace(" ", "\n") for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    bottom = [0.0] * len(rows)
    for phase in PHASES:
        values = [r["seconds"][phase] for r in rows]
        left.bar(labels, values, bottom=bottom, label=PHASE_LABELS[phase])
        bottom = [b + v for b, v in zip(bottom, values)]
    left.set(ylabel="seconds per step", title="where a step's time goes")
    left.legend(fontsize=8)
    right.bar(labels, [r["tokens_per_s"] for r in rows], color="tab:gray")
    right.set(ylabel="tokens/s", title="throughput and efficiency")
    efficiency = right.twinx()
    efficiency.plot(labels, [r["efficiency"] for r in rows], "o-", color="tab:red")
    efficiency.set(ylabel="efficiency vs the first point", ylim=(0, max(1.1, *[r["efficiency"] for r in rows])))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(report: dict, out_dir: str, title: str) -> dict[str, str]:
    """scaling.json, scaling.md and (when a point has figures) scaling.png in `out_dir`."""
    paths = {"json": os.path.join(out_dir, "scaling.json"), "table": os.path.join(out_dir, "scaling.md")}
    write_text_atomic(paths["json"], json.dumps(report, indent=2))
    write_text_atomic(paths["table"], f"# {title}\n\n{table(report)}\n")
    if report["base"] is not None:
        paths["plot"] = plot(report, os.path.join(out_dir, "scaling.png"), title)
    return paths
