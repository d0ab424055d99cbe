"""WebArena task configs: loaded from WebArena's JSON form, their site placeholders substituted.

A task config holds `sites`, `start_url` (several joined by " |AND| " open one tab each),
`intent`, `require_login` and `eval` (`evaluators.check_eval_config` says what it may hold). URLs
may name a site by WebArena's placeholder (`__SHOPPING__`, `__GITLAB__`, ...), replaced by the
URL the server was given for that site. The catalogue's id is the position in a list file, or the
`task_id` of WebArena's one-file-per-task directories (`config_files/<task_id>.json`), which must
then be contiguous from 0 (AgentGym's `/reset {"idx"}` names those files). The category is the
task's first site and first evaluator (`shopping/string_match`); the split is the config's
`split` (default "test": WebArena's tasks are an evaluation set).
"""

from __future__ import annotations

import dataclasses
import json
import os

from envs.webarena import evaluators
from envs.webarena.options import SITES

PLACEHOLDERS = {f"__{site.upper()}__": site for site in SITES}


@dataclasses.dataclass(frozen=True)
class WebTask:
    id: int
    intent: str
    start_urls: tuple[str, ...]
    eval: dict
    sites: tuple[str, ...]
    split: str
    require_login: bool

    @property
    def category(self) -> str:
        return f"{self.sites[0] if self.sites else 'web'}/{self.eval['eval_types'][0]}"


def load(path: str, sites: dict[str, str]) -> list[WebTask]:
    """The tasks at `path` (a JSON list, or a directory of `<id>.json`) with `sites` substituted;
    raises ValueError naming the file, the task and what is wrong."""
    raw = _read(path)
    if not raw:
        raise ValueError(f"webarena tasks {path}: no tasks")
    return [_task(i, config, sites, f"{path}: task {i}") for i, config in enumerate(raw)]


def _read(path: str) -> list[dict]:
    if os.path.isdir(path):
        names = [n for n in os.listdir(path) if n.endswith(".json") and n[:-5].isdigit()]
        ids = sorted(int(n[:-5]) for n in names)
        if ids != list(range(len(ids))):
            missing = sorted(set(range(len(ids))) - set(ids))[:5]
            raise ValueError(f"webarena tasks {path}: <task_id>.json files must run from 0 without gaps; "
                             f"missing {missing}")
        return [_json(os.path.join(path, f"{i}.json")) for i in ids]
    configs = _json(path)
    if not isinstance(configs, list):
        raise ValueError(f"webarena tasks {path}: expected a JSON list of task configs, found {type(configs).__name__}")
    return configs


def _json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"webarena tasks {path}: cannot read it: {exc}") from None


def _task(index: int, config, sites: dict[str, str], where: str) -> WebTask:
    if not isinstance(config, dict):
        raise ValueError(f"{where}: expected an object, found {type(config).__name__}")
    for key, kind in (("intent", str), ("start_url", str), ("eval", dict)):
        if not isinstance(config.get(key), kind):
            raise ValueError(f"{where}: field {key!r} must be a {kind.__name__}")
    named = config.get("sites", [])
    if not isinstance(named, list) or not all(isinstance(s, str) for s in named):
        raise ValueError(f"{where}: field 'sites' must be a list of site names")
    config = _substitute(config, sites, where)
    evaluators.check_eval_config(config["eval"], where)
    return WebTask(id=index, intent=config["intent"], eval=config["eval"], sites=tuple(named),
                   start_urls=tuple(u.strip() for u in config["start_url"].split(" |AND| ")),
                   split=str(config.get("split", "test")), require_login=bool(config.get("require_login", False)))


def _substitute(value, sites: dict[str, str], where: str):
    if isinstance(value, str):
        for placeholder, site in PLACEHOLDERS.items():
            if placeholder in value:
                if site not in sites:
                    raise ValueError(f"{where} uses {placeholder}, but the server has no URL for site {site!r}; "
                                     f"give --site {site}=http://... (env.options.sites.{site})")
                value = value.replace(placeholder, sites[site])
        return value
    if isinstance(value, list):
        return [_substitute(v, sites, where) for v in value]
    if isinstance(value, dict):
        return {k: _substitute(v, sites, where) for k, v in value.items()}
    return value
