"""One Deep Search episode: a question, searches through a shared retriever, answers scored by
exact match.

The action is the reply's first `<search>query</search>` or `<answer>text</answer>` (a bare tag
pair is a reply too). A search answers the top-k passages as Search-R1 shows them; an answer that
matches a golden answer after SQuAD normalisation ends the episode with reward 1, a wrong one
keeps it going, as in AgentGym. Anything else, an empty or over-long query, or a retriever that
fails gets an observation saying what to do, never an error: the episode goes on.

episode_score is 1.0 once an answer matched, else 0; success means that match. A step's
valid_action says whether the reply held a search or answer tag pair.
"""

from __future__ import annotations

import re
import string
from typing import Protocol

from envs.deepsearch.retriever import RetrieverError
from envs.deepsearch.tasks import Question

_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL | re.IGNORECASE)
_NO_PUNCTUATION = str.maketrans("", "", string.punctuation)
ACTION_FORMS = ("<search>query</search>", "<answer>text</answer>")
NO_ACTION = ("Your reply has no action. Reply with exactly one <search>query</search> to search, or "
             "<answer>text</answer> to give the final answer.")


class Retriever(Protocol):
    def search(self, queries: list[str], topk: int) -> list[list[dict]]:
        """Per query, the best `topk` passages first, each {"id", "contents": "title\\ntext", ...}."""


def parse_action(reply: str) -> tuple[str, str] | None:
    """(kind, text) of the reply's first search or answer tag pair, kind lower case; None if none."""
    match = _ACTION.search(reply)
    return (match.group(1).lower(), match.group(2).strip()) if match else None


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower().translate(_NO_PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(answer: str, golden: tuple[str, ...] | list[str]) -> bool:
    given = normalize_answer(answer)
    return any(given == normalize_answer(g) for g in golden)


def information(passages: list[dict]) -> str:
    """Passages as Search-R1 shows them: `Doc i(Title: title) text`, one per line."""
    if not passages:
        return "<information>No passage matched the query.</information>"
    lines = []
    for i, passage in enumerate(passages, 1):
        title, _, text = passage["contents"].partition("\n")
        lines.append(f"Doc {i}(Title: {title.strip()}) {' '.join(text.split())}")
    return "<information>" + "\n".join(lines) + "\n</information>"


class DeepSearchEnv:
    def __init__(self, questions: list[Question], retriever: Retriever, topk: int, max_query_chars: int):
        self._questions = questions
        self._retriever = retriever
        self._topk = topk
        self._max_query_chars = max_query_chars
        self._question: Question | None = None
        self._observation = ""
        self._solved = False

    def reset(self, data_idx: int) -> dict:
        self._question = self._questions[data_idx]
        self._solved = False
        self._observation = f"Question: {self._question.question}"
        return self._answer(0.0, False)

    def step(self, reply: str) -> dict:
        action = parse_action(reply)
        if action is None:
            self._observation = NO_ACTION
            return {**self._answer(0.0, False), "valid_action": False}
        kind, text = action
        if kind == "answer":
            if exact_match(text, self._question.golden_answers):
                self._solved = True
                self._observation = f'Your answer "{text}" is correct.'
                return {**self._answer(1.0, True), "valid_action": True}
            self._observation = (f'Your answer "{text}" is not correct. Search for more information, '
                                 "or give another answer.")
            return {**self._answer(0.0, False), "valid_action": True}
        self._observation = self._search(text)
        return {**self._answer(0.0, False), "valid_action": True}

    def _search(self, query: str) -> str:
        query = " ".join(query.split())
        if not query:
            return "The search query is empty. Put what you want to find between the tags: <search>query</search>."
        if len(query) > self._max_query_chars:
            return (f"The search query has {len(query)} characters; the limit is {self._max_query_chars}. "
                    "Search with a shorter query.")
        try:
            passages = self._retriever.search([query], self._topk)[0]
        except RetrieverError as exc:
            return f"The search engine could not answer ({exc}). Try the search again."
        return information(passages)

    def _answer(self, reward: float, done: bool) -> dict:
        return {"observation": self._observation, "reward": reward, "done": done,
                "episode_score": float(self._solved), "success": self._solved}

    def observation(self) -> str:
        return self._observation

    def close(self) -> None:
        self._question = None
