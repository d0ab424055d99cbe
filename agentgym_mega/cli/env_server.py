"""`agentgym-mega env-server`: one environment kind served over the AgentGym HTTP protocol."""

from __future__ import annotations

import argparse
import sys

from agentgym_mega.cli.options import COUNT, add_server_security, bounded, command, port
from agentgym_mega.errors import BadInput
from envs import KINDS, limits
from envs.deepsearch.options import DeepSearchOptions
from envs.webarena.options import SITES, WebArenaOptions

# envs.server is imported when the command runs: its web stack (FastAPI, uvicorn) would slow
# every --help.


def add(sub) -> None:
    p = command(
        sub, "env-server", func=run,
        help="serve one environment kind (textcraft, babyai, sciworld, deepsearch, webarena) over HTTP",
        description=(
            "Hosts many instances of one environment in one process behind the AgentGym HTTP\n"
            "protocol (POST /create, /reset, /step, /close; GET /observation), so existing\n"
            "AgentGym clients work unchanged, plus POST /batch (many operations in one round trip),\n"
            "GET /health and GET /tasks. A step's action may be a whole model reply: the text after\n"
            "its last `Action:` is used (deepsearch: its first <search> or <answer> tag pair;\n"
            "webarena: the first action in triple backticks).\n"
            "Every reset/step answer adds episode_score (0-1) and success.\n"
            "Live instances are capped by memory: --memory-share of the memory available at start-up\n"
            "divided by one instance's measured cost (SciWorld 384 MiB, WebArena 128 MiB, BabyAI 64 KiB,\n"
            "Deep Search 16 KiB, TextCraft 8 KiB);\n"
            "--max-instances can only lower that. Past the cap /create answers 503 (server full);\n"
            "instances idle for --idle-timeout seconds are closed (a SciWorld JVM is ended).\n"
            "With a secret (--secret-file, or $AGENTGYM_MEGA_SECRET) every request but GET /health\n"
            "needs `Authorization: Bearer <secret>` (else 401). A --host other than loopback needs a\n"
            "secret unless --insecure."
        ),
    )
    p.add_argument("--env", required=True, choices=KINDS, help="environment kind to serve")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=port, default=36001, help="port to bind (default 36001; 0: any free one)")
    p.add_argument("--max-instances", type=COUNT, default=None,
                   help="cap on live instances, below the memory cap (default: the memory cap)")
    p.add_argument("--memory-share", type=bounded(float, 0, "a fraction in (0, 1]"), default=None,
                   help=f"share of the memory available at start-up that instances may fill (default "
                        f"${limits.MEMORY_SHARE_ENV}, else {limits.MEMORY_SHARE}); servers sharing a machine "
                        "should split it")
    p.add_argument("--idle-timeout", type=bounded(float, 0, "a number of seconds > 0"), default=600.0,
                   help="close instances unused for this many seconds (default 600)")
    add_server_security(p)
    p.add_argument("--max-batch-ops", type=COUNT, default=limits.MAX_BATCH_OPS,
                   help="most operations in one POST /batch; more answers 413 (default %(default)s)")
    p.add_argument("--max-action-chars", type=COUNT, default=limits.MAX_ACTION_CHARS,
                   help="longest action in characters; longer answers 400 (default %(default)s)")
    p.add_argument("--option", action="append", default=[], type=_key_value, metavar="KEY=VALUE",
                   help="an option of the environment kind, repeatable (deepsearch: "
                        f"{', '.join(DeepSearchOptions.__dataclass_fields__)}; webarena: "
                        f"{', '.join(k for k in WebArenaOptions.__dataclass_fields__ if k != 'sites')}; "
                        "docs/environments.md)")
    p.add_argument("--site", action="append", default=[], type=_key_value, metavar="NAME=URL",
                   help=f"webarena: the URL of a site its tasks name, repeatable ({', '.join(SITES)}); "
                        "shopping defaults to the shipped shop, started by the server")


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE, e.g. retriever_url=http://127.0.0.1:8000")
    return key.strip(), value


def _env_options(args) -> dict:
    options = dict(args.option)
    if args.site:
        if args.env != "webarena":
            raise BadInput(f"--site is an option of webarena, not of {args.env}")
        options["sites"] = {**options.get("sites", {}), **dict(args.site)}
    return options


def run(args) -> int:
    from envs.server import make_server, read_secret_file

    try:
        secret = read_secret_file(args.secret_file) if args.secret_file else None
        server = make_server(args.env, args.host, args.port, args.max_instances, args.idle_timeout,
                             secret=secret, insecure=args.insecure, memory_share=args.memory_share,
                             max_body_bytes=args.max_body_bytes, max_batch_ops=args.max_batch_ops,
                             max_action_chars=args.max_action_chars, env_options=_env_options(args))
    except ValueError as exc:  # a setting that is not allowed (make_server names it)
        raise BadInput(str(exc)) from None
    state = server.config.app.state
    sock = server.config.bind_socket()  # bound before the line below, so it names the port 0 got
    print(f"serving {args.env} on http://{args.host}:{sock.getsockname()[1]} (cap {state.pool.max_instances} "
          f"instances: {state.pool.cap_reason}; idle timeout {args.idle_timeout:g} s; "
          f"authentication {'on' if state.secured else 'off'})", file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    return 0

