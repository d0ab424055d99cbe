"""The RL math against values computed by hand (written out in each test)."""

import math

import pytest
import torch

from agentgym_mega.algorithms import (
    actor_loss,
    aggregate_parts,
    critic_loss,
    gae,
    grpo_advantages,
    kl_penalty,
    reinforce_pp_advantages,
    rloo_advantages,
    truncated_importance_weights,
    turn_cap,
)
from agentgym_mega.algorithms.losses import LOG_RATIO_CLAMP
from agentgym_mega.config import AlgorithmConfig, HorizonConfig

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


# The loss tests call actor_loss / critic_loss as training does: a batch dict and an
# AlgorithmConfig, checking (total, count) and the metric totals. Hand values are written to 6
# decimals, so they are compared with atol 1e-5 (rtol 1e-6).
def _close(actual, expected):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=torch.float32), rtol=1e-6, atol=1e-5)


def _actor(logp, old, adv, mask, entropy=None, ref=None, **cfg):
    """actor_loss on a hand-written batch; entropy and KL are off unless `cfg` turns them on."""
    batch = {"old_logprobs": T(old), "advantages": T(adv), "loss_mask": T(mask)}
    if ref is not None:
        batch["ref_logprobs"] = T(ref)
    logp = T(logp)
    entropy = torch.zeros_like(logp) if entropy is None else T(entropy)
    return actor_loss(logp, entropy, batch, AlgorithmConfig(**{"entropy_coef": 0.0, "kl_coef": 0.0, **cfg}))


# (logp, advantages) of one 5-token sequence; with old log-probs 0 each token's ratio is e^logp.
_SURROGATE = ([[0.5, -0.5, 0.0, 1.0, -0.5]], [[1.0, 1.0, -2.0, -1.0, -1.0]])


def test_actor_loss_clipped_surrogate_takes_the_pessimistic_branch():
    logp, adv = _SURROGATE
    total, count, metrics = _actor(logp, [[0.0] * 5], adv, [[1.0] * 5], clip=0.2)
    # t0: ratio e^.5 = 1.648721, A=1:  max(-1.648721, -1.2) = -1.2           clipped
    # t1: ratio e^-.5 = 0.606531, A=1: max(-0.606531, -0.8) = -0.606531      unclipped
    # t2: ratio 1, A=-2:              max(2, 2) = 2                           unclipped
    # t3: ratio e = 2.718282, A=-1:   max(2.718282, 1.2) = 2.718282           unclipped
    # t4: ratio e^-.5, A=-1:          max(0.606531, 0.8) = 0.8                clipped
    # total = -1.2 - 0.606531 + 2 + 2.718282 + 0.8 = 3.711751 over 5 tokens; 2 tokens clipped
    _close(total, 3.711751)
    _close(count, 5.0)
    _close(metrics["pg_loss"], 3.711751)
    _close(metrics["clip_fraction"], 2.0)
    assert "kl" not in metrics


def test_actor_loss_dual_clip_bounds_negative_advantage_tokens():
    logp, adv = _SURROGATE
    total, count, metrics = _actor(logp, [[0.0] * 5], adv, [[1.0] * 5], clip=0.2, dual_clip=2.0)
    # bound -A * 2 on A < 0: t2 min(2, 4) = 2, t3 min(2.718282, 2) = 2, t4 min(0.8, 2) = 0.8
    # total = -1.2 - 0.606531 + 2 + 2 + 0.8 = 2.993469; clip_fraction counts the PPO clip only
    _close(total, 2.993469)
    _close(count, 5.0)
    _close(metrics["clip_fraction"], 2.0)


def test_actor_loss_ignores_masked_tokens():
    # the masked-out token (ratio e^9, A=100) would add -1.2 * 100 if counted
    total, count, _ = _actor([[0.0, 9.0]], [[0.0, 0.0]], [[1.0, 100.0]], [[1.0, 0.0]])
    _close(total, -1.0)  # ratio 1, A=1
    _close(count, 1.0)


