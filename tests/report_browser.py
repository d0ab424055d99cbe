"""Checks of an `agentgym-mega report` page in headless Chromium (Playwright, the system's chromium),
shared by the unit test on a synthetic run and the end-to-end test on a real one."""

from __future__ import annotations

import os
import shutil

# The flags envs/webarena's browser starts Chromium with: no sandbox in containers, no GPU, no
# background fetches of Chromium's own (which would show up as requests the page did not make).
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--mute-audio"]
FILTERS = ("split", "status", "success", "category", "step")


def check_report(html_path: str, screenshot_path: str, action_text: str) -> None:
    """Opens the report at `html_path` and asserts that (1) `action_text` shows in the episode
    browser once searched for and expanded, with no element made from episode text, (2) the filters
    change what is shown, (3) every request the page made is to a file:// URL, (4) no console or
    page error occurred, and that the same task over time shows a column per evaluation step; then
    saves a full-page screenshot to `screenshot_path`."""
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "no chromium on PATH (Debian's `chromium` package)"
    requests, errors = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=FLAGS, timeout=60_000)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("request", lambda r: requests.append(r.url))
            page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
            page.on("dialog", lambda d: (errors.append(f"dialog: {d.message}"), d.dismiss()))
            page.goto("file://" + os.path.abspath(html_path), wait_until="load")
            _check_filters(page)
            _check_over_time(page)
            _check_action_visible(page, action_text)
            page.screenshot(path=screenshot_path, full_page=True)
        finally:
            browser.close()
    assert requests and all(url.startswith("file://") for url in requests), requests
    assert not errors, errors


def _matching(page) -> int:
    return int(page.locator("#ep-count").get_attribute("data-matching"))


def _check_filters(page) -> None:
    """Each filter with two or more values splits the episodes: every value shows fewer than all,
    the values' counts add up to all, and the list shows what the count says."""
    total = _matching(page)
    assert total > 0, "the episode browser shows no episode"
    split_somewhere = False
    for name in FILTERS:
        select = page.locator(f"#f-{name}")
        values = [v for v in select.locator("option").evaluate_all("os => os.map(o => o.value)") if v]
        if len(values) < 2:
            continue
        counts = []
        for value in values:
            select.select_option(value)
            counts.append(_matching(page))
            shown = page.locator("#ep-list details.episode").count()
            assert shown == min(counts[-1], 25), (name, value, shown, counts[-1])
        select.select_option("")
        assert all(0 < c < total for c in counts) and sum(counts) == total, (name, values, counts, total)
        split_somewhere = True
    assert split_somewhere, "no filter has two values to choose between"
    assert _matching(page) == total


def _check_over_time(page) -> None:
    """The first held-out task shows one column per evaluation step, and a sample opens turn by turn."""
    steps = page.evaluate("""() => [...new Set(JSON.parse(document.getElementById('episodes-data').textContent)
        .filter(e => e.split === 'eval').map(e => e.step))].sort((a, b) => a - b)""")
    if not steps:
        assert page.locator("#t-none").is_visible()
        return
    assert page.locator("#t-grid th").all_inner_texts() == [f"step {s}" for s in steps]
    page.locator("#t-grid details.episode summary").first.click()
    page.locator("#t-grid .turn").first.wait_for(state="visible", timeout=10_000)  # built when opened


def _check_action_visible(page, action_text: str) -> None:
    page.locator("#f-text").fill(action_text)
    assert _matching(page) > 0, f"no episode holds {action_text!r}"
    page.locator("#expand-all").click()
    action = page.locator("#ep-list code.action", has_text=action_text).first
    action.wait_for(state="visible", timeout=10_000)
    assert action.is_visible()
    # episode text stays text: the open episodes added no element that loads or runs anything
    assert page.locator("img, iframe, object, embed, #ep-list script, #t-grid script").count() == 0
    # the screenshot shows that episode open and the others closed
    action.evaluate("a => document.querySelectorAll('#ep-list details.episode').forEach(d => d.open = d.contains(a))")
