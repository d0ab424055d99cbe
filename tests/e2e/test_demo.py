"""`make demo`'s pipeline, shortened: pretrain-tiny writes a base policy that vLLM and megatron
load (a Llama with the cross-word tokenizer), and configs/demo_cpu.yaml trains it through the
whole stack with held-out evaluations before and after. (Whether it learns is the demo's own
figure, in docs/figures.md; this checks that the parts still fit together.)"""

import json
import os

import pytest

from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.slow


def test_pretrain_tiny_then_demo_config_trains_and_evaluates(tmp_path):
    base = tmp_path / "base"
    result = run_cli("pretrain-tiny", "--env", "babyai", "--categories", "GoToRedBall,GoToRedBallNoDists",
                     "--episodes", "96", "--epochs", "1", "--batch-size", "16", "--out", str(base), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((base / "pretrain.json").read_text())
    assert summary["steps"] == 6 and summary["final_loss"] < summary["initial_loss"]
    assert json.loads((base / "config.json").read_text())["num_key_value_heads"] == 2  # TP=2 splits them

    run_dir = tmp_path / "run"
    result = run_cli(
        "train", "--config", os.path.join(REPO, "configs", "demo_cpu.yaml"),
        f"model.path={base}", f"trainer.output_dir={run_dir}", "env.categories=[GoToRedBall,GoToRedBallNoDists]",
        "trainer.total_steps=2", "trainer.save_freq=0", "horizon.interval=1", "rollout.n_per_task=2",
        "eval.freq=2", "eval.n=1", "eval.limit=4", "logging.progress_bar=false", timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(run_dir / "metrics.jsonl") as f:
        metrics = [json.loads(line) for line in f]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert "eval/success" in metrics[0] and "eval/success" in metrics[2]
    assert (metrics[1]["horizon/turn_cap"], metrics[2]["horizon/turn_cap"]) == (2, 4)
    assert metrics[2]["rollout/logprob_diff"] <= 1e-4  # the Llama's weights reached vLLM at TP=2
    assert "held-out success (4 tasks x 1, 6 turns)" in result.stdout
    assert (run_dir / "reward_curve.png").exists()
    assert (run_dir / "checkpoints" / "actor" / "latest").read_text().strip() == "iter_0000002"
