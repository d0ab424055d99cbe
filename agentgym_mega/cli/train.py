"""`agentgym-mega train`: the RL run of a config, stopped cleanly by SIGUSR1 or SIGTERM."""

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
            "SIGUSR1 (Slurm's warning before the time limit, --signal=B:USR1@SECONDS) or SIGTERM\n"
            "(Slurm's preemption, scancel) stops the run after the current step with a checkpoint and\n"
            "exit code 75 (at once, before anything starts, when it comes while the config loads); the\n"
            "same command with --resume goes on at the next step, turn cap and task-sampler position.\n"
            "Under Slurm, AGM_STOP_LEAD_S (the seconds between that warning and the time limit) is\n"
            "checked against the plan's estimate of a step plus a checkpoint save, written at\n"
            "AGM_CHECKPOINT_WRITE_GBPS GB/s (default 1): a warning when they do not fit."
        ),
    )
    p.add_argument("--config", required=True, help="YAML config (see configs/)")
    p.add_argument("--resume", nargs="?", const="latest", choices=["latest", "auto"],
                   help="continue from the latest checkpoint in trainer.output_dir (an error when there is "
                        "none); `--resume auto` starts fresh when there is none")
    overrides_option(p)


STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


def stop_on_signals() -> threading.Event:
    """An event that SIGUSR1 (Slurm's warning before the time limit) and SIGTERM (Slurm's
    preemption, unless the site sets PreemptParameters=send_user_signal; scancel) set: the run
    stops after its current step with a checkpoint instead of dying of either."""
    stop = threading.Event()
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda *_: stop.set())
    return stop


def run(args) -> int:
    # From the first moment: either signal's default action would kill a run still starting up.
    stop = stop_on_signals()
    from agentgym_mega.config import load_config
    from agentgym_mega.trainer import STOPPED_EXIT_CODE, Stopped, train

    cfg = load_config(args.config, args.overrides)
    require_hf_dir("model.path", cfg.model.path)
    if stop.is_set():  # no step to save: starting Ray and the engines would only spend the grace time
        print(f"agentgym-mega train: stopped on request before training started; exit {STOPPED_EXIT_CODE}",
              file=sys.stderr)
        return STOPPED_EXIT_CODE
    try:
        train(cfg, resume=args.resume, stop=stop)
    except Stopped as stopped:
        print(f"agentgym-mega train: {stopped}; exit {STOPPED_EXIT_CODE}", file=sys.stderr)
        return STOPPED_EXIT_CODE
    return 0

