"""The AgentGym HTTP protocol over an `InstancePool`, plus `/batch`, `/health` and `/tasks`.

Original AgentGym clients work unchanged: `/create` (with or without a body; TextCraft's body
`{"minecraft_dir", "commands", "goal"}` also starts the episode data_idx = id and answers its first
observation, as the original did), `/reset`, `/step`, `/observation`, `/close` with the same bodies
and fields; for a kind with `env_idx_task` (Deep Search) also AgentGym's env_idx dialect, where
/create with a body answers a bare id and later requests carry `env_idx`. Errors are JSON
`{"error": ...}` with a meaningful status (the original answered 200 or FastAPI's 422): 400 bad
input, 401 no or a wrong secret, 404 unknown id, 409 episode state, 413 too large, 500 a failed
instance, 503 server full.

Every reset and step answer (single or batched) carries `episode_score` (on [0, 1]) and
`success` beside AgentGym's fields; `envs` defines them for each environment.

`POST /batch` `{"ops": [{"op": "step", "id": 3, "action": "..."}, ...]}` runs many operations in
one round trip and answers `{"results": [...]}` in the same order, each result the single
endpoint's answer or `{"error", "status"}`; one bad item never fails the others.

Limits: a request body over `max_body_bytes` answers 413 (checked against Content-Length before
reading, and while a chunked body streams), a /batch over `max_batch_ops` operations 413, an
action over `max_action_chars` characters 400. With a secret, every request but `GET /health`
must carry `Authorization: Bearer <secret>` or gets 401 before anything else runs. A server bound
to an address other than loopback needs a secret unless `insecure` is set.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import json
import logging
import os

import psutil
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from envs import limits, load_kind
from envs.pool import BadRequest, InstancePool, PoolError, TooLarge, require_count

log = logging.getLogger(__name__)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 once it would pass `limit` bytes; never holds more than that."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise BadRequest(f"Content-Length {declared!r} is not a byte count")
        if int(declared) > limit:
            raise TooLarge(_too_large(limit))
    body = bytearray()
    async for chunk in request.stream():
        if len(body) + len(chunk) > limit:
            raise TooLarge(_too_large(limit))
        body += chunk
    return bytes(body)


def _too_large(limit: int) -> str:
    return f"the request body is over the {limit}-byte limit (--max-body-bytes)"


def parse_object(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError:
        raise BadRequest(f"the body is not valid JSON: {raw[:80]!r}; expected an object") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, given {type(body).__name__}")
    return body


class RequireSecret:
    """ASGI middleware: every request but `GET /health` must carry `Authorization: Bearer <secret>`.
    It answers 401 before any route runs, so a refused request reads no body and touches no
    instance."""

    def __init__(self, app, secret: str):
        self.app = app
        self._expected = f"Bearer {secret}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (scope["method"], scope["path"]) != ("GET", "/health"):
            given = next((value for name, value in scope["headers"] if name == b"authorization"), None)
            if given is None or not hmac.compare_digest(given, self._expected):
                what = "no Authorization header" if given is None else "a wrong secret"
                response = JSONResponse(
                    {"error": f"unauthorized: {what}; send `Authorization: Bearer <secret>` with the "
                              f"server's secret (its --secret-file or ${limits.SECRET_ENV})"},
                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def json_api(title: str, secret: str | None, lifespan=None) -> FastAPI:
    """An app of ours: the secret required when given, a `PoolError` answered as `{"error"}` with its
    status, anything unexpected logged and answered 500."""
    app = FastAPI(title=title, lifespan=lifespan)
    app.state.secured = secret is not None
    if secret is not None:
        app.add_middleware(RequireSecret, secret=secret)

    @app.exception_handler(PoolError)
    async def _refused(_, exc: PoolError):
        return JSONResponse({"error": str(exc)}, status_code=exc.status)

    @app.exception_handler(Exception)
    async def _unexpected(_, exc: Exception):
        log.exception("unexpected error in %s", title)
        return JSONResponse({"error": f"internal error: {type(exc).__name__}: {exc}"}, status_code=500)

    return app


def build_app(pool: InstancePool, max_body_bytes: int = limits.MAX_BODY_BYTES, secret: str | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        pool.shutdown()  # ends every instance (and JVM) when the server stops

    app = json_api(f"agentgym-mega {pool.kind.name} server", secret, lifespan)
    app.state.pool = pool
    proc = psutil.Process(os.getpid())

    async def json_body(request: Request) -> dict:
        return parse_object(await read_body(request, max_body_bytes))

    # Endpoints return JSONResponse themselves: FastAPI's generic encoding of returned dicts costs
    # more than the environments' own steps on the batched path.

    @app.post("/create")
    async def create(request: Request):
        raw = await read_body(request, max_body_bytes)
        body = parse_object(raw) if raw.strip() not in (b"", b"null") else None
        return JSONResponse(await run_in_threadpool(pool.create, body))

    # AgentGym's env_idx dialect, where the kind serves it: the instance is `env_idx`, the task a
    # field of the kind's (Deep Search's `id`); ours names the instance `id`, the task `data_idx`.
    dialect = pool.kind.env_idx_task

    def instance(body: dict):
        return body["env_idx"] if dialect and "env_idx" in body else body.get("id")

    @app.post("/reset")
    async def reset(request: Request):
        body = await json_body(request)
        task = body.get(dialect) if dialect and "env_idx" in body else body.get("data_idx")
        return JSONResponse(await run_in_threadpool(pool.reset, instance(body), task))

    @app.post("/step")
    async def step(request: Request):
        body = await json_body(request)
        return JSONResponse(await run_in_threadpool(pool.step, instance(body), body.get("action")))

    @app.get("/observation")
    async def observation(id: str | None = None, env_idx: str | None = None):  # noqa: A002 (the protocol's name)
        given = env_idx if dialect and env_idx is not None else id
        try:
            instance_id = int(given)
        except (TypeError, ValueError):
            raise BadRequest(f"id={given!r} is not allowed; allowed: an integer id returned by /create") from None
        return JSONResponse(await run_in_threadpool(pool.observation, instance_id))

    @app.post("/close")
    async def close(request: Request):
        body = await json_body(request)
        return JSONResponse(await run_in_threadpool(pool.close, instance(body)))

    @app.post("/batch")
    async def batch(request: Request):
        body = await json_body(request)
        return JSONResponse({"results": await run_in_threadpool(pool.batch, body.get("ops"))})

    @app.get("/health")
    async def health():
        return {
            "status": "ok", "env": pool.kind.name, "instances": len(pool),
            "max_instances": pool.max_instances, "cap": pool.cap_reason, "memory_cap": pool.memory_cap,
            "instance_bytes": pool.kind.instance_bytes, "idle_timeout": pool.idle_timeout,
            "max_body_bytes": max_body_bytes, "max_batch_ops": pool.max_batch_ops,
            "max_action_chars": pool.max_action_chars, "auth": secret is not None,
            "rss_bytes": proc.memory_info().rss, **await run_in_threadpool(pool.kind.health),
        }

    @app.get("/tasks")
    async def tasks(split: str | None = None):
        if split not in (None, "train", "test", "dev"):
            raise BadRequest(f"split={split!r} is not allowed; allowed: train, test, dev, or none for all")
        items = [t for t in pool.kind.tasks() if split is None or t.split == split]
        return {"env": pool.kind.name, "count": len(items),
                "tasks": [{"id": t.id, "category": t.category, "split": t.split} for t in items]}

    return app


def read_secret_file(path: str) -> str:
    """The secret in a file (surrounding whitespace dropped), checked as `check_secret` does."""
    try:
        with open(path, encoding="utf-8") as f:
            return check_secret(f.read().strip(), f"--secret-file {path}")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--secret-file {path}: cannot read it: {exc}") from None


def check_secret(secret: str, source: str) -> str:
    """A secret must be non-empty printable ASCII without spaces: it travels in an HTTP header."""
    if not secret or not all(33 <= ord(c) <= 126 for c in secret):
        raise ValueError(f"the secret from {source} is not allowed; allowed: non-empty printable ASCII "
                         "without spaces, e.g. from `python -c \"import secrets; print(secrets.token_urlsafe(32))\"`")
    return secret


def resolve_secret(secret: str | None, host: str, insecure: bool, exposes: str) -> str | None:
    """The secret a server on `host` requires: `secret`, else $AGENTGYM_MEGA_SECRET when set and not
    empty, else none, which only a loopback host (or `insecure`) allows. `exposes`: what anyone
    reaching an open server could do, for the refusal's message."""
    if secret is not None:
        secret = check_secret(secret, "the secret parameter")
    elif os.environ.get(limits.SECRET_ENV):  # set and empty: no secret
        secret = check_secret(os.environ[limits.SECRET_ENV], f"${limits.SECRET_ENV}")
    if secret is None and not insecure and not is_loopback(host):
        raise ValueError(f"refusing to serve on {host} without a secret: anyone who reaches it could {exposes}; "
                         f"give --secret-file (or ${limits.SECRET_ENV}), bind 127.0.0.1, or pass --insecure on a "
                         "network you trust")
    return secret


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # another host name: it may resolve anywhere
        return False


