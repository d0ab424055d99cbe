"""WebArena's options: which sites the tasks run against, the browser, the timeouts and the judge.

Given as `env.options` in a run's config (typed YAML values) or to `agentgym-mega env-server --env
webarena` as `--option KEY=VALUE` and `--site NAME=URL` (strings, converted here). Imports nothing
heavy: the trainer validates a config with it before any server starts.

- `sites`: the URL of each site a task names (`shopping`, `shopping_admin`, `reddit`, `gitlab`,
  `map`, `wikipedia`, `homepage`); a task's `__SHOPPING__`-style placeholders become these. A
  `shopping` left out is the shipped shop (`envs.webarena.site`), started by the server itself on a
  free local port. A task naming a site that has no URL is refused at start-up.
- `tasks`: a JSON file holding a list of task configs in WebArena's form, or a directory of
  WebArena's `<task_id>.json` files. Default: the shipped shop's tasks.
- `chromium`: the browser binary (Playwright cannot download one here). Default: `chromium` or
  `chromium-browser` on PATH (Debian's package, which `make install` installs).
- `step_timeout_s`: one action (a click's navigation, a `goto`) and the observation after it; a
  slower page is shown as far as it has loaded, with a note. `reset_timeout_s`: the start page.
- `viewport_width`, `viewport_height`: WebArena's 1280x720; the observation is the visible part.
- `max_observation_chars`: a longer accessibility tree is cut, with a note saying so.
- `judge_url`, `judge_model`, `judge_key_file`: an OpenAI-compatible chat endpoint (`.../v1`) for
  `fuzzy_match` answers (the project's own vLLM can serve one). Without one, fuzzy references
  are skipped, counted and warned about (see `evaluators`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Annotated, Optional

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

from envs.options import validate

SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")
TASKS = os.path.join(SITE_DIR, "tasks.json")
SITES = ("shopping", "shopping_admin", "reddit", "gitlab", "map", "wikipedia", "homepage")
_URL = Annotated[str, Field(pattern=r"^https?://[^\s/]+(/\S*)?$")]


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class WebArenaOptions:
    sites: dict[str, _URL] = dataclasses.field(default_factory=dict)
    tasks: str = TASKS
    chromium: Optional[str] = None
    step_timeout_s: Annotated[float, Field(gt=0, le=600)] = 15.0
    reset_timeout_s: Annotated[float, Field(gt=0, le=600)] = 30.0
    viewport_width: Annotated[int, Field(ge=320, le=7680)] = 1280
    viewport_height: Annotated[int, Field(ge=240, le=4320)] = 720
    max_observation_chars: Annotated[int, Field(ge=1000)] = 16000
    judge_url: Optional[_URL] = None
    judge_model: Optional[str] = None
    judge_key_file: Optional[str] = None


def check(options: dict) -> WebArenaOptions:
    """The options validated: site names known, URLs without a trailing slash, paths absolute."""
    opts = validate(WebArenaOptions, options, "webarena")
    unknown = sorted(set(opts.sites) - set(SITES))
    if unknown:
        raise ValueError(f"webarena sites {unknown} are not known; allowed: {', '.join(SITES)}")
    if (opts.judge_url is None) != (opts.judge_model is None):
        raise ValueError("webarena options judge_url and judge_model go together: give both or neither")
    if opts.judge_key_file and not opts.judge_url:
        raise ValueError("webarena option judge_key_file is the key of judge_url; give both or neither")
    paths = {k: os.path.abspath(os.path.expanduser(getattr(opts, k))) for k in ("tasks", "judge_key_file", "chromium")
             if getattr(opts, k)}
    sites = {name: url.rstrip("/") for name, url in opts.sites.items()}
    return dataclasses.replace(opts, sites=sites, **paths)


def chromium_path(opts: WebArenaOptions) -> str:
    """The browser binary, looked up where the server runs (the trainer's node may have none)."""
    found = opts.chromium or shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None or not os.access(found, os.X_OK):
        what = f"option chromium={opts.chromium!r} is not an executable" if opts.chromium else "none is on PATH"
        raise ValueError(f"webarena needs Chromium and {what}; install Debian's `chromium` package "
                         "(`make install` does) or give option chromium=/path/to/chromium")
    return found
