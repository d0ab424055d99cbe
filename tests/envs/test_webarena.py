"""WebArena through the real CLI server, a real headless Chromium and the shipped shop: the scripted
agent solves every shipped task from the observation text alone; bad ids, a 404, a refused
connection, a slow page and malformed replies each come back as observations; a click answers the
page its navigation lands on even when the page delays it; contexts are closed;
instances are isolated and run concurrently; a dead browser fails only its instances."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psutil
import pytest
import requests

from agentgym_mega.bench.env import _tree_memory
from envs.webarena.options import SITE_DIR, TASKS
from tests.conftest import eventually, refused_url, run_cli
from tests.envs.conftest import running
from tests.envs.test_original_clients import OriginalWebArenaClient
from tests.envs.webarena_agent import element, grader, run_plan

# A step that waits for nothing ends well within this on a loaded machine; one that waited it out
# (or a page three times as slow) would not, which the step-time asserts below tell apart.
STEP_TIMEOUT_S = 6


def _tasks() -> list[dict]:
    with open(TASKS, encoding="utf-8") as f:
        return json.load(f)


def _catalog() -> dict:
    with open(os.path.join(SITE_DIR, "catalog.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def judge():
    with grader() as served:
        yield served


@pytest.fixture(scope="module")
def server(judge):
    with running("webarena", "--max-instances", "48", "--option", f"judge_url={judge[0]}",
                 "--option", "judge_model=grader", "--option", f"step_timeout_s={STEP_TIMEOUT_S}") as served:
        yield served


class Episode:
    """One instance driven through the per-request endpoints, as AgentGym's clients do."""

    def __init__(self, url: str):
        self.url, self.http = url, requests.Session()
        self.id = self.http.post(f"{url}/create", timeout=60).json()["id"]

    def reset(self, task: int) -> dict:
        return self.http.post(f"{self.url}/reset", json={"id": self.id, "data_idx": task}, timeout=120).json()

    def step(self, reply: str) -> dict:
        return self.http.post(f"{self.url}/step", json={"id": self.id, "action": reply}, timeout=120).json()

    def close(self) -> None:
        self.http.post(f"{self.url}/close", json={"id": self.id}, timeout=60)


def _solve(url: str, task: dict) -> dict:
    episode = Episode(url)
    try:
        first = episode.reset(task["task_id"])
        assert first["observation"].startswith(f"Objective: {task['intent']}\nURL: "), first
        return run_plan(episode.step, first, task["scripted"])
    finally:
        episode.close()


def test_the_scripted_agent_solves_every_shipped_task_through_the_browser(server, judge):
    tasks = _tasks()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda t: _solve(server.url, t), tasks))
    failed = {t["task_id"]: (r["reward"], r["observation"]) for t, r in zip(tasks, results)
              if not (r["done"] and r["terminated"] and r["reward"] == 1.0 and r["success"])}
    assert not failed
    # The grader was asked once per fuzzy reference; an unachievable task answered "N/A" needs no judge.
    fuzzy = [(t["eval"]["reference_answers"] or {}).get("fuzzy_match") for t in tasks]
    asked = sum(len(refs) for refs in fuzzy if isinstance(refs, list))
    asked += sum(refs == "N/A" and t["scripted"][-1] != ["stop", "N/A"] for refs, t in zip(fuzzy, tasks))
    assert asked >= 4 and len(judge[1]) == asked
    assert {r.get("unjudged") for r in results} == {0}


def test_near_misses_end_the_episode_with_no_reward(server):
    tasks = [t for t in _tasks() if "exact_match" in (t["eval"]["reference_answers"] or {})]
    assert len(tasks) >= 6
    episode = Episode(server.url)
    try:
        for task in tasks:
            episode.reset(task["task_id"])
            near = task["eval"]["reference_answers"]["exact_match"] + " or so"
            result = episode.step(f"```stop [{near}]```")
            assert (result["done"], result["reward"], result["success"]) == (True, 0.0, False), task["task_id"]
    finally:
        episode.close()


