"""The scripted WebArena agent of the tests, and a grader behind an OpenAI-compatible endpoint.

The agent runs a task's `scripted` plan (see envs/webarena/site/tasks.json) through the server:
it finds every element it acts on, and every answer it gives, in the observation text alone,
scrolling down when what it looks for is not visible, so it succeeds only when the browser, the
accessibility tree and the actions work.

The grader stands in for an LLM behind `vllm serve` (a tiny CPU model cannot grade): it speaks the
chat-completions protocol the judge client uses and answers `correct` when every word of the
reference answer is in the agent's answer, and, asked whether an answer says a task cannot be
done, `yes` when it says so in so many words.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import re
import threading

_URL = re.compile(r"^URL: (https?://[^/\s]+)", re.MULTILINE)
_WORDS = re.compile(r"[\w$.]+")
_MAX_SCROLLS = 8


class PlanFailed(AssertionError):
    pass


def element(observation: str, role: str, name: str) -> int | None:
    found = re.search(rf"^\s*\[(\d+)\] {re.escape(role)} {re.escape(repr(name))}", observation, re.MULTILINE)
    return int(found.group(1)) if found else None


def run_plan(step, first: dict, plan: list) -> dict:
    """Runs `plan`; `step(reply) -> answer` sends one reply. Returns the last answer."""
    answer = first
    base = _URL.search(first["observation"]).group(1)
    for op in plan:
        kind = op[0]
        if kind == "goto":
            answer = step(f"I open the page. ```goto [{op[1].replace('__SHOPPING__', base)}]```")
        elif kind in ("click", "type"):
            answer, target = _scroll_until(step, answer, lambda obs: element(obs, op[1], op[2]), op)
            reply = f"```click [{target}]```" if kind == "click" else f"```type [{target}] [{op[3]}] [{op[4]}]```"
            answer = step(f"Next I act on it. In summary, the next action I will perform is {reply}")
        elif kind == "stop_with":
            answer, found = _scroll_until(step, answer, lambda obs: re.search(op[1], obs), op)
            answer = step(f"```stop [{found.group(1)}]```")
        elif kind == "stop":
            answer = step(f"```stop [{op[1]}]```")
        else:
            raise PlanFailed(f"unknown plan step {op!r}")
        if "error" in answer:
            raise PlanFailed(f"{op!r}: {answer}")
    return answer


def _scroll_until(step, answer: dict, look, op):
    for _ in range(_MAX_SCROLLS):
        found = look(answer["observation"])
        if found is not None:
            return answer, found
        answer = step("```scroll [down]```")
    raise PlanFailed(f"{op!r}: not found on the page:\n{answer['observation']}")


def _grade(prompt: str) -> str:
    fields = dict(re.findall(r"^(Reference answer|The agent's answer):\n(.*?)(?:\n\n|\Z)", prompt, re.M | re.S))
    answer = set(_WORDS.findall(fields.get("The agent's answer", "").lower()))
    if "Reference answer" in fields:
        reference = set(_WORDS.findall(fields["Reference answer"].lower()))
        return "correct" if reference <= answer else "incorrect"
    return "yes" if answer & {"n/a", "not", "no", "cannot", "unavailable"} else "no"


class ChatServer:
    """A local OpenAI-shaped /v1/chat/completions that answers `reply` (a word, or a function of
    the user's prompt), or fails with `status`, and records each request's path, headers and JSON
    body."""

    def __init__(self, reply="correct"):
        self.reply, self.status, self.raw, self.requests = reply, 200, None, []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                if self.path != "/v1/chat/completions":
                    self._send(404, {"error": "not found"})
                elif server.status != 200:
                    self._send(server.status, {"error": {"message": "model crashed"}})
                elif server.raw is not None:
                    self._send(200, server.raw)
                else:
                    self._send(200, {"id": "x", "object": "chat.completion", "model": body["model"],
                                     "choices": [{"index": 0, "finish_reason": "stop",
                                                  "message": {"role": "assistant", "content": server.answer(body)}}]})

            def _send(self, status, payload):
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        # A short poll keeps shutdown() from waiting out the default half second per test.
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()

    def answer(self, body: dict) -> str:
        return self.reply(body["messages"][-1]["content"]) if callable(self.reply) else self.reply

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@contextlib.contextmanager
def grader():
    """The grader on a free local port; yields its `/v1` URL and the requests it got."""
    server = ChatServer(_grade)
    try:
        yield server.url, server.requests
    finally:
        server.close()
