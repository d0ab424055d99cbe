"""WebArena (AgentGym's `webarena`): web tasks done in a real headless Chromium through its
accessibility tree; see `env` for the episode, `actions` for the action space, `evaluators` for
the scores, `tasks` for the task configs, `options` for the settings and `site` for the shipped shop.

`configure(options)` loads the tasks, starts the shipped shop when no `shopping` URL is given,
and makes the server's one browser (launched at the first episode); each instance is one browser
context, closed on /close, on idle eviction and at each reset. An instance costs what its
context's pages cost in Chromium: `bench env --env webarena` measures the growth of the server's
process tree per live context with its start page open (PSS, and RSS summed over the processes,
which share most pages; docs/results.md). The cap counts 128 MiB, well above the shipped shop's
cost: the real WebArena sites' pages (Magento, GitLab) weigh several times the shop's. The browser
itself (Chromium and Playwright's driver) is paid once per server. A batch's steps run on 16
threads, which the browser's loop overlaps.

AgentGym's webarena client speaks a dialect of its own, served beside ours: `/create` with no
body answers `{"env_idx"}` (and our `id`), later requests carry `env_idx`, `/reset {"env_idx",
"seed", "idx"}` starts task `idx` (an observation of "TimeoutError" when its start page did not
load), and `/step {"env_idx", "action"}` takes the whole model reply and answers `terminated`.
"""

from __future__ import annotations

import atexit

from envs.environment import Kind, Task
from envs.webarena.options import chromium_path

# The CLI and the trainer import this package for `options`: Playwright (the browser and the
# episode), requests (the evaluators' judge) and the shipped shop are imported by `configure`.


def configure(opts):
    """The Kind for validated `options.WebArenaOptions`: tasks loaded, the shop started, the browser made."""
    from envs.webarena import evaluators, tasks
    from envs.webarena.browser import Browser
    from envs.webarena.env import Shared, WebArenaEnv

    sites = dict(opts.sites)
    if "shopping" not in sites:
        from envs.webarena.site.server import start_site

        server, sites["shopping"] = start_site()
        atexit.register(server.shutdown)
    loaded = tasks.load(opts.tasks, sites)
    judge = None
    if opts.judge_url:
        key = None
        if opts.judge_key_file:
            with open(opts.judge_key_file, encoding="utf-8") as f:
                key = f.read().strip()
        judge = evaluators.Judge(opts.judge_url, opts.judge_model, key)
    browser = Browser(chromium_path(opts))
    atexit.register(browser.close)
    shared = Shared(browser=browser, tasks=loaded, opts=opts, judge=judge)
    catalogue = [Task(t.id, t.category, t.split) for t in loaded]
    return Kind(name="webarena", make=lambda: WebArenaEnv(shared), tasks=lambda: catalogue,
                size=lambda: len(loaded), instance_bytes=128 << 20, batch_threads=16,
                index_range=f"an integer from 0 to {len(loaded) - 1}", parse_action=lambda reply: reply,
                env_idx_task="idx", health=lambda: {"browser": browser.stats(), "unjudged": shared.unjudged})
