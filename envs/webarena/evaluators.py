"""WebArena's evaluators as pure functions, and the LLM judge that scores its fuzzy references.

A task's `eval` config lists `eval_types`; when the agent stops, each listed evaluator scores the
episode in [0, 1] and the episode's score is their product (every check must pass):

- `string_match` scores the stop action's text against `reference_answers`: `exact_match` (the
  cleaned strings are equal), `must_include` (every listed string occurs in the answer; a lone item
  must occur as whole tokens, so "1" does not pass "10") and `fuzzy_match` (each reference judged
  by an LLM, or "N/A": the answer must say the task cannot be done). Cleaning strips whitespace and
  one pair of surrounding quotes and lower-cases.
- `url_match` compares the page's final URL with `reference_url` (host, port and path equal;
  every query parameter of the reference present in the page's URL with the same values).
- `program_html` reads what a JavaScript locator yields on a page (the browser side's `fetch`)
  and requires the listed contents in it.

Without a judge, fuzzy references are skipped rather than guessed: `Verdict.unjudged` counts them,
and a `string_match` that had nothing else to check scores 0. Any reference may hold alternatives
joined by " |OR| " (one suffices). `check_eval_config` refuses, at load time, configs these
functions cannot score faithfully.
"""

from __future__ import annotations

import dataclasses
import html
import json
import re
import urllib.parse
from typing import Callable

import requests

STRING_KEYS = ("exact_match", "must_include", "fuzzy_match")
EVAL_TYPES = ("string_match", "url_match", "program_html")
URL_NOTES = ("GOLD in PRED",)
OR = " |OR| "

# Words (hyphenated ones and dotted names kept whole), numbers with their decimal or thousands
# separators kept whole, and every other non-space character alone: so "$50" is "$", "50".
_TOKEN = re.compile(r"\d+(?:[.,:]\d+)+|\w+(?:[-/.]\w+)*|[^\w\s]")

# Ports a URL may leave implicit; "http://h:80/" and "http://h/" name the same page.
_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclasses.dataclass(frozen=True)
class Verdict:
    """How an episode's answer and final page scored against a task's references: the product of
    `parts` (each eval type's score), the fuzzy references skipped and what each failed check saw."""

    score: float
    parts: dict[str, float]
    unjudged: int
    notes: list[str]


class JudgeError(RuntimeError):
    """The judge could not be asked, or its reply could not be read."""


