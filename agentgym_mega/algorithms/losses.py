"""Loss terms and the masked reductions they share."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from agentgym_mega.config import AlgorithmConfig

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
LOG_RATIO_CLAMP = 20.0


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp_min(1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp_min(1.0)


def truncated_importance_weights(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
                                 cap: float) -> torch.Tensor:
    """min(p / p_behaviour, cap) per token, 0 off the mask: truncated importance sampling (verl's
    rollout correction), weighting each token's policy-gradient term by how much likelier the
    trainer's policy finds the token than the engine that sampled it did, never more than `cap`."""
    return torch.exp((logprobs - behaviour_logprobs).clamp(max=math.log(cap))) * mask.to(logprobs.dtype)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked-in entries; masked-out entries become 0."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask.to(x.dtype)


def aggregate_parts(loss: torch.Tensor, mask: torch.Tensor, agg: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduces a [batch, tokens] loss to (total, count), the aggregate being ``total / count``:
    `token-mean` weighs every token alike, `seq-mean-token-sum` sums each sequence then averages
    sequences, `seq-mean-token-mean` averages within each sequence first (every sequence weighs
    the same). Both parts add up over any split of the batch along sequences (micro-batches, DP
    ranks), so the parts of slices give the whole batch's aggregate. The count is trained tokens
    for `token-mean` and sequences with trained tokens for the `seq-mean-*` aggregations."""
    mask = mask.to(loss.dtype)
    if agg == "token-mean":
        return (loss * mask).sum(), mask.sum()
    tokens = mask.sum(-1)
    if agg == "seq-mean-token-sum":
        per_seq = (loss * mask).sum(-1)
    elif agg == "seq-mean-token-mean":
        per_seq = (loss * mask).sum(-1) / tokens.clamp_min(1.0)
    else:
        raise ValueError(f"loss aggregation {agg!r}: allowed {', '.join(AGGREGATIONS)}")
    return per_seq.sum(), (tokens > 0).to(loss.dtype).sum()  # per_seq is 0 without tokens


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimates from log-probs of the sampled tokens.

    k1: logp - ref_logp (unbiased, high variance); k2: (logp - ref_logp)^2 / 2;
    k3 / low_var_kl: exp(ref - logp) - (ref - logp) - 1 (unbiased, non-negative), with the
    log-ratio clamped to [-20, 20] and the result to [-10, 10] for stability."""
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind in ("k3", "low_var_kl"):
        neg = torch.clamp(-log_ratio, -20.0, 20.0)
        return torch.clamp(torch.exp(neg) - neg - 1.0, -10.0, 10.0)
    raise ValueError(f"kl kind {kind!r}: allowed k1, k2, k3, low_var_kl")


def clipped_surrogate(logp, old_logp, advantages, clip: float = 0.2,
                      dual_clip: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO surrogate loss and where its clipped branch was taken (1.0 / 0.0)."""
    # Clamped as verl does: one token whose probability moved by e^20 or more cannot make the
    # loss (or its gradient) infinite.
    ratio = torch.exp(torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    loss = torch.maximum(unclipped, clipped)
    took_clip = (clipped > unclipped).to(loss.dtype)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        # For negative advantages, bound the loss at -A * c so a huge ratio cannot explode it.
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * dual_clip), loss)
    return loss, took_clip


def clipped_value_error(values, old_values, returns, clip: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss and where the clipped branch was taken (1.0 / 0.0)."""
    clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
    unclipped = (values - returns) ** 2
    clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).to(values.dtype)


def actor_loss(logp: torch.Tensor, entropy: torch.Tensor, batch: dict,
               cfg: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The policy objective of one slice of a batch under `cfg`: clipped
    surrogate, minus the entropy bonus, plus the KL penalty when it is a loss term.
    `batch` holds old_logprobs, advantages, loss_mask and, for the KL term, ref_logprobs.
    Returns (total, count, metric totals) as :func:`aggregate_parts` does, so that slices on
    different DP ranks or micro-batches add up to the whole batch's objective; every metric is
    aggregated like the loss (with token-mean, clip_fraction is the share of clipped tokens)."""
    surrogate, took_clip = clipped_surrogate(logp, batch["old_logprobs"], batch["advantages"],
                                             cfg.clip, cfg.dual_clip)
    # Without a bonus the entropy stays out of the graph, so the head skips its gradient terms.
    per_token = surrogate - cfg.entropy_coef * entropy if cfg.entropy_coef else surrogate
    terms = {"pg_loss": surrogate, "entropy": entropy, "clip_fraction": took_clip}
    if cfg.kl_in == "loss" and cfg.kl_coef > 0:
        kl = kl_penalty(logp, batch["ref_logprobs"], cfg.kl_type)
        per_token = per_token + cfg.kl_coef * kl
        terms["kl"] = kl
    return _totals(per_token, terms, batch["loss_mask"], cfg.loss_agg)


def critic_loss(values: torch.Tensor, batch: dict, cfg: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The clipped value loss of one slice against batch["returns"] (old_values, loss_mask too),
    as (total, count, metric totals) like :func:`actor_loss`."""
    loss, took_clip = clipped_value_error(values, batch["old_values"], batch["returns"], cfg.value_clip)
    return _totals(loss, {"value_clip_fraction": took_clip}, batch["loss_mask"], cfg.loss_agg)


def _totals(loss, terms: dict, mask, agg: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    total, count = aggregate_parts(loss, mask, agg)
    return total, count, {k: aggregate_parts(v.detach(), mask, agg)[0] for k, v in terms.items()}
