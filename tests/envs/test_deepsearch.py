"""Deep Search: the episode's rules, the question catalogue, the options, and the real server
(started through the CLI on the shipped questions, BM25 over the shipped corpus in-process) driven
by a scripted agent that reads only observations."""

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

import envs
from agentgym_mega.config import ConfigError, load_config
from agentgym_mega.network import start_server
from agentgym_mega.rollout.env_client import EnvClient, wait_healthy
from envs.deepsearch import options, tasks
from envs.deepsearch.env import NO_ACTION, DeepSearchEnv, exact_match, information, normalize_answer, parse_action
from tests.conftest import refused_url, run_cli
from tests.envs.conftest import running
from tests.envs.deepsearch_agent import ScriptedSearchAgent

SHIPPED = tasks.load(options.DATA_DIR)


# -- the rules, as pure functions ---------------------------------------------------------------

def test_the_first_search_or_answer_tag_pair_is_the_action():
    reply = "<think>find it</think>\n<search> capital of Orvania </search>"
    assert parse_action(reply) == ("search", "capital of Orvania")
    assert parse_action("<answer>Kelda</answer><search>more</search>") == ("answer", "Kelda")
    assert parse_action("<search>a\nb</search>") == ("search", "a\nb")
    assert parse_action("<SEARCH>x</SEARCH>") == ("search", "x")
    for reply in ("Action: search capital", "<search>unclosed", "<search>x</answer>", "<answer>", ""):
        assert parse_action(reply) is None, reply


def test_squad_normalisation_and_exact_match():
    assert normalize_answer("The  Tower of London!") == "tower of london"
    assert normalize_answer("An apple, a day") == "apple day"
    assert exact_match("the Kelda River.", ["kelda river"]) and exact_match("1873", ["year", "1873"])
    assert not exact_match("Kelda", ["Kelda River"]) and not exact_match("", ["x"])


def test_passages_are_shown_as_search_r1_does():
    shown = information([{"id": "7", "contents": "Orvania\nOrvania is a country.\nIts capital is Kelda."},
                         {"id": "9", "contents": "Kelda\nA city."}])
    assert shown == ("<information>Doc 1(Title: Orvania) Orvania is a country. Its capital is Kelda.\n"
                     "Doc 2(Title: Kelda) A city.\n</information>")
    assert information([]) == "<information>No passage matched the query.</information>"


class _Retriever:
    def __init__(self, fail=False):
        self.fail, self.queries = fail, []

    def search(self, queries, topk):
        from envs.deepsearch.retriever import RetrieverError

        if self.fail:
            raise RetrieverError("http://127.0.0.1:9: connection refused")
        self.queries += queries
        return [[{"id": "1", "contents": "Kelda\nKelda is the capital of Orvania."}][:topk] for _ in queries]


def test_an_episode_searches_answers_wrong_then_right():
    questions = [tasks.Question("What is the capital of Orvania?", ("Kelda",), "single", "test")]
    retriever = _Retriever()
    env = DeepSearchEnv(questions, retriever, topk=3, max_query_chars=50)
    first = env.reset(0)
    assert first == {"observation": "Question: What is the capital of Orvania?", "reward": 0.0, "done": False,
                     "episode_score": 0.0, "success": False}
    searched = env.step("<think>look it up</think><search>  capital   of Orvania </search>")
    assert retriever.queries == ["capital of Orvania"] and searched["observation"].startswith("<information>Doc 1")
    wrong = env.step("<answer>Orvania City</answer>")
    assert (wrong["reward"], wrong["done"], wrong["success"]) == (0.0, False, False)
    assert 'Your answer "Orvania City" is not correct' in wrong["observation"]
    assert (searched["valid_action"], wrong["valid_action"]) == (True, True)
    untagged = env.step("no tags at all")
    assert untagged["observation"] == NO_ACTION and untagged["valid_action"] is False
    assert "empty" in env.step("<search> </search>")["observation"]
    long = env.step(f"<search>{'x' * 51}</search>")["observation"]
    assert "51 characters; the limit is 50" in long and len(retriever.queries) == 1  # refused before searching
    right = env.step("<answer>the kelda</answer>")
    assert (right["reward"], right["done"], right["episode_score"], right["success"]) == (1.0, True, 1.0, True)


