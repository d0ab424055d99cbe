"""The policy on megatron-core: per-token log-probs and entropy of given tokens, the policy
update, and (``trainable=False``) the frozen reference policy.

Log-probs use megatron's vocab-parallel cross entropy on the TP-sharded logits, and the entropy
the same sharded reduction: the full vocabulary is never gathered on one rank.
Token convention (the batch record's): ``logprobs[:, t] = log p(input_ids[:, t] | input_ids[:, :t])``
for ``t >= 1``; position 0 has no prediction and holds 0.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from agentgym_mega.models.worker import ModelWorker

# Padded vocabulary rows are not tokens: their logits are pushed to a value whose exp is 0 but
# which stays finite, so entropy terms p * logit are 0 rather than NaN.
_PADDED_LOGIT = -1e9

# (logprobs [b, T], entropy [b, T], micro-batch) -> (loss total, count, {metric: total}); the
# step's loss is the ratio of the totals and counts over all micro-batches and DP ranks.
PolicyLossFn = Callable[[torch.Tensor, torch.Tensor, dict], tuple[torch.Tensor, torch.Tensor, dict]]


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the vocabulary split across TP ranks; differentiable."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    top = logits.detach().max(dim=-1, keepdim=True).values
    torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX,
                                 group=parallel_state.get_tensor_model_parallel_group())
    shifted = logits - top
    exp = shifted.exp()
    z = reduce_from_tensor_model_parallel_region(exp.sum(-1))
    weighted = reduce_from_tensor_model_parallel_region((exp * shifted).sum(-1))
    return z.log() - weighted / z  # -sum p log p with log p = shifted - log z


def token_logprobs_and_entropy(logits: torch.Tensor, input_ids: torch.Tensor, vocab: int,
                               temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits``: this TP rank's ``[b, T, V_padded / tp]`` shard. Returns ``[b, T]`` log-probs of
    ``input_ids`` and entropies, aligned as the module docstring says."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    shard = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * shard
    padded = torch.arange(start, start + shard, device=logits.device) >= vocab
    scaled = (logits.float() / temperature).masked_fill(padded, _PADDED_LOGIT)[:, :-1]
    # megatron's cross entropy works in place on its input, which the entropy still needs.
    logp = -vocab_parallel_cross_entropy(scaled.clone(), input_ids[:, 1:])
    entropy = vocab_parallel_entropy(scaled)
    return F.pad(logp, (1, 0)), F.pad(entropy, (1, 0))


class MegatronActor(ModelWorker):
    """``MegatronActor(hf_dir, cfg)`` trains; ``MegatronActor(hf_dir, cfg, trainable=False)`` is
    the frozen reference policy. Every method is collective over the trainer's ranks."""

    def __init__(self, hf_dir: str, cfg, *, trainable: bool = True, load_weights: bool = True):
        super().__init__(hf_dir, cfg, trainable=trainable, load_weights=load_weights)

    def full_logits(self, input_ids: torch.Tensor, micro_batch_size: int | None = None) -> torch.Tensor:
        """``[B, T, vocab]`` logits gathered over TP, padding dropped: for parity checks and the
        conversion tools only (training never gathers the vocabulary)."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        vocab = self.hf_config.vocab_size

        def head(logits, mb):
            return logits.sum() * 0, {"logits": gather_from_tensor_model_parallel_region(logits)[..., :vocab]}

        return self.infer({"input_ids": input_ids}, head, ("logits",), micro_batch_size)["logits"]

    def logprobs(self, input_ids: torch.Tensor, temperature: float = 1.0, micro_batch_size: int | None = None,
                 attention_mask: torch.Tensor | None = None) -> dict:
        """``{"logprobs": [B, T], "entropy": [B, T]}`` for ``input_ids [B, T]`` (with an
        ``attention_mask``, micro-batches are only as wide as their sequences)."""
        vocab = self.hf_config.vocab_size

        def head(logits, mb):
            with torch.no_grad():
                logp, ent = token_logprobs_and_entropy(logits, mb["input_ids"], vocab, temperature)
            return logp.sum() * 0, {"logprobs": logp, "entropy": ent}

        batch = {"input_ids": input_ids} | ({} if attention_mask is None else {"attention_mask": attention_mask})
        return self.infer(batch, head, ("logprobs", "entropy"), micro_batch_size)

    def update(self, batch: dict, loss_fn: PolicyLossFn, temperature: float = 1.0,
               micro_batch_size: int | None = None) -> dict:
        """One optimizer step: ``loss_fn`` gets the differentiable log-probs and entropy of each
        micro-batch of this DP rank's slice of ``batch`` (which holds ``input_ids`` and whatever
        the loss needs)."""
        vocab = self.hf_config.vocab_size

        def head(logits, mb):
            logp, ent = token_logprobs_and_entropy(logits, mb["input_ids"], vocab, temperature)
            return loss_fn(logp, ent, mb)

        return self.train_step(batch, head, micro_batch_size)
