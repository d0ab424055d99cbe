"""One WebArena episode in its own browser context: the observation text, the actions, the score.

A reset closes the instance's previous context and opens a fresh one (no cookies, cart or history
carried over), then the task's start pages, one tab each. Each step runs one action and answers
the next observation; `stop [answer]` runs the task's evaluators, whose product is the reward,
and ends the episode. Whatever the page does (an id that is not shown, a 404, a refused
connection, a page slower than the step's timeout) comes back as a note in the observation: the
instance stays usable. Only a browser that died fails the instance (`InstanceFailed`).

The observation: the objective, the URL, the open tabs, the previous action, a note when there is
one, then the visible part of the page's accessibility tree (`browser.accessibility_tree`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from urllib.parse import urlparse

from playwright.async_api import Error as PlaywrightError
from playwright.async_api import TimeoutError as PlaywrightTimeout

from envs.environment import InstanceFailed
from envs.webarena import actions, evaluators
from envs.webarena.browser import Browser, BrowserTimeout, accessibility_tree, cdp_session
from envs.webarena.options import WebArenaOptions
from envs.webarena.tasks import WebTask

log = logging.getLogger(__name__)
START_TIMEOUT = "TimeoutError"  # AgentGym's client raises when a reset answers this observation
# a task queued behind whatever the input queued (a form posts its submission as a task)
_TASK_ROUND_TRIP = ("new Promise(done => { const channel = new MessageChannel(); "
                    "channel.port1.onmessage = () => done(); channel.port2.postMessage(0); })")
_KEYS = {"ctrl": "Control", "control": "Control", "cmd": "Meta", "meta": "Meta", "alt": "Alt", "shift": "Shift",
         "enter": "Enter", "esc": "Escape", "tab": "Tab", "space": " "}


@dataclasses.dataclass
class Shared:
    """What every instance of a server shares: the browser, the tasks, the options, the judge."""

    browser: Browser
    tasks: list[WebTask]
    opts: WebArenaOptions
    judge: evaluators.Judge | None
    unjudged: int = 0
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class WebArenaEnv:
    def __init__(self, shared: Shared):
        self._shared = shared
        self._opts = shared.opts
        self._context = None
        self._page = None
        self._task: WebTask | None = None
        self._shown: set[int] = set()
        self._previous = "None"
        self._observation = ""
        self._page_view = ""  # the last observation of the page, shown again after a reply with no action

    # -- the Environment interface ----------------------------------------------------------
    def reset(self, data_idx: int) -> dict:
        self._task = self._shared.tasks[data_idx]
        self._previous = "None"
        self._drop_context()
        note = self._run(self._start(self._task), self._opts.reset_timeout_s * len(self._task.start_urls))
        if note == START_TIMEOUT:
            self._observation = START_TIMEOUT
            return {"observation": START_TIMEOUT, "reward": 0.0, "done": False, "episode_score": 0.0,
                    "success": False, "error": f"the start page did not load within {self._opts.reset_timeout_s:g} s"}
        return self._answer(note, 0.0, False)

    def step(self, action: str) -> dict:
        try:
            parsed = actions.parse(action)
        except actions.BadAction as exc:
            return {**self._answer(str(exc), 0.0, False, observe=False), "valid_action": False}
        self._previous = str(parsed)
        if parsed.name == "stop":
            try:
                outcome = self._evaluate(parsed.text)
            except evaluators.JudgeError as exc:  # unscored, not wrong: the run logs and counts it
                log.error("task %d: the judge failed: %s", self._task.id, exc)
                answer = self._answer("The episode is over (the judge could not score it).", 0.0, True, observe=False)
                return {**answer, "judge_error": str(exc), "valid_action": True}
            answer = self._answer(f"The episode is over (score {outcome.score:g}).", outcome.score, True, observe=False)
            return {**answer, "unjudged": outcome.unjudged, "valid_action": True}
        note = self._run(self._act(parsed), self._opts.step_timeout_s)
        return {**self._answer(note, 0.0, False), "valid_action": True}

    def observation(self) -> str:
        return self._observation

    def close(self) -> None:
        self._drop_context()

    # -- answers ----------------------------------------------------------------------------
    def _answer(self, note: str | None, reward: float, done: bool, observe: bool = True) -> dict:
        if observe:
            self._observation = self._page_view = self._run(self._render(note), self._opts.step_timeout_s)
        else:
            self._observation = note if done else f"Note: {note}\n\n{self._page_view}"
        return {"observation": self._observation, "reward": reward, "done": done, "terminated": done,
                "truncated": False, "episode_score": reward, "success": done and reward >= 1.0}

    def _run(self, coro, timeout: float):
        """One browser call; a dead browser fails the instance, a hung one becomes a note."""
        try:
            return self._shared.browser.run(coro, timeout + 5)
        except BrowserTimeout as exc:
            return f"The browser did not finish within the step's time ({exc}); the page may still be loading."
        except PlaywrightError as exc:
            if self._context is None or not self._context.browser or not self._context.browser.is_connected():
                raise InstanceFailed(f"the browser closed ({_first_line(exc)}); close this instance and "
                                     "create another") from None
            return f"The browser refused that: {_first_line(exc)}"

    # -- coroutines on the browser's loop -----------------------------------------------------
    async def _start(self, task: WebTask) -> str | None:
        self._context = await self._shared.browser.new_context(self._opts.viewport_width, self._opts.viewport_height)
        for url in task.start_urls:
            self._page = await self._context.new_page()
            try:
                await self._page.goto(url, wait_until="load", timeout=self._opts.reset_timeout_s * 1000)
            except PlaywrightTimeout:
                return START_TIMEOUT
        await self._page.bring_to_front()
        return None

    async def _render(self, note: str | None) -> str:
        page = self._page
        titles = [await _title(p) for p in self._context.pages]
        tabs = ", ".join(f"[{i}] {title!r}" + (" (current)" if p is page else "")
                         for i, (p, title) in enumerate(zip(self._context.pages, titles)))
        try:
            tree, self._shown = await asyncio.wait_for(
                accessibility_tree(page, self._opts.max_observation_chars), self._opts.step_timeout_s)
        except (asyncio.TimeoutError, PlaywrightError) as exc:
            tree, self._shown = f"(the page cannot be read now: {_first_line(exc) or 'it did not answer'})", set()
        head = [f"Objective: {self._task.intent}", f"URL: {page.url}", f"Tabs: {tabs}",
                f"Previous action: {self._previous}"]
        if note:
            head.append(f"Note: {note}")
        return "\n".join(head) + "\n\n" + tree

    async def _act(self, action: actions.Action) -> str | None:
        page, name = self._page, action.name
        if name in ("click", "hover", "type"):
            if action.element not in self._shown:
                return f"There is no element [{action.element}] in the current observation; use an id shown there."
            point = await _center(page, action.element)
            if point is None:
                return f"Element [{action.element}] has no box on the page to {name}."
            if name == "hover":
                await page.mouse.move(*point)
                return None

            async def interact():
                await page.mouse.click(*point)
                if name == "type":
                    await page.keyboard.press("ControlOrMeta+A")
                    await page.keyboard.type(action.text)
                    if action.enter:
                        await page.keyboard.press("Enter")
            return await self._navigating(page, interact)
        if name == "press":
            keys = "+".join(_KEYS.get(k.strip().lower(), k.strip()) for k in action.text.split("+"))
            return await self._navigating(page, lambda: page.keyboard.press(keys))
        if name == "scroll":
            await page.evaluate(f"window.scrollBy(0, {'-' if action.text == 'up' else ''}window.innerHeight * 0.8)")
            return None
        if name == "goto":
            if urlparse(action.text).scheme not in ("http", "https"):
                return f"goto takes an http:// or https:// URL; {action.text[:200]!r} is not one."
            return await self._load(page.goto(action.text, wait_until="load", timeout=self._timeout_ms), action.text)
        if name in ("go_back", "go_forward"):
            move = page.go_back if name == "go_back" else page.go_forward
            return await self._load(move(wait_until="load", timeout=self._timeout_ms), page.url)
        return await self._tabs(action)

    async def _tabs(self, action: actions.Action) -> str | None:
        pages = self._context.pages
        if action.name == "new_tab":
            self._page = await self._context.new_page()
        elif action.name == "tab_focus":
            if not 0 <= action.element < len(pages):
                return f"There is no tab [{action.element}]; tabs are numbered 0 to {len(pages) - 1}."
            self._page = pages[action.element]
        else:  # close_tab
            await self._page.close()
            pages = self._context.pages
            self._page = pages[-1] if pages else await self._context.new_page()
        await self._page.bring_to_front()
        return None

    @property
    def _timeout_ms(self) -> float:
        return self._opts.step_timeout_s * 1000

    async def _load(self, navigation, url: str) -> str | None:
        try:
            response = await navigation
        except PlaywrightTimeout:
            return await self._stop_loading(self._page)
        except PlaywrightError as exc:
            if "net::" not in str(exc):
                raise
            return f"Could not load {url}: {_first_line(exc).split('net::', 1)[1].split()[0]}."
        return _status_note(response)

    async def _navigating(self, page, act) -> str | None:
        """Runs `act`; when it makes the page navigate, waits for the new page to load.

        The renderer announces a navigation it starts (a link, a form, a script) while it handles the
        input, so an answer it gives afterwards on the same session comes after the announcement: one
        round trip tells whether the action navigates, however busy the machine is. (A fixed grace
        period for the network request missed a form's redirect with 16 browsers on 2 cores.)"""
        requested, loaded, responses = [], asyncio.Event(), []

        def on_response(response):
            if response.request.is_navigation_request() and response.frame == page.main_frame:
                responses.append(response)

        def on_load(_):
            loaded.set()

        async with cdp_session(page) as cdp:
            main_frame = (await cdp.send("Page.getFrameTree"))["frameTree"]["frame"]["id"]
            cdp.on("Page.frameRequestedNavigation", lambda event: requested.append(event["url"]) if (
                event["frameId"] == main_frame and event["disposition"] == "currentTab") else None)
            await cdp.send("Page.enable")
            page.on("response", on_response)
            page.on("load", on_load)
            try:
                before = page.url
                await act()
                deadline = time.monotonic() + self._opts.step_timeout_s  # for the round trip and the load together
                try:
                    await asyncio.wait_for(cdp.send("Runtime.evaluate", {
                        "expression": _TASK_ROUND_TRIP, "awaitPromise": True}), self._opts.step_timeout_s)
                except (PlaywrightError, asyncio.TimeoutError):  # navigated away meanwhile, or a page that hangs
                    pass
                if not requested or _same_document(requested[-1], before):
                    return None
                if not loaded.is_set():
                    try:
                        await asyncio.wait_for(loaded.wait(), max(deadline - time.monotonic(), 0))
                    except asyncio.TimeoutError:
                        return await self._stop_loading(page)
                return _status_note(responses[-1] if responses else None)
            finally:
                page.remove_listener("response", on_response)
                page.remove_listener("load", on_load)

    async def _stop_loading(self, page) -> str:
        """Cancels a navigation past the step's time (a page mid-navigation cannot be read), so the
        tab shows what it showed before, or what had loaded."""
        async with cdp_session(page) as cdp:
            await cdp.send("Page.stopLoading")
        return (f"The page did not finish loading within {self._opts.step_timeout_s:g} s, so loading was "
                "stopped; this is what the tab shows now.")

    # -- the score --------------------------------------------------------------------------
    def _evaluate(self, answer: str) -> evaluators.Verdict:
        task = self._task
        outcome = evaluators.evaluate(task.eval, task.intent, answer, self._page.url, self._fetch, self._shared.judge)
        if outcome.unjudged:
            with self._shared.lock:
                self._shared.unjudged += outcome.unjudged
                total = self._shared.unjudged
            log.warning("task %d: %d fuzzy_match reference(s) not judged: no judge is configured (judge_url); "
                        "%d so far on this server", task.id, outcome.unjudged, total)
        return outcome

    def _fetch(self, url: str, locator: str) -> str:
        """What `locator` yields on `url` ("last": the current page), read in this instance's context."""
        async def read():
            page = self._page if url == "last" else await self._context.new_page()
            try:
                if url != "last":
                    await page.goto(url, wait_until="load", timeout=self._timeout_ms)
                value = await (page.evaluate(locator) if locator else page.content())
                return "" if value is None else str(value)
            finally:
                if page is not self._page:
                    await page.close()
        return self._shared.browser.run(read(), self._opts.step_timeout_s * 2)

    def _drop_context(self) -> None:
        context, self._context, self._page = self._context, None, None
        if context is not None:
            try:
                self._shared.browser.run(context.close(), 30)
            except Exception as exc:  # a context of a dead browser is gone already
                log.debug("closing a browser context: %s", exc)


async def _center(page, backend_id: int) -> tuple[float, float] | None:
    """The element's centre in the viewport, scrolled into view first; None when it has no box."""
    async with cdp_session(page) as cdp:
        try:
            await cdp.send("DOM.scrollIntoViewIfNeeded", {"backendNodeId": backend_id})
            quads = (await cdp.send("DOM.getContentQuads", {"backendNodeId": backend_id}))["quads"]
        except PlaywrightError:
            return None
    if not quads:
        return None
    quad = quads[0]
    return sum(quad[0::2]) / 4, sum(quad[1::2]) / 4


async def _title(page) -> str:
    try:
        return await asyncio.wait_for(page.title(), 2)
    except (PlaywrightError, asyncio.TimeoutError):
        return ""


def _same_document(url: str, start: str) -> bool:
    """A navigation to `url` from the page at `start` that only moves to a fragment loads no new
    page (`start`: the URL before the action; the page may have moved on since)."""
    return "#" in url and url.split("#", 1)[0] == start.split("#", 1)[0]


def _status_note(response) -> str | None:
    if response is not None and response.status >= 400:
        return f"The server answered HTTP {response.status} for this page."
    return None


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().split("\n", 1)[0]
