"""A retriever index over HTTP in Search-R1's retrieval-server format, plus `GET /health`.

`POST /retrieve` `{"queries": ["...", ...], "topk": 3, "return_scores": true}` answers
`{"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}`, one list per query,
best first; with `return_scores` false or absent each item is the document `{"id", "contents"}`
alone. `topk` absent or null: 3 (Search-R1's default). An empty or whitespace-only query, or a
BM25 query sharing no word with the corpus, gets an empty list (see `envs.deepsearch.retriever`).

Errors are JSON `{"error": ...}`: 400 bad input or a request over a cap (queries per request,
topk, characters per query; the message names the cap and its option), 401 no or a wrong secret,
413 a body over `max_body_bytes`. Security as `envs.server`: loopback by default, a secret
(`Authorization: Bearer <secret>` on every request but `GET /health`) required for another
address unless `insecure`; bodies are only ever parsed as JSON.
"""

from __future__ import annotations

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from envs import limits
from envs.deepsearch.retriever import MAX_QUERIES, MAX_QUERY_CHARS, MAX_TOPK, LocalRetriever, load_index
from envs.pool import BadRequest, require_count
from envs.server import json_api, parse_object, read_body, resolve_secret

DEFAULT_TOPK = 3


def build_app(retriever: LocalRetriever, *, secret: str | None = None, max_body_bytes: int = limits.MAX_BODY_BYTES,
              max_queries: int = MAX_QUERIES, max_topk: int = MAX_TOPK,
              max_query_chars: int = MAX_QUERY_CHARS) -> FastAPI:
    app = json_api("agentgym-mega retriever", secret)
    app.state.retriever = retriever

    @app.post("/retrieve")
    async def retrieve(request: Request):
        body = parse_object(await read_body(request, max_body_bytes))
        queries, topk, scores = _checked(body, max_queries, max_topk, max_query_chars)
        hits = await run_in_threadpool(retriever.search, queries, topk)
        if scores:
            result = [[{"document": {"id": h["id"], "contents": h["contents"]}, "score": h["score"]} for h in per_query]
                      for per_query in hits]
        else:
            result = [[{"id": h["id"], "contents": h["contents"]} for h in per_query] for per_query in hits]
        return JSONResponse({"result": result})

    @app.get("/health")
    async def health():
        return {"status": "ok", "passages": len(retriever), "mode": retriever.mode,
                "indexes": retriever.manifest["indexes"], "max_body_bytes": max_body_bytes,
                "max_queries": max_queries, "max_topk": max_topk, "max_query_chars": max_query_chars,
                "auth": secret is not None}

    return app


def _checked(body: dict, max_queries: int, max_topk: int, max_query_chars: int) -> tuple[list[str], int, bool]:
    queries = body.get("queries")
    if not isinstance(queries, list):
        given = "missing" if queries is None else f"a JSON {type(queries).__name__}"
        raise BadRequest(f"queries is {given}; allowed: a list of strings")
    wrong = next((i for i, q in enumerate(queries) if not isinstance(q, str)), None)
    if wrong is not None:
        raise BadRequest(f"queries[{wrong}] is a JSON {type(queries[wrong]).__name__}; allowed: a list of strings")
    if len(queries) > max_queries:
        raise BadRequest(f"{len(queries)} queries in one request is over the cap of {max_queries} (--max-queries); "
                         "send them in several requests")
    long = next((i for i, q in enumerate(queries) if len(q) > max_query_chars), None)
    if long is not None:
        raise BadRequest(f"queries[{long}] has {len(queries[long])} characters, over the cap of {max_query_chars} "
                         "(--max-query-chars)")
    topk = body.get("topk")
    topk = DEFAULT_TOPK if topk is None else topk
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= max_topk:
        raise BadRequest(f"topk={topk!r} is not allowed; allowed: an integer from 1 to {max_topk} (--max-topk)")
    scores = body.get("return_scores")
    scores = False if scores is None else scores
    if not isinstance(scores, bool):
        raise BadRequest(f"return_scores={scores!r} is not allowed; allowed: true or false")
    return queries, topk, scores


def make_server(index: str, host: str = "127.0.0.1", port: int = 8000, mode: str | None = None, *,
                device: str | None = None, secret: str | None = None, insecure: bool = False,
                max_body_bytes: int = limits.MAX_BODY_BYTES,
                max_queries: int = MAX_QUERIES, max_topk: int = MAX_TOPK,
                max_query_chars: int = MAX_QUERY_CHARS) -> uvicorn.Server:
    """A uvicorn server over the index in directory `index` (`load_index(index, mode, device)`);
    `.run()` blocks.

    `secret` None: $AGENTGYM_MEGA_SECRET when set and not empty, else no authentication, which only a
    loopback `host` (or `insecure`) allows. Raises ValueError naming a setting that is not allowed
    (RetrieverInputError, a ValueError, for the index and mode).
    """
    secret = resolve_secret(secret, host, insecure, "query the index")
    for name, value in (("max_body_bytes", max_body_bytes), ("max_queries", max_queries), ("max_topk", max_topk),
                        ("max_query_chars", max_query_chars)):
        require_count(name, value)
    app = build_app(load_index(index, mode, device), secret=secret, max_body_bytes=max_body_bytes,
                    max_queries=max_queries, max_topk=max_topk, max_query_chars=max_query_chars)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, timeout_keep_alive=60,
                            backlog=4096)
    return uvicorn.Server(config)