def clean_answer(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        text = text[1:-1]
    return text.lower()


def exact_match(answer: str, reference: str) -> float:
    return float(clean_answer(answer) == clean_answer(reference))


def must_include(answer: str, reference: str, tokenize: bool = False) -> float:
    answer = clean_answer(answer)
    answer_tokens = _TOKEN.findall(answer)
    for alternative in reference.split(OR):
        alternative = clean_answer(alternative)
        if tokenize:
            if _contains_run(answer_tokens, _TOKEN.findall(alternative)):
                return 1.0
        elif alternative in answer:
            return 1.0
    return 0.0


def _contains_run(tokens: list[str], run: list[str]) -> bool:
    return any(tokens[i:i + len(run)] == run for i in range(len(tokens) - len(run) + 1))


def string_match(answer: str, reference_answers: dict, intent: str,
                 judge: Judge | None) -> tuple[float, int, list[str]]:
    """(score, fuzzy references left unjudged, notes on failed checks) of `answer`."""
    score, checked, unjudged, notes = 1.0, 0, 0, []
    if "exact_match" in reference_answers:
        checked += 1
        reference = reference_answers["exact_match"]
        if not exact_match(answer, reference):
            score = 0.0
            notes.append(f"string_match: exact_match wanted {reference!r}, got {_short(answer)!r}")
    if "must_include" in reference_answers:
        items = reference_answers["must_include"]
        checked += 1
        for reference in items:
            # WebArena asks for whole tokens only when a single string is required.
            if not must_include(answer, reference, tokenize=len(items) == 1):
                score = 0.0
                notes.append(f"string_match: must_include {reference!r} not in {_short(answer)!r}")
    if "fuzzy_match" in reference_answers:
        references = reference_answers["fuzzy_match"]
        if references == "N/A" and clean_answer(answer) == "n/a":
            # The agent answered the unachievable task with the marker itself: no judge needed.
            checked += 1
        elif judge is None:
            unjudged += 1 if references == "N/A" else len(references)
            notes.append(f"string_match: fuzzy_match not judged (no judge configured): {references!r}")
        elif references == "N/A":
            checked += 1
            if not judge.unachievable(intent, answer):
                score = 0.0
                notes.append(f"string_match: judge found no 'cannot be done' in {_short(answer)!r}")
        else:
            checked += 1
            for reference in references:
                if not judge.fuzzy(intent, reference, answer):
                    score = 0.0
                    notes.append(f"string_match: judge rejected {_short(answer)!r} against {reference!r}")
    if not checked:
        # Nothing verified the answer; passing it would reward whatever the agent said.
        score = 0.0
    return score, unjudged, notes


def url_match(url: str, reference_url: str, note: str = "GOLD in PRED") -> float:
    if note not in URL_NOTES:
        raise ValueError(f"unknown url_note {note!r}; known: {', '.join(URL_NOTES)}")
    page, page_query = _url_parts(url)
    for reference in reference_url.split(OR):
        wanted, wanted_query = _url_parts(reference)
        if page == wanted and all(sorted(page_query.get(k, [])) == sorted(v) for k, v in wanted_query.items()):
            return 1.0
    return 0.0


def _url_parts(url: str) -> tuple[tuple, dict[str, list[str]]]:
    """((host, port, path), query) of `url`; the scheme and the fragment do not matter."""
    parsed = urllib.parse.urlsplit(url.strip())
    port = parsed.port if parsed.port != _DEFAULT_PORTS.get(parsed.scheme) else None
    path = urllib.parse.unquote(parsed.path).rstrip("/")
    # Blank values kept: a reference's "?q=" still requires the page's URL to carry q.
    return (parsed.hostname, port, path), urllib.parse.parse_qs(parsed.query, keep_blank_values=True)


def program_html(targets: list[dict], fetch: Callable[[str, str], str]) -> tuple[float, list[str]]:
    """(score, notes) of the pages' contents; `fetch(url, locator)` returns the locator's text on
    that page ("last": the current page as it is; locator "": the page's HTML)."""
    if not targets:
        return 0.0, ["program_html: no targets to check"]
    score, notes = 1.0, []
    for target in targets:
        url, locator, required = target["url"], target["locator"], target["required_contents"]
        try:
            text = fetch(url, locator)
        except Exception as exc:  # a page that fails to load or a locator that throws fails only its check
            score = 0.0
            notes.append(f"program_html: fetching {locator or 'the HTML'!r} at {url} failed: {exc!r}")
            continue
        # A locator that matches nothing yields null; page HTML carries entities ("&amp;").
        text = html.unescape(text or "")
        if "exact_match" in required:
            if not exact_match(text, required["exact_match"]):
                score = 0.0
                notes.append(f"program_html: {url} {locator!r} is {_short(text)!r}, "
                             f"wanted {required['exact_match']!r}")
        else:
            for content in required["must_include"]:
                if not must_include(text, content):
                    score = 0.0
                    notes.append(f"program_html: {content!r} not in {url} {locator!r}: {_short(text)!r}")
    return score, notes


def evaluate(eval_config: dict, intent: str, answer: str, url: str, fetch: Callable[[str, str], str],
             judge: Judge | None) -> Verdict:
    """Scores an episode that stopped with `answer` on page `url`. JudgeError propagates: a judge
    that cannot answer is the caller's to report, not a wrong answer."""
    parts, unjudged, notes = {}, 0, []
    for kind in eval_config["eval_types"]:
        if kind == "string_match":
            parts[kind], skipped, found = string_match(answer, eval_config["reference_answers"], intent, judge)
            unjudged += skipped
        elif kind == "url_match":
            parts[kind] = url_match(url, eval_config["reference_url"], eval_config.get("url_note", "GOLD in PRED"))
            found = [] if parts[kind] else [f"url_match: {url} is not {eval_config['reference_url']}"]
        elif kind == "program_html":
            parts[kind], found = program_html(eval_config["program_html"], fetch)
        else:
            raise ValueError(f"unknown eval type {kind!r}; known: {', '.join(EVAL_TYPES)}")
        notes.extend(found)
    if not parts:
        raise ValueError("eval_types is empty: nothing to score the episode with")
    score = 1.0
    for value in parts.values():
        score *= value
    return Verdict(score=score, parts=parts, unjudged=unjudged, notes=notes)


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def check_eval_config(eval_config: dict, where: str) -> None:
    """Raises ValueError naming `where` and the field if `evaluate` could not score this config."""
    def bad(field: str, problem: str) -> ValueError:
        return ValueError(f"{where}: eval.{field} {problem}")

    if not isinstance(eval_config, dict):
        raise ValueError(f"{where}: eval must be an object, found {type(eval_config).__name__}")
    kinds = eval_config.get("eval_types")
    if not isinstance(kinds, list) or not kinds:
        raise bad("eval_types", f"must be a non-empty list of {', '.join(EVAL_TYPES)}")
    for kind in kinds:
        if kind not in EVAL_TYPES:
            raise bad("eval_types", f"names unknown evaluator {kind!r}; known: {', '.join(EVAL_TYPES)}")
    if "string_match" in kinds:
        _check_reference_answers(eval_config.get("reference_answers"), bad)
    if "url_match" in kinds:
        if not isinstance(eval_config.get("reference_url"), str) or not eval_config["reference_url"].strip():
            raise bad("reference_url", "must be a non-empty URL for url_match")
        if eval_config.get("url_note", "GOLD in PRED") not in URL_NOTES:
            raise bad("url_note", f"is {eval_config['url_note']!r}; known: {', '.join(URL_NOTES)}")
    if "program_html" in kinds:
        targets = eval_config.get("program_html")
        if not isinstance(targets, list) or not targets:
            raise bad("program_html", "must be a non-empty list of targets for program_html")
        for i, target in enumerate(targets):
            _check_target(target, f"program_html[{i}]", bad)


def _check_reference_answers(references, bad) -> None:
    if not isinstance(references, dict) or not references:
        raise bad("reference_answers", f"must be an object with some of {', '.join(STRING_KEYS)} for string_match")
    for key, value in references.items():
        field = f"reference_answers.{key}"
        if key not in STRING_KEYS:
            raise bad(field, f"is not a known reference; known: {', '.join(STRING_KEYS)}")
        if key == "exact_match" and not isinstance(value, str):
            raise bad(field, "must be a string")
        if key == "fuzzy_match" and value == "N/A":
            continue
        if key != "exact_match" and not _nonblank_strings(value):
            raise bad(field, "must be a non-empty list of non-blank strings"
                      + (' (or "N/A")' if key == "fuzzy_match" else ""))


def _check_target(target, field: str, bad) -> None:
    if not isinstance(target, dict):
        raise bad(field, "must be an object with url, locator and required_contents")
    for key in ("url", "locator"):
        if not isinstance(target.get(key), str):
            raise bad(f"{field}.{key}", "must be a string")
        if target[key].startswith("func:"):
            # These call WebArena's Python helpers, which query its self-hosted sites' admin
            # back ends (Magento's, GitLab's, Reddit's) with credentials this environment lacks.
            raise bad(f"{field}.{key}", f"is {target[key]!r}: WebArena's site-specific helper functions "
                      "(func:...) are not supported; they query its self-hosted sites' admin back ends")
    if not target["url"].strip():
        raise bad(f"{field}.url", 'must be "last" or a page URL')
    if "prep_actions" in target:
        # fetch(url, locator) has no way to run scripts before the locator, so the check would read a
        # page other than the one the task's author meant.
        raise bad(f"{field}.prep_actions", "are not supported: only a url and a locator are read")
    required = target.get("required_contents")
    if not isinstance(required, dict) or len(required) != 1 or not required.keys() <= {"exact_match", "must_include"}:
        raise bad(f"{field}.required_contents", 'must be {"exact_match": str} or {"must_include": [str, ...]}')
    if "exact_match" in required and not isinstance(required["exact_match"], str):
        raise bad(f"{field}.required_contents.exact_match", "must be a string")
    if "must_include" in required and not _nonblank_strings(required["must_include"]):
        raise bad(f"{field}.required_contents.must_include", "must be a non-empty list of non-blank strings")


def _nonblank_strings(value) -> bool:
    # A blank string is contained in every answer, so it would pass anything.
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) and v.strip() for v in value)


