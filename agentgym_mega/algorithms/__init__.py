"""The RL math as pure tensor functions: advantages, KL, losses, and the horizon schedule.

Shapes: token tensors are [batch, tokens]; `mask` is the loss mask (1 on assistant tokens and
their end-of-turn token, 0 on prompts, observations and padding); per-episode `scores` and
`group_ids` are [batch].
"""

from agentgym_mega.algorithms.advantages import (
    gae,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from agentgym_mega.algorithms.estimators import compute_advantages
from agentgym_mega.algorithms.horizon import horizon_cap
from agentgym_mega.algorithms.losses import (
    actor_loss,
    aggregate,
    aggregate_parts,
    critic_loss,
    entropy_bonus,
    kl_penalty,
    masked_mean,
    masked_whiten,
    policy_loss,
    value_loss,
)

__all__ = [
    "actor_loss", "aggregate", "aggregate_parts", "compute_advantages", "critic_loss", "entropy_bonus", "gae", "grpo_advantages", "horizon_cap", "kl_penalty",
    "masked_mean", "masked_whiten", "policy_loss", "reinforce_pp_advantages", "rloo_advantages",
    "value_loss",
]
