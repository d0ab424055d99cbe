"""The AgentGym HTTP protocol and every malformed-input case, through the real server process."""

import pytest
import requests

from tests.conftest import eventually
from tests.envs.conftest import running


def _post(server, path, body=None, raw=None):
    if raw is not None:
        return requests.post(server.url + path, data=raw, headers={"content-type": "application/json"})
    return requests.post(server.url + path, json=body)


def _new(server, data_idx=0) -> int:
    iid = _post(server, "/create").json()["id"]
    assert _post(server, "/reset", {"id": iid, "data_idx": data_idx}).status_code == 200
    return iid


def test_agentgym_episode_with_bare_and_react_actions(textcraft_server):
    s = textcraft_server
    iid = _post(s, "/create").json()["id"]
    reset = _post(s, "/reset", {"id": iid, "data_idx": 2}).json()
    assert reset["observation"].startswith("Crafting commands:") and reset["done"] is False
    bare = _post(s, "/step", {"id": iid, "action": "get 2 oak logs"}).json()
    assert bare == {"observation": "Got 2 oak logs", "reward": 0.0, "done": False, "episode_score": 0.0,
                    "success": False, "valid_action": True, "action": "get 2 oak logs"}
    reply = "Thought: I need to check.\nAction: inventory\nThen I will craft."
    react = _post(s, "/step", {"id": iid, "action": reply}).json()
    assert react["observation"] == "Inventory: [oak logs] (2) " and react["action"] == "inventory"
    obs = requests.get(f"{s.url}/observation", params={"id": iid}).json()
    assert obs == react["observation"]
    assert _post(s, "/close", {"id": iid}).json() is True


def test_health_and_tasks(textcraft_server):
    health = requests.get(f"{textcraft_server.url}/health").json()
    assert health["status"] == "ok" and health["env"] == "textcraft" and health["rss_bytes"] > 0
    tasks = requests.get(f"{textcraft_server.url}/tasks").json()
    assert tasks["count"] == 544 and tasks["tasks"][533] == {"id": 533, "category": "depth-4", "split": "train"}
    test = requests.get(f"{textcraft_server.url}/tasks", params={"split": "test"}).json()
    assert 0 < test["count"] < 544 and all(t["split"] == "test" for t in test["tasks"])


@pytest.mark.parametrize("path,body,raw,status,words", [
    ("/step", None, b"not json", 400, "not valid JSON"),
    ("/reset", None, b"[1, 2]", 400, "must be a JSON object"),
    ("/step", {"id": 10**9, "action": "inventory"}, None, 404, "unknown id"),
    ("/close", {"id": 10**9}, None, 404, "unknown id"),
    ("/step", {"id": "zero", "action": "inventory"}, None, 400, "allowed: an integer id"),
    ("/reset", {"id": 0, "data_idx": -1}, None, 400, "allowed: an integer >= 0 (ids wrap modulo the 544"),
    ("/reset", {"id": 0, "data_idx": 1.5}, None, 400, "allowed: an integer >= 0"),
    ("/reset", {"id": 0, "data_idx": "3"}, None, 400, "allowed: an integer >= 0"),
    ("/batch", {"ops": "step"}, None, 400, "non-empty list of operations"),
])
def test_malformed_requests_get_json_errors(textcraft_server, path, body, raw, status, words):
    _new(textcraft_server)  # id 0 exists, so data_idx errors are about the index, not the id
    resp = _post(textcraft_server, path, body, raw)
    assert resp.status_code == status and words in resp.json()["error"]
    assert requests.get(f"{textcraft_server.url}/health").status_code == 200


def test_observation_with_bad_id(textcraft_server):
    resp = requests.get(f"{textcraft_server.url}/observation", params={"id": "abc"})
    assert resp.status_code == 400 and "integer id" in resp.json()["error"]
    resp = requests.get(f"{textcraft_server.url}/observation", params={"id": 10**9})
    assert resp.status_code == 404


def test_step_needs_reset_and_a_finished_episode_needs_another(textcraft_server):
    s = textcraft_server
    iid = _post(s, "/create").json()["id"]
    early = _post(s, "/step", {"id": iid, "action": "inventory"})
    assert early.status_code == 409 and "POST /reset first" in early.json()["error"]
    _post(s, "/reset", {"id": iid, "data_idx": 0})  # acacia planks from acacia logs
    _post(s, "/step", {"id": iid, "action": "get 1 acacia logs"})
    won = _post(s, "/step", {"id": iid, "action": "craft 4 acacia planks using 1 acacia logs"}).json()
    assert won["reward"] == 1.0 and won["done"] is True
    after = _post(s, "/step", {"id": iid, "action": "inventory"})
    assert after.status_code == 409 and "finished" in after.json()["error"]
    _post(s, "/reset", {"id": iid, "data_idx": 0})
    assert _post(s, "/step", {"id": iid, "action": "inventory"}).status_code == 200


def test_babyai_ids_and_unknown_commands(babyai_server):
    s = babyai_server
    iid = _new(s, data_idx=40 * 10**6 + 1)  # huge id: level 2, seed 1,000,000
    assert _post(s, "/reset", {"id": iid, "data_idx": -3}).json()["error"].endswith(
        "allowed: an integer >= 0 (level = id % 40 + 1, seed = id // 40)")
    out = _post(s, "/step", {"id": iid, "action": "Action: dance"}).json()
    assert "'dance' is not a valid action" in out["observation"] and "go to <object>" in out["observation"]
    assert out["valid_action"] is False


def test_batch_results_are_per_item(textcraft_server):
    s = textcraft_server
    iid = _new(s, data_idx=5)
    ops = [{"op": "step", "id": iid, "action": "inventory"}, {"op": "step", "id": 10**9, "action": "x"},
           {"op": "reset", "id": iid, "data_idx": -1}, {"op": "fly"}, {"op": "close", "id": iid}]
    results = _post(s, "/batch", {"ops": ops}).json()["results"]
    assert results[0]["observation"].startswith("Inventory")
    assert [r.get("status") for r in results[1:4]] == [404, 400, 400]
    assert results[4] == {"closed": True}


def test_server_full_and_idle_eviction():
    with running("textcraft", "--max-instances", "2", "--idle-timeout", "1") as s:
        ids = [_post(s, "/create").json()["id"] for _ in range(2)]
        full = _post(s, "/create")
        assert full.status_code == 503 and "server full" in full.json()["error"]
        eventually(lambda: requests.get(f"{s.url}/health").json()["instances"] == 0)  # idle 1 s: swept
        gone = _post(s, "/reset", {"id": ids[0], "data_idx": 0})
        assert gone.status_code == 404 and "evicted" in gone.json()["error"]
        assert _post(s, "/create").status_code == 200
