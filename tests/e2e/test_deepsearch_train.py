"""Deep Search through the whole loop on CPU: env servers started by the trainer in Ray with the
run's `env.options`, its instruction, a vLLM engine and a megatron actor, one step."""

import json
import os

import pytest

from tests.conftest import REPO, TINY_TEXTCRAFT, run_cli

pytestmark = pytest.mark.slow


def test_one_step_on_questions_the_options_point_at(tmp_path, tiny_qwen2):
    # Two questions of a source only this directory has: the run's categories are found only if
    # the servers the trainer started loaded env.options.data_dir.
    data = tmp_path / "questions"
    (data / "mine").mkdir(parents=True)
    (data / "mine" / "train.jsonl").write_text("".join(
        json.dumps({"question": q, "golden_answers": [a]}) + "\n"
        for q, a in [("Who founded Oriveth Systems?", "Kaelen Morvast"), ("Where is Tessaly?", "Orvania")]))
    (data / "layout.json").write_text(json.dumps([{"source": "mine", "file": "mine/train.jsonl", "split": "train"}]))
    run_dir = tmp_path / "run"
    overrides = [o for o in TINY_TEXTCRAFT if not o.startswith("env.")] + [
        f"model.path={tiny_qwen2}", "env.name=deepsearch", "env.num_servers=1", "env.categories=[mine]",
        f"env.options={{data_dir: {data}, corpus: {REPO}/envs/deepsearch/data/corpus.jsonl, topk: 2}}",
        "rollout.max_tokens_per_turn=24", "horizon.caps=[2]", "trainer.total_steps=1",
        f"trainer.output_dir={run_dir}",
    ]
    result = run_cli("train", "--config", os.path.join(REPO, "configs", "base.yaml"), *overrides, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(run_dir / "metrics.jsonl") as f:
        (step,) = [json.loads(line) for line in f]
    # Every episode ran against a live server (a random policy's replies are observations, not errors).
    assert step["episode/env_errors"] == 0 and 1 <= step["episode/turns_mean"] <= 2
    assert step["actor/grad_norm"] > 0 and step["rollout/logprob_diff"] <= 1e-4
