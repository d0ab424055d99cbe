"""The Deep Search retriever: BM25 and dense (FAISS against a brute-force inner product, with a
tiny sentence-transformers encoder made here) indexes built from a corpus written here, bad
corpora, and the server through the CLI: Search-R1's format, limits, the secret, 64 concurrent
clients, RemoteRetriever."""

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests

from agentgym_mega.network import start_server
from agentgym_mega.rollout.env_client import wait_healthy
from envs.deepsearch import options
from envs.deepsearch.retriever import (
    CoalescingRetriever,
    RemoteRetriever,
    RetrieverError,
    RetrieverInputError,
    bench_queries,
    build_index,
    load_index,
    open_retriever,
)
from tests.conftest import REPO, refused_url, run_cli
from tests.envs.tiny_encoder import make_tiny_encoder

SECRET = "retriever-secret_for-tests"
# One made-up entity per passage, so a query naming one has exactly one right answer.
NAMES = [f"{a}{b}" for a in ("Zor", "Quil", "Brem", "Tav", "Oss", "Lun", "Kra", "Vex") for b in
         ("ba", "dor", "mira", "tek", "vin", "sul", "gar", "poe")]
KINDS = ("river", "mountain", "city", "composer", "painter", "island", "festival", "bridge")


def _passages() -> list[dict]:
    rows = [{"id": f"p{i}", "contents": f"{name}\n{name} is a {KINDS[i % 8]} known since year {1500 + 7 * i}."}
            for i, name in enumerate(NAMES)]
    rows.append({"id": 999, "contents": "Rivers\nA river is a natural flowing watercourse toward an ocean."})
    return rows


