"""`agentgym-mega`: one subcommand per capability, each a module of this package. A module's
add(sub) registers its parser and names the function that runs it; that function parses nothing
and calls into the library."""

from __future__ import annotations

import argparse
import sys

from agentgym_mega.cli import (
    bench,
    config,
    config_reference,
    doctor,
    env_server,
    evaluate,
    make_tiny_model,
    plan,
    preflight,
    pretrain_tiny,
    report,
    retriever,
    scaling,
    show,
    study,
    train,
)
from agentgym_mega.errors import EXIT_BAD_INPUT, BadInput

# In the order `agentgym-mega --help` lists them; a new subcommand is a module with add(sub) and
# one entry here.
COMMANDS = (config, train, evaluate, report, show, plan, scaling, study, make_tiny_model, pretrain_tiny, doctor,
            env_server, retriever, bench, config_reference, preflight)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentgym-mega",
        description="Multi-turn agentic RL (AgentGym-RL, ScalingInter-RL) on megatron-core + vLLM.",
        epilog="Run `agentgym-mega <command> --help` for each command's options.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="<command>")
    for command in COMMANDS:
        command.add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BadInput as exc:
        print(f"agentgym-mega {args.command}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
