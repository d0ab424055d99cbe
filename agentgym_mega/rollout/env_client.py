"""The trainer's side of the environment servers.

`EnvClient` spreads instances over several servers and talks to each through its batched path
(`POST /batch`): resetting or stepping a whole rollout round is one round trip per server, all
servers in parallel. Per-item failures come back as `{"error", "status"}` results, and so does
every item of a server that cannot be reached, so one broken instance or server costs its own
episodes, never the round. `start_servers` runs servers as Ray actors
(`num_gpus=0`) when the trainer starts them itself.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests

DEFAULT_TIMEOUT_S = 600.0


class EnvServerError(RuntimeError):
    """A server could not be reached or rejected a whole request."""


MISSING_ID = -1  # no server issues it


@dataclasses.dataclass(frozen=True)
class Handle:
    server: int  # index into EnvClient.urls
    id: int


class EnvClient:
    def __init__(self, urls: list[str], timeout: float = DEFAULT_TIMEOUT_S):
        if not urls:
            raise ValueError("EnvClient needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout = timeout
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

    def step(self, handles: list[Handle], actions: list[str]) -> list[dict]:
        """Actions may be whole model replies: servers act on the text after the last `Action:`."""
        return self._run([(h.server, {"op": "step", "id": h.id, "action": a}) for h, a in zip(handles, actions)])

    def close(self, handles: list[Handle]) -> list[dict]:
        return self._run([(h.server, {"op": "close", "id": h.id}) for h in handles])

    def health(self) -> list[dict]:
        return [self._get(url, "/health") for url in self.urls]

    def tasks(self, split: str | None = None) -> list[dict]:
        params = {"split": split} if split else None
        return self._get(self.urls[0], "/tasks", params)["tasks"]

    def shutdown(self) -> None:
        self._fan.shutdown(wait=False)

    # -- transport ----------------------------------------------------------------------------
    def _run(self, items: list[tuple[int, dict]]) -> list[dict]:
        """One /batch per server, all servers at once; results in the order of `items`."""
        by_server: dict[int, list[int]] = {}
        for pos, (server, _) in enumerate(items):
            by_server.setdefault(server, []).append(pos)
        results: list[dict | None] = [None] * len(items)

        def send(server: int) -> None:
            positions = by_server[server]
            try:
                answer = self._post(self.urls[server], "/batch", {"ops": [items[p][1] for p in positions]})["results"]
            except EnvServerError as exc:
                # A dead or broken server costs its own episodes, never the round.
                answer = [{"error": f"environment server unavailable: {exc}", "status": 503}] * len(positions)
            for p, r in zip(positions, answer):
                results[p] = r

        for future in [self._fan.submit(send, s) for s in by_server]:
            future.result()
        return results

    def _session(self) -> requests.Session:
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
        return self._local.session

    def _post(self, url: str, path: str, body: dict) -> dict:
        try:
            resp = self._session().post(url + path, json=body, timeout=self.timeout)
        except requests.RequestException as exc:
            raise EnvServerError(f"{url}{path}: {exc}") from None
        return _json(resp, url + path)

    def _get(self, url: str, path: str, params: dict | None = None) -> dict:
        try:
            resp = self._session().get(url + path, params=params, timeout=self.timeout)
        except requests.RequestException as exc:
            raise EnvServerError(f"{url}{path}: {exc}") from None
        return _json(resp, url + path)


def _json(resp: requests.Response, where: str) -> dict:
    try:
        body = resp.json()
    except ValueError:
        raise EnvServerError(f"{where}: HTTP {resp.status_code}, not JSON: {resp.text[:200]!r}") from None
    if resp.status_code != 200:
        raise EnvServerError(f"{where}: HTTP {resp.status_code}: {body.get('error', body)}")
    return body


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


def start_servers(env: str, workers: int, max_instances: int = 512, idle_timeout: float = 600.0,
                  num_cpus: float = 1, options=None) -> tuple[list, list[str]]:
    """Starts `workers` servers as Ray actors on CPU (num_gpus=0); returns (actors, urls).
    `options(i)`, when given, are server i's Ray actor options (see cluster.Placement).

    Keep the actors referenced: a server lives as long as its actor.
    """
    import ray

    from agentgym_mega.rollout.env_server_actor import EnvServerActor

    if not ray.is_initialized():
        ray.init(include_dashboard=False)
    actors = [ray.remote(**(options(i) if options else {"num_gpus": 0, "num_cpus": num_cpus}))(EnvServerActor)
              .remote(env, max_instances, idle_timeout) for i in range(workers)]
    urls = ray.get([a.url.remote() for a in actors])
    return actors, urls
