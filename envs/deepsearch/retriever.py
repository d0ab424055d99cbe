"""The Deep Search retriever: a BM25 index (bm25s) over a Search-R1/FlashRAG passage corpus, an
optional dense one (an e5-style sentence-transformers encoder read from a local directory, a FAISS
flat inner-product index), and a client of `envs.deepsearch.retriever_server` with the same
`search`, so an environment takes an in-process index or a server's URL alike.

The corpus is JSONL, one `{"id", "contents"}` per line, `contents` the title on its first line,
then the text. `build_index` writes a directory holding:

- `retriever.json`: the manifest (format, passage count, indexes, dense model and dimension,
  build time);
- bm25s's own files (`params.index.json`, `vocab.index.json`, `*.csc.index.npy`), memory-mapped
  at load;
- `corpus.jsonl` and `corpus.mmindex.json`, written by bm25s's save: the passages as
  `{"id", "contents"}` (ids as strings) and their line offsets, read one passage at a time
  through bm25s's memory-mapped `JsonlCorpus`;
- `dense.faiss` (built with a dense model): the normalised `passage: ` embeddings, row i for
  passage i, memory-mapped at load.

`search(queries, topk)` answers per query up to `topk` hits `{"id", "contents", "score"}`, best
first. An empty or whitespace-only query has no hits ([]), and so has a BM25 query that shares no
word with the corpus: a BM25 hit is a passage with at least one of the query's words (score > 0).
Nothing is downloaded: the encoder is loaded from its directory only.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from agentgym_mega.files import atomic_dir, commit_dir
from envs import limits
from envs.pool import require_count

log = logging.getLogger(__name__)

# Light on import (the CLI and the trainer read the constants): numpy, requests, tqdm, bm25s,
# faiss, torch, sentence-transformers and the web server stack (`envs.server`) are imported where
# they are used.

FORMAT = 1  # of the index directory; load_index refuses others
MANIFEST = "retriever.json"
PASSAGES = "corpus.jsonl"  # bm25s's corpus file name; its line index is corpus.mmindex.json
DENSE_INDEX = "dense.faiss"
MODES = ("bm25", "dense")
QUERY_PREFIX, PASSAGE_PREFIX = "query: ", "passage: "  # e5's, as Search-R1 encodes with e5
STOPWORDS = "en"  # bm25s's English list; lowercased words, no stemmer

# The server's default caps, which RemoteRetriever also splits its batches by; importable without
# the web stack.
MAX_QUERIES = 1024  # queries in one POST /retrieve
MAX_TOPK = 100
MAX_QUERY_CHARS = 4096


class RetrieverInputError(ValueError):
    """A corpus, index directory, model directory or search argument that cannot be used; the
    message names it and what is allowed."""


class RetrieverError(RuntimeError):
    """A retriever server that cannot be reached or answers an error; the message names its URL
    and the cause. `status`: the HTTP status of an error answer, None when unreachable."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def build_index(corpus: str, out: str, dense_model: str | None = None, batch_size: int = 64,
                progress: bool = True, device: str | None = None) -> dict:
    """Indexes the JSONL `corpus` into the directory `out`, built beside it and moved into place
    only when complete (a failed build leaves no `out`). `dense_model`: a local sentence-transformers
    directory; the passages are then also encoded, `batch_size` at a time, on `device` (None: the
    GPU when there is one). Returns the passage
    count, seconds, passages/s, the directory's bytes and the indexes built."""
    import bm25s

    start = time.perf_counter()
    if not os.path.isfile(corpus):
        raise RetrieverInputError(f"corpus {corpus!r}: no such file; expected JSONL, one "
                                  '{"id": ..., "contents": "title\\ntext"} per line')
    if os.path.exists(out) and not os.path.isfile(os.path.join(out, MANIFEST)) and (
            not os.path.isdir(out) or os.listdir(out)):  # replacing it would delete someone's files
        raise RetrieverInputError(f"out {out!r} exists and is not a retriever index; allowed: a new path, an empty "
                                  "directory, or an index to replace")
    require_count("batch_size", batch_size, RetrieverInputError)
    encoder = _encoder(dense_model, device) if dense_model else None  # a bad model fails before the long part
    tmp = atomic_dir(out)
    try:
        tokens = bm25s.tokenize((text for _, text in _passages(corpus, progress)), lower=True, stopwords=STOPWORDS,
                                stemmer=None, show_progress=False)
        bm25 = bm25s.BM25()
        bm25.index(tokens, show_progress=progress)
        # The file is known good now: the second pass only feeds bm25s's save of the passages.
        bm25.save(tmp, corpus=({"id": pid, "contents": text} for pid, text in _passages(corpus, False)),
                  show_progress=progress)
        count = len(tokens.ids)
        manifest = {"format": FORMAT, "passages": count, "indexes": ["bm25"], "source": os.path.abspath(corpus),
                    "bm25": {"lower": True, "stopwords": STOPWORDS, "stemmer": None}, "dense": None}
        if encoder is not None:
            manifest["indexes"].append("dense")
            manifest["dense"] = _index_dense(encoder, dense_model, tmp, count, batch_size, progress)
        seconds = time.perf_counter() - start
        manifest |= {"built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "build_seconds": round(seconds, 3)}
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=2)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    commit_dir(tmp, out)
    size = sum(os.path.getsize(os.path.join(out, name)) for name in os.listdir(out))
    return {"passages": count, "seconds": seconds, "passages_per_s": count / seconds, "bytes": size,
            "indexes": manifest["indexes"]}