def test_a_failing_retriever_is_an_observation_and_the_episode_goes_on():
    env = DeepSearchEnv([tasks.Question("Q?", ("A",), "single", "test")], _Retriever(fail=True), 3, 100)
    env.reset(0)
    out = env.step("<search>anything</search>")
    assert out["done"] is False and "search engine could not answer" in out["observation"]
    assert "connection refused" in out["observation"]
    assert env.step("<answer>A</answer>")["success"] is True


# -- the catalogue and the options ----------------------------------------------------------------

def _write_questions(path, n, prefix):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": f"{prefix}{i}", "question": f"{prefix} question {i}?",
                                        "golden_answers": [f"{prefix}{i}"]}) + "\n" for i in range(n)))


def test_flashrag_files_take_contiguous_ids_in_agentgyms_order(tmp_path):
    sizes = {"nq/train.jsonl": 3, "hotpotqa/train.jsonl": 2, "nq/test.jsonl": 2, "triviaqa/test.jsonl": 1,
             "popqa/test.jsonl": 1, "hotpotqa/dev.jsonl": 2, "2wikimultihopqa/dev.jsonl": 1,
             "musique/dev.jsonl": 1, "bamboogle/test.jsonl": 2}
    for name, n in reversed(sizes.items()):  # written in another order: the layout decides
        _write_questions(tmp_path / name, n, name.split("/")[0])
    loaded = tasks.load(str(tmp_path))
    assert [(q.source, q.split) for q in loaded] == [
        ("nq", "train")] * 3 + [("hotpotqa", "train")] * 2 + [("nq", "test")] * 2 + [
        ("triviaqa", "test"), ("popqa", "test")] + [("hotpotqa", "test")] * 2 + [
        ("2wikimultihopqa", "test"), ("musique", "test")] + [("bamboogle", "test")] * 2
    assert loaded[3].question == "hotpotqa question 0?" and loaded[5].golden_answers == ("nq0",)


