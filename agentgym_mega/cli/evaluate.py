"""`agentgym-mega eval`: Avg@n, Pass@n, success and valid-action rate of a model on an environment split."""

from __future__ import annotations

from agentgym_mega import evaluation
from agentgym_mega.cli.options import (
    COUNT,
    REPORT_JSON,
    command,
    json_option,
    overrides_option,
    require_hf_dir,
    write_json,
)

# Imported when the command runs: the config schema (pydantic, YAML) would slow every --help.


def add(sub) -> None:
    p = command(
        sub, "eval", func=run,
        help="evaluate a model on an environment split: Avg@n and Pass@n per category",
        description=(
            "The AgentGym protocol: --n samples per task at rollout.temperature, the environment's\n"
            "evaluation turn limit (BabyAI 20, TextCraft and SciWorld 30) unless --max-turns, through\n"
            "real env servers and the config's vLLM engines (rollout.num_engines, placed as in\n"
            "training). Prints Avg@n (mean score) and Pass@n (share of tasks with a sample scoring\n"
            "> 0), the success rate and the valid-action rate (share of replies the env server parsed\n"
            "as an action) overall and per category (TextCraft depth, BabyAI level, SciWorld task). A megatron\n"
            "checkpoint (--ckpt) is exported to HF first."
        ),
    )
    p.add_argument("--config", required=True, help="YAML config (env, rollout settings)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", help="Hugging Face model directory")
    source.add_argument("--ckpt", help="megatron checkpoint (a directory, or a root with `latest`)")
    p.add_argument("--n", type=COUNT, help="samples per task (default eval.n)")
    p.add_argument("--split", choices=["train", "test"], help="task split (default eval.split)")
    p.add_argument("--limit", type=COUNT, help="only the first N tasks of the split (default eval.limit)")
    p.add_argument("--max-turns", type=COUNT, help="turn cap (default eval.max_turns, else the environment's)")
    json_option(p, REPORT_JSON)
    overrides_option(p)


def run(args) -> int:
    from agentgym_mega.config import load_config

    if args.hf:
        require_hf_dir("--hf", args.hf)
    cfg = load_config(args.config, args.overrides)
    pick = lambda flag, key: getattr(cfg.eval, key) if flag is None else flag  # noqa: E731
    report = evaluation.run(cfg, args.hf, args.ckpt, pick(args.n, "n"), pick(args.split, "split"),
                            pick(args.limit, "limit"), pick(args.max_turns, "max_turns"))
    print(evaluation.table(report))
    write_json(args.json, report)
    return 0

