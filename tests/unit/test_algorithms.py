"""The RL math against values computed by hand (written out in each test)."""

import pytest
import torch

from agentgym_mega.algorithms import (
    aggregate, aggregate_parts, critic_loss, entropy_bonus, gae, grpo_advantages, horizon_cap, kl_penalty, policy_loss,
    reinforce_pp_advantages, rloo_advantages, value_loss,
)
from agentgym_mega.config import HorizonConfig

T = torch.tensor


def test_gae_skips_observation_tokens():
    # tokens: prompt, asst, asst, observation, asst; rewards on mask-0 tokens are ignored.
    mask = T([[0, 1, 1, 0, 1]])
    values = T([[9.0, 1.0, 2.0, 9.0, 3.0]])
    rewards = T([[5.0, 0.0, 0.0, 5.0, 1.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # t4: delta = 1 + 0.9*0 - 3 = -2             -> A = -2
    # t2: delta = 0 + 0.9*V(t4)=2.7 - 2 = 0.7    -> A = 0.7 + 0.45*(-2) = -0.2
    # t1: delta = 0 + 0.9*V(t2)=1.8 - 1 = 0.8    -> A = 0.8 + 0.45*(-0.2) = 0.71
    torch.testing.assert_close(adv, T([[0.0, 0.71, -0.2, 0.0, -2.0]]))
    torch.testing.assert_close(ret, T([[0.0, 1.71, 1.8, 0.0, 1.0]]))


def test_gae_with_unit_gamma_lambda_and_zero_values_spreads_the_terminal_reward():
    mask = T([[1, 1, 0, 1], [1, 0, 0, 0]])
    rewards = T([[0.0, 0.0, 0.0, 1.0], [0.5, 0.0, 0.0, 0.0]])
    adv, ret = gae(rewards, torch.zeros(2, 4), mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, T([[1.0, 1.0, 0.0, 1.0], [0.5, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(ret, adv)


def test_reinforce_pp_whitens_masked_returns():
    mask = T([[1, 0, 1], [1, 1, 0]])
    rewards = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    adv = reinforce_pp_advantages(rewards, mask, gamma=0.5)
    # returns: row0 [0.5, -, 1], row1 [1, 2, -]; mean 1.125, population std sqrt(0.296875)
    std = 0.296875 ** 0.5
    expected = T([[(0.5 - 1.125) / std, 0.0, (1 - 1.125) / std], [(1 - 1.125) / std, (2 - 1.125) / std, 0.0]])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=1e-5)


def test_grpo_normalises_within_groups_and_zeroes_singletons():
    scores = T([1.0, 0.0, 0.0, 1.0, 1.0, 5.0])
    groups = T([0, 0, 0, 0, 1, 2])
    # group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735
    a = 0.5 / ((1 / 3) ** 0.5 + 1e-6)
    torch.testing.assert_close(grpo_advantages(scores, groups), T([a, -a, -a, a, 0.0, 0.0]))
    torch.testing.assert_close(grpo_advantages(scores, groups, norm_by_std=False), T([0.5, -0.5, -0.5, 0.5, 0.0, 0.0]))


def test_grpo_group_with_equal_scores_has_zero_advantage():
    assert torch.equal(grpo_advantages(T([1.0, 1.0, 1.0]), T([7, 7, 7])), torch.zeros(3))


def test_rloo_uses_the_mean_of_the_other_samples():
    scores = T([1.0, 0.0, 0.0, 1.0, 3.0, 5.0, 4.0])
    groups = T([0, 0, 0, 0, 1, 1, 2])
    # group 0: 1 - (1/3) = 2/3, 0 - 2/3; group 1: 3 - 5, 5 - 3; group 2 alone: 0
    torch.testing.assert_close(
        rloo_advantages(scores, groups), T([2 / 3, -2 / 3, -2 / 3, 2 / 3, -2.0, 2.0, 0.0])
    )


def test_kl_estimators():
    logp, ref = T([-1.0]), T([-2.0])  # log-ratio 1
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), T([1.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), T([0.5]))
    k3 = torch.exp(T([-1.0])) + 1.0 - 1.0  # e^-1 - (-1) - 1
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), k3)
    torch.testing.assert_close(kl_penalty(logp, ref, "low_var_kl"), k3)
    assert kl_penalty(T([0.0]), T([0.0]), "k3").item() == 0.0
    # clamped like the original: log-ratio to [-20, 20], the estimate to [-10, 10]
    extreme = kl_penalty(T([0.0, -50.0]), T([-50.0, 0.0]), "low_var_kl")
    torch.testing.assert_close(extreme, T([10.0, 10.0]))
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(logp, ref, "k4")


def test_policy_loss_clips_and_dual_clips():
    old = torch.zeros(1, 4)
    logp = T([[0.5, -0.5, 0.0, 1.0]])
    adv = T([[1.0, 1.0, -2.0, -1.0]])
    mask = torch.ones(1, 4)
    # t0: ratio e^.5 clipped to 1.2 -> -1.2 (clipped branch); t1: ratio e^-.5 -> -0.60653;
    # t2: ratio 1 -> 2; t3: ratio e -> max(2.71828, 1.2) = 2.71828
    loss, clip_frac = policy_loss(logp, old, adv, mask, clip=0.2)
    torch.testing.assert_close(loss, T((-1.2 - 0.606531 + 2.0 + 2.718282) / 4))
    torch.testing.assert_close(clip_frac, T(0.25))
    # dual clip 2: t3 bounded at -A * 2 = 2
    loss, _ = policy_loss(logp, old, adv, mask, clip=0.2, dual_clip=2.0)
    torch.testing.assert_close(loss, T((-1.2 - 0.606531 + 2.0 + 2.0) / 4))


def test_policy_loss_ignores_masked_tokens():
    loss, _ = policy_loss(T([[0.0, 9.0]]), T([[0.0, 0.0]]), T([[1.0, 100.0]]), T([[1, 0]]))
    torch.testing.assert_close(loss, T(-1.0))


def test_aggregations():
    loss = T([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = T([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the third sequence has no trained tokens
    torch.testing.assert_close(aggregate(loss, mask, "token-mean"), T(7 / 3))
    torch.testing.assert_close(aggregate(loss, mask, "seq-mean-token-sum"), T((3 + 4) / 2))
    torch.testing.assert_close(aggregate(loss, mask, "seq-mean-token-mean"), T((1.5 + 4) / 2))
    torch.testing.assert_close(entropy_bonus(loss, mask), T(7 / 3))
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(loss, mask, "sum")


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_aggregate_parts_of_slices_add_up_to_the_whole_batch(agg):
    # What DP slicing relies on: slices of unequal token counts, summed part by part, give the
    # aggregate of the whole batch (a mean of the slices' means would not).
    loss = torch.arange(12.0).reshape(4, 3)
    mask = T([[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]])
    parts = [aggregate_parts(loss[i: i + 2], mask[i: i + 2], agg) for i in (0, 2)]
    total, count = (sum(p[i] for p in parts) for i in (0, 1))
    torch.testing.assert_close(total / count, aggregate(loss, mask, agg))


def test_critic_loss_totals():
    from agentgym_mega.config import AlgorithmConfig

    batch = {"old_values": T([[1.0, 1.0]]), "returns": T([[2.0, 2.0]]), "loss_mask": torch.ones(1, 2)}
    total, count, metrics = critic_loss(T([[1.5, 1.1]]), batch, AlgorithmConfig(value_clip=0.2))
    torch.testing.assert_close(total / count, T((0.32 + 0.405) / 2))  # as in test_value_loss_clipping
    torch.testing.assert_close(metrics["value_clip_fraction"] / count, T(0.5))


def test_value_loss_clipping():
    returns, old, mask = T([[2.0, 2.0]]), T([[1.0, 1.0]]), torch.ones(1, 2)
    # v=1.5 clipped to 1.2: max(0.25, 0.64) -> 0.32; v=1.1 inside the clip: 0.81 -> 0.405
    loss, frac = value_loss(T([[1.5, 1.1]]), old, returns, mask, clip=0.2)
    torch.testing.assert_close(loss, T((0.32 + 0.405) / 2))
    torch.testing.assert_close(frac, T(0.5))


@pytest.mark.parametrize("step,cap", [
    (1, 6), (99, 6), (100, 6), (101, 13), (102, 13), (199, 13), (200, 13), (201, 20), (300, 20), (10_000, 20),
])
def test_horizon_cap_scaling_inter_at_and_around_boundaries(step, cap):
    horizon = HorizonConfig(schedule="scaling_inter", caps=[6, 13, 20], interval=100)
    assert horizon_cap(step, horizon) == cap


def test_horizon_cap_fixed_and_invalid_steps():
    assert horizon_cap(1, HorizonConfig(schedule="fixed", caps=[20])) == 20
    assert horizon_cap(5000, HorizonConfig(schedule="fixed", caps=[20])) == 20
    with pytest.raises(ValueError, match="1-based"):
        horizon_cap(0, HorizonConfig())


def test_actor_loss_combines_surrogate_entropy_and_kl():
    from agentgym_mega.algorithms import actor_loss
    from agentgym_mega.config import AlgorithmConfig

    logp = T([[-1.0, -2.0]])
    batch = {"old_logprobs": logp.clone(), "advantages": T([[1.0, 1.0]]), "loss_mask": T([[1.0, 1.0]]),
             "ref_logprobs": T([[-2.0, -2.0]])}
    entropy = T([[0.5, 1.5]])
    cfg = AlgorithmConfig(kl_type="k1", kl_coef=0.1, entropy_coef=0.01, kl_in="loss")
    total, count, metrics = actor_loss(logp, entropy, batch, cfg)
    # token-mean over 2 tokens. ratio 1: surrogate -1 each; entropy 0.5 + 1.5; k1 KL 1 + 0
    torch.testing.assert_close(count, T(2.0))
    torch.testing.assert_close(total / count, T(-1.0 - 0.01 * 1.0 + 0.1 * 0.5))
    torch.testing.assert_close(metrics["kl"], T(1.0))
    cfg = AlgorithmConfig(kl_in="reward", entropy_coef=0.0)  # KL handled in the reward instead
    total, count, metrics = actor_loss(logp, entropy, batch, cfg)
    torch.testing.assert_close(total / count, T(-1.0))
    assert "kl" not in metrics


def _batch(scores, groups, mask, rewards=None, values=None, statuses=None):
    from agentgym_mega.rollout.batch import Episode, TrajectoryBatch

    mask = T(mask)
    n = len(scores)
    episodes = [Episode(0, "", g, s, s > 0, 1, status, 1) for g, s, status in zip(groups, scores, statuses or ["done"] * n)]
    return TrajectoryBatch(
        input_ids=torch.zeros_like(mask, dtype=torch.long), attention_mask=torch.ones_like(mask),
        loss_mask=mask, rollout_logprobs=torch.zeros_like(mask),
        rewards=T(rewards) if rewards is not None else torch.zeros_like(mask),
        group_ids=T(groups), scores=T(scores), episodes=episodes,
        values=T(values) if values is not None else None,
    )


def test_outcome_estimators_spread_the_episode_advantage_over_its_tokens():
    from agentgym_mega.algorithms import compute_advantages
    from agentgym_mega.config import AlgorithmConfig

    batch = _batch([1.0, 0.0], [0, 0], [[0, 1, 1], [1, 1, 0]])
    compute_advantages(batch, AlgorithmConfig(estimator="rloo"))
    torch.testing.assert_close(batch.advantages, T([[0.0, 1.0, 1.0], [-1.0, -1.0, 0.0]]))
    compute_advantages(batch, AlgorithmConfig(estimator="grpo"))
    a = 0.5 / (0.5 ** 0.5 + 1e-6)  # mean 0.5, unbiased std sqrt(0.5)
    torch.testing.assert_close(batch.advantages, T([[0.0, a, a], [-a, -a, 0.0]]))


def test_gae_estimator_uses_values_and_token_rewards():
    from agentgym_mega.algorithms import compute_advantages
    from agentgym_mega.config import AlgorithmConfig

    batch = _batch([1.0], [0], [[1, 0, 1]], rewards=[[0.0, 0.0, 1.0]], values=[[0.5, 9.0, 0.25]])
    compute_advantages(batch, AlgorithmConfig(estimator="gae", gamma=1.0, lam=1.0))
    # t2: 1 - 0.25 = 0.75; t0: 0 + V(t2) - 0.5 = -0.25, plus 0.75 -> 0.5
    torch.testing.assert_close(batch.advantages, T([[0.5, 0.0, 0.75]]))
    torch.testing.assert_close(batch.returns, T([[1.0, 0.0, 1.0]]))


def test_eval_summary_avg_pass_at_n_and_success():
    import dataclasses

    from agentgym_mega.evaluation import summarize
    from agentgym_mega.rollout.batch import Episode

    def ep(task, category, score):  # success as a SciWorld task has it: full score only
        return Episode(task, category, task, score, score == 1.0, 3, "done", 10)

    broken = dataclasses.replace(ep(1, "depth1", 1.0), status="env_error")  # left out of every figure
    episodes = [ep(0, "depth1", 1.0), ep(0, "depth1", 0.0), ep(1, "depth1", 0.0), ep(1, "depth1", 0.0),
                ep(2, "depth2", 0.5), ep(2, "depth2", 0.5), broken]
    report = summarize(episodes, n=2)
    # Avg@2: mean of the six scores; Pass@2: tasks 0 and 2 of 3 have a sample > 0; success: 1 of 6
    # samples is a success (scoring 0.5 is progress, not success)
    assert report["overall"] == {"tasks": 3, "avg": pytest.approx(2.0 / 6), "pass": pytest.approx(2 / 3),
                                 "success": pytest.approx(1 / 6)}
    assert report["categories"]["depth1"] == {"tasks": 2, "avg": 0.25, "pass": 0.5, "success": 0.25}
    assert report["categories"]["depth2"] == {"tasks": 1, "avg": 0.5, "pass": 1.0, "success": 0.0}
    assert report["env_errors"] == 1


def test_env_error_episodes_do_not_shift_their_group_baseline():
    from agentgym_mega.algorithms import compute_advantages
    from agentgym_mega.config import AlgorithmConfig

    # group 0: scores 1, 0 and an env error that scored 0 before it broke; group 1: one valid
    # sample beside an env error, so no baseline at all.
    statuses = ["done", "done", "env_error", "done", "env_error"]
    scores, groups = [1.0, 0.0, 0.0, 1.0, 0.0], [0, 0, 0, 1, 1]
    valid = T([True, True, False, True, False])
    torch.testing.assert_close(rloo_advantages(T(scores), T(groups), valid), T([1.0, -1.0, 0.0, 0.0, 0.0]))
    a = 0.5 / (0.5 ** 0.5 + 1e-6)  # mean 0.5 and unbiased std sqrt(0.5) over the two valid samples
    torch.testing.assert_close(grpo_advantages(T(scores), T(groups), valid), T([a, -a, 0.0, 0.0, 0.0]))
    batch = _batch(scores, groups, [[1.0, 1.0]] * 5, statuses=statuses)
    compute_advantages(batch, AlgorithmConfig(estimator="rloo"))
    torch.testing.assert_close(batch.advantages[:, 0], T([1.0, -1.0, 0.0, 0.0, 0.0]))


def test_ppo_ratio_is_clamped_so_one_token_cannot_make_the_loss_infinite():
    from agentgym_mega.algorithms.losses import LOG_RATIO_CLAMP, clipped_surrogate

    # a token whose probability rose by e^1000 with a negative advantage: the unclipped branch
    # would be -A * inf
    logp, old = T([0.0, -0.1]), T([-1000.0, -0.1])
    loss, _ = clipped_surrogate(logp, old, T([-1.0, 1.0]))
    assert torch.isfinite(loss).all()
    torch.testing.assert_close(loss[0], torch.exp(T(LOG_RATIO_CLAMP)))
    torch.testing.assert_close(loss[1], T(-1.0))
    logp = logp.clone().requires_grad_(True)
    clipped_surrogate(logp, old, T([-1.0, 1.0]))[0].sum().backward()
    assert torch.isfinite(logp.grad).all()
