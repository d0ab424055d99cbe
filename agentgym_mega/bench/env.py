"""`agentgym-mega bench env`: steps per second and step latency of one environment server, per
concurrency, through the per-request AgentGym path (one HTTP call per step, one client thread per
episode, as the original clients do) and through the batched path (one `/batch` call per round).

Each episode is create, reset, `steps` steps, close; an episode that finishes early is reset and
continues, so every run makes the same number of steps. The clock runs from the moment every
episode is set up until every episode has made its steps (creation, with its JVM starts or level
generation, is not stepping). The server runs as a separate process started through the real CLI,
and its RSS is read before and after. Deep Search runs as deployed: its server searches through a
`retriever serve` of the shipped corpus, whose queries/s (batched and one per request) are
reported beside the steps/s. WebArena browses the shipped shop: each step clicks the first link
of its observation or goes back (a page load either way), and the memory of a live instance is
measured apart: the server's whole process tree (it and Chromium's processes), PSS and RSS, with
no context open and with one per instance, after each has loaded its start page.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import threading
import time

import numpy as np
import psutil
import requests

from agentgym_mega.network import start_server
from agentgym_mega.rollout.env_client import EnvClient, EnvServerError, wait_healthy
from envs.deepsearch import tasks
from envs.deepsearch.options import DATA_DIR
from envs.deepsearch.retriever import PASSAGES, bench_queries, build_index

# Actions that exercise each game without solving it quickly.
ACTIONS = {
    "textcraft": ["inventory", "get 1 oak log", "craft 4 oak planks using 1 oak log"],
    "babyai": ["turn left", "move forward", "turn right", "check available actions"],
    "sciworld": ["look around", "inventory"],
    "deepsearch": ["<search>who founded the company</search>", "<answer>not the answer</answer>",
                   "<search>capital city of the country</search>"],
}
_LINK = re.compile(r"\[(\d+)\] link '")


def _action(env: str, step: int, observation: str) -> str:
    if env != "webarena":
        return ACTIONS[env][step % len(ACTIONS[env])]
    link = _LINK.search(observation)
    return "```go_back```" if step % 2 or link is None else f"```click [{link.group(1)}]```"


def _stats(path: str, concurrency: int, steps: int, wall: float, latencies: list[float], errors: int) -> dict:
    lat = np.array(latencies) * 1000
    return {
        "path": path, "concurrency": concurrency, "steps": steps, "wall_s": round(wall, 3),
        "steps_per_s": round(steps / wall, 1),
        "step_latency_p50_ms": round(float(np.percentile(lat, 50)), 2),
        "step_latency_p99_ms": round(float(np.percentile(lat, 99)), 2),
        "errors": errors,
    }


def _per_request(url: str, env: str, concurrency: int, steps: int) -> dict:
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()
    phase = threading.Barrier(concurrency + 1)  # all set up / all stepped: the clock runs between

    def episode(k: int) -> None:
        session = requests.Session()
        own: list[float] = []
        try:
            iid = session.post(f"{url}/create").json()["id"]
            out = session.post(f"{url}/reset", json={"id": iid, "data_idx": k}).json()
            phase.wait()
            for s in range(steps):
                t = time.perf_counter()
                action = _action(env, s, out["observation"])
                out = session.post(f"{url}/step", json={"id": iid, "action": action}).json()
                own.append(time.perf_counter() - t)
                if out.get("done"):
                    out = session.post(f"{url}/reset", json={"id": iid, "data_idx": k}).json()
            phase.wait()
            session.post(f"{url}/close", json={"id": iid})
        except (requests.RequestException, KeyError, ValueError, threading.BrokenBarrierError):
            phase.abort()
            with lock:
                errors[0] += 1
        with lock:
            latencies.extend(own)

    threads = [threading.Thread(target=episode, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    t0 = t1 = time.perf_counter()
    try:
        phase.wait()
        t0 = time.perf_counter()
        phase.wait()
        t1 = time.perf_counter()
    except threading.BrokenBarrierError:
        errors[0] += 1
    for t in threads:
        t.join()
    return _stats("per_request", concurrency, len(latencies), t1 - t0, latencies, errors[0])


def _batched(url: str, env: str, concurrency: int, steps: int) -> dict:
    client = EnvClient([url])
    latencies, errors, done_steps = [], 0, 0
    t0 = t1 = time.perf_counter()
    try:
        handles = client.create(concurrency)
        idxs = list(range(concurrency))
        results = client.reset(handles, idxs)
        t0 = time.perf_counter()
        for s in range(steps):
            t = time.perf_counter()
            results = client.step(handles, [_action(env, s, r.get("observation", "")) for r in results])
            latencies.append(time.perf_counter() - t)
            errors += sum("error" in r for r in results)
            done_steps += sum("error" not in r for r in results)
            finished = [i for i, r in enumerate(results) if r.get("done")]
            if finished:
                again = client.reset([handles[i] for i in finished], [idxs[i] for i in finished])
                for i, r in zip(finished, again):
                    results[i] = r
        t1 = time.perf_counter()
        client.close(handles)
    except EnvServerError:
        errors += 1
    finally:
        client.shutdown()
    return _stats("batched", concurrency, done_steps, t1 - t0, latencies, errors)


def _rss(url: str) -> int:
    return requests.get(f"{url}/health", timeout=30).json()["rss_bytes"]


def _tree_memory(pid: int) -> dict:
    """PSS (shared pages split between the processes sharing them) and RSS summed over a process
    and its descendants: Chromium's renderers share most of their pages."""
    pss = rss = 0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            info = proc.memory_full_info()
            pss, rss = pss + info.pss, rss + info.rss
    return {"pss_bytes": pss, "rss_bytes": rss}