def make_server(env: str, host: str, port: int, max_instances: int | None = None, idle_timeout: float = 600.0, *,
                secret: str | None = None, insecure: bool = False, memory_share: float | None = None,
                max_body_bytes: int = limits.MAX_BODY_BYTES, max_batch_ops: int = limits.MAX_BATCH_OPS,
                max_action_chars: int = limits.MAX_ACTION_CHARS, env_options: dict | None = None) -> uvicorn.Server:
    """A uvicorn server hosting one environment kind; `.run()` blocks, Ray processes run it in a thread.

    `secret` None: $AGENTGYM_MEGA_SECRET when set and not empty, else no authentication, which
    only a loopback `host` (or `insecure`) allows. `memory_share` None: $AGENTGYM_MEGA_MEMORY_SHARE when set, else
    limits.MEMORY_SHARE. `env_options`: the kind's own options (`envs.check_options`). Raises
ValueError, naming the setting, for a setting that is not allowed.
    """
    secret = resolve_secret(secret, host, insecure, "drive the server")
    if memory_share is None:
        memory_share = _share_from_env()
    require_count("max_body_bytes", max_body_bytes)
    pool = InstancePool(load_kind(env, env_options), max_instances=max_instances, idle_timeout=idle_timeout,
                        memory_share=memory_share, max_batch_ops=max_batch_ops, max_action_chars=max_action_chars)
    config = uvicorn.Config(build_app(pool, max_body_bytes, secret), host=host, port=port, log_level="warning",
                            access_log=False, timeout_keep_alive=60, backlog=4096)
    return uvicorn.Server(config)


def _share_from_env() -> float:
    text = os.environ.get(limits.MEMORY_SHARE_ENV)
    if text is None:
        return limits.MEMORY_SHARE
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"${limits.MEMORY_SHARE_ENV}={text!r} is not allowed; allowed: a fraction in (0, 1]") from None
