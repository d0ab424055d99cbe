"""Under RL load: no memory growth over many episodes, and isolated episodes for concurrent clients."""

import threading

import pytest
import requests

from envs.babyai.text import BabyAIEnv
from envs.environment import extract_action
from envs.textcraft.game import TextCraftEnv

CYCLES = 1000
WARMUP = 50  # first episodes fill caches (level envs, response paths); RSS is measured after them
FINISHED = "<409: episode finished>"
SCRIPTS = {
    "textcraft": (TextCraftEnv, ["get 1 oak logs", "inventory", "craft 1 stick using 1 oak logs",
                                 "Thought: check.\nAction: inventory"]),
    "babyai": (BabyAIEnv, ["turn left", "move forward", "Action: turn right", "check available actions"]),
}


def _cycle(session, url: str, k: int, action: str) -> None:
    iid = session.post(f"{url}/create").json()["id"]
    session.post(f"{url}/reset", json={"id": iid, "data_idx": k})
    assert "observation" in session.post(f"{url}/step", json={"id": iid, "action": action}).json()
    assert session.post(f"{url}/close", json={"id": iid}).json() is True


@pytest.mark.slow
@pytest.mark.parametrize("env", ["textcraft", "babyai"])
def test_1000_episode_cycles_leave_rss_within_10_percent(env, request):
    server = request.getfixturevalue(f"{env}_server")
    actions = SCRIPTS[env][1]
    session = requests.Session()
    for k in range(WARMUP):
        _cycle(session, server.url, k, actions[k % len(actions)])
    start = server.rss()
    for k in range(CYCLES):
        _cycle(session, server.url, k, actions[k % len(actions)])
    end = server.rss()
    assert end <= 1.10 * start, f"RSS grew from {start / 2**20:.1f} MiB to {end / 2**20:.1f} MiB"
    assert requests.get(f"{server.url}/health").json()["instances"] == 0


@pytest.mark.parametrize("env", ["textcraft", "babyai"])
def test_64_concurrent_clients_get_isolated_consistent_episodes(env, request):
    server = request.getfixturevalue(f"{env}_server")
    make, actions = SCRIPTS[env]
    clients = 64
    got: dict[int, list[str]] = {}
    barrier = threading.Barrier(clients)

    def client(k: int) -> None:
        session = requests.Session()
        barrier.wait()  # every client starts at once
        iid = session.post(f"{server.url}/create").json()["id"]
        trace = [session.post(f"{server.url}/reset", json={"id": iid, "data_idx": 7 * k}).json()["observation"]]
        for action in actions * 2:
            resp = session.post(f"{server.url}/step", json={"id": iid, "action": action})
            trace.append(FINISHED if resp.status_code == 409 else resp.json()["observation"])
        session.post(f"{server.url}/close", json={"id": iid})
        got[k] = trace

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # The same episodes played alone, in process, must read exactly the same.
    for k in range(clients):
        alone = make()
        expected, done = [alone.reset(7 * k)["observation"]], False
        for action in actions * 2:  # a random walk can finish a BabyAI "go to": later steps get 409
            if done:
                expected.append(FINISHED)
                continue
            out = alone.step(extract_action(action))
            expected.append(out["observation"])
            done = out["done"]
        assert got[k] == expected, f"client {k} saw another episode's state"
