"""The trainer's client: servers started as Ray processes on CPU, batched calls fanned out over them,
split to fit the servers' limits, with the shared secret."""

import json
import time

import pytest
import ray
import requests

from agentgym_mega.rollout.env_client import EnvClient, EnvRequestRejected, Handle, StepGroups, start_servers
from envs.textcraft.game import TextCraftEnv
from tests.envs.conftest import running

SECRET = "client-test-secret"


def test_client_sends_the_secret_and_splits_batches_to_the_server_limits(tmp_path):
    (tmp_path / "secret").write_text(SECRET)
    limits = ("--max-batch-ops", "3", "--max-body-bytes", "1200")
    with running("textcraft", "--secret-file", str(tmp_path / "secret"), *limits) as server:
        client = EnvClient([server.url], secret=SECRET, max_batch_ops=3, max_body_bytes=1200)
        handles = client.create(10)
        assert sorted(h.id for h in handles) == list(range(10))
        client.reset(handles, [0] * 10)
        # ~300-byte replies: 3 operations or ~1200 bytes per call, so at least four calls.
        replies = [f"Thought: {'hmm ' * 70}\nAction: get {k + 1} acacia logs" for k in range(10)]
        steps = client.step(handles, replies)
        assert [r["observation"] for r in steps] == [f"Got {k + 1} acacia logs" for k in range(10)]
        assert all((r["episode_score"], r["success"]) == (0.0, False) for r in steps)
        won = client.step(handles[:1], ["craft 4 acacia planks using 1 acacia logs"])[0]
        assert (won["done"], won["episode_score"], won["success"]) == (True, 1.0, True)
        oversized = client.step(handles[1:3], ["inventory " + "x" * 2000, "inventory"])
        assert oversized[0]["status"] == 413 and "over the 1200-byte request limit" in oversized[0]["error"]
        assert oversized[1]["observation"].startswith("Inventory: [acacia logs] (3)")
        assert client.close(handles) == [{"closed": True}] * 10
        with pytest.raises(EnvRequestRejected, match="HTTP 401: unauthorized: a wrong secret"):
            EnvClient([server.url], secret="not-it").create(1)
        with pytest.raises(EnvRequestRejected, match="HTTP 401: unauthorized: no Authorization header"):
            EnvClient([server.url]).tasks()
        client.shutdown()
    # The server is gone: every item of every call it would have taken fails on its own.
    gone = EnvClient([server.url], max_batch_ops=3).step(handles, ["inventory"] * 10)
    assert [r["status"] for r in gone] == [503] * 10 and all("unavailable" in r["error"] for r in gone)


@pytest.mark.slow
def test_step_groups_send_what_arrives_together_as_one_batch(tmp_path):
    """Async episodes step one by one; StepGroups sends the steps that arrive within its window
    to their server as one /batch (one POST, every answer its own), and with window 0 each alone.
    A rejected request reaches every caller of its group."""
    from concurrent.futures import ThreadPoolExecutor

    class Counting(EnvClient):
        posts = 0

        def _post(self, url, path, body, timeout=None):
            Counting.posts += path == "/batch"
            return super()._post(url, path, body, timeout)

    (tmp_path / "secret").write_text(SECRET)
    with running("textcraft", "--secret-file", str(tmp_path / "secret")) as server:
        client = Counting([server.url], secret=SECRET)
        handles = client.create(8)
        client.reset(handles, [0] * 8)
        for window, posts in ((0.2, 1), (0.0, 8)):
            groups, Counting.posts = StepGroups(client, window), 0
            with ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(lambda k: groups.step(handles[k], f"Action: get {k + 1} acacia logs"),
                                        range(8)))
            assert Counting.posts == posts
            assert [a["observation"] for a in answers] == [f"Got {k + 1} acacia logs" for k in range(8)]
        wrong = StepGroups(EnvClient([server.url], secret="not-it"), 0.2)
        with ThreadPoolExecutor(3) as pool:
            waits = [pool.submit(wrong.step, handles[k], "inventory") for k in range(3)]
        for wait in waits:
            with pytest.raises(EnvRequestRejected, match="HTTP 401"):
                wait.result()


def test_ray_actor_servers_and_batched_fan_out():
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        procs, urls = start_servers("textcraft", num_servers=2, num_cpus=0.5, secret=SECRET)
        assert len(set(urls)) == 2
        assert requests.post(urls[0] + "/create").status_code == 401
        health = requests.get(urls[0] + "/health").json()
        assert health["auth"] is True and "40% of" in health["cap"]  # two servers on this one node
        client = EnvClient(urls, secret=SECRET)
        handles = client.create(8)
        assert sorted({h.server for h in handles}) == [0, 1]
        idxs = [3, 130, 420, 540, 3, 130, 420, 540]
        first = client.reset(handles, idxs)
        replies = [f"Thought: step {k}.\nAction: get {k + 1} oak logs" for k in range(8)]
        steps = client.step(handles, replies)
        for k, (idx, obs, out) in enumerate(zip(idxs, first, steps)):
            alone = TextCraftEnv()
            assert obs["observation"] == alone.reset(idx)["observation"]
            assert out["observation"] == f"Got {k + 1} oak logs"
        broken = client.step([Handle(handles[0].server, 10**9)], ["inventory"])
        assert broken[0]["status"] == 404
        assert client.close(handles) == [{"closed": True}] * 8
        assert [requests.get(u + "/health", timeout=10).json()["instances"] for u in urls] == [0, 0]
        # A server that is gone at create time: its instances fail per item, the others work.
        ray.kill(procs[1])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # ray.kill returns before the process is gone
            try:
                requests.get(urls[1] + "/health", timeout=2)
            except requests.ConnectionError:
                break
            time.sleep(0.1)
        handles = client.create(4)
        results = client.reset(handles, [3, 3, 130, 130])
        assert [h.id >= 0 for h in handles] == [True, False, True, False]
        assert all("error" not in r for r in results[0::2])
        assert all("unavailable" in r["error"] for r in results[1::2])
        client.close(handles[0::2])
        client.shutdown()
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_ray_actor_servers_take_the_environments_options(tmp_path):
    # Questions of a source only this directory has: the catalogue names it only if the server
    # the server process started loaded env_options' data_dir, and its searches use env_options' corpus.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "train.jsonl").write_text(json.dumps({"question": "Who founded Oriveth?",
                                                               "golden_answers": ["Kaelen Morvast"]}) + "\n")
    (tmp_path / "layout.json").write_text(json.dumps([{"source": "mine", "file": "mine/train.jsonl",
                                                       "split": "train"}]))
    (tmp_path / "corpus.jsonl").write_text(json.dumps({"id": "0", "contents": "Oriveth\nOriveth was founded by "
                                                                                  "Kaelen Morvast."}) + "\n")
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        options = {"data_dir": str(tmp_path), "corpus": str(tmp_path / "corpus.jsonl"), "topk": 1}
        _, urls = start_servers("deepsearch", num_servers=1, num_cpus=0.5, secret=SECRET, env_options=options)
        client = EnvClient(urls, secret=SECRET)
        assert [(t.id, t.category, t.split) for t in client.tasks()] == [(0, "mine", "train")]
        handles = client.create(1)
        assert client.reset(handles, [0])[0]["observation"] == "Question: Who founded Oriveth?"
        found = client.step(handles, ["<think>Look.</think>\n<search>Oriveth founded</search>"])[0]["observation"]
        assert found == "<information>Doc 1(Title: Oriveth) Oriveth was founded by Kaelen Morvast.\n</information>"
        client.shutdown()
    finally:
        ray.shutdown()
