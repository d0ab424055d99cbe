"""`agentgym-mega study horizon`: the paper's horizon experiment, arms x seeds of `train` runs."""

from __future__ import annotations

import os

from agentgym_mega.cli.options import COUNT, command, counts, json_option, overrides_option, write_json
from agentgym_mega.errors import BadInput

# The study, its configs and its report are imported when the command runs: they pull in Ray, the
# config schema and matplotlib; --help should pay for none of them.

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "study_horizon_cpu.yaml")
ARMS = "scaling_inter,short,long"


def add(sub) -> None:
    p = command(
        sub, "study",
        help="experiments of several training runs: horizon (ScalingInter against fixed turn caps, over seeds)",
        description=(
            "An experiment as one command: several `train` runs of one base config, one after\n"
            "another, each in its own directory, resumable, reported together (table, PNG, JSON).\n"
            "\n"
            "horizon: the paper's horizon claim. ScalingInter-RL (the turn cap grows in stages)\n"
            "against a short and a long fixed cap, each arm over several training seeds.\n"
            "See `agentgym-mega study horizon --help`."
        ),
    )
    experiments = p.add_subparsers(dest="experiment", required=True, metavar="<experiment>")
    p = command(
        experiments, "horizon", func=run,
        help="ScalingInter against a short and a long fixed turn cap, over seeds",
        description=(
            "Arms that share one base config (--config) but their horizon schedule:\n"
            "scaling_inter (the caps in stages of --interval steps), short (fixed at the first cap),\n"
            "long (fixed at the last); an arm named with the suffix _gigpo (e.g. scaling_inter_gigpo)\n"
            "trains with algorithm.estimator=gigpo algorithm.gamma=0.95. Each arm trains --seeds times\n"
            "(trainer.seed = the config's + k, all from the same model.path), each a normal `train`\n"
            "run in OUT/<arm>/seed_<k>/, one after another, with a progress line per step.\n"
            "\n"
            "Killed, the same command goes on: finished runs are not redone, an unfinished one resumes\n"
            "from its checkpoint; other arguments than OUT/study.json records are refused (exit 2).\n"
            "Output: per arm, held-out success at each evaluation (mean and std over seeds), episode\n"
            "turns and the training reward's std per step, as OUT/study.md (a table, also printed),\n"
            "OUT/study.png (a curve and seed band per arm, ScalingInter's stages marked) and --json.\n"
            "--quick: 1 seed, two steps per stage, small batches and a few evaluation tasks: it checks\n"
            "that the command works; no conclusion is drawn from it."
        ),
    )
    p.add_argument("--config", default=CONFIG, help="the base config (default configs/study_horizon_cpu.yaml)")
    p.add_argument("--arms", default=ARMS, type=lambda s: [a.strip() for a in s.split(",") if a.strip()],
                   help=f"comma list of arms (default {ARMS}; each also with the suffix _gigpo)")
    p.add_argument("--seeds", type=COUNT, help="training seeds per arm (default 3; 1 with --quick)")
    p.add_argument("--caps", type=counts, help="turn caps, e.g. 4,8,12 (default: the config's horizon.caps)")
    p.add_argument("--interval", type=COUNT, help="steps per ScalingInter stage (default: the config's; 2 with "
                                                  "--quick)")
    p.add_argument("--quick", action="store_true", help="a small study that checks the command works")
    p.add_argument("--out", help="the study's directory (default runs/study/horizon, runs/study/horizon-quick "
                                 "with --quick)")
    p.add_argument("--report-only", action="store_true", help="run nothing: report the runs already in --out")
    json_option(p, "also write the report as JSON here")
    overrides_option(p)


def run(args) -> int:
    from agentgym_mega import study, study_report

    out_dir = os.path.abspath(args.out or os.path.join("runs", "study", "horizon-quick" if args.quick else "horizon"))
    seeds = args.seeds or (1 if args.quick else 3)
    plan = study.prepare(args.config, args.overrides, args.arms, seeds, args.caps, args.interval, args.quick, out_dir)
    if not args.report_only:
        _require_base(plan)
    study.check_settings(plan, record=not args.report_only)
    if not args.report_only:
        code = study.run_all(plan)
        if code:
            return code
    figures = study.summaries(plan)
    title = (f"horizon study: {', '.join(plan.cfg.env.categories or [plan.cfg.env.name])}, {seeds} seed(s), "
             f"{plan.cfg.trainer.total_steps} steps per run")
    if args.quick:
        title += " (--quick: checks the command works; no conclusion is drawn from it)"
    paths = study_report.write(figures, out_dir, title)
    print(study_report.table(figures))
    write_json(args.json, study.report(plan, figures))
    print("wrote " + ", ".join([*paths.values(), *([args.json] if args.json else [])]))
    return 0


def _require_base(plan) -> None:
    """Checked before any run starts: every arm and seed starts from this base policy."""
    path = plan.cfg.model.path
    if not os.path.isfile(os.path.join(path, "config.json")):
        levels = ",".join(plan.cfg.env.categories or [])
        raise BadInput(f"model.path={path!r} is not a Hugging Face model directory (no config.json). Every run "
                       f"starts from it; a base for the study's levels: agentgym-mega pretrain-tiny --out {path} "
                       f"--categories {levels} --max-turns {plan.settings['caps'][-1]}")