def _passages(path: str, progress: bool):
    """Yields (id, contents) of each passage in the file; a line that is not one raises
    RetrieverInputError naming the file and the line. Blank lines are skipped."""
    from tqdm import tqdm

    first_line: dict[str, int] = {}
    with open(path, "rb") as f, tqdm(total=os.path.getsize(path), unit="B", unit_scale=True, desc="reading corpus",
                                     disable=not progress) as bar:
        for number, raw in enumerate(f, 1):
            bar.update(len(raw))
            if not raw.strip():
                continue
            where = f"{path}, line {number}"
            try:
                row = json.loads(raw)
            except ValueError:  # UnicodeDecodeError included
                raise RetrieverInputError(f'{where}: not JSON: {raw[:80]!r}; expected {{"id": ..., "contents": ...}}'
                                          ) from None
            if not isinstance(row, dict):
                raise RetrieverInputError(f'{where}: a JSON {type(row).__name__}; expected an object '
                                          '{"id": ..., "contents": ...}')
            missing = [key for key in ("id", "contents") if key not in row]
            if missing:
                raise RetrieverInputError(f'{where}: no {" and no ".join(missing)}; expected {{"id": ..., '
                                          '"contents": ...}')
            pid, text = row["id"], row["contents"]
            if isinstance(pid, bool) or not isinstance(pid, str | int) or pid == "":
                raise RetrieverInputError(f"{where}: id {json.dumps(pid)[:80]} is not allowed; allowed: a non-empty "
                                          "string or an integer")
            if not isinstance(text, str):
                raise RetrieverInputError(f"{where}: contents {json.dumps(text)[:80]} is not allowed; allowed: a "
                                          "string, the title, a newline, then the text")
            pid = str(pid)
            if pid in first_line:
                raise RetrieverInputError(f"{where}: id {pid!r} is already the id of line {first_line[pid]}; "
                                          "ids must be unique")
            first_line[pid] = number
            yield pid, text
    if not first_line:
        raise RetrieverInputError(f'{path}: no passages; expected JSONL, one {{"id": ..., "contents": ...}} per line')


def _encoder(model_dir: str, device: str | None = None):
    """The sentence-transformers encoder in `model_dir`, on `device` (None: the GPU when torch sees
    one, else the CPU: encoding a Wikipedia-sized corpus is a GPU job)."""
    if not os.path.isfile(os.path.join(model_dir, "modules.json")):
        raise RetrieverInputError(f"dense model {model_dir!r} is not a sentence-transformers directory (no "
                                  "modules.json); allowed: a local directory such as a saved intfloat/e5-base-v2")
    import torch
    from sentence_transformers import SentenceTransformer

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    # Only that directory: a path that also names a Hub model must never download.
    return SentenceTransformer(model_dir, device=device, local_files_only=True)


def _encode(encoder, texts: list[str], batch_size: int):
    import numpy as np

    vectors = encoder.encode(texts, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True,
                             show_progress_bar=False)
    return np.ascontiguousarray(vectors, dtype=np.float32)