def test_bad_actions_and_bad_pages_come_back_as_observations(server):
    episode = Episode(server.url)
    try:
        first = episode.reset(0)
        base = first["observation"].split("URL: ", 1)[1].split("/", 3)[:3]
        base = "/".join(base)
        missing = episode.step("```click [999999]```")
        assert "There is no element [999999]" in missing["observation"] and missing["valid_action"] is True
        no_action = episode.step("I am not sure what to do.")
        assert "No action found" in no_action["observation"] and no_action["valid_action"] is False
        unknown = episode.step("```fly [12]```")
        assert "not a valid action" in unknown["observation"] and unknown["valid_action"] is False
        assert "HTTP 404" in episode.step(f"```goto [{base}/no/such/page]```")["observation"]
        with refused_url() as url:
            closed = episode.step(f"```goto [{url}/]```")["observation"]
        assert "Could not load" in closed and "ERR_CONNECTION_REFUSED" in closed
        assert "http:// or https://" in episode.step("```goto [file:///etc/passwd]```")["observation"]
        assert "There is no tab [5]" in episode.step("```tab_focus [5]```")["observation"]
        started = time.monotonic()
        slow = episode.step(f"```goto [{base}/slow?seconds={3 * STEP_TIMEOUT_S}]```")
        assert f"did not finish loading within {STEP_TIMEOUT_S} s" in slow["observation"], slow
        assert time.monotonic() - started < 3 * STEP_TIMEOUT_S
        # The instance is still whole: it browses on.
        home = episode.step(f"```goto [{base}/]```")
        cart = element(home["observation"], "link", "Cart (0)")
        assert cart is not None, home["observation"]
        assert f"URL: {base}/cart" in episode.step(f"```click [{cart}]```")["observation"]
    finally:
        episode.close()
    gone = requests.post(f"{server.url}/step", json={"id": episode.id, "action": "```go_back```"}, timeout=60)
    assert gone.status_code == 404
    bad_task = requests.post(f"{server.url}/reset", json={"id": Episode(server.url).id, "data_idx": 10_000}, timeout=60)
    assert bad_task.status_code == 400 and "is not allowed" in bad_task.json()["error"]


def test_sixteen_concurrent_instances_keep_their_own_carts(server):
    products = _catalog()["products"][:16]

    def shop(product: dict) -> str:
        episode = Episode(server.url)
        try:
            base = "/".join(episode.reset(0)["observation"].split("URL: ", 1)[1].split("/", 3)[:3])
            page = episode.step(f"```goto [{base}/product/{product['id']}]```")["observation"]
            add = element(page, "button", "Add to cart")
            assert add is not None, page
            return episode.step(f"```click [{add}]```")["observation"]
        finally:
            episode.close()

    with ThreadPoolExecutor(16) as pool:
        carts = list(pool.map(shop, products))
    for product, cart in zip(products, carts):
        assert "/cart" in cart.split("\n", 2)[1] and f"'{product['name']}'" in cart
        others = [p["name"] for p in products if p is not product and f"'{p['name']}'" in cart]
        assert not others, (product["name"], others)


_BUSY_FORM = (b"<html><head><title>Busy form</title></head><body><form method='get' action='/landed'>"
              b"<button onclick='setTimeout(() => { const end = Date.now() + 600; while (Date.now() < end); })'>"
              b"Send</button></form></body></html>")


_LANDED = (b"<html><head><title>Landed</title></head><body><p>Arrived</p><button>Nothing</button>"
           b"<a href='#end'>Jump</a> <a href='/landed?again#end'>Again</a> <a href='/slow'>Slow</a>"
           b"<p id='end'>End</p></body></html>")