def test_bad_question_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="no question files in .*layout.json or FlashRAG's files"):
        tasks.load(str(tmp_path))
    _write_questions(tmp_path / "nq" / "test.jsonl", 2, "nq")
    with open(tmp_path / "nq" / "test.jsonl", "a") as f:
        f.write('{"question": "no answers"}\n')
    with pytest.raises(ValueError, match=r"nq/test.jsonl:3: not a FlashRAG question"):
        tasks.load(str(tmp_path))
    (tmp_path / "layout.json").write_text(json.dumps([{"source": "nq", "file": "nq/test.jsonl", "split": "eval"}]))
    with pytest.raises(ValueError, match=r"layout.json: expected a list of .*found \{'source': 'nq'"):
        tasks.load(str(tmp_path))
    (tmp_path / "layout.json").write_text(json.dumps([{"source": "x", "file": "x.jsonl", "split": "test"}]))
    with pytest.raises(ValueError, match=r"layout.json names files that do not exist: \['.*/x.jsonl'\]"):
        tasks.load(str(tmp_path))
    (tmp_path / "x.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="hold no question"):
        tasks.load(str(tmp_path))


def test_the_shipped_layout_gives_both_splits_and_both_sources():
    counts = {}
    for q in SHIPPED:
        counts[(q.source, q.split)] = counts.get((q.source, q.split), 0) + 1
    assert set(counts) == {("single", "train"), ("twohop", "train"), ("single", "test"), ("twohop", "test")}
    assert min(counts.values()) >= 50


def test_options_are_checked_in_the_config_before_any_server_starts(tmp_path):
    cfg = load_config(None, ["env.name=deepsearch", "env.options={topk: 5, corpus: c.jsonl}"])
    assert cfg.env.options == {"topk": 5, "corpus": "c.jsonl"}
    assert envs.check_options("deepsearch", cfg.env.options).corpus.endswith("/c.jsonl")
    with pytest.raises(ConfigError, match="env.options: .*option nope=1 is not allowed"):
        load_config(None, ["env.name=deepsearch", "env.options={nope: 1}"])
    with pytest.raises(ConfigError, match="both name a retriever"):
        load_config(None, ["env.name=deepsearch", "env.options={corpus: a, retriever_url: 'http://x'}"])
    with pytest.raises(ConfigError, match="environment 'babyai' takes no options"):
        load_config(None, ["env.name=babyai", "env.options={topk: 3}"])


# -- the real server ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def deepsearch_server():
    with running("deepsearch", "--max-instances", "512") as server:
        yield server


def _play(client: EnvClient, questions: list[int], max_turns: int = 6) -> list[bool]:
    """The scripted agent on every question at once, through the batched path."""
    handles = client.create(len(questions))
    try:
        first = client.reset(handles, questions)
        seen = [[r["observation"]] for r in first]
        asked = [obs[0].removeprefix("Question: ") for obs in seen]
        agents = [ScriptedSearchAgent() for _ in questions]
        solved, live = [False] * len(questions), list(range(len(questions)))
        for _ in range(max_turns):
            if not live:
                break
            results = client.step([handles[i] for i in live], [agents[i].reply(asked[i], seen[i]) for i in live])
            for i, result in zip(list(live), results):
                assert "error" not in result, result
                seen[i].append(result["observation"])
                if result["done"]:
                    solved[i] = result["success"]
                    live.remove(i)
        return solved
    finally:
        client.close(handles)


def test_the_scripted_agent_solves_the_shipped_questions_through_the_server(deepsearch_server):
    client = EnvClient([deepsearch_server.url])
    try:
        unsolved = {}
        for source in ("single", "twohop"):
            ids = [i for i, q in enumerate(SHIPPED) if q.source == source]
            solved = [ok for start in range(0, len(ids), 256) for ok in _play(client, ids[start:start + 256])]
            unsolved[source] = [i for i, ok in zip(ids, solved) if not ok]
    finally:
        client.shutdown()
    # The claim (README, Deep Search): it solves all 900, the 500 single-hop and 400 two-hop.
    assert {source: len([q for q in SHIPPED if q.source == source]) for source in unsolved} == \
        {"single": 500, "twohop": 400}
    assert unsolved == {"single": [], "twohop": []}, unsolved


def _post(server, path, body=None):
    return requests.post(f"{server.url}{path}", json=body, timeout=60)


def test_malformed_replies_and_huge_queries_get_observations_or_clear_errors(deepsearch_server):
    s = deepsearch_server
    iid = _post(s, "/create").json()["id"]
    _post(s, "/reset", {"id": iid, "data_idx": 0})
    for reply in ("<search>unclosed", "<answer>x</search>", "Action: search capital", ""):
        out = _post(s, "/step", {"id": iid, "action": reply}).json()
        assert out["observation"] == NO_ACTION and out["done"] is False and out["valid_action"] is False, reply
    huge = _post(s, "/step", {"id": iid, "action": f"<search>{'word ' * 1000}</search>"}).json()
    assert "the limit is 1000" in huge["observation"]
    too_big = _post(s, "/step", {"id": iid, "action": f"<search>{'x' * 20000}</search>"})
    assert too_big.status_code == 400 and "the cap is" in too_big.json()["error"]
    assert _post(s, "/step", {"id": iid, "action": "<search>capital</search>"}).json()["observation"].startswith(
        "<information>Doc 1(Title: ")
    bad_task = _post(s, "/reset", {"id": iid, "data_idx": len(SHIPPED)})
    assert bad_task.status_code == 400 and f"from 0 to {len(SHIPPED) - 1}" in bad_task.json()["error"]


def test_a_dead_retriever_gives_an_observation_not_a_dead_episode():
    with refused_url() as url, running("deepsearch", "--option", f"retriever_url={url}", "--option",
                                       "timeout_s=5") as s:
        iid = _post(s, "/create").json()["id"]
        _post(s, "/reset", {"id": iid, "data_idx": 0})
        out = _post(s, "/step", {"id": iid, "action": "<search>anything</search>"}).json()
        assert "search engine could not answer" in out["observation"] and url in out["observation"]
        answer = SHIPPED[0].golden_answers[0]
        assert _post(s, "/step", {"id": iid, "action": f"<answer>{answer}</answer>"}).json()["success"] is True


def test_bad_options_stop_the_server_with_a_message(tmp_path):
    out = run_cli("env-server", "--env", "deepsearch", "--option", "topk=zero", timeout=120)
    assert out.returncode == 2 and "deepsearch option topk='zero' is not allowed" in out.stderr
    out = run_cli("env-server", "--env", "deepsearch", "--option", f"data_dir={tmp_path}", timeout=120)
    assert out.returncode == 2 and "no question files in" in out.stderr
    out = run_cli("env-server", "--env", "textcraft", "--option", "topk=3", timeout=120)
    assert out.returncode == 2 and "takes no options" in out.stderr


def test_64_concurrent_clients_each_get_their_own_episode(deepsearch_server):
    s = deepsearch_server
    barrier = threading.Barrier(64)

    def episode(k: int) -> tuple[str, bool]:
        session = requests.Session()
        iid = session.post(f"{s.url}/create", timeout=60).json()["id"]
        first = session.post(f"{s.url}/reset", json={"id": iid, "data_idx": k}, timeout=60).json()
        barrier.wait(timeout=60)
        wrong = session.post(f"{s.url}/step", json={"id": iid, "action": "<answer>not it</answer>"}, timeout=60)
        right = session.post(f"{s.url}/step", json={"id": iid, "action": f"<answer>{SHIPPED[k].golden_answers[0]}"
                                                                             "</answer>"}, timeout=60).json()
        session.post(f"{s.url}/close", json={"id": iid}, timeout=60)
        return first["observation"], wrong.json()["done"] is False and right["success"] is True

    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(episode, range(64)))
    assert [obs for obs, _ in results] == [f"Question: {SHIPPED[k].question}" for k in range(64)]
    assert all(ok for _, ok in results)


