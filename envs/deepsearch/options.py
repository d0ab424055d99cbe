"""Deep Search's options: where its questions are and which retriever answers its searches.

Given as `env.options` in a run's config (typed YAML values) or as `--option KEY=VALUE` to
`agentgym-mega env-server --env deepsearch` (strings, converted here). Imports nothing heavy: the
trainer validates a config with it before any server starts.

- `data_dir`: question files in FlashRAG's JSONL form. With a `layout.json` (a list of
  `{"source", "file", "split"}`) the files it names, in its order; without one, FlashRAG's own
  files in the AgentGym order (`tasks.FLASHRAG_LAYOUT`), those present. Default: the shipped set.
- The retriever, one of: `retriever_url` (an `agentgym-mega retriever serve`, shared by many env
  servers), `index_dir` (an index from `agentgym-mega retriever build`, loaded in-process,
  `mode` bm25 or dense), or `corpus` (a corpus JSONL indexed with BM25 in memory at start-up,
  for small corpora). Default: `corpus` = the data directory's `corpus.jsonl`.
- `retriever_secret_file`: the secret `retriever_url` requires; default $AGENTGYM_MEGA_SECRET (the
  servers the trainer starts get a fresh one there, so name the retriever's file for them). A
  retriever that refuses the server's request stops the server at start-up.
- `topk`: passages per search (the paper: 3). `timeout_s`: one retriever call.
- `max_query_chars`: a longer search query gets an observation saying so, not a search.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Annotated, Literal, Optional

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

from envs.options import validate

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
_PATHS = ("data_dir", "index_dir", "corpus", "retriever_secret_file")


# Lax mode on purpose: `--option topk=5` arrives as a string.
@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class DeepSearchOptions:
    data_dir: str = DATA_DIR
    retriever_url: Optional[Annotated[str, Field(pattern=r"^https?://")]] = None
    retriever_secret_file: Optional[str] = None
    index_dir: Optional[str] = None
    corpus: Optional[str] = None
    mode: Literal["bm25", "dense"] = "bm25"
    topk: Annotated[int, Field(ge=1, le=50)] = 3
    timeout_s: Annotated[float, Field(gt=0)] = 30.0
    max_query_chars: Annotated[int, Field(ge=1)] = 1000


def check(options: dict) -> DeepSearchOptions:
    """The options validated, paths made absolute (servers may run in another directory)."""
    opts = validate(DeepSearchOptions, options, "deepsearch")
    sources = [k for k in ("retriever_url", "index_dir", "corpus") if getattr(opts, k) is not None]
    if len(sources) > 1:
        raise ValueError(f"deepsearch options {' and '.join(sources)} both name a retriever; give one of "
                         "retriever_url, index_dir, corpus")
    if opts.retriever_secret_file and not opts.retriever_url:
        raise ValueError("deepsearch option retriever_secret_file is the secret of retriever_url; give both or neither")
    paths = {k: os.path.abspath(os.path.expanduser(getattr(opts, k))) for k in _PATHS if getattr(opts, k)}
    return dataclasses.replace(opts, **paths)
