"""Every estimator through the real loop: `agentgym-mega train` on BabyAI (a tiny pretrained base
that succeeds often enough for rewards to differ), a vLLM engine and megatron-core at TP=2, two
steps each, then (gae) a resume from the step-1 checkpoint that must repeat step 2 exactly.

What must hold for each: the reference policy equals the actor at step 1 (KL exactly 0), the
losses are finite, the engine samples what the trainer scores (`rollout/logprob_diff` below
1e-4), the critic fits its returns over the PPO epochs of a step, and a resumed step 2 equals the
uninterrupted one (sampling is seeded per request, so the same weights sample the same episodes).
"""

import json
import math
import os
import shutil

import pytest

from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.slow

LOGPROB_TOL = 1e-4  # engine vs trainer log-probs, fp32
RESUME_TOL = 1e-6  # a resumed step against the uninterrupted one: same weights, same episodes
LEVELS = "GoToRedBall,GoToRedBallNoDists"

ESTIMATORS = {
    # PPO with the critic, the KL in the reward; three epochs over each batch for the critic to fit
    "gae": ["algorithm.estimator=gae", "algorithm.kl_coef=0.001", "algorithm.kl_in=reward", "trainer.ppo_epochs=3"],
    "grpo": ["algorithm.estimator=grpo", "algorithm.kl_coef=0.001", "algorithm.kl_in=loss"],
    "reinforce_pp": ["algorithm.estimator=reinforce_pp", "algorithm.kl_coef=0.001", "algorithm.kl_in=reward"],
    "rloo": ["algorithm.estimator=rloo", "algorithm.kl_coef=0.0"],
}

# What a resume restores differs by role, not by estimator: gae has the actor, the reference and
# the critic, every other estimator a subset of those, so gae's exact resume covers theirs
# (tests/e2e/test_train_loop.py resumes a grpo run at the right step and turn cap).
RESUMED = ("gae",)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    out = tmp_path_factory.mktemp("estimators") / "base"
    result = run_cli("pretrain-tiny", "--env", "babyai", "--categories", LEVELS, "--episodes", "256",
                     "--epochs", "2", "--batch-size", "16", "--out", str(out), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def _train(base, run_dir, estimator, *extra):
    result = run_cli(
        "train", "--config", os.path.join(REPO, "configs", "demo_cpu.yaml"), *ESTIMATORS[estimator],
        f"model.path={base}", f"trainer.output_dir={run_dir}", f"env.categories=[{LEVELS}]",
        "rollout.n_per_task=4", "trainer.batch_size=2", "trainer.mini_batch_size=2", "horizon.interval=1",
        "trainer.total_steps=2", "trainer.save_freq=1", "eval.at_start=false", "eval.freq=0",
        "logging.progress_bar=false", *extra, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _checkpoint_roots(run_dir):
    return [p for p in (run_dir / "checkpoints").iterdir() if p.is_dir()]


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_estimator_trains_and_resumes_exactly(base, tmp_path, estimator):
    run_dir = tmp_path / "run"
    first, second = _train(base, run_dir, estimator)

    for step in (first, second):
        losses = {k: v for k, v in step.items() if k.endswith("loss") or "/loss_" in k}
        assert losses and all(math.isfinite(v) for v in losses.values()), losses
    if "algorithm.kl_coef=0.0" not in ESTIMATORS[estimator]:
        assert first["actor/ref_kl"] == 0.0  # the reference policy is the starting actor
        assert second["actor/ref_kl"] > 0.0  # ... and the actor moved away from it
        if "algorithm.kl_in=loss" in ESTIMATORS[estimator]:
            assert first["actor/kl"] == 0.0  # one update per step: it ran on the starting weights
    else:
        assert "actor/ref_kl" not in first  # no reference model without a KL term
    assert second["rollout/logprob_diff"] < LOGPROB_TOL
    assert first["actor/grad_norm"] > 0
    if estimator == "gae":
        for step in (first, second):
            assert step["critic/loss_last_epoch"] < step["critic/loss_first_epoch"]
        assert {p.name for p in _checkpoint_roots(run_dir)} == {"actor", "critic"}

    if estimator not in RESUMED:
        return
    # Interrupted after step 1: a new run directory holding only the step-1 checkpoints resumes.
    resumed_dir = tmp_path / "resumed"
    for root in _checkpoint_roots(run_dir):
        target = resumed_dir / "checkpoints" / root.name
        shutil.copytree(root / "iter_0000001", target / "iter_0000001")
        (target / "latest").write_text("iter_0000001")
    (resumed_dir / "metrics.jsonl").write_text(json.dumps(first) + "\n")
    again = _train(base, resumed_dir, estimator, "--resume")[1]
    assert again["step"] == 2
    assert again["reward/mean"] == second["reward/mean"]  # the same episodes were sampled
    assert again["episode/response_tokens_mean"] == second["episode/response_tokens_mean"]
    for key in sorted(k for k in second if k.startswith(("actor/", "critic/"))):
        assert abs(again[key] - second[key]) <= RESUME_TOL * max(1.0, abs(second[key])), key
