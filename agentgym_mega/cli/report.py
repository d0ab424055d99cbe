"""`agentgym-mega report`: a run directory as one self-contained HTML page."""

from __future__ import annotations

from agentgym_mega.cli.options import command

# The report package (jinja2, matplotlib) is imported when the command runs, not for every --help.


def add(sub) -> None:
    p = command(
        sub, "report", func=run,
        help="write a run's report: one self-contained HTML page with curves, evals and episodes",
        description=(
            "Reads a run directory (trainer.output_dir: metrics.jsonl, config.yaml, eval/step_N.json,\n"
            "episodes/step_N.jsonl) and writes one HTML file that needs nothing else: open it from\n"
            "file:// on a laptop or a login node. It shows the run at a glance (config, steps, time per\n"
            "phase), curves (reward, success, held-out success per category with the turn-cap stages,\n"
            "KL, entropy, clip fraction), the evaluation tables, an episode browser (filters by step,\n"
            "split, category, status and success, text search, each episode turn by turn) and each\n"
            "held-out task's samples at every evaluation side by side."
        ),
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory (trainer.output_dir)")
    p.add_argument("--out", help="the HTML file to write (default RUN_DIR/report.html)")


def run(args) -> int:
    from agentgym_mega.report import build

    print(f"report: {build(args.run_dir, args.out)} (open it in a browser: one file, no network needed)")
    return 0