def _index_dense(encoder, model_dir: str, directory: str, count: int, batch_size: int, progress: bool) -> dict:
    import faiss
    from tqdm import tqdm

    dim = encoder.get_embedding_dimension()
    index = faiss.IndexFlatIP(dim)  # exact: inner product of normalised vectors is the cosine
    with open(os.path.join(directory, PASSAGES), encoding="utf-8") as f, \
            tqdm(total=count, unit="passage", desc="encoding passages", disable=not progress) as bar:
        while batch := [PASSAGE_PREFIX + json.loads(line)["contents"] for line in itertools.islice(f, batch_size)]:
            index.add(_encode(encoder, batch, batch_size))
            bar.update(len(batch))
    faiss.write_index(index, os.path.join(directory, DENSE_INDEX))
    return {"model": os.path.abspath(model_dir), "dim": dim, "metric": "inner_product", "normalized": True,
            "query_prefix": QUERY_PREFIX, "passage_prefix": PASSAGE_PREFIX}


def load_index(directory: str, mode: str | None = None, device: str | None = None) -> LocalRetriever:
    """The index in `directory`, memory-mapped. `mode` None: dense when the index has one, else bm25.
    `device`: where a dense index's query encoder runs (None: the GPU when there is one)."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise RetrieverInputError(f"{directory!r} is not a retriever index (no {MANIFEST}); build one with "
                                  "`agentgym-mega retriever build`") from None
    if manifest.get("format") != FORMAT:
        raise RetrieverInputError(f"{path}: format {manifest.get('format')!r} is not allowed; allowed: {FORMAT} "
                                  "(rebuild the index with this version)")
    built = manifest["indexes"]
    mode = mode or ("dense" if "dense" in built else "bm25")
    if mode not in MODES:
        raise RetrieverInputError(f"mode {mode!r} is not allowed; allowed: {', '.join(MODES)}, or none for the "
                                  "index's dense one when it has one")
    if mode not in built:
        raise RetrieverInputError(f"{directory!r} has no {mode} index (it has {', '.join(built)}); build it with "
                                  "`agentgym-mega retriever build --dense-model DIR`")
    import numpy as np
    from bm25s.utils.corpus import JsonlCorpus

    passages = JsonlCorpus(os.path.join(directory, PASSAGES), show_progress=False, verbosity=0)
    # The line offsets as an array: a Python list costs about 36 bytes a passage, this 8.
    passages.mmindex = np.asarray(passages.mmindex, dtype=np.int64)
    if mode == "bm25":
        import bm25s

        return LocalRetriever(manifest, passages, bm25=bm25s.BM25.load(directory, mmap=True, show_progress=False))
    import faiss

    dense = faiss.read_index(os.path.join(directory, DENSE_INDEX), faiss.IO_FLAG_MMAP_IFC)
    return LocalRetriever(manifest, passages, dense=dense, encoder=_encoder(manifest["dense"]["model"], device))


class LocalRetriever:
    """An index loaded in this process by `load_index`; `search` may be called from many threads."""

    def __init__(self, manifest: dict, passages, bm25=None, dense=None, encoder=None):
        self.manifest, self.mode = manifest, "bm25" if bm25 is not None else "dense"
        self._passages, self._bm25, self._dense, self._encoder = passages, bm25, dense, encoder
        self._passages_lock = threading.Lock()  # JsonlCorpus seeks one shared mmap, then reads a line
        self._encoder_lock = threading.Lock()  # a fast tokenizer refuses concurrent calls ("Already borrowed")

    def __len__(self) -> int:
        return len(self._passages)

    def search(self, queries: list[str], topk: int) -> list[list[dict]]:
        """Per query, up to `topk` hits `{"id", "contents", "score"}`, best first."""
        _check_search(queries, topk)
        hits: list[list[dict]] = [[] for _ in queries]
        asked = [i for i, q in enumerate(queries) if q.strip()]
        if asked:
            rank = self._rank_bm25 if self.mode == "bm25" else self._rank_dense
            for i, (rows, scores) in zip(asked, rank([queries[i] for i in asked], min(topk, len(self)))):
                with self._passages_lock:
                    docs = [self._passages[int(row)] for row in rows]
                hits[i] = [{"id": d["id"], "contents": d["contents"], "score": float(s)} for d, s in zip(docs, scores)]
        return hits

    def _rank_bm25(self, queries: list[str], k: int) -> list[tuple]:
        import bm25s
        import numpy as np

        words = bm25s.tokenize(queries, lower=True, stopwords=STOPWORDS, stemmer=None, return_ids=False,
                               show_progress=False)
        ids = [self._bm25.get_tokens_ids(w) for w in words]
        known = [i for i, q in enumerate(ids) if q]
        ranked = [(np.empty(0, np.int64), np.empty(0, np.float32))] * len(queries)
        if known:
            rows, scores = self._bm25.retrieve([ids[i] for i in known], k=k, show_progress=False)
            for i, r, s in zip(known, rows, scores):
                ranked[i] = (r[s > 0], s[s > 0])
        return ranked

    def _rank_dense(self, queries: list[str], k: int) -> list[tuple]:
        with self._encoder_lock:
            vectors = _encode(self._encoder, [QUERY_PREFIX + q for q in queries], len(queries))
        scores, rows = self._dense.search(vectors, k)
        return list(zip(rows, scores))


def _check_search(queries, topk) -> None:
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise RetrieverInputError(f"queries {str(queries)[:80]!r} is not allowed; allowed: a list of strings")
    require_count("topk", topk, RetrieverInputError)


class RemoteRetriever:
    """A retriever server (`agentgym-mega retriever serve`) with LocalRetriever's `search`: one
    POST /retrieve per `max_queries` queries (the server's default cap). `secret`: sent as
    `Authorization: Bearer <secret>` (servers started with one)."""

    def __init__(self, url: str, timeout: float = 60.0, secret: str | None = None, max_queries: int = MAX_QUERIES):
        require_count("max_queries", max_queries, RetrieverInputError)
        self.url, self.timeout, self.max_queries = url.rstrip("/"), timeout, max_queries
        self._headers = {"Authorization": f"Bearer {secret}"} if secret else {}
        self._local = threading.local()  # a requests.Session per thread: sessions are not thread-safe

    def search(self, queries: list[str], topk: int) -> list[list[dict]]:
        _check_search(queries, topk)
        hits = []
        for start in range(0, len(queries), self.max_queries):
            result = self._post({"queries": queries[start:start + self.max_queries], "topk": topk,
                                 "return_scores": True})
            try:
                hits += [[{**item["document"], "score": item["score"]} for item in per_query] for per_query in result]
            except (KeyError, TypeError):
                raise RetrieverError(f"retriever {self.url}/retrieve answered an unexpected body: "
                                     f"{str(result)[:200]}") from None
        return hits

    def _post(self, body: dict) -> list:
        import requests

        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
            self._local.session.headers.update(self._headers)
        where = f"{self.url}/retrieve"
        try:
            resp = self._local.session.post(where, json=body, timeout=self.timeout)
        except requests.RequestException as exc:
            raise RetrieverError(f"retriever {where}: cannot reach it: {exc}") from None
        try:
            answer = resp.json()
        except ValueError:
            answer = None
        if resp.status_code != 200 or not isinstance(answer, dict) or "result" not in answer:
            cause = answer.get("error", answer) if isinstance(answer, dict) else resp.text[:200]
            raise RetrieverError(f"retriever {where} answered HTTP {resp.status_code}: {cause}", resp.status_code)
        return answer["result"]


def open_retriever(opts) -> LocalRetriever | RemoteRetriever:
    """The retriever Deep Search's options (`envs.deepsearch.options.DeepSearchOptions`) name: a server at
    `retriever_url` (sent the secret of `retriever_secret_file`, else $AGENTGYM_MEGA_SECRET when
    set), the index in `index_dir`, or `corpus` (default: the data directory's corpus.jsonl)
    indexed with BM25 now."""
    if opts.retriever_url:
        return _checked_remote(opts)
    if opts.index_dir:
        return load_index(opts.index_dir, opts.mode)
    if opts.mode != "bm25":
        raise RetrieverInputError(f"mode {opts.mode!r} needs index_dir (built with --dense-model) or retriever_url; "
                                  "a corpus is indexed with BM25 only")
    with tempfile.TemporaryDirectory(prefix="retriever-") as tmp:
        build_index(opts.corpus or os.path.join(opts.data_dir, PASSAGES), os.path.join(tmp, "index"), progress=False)
        # Loaded memory-mapped and open, the files outlive their names: nothing stays on disk.
        return load_index(os.path.join(tmp, "index"), "bm25")


class _Pending:
    __slots__ = ("queries", "topk", "hits", "error", "ready", "lead")

    def __init__(self, queries: list[str], topk: int):
        self.queries, self.topk, self.hits, self.error = queries, topk, None, None
        self.ready, self.lead = threading.Event(), False


class CoalescingRetriever:
    """Concurrent searches joined into one call of `inner`: while a call is out, the searches that
    arrive wait, and the first of them then sends them all as the next call (one per `topk`). The
    steps of a `/batch`, which a Deep Search server runs on many threads at once, so cost one
    retriever call per wave instead of one each: a BM25 search of many queries costs about as much
    as one, and a remote one is one round trip. A failed call fails each search it carried."""

    def __init__(self, inner):
        self.inner = inner
        self._lock = threading.Lock()
        self._waiting: list[_Pending] = []
        self._busy = False  # a wave is being sent; arrivals wait for the next

    def search(self, queries: list[str], topk: int) -> list[list[dict]]:
        mine = _Pending(queries, topk)
        with self._lock:
            self._waiting.append(mine)
            lead, self._busy = not self._busy, True
        if not lead:
            mine.ready.wait()
        if lead or mine.lead:  # this thread sends the next wave, its own search among them
            with self._lock:
                wave, self._waiting = self._waiting, []
            try:
                self._send(wave)
            finally:
                with self._lock:
                    if self._waiting:  # hand over: the oldest waiting search sends the next wave
                        self._waiting[0].lead = True
                        self._waiting[0].ready.set()
                    else:
                        self._busy = False
        if mine.error is not None:
            raise mine.error
        return mine.hits

    def _send(self, wave: list[_Pending]) -> None:
        for topk in sorted({p.topk for p in wave}):
            group = [p for p in wave if p.topk == topk]
            try:
                hits = self.inner.search([q for p in group for q in p.queries], topk)
            except Exception as exc:  # each search of the call sees the failure, as if it were alone
                for p in group:
                    p.error = exc
            else:
                for p in group:
                    p.hits, hits = hits[:len(p.queries)], hits[len(p.queries):]
            for p in group:
                p.ready.set()


def _checked_remote(opts) -> RemoteRetriever:
    """A server that refuses us (a wrong secret, a cap below ours) stops the env server at start-up,
    where the run's owner sees it, instead of failing every search of the run; one that cannot be
    reached yet only warns: searches answer an observation until it can."""
    from envs.server import read_secret_file

    secret = (read_secret_file(opts.retriever_secret_file) if opts.retriever_secret_file
              else os.environ.get(limits.SECRET_ENV))
    remote = RemoteRetriever(opts.retriever_url, timeout=opts.timeout_s, secret=secret)
    try:
        remote.search(["start-up check"], opts.topk)
    except RetrieverError as exc:
        if exc.status is not None and 400 <= exc.status < 500:
            raise RetrieverInputError(f"the retriever refused this server's request at start-up ({exc}); check "
                                      "retriever_secret_file and its --max-topk") from None
        log.warning("deepsearch: %s; searches answer that until it can be reached", exc)
    return remote


def bench_queries(retriever, queries: list[str], concurrency: int = 16, topk: int = 3) -> dict:
    """Queries/s of `retriever` (a LocalRetriever, a RemoteRetriever, or a server's URL): all
    `queries` in one `search` call (batched), then one query per call from `concurrency` threads
    (single), with the single calls' median and p99 latency."""
    if not queries:
        raise RetrieverInputError("bench_queries needs at least one query")
    if isinstance(retriever, str):
        retriever = RemoteRetriever(retriever)
    start = time.perf_counter()
    retriever.search(queries, topk)
    batched = time.perf_counter() - start

    def one(query: str) -> float:
        began = time.perf_counter()
        retriever.search([query], topk)
        return time.perf_counter() - began

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        latencies = sorted(pool.map(one, queries))
    single = time.perf_counter() - start
    return {"queries": len(queries), "topk": topk, "concurrency": concurrency,
            "batched_qps": len(queries) / batched, "single_qps": len(queries) / single,
            "single_p50_ms": 1000 * latencies[len(latencies) // 2],
            "single_p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))]}
