"""`agentgym-mega report`: the page of a run directory written as EPISODES_SPEC describes it (a
resumed step, evaluations at steps 0 and 2, train and eval episodes, one with hostile text) holds
everything inline, escapes the episodes, and works in headless Chromium."""

import json
import os
import re

import pytest
import yaml

from agentgym_mega.cli import main
from agentgym_mega.report import script_json
from tests.conftest import run_cli

EVIL = "</script><img src=x onerror=alert(1)>"
ACTION = "pick up the red ball"
CATEGORIES = ("GoToRedBall", "GoToRedBallGrey")


def _turn(text, action, observation, reward):
    return {"text": text, "action": action, "valid_action": bool(action),
            "action_error": None if action else "no `Action:` line in the reply", "observation": observation,
            "reward": reward, "tokens": 12, "observation_tokens": 0 if observation is None else 30,
            "generate_s": 0.12, "env_s": 0.01}


def _episode(step, split, task_id, sample, success):
    turns = [_turn("I should look around first.", "", "You see a wall.", 0.0),
             _turn(f"Thought: the ball is near.\nAction: {ACTION}", ACTION, None, 0.9 if success else 0.0)]
    if (step, split, task_id, sample) == (1, "train", 3, 0):
        turns[0]["text"] = f"Here is a trick {EVIL} and more"
    return {"step": step, "split": split, "env": "babyai", "task_id": task_id,
            "category": CATEGORIES[task_id % 2], "group": task_id, "sample": sample, "weight_version": step,
            "status": "done" if success else "horizon", "score": 0.9 if success else 0.0, "success": success,
            "error": None, "rewards": [t["reward"] for t in turns], "observation": f"go to the red ball ({task_id})",
            "turns": turns, "tokens": {"prompt": 120, "response": 24, "total": 180}, "time_s": 1.3}


def _eval_report(step, success):
    scope = {"tasks": 2, "avg": success * 0.9, "pass": success, "success": success, "valid": 0.5}
    return {"n": 2, "step": step, "max_turns": 6, "overall": scope,
            "categories": {c: scope for c in CATEGORIES}, "env_errors": 0, "timeouts": 0}


def _eval_metrics(report):
    metrics = {f"eval/{k}": report["overall"][k] for k in ("success", "avg", "pass", "valid")}
    for c in CATEGORIES:
        metrics |= {f"eval/{c}/{k}": report["categories"][c][k] for k in ("success", "avg", "pass", "valid")}
    return metrics


