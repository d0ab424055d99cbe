"""From a rollout batch to per-token advantages and returns, for the configured estimator."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from agentgym_mega.algorithms.advantages import (
    STATE_KEYS,
    gae,
    gigpo_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    turn_index,
)
from agentgym_mega.algorithms.losses import kl_penalty
from agentgym_mega.rollout.status import Status

if TYPE_CHECKING:
    from agentgym_mega.config import AlgorithmConfig


def token_rewards(batch, cfg: AlgorithmConfig) -> torch.Tensor:
    """The terminal rewards, minus the KL penalty per token when KL is part of the reward (the
    token-level estimators only: config validation refuses `kl_in=reward` for grpo, rloo and
    gigpo, whose advantage is one number per episode or turn)."""
    rewards = batch.rewards
    if cfg.kl_in == "reward" and cfg.kl_coef > 0:
        kl = kl_penalty(batch.old_logprobs, batch.ref_logprobs, cfg.kl_type) * batch.loss_mask
        rewards = rewards - cfg.kl_coef * kl
    return rewards


def compute_advantages(batch, cfg: AlgorithmConfig):
    """Fills batch.advantages and batch.returns ([B, T], zero off the loss mask)."""
    mask = batch.loss_mask
    if cfg.estimator == "gae":
        batch.advantages, batch.returns = gae(token_rewards(batch, cfg), batch.values, mask, cfg.gamma, cfg.lam)
    elif cfg.estimator == "reinforce_pp":
        batch.advantages = reinforce_pp_advantages(token_rewards(batch, cfg), mask, cfg.gamma)
        batch.returns = batch.advantages
    elif cfg.estimator == "gigpo":
        index, runs = turn_index(mask)
        states, rewards = _turn_states_and_rewards(batch, runs, STATE_KEYS[cfg.gigpo_state_key])
        per_turn = gigpo_advantages(batch.scores, batch.group_ids, batch.valid, states, rewards, cfg.gamma,
                                    cfg.gigpo_step_weight)
        # Padding the turn axis keeps gather's index in range on rows with no turns at all.
        per_turn = torch.nn.functional.pad(per_turn, (0, 1))
        batch.advantages = per_turn.gather(1, index.clamp_min(0)) * mask
        batch.returns = batch.advantages
    else:
        # Outcome estimators: one advantage per episode, on every token the policy produced.
        # Episodes that ended on an env error neither get an advantage nor shift their group's baseline.
        estimator = grpo_advantages if cfg.estimator == "grpo" else rloo_advantages
        per_episode = estimator(batch.scores, batch.group_ids, batch.valid)
        batch.advantages = per_episode[:, None] * mask
        batch.returns = batch.advantages
    return batch


def _turn_states_and_rewards(batch, runs: list[list[int]], key) -> tuple[list[list], list[list[float]]]:
    """Per valid episode, the keyed state each turn acted on (the first observation, then the
    previous turn's) and each turn's env reward, read from its transcript and checked against the
    loss mask's runs (`runs`: each row's run lengths); invalid episodes get [] for both."""
    states, rewards = [], []
    for i, (episode, lengths) in enumerate(zip(batch.episodes, runs)):
        if not episode.trained:
            states.append([])
            rewards.append([])
            continue
        where = f"algorithm.estimator=gigpo: episode {i} (task {episode.task_id}, status {episode.status})"
        if episode.transcript is None:
            raise ValueError(f"{where} has no transcript, and gigpo keys its steps by the observations in it; "
                             "a batch saved by a version that kept none can train with grpo, not gigpo")
        turns = episode.transcript["turns"]
        _check_runs(where, lengths, [turn["tokens"] for turn in turns], episode.status == Status.TRUNCATED)
        seen = [episode.transcript["observation"]] + [turn["observation"] for turn in turns]
        states.append([key(text) for text in seen[: len(turns)]])
        rewards.append([float(turn["reward"]) for turn in turns])
    return states, rewards


def _check_runs(where: str, lengths: list[int], tokens: list[int], truncated: bool) -> None:
    """One run of sampled tokens per turn, as long as the transcript says; the context limit may
    cut a truncated episode's last run short (or off)."""
    fits = len(lengths) == len(tokens) or (truncated and len(lengths) < len(tokens))
    if fits:
        last = len(lengths) - 1
        fits = all(n == tokens[t] or (truncated and t == last and 0 < n < tokens[t]) for t, n in enumerate(lengths))
    if not fits:
        raise ValueError(f"{where}: its loss mask has runs of {lengths} sampled tokens, its transcript "
                         f"{len(tokens)} turns of {tokens} tokens; every turn should be one run")