def _context_memory(url: str, pid: int, n: int) -> dict:
    """What one live WebArena instance (a browser context with its start page) adds to the server."""
    client = EnvClient([url])
    try:
        idle = _tree_memory(pid)
        handles = client.create(n)
        results = client.reset(handles, list(range(n)))
        time.sleep(1)  # renderers settle after the load event
        live = _tree_memory(pid)
        client.close(handles)
    finally:
        client.shutdown()
    per = {k: (live[k] - idle[k]) / n for k in idle}
    print(f"webarena: {n} live contexts add {per['pss_bytes'] / 2**20:.1f} MiB PSS ({per['rss_bytes'] / 2**20:.1f} "
          f"MiB RSS summed over processes) each; server tree {idle['pss_bytes'] / 2**20:.0f} MiB PSS with none",
          flush=True)
    return {"instances": n, "errors": sum("error" in r for r in results), "idle": idle, "live": live,
            "per_instance_pss_bytes": round(per["pss_bytes"]), "per_instance_rss_bytes": round(per["rss_bytes"])}


@contextlib.contextmanager
def serving(command: list[str], process: list | None = None):
    """`agentgym-mega COMMAND` running on a port the OS picks; yields its URL once healthy (its pid appended to
    `process` when given)."""
    server, url = start_server(command)
    if process is not None:
        process.append(server.pid)
    try:
        wait_healthy(url)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=60)


@contextlib.contextmanager
def _shipped_retriever():
    """Deep Search's deployed shape: the shipped corpus indexed, served by `retriever serve`."""
    with tempfile.TemporaryDirectory(prefix="bench-retriever-") as tmp:
        build_index(os.path.join(DATA_DIR, PASSAGES), os.path.join(tmp, "index"), progress=False)
        with serving(["retriever", "serve", "--index", os.path.join(tmp, "index")]) as url:
            yield url


def _retriever_rates(url: str) -> dict:
    """Queries/s of the retriever the env server searched through, on the shipped questions."""
    rates = bench_queries(url, [q.question for q in tasks.load(DATA_DIR)], concurrency=16)
    print(f"retriever: {rates['batched_qps']:.0f} queries/s batched ({rates['queries']} in one request), "
          f"{rates['single_qps']:.0f} queries/s one per request from {rates['concurrency']} threads "
          f"(p50 {rates['single_p50_ms']:.1f} ms, p99 {rates['single_p99_ms']:.1f} ms)", flush=True)
    return {"served": "retriever serve over the shipped corpus (BM25)", **rates}


def run(env: str, concurrencies: list[int], steps: int = 20) -> dict:
    with contextlib.ExitStack() as stack:
        server = ["env-server", "--env", env, "--max-instances", str(2 * max(concurrencies) + 16)]
        retriever = stack.enter_context(_shipped_retriever()) if env == "deepsearch" else None
        if retriever:
            server += ["--option", f"retriever_url={retriever}"]
        pid: list[int] = []
        url = stack.enter_context(serving(server, pid))
        report = {"env": env, "steps_per_episode": steps, "server_rss_before_bytes": _rss(url), "results": []}
        for c in concurrencies:
            for measure in (_per_request, _batched):
                row = measure(url, env, c, steps)
                report["results"].append(row)
                print(f"{env} c={c:<4} {row['path']:<12} {row['steps_per_s']:>9.1f} steps/s  "
                      f"p50 {row['step_latency_p50_ms']:>8.2f} ms  p99 {row['step_latency_p99_ms']:>8.2f} ms  "
                      f"errors {row['errors']}", flush=True)
        report["server_rss_after_bytes"] = _rss(url)
        if env == "webarena":
            report["memory_per_instance"] = _context_memory(url, pid[0], max(concurrencies))
        if retriever:
            report["retriever"] = _retriever_rates(retriever)
    speed = {(r["concurrency"], r["path"]): r["steps_per_s"] for r in report["results"]}
    report["batched_over_per_request"] = {
        str(c): round(speed[(c, "batched")] / speed[(c, "per_request")], 2) for c in concurrencies
    }
    return report
