"""One headless Chromium per env server, driven through Playwright's async API from one thread.

Playwright's objects belong to the event loop that made them, while the instance pool calls
environments from many threads; so the browser lives on a loop of its own (`Browser.run` hands it
a coroutine and waits, bounded), and concurrent instances overlap on that loop while Chromium does
the work. Each instance is a browser context (its own cookies and storage, no process of its own
beyond its pages' renderers). A browser that died (crashed, killed) is launched again for the next
context; contexts of the dead one fail, and only their instances.

`accessibility_tree` renders the visible part of a page as WebArena does: Chromium's accessibility
tree (CDP `Accessibility.getFullAXTree`), kept to nodes whose layout box (CDP `DOMSnapshot`)
meets the viewport, one line per node, `[id] role 'name' properties`, indented by depth. The id
is the node's backend DOM id, which the actions resolve back to the element.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading

from playwright.async_api import Browser as PlaywrightBrowser
from playwright.async_api import async_playwright

# Flags that keep a headless Chromium quiet and self-contained in a container: no sandbox (it
# needs user namespaces), no GPU, and none of the background traffic to Google's services.
FLAGS = ("--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--mute-audio")
# Nodes that carry no meaning of their own: their children are shown in their place.
_SKIPPED_ROLES = {"generic", "none", "InlineTextBox", "LineBreak", "presentation"}
# Properties worth a model's attention; the rest (focusable, editable, settable...) are noise.
_SHOWN_PROPERTIES = ("focused", "checked", "selected", "expanded", "pressed", "disabled", "required", "level",
                     "valuetext")


class BrowserTimeout(TimeoutError):
    """A browser call that did not finish in time; the call was cancelled."""


class Browser:
    def __init__(self, executable: str):
        self.executable = executable
        self.launches = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="chromium-loop", daemon=True)
        self._thread.start()
        self._launching = None  # an asyncio.Lock, made on the loop
        self._browser: PlaywrightBrowser | None = None
        self._playwright = self.run(async_playwright().start(), 60)

    def run(self, coro, timeout: float):
        """Runs `coro` on the browser's loop; raises BrowserTimeout after `timeout` seconds."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise BrowserTimeout(f"the browser did not answer within {timeout:g} s") from None

    async def new_context(self, width: int, height: int):
        browser = await self._connected()
        return await browser.new_context(viewport={"width": width, "height": height}, java_script_enabled=True)

    async def _connected(self) -> PlaywrightBrowser:
        if self._launching is None:
            self._launching = asyncio.Lock()
        async with self._launching:
            if self._browser is None or not self._browser.is_connected():
                self._browser = await self._playwright.chromium.launch(
                    executable_path=self.executable, headless=True, args=list(FLAGS), timeout=60_000)
                self.launches += 1
        return self._browser

    def stats(self) -> dict:
        """Open contexts and pages (what a leak would grow), and how often Chromium was launched."""
        async def count():
            browser = self._browser
            alive = browser is not None and browser.is_connected()
            contexts = browser.contexts if alive else []
            return {"connected": alive, "launches": self.launches, "contexts": len(contexts),
                    "pages": sum(len(c.pages) for c in contexts)}
        return self.run(count(), 30)

    def close(self) -> None:
        async def stop():
            if self._browser is not None and self._browser.is_connected():
                await self._browser.close()
            await self._playwright.stop()
        try:
            self.run(stop(), 30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)


@contextlib.asynccontextmanager
async def cdp_session(page):
    """A Chrome DevTools Protocol session on `page`, detached after use."""
    cdp = await page.context.new_cdp_session(page)
    try:
        yield cdp
    finally:
        await cdp.detach()


async def accessibility_tree(page, max_chars: int) -> tuple[str, set[int]]:
    """The visible part of `page` as text, and the element ids it shows (what actions may name)."""
    async with cdp_session(page) as cdp:
        tree = await cdp.send("Accessibility.getFullAXTree")
        snapshot = await cdp.send("DOMSnapshot.captureSnapshot", {"computedStyles": [], "includeDOMRects": True})
        view = await cdp.send("Runtime.evaluate", {
            "expression": "[window.scrollX, window.scrollY, window.innerWidth, window.innerHeight]",
            "returnByValue": True})
    x0, y0, width, height = view["result"]["value"]
    boxes = _boxes(snapshot)
    nodes = {n["nodeId"]: n for n in tree["nodes"]}
    lines: list[str] = []
    shown: set[int] = set()

    def visible(backend_id) -> bool | None:
        box = boxes.get(backend_id)
        if box is None:
            return None  # no layout box of its own (the document, text runs): follows its parent
        x, y, w, h = box
        return w > 0 and h > 0 and x < x0 + width and x + w > x0 and y < y0 + height and y + h > y0

    def walk(node_id: str, depth: int, parent_name: str, parent_visible: bool) -> None:
        node = nodes.get(node_id)
        if node is None:
            return
        role = node.get("role", {}).get("value", "")
        name = str(node.get("name", {}).get("value", "")).strip()
        backend = node.get("backendDOMNodeId")
        seen = visible(backend)
        seen = parent_visible if seen is None else seen
        keep = (seen and not node.get("ignored") and backend is not None
                and not (role in _SKIPPED_ROLES and not name)
                and not (role == "StaticText" and (not name or name in parent_name)))
        if keep:
            lines.append("\t" * depth + f"[{backend}] {role} {name!r}{_properties(node)}")
            shown.add(backend)
        for child in node.get("childIds", []):
            walk(child, depth + 1 if keep else depth, name if keep else parent_name, seen)

    walk(tree["nodes"][0]["nodeId"], 0, "", True)
    text = "\n".join(lines)
    if len(text) > max_chars:
        cut = text.rfind("\n", 0, max_chars)
        text = text[:cut] + f"\n(the rest of the visible page is cut: over {max_chars} characters)"
        shown = {i for i in shown if f"[{i}]" in text}
    return text, shown


def _boxes(snapshot: dict) -> dict[int, tuple[float, float, float, float]]:
    """Backend node id -> layout box in document coordinates, for the main frame's document."""
    if not snapshot["documents"]:
        return {}
    document = snapshot["documents"][0]
    backend_ids = document["nodes"]["backendNodeId"]
    layout = document["layout"]
    return {backend_ids[i]: tuple(box) for i, box in zip(layout["nodeIndex"], layout["bounds"])}


def _properties(node: dict) -> str:
    found = {p["name"]: p["value"].get("value") for p in node.get("properties", [])}
    value = node.get("value", {}).get("value")
    parts = [] if value in (None, "") else [f"value: {str(value)!r}"]
    for key in _SHOWN_PROPERTIES:
        shown = found.get(key)
        if shown in (None, False, "false", "") or (key == "focused" and shown is not True):
            continue
        if key == "valuetext" and str(shown) == str(value):
            continue
        parts.append(f"{key}: {shown}")
    return "".join(" " + p for p in parts)
