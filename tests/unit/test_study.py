"""`agentgym-mega study horizon` without training: the arms' and runs' overrides, the settings a
study records and refuses to mix, which runs it skips, the figures over seeds from hand-written
metrics.jsonl files, and the report it writes (table, PNG, --json)."""

import json
import os
import sys

import pytest

from agentgym_mega import study, study_report
from agentgym_mega.cli import main
from agentgym_mega.errors import BadInput
from agentgym_mega.metrics import read_metrics

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "study_horizon_cpu.yaml")
ARMS = ["scaling_inter", "short", "long"]
QUICK_SHARED = ["trainer.batch_size=4", "trainer.mini_batch_size=2", "rollout.n_per_task=4", "trainer.save_freq=3",
                "eval.freq=3", "eval.limit=8", "eval.n=1", "trainer.total_steps=6"]


def write_metrics(run_dir, lines):
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)


def run_lines(evals: dict, steps: int = 6, std: float = 0.3) -> list[dict]:
    """A run's lines as the trainer writes them: step 0's evaluation alone, then one record per
    step, an evaluation merged into its step's record."""
    lines = [{"step": 0, "eval/success": evals[0]}] if 0 in evals else []
    for step in range(1, steps + 1):
        record = {"step": step, "reward/mean": 0.1, "reward/std": std * step, "episode/turns_mean": float(step)}
        lines.append(record | ({"eval/success": evals[step]} if step in evals else {}))
    return lines


def test_each_arm_overrides_only_its_horizon_and_each_run_its_seed_and_directory(tmp_path):
    arms = study.arms(ARMS + ["long_gigpo"], [2, 4, 8], 20)
    assert [a.overrides for a in arms] == [
        ["horizon.schedule=scaling_inter", "horizon.caps=[2,4,8]", "horizon.interval=20"],
        ["horizon.schedule=fixed", "horizon.caps=[2]"],
        ["horizon.schedule=fixed", "horizon.caps=[8]"],
        ["horizon.schedule=fixed", "horizon.caps=[8]", "algorithm.estimator=gigpo", "algorithm.gamma=0.95"]]
    assert [a.boundaries(60) for a in arms] == [[20, 40], [], [], []]  # the last step at caps 2 and 4
    runs = study.plan(arms[1:2], 2, 7, ["eval.n=1"], str(tmp_path))
    assert [(r.k, r.seed, r.path) for r in runs] == [(1, 8, str(tmp_path / "short" / "seed_1")),
                                                     (2, 9, str(tmp_path / "short" / "seed_2"))]
    assert list(runs[1].overrides) == ["eval.n=1", "horizon.schedule=fixed", "horizon.caps=[2]", "trainer.seed=9",
                                       f"trainer.output_dir={tmp_path / 'short' / 'seed_2'}",
                                       "logging.progress_bar=false"]


def test_quick_study_of_the_shipped_config_is_small_and_the_users_overrides_win(tmp_path):
    plan = study.prepare(CONFIG, [], ARMS, 1, None, None, True, str(tmp_path))
    assert (plan.cfg.trainer.total_steps, plan.settings["caps"], plan.settings["interval"]) == (6, [4, 8, 12], 2)
    assert [list(r.overrides) for r in plan.runs] == [
        [*QUICK_SHARED, *arm, "trainer.seed=1", f"trainer.output_dir={tmp_path / name / 'seed_1'}",
         "logging.progress_bar=false"]
        for name, arm in [("scaling_inter", ["horizon.schedule=scaling_inter", "horizon.caps=[4,8,12]",
                                             "horizon.interval=2"]),
                          ("short", ["horizon.schedule=fixed", "horizon.caps=[4]"]),
                          ("long", ["horizon.schedule=fixed", "horizon.caps=[12]"])]]
    # every stage runs: a quick study's steps follow its caps and interval
    assert study.prepare(CONFIG, [], ["short"], 1, [2, 4], 3, True, str(tmp_path)).cfg.trainer.total_steps == 6
    full = study.prepare(CONFIG, ["trainer.total_steps=90"], ["short"], 3, [2, 5], 30, False, str(tmp_path))
    assert full.cfg.trainer.total_steps == 90 and [r.seed for r in full.runs] == [1, 2, 3]
    assert full.runs[0].overrides[:3] == ("trainer.total_steps=90", "horizon.schedule=fixed", "horizon.caps=[2]")