def test_env_servers_share_an_authenticated_retriever_and_a_wrong_secret_stops_one(tmp_path):
    index, secret = tmp_path / "index", tmp_path / "secret"
    secret.write_text("retriever-secret-1\n")
    assert run_cli("retriever", "build", "--corpus", f"{options.DATA_DIR}/corpus.jsonl", "--out", str(index),
                   timeout=300).returncode == 0
    retriever, url = start_server(["retriever", "serve", "--index", str(index), "--secret-file", str(secret)])
    try:
        wait_healthy(url)
        with running("deepsearch", "--option", f"retriever_url={url}", "--option",
                     f"retriever_secret_file={secret}") as s:
            iid = _post(s, "/create").json()["id"]
            _post(s, "/reset", {"id": iid, "data_idx": 0})
            out = _post(s, "/step", {"id": iid, "action": f"<search>{SHIPPED[0].question}</search>"}).json()
            assert out["observation"].startswith("<information>Doc 1(Title: ")
        refused = run_cli("env-server", "--env", "deepsearch", "--port", "0",
                          "--option", f"retriever_url={url}", timeout=120)
        assert refused.returncode == 2 and "the retriever refused this server's request at start-up" in refused.stderr
        assert "HTTP 401" in refused.stderr
    finally:
        retriever.terminate()
        retriever.wait(timeout=30)
