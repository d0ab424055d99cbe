"""`agentgym-mega show` and the episode reader under it, on a run directory written as
EPISODES_SPEC says: filters, order, literal model text, folding, bad lines, bad directories."""

from __future__ import annotations

import json
import os

import pytest

from agentgym_mega.cli import main
from agentgym_mega.episode_view import OBSERVATION_CHARS, read_episodes
from agentgym_mega.errors import EXIT_BAD_INPUT

LONG = "x" * (OBSERVATION_CHARS + 250)


def episode(step, split, task_id, status="done", success=True, category="GoToRedBall", turns=None):
    turns = turns or [{"text": f"reply s{step} {split} t{task_id}", "action": "go forward", "valid_action": True,
                       "action_error": None, "observation": "You moved.", "reward": 0.0, "tokens": 5,
                       "observation_tokens": 8, "generate_s": 0.1, "env_s": 0.01}]
    return {"step": step, "split": split, "env": "babyai", "task_id": task_id, "category": category, "group": 0,
            "sample": 0, "weight_version": step, "status": status, "score": 1.0 if success else 0.0,
            "success": success, "error": None, "rewards": [t["reward"] for t in turns],
            "observation": f"task {task_id}: go to the red ball", "turns": turns,
            "tokens": {"prompt": 40, "response": 5, "total": 53}, "time_s": 0.4}


@pytest.fixture
def run_dir(tmp_path):
    """Step 0 (eval only) and step 2 (train and eval), one reply with rich markup and a terminal
    escape sequence, one action that did not parse, one long observation, and a hand-broken line."""
    markup = {"text": "[red]x[/] [bold]not bold \x1b[2Jcleared?", "action": "", "valid_action": False,
              "action_error": "no action found in [/] reply", "observation": LONG, "reward": 0.0, "tokens": 7,
              "observation_tokens": 0, "generate_s": 0.1, "env_s": 0.0}
    steps = {
        0: [episode(0, "eval", 3, success=False, status="horizon"), episode(0, "eval", 1)],
        2: [episode(2, "eval", 3), episode(2, "train", 12, category="PickupLoc"),
            episode(2, "train", 5, status="truncated", success=False, turns=[markup])],
    }
    os.makedirs(tmp_path / "episodes")
    for step, episodes in steps.items():
        lines = [json.dumps(e) for e in episodes]
        if step == 2:
            lines.insert(1, '{"step": 2, "split": "tra')  # line 2: cut short by a hand edit
        (tmp_path / "episodes" / f"step_{step}.jsonl").write_text("\n".join(lines) + "\n")
    return str(tmp_path)


def ids(episodes):
    return [(e["step"], e["split"], e["task_id"]) for e in episodes]


def test_filters_select_exactly_and_order_by_step_split_task(run_dir, caplog):
    assert ids(read_episodes(run_dir)) == [(0, "eval", 1), (0, "eval", 3), (2, "train", 5), (2, "train", 12),
                                           (2, "eval", 3)]
    assert "step_2.jsonl line 2 skipped" in caplog.text
    assert ids(read_episodes(run_dir, step="last", split="eval")) == [(2, "eval", 3)]
    assert ids(read_episodes(run_dir, step=0)) == [(0, "eval", 1), (0, "eval", 3)]
    assert ids(read_episodes(run_dir, task="3")) == [(0, "eval", 3), (2, "eval", 3)]
    assert ids(read_episodes(run_dir, success=False)) == [(0, "eval", 3), (2, "train", 5)]
    assert ids(read_episodes(run_dir, status="truncated")) == [(2, "train", 5)]
    assert ids(read_episodes(run_dir, category="PickupLoc")) == [(2, "train", 12)]
    assert ids(read_episodes(run_dir, split="train", limit=1)) == [(2, "train", 5)]


def test_show_prints_turns_with_markup_literal_and_folds_long_observations(run_dir, capsys, caplog):
    assert main(["show", run_dir, "--step", "2", "--split", "train", "--failed"]) == 0
    out = capsys.readouterr().out
    assert "step_2.jsonl line 2 skipped" in caplog.text
    assert "task 5" in out and "task 12" not in out  # --failed: only the truncated episode
    assert "[red]x[/] [bold]not bold" in out  # markup shown as written, not applied
    assert "\\x1b[2Jcleared?" in out and "\x1b" not in out  # an escape sequence shown, not sent
    assert "no action found in [/] reply" in out
    assert "[250 more characters; --full shows them]" in out
    # rich wraps it beside its label: count its letters, not the string
    assert OBSERVATION_CHARS <= out.count("x") < OBSERVATION_CHARS + 10

    assert main(["show", run_dir, "--task", "12", "--full"]) == 0
    out = capsys.readouterr().out
    assert "reply s2 train t12" in out and "go forward" in out and "You moved." in out
    assert "truncated" not in out and "task 5" not in out


def test_show_full_prints_long_observations_whole(run_dir, capsys):
    assert main(["show", run_dir, "--task", "5", "--full"]) == 0
    out = capsys.readouterr().out
    assert out.count("x") >= len(LONG) and "more characters" not in out


def test_show_no_match_exits_1_and_missing_episodes_dir_exits_2(run_dir, tmp_path, capsys):
    assert main(["show", run_dir, "--step", "7"]) == 1
    assert "no episode in" in capsys.readouterr().err
    empty = tmp_path / "other"
    empty.mkdir()
    assert main(["show", str(empty)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert str(empty) in err and "episodes/" in err and "logging.episodes" in err