@pytest.fixture
def busy_site():
    """A page whose button queues 600 ms of script ahead of its form's submission, as a loaded
    machine delays a navigation; the page the form lands on; and a page slower than a step."""
    class Pages(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/slow":
                time.sleep(3 * STEP_TIMEOUT_S)
            body = _BUSY_FORM if self.path == "/" else _LANDED
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    site = ThreadingHTTPServer(("127.0.0.1", 0), Pages)
    threading.Thread(target=site.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{site.server_address[1]}"
    finally:
        site.shutdown()
        site.server_close()


def test_a_click_whose_navigation_starts_late_answers_the_new_page(server, busy_site):
    episode = Episode(server.url)
    try:
        episode.reset(0)
        form = episode.step(f"```goto [{busy_site}/]```")["observation"]
        send = element(form, "button", "Send")
        assert send is not None, form
        landed = episode.step(f"```click [{send}]```")["observation"]
        assert f"URL: {busy_site}/landed" in landed and "'Landed' (current)" in landed and "Arrived" in landed, landed
        # A click that does not navigate answers at once, with no navigation to wait out.
        started = time.monotonic()
        still = episode.step(f"```click [{element(landed, 'button', 'Nothing')}]```")["observation"]
        assert f"URL: {busy_site}/landed" in still and "Note:" not in still, still
        assert time.monotonic() - started < STEP_TIMEOUT_S
        # A link to a fragment of this page loads nothing and waits for nothing; one to a fragment
        # of another page loads that page.
        started = time.monotonic()
        jumped = episode.step(f"```click [{element(still, 'link', 'Jump')}]```")["observation"]
        assert f"URL: {busy_site}/landed?#end" in jumped and "Note:" not in jumped, jumped
        assert time.monotonic() - started < STEP_TIMEOUT_S
        again = episode.step(f"```click [{element(jumped, 'link', 'Again')}]```")["observation"]
        assert f"URL: {busy_site}/landed?again#end" in again and "Arrived" in again and "Note:" not in again, again
        # A click whose page outlasts the step's time is stopped within it, and the tab reads on.
        started = time.monotonic()
        slow = episode.step(f"```click [{element(again, 'link', 'Slow')}]```")["observation"]
        assert f"did not finish loading within {STEP_TIMEOUT_S} s" in slow and "Arrived" in slow, slow
        assert time.monotonic() - started < 2 * STEP_TIMEOUT_S
    finally:
        episode.close()


def test_contexts_are_closed_over_200_episodes(server):
    tasks = len(_tasks())

    def episode(k: int) -> None:
        one = Episode(server.url)
        assert one.reset(k % tasks)["observation"].startswith("Objective: ")
        one.close()

    def run(n: int) -> None:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(episode, range(n)))

    run(8)  # warm: the browser and its renderers are up
    def state() -> tuple[dict, int]:
        return requests.get(f"{server.url}/health", timeout=60).json(), _tree_memory(server.proc.pid)["rss_bytes"]

    before, rss_before = state()
    run(200)
    after, rss_after = state()
    assert after["instances"] == before["instances"]
    assert after["browser"]["contexts"] == before["browser"]["contexts"]
    assert after["browser"]["pages"] == before["browser"]["pages"]
    assert after["browser"]["launches"] == 1
    assert rss_after <= 1.2 * rss_before, (rss_before, rss_after)


def _chromium_main(pid: int) -> psutil.Process:
    tree = psutil.Process(pid).children(recursive=True)
    return next(p for p in tree if "chrom" in p.name() and not any(a.startswith("--type=") for a in p.cmdline()))


def test_a_dead_browser_fails_its_instances_and_the_next_one_relaunches_it(tmp_path):
    tasks = _tasks()[:1] + [dict(_tasks()[0], start_url="__SHOPPING__/slow?seconds=5")]
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps(tasks))
    with running("webarena", "--option", f"tasks={path}", "--option", "reset_timeout_s=1") as served:
        timed_out = Episode(served.url).reset(1)
        assert timed_out["observation"] == "TimeoutError" and "did not load within 1 s" in timed_out["error"]
        victim = Episode(served.url)
        victim.reset(0)
        _chromium_main(served.proc.pid).send_signal(signal.SIGKILL)
        eventually(lambda: not requests.get(f"{served.url}/health", timeout=60).json()["browser"]["connected"])
        dead = victim.http.post(f"{served.url}/step", json={"id": victim.id, "action": "```scroll [down]```"})
        assert dead.status_code == 500 and "browser" in dead.json()["error"]
        fresh = Episode(served.url)
        assert fresh.reset(0)["observation"].startswith("Objective: ")
        assert requests.get(f"{served.url}/health", timeout=60).json()["browser"]["launches"] == 2