def _write(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _question(i: int) -> str:
    return f"When was {NAMES[i]} first known?"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return _write(tmp_path_factory.mktemp("corpus") / "corpus.jsonl", _passages())


@pytest.fixture(scope="module")
def bm25_dir(corpus, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("bm25") / "index")
    report = build_index(corpus, out, progress=False)
    assert report["passages"] == len(NAMES) + 1 and report["indexes"] == ["bm25"]
    assert report["bytes"] > 0 and report["passages_per_s"] > 0
    return out


def test_bm25_finds_the_named_entity_respects_topk_and_reloads_memory_mapped(bm25_dir, tmp_path):
    index = load_index(bm25_dir)
    assert index.mode == "bm25" and len(index) == len(NAMES) + 1
    assert isinstance(index._bm25.scores["data"], np.memmap)
    questions = [_question(i) for i in range(len(NAMES))]
    hits = index.search(questions, 3)
    for i, per_query in enumerate(hits):
        assert per_query[0]["id"] == f"p{i}" and per_query[0]["contents"].startswith(f"{NAMES[i]}\n")
        assert 1 <= len(per_query) <= 3 and [h["score"] for h in per_query] == sorted(
            (h["score"] for h in per_query), reverse=True)
    assert [len(h) for h in index.search(["year known", "river"], 2)] == [2, 2]
    assert len(index.search(["year known"], 500)[0]) == len(NAMES)  # topk past the corpus: every match
    assert index.search(["natural watercourse"], 3)[0][0]["id"] == "999"  # integer ids come back as strings
    # No words to match: no hits, rather than arbitrary passages at score 0.
    assert index.search(["", "   ", "the of and", "xylophone"], 3) == [[], [], [], []]
    with pytest.raises(RetrieverInputError, match="a list of strings"):
        index.search("Zorba", 3)
    with pytest.raises(RetrieverInputError, match="topk=0"):
        index.search(["Zorba"], 0)

    moved = str(tmp_path / "moved")
    shutil.copytree(bm25_dir, moved)
    assert load_index(moved, "bm25").search(questions, 3) == hits
    with pytest.raises(RetrieverInputError, match="no dense index"):
        load_index(moved, "dense")


def test_open_retriever_indexes_a_corpus_and_leaves_nothing_on_disk(corpus, bm25_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    from_corpus = open_retriever(options.check({"corpus": corpus}))
    assert os.listdir(tmp_path) == []
    assert from_corpus.search([_question(5)], 3) == load_index(bm25_dir).search([_question(5)], 3)
    from_dir = open_retriever(options.check({"index_dir": bm25_dir}))
    assert from_dir.search([_question(7)], 1)[0][0]["id"] == "p7"


@pytest.mark.parametrize("lines, where, says", [
    (['{"id": "a", "contents": "A\\ntext"}', "not json"], "line 2", "not JSON"),
    (['[1, 2]'], "line 1", "a JSON list"),
    (['{"contents": "A\\ntext"}'], "line 1", "no id"),
    (['{"id": "a", "contents": "A"}', "", '{"id": "b"}'], "line 3", "no contents"),
    (['{"id": null, "contents": "A"}'], "line 1", "id null is not allowed"),
    (['{"id": "a", "contents": ["A"]}'], "line 1", 'contents ["A"] is not allowed'),
    (['{"id": "a", "contents": "A"}', '{"id": "a", "contents": "B"}'], "line 2", "already the id of line 1"),
    ([], "", "no passages"),
])
def test_a_bad_corpus_names_file_and_line_and_writes_nothing(tmp_path, lines, where, says):
    path = _write(tmp_path / "bad.jsonl", lines)
    out = tmp_path / "index"
    with pytest.raises(RetrieverInputError) as error:
        build_index(path, str(out), progress=False)
    assert path in str(error.value) and where in str(error.value) and says in str(error.value)
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]


def test_the_cli_refuses_a_missing_corpus_and_keeps_a_previous_index(corpus, tmp_path):
    out = str(tmp_path / "index")
    build_index(corpus, out, progress=False)
    done = run_cli("retriever", "build", "--corpus", str(tmp_path / "absent.jsonl"), "--out", out, timeout=60)
    assert done.returncode == 2 and "absent.jsonl" in done.stderr and "no such file" in done.stderr
    duplicated = _write(tmp_path / "dup.jsonl", _passages() + [{"id": "p3", "contents": "again"}])
    done = run_cli("retriever", "build", "--corpus", duplicated, "--out", out, timeout=60)
    assert done.returncode == 2 and f"line {len(NAMES) + 2}" in done.stderr, done.stderr
    assert sorted(os.listdir(tmp_path)) == ["dup.jsonl", "index"]
    assert load_index(out).search([_question(1)], 1)[0][0]["id"] == "p1"
    with pytest.raises(RetrieverInputError, match="exists and is not a retriever index"):
        build_index(corpus, str(tmp_path), progress=False)  # would delete dup.jsonl


# The dense index: a tiny random encoder (tests/envs/tiny_encoder.py).

@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory) -> str:
    texts = [f"passage: {r['contents']}" for r in _passages()] + [f"query: {_question(0)}"]
    return make_tiny_encoder(tmp_path_factory.mktemp("encoder"), texts)


def _offline() -> dict:
    return os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@contextlib.contextmanager
