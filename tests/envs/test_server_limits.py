"""Server limits and authentication through the real server process: oversized bodies, batches and
actions, the shared secret, the loopback rule, and the memory-derived cap on instances (a burst of
SciWorld creates past it starts no more JVMs than the cap)."""

import threading
import time

import psutil
import pytest
import requests

from envs.pool import InstancePool, memory_cap
from envs.server import make_server
from envs.textcraft import KIND as TEXTCRAFT
from tests.conftest import run_cli
from tests.envs.conftest import running

SECRET = "s3cret-token_for-tests"


@pytest.fixture(scope="module")
def limited():
    with running("textcraft", "--max-body-bytes", "2048", "--max-batch-ops", "4", "--max-action-chars", "64") as s:
        yield s


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    path = tmp_path_factory.mktemp("secret") / "secret"
    path.write_text(SECRET + "\n")
    with running("textcraft", "--secret-file", str(path)) as s:
        yield s


def _episode(url: str, headers=None) -> int:
    iid = requests.post(f"{url}/create", headers=headers).json()["id"]
    assert requests.post(f"{url}/reset", json={"id": iid, "data_idx": 0}, headers=headers).status_code == 200
    return iid


def _still_serves(url: str, iid: int, headers=None) -> None:
    out = requests.post(f"{url}/step", json={"id": iid, "action": "get 1 acacia logs"}, headers=headers)
    assert out.status_code == 200 and out.json()["observation"] == "Got 1 acacia logs"


def test_oversized_body_answers_413_whether_declared_or_streamed(limited):
    iid = _episode(limited.url)
    big = b'{"id": 0, "action": "' + b"x" * 3000 + b'"}'
    declared = requests.post(f"{limited.url}/step", data=big, headers={"content-type": "application/json"})
    assert declared.status_code == 413 and "over the 2048-byte limit" in declared.json()["error"]
    chunks = iter([big[:100], big[100:2000], big[2000:]])  # no Content-Length: chunked transfer
    streamed = requests.post(f"{limited.url}/step", data=chunks, headers={"content-type": "application/json"})
    assert streamed.status_code == 413 and "2048-byte limit" in streamed.json()["error"]
    _still_serves(limited.url, iid)


def test_batch_over_the_op_cap_answers_413(limited):
    iid = _episode(limited.url)
    ops = [{"op": "observation", "id": iid}]
    too_many = requests.post(f"{limited.url}/batch", json={"ops": ops * 5})
    assert too_many.status_code == 413 and "5 operations in one /batch; the cap is 4" in too_many.json()["error"]
    assert len(requests.post(f"{limited.url}/batch", json={"ops": ops * 4}).json()["results"]) == 4
    _still_serves(limited.url, iid)


def test_action_over_the_cap_answers_400_alone_and_per_item(limited):
    iid = _episode(limited.url)
    long = "get 1 acacia logs " + "x" * 60
    alone = requests.post(f"{limited.url}/step", json={"id": iid, "action": long})
    assert alone.status_code == 400 and f"{len(long)} characters; the cap is 64" in alone.json()["error"]
    ops = [{"op": "step", "id": iid, "action": long}, {"op": "step", "id": iid, "action": "inventory"}]
    results = requests.post(f"{limited.url}/batch", json={"ops": ops}).json()["results"]
    assert results[0]["status"] == 400 and "the cap is 64" in results[0]["error"]
    assert results[1]["observation"] == "Inventory: You are not carrying anything."
    health = requests.get(f"{limited.url}/health").json()
    assert (health["max_body_bytes"], health["max_batch_ops"], health["max_action_chars"]) == (2048, 4, 64)


def test_requests_without_the_secret_get_401_and_touch_nothing(secured):
    url, good = secured.url, {"Authorization": f"Bearer {SECRET}"}
    health = requests.get(f"{url}/health")  # open: probes and wait_healthy need no secret
    assert health.status_code == 200 and health.json()["auth"] is True
    iid = _episode(url, good)
    missing = requests.post(f"{url}/create")
    assert missing.status_code == 401 and "no Authorization header" in missing.json()["error"]
    wrong = requests.post(f"{url}/create", headers={"Authorization": "Bearer not-it"})
    assert wrong.status_code == 401 and "a wrong secret" in wrong.json()["error"]
    assert missing.headers["www-authenticate"] == "Bearer"
    step = {"id": iid, "action": "get 1 acacia logs"}
    assert requests.post(f"{url}/step", json=step, headers={"Authorization": SECRET}).status_code == 401
    oversized = requests.post(f"{url}/step", data=b"x" * (2 << 20), headers={"Authorization": "Bearer no"})
    assert oversized.status_code == 401  # refused before the body is read
    assert requests.get(f"{url}/tasks").status_code == 401
    assert requests.post(f"{url}/close", json={"id": iid}, headers={"Authorization": "Bearer x"}).status_code == 401
    assert requests.get(f"{url}/health").json()["instances"] == 1  # the refused creates made nothing
    _still_serves(url, iid, good)
    inventory = requests.post(f"{url}/step", json={"id": iid, "action": "inventory"}, headers=good).json()
    assert inventory["observation"] == "Inventory: [acacia logs] (1) "  # the refused step did not run
    assert requests.post(f"{url}/create", headers=good).status_code == 200
    assert requests.get(f"{url}/tasks", headers=good).json()["count"] == 544


