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
from agentgym_mega.algorithms.horizon import turn_cap
from agentgym_mega.algorithms.losses import (
    actor_loss,
    aggregate_parts,
    critic_loss,
    kl_penalty,
    masked_mean,
    masked_whiten,
    truncated_importance_weights,
)

__all__ = [
    "actor_loss", "aggregate_parts", "compute_advantages", "critic_loss", "gae", "grpo_advantages", "kl_penalty",
    "masked_mean", "masked_whiten", "reinforce_pp_advantages", "rloo_advantages",
    "truncated_importance_weights", "turn_cap",
]