def _serving(*args: str, env: dict | None = None):
    proc, url = start_server(["retriever", "serve", *args], cwd=REPO, env=env)
    try:
        wait_healthy(url, timeout=60)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_dense_equals_a_brute_force_inner_product_offline(corpus, encoder_dir, tmp_path):
    from sentence_transformers import SentenceTransformer

    out = str(tmp_path / "dense")
    done = subprocess.run([sys.executable, "-m", "agentgym_mega.cli", "retriever", "build", "--corpus", corpus,
                           "--out", out, "--dense-model", encoder_dir, "--batch-size", "16"],
                          cwd=REPO, env=_offline(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "passages/s" in done.stdout and "MiB on disk" in done.stdout
    manifest = json.load(open(os.path.join(out, "retriever.json")))
    assert manifest["indexes"] == ["bm25", "dense"] and manifest["dense"]["dim"] == 32

    model = SentenceTransformer(encoder_dir, device="cpu", local_files_only=True)
    rows = _passages()
    passages = model.encode([f"passage: {r['contents']}" for r in rows], normalize_embeddings=True)
    queries = [_question(3), "river festival", "a bridge known since year 1600", "zzz unknown words"]
    scores = model.encode([f"query: {q}" for q in queries], normalize_embeddings=True) @ passages.T
    index = load_index(out)
    assert index.mode == "dense"
    found = index.search(queries, 5)
    for per_query, row in zip(found, scores):
        best = np.argsort(-row, kind="stable")[:5]
        assert [h["id"] for h in per_query] == [str(rows[i]["id"]) for i in best]
        np.testing.assert_allclose([h["score"] for h in per_query], row[best], atol=1e-5)

    # The server loads the encoder from its directory with the Hub switched off.
    with _serving("--index", out, env=_offline()) as url:
        assert requests.get(f"{url}/health").json()["mode"] == "dense"
        assert RemoteRetriever(url).search(queries, 5) == [
            [h | {"score": pytest.approx(h["score"], abs=1e-6)} for h in per_query] for per_query in found]


# The server, started through the CLI with small caps and a secret.

@pytest.fixture(scope="module")
def server(bm25_dir, tmp_path_factory):
    secret = tmp_path_factory.mktemp("secret") / "secret"
    secret.write_text(SECRET + "\n")
    with _serving("--index", bm25_dir, "--secret-file", str(secret), "--max-queries", "8", "--max-topk", "5",
                  "--max-query-chars", "200", "--max-body-bytes", "4096") as url:
        yield url


def _retrieve(url: str, body, secret: str | None = SECRET) -> requests.Response:
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(f"{url}/retrieve", data=data, headers=headers, timeout=30)


def test_retrieve_answers_search_r1s_format(server):
    resp = _retrieve(server, {"queries": [_question(4), ""], "topk": 2, "return_scores": True})
    assert resp.status_code == 200
    first, empty = resp.json()["result"]
    assert empty == [] and len(first) == 2
    assert set(first[0]) == {"document", "score"} and first[0]["document"]["id"] == "p4"
    assert set(first[0]["document"]) == {"id", "contents"} and first[0]["score"] > first[1]["score"]
    plain = _retrieve(server, {"queries": [_question(4)]}).json()["result"][0]  # topk 3, no scores
    assert len(plain) == 3 and plain[0] == first[0]["document"] and set(plain[0]) == {"id", "contents"}
    health = requests.get(f"{server}/health").json()  # no secret needed
    assert health | {"passages": len(NAMES) + 1, "mode": "bm25", "max_queries": 8, "auth": True} == health


@pytest.mark.parametrize("body, status, says", [
    ({"queries": ["q"] * 9}, 400, "--max-queries"),
    ({"queries": ["q"], "topk": 6}, 400, "--max-topk"),
    ({"queries": ["q"], "topk": 0}, 400, "topk=0"),
    ({"queries": ["q"], "topk": "3"}, 400, "topk='3'"),
    ({"queries": ["q" * 201]}, 400, "--max-query-chars"),
    ({"queries": ["q"], "padding": "x" * 5000}, 413, "--max-body-bytes"),
    (b"queries=q", 400, "not valid JSON"),
    ([_question(1)], 400, "JSON object"),
    ({"queries": "Zorba"}, 400, "queries is a JSON str"),
    ({"queries": ["ok", 3]}, 400, "queries[1] is a JSON int"),
    ({"topk": 3}, 400, "queries is missing"),
    ({"queries": ["q"], "return_scores": "yes"}, 400, "return_scores"),
])
def test_retrieve_refuses_bad_and_oversized_requests(server, body, status, says):
    resp = _retrieve(server, body)
    assert resp.status_code == status and says in resp.json()["error"], resp.text


def test_retrieve_needs_the_secret(server):
    for secret in (None, "wrong"):
        resp = _retrieve(server, {"queries": ["q"]}, secret)
        assert resp.status_code == 401 and "unauthorized" in resp.json()["error"]
    with pytest.raises(RetrieverError, match=f"{server}/retrieve answered HTTP 401"):
        RemoteRetriever(server).search(["q"], 1)


def test_64_concurrent_clients_each_get_their_own_answer(server):
    start = threading.Barrier(64)

    def client(i: int) -> str:
        start.wait()
        return _retrieve(server, {"queries": [_question(i)], "topk": 1}).json()["result"][0][0]["id"]

    with ThreadPoolExecutor(64) as pool:
        assert list(pool.map(client, range(64))) == [f"p{i}" for i in range(64)]


def test_remote_retriever_matches_the_index_and_names_an_unreachable_url(server, bm25_dir):
    questions = [_question(i) for i in range(20)] + [""]
    remote = RemoteRetriever(server, secret=SECRET, max_queries=8)  # 3 requests
    assert remote.search(questions, 3) == load_index(bm25_dir).search(questions, 3)
    report = bench_queries(remote, questions, concurrency=4)
    assert report["queries"] == 21 and report["batched_qps"] > 0 and report["single_qps"] > 0
    with refused_url() as closed, pytest.raises(RetrieverError, match=f"retriever {closed}/retrieve: cannot reach it"):
        RemoteRetriever(closed, timeout=5).search(["q"], 1)


class _Gated:
    """An inner retriever whose first call waits for the test: answers name each query and the call."""

    def __init__(self, fail: bool = False):
        self.calls, self.fail, self.gate = [], fail, threading.Event()

    def search(self, queries, topk):
        self.calls.append(list(queries))
        if len(self.calls) == 1:
            self.gate.wait(timeout=30)
        if self.fail:
            raise RetrieverError("retriever http://x/retrieve answered HTTP 500: down", 500)
        return [[{"id": q, "contents": f"call {len(self.calls)}", "score": float(topk)}] for q in queries]


def _wave(inner, n: int = 32):
    """n searches at once while the first call is held: the other n - 1 queue for one wave."""
    coalescing = CoalescingRetriever(inner)
    results: dict[int, object] = {}

    def search(i: int) -> None:
        try:
            results[i] = coalescing.search([f"q{i}"], 3)
        except RetrieverError as exc:
            results[i] = exc

    first = threading.Thread(target=search, args=(0,))
    first.start()
    while not inner.calls:
        time.sleep(0.001)
    others = [threading.Thread(target=search, args=(i,)) for i in range(1, n)]
    for t in others:
        t.start()
    while len(coalescing._waiting) < n - 1:
        time.sleep(0.001)
    inner.gate.set()
    for t in [first, *others]:
        t.join(timeout=30)
    return coalescing, results


def test_concurrent_searches_go_out_as_one_call_per_wave_and_each_gets_its_own_hits():
    inner = _Gated()
    _, results = _wave(inner)
    assert inner.calls[0] == ["q0"] and sorted(inner.calls[1]) == sorted(f"q{i}" for i in range(1, 32))
    assert len(inner.calls) == 2
    assert results[0] == [[{"id": "q0", "contents": "call 1", "score": 3.0}]]
    assert all(results[i] == [[{"id": f"q{i}", "contents": "call 2", "score": 3.0}]] for i in range(1, 32))


def test_a_failed_call_fails_each_search_it_carried_and_the_next_wave_still_goes_out():
    inner = _Gated(fail=True)
    coalescing, results = _wave(inner, n=8)
    assert all(isinstance(results[i], RetrieverError) and "HTTP 500" in str(results[i]) for i in range(8))
    inner.fail = False
    assert coalescing.search(["again"], 2) == [[{"id": "again", "contents": "call 3", "score": 2.0}]]
