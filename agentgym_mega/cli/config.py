"""`agentgym-mega config`: a config resolved, validated and printed."""

from __future__ import annotations

import sys

from agentgym_mega.cli.options import command, overrides_option

# Imported when the command runs: the config schema (pydantic, YAML) would slow every --help.


def add(sub) -> None:
    p = command(
        sub, "config", func=run,
        help="validate a config and print it with includes and overrides applied",
        description=(
            "Loads a YAML config (following its `include:` files), applies dotted overrides such as\n"
            "trainer.total_steps=50 or horizon.caps=[6,13,20], validates every key, and prints the\n"
            "resolved config. Exit code 2 and a message naming the key on any invalid value."
        ),
    )
    p.add_argument("--config", help="YAML file; omitted: the built-in defaults")
    p.add_argument("--out", help="write the resolved YAML here instead of stdout")
    overrides_option(p)


def run(args) -> int:
    from agentgym_mega.config import dump_yaml, load_config

    cfg = load_config(args.config, args.overrides)
    text = dump_yaml(cfg)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0

