"""The trainer's side of the environment servers.

`EnvClient` spreads instances over several servers and talks to each through its batched path
(`POST /batch`): resetting or stepping a whole rollout round is one round trip per server, all
servers in parallel, each server's operations split into /batch calls that fit its limits
(operations per call, body bytes). Per-item failures come back as `{"error", "status"}` results,
and so does every item of a server that cannot be reached, so one broken instance or server costs
its own episodes, never the round; a server that rejects a whole request (a wrong secret, limits
below the client's) raises `EnvRequestRejected`, since every later round would fail the same way.
Step results carry `episode_score` (on [0, 1]) and `success` beside AgentGym's fields (see `envs`).
`start_servers` runs servers as Ray processes (`num_gpus=0`) when the trainer starts them itself.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from agentgym_mega.network import reachable_ip
from envs import limits
from envs.environment import Task

# Ray and the server side (FastAPI, uvicorn) are imported by `start_servers` alone: processes that
# import this module but start no servers (`bench env`, `pretrain-tiny`) need neither.

DEFAULT_TIMEOUT_S = 600.0
_ENVELOPE = len(b'{"ops":[]}')


class EnvServerError(RuntimeError):
    """A server could not be reached or rejected a whole request."""


class EnvRequestRejected(EnvServerError):
    """A server answered a whole request with a 4xx status: the request itself is wrong."""


class EnvTimeout(EnvServerError):
    """A server did not answer within the call's timeout."""


MISSING_ID = -1  # no server issues it
TIMEOUT_STATUS = 504  # the per-item status of operations whose server did not answer in time


@dataclasses.dataclass(frozen=True)
class Handle:
    server: int  # index into EnvClient.urls
    id: int


