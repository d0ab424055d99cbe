"""GiGPO (algorithm.estimator=gigpo) against hand-computed values: the pure function, the token
mapping through the loss mask, its clear errors, and its config checks."""

import typing

import pytest
import torch

from agentgym_mega.algorithms.advantages import STATE_KEYS, discounted_returns, gigpo_advantages
from agentgym_mega.config import AlgorithmConfig, ConfigError, load_config
from agentgym_mega.rollout.batch import Episode, TrajectoryBatch
from agentgym_mega.rollout.status import Status

EPS = 1e-6  # the eps in every std denominator, as grpo's


def T(x):
    return torch.tensor(x, dtype=torch.float32)


def test_discounted_returns_by_hand():
    # t2: 1; t1: 0.5 + 0.5 * 1 = 1.0; t0: 0 + 0.5 * 1.0 = 0.5
    assert discounted_returns([0.0, 0.5, 1.0], 0.5) == [0.5, 1.0, 1.0]


def test_gigpo_two_groups_shared_unshared_and_revisited_states_by_hand():
    # Group 0: e0, e1, e2 and e3 (an env error); group 1: e4, e5. gamma 0.5, w 1.
    states = [["A", "B"], ["A", "C", "B"], ["A", "B", "B"], ["A", "B"], ["A", "D"], ["A"]]
    rewards = [[0, 1], [0, 0, 1], [0, 0.5, 0], [0, 1], [0, 1], [0]]
    scores, groups = T([1, 1, 0, 1, 1, 0]), torch.tensor([0, 0, 0, 0, 1, 1])
    valid = torch.tensor([True, True, True, False, True, True])
    got = gigpo_advantages(scores, groups, valid, states, rewards, gamma=0.5, step_weight=1.0)
    # Returns (gamma 0.5): e0 [0.5, 1]; e1 [0.25, 0.5, 1]; e2 [0.25, 0.5, 0]; e4 [0.5, 1]; e5 [0].
    # Episode level, group 0 scores 1, 1, 0 (e3 left out): mean 2/3, unbiased std sqrt(1/3).
    s0 = (1 / 3) ** 0.5
    win0, lose0 = (1 / 3) / (s0 + EPS), (-2 / 3) / (s0 + EPS)
    # group 1 scores 1, 0: mean 0.5, std sqrt(0.5).
    win1 = 0.5 / (0.5 ** 0.5 + EPS)
    # Anchor (0, A): returns 0.5, 0.25, 0.25: mean 1/3, squares 1/36 + 2/144 = 1/24, var 1/48.
    sa = (1 / 48) ** 0.5
    a_e0, a_other = (1 / 6) / (sa + EPS), (-1 / 12) / (sa + EPS)
    # Anchor (0, B), e2 visiting it twice: returns 1 (e0), 1 (e1), 0.5 and 0 (e2): mean 0.625,
    # squares 2 * 0.375^2 + 0.125^2 + 0.625^2 = 0.6875, var 0.6875 / 3.
    sb = (0.6875 / 3) ** 0.5
    b_hi, b_mid, b_lo = 0.375 / (sb + EPS), -0.125 / (sb + EPS), -0.625 / (sb + EPS)
    # (0, C) and (1, D): seen once, step advantage 0. (1, A): returns 0.5, 0: +-0.25 / sqrt(0.125).
    a1 = 0.25 / (0.125 ** 0.5 + EPS)
    expected = T([
        [win0 + a_e0, win0 + b_hi, 0.0],
        [win0 + a_other, win0 + 0.0, win0 + b_hi],
        [lose0 + a_other, lose0 + b_mid, lose0 + b_lo],
        [0.0, 0.0, 0.0],  # the env error: nothing, and it shifted no baseline above
        [win1 + a1, win1 + 0.0, 0.0],
        [-win1 - a1, 0.0, 0.0],
    ])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_gigpo_step_weight_scales_only_the_step_part():
    # One group of two episodes sharing both states, rewards at the end, gamma 1: the step returns
    # equal the scores, so the step advantages equal the episode ones and w = 0.5 gives 1.5 times.
    states, rewards = [["A", "B"], ["A", "B"]], [[0, 1], [0, 0]]
    got = gigpo_advantages(T([1, 0]), torch.tensor([7, 7]), None, states, rewards, gamma=1.0, step_weight=0.5)
    a = 0.5 / (0.5 ** 0.5 + EPS)
    torch.testing.assert_close(got, T([[1.5 * a, 1.5 * a], [-1.5 * a, -1.5 * a]]), rtol=1e-5, atol=1e-6)


def _episode(group, score, turns, status=Status.DONE, first="s0"):
    """An episode whose turn t has turns[t] = (tokens, observation after it, reward)."""
    transcript = {"observation": first, "turns": [
        {"text": "x", "tokens": n, "observation": obs, "reward": r} for n, obs, r in turns]}
    return Episode(0, "", group, score, score > 0, len(turns), status, sum(n for n, _, _ in turns),
                   transcript=transcript)


def _batch(episodes, mask):
    mask = T(mask)
    return TrajectoryBatch(
        input_ids=torch.zeros_like(mask, dtype=torch.long), attention_mask=torch.ones_like(mask), loss_mask=mask,
        rollout_logprobs=torch.zeros_like(mask), rewards=torch.zeros_like(mask),
        group_ids=torch.tensor([e.group_id for e in episodes]), scores=T([e.score for e in episodes]),
        episodes=episodes)


