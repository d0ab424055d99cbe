"""Advantage estimators. Observation tokens (mask 0) are skipped: each assistant token's
successor is the next assistant token, so environment text never enters the credit chain."""

from __future__ import annotations

import re
from typing import Callable

import torch

from agentgym_mega.algorithms.losses import masked_whiten


def _discounted_over_mask(deltas, mask, discount):
    """out[t] = deltas[t] + discount * out[next masked-in t'], walking right to left and
    leaving masked-out positions at 0 without breaking the chain."""
    out = torch.zeros_like(deltas)
    running = torch.zeros_like(deltas[:, 0])
    for t in reversed(range(deltas.shape[1])):
        on = mask[:, t].bool()
        running = torch.where(on, deltas[:, t] + discount * running, running)
        out[:, t] = torch.where(on, running, torch.zeros_like(running))
    return out


def gae(rewards, values, mask, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over assistant tokens. Returns (advantages, returns),
    returns = advantages + values on masked-in tokens, 0 elsewhere."""
    mask = mask.to(values.dtype)
    # V of each token's successor: the next masked-in token's value (0 after the last one).
    next_values = torch.zeros_like(values)
    following = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        next_values[:, t] = following
        following = torch.where(mask[:, t].bool(), values[:, t], following)
    deltas = rewards + gamma * next_values - values
    advantages = _discounted_over_mask(deltas, mask, gamma * lam)
    return advantages, (advantages + values) * mask


def reinforce_pp_advantages(rewards, mask, gamma: float, eps: float = 1e-8) -> torch.Tensor:
    """REINFORCE++: discounted return-to-go over assistant tokens, whitened over the batch."""
    returns = _discounted_over_mask(rewards, mask, gamma)
    return masked_whiten(returns, mask, eps)


def _group_stats(scores, group_ids, valid=None):
    """Per-element group sum, count and unbiased std (0 for groups of one) over the `valid`
    elements only (default: all); an invalid element still gets its group's statistics."""
    valid = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid.bool()
    weight = valid.to(scores.dtype)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    groups = int(inverse.max()) + 1 if len(inverse) else 0
    count = torch.zeros(groups, dtype=scores.dtype).index_add_(0, inverse, weight)
    total = torch.zeros(groups, dtype=scores.dtype).index_add_(0, inverse, scores * weight)
    mean = total / count.clamp_min(1.0)
    sq = torch.zeros(groups, dtype=scores.dtype).index_add_(0, inverse, (scores - mean[inverse]) ** 2 * weight)
    std = torch.sqrt(sq / (count - 1).clamp_min(1.0))
    return total[inverse], count[inverse], std[inverse]


def grpo_advantages(scores, group_ids, valid=None, norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: score minus its group's mean, divided by the group's (unbiased) std + eps.
    Only `valid` samples (default: all) enter the group statistics and get an advantage: an
    episode that ended on an environment error says nothing about the policy. A group with one
    valid sample has no baseline and gets advantage 0."""
    total, count, std = _group_stats(scores, group_ids, valid)
    centred = scores - total / count.clamp_min(1.0)
    advantages = centred / (std + eps) if norm_by_std else centred
    return torch.where(_has_baseline(count, valid), advantages, torch.zeros_like(advantages))


def rloo_advantages(scores, group_ids, valid=None) -> torch.Tensor:
    """RLOO: score minus the mean of the other valid samples of its group (0 for a group with one
    valid sample, and for invalid samples, as in :func:`grpo_advantages`)."""
    total, count, _ = _group_stats(scores, group_ids, valid)
    leave_one_out = (total - scores) / (count - 1).clamp_min(1.0)
    return torch.where(_has_baseline(count, valid), scores - leave_one_out, torch.zeros_like(scores))


def _has_baseline(count, valid) -> torch.Tensor:
    ok = count > 1
    return ok if valid is None else ok & valid.bool()


# GiGPO's anchor-state keys, by the name algorithm.gigpo_state_key gives: how the observation a
# turn acted on becomes the state it is grouped by. Envs whose text carries noise (reflowed
# whitespace, step counters) need a looser key, or no two episodes ever share a state.
STATE_KEYS: dict[str, Callable[[str], str]] = {
    "exact": lambda text: text,
    "whitespace": lambda text: " ".join(text.split()),
    "digits": lambda text: re.sub(r"\d+", "#", " ".join(text.split())),
}


def discounted_returns(rewards: list[float], gamma: float) -> list[float]:
    """Each step's discounted return: its reward plus gamma times the next step's return."""
    out, running = [], 0.0
    for reward in reversed(rewards):
        running = reward + gamma * running
        out.append(running)
    return out[::-1]


def gigpo_advantages(scores, group_ids, valid, states: list[list], rewards: list[list[float]], gamma: float,
                     step_weight: float, eps: float = 1e-6) -> torch.Tensor:
    """GiGPO (arXiv 2505.10978): [B, max turns] advantages, 0 past an episode's turns. Turn t of
    episode i gets the episode's GRPO advantage plus `step_weight` times its step advantage: its
    discounted return (from `rewards[i]`, the per-turn rewards) relative to the returns of every
    step of the same group that acted on the same anchor state `states[i][t]` (a hashable key),
    normalised as GRPO does (mean off, over unbiased std + eps). A state revisited within an
    episode is one step per visit; a state seen once in its group has no baseline: step
    advantage 0. Invalid episodes get 0 and enter no statistics."""
    valid = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid.bool()
    episode = grpo_advantages(scores, group_ids, valid, eps=eps)
    rows, cols, anchors, returns = [], [], [], []
    anchor_ids: dict[tuple, int] = {}
    for i in torch.nonzero(valid).flatten().tolist():
        for t, (state, ret) in enumerate(zip(states[i], discounted_returns(rewards[i], gamma), strict=True)):
            rows.append(i)
            cols.append(t)
            returns.append(ret)
            anchors.append(anchor_ids.setdefault((int(group_ids[i]), state), len(anchor_ids)))
    step = grpo_advantages(torch.tensor(returns, dtype=scores.dtype), torch.tensor(anchors, dtype=torch.long), eps=eps)
    out = torch.zeros(len(states), max((len(s) for s in states), default=0), dtype=scores.dtype)
    out[rows, cols] = episode[rows] + step_weight * step
    return out


def turn_index(mask) -> tuple[torch.Tensor, list[list[int]]]:
    """Each turn's sampled tokens are one contiguous run of the loss mask: per token, the index
    of its run (-1 off the mask), and each row's run lengths."""
    on = mask.bool()
    starts = on & ~torch.nn.functional.pad(on[:, :-1], (1, 0), value=False)
    index = torch.where(on, starts.long().cumsum(1) - 1, torch.full_like(mask, -1, dtype=torch.long))
    return index, [torch.bincount(row[row >= 0]).tolist() for row in index]