def test_a_site_given_by_url_a_dead_judge_and_idle_instances():
    from envs.webarena.site.server import start_site

    fuzzy = next(t for t in _tasks() if isinstance((t["eval"]["reference_answers"] or {}).get("fuzzy_match"), list))
    shop, url = start_site()
    try:
        with refused_url() as judge, running("webarena", "--site", f"shopping={url}", "--idle-timeout", "1", "--option",
                                             f"judge_url={judge}/v1", "--option", "judge_model=gone") as served:
            episode = Episode(served.url)
            first = episode.reset(0)
            assert first["observation"].split("\n")[1].startswith(f"URL: {url}/")
            # A judge that cannot be reached ends the episode unscored, saying why; the instance goes on.
            episode.reset(fuzzy["task_id"])
            unscored = episode.step(f"```stop [{fuzzy['eval']['reference_answers']['fuzzy_match'][0]}]```")
            assert unscored["done"] and unscored["reward"] == 0.0 and "judge" in unscored["judge_error"]
            assert episode.reset(0)["observation"].startswith("Objective: ")
            assert requests.get(f"{served.url}/health", timeout=60).json()["browser"]["contexts"] == 1
            def left() -> tuple[int, int, int]:
                health = requests.get(f"{served.url}/health", timeout=60).json()
                return health["instances"], health["browser"]["contexts"], health["browser"]["pages"]

            eventually(lambda: left() == (0, 0, 0))  # past the idle timeout the sweeper closes all three
    finally:
        shop.shutdown()


def test_bad_options_stop_the_server_with_a_message(tmp_path):
    unknown = run_cli("env-server", "--env", "webarena", "--option", "speed=11", "--port", "0", timeout=120)
    assert unknown.returncode == 2 and "webarena option speed" in unknown.stderr
    site = run_cli("env-server", "--env", "webarena", "--site", "casino=http://127.0.0.1:1", timeout=120)
    assert site.returncode == 2 and "casino" in site.stderr
    wrong_kind = run_cli("env-server", "--env", "babyai", "--site", "shopping=http://127.0.0.1:1", timeout=120)
    assert wrong_kind.returncode == 2 and "--site is an option of webarena" in wrong_kind.stderr
    broken = _tasks()[:2]
    broken[1] = dict(broken[1], eval={"eval_types": ["string_match"], "reference_answers": {"close_enough": "x"}})
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps(broken))
    bad = run_cli("env-server", "--env", "webarena", "--option", f"tasks={path}", "--port", "0",
                  timeout=120)
    assert bad.returncode == 2 and "task 1" in bad.stderr and "close_enough" in bad.stderr


def test_agentgyms_webarena_client_works_unchanged(server):
    task = next(t for t in _tasks() if t["scripted"][-1][0] == "stop_with")
    client = OriginalWebArenaClient(server.url)
    first = client.reset(task["task_id"])
    assert first["observation"].startswith(f"Objective: {task['intent']}")
    assert client.observe() == first["observation"]

    def step(reply: str) -> dict:
        out = client.step(reply)
        return {"observation": out["state"], "reward": out["reward"], "done": out["done"]}

    last = run_plan(step, first, task["scripted"])
    assert (last["done"], last["reward"]) == (True, 1.0)
    client.close()
