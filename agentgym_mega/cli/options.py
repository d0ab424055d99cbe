"""What several subcommands share: argument types (a bad value exits 2 with argparse's message
naming the option) and the parts their parsers and runs have in common."""

from __future__ import annotations

import argparse
import json
import os

from agentgym_mega.errors import BadInput
from envs import limits

FORMAT = argparse.RawDescriptionHelpFormatter
BENCH_JSON = "write the report here"
REPORT_JSON = "also write the report as JSON here"


def bounded(kind, low, what: str):
    """An argparse type: `kind` parsed and at least `low` (> `low` for floats), else exit 2."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if value < low or (kind is float and value == low):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value
    return parse


COUNT = bounded(int, 1, "an integer >= 1")


def port(text: str) -> int:
    value = bounded(int, 0, "a port in 0-65535")(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port in 0-65535")
    return value


def counts(text: str) -> list[int]:
    parse = bounded(int, 1, "a comma list of integers >= 1, e.g. 1,16,64,256")
    return [parse(item.strip()) for item in text.split(",")]


def name_list(allowed: tuple[str, ...], what: str):
    """An argparse type: a comma list of names from `allowed`, else exit 2 naming the unknown."""
    def parse(text: str) -> list[str]:
        given = [t.strip() for t in text.split(",")]
        unknown = [t for t in given if t not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {what} {unknown}; allowed: {', '.join(allowed)}")
        return given
    return parse


def command(sub, name: str, help: str, description: str, **defaults) -> argparse.ArgumentParser:
    """Adds subcommand `name`; `defaults` name what runs it (func=, or run= for a benchmark)."""
    p = sub.add_parser(name, formatter_class=FORMAT, help=help, description=description)
    p.set_defaults(**defaults)
    return p


def json_option(p, help: str) -> None:
    p.add_argument("--json", help=help)


def overrides_option(p) -> None:
    p.add_argument("overrides", nargs="*", metavar="section.key=value")


def add_shape_args(p, kv_heads: int, vocab: int) -> None:
    p.add_argument("--layers", type=COUNT, default=2)
    p.add_argument("--hidden", type=COUNT, default=128)
    p.add_argument("--heads", type=COUNT, default=2)
    p.add_argument("--kv-heads", type=COUNT, default=kv_heads, help="key/value heads (GQA); divides --heads")
    p.add_argument("--vocab", type=COUNT, default=vocab, help="BPE vocabulary and model vocab size")
    p.add_argument("--ffn", type=COUNT, default=None, help="MLP width (default 3 x hidden)")
    p.add_argument("--seed", type=int, default=0)


def validate_spec(spec) -> None:
    try:
        spec.validate()
    except ValueError as exc:
        raise BadInput(str(exc)) from None


def write_json(path: str | None, report: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)


def require_hf_dir(what: str, path: str) -> None:
    """Checked before anything starts: a bad model path should not cost a Ray and engine start-up."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise BadInput(f"{what}={path!r} is not a Hugging Face model directory (no config.json)")


def add_server_security(p) -> None:
    """What every server of ours takes: a cap on request bodies, the shared secret, --insecure."""
    p.add_argument("--max-body-bytes", type=COUNT, default=limits.MAX_BODY_BYTES,
                   help="largest request body; larger answers 413 (default %(default)s)")
    p.add_argument("--secret-file", help="file holding the shared secret clients must send as a Bearer token "
                                         f"(default: ${limits.SECRET_ENV}, else no authentication)")
    p.add_argument("--insecure", action="store_true",
                   help="allow a --host other than loopback without a secret")
