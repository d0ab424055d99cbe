"""`agentgym-mega config-reference`: docs/configuration.md rendered from the config schema."""

from __future__ import annotations

from agentgym_mega.cli.options import command

# Imported when the command runs: the config schema (pydantic, YAML) would slow every --help.


def add(sub) -> None:
    p = command(
        sub, "config-reference", func=run,
        help="write docs/configuration.md from the config schema, or check it is current",
        description=(
            "Renders every config section and key (type, default, description) from\n"
            "agentgym_mega/config.py as Markdown. --check writes nothing and exits 1 when the file differs."
        ),
    )
    p.add_argument("--out", help="the page to write or check (default: docs/configuration.md of this checkout)")
    p.add_argument("--check", action="store_true", help="exit 1 with a message when the page is stale")


def run(args) -> int:
    from agentgym_mega import config_reference

    return config_reference.run(args.out, args.check)