_SYSTEM = "You grade the final answers of a web-browsing agent. Reply with the verdict only, nothing else."

_FUZZY = """Task the agent was given:
{intent}

Reference answer:
{reference}

The agent's answer:
{answer}

Does the agent's answer give the same information as the reference answer? Differences of wording, \
format or extra detail are fine as long as nothing contradicts the reference or is missing from it. \
Reply with exactly one of: correct, incorrect, partially correct."""

_UNACHIEVABLE = """Task the agent was given:
{intent}

The agent's answer:
{answer}

Does the answer say that the task cannot be done, or that the information asked for is not available \
or does not exist? Reply with exactly one word: yes or no."""

# The verdict is a word or two; a small cap keeps a chatty model from running on.
_MAX_TOKENS = 16
# Bytes of the HTTP reply read at most; an OpenAI-shaped reply to 16 tokens is far smaller.
_MAX_REPLY_BYTES = 1 << 20


class Judge:
    """An OpenAI-compatible chat-completions endpoint (`url` like http://host:8000/v1) as grader."""

    def __init__(self, url: str, model: str, api_key: str | None = None, timeout_s: float = 60.0):
        self.endpoint = url.rstrip("/") + "/chat/completions"
        self.model = model
        self.timeout_s = timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def fuzzy(self, intent: str, reference: str, answer: str) -> float:
        words = self._verdict(_FUZZY.format(intent=intent, reference=reference, answer=answer))
        # The verdict is the reply's last word; "incorrect" and "partially correct" end differently
        # from, or with a qualifier before, a plain "correct".
        if words[-1] == "correct":
            return float(len(words) < 2 or words[-2] not in ("partially", "not"))
        if words[-1] == "incorrect":
            return 0.0
        raise JudgeError(f"judge at {self.endpoint}: no correct/incorrect verdict in its reply {' '.join(words)!r}")

    def unachievable(self, intent: str, answer: str) -> float:
        words = self._verdict(_UNACHIEVABLE.format(intent=intent, answer=answer))
        if words[-1] in ("yes", "no"):
            return float(words[-1] == "yes")
        raise JudgeError(f"judge at {self.endpoint}: no yes/no verdict in its reply {' '.join(words)!r}")

    def _verdict(self, prompt: str) -> list[str]:
        """The lower-cased words of the model's reply to `prompt`; never empty."""
        request = {"model": self.model, "temperature": 0, "max_tokens": _MAX_TOKENS,
                   "messages": [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": prompt}]}
        try:
            with requests.post(self.endpoint, json=request, headers=self.headers, timeout=self.timeout_s,
                               stream=True) as response:
                body = b""
                for chunk in response.iter_content(chunk_size=1 << 16):
                    body += chunk
                    if len(body) > _MAX_REPLY_BYTES:
                        break
        except requests.RequestException as exc:
            raise JudgeError(f"judge at {self.endpoint}: request failed: {exc}") from exc
        if response.status_code != 200:
            raise JudgeError(f"judge at {self.endpoint}: HTTP {response.status_code}: "
                             f"{body[:300].decode('utf-8', 'replace')}")
        if len(body) > _MAX_REPLY_BYTES:
            raise JudgeError(f"judge at {self.endpoint}: reply larger than {_MAX_REPLY_BYTES} bytes")
        try:
            content = json.loads(body)["choices"][0]["message"]["content"]
            words = re.findall(r"[a-z]+", content.lower())
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise JudgeError(f"judge at {self.endpoint}: reply is not a chat completion ({exc!r}): "
                             f"{body[:300].decode('utf-8', 'replace')}") from exc
        if not words:
            raise JudgeError(f"judge at {self.endpoint}: empty verdict {content!r}")
        return words