@pytest.mark.parametrize("names,caps,message", [
    (["scaling_inter", "medium"], [2, 4], "unknown arm 'medium'"),
    (["short", "short"], [2, 4], "named twice"),
    (["short"], [4], "two or more strictly increasing caps"),
    (["short"], [4, 4], "two or more strictly increasing caps"),
])
def test_bad_arms_are_named(names, caps, message):
    with pytest.raises(BadInput, match=message):
        study.arms(names, caps, 10)


def test_a_study_without_evaluations_or_with_a_bad_key_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(BadInput, match="eval.freq=0"):
        study.prepare(CONFIG, ["eval.freq=0"], ARMS, 1, None, None, False, str(tmp_path))
    with pytest.raises(BadInput, match="(?s)the base config: .*trainer.total_stepz"):
        study.prepare(CONFIG, ["trainer.total_stepz=5"], ARMS, 1, None, None, False, str(tmp_path))


def test_changed_settings_are_refused_naming_what_differs(tmp_path):
    first = study.prepare(CONFIG, [], ARMS, 1, None, None, True, str(tmp_path))
    with pytest.raises(BadInput, match="does not exist"):  # --report-only of nothing
        study.check_settings(first, record=False)
    study.check_settings(first, record=True)
    study.check_settings(study.prepare(CONFIG, [], ARMS, 1, None, None, True, str(tmp_path)), record=True)  # same
    other = study.prepare(CONFIG, ["eval.n=2"], ARMS, 1, [2, 4, 8], None, True, str(tmp_path))
    with pytest.raises(BadInput) as refused:
        study.check_settings(other, record=True)
    text = str(refused.value)
    assert "caps: recorded [4, 8, 12], now [2, 4, 8]" in text and "base.eval.n: recorded 1, now 2" in text
    assert "overrides: recorded [], now ['eval.n=2']" in text and "another --out" in text
    assert json.loads((tmp_path / "study.json").read_text()) == first.settings  # the record kept


def test_a_run_is_finished_when_its_last_step_has_its_evaluation(tmp_path):
    assert not study.finished(str(tmp_path / "absent"), 6)
    write_metrics(tmp_path / "a", run_lines({0: 0.1, 3: 0.2}))  # killed after step 6, before its evaluation
    assert not study.finished(str(tmp_path / "a"), 6)
    write_metrics(tmp_path / "a", [{"step": 6, "eval/success": 0.4}])  # resumed: step 6 again, evaluated
    assert study.finished(str(tmp_path / "a"), 6)
    assert not study.finished(str(tmp_path / "a"), 8)  # a longer study's run goes on


def test_finished_runs_are_not_run_again(tmp_path):
    plan = study.prepare(CONFIG, [], ARMS, 1, None, None, True, str(tmp_path))
    for run in plan.runs:
        write_metrics(run.path, run_lines({0: 0.1, 3: 0.2, 6: 0.3}))
    said = []
    assert study.run_all(plan, said.append) == 0
    assert said == [f"[study] arm {arm} seed 1/1: finished before, not run again" for arm in ARMS]


def test_a_run_s_step_lines_become_progress_and_its_output_goes_to_its_log(tmp_path):
    child = "print('placement: 1 node'); print('step 1: reward 0.1'); print('eval at step 1:'); print('step 2: x')"
    steps = []
    code = study.train([sys.executable, "-c", child + "; raise SystemExit(75)"], str(tmp_path / "log"),
                       steps.append)
    assert (code, steps) == (75, [1, 2])
    assert (tmp_path / "log").read_text().splitlines()[0] == "placement: 1 node"