@pytest.mark.parametrize("agg,total,count,entropy", [
    # per-token loss -A (ratio 1): rows [1, 2, -], [4, -, -], [-, -, -] (row 2 has no trained tokens)
    ("token-mean", 1 + 2 + 4, 3, 0.5 + 1.5 + 2),              # every token alike
    ("seq-mean-token-sum", (1 + 2) + 4, 2, (0.5 + 1.5) + 2),   # per-row sums over rows with tokens
    ("seq-mean-token-mean", (1 + 2) / 2 + 4, 2, (0.5 + 1.5) / 2 + 2),  # per-row means: 1.5 + 4
])
def test_actor_loss_aggregations(agg, total, count, entropy):
    logp = [[-1.0] * 3] * 3
    adv = [[-1.0, -2.0, -3.0], [-4.0, 0.0, 0.0], [-9.0, -9.0, -9.0]]
    mask = [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    ent = [[0.5, 1.5, 7.0], [2.0, 7.0, 7.0], [7.0, 7.0, 7.0]]  # the 7s are masked out
    got_total, got_count, metrics = _actor(logp, logp, adv, mask, entropy=ent, loss_agg=agg)
    _close(got_total, total)
    _close(got_count, count)
    _close(metrics["entropy"], entropy)  # metrics are aggregated like the loss


def test_aggregate_parts_rejects_an_unknown_aggregation():
    with pytest.raises(ValueError, match="token-mean"):
        aggregate_parts(torch.ones(1, 2), torch.ones(1, 2), "sum")


def test_actor_loss_entropy_term_lowers_the_loss():
    # ratio 1 and A=0: the surrogate is 0, so total = -0.1 * (1 + 3) = -0.4
    total, count, metrics = _actor([[-1.0, -1.0]], [[-1.0, -1.0]], [[0.0, 0.0]], [[1.0, 1.0]],
                                   entropy=[[1.0, 3.0]], entropy_coef=0.1)
    _close(total, -0.4)
    _close(count, 2.0)
    _close(metrics["entropy"], 4.0)


def test_actor_loss_kl_term():
    # ratio 1, A=1: surrogate -1 per token; log-ratio to the reference: 1, 0
    args = ([[-1.0, -2.0]], [[-1.0, -2.0]], [[1.0, 1.0]], [[1.0, 1.0]])
    kw = dict(entropy=[[0.5, 1.5]], ref=[[-2.0, -2.0]], kl_coef=0.1, kl_in="loss")
    total, count, metrics = _actor(*args, **kw, kl_type="k1", entropy_coef=0.01)
    # k1 KL 1 + 0; total = -2 - 0.01 * (0.5 + 1.5) + 0.1 * 1 = -1.92
    _close(total, -1.92)
    _close(count, 2.0)
    _close(metrics["pg_loss"], -2.0)
    _close(metrics["entropy"], 2.0)
    _close(metrics["kl"], 1.0)
    total, _, metrics = _actor(*args, **kw, kl_type="low_var_kl")
    # k3 of log-ratio 1: e^-1 - (-1) - 1 = 0.367879, of 0: 0; total = -2 + 0.1 * 0.367879
    _close(total, -1.963212)
    _close(metrics["kl"], 0.367879)
    total, _, metrics = _actor(*args, **{**kw, "kl_in": "reward"})  # the KL goes into the reward
    _close(total, -2.0)
    assert "kl" not in metrics


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_actor_loss_parts_of_slices_add_up_to_the_whole_batch(agg):
    # What DP slicing and micro-batching rely on: slices of unequal token counts, summed part by
    # part, give the whole batch's objective and metrics.
    g = torch.Generator().manual_seed(0)
    logp, old, ref, adv, ent = (torch.randn(4, 3, generator=g) for _ in range(5))
    mask = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    cfg = AlgorithmConfig(loss_agg=agg, entropy_coef=0.01, kl_coef=0.1, kl_in="loss")

    def run(rows):
        batch = {"old_logprobs": old[rows], "advantages": adv[rows], "loss_mask": mask[rows], "ref_logprobs": ref[rows]}
        return actor_loss(logp[rows], ent[rows], batch, cfg)

    whole_total, whole_count, whole_metrics = run(slice(0, 4))
    parts = [run(slice(0, 2)), run(slice(2, 4))]  # 4 and 2 tokens, 2 and 1 sequences with tokens
    total, count = parts[0][0] + parts[1][0], parts[0][1] + parts[1][1]
    torch.testing.assert_close(total / count, whole_total / whole_count)
    for key, value in whole_metrics.items():
        torch.testing.assert_close(parts[0][2][key] + parts[1][2][key], value)
    # the check can fail: the mean of the slices' means is not the whole batch's mean
    assert not torch.isclose((parts[0][0] / parts[0][1] + parts[1][0] / parts[1][1]) / 2, whole_total / whole_count)


def test_critic_loss_value_clip():
    batch = {"old_values": T([[1.0, 1.0, 1.0, 1.0]]), "returns": T([[2.0, 2.0, 2.0, 2.0]]),
             "loss_mask": T([[1.0, 1.0, 1.0, 0.0]])}
    total, count, metrics = critic_loss(T([[1.5, 1.1, 0.5, 100.0]]), batch, AlgorithmConfig(value_clip=0.2))
    # v=1.5 clipped to 1.2: 0.5 * max(0.25, 0.64) = 0.32                           clipped
    # v=1.1 inside the clip: 0.5 * 0.81 = 0.405                                     unclipped
    # v=0.5 clipped to 0.8, but the unclipped error is larger: 0.5 * max(2.25, 1.44) = 1.125
    # total = 0.32 + 0.405 + 1.125 = 1.85 over 3 tokens (the masked v=100 is left out)
    _close(total, 1.85)
    _close(count, 3.0)
    _close(metrics["value_clip_fraction"], 1.0)


def test_critic_loss_seq_mean_token_mean():
    batch = {"old_values": torch.ones(2, 2), "returns": T([[2.0, 2.0], [1.0, 1.0]]),
             "loss_mask": T([[1.0, 1.0], [1.0, 0.0]])}
    total, count, _ = critic_loss(T([[1.5, 1.1], [1.0, 9.0]]), batch, AlgorithmConfig(loss_agg="seq-mean-token-mean"))
    # row 0: (0.32 + 0.405) / 2 = 0.3625; row 1: v=1 = R -> 0
    _close(total, 0.3625)
    _close(count, 2.0)


@pytest.mark.parametrize("step,cap", [
    (1, 6), (99, 6), (100, 6), (101, 13), (102, 13), (199, 13), (200, 13), (201, 20), (300, 20), (10_000, 20),
])
def test_turn_cap_scaling_inter_at_and_around_boundaries(step, cap):
    horizon = HorizonConfig(schedule="scaling_inter", caps=[6, 13, 20], interval=100)
    assert turn_cap(step, horizon) == cap


def test_turn_cap_fixed_and_invalid_steps():
    assert turn_cap(1, HorizonConfig(schedule="fixed", caps=[20])) == 20
    assert turn_cap(5000, HorizonConfig(schedule="fixed", caps=[20])) == 20
    with pytest.raises(ValueError, match="1-based"):
        turn_cap(0, HorizonConfig())


def _batch(scores, groups, mask, rewards=None, values=None, statuses=None):
    from agentgym_mega.rollout.batch import Episode, TrajectoryBatch
    from agentgym_mega.rollout.status import Status

    mask = T(mask)
    statuses = statuses or [Status.DONE] * len(scores)
    episodes = [Episode(0, "", g, s, s > 0, 1, status, 1) for g, s, status in zip(groups, scores, statuses)]
    return TrajectoryBatch(
        input_ids=torch.zeros_like(mask, dtype=torch.long), attention_mask=torch.ones_like(mask),
        loss_mask=mask, rollout_logprobs=torch.zeros_like(mask),
        rewards=T(rewards) if rewards is not None else torch.zeros_like(mask),
        group_ids=T(groups), scores=T(scores), episodes=episodes,
        values=T(values) if values is not None else None,
    )


def test_outcome_estimators_spread_the_episode_advantage_over_its_tokens():
    from agentgym_mega.algorithms import compute_advantages

    batch = _batch([1.0, 0.0], [0, 0], [[0, 1, 1], [1, 1, 0]])
    compute_advantages(batch, AlgorithmConfig(estimator="rloo"))
    torch.testing.assert_close(batch.advantages, T([[0.0, 1.0, 1.0], [-1.0, -1.0, 0.0]]))
    compute_advantages(batch, AlgorithmConfig(estimator="grpo"))
    a = 0.5 / (0.5 ** 0.5 + 1e-6)  # mean 0.5, unbiased std sqrt(0.5)
    torch.testing.assert_close(batch.advantages, T([[0.0, a, a], [-a, -a, 0.0]]))


def test_gae_estimator_uses_values_and_token_rewards():
    from agentgym_mega.algorithms import compute_advantages

    batch = _batch([1.0], [0], [[1, 0, 1]], rewards=[[0.0, 0.0, 1.0]], values=[[0.5, 9.0, 0.25]])
    compute_advantages(batch, AlgorithmConfig(estimator="gae", gamma=1.0, lam=1.0))
    # t2: 1 - 0.25 = 0.75; t0: 0 + V(t2) - 0.5 = -0.25, plus 0.75 -> 0.5
    torch.testing.assert_close(batch.advantages, T([[0.5, 0.0, 0.75]]))
    torch.testing.assert_close(batch.returns, T([[1.0, 0.0, 1.0]]))


def test_eval_summary_avg_pass_at_n_and_success():
    import dataclasses

    from agentgym_mega.evaluation import summarize, table
    from agentgym_mega.rollout.batch import Episode
    from agentgym_mega.rollout.status import Status

    def ep(task, category, score, valid):  # success as a SciWorld task has it: full score only
        return Episode(task, category, task, score, score == 1.0, 3, Status.DONE, 10, valid_actions=valid)

    broken = dataclasses.replace(ep(1, "depth1", 1.0, 3), status=Status.ENV_ERROR)  # left out of every figure
    episodes = [ep(0, "depth1", 1.0, 3), ep(0, "depth1", 0.0, 0), ep(1, "depth1", 0.0, 1), ep(1, "depth1", 0.0, 2),
                ep(2, "depth2", 0.5, 3), ep(2, "depth2", 0.5, 3), broken]
    report = summarize(episodes, n=2)
    # Avg@2: mean of the six scores; Pass@2: tasks 0 and 2 of 3 have a sample > 0; success: 1 of 6
    # samples is a success (scoring 0.5 is progress, not success); valid: replies parsed as an
    # action over all replies, 12 of 18 (depth1 6 of 12, depth2 6 of 6)
    assert report["overall"] == {"tasks": 3, "avg": pytest.approx(2.0 / 6), "pass": pytest.approx(2 / 3),
                                 "success": pytest.approx(1 / 6), "valid": pytest.approx(2 / 3)}
    assert report["categories"]["depth1"] == {"tasks": 2, "avg": 0.25, "pass": 0.5, "success": 0.25, "valid": 0.5}
    assert report["categories"]["depth2"] == {"tasks": 1, "avg": 0.5, "pass": 1.0, "success": 0.0, "valid": 1.0}
    assert report["env_errors"] == 1
    lines = table(report).splitlines()
    assert lines[0].split()[-1] == "valid"
    assert lines[-1].split() == ["overall", "3", "0.3333", "0.6667", "0.1667", "0.6667"]


def test_env_error_episodes_do_not_shift_their_group_baseline():
    from agentgym_mega.algorithms import compute_advantages
    from agentgym_mega.rollout.status import Status

    # group 0: scores 1, 0 and an env error that scored 0 before it broke; group 1: one valid
    # sample beside an env error, so no baseline at all.
    statuses = [Status.DONE, Status.DONE, Status.ENV_ERROR, Status.DONE, Status.ENV_ERROR]
    scores, groups = [1.0, 0.0, 0.0, 1.0, 0.0], [0, 0, 0, 1, 1]
    valid = T([True, True, False, True, False])
    torch.testing.assert_close(rloo_advantages(T(scores), T(groups), valid), T([1.0, -1.0, 0.0, 0.0, 0.0]))
    a = 0.5 / (0.5 ** 0.5 + 1e-6)  # mean 0.5 and unbiased std sqrt(0.5) over the two valid samples
    torch.testing.assert_close(grpo_advantages(T(scores), T(groups), valid), T([a, -a, 0.0, 0.0, 0.0]))
    batch = _batch(scores, groups, [[1.0, 1.0]] * 5, statuses=statuses)
    compute_advantages(batch, AlgorithmConfig(estimator="rloo"))
    torch.testing.assert_close(batch.advantages[:, 0], T([1.0, -1.0, 0.0, 0.0, 0.0]))


def test_ppo_ratio_is_clamped_so_one_token_cannot_make_the_loss_infinite():
    # a token whose probability rose by e^1000 with a negative advantage: unclamped, its branch
    # would be -A * e^1000 = inf in float32. Clamped: e^LOG_RATIO_CLAMP, plus -1 from the ratio-1
    # token (about 4.9e8 - 1, compared with rtol 1e-6).
    logp = T([[0.0, -0.1]], requires_grad=True)
    batch = {"old_logprobs": T([[-1000.0, -0.1]]), "advantages": T([[-1.0, 1.0]]), "loss_mask": T([[1.0, 1.0]])}
    total, _, _ = actor_loss(logp, torch.zeros(1, 2), batch, AlgorithmConfig(entropy_coef=0.0, kl_coef=0.0))
    torch.testing.assert_close(total, T(math.exp(LOG_RATIO_CLAMP) - 1.0), rtol=1e-6, atol=0.0)
    total.backward()
    assert torch.isfinite(logp.grad).all()


def test_truncated_importance_weights_by_hand():
    # token 1: same log-prob -> 1; token 2: the trainer finds it e^-1 as likely -> 0.3679;
    # token 3: e^0.8 = 2.2255 as likely -> cut to the cap 2; token 4: off the mask -> 0.
    logprobs = T([[-1.0, -2.0, -0.2, -0.5]])
    behaviour = T([[-1.0, -1.0, -1.0, -2.0]])
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    weights = truncated_importance_weights(logprobs, behaviour, mask, cap=2.0)
    assert torch.allclose(weights, T([[1.0, math.exp(-1.0), 2.0, 0.0]]), atol=1e-6)
    # a log-ratio far past the cap stays finite
    assert truncated_importance_weights(T([[0.0]]), T([[-1000.0]]), T([[1.0]]), 5.0).item() == pytest.approx(5.0)


def test_rollout_batch_state_round_trips_and_concat_pads():
    """What a checkpoint keeps of the rollout collected ahead (one step off-policy), read back
    with torch.load(weights_only=True); concat pads ids with the pad id and versions with -1."""
    import io

    from agentgym_mega.rollout.batch import TrajectoryBatch
    from agentgym_mega.rollout.status import Status

    batch = _batch([1.0, 0.0], [0, 0], [[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]], statuses=[Status.DONE, Status.TIMEOUT])
    batch.weight_versions = T([[-1, 3, 3], [-1, 3, -1]])
    buffer = io.BytesIO()
    state = batch.state()
    assert [type(e["status"]) for e in state["episodes"]] == [str, str]  # the saved form: plain strings
    assert [e["status"] for e in state["episodes"]] == ["done", "timeout"]
    torch.save(state, buffer)
    buffer.seek(0)
    again = TrajectoryBatch.from_state(torch.load(buffer, weights_only=True))
    for name in ("input_ids", "loss_mask", "rollout_logprobs", "rewards", "weight_versions", "group_ids", "scores"):
        assert torch.equal(getattr(again, name), getattr(batch, name)), name
    assert again.episodes == batch.episodes and [e.status for e in again.episodes] == [Status.DONE, Status.TIMEOUT]
    assert all(type(e.status) is Status for e in again.episodes)

    narrow = _batch([0.5], [1], [[1.0]])
    narrow.weight_versions = T([[4]])
    narrow.input_ids += 9
    joined = TrajectoryBatch.concat([narrow, batch], pad_id=7)
    assert joined.input_ids.tolist()[0] == [9, 7, 7] and joined.weight_versions.tolist()[0] == [4, -1, -1]
    assert joined.loss_mask.tolist()[0] == [1.0, 0.0, 0.0] and joined.group_ids.tolist() == [1, 0, 0]
    batch.old_logprobs = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="old_logprobs"):
        batch.state()


def test_update_slices_carry_only_what_a_step_reads():
    """What crosses Ray to the ranks for an optimizer step: the typed slice, its unset fields
    left out of the tensors a model shard micro-batches (no KL loss: no ref_logprobs)."""
    batch = _batch([1.0, 0.0], [0, 0], [[0.0, 1.0], [1.0, 1.0]], values=[[0.5, 0.25], [0.0, 1.0]])
    batch.old_logprobs, batch.advantages, batch.returns = torch.zeros(2, 2), torch.ones(2, 2), torch.full((2, 2), 2.0)
    policy = batch.for_policy_update().tensors()
    assert list(policy) == ["input_ids", "loss_mask", "old_logprobs", "advantages", "attention_mask"]
    assert all(policy[name] is getattr(batch, name) for name in policy)
    batch.ref_logprobs = torch.zeros(2, 2)
    assert "ref_logprobs" in batch.for_policy_update().tensors()
    value = batch.for_value_update().tensors()
    assert list(value) == ["input_ids", "loss_mask", "old_values", "returns", "attention_mask"]
    assert value["old_values"] is batch.values and value["returns"] is batch.returns
