"""The AgentGym HTTP protocol over an `InstancePool`, plus `/batch`, `/health` and `/tasks`.

Original AgentGym clients work unchanged: `/create`, `/reset`, `/step`, `/observation`, `/close`
with the same bodies and fields. Errors are JSON `{"error": ...}` with a meaningful status (the
original answered 200 or FastAPI's 422): 400 bad input, 404 unknown id, 409 episode state,
500 a failed instance, 503 server full.

`POST /batch` `{"ops": [{"op": "step", "id": 3, "action": "..."}, ...]}` runs many operations in
one round trip and answers `{"results": [...]}` in the same order, each result the single
endpoint's answer or `{"error", "status"}`; one bad item never fails the others.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os

import psutil
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from envs import load_kind
from envs.pool import BadRequest, InstancePool, PoolError

log = logging.getLogger(__name__)


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError:
        raise BadRequest(f"the body is not valid JSON: {raw[:80]!r}; expected an object") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, given {type(body).__name__}")
    return body


def build_app(pool: InstancePool) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        pool.shutdown()  # ends every instance (and JVM) when the server stops

    app = FastAPI(title=f"agentgym-mega {pool.kind.name} server", lifespan=lifespan)
    proc = psutil.Process(os.getpid())

    # Endpoints return JSONResponse themselves: FastAPI's generic encoding of returned dicts costs
    # more than the environments' own steps on the batched path.
    @app.exception_handler(PoolError)
    async def _pool_error(_, exc: PoolError):
        return JSONResponse({"error": str(exc)}, status_code=exc.status)

    @app.exception_handler(Exception)
    async def _unexpected(_, exc: Exception):
        log.exception("unexpected server error")
        return JSONResponse({"error": f"internal error: {type(exc).__name__}: {exc}"}, status_code=500)

    @app.post("/create")
    async def create():
        return JSONResponse({"id": await run_in_threadpool(pool.create)})

    @app.post("/reset")
    async def reset(request: Request):
        body = await _json_body(request)
        return JSONResponse(await run_in_threadpool(pool.reset, body.get("id"), body.get("data_idx")))

    @app.post("/step")
    async def step(request: Request):
        body = await _json_body(request)
        return JSONResponse(await run_in_threadpool(pool.step, body.get("id"), body.get("action")))

    @app.get("/observation")
    async def observation(id: str | None = None):  # noqa: A002 (the protocol's name)
        try:
            instance_id = int(id)
        except (TypeError, ValueError):
            raise BadRequest(f"id={id!r} is not allowed; allowed: an integer id returned by /create") from None
        return JSONResponse(await run_in_threadpool(pool.observation, instance_id))

    @app.post("/close")
    async def close(request: Request):
        body = await _json_body(request)
        return JSONResponse(await run_in_threadpool(pool.close, body.get("id")))

    @app.post("/batch")
    async def batch(request: Request):
        body = await _json_body(request)
        return JSONResponse({"results": await run_in_threadpool(pool.batch, body.get("ops"))})

    @app.get("/health")
    async def health():
        return {
            "status": "ok", "env": pool.kind.name, "instances": len(pool),
            "max_instances": pool.max_instances, "idle_timeout": pool.idle_timeout,
            "rss_bytes": proc.memory_info().rss,
        }

    @app.get("/tasks")
    async def tasks(split: str | None = None):
        if split not in (None, "train", "test", "dev"):
            raise BadRequest(f"split={split!r} is not allowed; allowed: train, test, dev, or none for all")
        items = [t for t in pool.kind.tasks() if split is None or t.split == split]
        return {"env": pool.kind.name, "count": len(items),
                "tasks": [{"id": t.id, "category": t.category, "split": t.split} for t in items]}

    return app


def make_server(env: str, host: str, port: int, max_instances: int, idle_timeout: float) -> uvicorn.Server:
    """A uvicorn server hosting one environment kind; `.run()` blocks, Ray actors run it in a thread."""
    pool = InstancePool(load_kind(env), max_instances=max_instances, idle_timeout=idle_timeout)
    config = uvicorn.Config(build_app(pool), host=host, port=port, log_level="warning",
                            access_log=False, timeout_keep_alive=60, backlog=4096)
    return uvicorn.Server(config)
