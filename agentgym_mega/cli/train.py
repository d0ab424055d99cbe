"""`agentgym-mega train`: the RL run of a config, stopped cleanly by SIGUSR1."""

from __future__ import annotations

import signal
import sys
import threading

from agentgym_mega.cli.options import command, overrides_option, require_hf_dir

# Imported when the command runs: the trainer pulls in torch, Ray and megatron, the config schema
# pydantic; --help should pay for none of them.


def add(sub) -> None:
    p = command(
        sub, "train", func=run,
        help="run multi-turn agentic RL (GRPO/PPO/REINFORCE++/RLOO with a ScalingInter horizon)",
        description=(
            "Starts Ray, the environment servers (or uses env.server_urls), vLLM engines and the\n"
            "megatron-core actor (plus reference policy and critic when configured), then loops:\n"
            "rollout -> log-probs -> advantages -> updates -> weight sync -> log -> checkpoint.\n"
            "Metrics go to OUTPUT_DIR/metrics.jsonl and OUTPUT_DIR/tensorboard; checkpoints to\n"
            "OUTPUT_DIR/checkpoints (trainer.output_dir). --resume continues from the latest one.\n"
            "SIGUSR1 (Slurm: --signal=B:USR1@300) stops the run after the current step with a\n"
            "checkpoint and exit code 75; the same command with --resume goes on at the next step,\n"
            "turn cap and task-sampler position."
        ),
    )
    p.add_argument("--config", required=True, help="YAML config (see configs/)")
    p.add_argument("--resume", nargs="?", const="latest", choices=["latest", "auto"],
                   help="continue from the latest checkpoint in trainer.output_dir (an error when there is "
                        "none); `--resume auto` starts fresh when there is none")
    overrides_option(p)


def run(args) -> int:
    # From the first moment: SIGUSR1's default action would kill a run still starting up.
    stop = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: stop.set())
    from agentgym_mega.config import load_config
    from agentgym_mega.trainer import STOPPED_EXIT_CODE, Stopped, train

    cfg = load_config(args.config, args.overrides)
    require_hf_dir("model.path", cfg.model.path)
    try:
        train(cfg, resume=args.resume, stop=stop)
    except Stopped as stopped:
        print(f"agentgym-mega train: {stopped}; exit {STOPPED_EXIT_CODE}", file=sys.stderr)
        return STOPPED_EXIT_CODE
    return 0

