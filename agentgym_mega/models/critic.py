"""The critic on megatron-core: the policy's backbone with a scalar value head in place of the
LM head, initialised from the actor's Hugging Face weights (the head starts at zero).

Alignment (the one place it is decided): ``values[:, t]`` is the value of the state in which token
``t`` is chosen, i.e. after reading ``input_ids[:, :t]``. The head's output at position ``t - 1``
has read exactly that, so values are the head's outputs shifted right by one, position 0 holding
0 (nothing is chosen there: it is always prompt). This is the actor's convention too
(``logprobs[:, t] = log p(x_t | x_<t)``), so GAE pairs each token's log-prob, advantage and value
on the same index, and the critic's loss trains the same shifted values towards the returns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from agentgym_mega.models.shard import ModelShard

if TYPE_CHECKING:
    from agentgym_mega.config import Config

# (values [b, T], micro-batch) -> (loss total, count, {metric: total}), as for the actor
ValueLossFn = Callable[[torch.Tensor, dict], tuple[torch.Tensor, torch.Tensor, dict]]


def state_values(head_out: torch.Tensor) -> torch.Tensor:
    """``[b, T, 1]`` value-head outputs -> ``[b, T]`` values of the state each token is chosen in."""
    return F.pad(head_out.squeeze(-1).float()[:, :-1], (1, 0))


class MegatronCritic(ModelShard):
    def __init__(self, hf_dir: str, cfg: Config):
        super().__init__(hf_dir, cfg, trainable=True, value_head=True)

    def values(self, input_ids: torch.Tensor, micro_batch_size: int | None = None,
               attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        def head(out, mb):
            values = state_values(out)
            return values.sum() * 0, {"values": values}

        batch = {"input_ids": input_ids} | ({} if attention_mask is None else {"attention_mask": attention_mask})
        return self.infer(batch, head, ("values",), micro_batch_size)["values"]

    def update(self, batch: dict, loss_fn: ValueLossFn, micro_batch_size: int | None = None) -> dict:
        return self.train_step(batch, lambda out, mb: loss_fn(state_values(out), mb), micro_batch_size)
