"""`agentgym-mega show`: a run's saved episodes printed turn by turn in the terminal."""

from __future__ import annotations

import sys

from agentgym_mega.cli.options import COUNT, bounded, command

EXIT_NONE_MATCH = 1


def step_arg(text: str) -> int | str:
    return "last" if text == "last" else bounded(int, 0, "a step number >= 0 or `last`")(text)


def add(sub) -> None:
    # not episode_view: it imports rich, which `agentgym-mega --help` need not load
    from agentgym_mega.episodes import SPLITS
    from agentgym_mega.rollout.status import STATUSES

    p = command(
        sub, "show", func=run,
        help="print a run's saved episodes turn by turn: reply, action, reward, observation",
        description=(
            "Reads RUN_DIR/episodes/step_N.jsonl (written with logging.episodes on) and prints each\n"
            "matching episode: a header (step, split, env, task, category, status, score, success,\n"
            "weights version, turns, tokens), then per turn the model's reply, the action the env\n"
            "parsed from it or why none parsed, the reward and the observation (folded past a few\n"
            "hundred characters unless --full). Ordered by step, split (train first), task.\n"
            "Exit code 1 when no episode matches, 2 when RUN_DIR has no episodes/."
        ),
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a training run's directory (trainer.output_dir)")
    p.add_argument("--step", type=step_arg, help="only this step (a number, or `last`)")
    p.add_argument("--split", choices=SPLITS, help="only training or only evaluation episodes")
    p.add_argument("--task", help="only this task id")
    p.add_argument("--category", help="only this category (TextCraft depth, BabyAI level, ...)")
    p.add_argument("--status", choices=STATUSES, help="only episodes that ended so")
    outcome = p.add_mutually_exclusive_group()
    outcome.add_argument("--success", dest="success", action="store_true", default=None,
                         help="only successful episodes")
    outcome.add_argument("--failed", dest="success", action="store_false", help="only failed episodes")
    p.add_argument("--limit", type=COUNT, help="at most this many episodes (the first in order)")
    p.add_argument("--full", action="store_true", help="print long observations whole instead of folded")


def run(args) -> int:
    from rich.console import Console

    from agentgym_mega.episode_view import read_episodes, render_episode, saved_steps

    episodes = read_episodes(args.run_dir, step=args.step, split=args.split, task=args.task, status=args.status,
                             success=args.success, category=args.category, limit=args.limit)
    if not episodes:
        steps = ", ".join(map(str, saved_steps(args.run_dir))) or "none"
        print(f"agentgym-mega show: no episode in {args.run_dir} matches these filters (steps saved: {steps})",
              file=sys.stderr)
        return EXIT_NONE_MATCH
    # highlight=False: rich would otherwise colour numbers and quotes inside the episode text.
    console = Console(highlight=False)
    for episode in episodes:
        console.print(render_episode(episode, args.full))
    return 0

