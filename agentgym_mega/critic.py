"""The critic on megatron-core: the policy's backbone with a scalar value head in place of the
LM head, initialised from the actor's Hugging Face weights (the head starts at zero).
``values[:, t]`` is the value of the state after reading ``input_ids[:, : t + 1]``."""

from __future__ import annotations

from typing import Callable

import torch

from agentgym_mega.models.worker import ModelWorker

# (values [b, T], micro-batch) -> (loss total, count, {metric: total}), as for the actor
ValueLossFn = Callable[[torch.Tensor, dict], tuple[torch.Tensor, torch.Tensor, dict]]


class MegatronCritic(ModelWorker):
    def __init__(self, hf_dir: str, cfg):
        super().__init__(hf_dir, cfg, trainable=True, value_head=True)

    def values(self, input_ids: torch.Tensor, micro_batch_size: int | None = None) -> torch.Tensor:
        def head(out, mb):
            values = out.squeeze(-1).float()
            return values.sum() * 0, {"values": values}

        return self.infer({"input_ids": input_ids}, head, ("values",), micro_batch_size)["values"]

    def update(self, batch: dict, loss_fn: ValueLossFn, micro_batch_size: int | None = None) -> dict:
        return self.train_step(batch, lambda out, mb: loss_fn(out.squeeze(-1).float(), mb), micro_batch_size)
