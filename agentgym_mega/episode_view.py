"""Saved episodes (RUN/episodes/step_N.jsonl, one JSON object per line) read back, filtered, ordered,
and rendered for a terminal with rich. Reading is for any module (the report, a notebook); the
rendering is what `agentgym-mega show` prints."""

from __future__ import annotations

import json
import logging
import os
import re

from rich.console import Group
from rich.table import Table
from rich.text import Text

from agentgym_mega.episodes import SPLITS
from agentgym_mega.errors import BadInput

logger = logging.getLogger(__name__)

# Beyond this many characters an observation is folded: a WebArena page or a SciWorld room
# description runs to thousands and would bury the replies.
OBSERVATION_CHARS = 600
_STEP_FILE = re.compile(r"step_(\d+)\.jsonl")
# Model and env text reaches a terminal: escape sequences in it could move the cursor or recolour
# it, so every control character but newline and tab is shown as its escape instead.
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(32), 127) if c not in (9, 10)}


def episodes_dir(run_dir: str) -> str:
    path = os.path.join(run_dir, "episodes")
    if not os.path.isdir(path):
        raise BadInput(f"{run_dir!r} has no episodes/ directory: the run saved no episodes "
                       f"(they are written when logging.episodes.eval or logging.episodes.train_every is on)")
    return path


def saved_steps(run_dir: str) -> list[int]:
    """The steps with a step_N.jsonl under RUN/episodes, ascending."""
    names = (_STEP_FILE.fullmatch(name) for name in os.listdir(episodes_dir(run_dir)))
    return sorted(int(m.group(1)) for m in names if m)


def _lines(path: str) -> list[dict]:
    """The episodes of one file; a line that is not an episode object (a hand edit) is skipped with
    a warning naming the file and line, so one bad line does not hide the rest."""
    episodes = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                episode = json.loads(line)
            except json.JSONDecodeError as exc:
                logger.warning("%s line %d skipped: not JSON (%s)", path, number, exc.msg)
                continue
            turns = episode.get("turns", []) if isinstance(episode, dict) else None
            if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
                logger.warning("%s line %d skipped: not an episode object with a list of turns", path, number)
                continue
            episodes.append(episode)
    return episodes


def _task_key(task_id) -> tuple:
    # Task ids are integers for most envs and strings for some: order numbers numerically.
    return (0, task_id, "") if isinstance(task_id, int) else (1, 0, str(task_id))


def _order_key(step: int, episode: dict) -> tuple:
    """By step (its file's), then split (train before eval, as a step samples before it
    evaluates), then task and sample."""
    split = episode.get("split")
    sample = episode.get("sample")
    return (step, SPLITS.index(split) if split in SPLITS else len(SPLITS), _task_key(episode.get("task_id")),
            sample if isinstance(sample, int) else 0)


def read_episodes(run_dir: str, step: int | str | None = None, split: str | None = None,
                  task: str | int | None = None, status: str | None = None, success: bool | None = None,
                  category: str | None = None, limit: int | None = None) -> list[dict]:
    """The saved episodes of a run matching every filter given (None: any), ordered by step, split
    (train first), task and sample, at most `limit`. `step` is a step number or "last" (the newest
    step saved); `task` and `category` match as text, so "12" finds task 12.
    Raises BadInput when RUN has no episodes/."""
    steps = saved_steps(run_dir)
    if step == "last":
        steps = steps[-1:]
    elif step is not None:
        steps = [s for s in steps if s == int(step)]
    wanted = {"split": split, "status": status, "success": success}
    as_text = {"task_id": task, "category": category}  # a CLI gives "2" for TextCraft's depth 2
    keyed = [(_order_key(s, e), e) for s in steps for e in _lines(os.path.join(run_dir, "episodes", f"step_{s}.jsonl"))
             if all(value is None or e.get(key) == value for key, value in wanted.items())
             and all(value is None or str(e.get(key)) == str(value) for key, value in as_text.items())]
    keyed.sort(key=lambda pair: pair[0])
    return [e for _, e in keyed[:limit]]


def _safe(value) -> str:
    return str(value).translate(_CONTROLS)


def folded(text: str, full: bool, limit: int = OBSERVATION_CHARS) -> Text:
    """`text` as literal rich Text (markup in it is shown, not applied), cut after `limit`
    characters unless `full`, with a note of how many were cut."""
    text = _safe(text)
    if full or len(text) <= limit:
        return Text(text)
    shown = Text(text[:limit])
    shown.append(f" … [{len(text) - limit} more characters; --full shows them]", style="dim italic")
    return shown


def _number(value) -> str:
    return f"{value:.2f}" if isinstance(value, float) else _safe(value)


def header(episode: dict) -> Text:
    """Two lines: which episode (step, split, env, task, category, group, sample, the weights
    version that sampled it), then how it went (status, score, success, turns, tokens, time)."""
    e = episode.get
    tokens = e("tokens") if isinstance(e("tokens"), dict) else {}
    line = Text()
    line.append(f"step {_safe(e('step', '?'))} {_safe(e('split', '?'))}", style="bold reverse")
    line.append(f"  {_safe(e('env', '?'))} task {_safe(e('task_id', '?'))}", style="bold cyan")
    line.append(f"  {_safe(e('category', '?'))}  group {_safe(e('group', '?'))} sample {_safe(e('sample', '?'))}"
                f"  weights v{_safe(e('weight_version', '?'))}\n")
    status = _safe(e("status", "?"))
    line.append(status, style="green" if status == "done" else "yellow")
    line.append(f"  score {_number(e('score', '?'))}")
    succeeded = e("success")
    line.append(f"  success {'yes' if succeeded else 'no'}", style="bold green" if succeeded else "bold red")
    line.append(f"  turns {len(e('turns', []))}")
    if e("time_s") is not None:
        line.append(f"  {_number(e('time_s'))} s")
    line.append(f"  tokens prompt {_safe(tokens.get('prompt', '?'))} sampled {_safe(tokens.get('response', '?'))}"
                f" total {_safe(tokens.get('total', '?'))}")
    return line


def _turn_rows(grid: Table, number: int, turn: dict, full: bool) -> None:
    t = turn.get
    grid.add_row(Text(f"turn {number}", style="bold"),
                 Text(f"reward {_number(t('reward', '?'))}  {_safe(t('tokens', '?'))} tokens", style="dim"))
    grid.add_row("reply", Text(_safe(t("text", ""))))
    if t("action_error"):
        grid.add_row(Text("action error", style="bold red"), Text(_safe(t("action_error")), style="red"))
    else:
        grid.add_row("action", Text(_safe(t("action", "")), style="bold magenta"))
    if t("observation") is not None:
        grid.add_row("observation", folded(t("observation"), full))


def render_episode(episode: dict, full: bool = False) -> Group:
    """The header, the task as the env first gave it, any env error, then each turn: the reply,
    the parsed action or why none parsed, the reward and the observation (folded unless `full`)."""
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="dim", no_wrap=True)
    # fold: an unbroken run (a URL, a JSON blob) continues on the next line instead of being cut.
    grid.add_column(overflow="fold")
    if episode.get("observation") is not None:
        grid.add_row("task", folded(episode["observation"], full))
    if episode.get("error"):
        grid.add_row(Text("env error", style="bold red"), Text(_safe(episode["error"]), style="red"))
    for number, turn in enumerate(episode.get("turns", []), 1):
        _turn_rows(grid, number, turn, full)
    return Group(header(episode), grid, Text(""))