def test_cli_refuses_a_public_host_without_a_secret(tmp_path):
    refused = run_cli("env-server", "--env", "textcraft", "--host", "0.0.0.0", timeout=120)
    assert refused.returncode == 2 and "refusing to serve on 0.0.0.0 without a secret" in refused.stderr
    (tmp_path / "empty").write_text("\n")
    empty = run_cli("env-server", "--env", "textcraft", "--secret-file", str(tmp_path / "empty"), timeout=120)
    assert empty.returncode == 2 and "is not allowed; allowed: non-empty printable ASCII" in empty.stderr
    missing = run_cli("env-server", "--env", "textcraft", "--secret-file", str(tmp_path / "nope"), timeout=120)
    assert missing.returncode == 2 and "cannot read it" in missing.stderr


def test_make_server_secret_sources_and_the_insecure_override(monkeypatch):
    monkeypatch.delenv("AGENTGYM_MEGA_SECRET", raising=False)
    assert make_server("textcraft", "0.0.0.0", 0, insecure=True).config.app.state.secured is False
    assert make_server("textcraft", "10.1.2.3", 0, secret=SECRET).config.app.state.secured is True
    monkeypatch.setenv("AGENTGYM_MEGA_SECRET", SECRET)
    assert make_server("textcraft", "0.0.0.0", 0).config.app.state.secured is True
    monkeypatch.setenv("AGENTGYM_MEGA_SECRET", "")  # empty: no secret, so loopback only
    with pytest.raises(ValueError, match="refusing to serve on 10.1.2.3 without a secret"):
        make_server("textcraft", "10.1.2.3", 0)
    with pytest.raises(ValueError, match="the secret parameter is not allowed"):
        make_server("textcraft", "127.0.0.1", 0, secret="two words")


def test_the_cap_is_the_memory_cap_unless_max_instances_is_lower():
    assert memory_cap(384 << 20, 24 << 30, 0.8) == 51 and memory_cap(1 << 30, 1 << 20, 0.8) == 1
    free = psutil.virtual_memory().available
    pool = InstancePool(TEXTCRAFT, max_instances=10**12)
    lower = InstancePool(TEXTCRAFT, max_instances=3)
    try:
        expected = 0.8 * free / TEXTCRAFT.instance_bytes
        assert pool.max_instances == pool.memory_cap and 0.8 * expected < pool.memory_cap < 1.25 * expected
        assert pool.cap_reason.startswith(f"the memory cap {pool.memory_cap} = 80% of")
        assert lower.max_instances == 3 and lower.cap_reason.startswith("--max-instances 3, under the memory cap")
    finally:
        pool.shutdown()
        lower.shutdown()
    with pytest.raises(ValueError, match=r"memory_share=1.5 is not allowed; allowed: a fraction in \(0, 1\]"):
        InstancePool(TEXTCRAFT, memory_share=1.5)


def test_sciworld_burst_past_the_memory_cap_starts_no_more_jvms_than_the_cap():
    from envs.sciworld import KIND as SCIWORLD

    target, burst = 6, 30
    share = (target + 0.5) * SCIWORLD.instance_bytes / psutil.virtual_memory().available
    with running("sciworld", "--memory-share", f"{share:.6f}") as s:
        health = requests.get(f"{s.url}/health").json()
        cap = health["max_instances"]
        assert 3 <= cap <= 10 and health["memory_cap"] == cap and "the memory cap" in health["cap"]
        base_rss = s.rss()
        answers, most_jvms, stop = [], [0], threading.Event()

        def watch() -> None:
            while not stop.is_set():
                most_jvms[0] = max(most_jvms[0], len(s.java_children()))
                time.sleep(0.05)

        def create() -> None:
            answers.append(requests.post(f"{s.url}/create", timeout=300))

        watcher = threading.Thread(target=watch)
        watcher.start()
        threads = [threading.Thread(target=create) for _ in range(burst)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        watcher.join()
        created = [r.json()["id"] for r in answers if r.status_code == 200]
        full = [r.json()["error"] for r in answers if r.status_code == 503]
        assert len(created) == cap and len(full) == burst - cap
        assert all(f"server full: {cap} live instances" in e for e in full)
        assert most_jvms[0] <= cap and len(s.java_children()) == cap
        total = s.rss() + sum(p.memory_info().rss for p in s.java_children())
        assert total <= base_rss + cap * SCIWORLD.instance_bytes
        for iid in created:
            requests.post(f"{s.url}/close", json={"id": iid})
        assert s.java_children() == [] and requests.post(f"{s.url}/create").status_code == 200
