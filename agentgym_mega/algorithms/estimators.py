"""From a rollout batch to per-token advantages and returns, for the configured estimator."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from agentgym_mega.algorithms.advantages import gae, grpo_advantages, reinforce_pp_advantages, rloo_advantages
from agentgym_mega.algorithms.losses import kl_penalty

if TYPE_CHECKING:
    from agentgym_mega.config import AlgorithmConfig


def token_rewards(batch, cfg: AlgorithmConfig) -> torch.Tensor:
    """The terminal rewards, minus the KL penalty per token when KL is part of the reward (the
    token-level estimators only: config validation refuses `kl_in=reward` for grpo and rloo,
    whose advantage is one number per episode)."""
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
    else:
        # Outcome estimators: one advantage per episode, on every token the policy produced.
        # Episodes that ended on an env error neither get an advantage nor shift their group's baseline.
        estimator = grpo_advantages if cfg.estimator == "grpo" else rloo_advantages
        per_episode = estimator(batch.scores, batch.group_ids, batch.valid)
        batch.advantages = per_episode[:, None] * mask
        batch.returns = batch.advantages
    return batch
