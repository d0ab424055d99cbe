"""The horizon study's figures, from its runs' metrics.jsonl: per arm, held-out success at every
evaluation (mean and spread over seeds), episode length, and the training reward's spread per step
(the paper's sign of instability); written as a Markdown table, a PNG and the --json report.

A mean or spread at a step is over the seeds that logged a value there: a seed missing an
evaluation (still running, or failed) is left out of that step, not counted as 0. Spreads are the
population standard deviation (ddof 0): the spread of these seeds, 0 for one seed, not an estimate
of every seed's.
"""

from __future__ import annotations

import os
import statistics
from typing import TYPE_CHECKING

from agentgym_mega.files import write_text_atomic

if TYPE_CHECKING:
    from agentgym_mega.study import Arm

# matplotlib is imported by `plot` only.

SUCCESS, TURNS, REWARD_STD = "eval/success", "episode/turns_mean", "reward/std"
# the --json report's keys per arm, in order
JSON_ARM_KEYS = ("name", "schedule", "caps", "interval", "seeds", "final_success", "final_mean", "final_std", "curve")


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.pstdev(values)


def curve(runs: list[dict[int, dict]], key: str) -> list[list[float]]:
    """[[step, mean, std]] over the seeds' runs (each {step: record}) at every step where one
    logged `key`, in step order."""
    steps = sorted({step for records in runs for step, record in records.items() if key in record})
    return [[step, *mean_std([records[step][key] for records in runs if key in records.get(step, {})])]
            for step in steps]


def late_mean(runs: list[dict[int, dict]], key: str, steps: int) -> float | None:
    """The mean of `key` over every seed's steps in the last third of the run (after step
    2/3 of `steps`); None when none logged it there."""
    values = [record[key] for records in runs for step, record in records.items()
              if 3 * step > 2 * steps and key in record]
    return statistics.fmean(values) if values else None


def summarize(arm: Arm, seeds: list[int], runs: list[dict[int, dict]], steps: int) -> dict:
    """An arm's figures from its seeds' runs ({step: record} each, in `seeds`' order). A seed's
    final success is its evaluation at the last step (None until it has one)."""
    finals = [records.get(steps, {}).get(SUCCESS) for records in runs]
    known = [f for f in finals if f is not None]
    final_mean, final_std = mean_std(known) if known else (None, None)
    turns = [record[TURNS] for records in runs for record in records.values() if TURNS in record]
    return {"name": arm.name, "schedule": arm.schedule, "caps": list(arm.caps), "interval": arm.interval,
            "seeds": seeds, "final_success": finals, "final_mean": final_mean, "final_std": final_std,
            "curve": curve(runs, SUCCESS), "turns_mean": statistics.fmean(turns) if turns else None,
            "turns_curve": curve(runs, TURNS), "reward_std_late": late_mean(runs, REWARD_STD, steps),
            "reward_std_curve": curve(runs, REWARD_STD), "boundaries": arm.boundaries(steps)}


def to_json(arms: list[dict], levels: list[str] | None, steps: int, evaluation: dict) -> dict:
    """The --json report: per arm JSON_ARM_KEYS; the levels (env.categories), the steps per run,
    and the evaluation's tasks, samples per task and turn limit."""
    return {"arms": [{key: arm[key] for key in JSON_ARM_KEYS} for arm in arms], "levels": levels, "steps": steps,
            "eval": {key: evaluation[key] for key in ("tasks", "n", "max_turns")}}


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _caps(arm: dict) -> str:
    caps = " -> ".join(map(str, arm["caps"]))
    return caps if arm["interval"] is None else f"{caps}, every {arm['interval']} steps"


def table(arms: list[dict]) -> str:
    """One row per arm: final held-out success (mean ± std over seeds, and each seed's), the
    training episodes' mean turns, and the reward's mean spread per step over the last third."""
    head = ["arm", "schedule", "caps", "final success (mean ± std)", "per seed", "mean turns",
            "reward std (last third)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm in arms:
        final = "-" if arm["final_mean"] is None else f"{arm['final_mean']:.3f} ± {arm['final_std']:.3f}"
        seeds = ", ".join(_num(f) for f in arm["final_success"])
        cells = [arm["name"], arm["schedule"], _caps(arm), final, seeds, _num(arm["turns_mean"], 2),
                 _num(arm["reward_std_late"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(arms: list[dict], path: str, title: str) -> str:
    """Held-out success per arm with its seed band (mean ± std), beside the training reward's
    spread and the episodes' turns per step; the first ScalingInter arm's stage ends marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("curve", "held-out success"), ("reward_std_curve", "training reward std per step"),
              ("turns_curve", "training episode turns"))
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4.5))
    stages = next((arm for arm in arms if arm["boundaries"]), None)
    for ax, (key, label) in zip(axes, panels):
        for arm in arms:
            if not arm[key]:
                continue
            steps, means, stds = zip(*arm[key])
            line, = ax.plot(steps, means, "o-" if key == "curve" else "-", label=arm["name"], markersize=3)
            ax.fill_between(steps, [m - s for m, s in zip(means, stds)], [m + s for m, s in zip(means, stds)],
                            color=line.get_color(), alpha=0.2)
        for boundary, cap in zip(stages["boundaries"] if stages else [], stages["caps"][1:] if stages else []):
            ax.axvline(boundary + 0.5, color="grey", linestyle=":", linewidth=1)  # between the stages' steps
            ax.text(boundary + 0.5, 1.0, f" cap {cap}", fontsize=8, color="grey", transform=ax.get_xaxis_transform(),
                    va="top")
        ax.set(xlabel="step", title=label)
    axes[0].set(ylim=(0, 1.05), ylabel="success (mean ± std over seeds)")
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(arms: list[dict], out_dir: str, title: str) -> dict[str, str]:
    """OUT/study.md (the title and the table) and OUT/study.png."""
    paths = {"table": os.path.join(out_dir, "study.md"), "plot": os.path.join(out_dir, "study.png")}
    write_text_atomic(paths["table"], f"# {title}\n\n{table(arms)}\n")
    plot(arms, paths["plot"], title)
    return paths