def _two_turn_batch(extra_env_error=True):
    # e0: turns of 2 and 3 tokens; e1: truncated, its second turn's 3 tokens cut to 2 by the
    # context limit; e2: an env error without a transcript (ignored, not an error).
    episodes = [_episode(0, 1.0, [(2, "s1", 0.0), (3, "end", 1.0)]),
                _episode(0, 0.0, [(2, "s1  ", 0.0), (3, None, 0.0)], status=Status.TRUNCATED)]
    mask = [[0, 0, 1, 1, 0, 0, 1, 1, 1, 0],
            [0, 0, 1, 1, 0, 0, 0, 0, 1, 1]]
    if extra_env_error:
        episodes.append(Episode(0, "", 0, 0.0, False, 1, Status.ENV_ERROR, 2))
        mask.append([0, 1, 1, 0, 0, 0, 0, 0, 0, 0])
    return _batch(episodes, mask)


def test_gigpo_estimator_maps_turn_advantages_onto_their_tokens():
    from agentgym_mega.algorithms import compute_advantages

    a = 0.5 / (0.5 ** 0.5 + EPS)  # scores 1, 0 (the env error left out): +-a; returns (gamma 1) alike
    batch = compute_advantages(_two_turn_batch(), AlgorithmConfig(estimator="gigpo", gamma=1.0))
    # exact keys: turn 0 shares "s0" (step +-a); "s1" and "s1  " differ: singletons, step 0.
    torch.testing.assert_close(batch.advantages, T([
        [0, 0, 2 * a, 2 * a, 0, 0, a, a, a, 0],
        [0, 0, -2 * a, -2 * a, 0, 0, 0, 0, -a, -a],
        [0] * 10,
    ]), rtol=1e-5, atol=1e-6)
    assert torch.equal(batch.returns, batch.advantages)
    # the whitespace key makes "s1" and "s1  " one state: turn 1 gets its step +-a too.
    batch = compute_advantages(_two_turn_batch(), AlgorithmConfig(estimator="gigpo", gigpo_state_key="whitespace"))
    torch.testing.assert_close(batch.advantages[:2, 6:], T([[2 * a] * 3 + [0], [0, 0, -2 * a, -2 * a]]),
                               rtol=1e-5, atol=1e-6)


def test_gigpo_with_zero_step_weight_is_exactly_grpo():
    from agentgym_mega.algorithms import compute_advantages

    gigpo = compute_advantages(_two_turn_batch(), AlgorithmConfig(estimator="gigpo", gigpo_step_weight=0.0))
    grpo = compute_advantages(_two_turn_batch(), AlgorithmConfig(estimator="grpo"))
    assert torch.equal(gigpo.advantages, grpo.advantages)


def test_gigpo_state_keys_normalise_noise():
    assert STATE_KEYS["exact"]("a  b\n") == "a  b\n"
    assert STATE_KEYS["whitespace"](" a \n b ") == "a b"
    assert STATE_KEYS["digits"]("step 12:  go 3") == STATE_KEYS["digits"]("step 7: go 40") == "step #: go #"
    # the config's names are the registry's, one list of names
    assert set(typing.get_args(typing.get_type_hints(AlgorithmConfig)["gigpo_state_key"])) == set(STATE_KEYS)


def test_gigpo_without_a_transcript_names_the_estimator():
    from agentgym_mega.algorithms import compute_advantages

    batch = _two_turn_batch(extra_env_error=False)
    batch.episodes[1].transcript = None  # as a batch saved by an older version reads back
    with pytest.raises(ValueError, match=r"algorithm.estimator=gigpo: episode 1 .* no transcript"):
        compute_advantages(batch, AlgorithmConfig(estimator="gigpo"))


@pytest.mark.parametrize("status,row", [
    (Status.DONE, [0, 0, 1, 1, 0, 0, 0, 0, 1, 1]),  # a cut run, but the episode was not truncated
    (Status.TRUNCATED, [0, 0, 1, 1, 1, 0, 0, 0, 1, 1]),  # a run longer than its turn
    (Status.TRUNCATED, [0, 1, 0, 1, 1, 0, 0, 0, 1, 1]),  # three runs for two turns
])
def test_gigpo_loss_mask_that_disagrees_with_the_transcript_is_an_error(status, row):
    from agentgym_mega.algorithms import compute_advantages

    batch = _two_turn_batch(extra_env_error=False)
    batch.episodes[1].status = status
    batch.loss_mask[1] = T(row)
    with pytest.raises(ValueError, match=r"algorithm.estimator=gigpo: episode 1 .*every turn should be one run"):
        compute_advantages(batch, AlgorithmConfig(estimator="gigpo"))


@pytest.mark.parametrize("overrides,expected", [
    (["algorithm.estimator=gigpo", "rollout.n_per_task=1"], ["rollout.n_per_task", "algorithm.estimator=gigpo"]),
    (["algorithm.estimator=gigpo", "algorithm.kl_in=reward"], ["algorithm.kl_in", "estimator=gigpo", "or turn"]),
    (["algorithm.gigpo_step_weight=-1"], ["algorithm.gigpo_step_weight", ">= 0"]),
    (["algorithm.gigpo_state_key=fuzzy"], ["algorithm.gigpo_state_key", "'whitespace'", "'fuzzy'"]),
])
def test_gigpo_config_errors_name_the_key(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    for text in expected:
        assert text in str(err.value)


def test_gigpo_config_accepts_its_knobs():
    cfg = load_config(None, ["algorithm.estimator=gigpo", "algorithm.gigpo_step_weight=0.5",
                             "algorithm.gigpo_state_key=digits", "algorithm.gamma=0.95"]).algorithm
    assert (cfg.estimator, cfg.gigpo_step_weight, cfg.gigpo_state_key, cfg.gamma) == ("gigpo", 0.5, "digits", 0.95)
