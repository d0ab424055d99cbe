"""W&B offline runs written by WandbRun and read back with wandb's own reader of the .wandb
transaction log (`wandb leet inspect --json`): a 2-step run's history, tables, and its resume."""

import glob
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from agentgym_mega.errors import BadInput
from agentgym_mega.wandb_run import ID_FILE, WandbRun

REPORT = {"n": 2, "step": 2, "max_turns": 6, "env_errors": 0, "timeouts": 0,
          "overall": {"tasks": 3, "avg": 0.5, "pass": 0.75, "success": 0.5, "valid": 0.9},
          "categories": {"GoToRedBall": {"tasks": 2, "avg": 0.75, "pass": 1.0, "success": 0.75, "valid": 1.0},
                         "PickupKey": {"tasks": 1, "avg": 0.0, "pass": 0.0, "success": 0.0, "valid": 0.7}}}


def episode(task_id: int, action: str) -> dict:
    return {"step": 2, "split": "train", "env": "babyai", "task_id": task_id, "category": "GoToRedBall",
            "status": "done", "score": 0.9, "success": True, "observation": "You see a red ball.",
            "turns": [{"text": f"I will {action}.", "action": action, "valid_action": True, "action_error": None,
                       "observation": None, "reward": 0.9}]}


def wandb_cfg(mode: str) -> SimpleNamespace:
    return SimpleNamespace(project="agentgym-mega", entity=None, name=None, tags=["unit"], mode=mode)


def segments(output_dir: str) -> list[tuple[dict, list[dict], str]]:
    """Each offline run directory under output_dir/wandb: its run record, its history rows, its path."""
    found = []
    for path in sorted(glob.glob(os.path.join(output_dir, "wandb", "offline-run-*", "run-*.wandb"))):
        out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", path],
                             capture_output=True, text=True, check=True, timeout=120)
        records = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
        run = next(r["run"] for r in records if r["type"] == "run")
        found.append((run, [r["history"]["item"] for r in records if r["type"] == "history"], os.path.dirname(path)))
    return found


@pytest.fixture(scope="module")
def wandb_home(tmp_path_factory):
    """wandb's settings, cache and data under a temporary folder; its service ends with the module."""
    wandb = pytest.importorskip("wandb")  # the `wandb` extra
    home = tmp_path_factory.mktemp("wandb_home")
    with pytest.MonkeyPatch.context() as mp:
        for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
            mp.setenv(var, str(home / var.lower()))
        for var in ("WANDB_MODE", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE",
                    "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_BASE_URL"):
            mp.delenv(var, raising=False)
        mp.setenv("NETRC", str(home / "netrc"))  # none: no credentials, so online mode cannot reach a server
        mp.setenv("WANDB_SILENT", "true")
        yield home
        wandb.teardown()


@pytest.fixture(scope="module")
def first_run(wandb_home, tmp_path_factory):
    """A 2-step offline run: step metrics, the eval table and 5 episodes sampled down to 3."""
    output_dir = str(tmp_path_factory.mktemp("run"))
    run = WandbRun.start(output_dir, wandb_cfg("offline"), {"logging": {"experiment": "unit"}}, resume=False)
    run.log(1, {"reward/mean": 0.25, "actor/ref_kl": 0.01, "note": "not a number"})
    run.log(2, {"reward/mean": 0.5, "actor/ref_kl": 0.02})
    run.log_eval(2, REPORT)
    run.log_episodes(2, [episode(i, f"go to box {i}") for i in range(5)], limit=3)
    run.finish()
    return output_dir, run.id


@pytest.fixture(scope="module")
def resumed_run(first_run):
    output_dir, _ = first_run
    run = WandbRun.start(output_dir, wandb_cfg("offline"), {"logging": {"experiment": "unit"}}, resume=True)
    run.log(3, {"reward/mean": 0.75})
    run.finish()
    return run.id


def test_two_step_offline_run_holds_step_metrics_and_tables(first_run):
    output_dir, run_id = first_run
    with open(os.path.join(output_dir, ID_FILE)) as f:
        assert f.read().strip() == run_id
    (run, history, run_dir), = [s for s in segments(output_dir) if not s[0].get("resume")]
    assert run["run_id"] == run_id and run["display_name"] == "unit"
    by_step = {row["trainer/step"]: row for row in history if "reward/mean" in row}
    assert {s: (r["reward/mean"], r["actor/ref_kl"]) for s, r in by_step.items()} == {1: (0.25, 0.01),
                                                                                     2: (0.5, 0.02)}
    assert not any("note" in row for row in history)  # only numbers, as in TensorBoard
    tables = {}
    for key in ("eval/table", "episodes/sample"):
        row = next(r for r in history if f"{key}.path" in r)
        assert row["trainer/step"] == 2
        with open(os.path.join(run_dir, "files", row[f"{key}.path"])) as f:
            tables[key] = json.load(f)
    assert tables["eval/table"]["columns"] == ["category", "tasks", "avg", "pass", "success", "valid"]
    assert tables["eval/table"]["data"] == [["GoToRedBall", 2, 0.75, 1.0, 0.75, 1.0],
                                            ["PickupKey", 1, 0.0, 0.0, 0.0, 0.7], ["overall", 3, 0.5, 0.75, 0.5, 0.9]]
    episodes = tables["episodes/sample"]
    assert episodes["columns"][:8] == ["step", "split", "task_id", "category", "status", "score", "success", "turns"]
    assert [row[2] for row in episodes["data"]] == [0, 1, 3]  # spread over the 5 episodes
    assert "action: go to box 3" in episodes["data"][2][8]


def test_resumed_run_continues_the_same_wandb_run(first_run, resumed_run):
    output_dir, run_id = first_run
    assert resumed_run == run_id
    with open(os.path.join(output_dir, ID_FILE)) as f:
        assert f.read().strip() == run_id
    (run, history, run_dir), = [s for s in segments(output_dir) if s[0].get("resume")]
    # offline, a resume is a new directory of the same run id (named ...-<id>, or ...-<id>-1 within the same second)
    assert run["run_id"] == run_id and os.path.exists(os.path.join(run_dir, f"run-{run_id}.wandb"))
    assert [(r["trainer/step"], r["reward/mean"]) for r in history if "reward/mean" in r] == [(3, 0.75)]


def test_disabled_imports_nothing_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # importing wandb would fail
    assert WandbRun.start(str(tmp_path / "run"), wandb_cfg("disabled"), {}, resume=False) is None
    assert os.listdir(tmp_path) == []


def test_missing_wandb_names_the_extra_and_the_way_off(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(BadInput, match=r"pip install 'agentgym-mega\[wandb\]'.*logging\.wandb\.mode=disabled"):
        WandbRun.start(str(tmp_path / "run"), wandb_cfg("offline"), {}, resume=False)


def test_online_without_login_is_bad_input(wandb_home, tmp_path):
    with pytest.raises(BadInput, match=r"logging\.wandb\.mode=online: .*logging\.wandb\.mode=offline"):
        WandbRun.start(str(tmp_path / "run"), wandb_cfg("online"), {}, resume=False)