def _train_metrics(step, reward):
    return {"reward/mean": reward, "reward/success_rate": reward, "episode/turns_mean": 2.0,
            "episode/valid_action_rate": 0.5, "actor/ref_kl": 0.01 * step, "actor/entropy": 1.0 - 0.1 * step,
            "actor/clip_fraction": 0.02, "horizon/turn_cap": 2 if step < 2 else 4,
            "time/rollout_s": 3.0, "time/logprob_s": 0.5, "time/train_s": 1.5, "time/sync_s": 0.2,
            "time/generate_s": 2.5}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """Two training steps after a step-0 evaluation; step 2 logged twice (a resumed run redid it:
    its second line, reward 0.75, wins); evaluations at steps 0 and 2."""
    run = tmp_path_factory.mktemp("run")
    config = {"model": {"path": "runs/models/smollm2-135m-instruct"},
              "env": {"name": "babyai", "categories": list(CATEGORIES)}, "algorithm": {"estimator": "grpo"},
              "horizon": {"schedule": "scaling_inter", "caps": [2, 4], "interval": 2},
              "trainer": {"total_steps": 2, "batch_size": 2}, "rollout": {"n_per_task": 2},
              "logging": {"experiment": "report-test"}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    evals = {0: _eval_report(0, 0.25), 2: _eval_report(2, 0.75)}
    lines = [{"step": 0, **_eval_metrics(evals[0])}, {"step": 1, **_train_metrics(1, 0.25)},
             {"step": 2, **_train_metrics(2, 0.5)}, {"step": 2, **_train_metrics(2, 0.75), **_eval_metrics(evals[2])}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (run / "eval").mkdir()
    for step, report in evals.items():
        (run / "eval" / f"step_{step}.json").write_text(json.dumps(report))
    (run / "episodes").mkdir()
    for step in (0, 1, 2):
        train = [_episode(step, "train", t, s, (t + s + step) % 2 == 0) for t in (3, 4) for s in (0, 1)]
        held_out = [_episode(step, "eval", t, s, s < step) for t in (0, 1) for s in (0, 1)]
        episodes = (train if step else []) + (held_out if step != 1 else [])
        (run / "episodes" / f"step_{step}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in episodes))
    return run


@pytest.fixture(scope="module")
def report(run_dir):
    result = run_cli("report", str(run_dir))
    assert result.returncode == 0, result.stderr
    path = str(run_dir / "report.html")
    assert result.stdout.startswith(f"report: {path} ")
    with open(path, encoding="utf-8") as f:
        return path, f.read()


def test_report_is_self_contained(report):
    html = report[1]
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html, re.I)
    assert not re.search(r"<(link|iframe|img|script\s+src)\b", html, re.I)  # nothing is fetched
    assert "<!DOCTYPE svg" not in html
    assert html.count("<svg") == 5  # reward/success, held-out per category, KL, entropy, clip fraction


def test_report_holds_the_run(report, run_dir):
    html = report[1]
    for text in ("runs/models/smollm2-135m-instruct", "babyai", "grpo", "2 of 2", "GoToRedBallGrey",
                 "step 0: n=2", "step 2: n=2", "Avg@2", "Pass@2", "valid actions", "cap 4"):
        assert text in html, text
    # time per phase: the resumed step counts once, 2 steps x 3.0 s of rollout of a 10.4 s total
    assert re.search(r"<td>rollout</td><td class=\"num\">6.0</td>", html)
    assert "10.4 s (sum of the timed phases)" in html  # the engines' busy time is part of the rollout's
    assert re.search(r"generate \(busy, within rollout\)</td><td class=\"num\">5.0</td>", html)
    blob = re.search(r'<script type="application/json" id="episodes-data">(.*?)</script>', html, re.S).group(1)
    assert len(json.loads(blob)) == sum(len(f.read_text().splitlines()) for f in (run_dir / "episodes").iterdir())


def test_episode_text_cannot_break_the_page(report):
    html = report[1]
    assert EVIL not in html and "<img" not in html
    assert html.count("</script>") == 2  # the JSON blob's and the script's own ends
    assert json.loads(script_json([EVIL, float("nan")])) == [EVIL, None]


def test_missing_pieces_render_with_a_note(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n{not json")
    out = tmp_path / "elsewhere" / "page.html"
    assert main(["report", str(tmp_path), "--out", str(out)]) == 0
    html = out.read_text()
    for note in ("no config.yaml", "skipped 1 line(s)", "No evaluation in this run", "No episodes saved",
                 "not in metrics.jsonl: actor/ref_kl"):
        assert note in html, note


def test_a_step_without_metrics_is_noted(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, **_train_metrics(1, 0.5)}) + "\n")
    (tmp_path / "episodes").mkdir()
    for step in (1, 3):
        episode = _episode(step, "train", 3, 1, True)
        (tmp_path / "episodes" / f"step_{step}.jsonl").write_text(json.dumps(episode) + "\n")
    assert main(["report", str(tmp_path)]) == 0
    html = (tmp_path / "report.html").read_text()
    assert "no metrics.jsonl line for step(s) [3]" in html
    assert "No held-out" in html and "No evaluation in this run" in html


def test_a_directory_that_is_not_a_run_is_refused(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "neither metrics.jsonl nor episodes/" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "absent")]) == 2
    assert not os.path.exists(tmp_path / "report.html")


def test_report_in_headless_chromium(report, tmp_path):
    from tests.report_browser import check_report

    check_report(report[0], str(tmp_path / "report.png"), ACTION)
    assert os.path.getsize(tmp_path / "report.png") > 10_000
