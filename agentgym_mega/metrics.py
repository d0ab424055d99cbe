"""Run metrics: one JSONL line and TensorBoard scalars per step, and episode statistics."""

from __future__ import annotations

import json
import os
import statistics
import time
from contextlib import contextmanager

from agentgym_mega.rollout.status import Status

# TensorBoard and matplotlib are imported where they are used: TensorBoard only with
# logging.tensorboard, matplotlib for the one plot at a run's end, not at the driver's start-up.


def valid_action_rate(episodes) -> float:
    """The share of replies the env servers parsed as an action, over all replies of `episodes`
    (0 when there are none)."""
    return sum(e.valid_actions for e in episodes) / max(1, sum(e.turns for e in episodes))


def episode_metrics(batch) -> dict:
    """Reward, success, valid-action rate, turns, lengths and how episodes ended, over a rollout
    batch. Reward, success, valid-action rate and group spread cover only the trained episodes
    (those that ended on an env error or a timeout are counted in `episode/env_errors` and
    `episode/timeouts`, and trained on by nobody)."""
    episodes = batch.episodes
    valid = [e for e in episodes if e.trained]
    n, n_valid = max(1, len(episodes)), max(1, len(valid))
    count = lambda status: sum(e.status == status for e in episodes)  # noqa: E731
    groups: dict[int, list[float]] = {}
    for e in valid:
        groups.setdefault(e.group_id, []).append(e.score)
    return {
        "reward/mean": sum(e.score for e in valid) / n_valid,
        "reward/success_rate": sum(e.success for e in valid) / n_valid,
        # the paper's sign of instability: a long horizon's scores spread (population std, ddof 0)
        "reward/std": statistics.pstdev([e.score for e in valid]) if valid else 0.0,
        # GRPO and RLOO learn only from tasks whose samples scored differently
        "reward/groups_with_spread": sum(max(g) > min(g) for g in groups.values()) / max(1, len(groups)),
        "episode/valid_action_rate": valid_action_rate(valid),
        "episode/turns_mean": sum(e.turns for e in episodes) / n,
        "episode/response_tokens_mean": sum(e.response_tokens for e in episodes) / n,
        "episode/done": count(Status.DONE),
        "episode/horizon": count(Status.HORIZON),
        "episode/truncated": count(Status.TRUNCATED),
        "episode/env_errors": count(Status.ENV_ERROR),
        "episode/timeouts": count(Status.TIMEOUT),
    }


def sync_metrics(stats) -> dict:
    """A weight sync's transfer (weight_sync.SyncStats): payload, rate per receiver, and where the
    time went (producing the tensors on the trainer: the TP/PP gather; the slowest engine's
    in-place load after the last byte); nothing when only a retry went through."""
    if stats is None:
        return {}
    return {"sync/bytes": stats.bytes, "sync/buckets": stats.buckets, "sync/gbps": stats.gbps,
            "sync/gather_s": stats.source_seconds, "sync/engine_load_s": stats.load_seconds}


class Timer:
    """Wall-clock seconds per phase of a step: `with timer("generate"): ...`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict:
        return {f"time/{k}_s": v for k, v in self.seconds.items()}


class MetricsLogger:
    def __init__(self, output_dir: str, logging_cfg):
        os.makedirs(output_dir, exist_ok=True)
        # Opened at the first line: a metrics.jsonl that exists holds a step (what launchers and
        # tests wait for), not just a run that started.
        self._jsonl_path = os.path.join(output_dir, "metrics.jsonl") if logging_cfg.jsonl else None
        self.jsonl = None
        self.tb = None
        if logging_cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))

    def log(self, step: int, metrics: dict) -> None:
        if self._jsonl_path and self.jsonl is None:
            self.jsonl = open(self._jsonl_path, "a")
        if self.jsonl:
            self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
            self.jsonl.flush()
        if self.tb:
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, step)
            self.tb.flush()

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()


def read_metrics(output_dir: str) -> dict[int, dict]:
    """A run's ``metrics.jsonl`` as one record per step: a step's lines merged, a later line's keys
    winning (a resumed run appends again the steps after its checkpoint)."""
    records: dict[int, dict] = {}
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            records[record["step"]] = records.get(record["step"], {}) | record
    return records


def plot_rewards(output_dir: str, title: str = "", window: int = 10) -> str:
    """Writes ``reward_curve.png`` from the run's ``metrics.jsonl``: training reward and success
    per step (raw and a ``window``-step moving average), held-out evaluations as points, and the
    turn cap's stages. Returns the file's path."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training nodes
    import matplotlib.pyplot as plt

    records = read_metrics(output_dir)
    steps = sorted(s for s, r in records.items() if "reward/mean" in r)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key, label, color in (("reward/mean", "reward", "tab:blue"), ("reward/success_rate", "success", "tab:green")):
        values = [records[s][key] for s in steps]
        smooth = [sum(values[max(0, i - window + 1): i + 1]) / len(values[max(0, i - window + 1): i + 1])
                  for i in range(len(values))]
        ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(steps, smooth, color=color, label=f"train {label} ({window}-step mean)")
    evals = sorted(s for s, r in records.items() if "eval/success" in r)
    if evals:
        ax.plot(evals, [records[s]["eval/success"] for s in evals], "o--", color="tab:red", label="held-out success")
    caps = [(s, records[s].get("horizon/turn_cap")) for s in steps]
    for (_, before), (step, cap) in zip(caps, caps[1:]):
        if cap != before:
            ax.axvline(step, color="grey", linestyle=":", linewidth=1)
            ax.text(step, 1.02, f"turn cap {cap}", fontsize=8, color="grey")
    ax.set(xlabel="step", ylabel="score", ylim=(0, 1.08), title=title or os.path.abspath(output_dir))
    ax.legend(loc="lower right", fontsize=8)
    path = os.path.join(output_dir, "reward_curve.png")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