def test_figures_over_seeds_with_a_resumed_step_and_a_missing_evaluation(tmp_path):
    seeds = [run_lines({0: 0.2, 3: 0.4, 6: 0.6}),
             # resumed after step 4: steps 5 and 6 logged twice, the later lines win
             run_lines({0: 0.2, 3: 0.5, 6: 0.1}) + run_lines({6: 0.8}, std=0.5)[4:],
             run_lines({0: 0.2, 6: 0.5}),  # no evaluation at step 3
             []]  # a seed not started
    for k, lines in enumerate(seeds, 1):
        write_metrics(tmp_path / f"seed_{k}", lines)
    runs = [read_metrics(str(tmp_path / f"seed_{k}")) for k in range(1, 5)]
    arm = study.arms(["scaling_inter"], [2, 4], 3)[0]
    figures = study_report.summarize(arm, [1, 2, 3, 4], runs, 6)
    assert figures["final_success"] == [0.6, 0.8, 0.5, None]
    expected = [[0, 0.2, 0.0], [3, 0.45, 0.05], [6, 19 / 30, (((0.6 - 19 / 30) ** 2 + (0.8 - 19 / 30) ** 2
                                                             + (0.5 - 19 / 30) ** 2) / 3) ** 0.5]]
    assert len(figures["curve"]) == 3
    for got, want in zip(figures["curve"], expected):
        assert got[0] == want[0] and got[1:] == pytest.approx(want[1:], abs=1e-12)
    assert (figures["final_mean"], figures["final_std"]) == pytest.approx(expected[2][1:], abs=1e-12)
    # reward std in the last third (steps 5, 6): 1.5 and 1.8 for two seeds, 2.5 and 3.0 for the resumed one
    assert figures["reward_std_late"] == pytest.approx((1.5 + 1.8) * 2 / 6 + (2.5 + 3.0) / 6, abs=1e-12)
    assert figures["turns_mean"] == pytest.approx(3.5, abs=1e-12) and figures["boundaries"] == [3]


def test_report_only_writes_the_table_the_png_and_the_json_schema(tmp_path, capsys):
    out, report = tmp_path / "out", tmp_path / "study.json"
    plan = study.prepare(CONFIG, [], ARMS, 1, None, None, True, str(out))
    study.check_settings(plan, record=True)
    for run, final in zip(plan.runs, (0.5, 0.25, None)):
        write_metrics(run.path, run_lines({0: 0.125, 3: 0.25} | ({6: final} if final is not None else {})))
    assert main(["study", "horizon", "--quick", "--out", str(out), "--report-only", "--json", str(report)]) == 0
    data = json.loads(report.read_text())
    assert list(data) == ["arms", "levels", "steps", "eval"]
    assert [list(arm) for arm in data["arms"]] == [list(study_report.JSON_ARM_KEYS)] * 3
    assert data["arms"][0] == {"name": "scaling_inter", "schedule": "scaling_inter", "caps": [4, 8, 12],
                               "interval": 2, "seeds": [1], "final_success": [0.5], "final_mean": 0.5,
                               "final_std": 0.0, "curve": [[0, 0.125, 0.0], [3, 0.25, 0.0], [6, 0.5, 0.0]]}
    assert data["arms"][2]["final_success"] == [None] and data["arms"][2]["final_mean"] is None
    assert (data["levels"], data["steps"]) == (["GoToLocalS8N7", "Open", "PickupLoc", "GoToObjMazeS7"], 6)
    assert data["eval"] == {"tasks": 8, "n": 1, "max_turns": 12}
    table = (out / "study.md").read_text()
    assert "no conclusion" in table and "| short | fixed | 4 | 0.250 ± 0.000 | 0.250 | 3.50 | 1.650 |" in table
    assert "| scaling_inter | scaling_inter | 4 -> 8 -> 12, every 2 steps |" in capsys.readouterr().out
    png = (out / "study.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert main(["study", "horizon", "--quick", "--out", str(out), "--caps", "2,4", "--report-only"]) == 2
    assert "caps: recorded [4, 8, 12], now [2, 4]" in capsys.readouterr().err