class EnvClient:
    """`secret`: sent as `Authorization: Bearer <secret>` when given (servers started with one).
    `max_batch_ops`, `max_body_bytes`: each /batch call stays within them; the servers' defaults."""

    def __init__(self, urls: list[str], timeout: float = DEFAULT_TIMEOUT_S, secret: str | None = None,
                 max_batch_ops: int = limits.MAX_BATCH_OPS, max_body_bytes: int = limits.MAX_BODY_BYTES):
        if not urls:
            raise ValueError("EnvClient needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout = timeout
        self.max_batch_ops, self.max_body_bytes = max_batch_ops, max_body_bytes
        self._headers = {"Content-Type": "application/json"}
        if secret is not None:
            self._headers["Authorization"] = f"Bearer {secret}"
        self._local = threading.local()  # requests sessions are not thread-safe: one per thread
        self._fan = ThreadPoolExecutor(len(self.urls))

    def create(self, n: int) -> list[Handle]:
        """n new instances, dealt round-robin over the servers. An instance that could not be
        created (its server died or is full) gets id -1: every later request on it returns a
        per-item error, so only its own episode ends, as when a server dies mid-episode."""
        servers = [i % len(self.urls) for i in range(n)]
        results = self._run([(s, {"op": "create"}) for s in servers])
        return [Handle(s, r.get("id", MISSING_ID)) for s, r in zip(servers, results)]

    def reset(self, handles: list[Handle], data_idxs: list[int]) -> list[dict]:
        return self._run([(h.server, {"op": "reset", "id": h.id, "data_idx": d}) for h, d in zip(handles, data_idxs)])

    def step(self, handles: list[Handle], actions: list[str], timeout: float | None = None) -> list[dict]:
        """Actions may be whole model replies: servers act on the text after the last `Action:`.
        `timeout`: seconds to wait for a server's answer (default: the client's); the items of a
        server that did not answer in time come back with status TIMEOUT_STATUS."""
        return self._run([(h.server, {"op": "step", "id": h.id, "action": a}) for h, a in zip(handles, actions)],
                         timeout)

    def close(self, handles: list[Handle]) -> list[dict]:
        return self._run([(h.server, {"op": "close", "id": h.id}) for h in handles])

    def tasks(self, split: str | None = None) -> list[Task]:
        """The first server's task catalogue (every server of a run hosts the same kind)."""
        params = {"split": split} if split else None
        return [Task(t["id"], t["category"], t["split"]) for t in self._get(self.urls[0], "/tasks", params)["tasks"]]

    def shutdown(self) -> None:
        self._fan.shutdown(wait=False)

    # -- transport ----------------------------------------------------------------------------
    def _run(self, items: list[tuple[int, dict]], timeout: float | None = None) -> list[dict]:
        """/batch calls to every server at once (several per server past its limits, one after
        another); results in the order of `items`. Items of one server (an episode's own step)
        are sent from the calling thread, so concurrent callers do not queue for the fan-out."""
        by_server: dict[int, list[int]] = {}
        for pos, (server, _) in enumerate(items):
            by_server.setdefault(server, []).append(pos)
        results: list[dict | None] = [None] * len(items)

        def send(server: int) -> None:
            encoded = {}
            for p in by_server[server]:
                op = json.dumps(items[p][1]).encode()
                if _ENVELOPE + len(op) > self.max_body_bytes:  # alone it is over the limit: its own error
                    results[p] = {"error": f"the operation has {len(op)} bytes, over the {self.max_body_bytes}"
                                           "-byte request limit", "status": 413}
                else:
                    encoded[p] = op
            unavailable = None  # once a call fails, the server's later calls are not tried
            for positions in _pack(encoded, self.max_batch_ops, self.max_body_bytes):
                answer = None
                if unavailable is None:
                    body = b'{"ops":[' + b",".join(encoded[p] for p in positions) + b"]}"
                    try:
                        answer = self._post(self.urls[server], "/batch", body, timeout)["results"]
                    except EnvRequestRejected:
                        raise
                    except EnvTimeout as exc:
                        unavailable = {"error": str(exc), "status": TIMEOUT_STATUS}
                    except EnvServerError as exc:
                        # A dead or broken server costs its own episodes, never the round.
                        unavailable = {"error": f"environment server unavailable: {exc}", "status": 503}
                for p, r in zip(positions, answer or [unavailable] * len(positions)):
                    results[p] = r

        if len(by_server) == 1:
            send(next(iter(by_server)))
        else:
            for future in [self._fan.submit(send, s) for s in by_server]:
                future.result()
        return results

    def _session(self) -> requests.Session:
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
            self._local.session.headers.update(self._headers)
        return self._local.session

    def _post(self, url: str, path: str, body: bytes, timeout: float | None = None) -> dict:
        timeout = self.timeout if timeout is None else timeout
        try:
            resp = self._session().post(url + path, data=body, timeout=timeout)
        except requests.Timeout:
            raise EnvTimeout(f"{url}{path}: no answer within {timeout:g} s") from None
        except requests.RequestException as exc:
            raise EnvServerError(f"{url}{path}: {exc}") from None
        return _json(resp, url + path)

    def _get(self, url: str, path: str, params: dict | None = None) -> dict:
        try:
            resp = self._session().get(url + path, params=params, timeout=self.timeout)
        except requests.RequestException as exc:
            raise EnvServerError(f"{url}{path}: {exc}") from None
        return _json(resp, url + path)


class StepGroups:
    """Env steps from independent callers (the episodes of an async rollout), each server's sent
    as one /batch when they arrive within `window_s` of its first: the episodes that one engine
    step finished reach their server in one round trip instead of one each. A group is answered
    when its slowest step is; `window_s` 0 sends every step alone."""

    def __init__(self, env: EnvClient, window_s: float):
        self.env, self.window_s = env, window_s
        self._lock = threading.Lock()
        self._forming: dict[int, list] = {}  # server -> [(handle, action, timeout, slot)]

    def step(self, handle: Handle, action: str, timeout: float | None = None) -> dict:
        if self.window_s <= 0:
            return self.env.step([handle], [action], timeout)[0]
        slot: dict = {"answered": threading.Event()}
        with self._lock:
            leader = handle.server not in self._forming
            group = self._forming.setdefault(handle.server, [])
            group.append((handle, action, timeout, slot))
        if leader:  # the first step of a group waits the window out, then sends the group
            time.sleep(self.window_s)
            with self._lock:
                group = self._forming.pop(handle.server)
            self._send(group)
        slot["answered"].wait()
        if "raised" in slot:
            raise slot["raised"]
        return slot["result"]

    def _send(self, group: list) -> None:
        limits = [t for _, _, t, _ in group]
        start = time.monotonic()
        try:
            results = self.env.step([h for h, _, _, _ in group], [a for _, a, _, _ in group],
                                    None if None in limits else max(limits))
        except Exception as exc:  # a rejected request: every caller of the group sees it
            results = [exc] * len(group)
        took = time.monotonic() - start
        for (_, _, limit, slot), result in zip(group, results):
            if isinstance(result, Exception):
                slot["raised"] = result
            elif limit is not None and took > limit and "error" not in result:
                # Answered, but later than this step's own limit (the group's was longer).
                slot["result"] = {"error": f"no answer within {limit:g} s (its group took {took:.1f} s)",
                                  "status": TIMEOUT_STATUS}
            else:
                slot["result"] = result
            slot["answered"].set()


def _json(resp: requests.Response, where: str) -> dict:
    try:
        body = resp.json()
    except ValueError:
        raise EnvServerError(f"{where}: HTTP {resp.status_code}, not JSON: {resp.text[:200]!r}") from None
    if resp.status_code != 200:
        error = EnvRequestRejected if 400 <= resp.status_code < 500 else EnvServerError
        raise error(f"{where}: HTTP {resp.status_code}: {body.get('error', body)}")
    return body


def _pack(encoded: dict[int, bytes], max_ops: int, max_bytes: int) -> list[list[int]]:
    """Groups the positions of encoded operations, in order, into /batch bodies of at most
    `max_ops` operations and `max_bytes` bytes (each operation fits alone)."""
    groups: list[list[int]] = []
    size = 0
    for p, op in encoded.items():
        if not groups or len(groups[-1]) >= max_ops or size + 1 + len(op) > max_bytes:
            groups.append([])
            size = _ENVELOPE - 1  # the first operation has no comma before it
        groups[-1].append(p)
        size += 1 + len(op)
    return groups


def wait_healthy(url: str, timeout: float = 120.0) -> dict:
    """Polls GET /health until the server answers (it loads its catalogue before listening)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            resp = requests.get(url.rstrip("/") + "/health", timeout=5)
            if resp.status_code == 200:
                return resp.json()
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise EnvServerError(f"{url} did not become healthy within {timeout:g} s")
        time.sleep(0.2)


def start_servers(env: str, num_servers: int, max_instances: int | None = None, idle_timeout: float = 600.0,
                  num_cpus: float = 1, options=None, secret: str | None = None,
                  env_options: dict | None = None) -> tuple[list, list[str]]:
    """Starts `num_servers` servers as Ray processes on CPU (num_gpus=0); returns (their Ray
    processes, urls). `options(i)`, when given, are server i's Ray options (see cluster.Placement);
    `env_options`, the environment kind's own (`env.options`).

    `secret`: the servers require it as `Authorization: Bearer <secret>`; give EnvClient the same.
    On a multi-node Ray cluster the servers bind the node's address, so a secret is required there.
    Servers sharing a node split its memory: each may fill MEMORY_SHARE / ceil(num_servers / nodes) of
    what the node has available (the trainer's placement spreads servers evenly over the nodes).
    `max_instances` None: each server's memory cap. Keep the processes referenced: a server lives as
    long as its Ray handle.
    """
    import ray

    from agentgym_mega.rollout.env_server_process import EnvServerProcess
    from envs.server import check_secret, is_loopback

    if not ray.is_initialized():
        ray.init(include_dashboard=False)
    host = reachable_ip()
    if secret is None and not is_loopback(host):
        raise ValueError(f"start_servers: the servers would bind {host} (a multi-node Ray cluster) without a "
                         "secret; pass secret=... and give EnvClient the same")
    nodes = sum(1 for node in ray.nodes() if node["Alive"])
    # The servers read these (make_server); an empty secret means none, over any inherited one.
    env_vars = {limits.MEMORY_SHARE_ENV: str(limits.MEMORY_SHARE / math.ceil(num_servers / nodes)),
                limits.SECRET_ENV: "" if secret is None else check_secret(secret, "start_servers(secret=...)")}
    procs = []
    for i in range(num_servers):
        opts = dict(options(i) if options else {"num_gpus": 0, "num_cpus": num_cpus})
        runtime_env = dict(opts.get("runtime_env") or {})
        runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **env_vars}
        opts["runtime_env"] = runtime_env
        procs.append(ray.remote(**opts)(EnvServerProcess).remote(env, max_instances, idle_timeout, env_options))
    urls = ray.get([p.url.remote() for p in procs])
    return procs, urls
