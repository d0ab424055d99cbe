"""The policy on megatron-core: per-token log-probs and entropy of given tokens, the policy
update, and (``trainable=False``) the frozen reference policy.

Log-probs and entropy come from one fused head on the TP-sharded logits (reductions over the TP
group, the softmax recomputed in the backward pass): the full vocabulary is never gathered on one
rank, and a micro-batch's logits are held in fp32 once, not once per term.
Token convention (the batch record's): ``logprobs[:, t] = log p(input_ids[:, t] | input_ids[:, :t])``
for ``t >= 1``; position 0 has no prediction and holds 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from agentgym_mega.models.shard import ModelShard

if TYPE_CHECKING:
    from agentgym_mega.config import Config

# Padded vocabulary rows are not tokens: their logits are pushed to a value whose exp is 0 but
# which stays finite, so entropy terms p * logit are 0 rather than NaN.
_PADDED_LOGIT = -1e9

# (logprobs [b, T], entropy [b, T], micro-batch) -> (loss total, count, {metric: total}); the
# step's loss is the ratio of the totals and counts over all micro-batches and DP ranks.
PolicyLossFn = Callable[[torch.Tensor, torch.Tensor, dict], tuple[torch.Tensor, torch.Tensor, dict]]


def _centred(logits, targets, vocab: int, temperature: float, group):
    """The head's first pass over this rank's logits shard ``[..., V / tp]``: ``x - m`` in fp32
    (``x`` the scaled logits, padded vocabulary rows pushed to ``_PADDED_LOGIT``, ``m`` the max
    over the whole vocabulary, reduced over the TP group), and each target's entry of it with the
    target's index in this shard and whether this shard holds it (the entry is 0 where it does
    not). The logits themselves are never written."""
    shard = logits.shape[-1]
    start = torch.distributed.get_rank(group) * shard if group is not None else 0
    x = logits.float()  # the logits themselves when they are fp32 at temperature 1
    if temperature != 1.0:
        x = x / temperature
    if start + shard > vocab:
        x = x.masked_fill(torch.arange(start, start + shard, device=x.device) >= vocab, _PADDED_LOGIT)
    top = x.amax(dim=-1, keepdim=True)  # not max(): finding the indices too is far slower on CPU
    if group is not None:
        torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=group)
    centred = x - top if x is logits else x.sub_(top)
    local = targets - start
    mine = (local >= 0) & (local < shard)
    target = centred.gather(-1, local.clamp(0, shard - 1).unsqueeze(-1)).squeeze(-1) * mine
    return centred, target, local, mine


def _target_logprobs(logits, targets, vocab: int, temperature: float, group) -> torch.Tensor:
    """Log-probs of the targets alone, for passes without a gradient (the old and the reference
    policy's): ``logp = (x - m)[target] - log z``, with ``z = sum exp(x - m)`` exponentiated in
    place. One fp32 copy of the logits shard at the peak, and no pass for the entropy or for
    ``log p`` as a whole, which :class:`_LogprobsAndEntropy` keeps for the backward pass."""
    centred, target, _, _ = _centred(logits, targets, vocab, temperature, group)
    sums = torch.stack([centred.exp_().sum(-1), target])
    del centred
    if group is not None:
        torch.distributed.all_reduce(sums, group=group)
    z, target = sums
    return target - z.log()


class _LogprobsAndEntropy(torch.autograd.Function):
    """Log-probs of the targets and entropies from TP-sharded logits ``[..., V / tp]`` in one pass
    that keeps a single fp32 tensor of the logits' size, ``log p`` itself, for the backward pass
    (megatron's cross entropy plus an autograd entropy kept about three). Peak: two fp32 copies
    of one micro-batch's logits shard, in the forward and the backward pass alike.

    With ``x`` the scaled logits, ``log p = x - m - log z`` over the whole vocabulary (``m`` its
    max, ``z = sum exp(x - m)``, both reduced over the TP group), ``logp = log p[target]`` and
    ``H = -sum p log p = log z - sum exp(x - m) (x - m) / z``; the gradients are
    ``d logp / dx = onehot - p`` and ``dH / dx = -p (log p + H)``."""

    @staticmethod
    def forward(ctx, logits, targets, vocab: int, temperature: float, group):
        ctx.set_materialize_grads(False)  # an output the loss does not use gets no gradient terms
        log_p, target, local, mine = _centred(logits, targets, vocab, temperature, group)  # log p once log z is off
        exp = log_p.exp()
        sums = torch.stack([exp.sum(-1), exp.mul_(log_p).sum(-1), target])
        del exp
        if group is not None:
            torch.distributed.all_reduce(sums, group=group)
        z, weighted, target = sums
        log_z = z.log()
        log_p.sub_(log_z.unsqueeze(-1))
        entropy = log_z - weighted / z
        ctx.save_for_backward(log_p, entropy, local, mine)
        ctx.temperature, ctx.dtype = temperature, logits.dtype
        return target - log_z, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        log_p, entropy, local, mine = ctx.saved_tensors
        if grad_logp is None:
            grad_logp = torch.zeros_like(entropy)
        if grad_entropy is None:  # dL/dx = g_lp (onehot - p), built in log_p's memory
            grad = log_p.exp_().mul_(grad_logp.neg().unsqueeze(-1))
        else:  # dL/dx = g_lp (onehot - p) - g_H p (log p + H), built in log_p's memory
            p = log_p.exp()
            grad = log_p.add_(entropy.unsqueeze(-1)).mul_(grad_entropy.unsqueeze(-1)).add_(grad_logp.unsqueeze(-1))
            grad.mul_(p).neg_()
            del p
        grad.scatter_add_(-1, local.clamp(0, grad.shape[-1] - 1).unsqueeze(-1),
                          (grad_logp * mine).unsqueeze(-1))
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        return grad.to(ctx.dtype), None, None, None, None


def logit_rows(positions: torch.Tensor) -> torch.Tensor:
    """``[b, T]`` positions wanted (nonzero) -> ``[b, T]`` the logit rows that predict them: row
    ``t`` predicts token ``t + 1``. The policy model's ``loss_mask`` keyword."""
    return F.pad(positions[:, 1:], (0, 1))


def token_logprobs_and_entropy(logits: torch.Tensor, input_ids: torch.Tensor, vocab: int,
                               temperature: float = 1.0, positions: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits``: this TP rank's ``[T, b, V_padded / tp]`` shard, in megatron's sequence-first
    order (:func:`agentgym_mega.models.gpt.policy_gpt_model`). Returns ``[b, T]`` log-probs of
    ``input_ids [b, T]`` and entropies, aligned as the module docstring says; differentiable, and
    the full vocabulary is never gathered. ``positions`` (``[b, T]``, nonzero where wanted, e.g.
    a loss mask): only those are computed, the rest hold 0; ``logits`` may then be just the
    ``[n, V_padded / tp]`` rows that predict them (the policy model given
    ``loss_mask=logit_rows(positions)``). Agent episodes are mostly prompt and observation
    tokens, so this spares most of the head's work and its fp32 copies."""
    return _per_token(_LogprobsAndEntropy.apply, logits, input_ids, vocab, temperature, positions)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, vocab: int, temperature: float = 1.0,
                   positions: torch.Tensor | None = None) -> torch.Tensor:
    """The log-probs of :func:`token_logprobs_and_entropy` alone, for passes without a gradient:
    half the head's passes over the logits and half its fp32 memory."""
    (logp,) = _per_token(lambda *a: (_target_logprobs(*a),), logits, input_ids, vocab, temperature, positions)
    return logp


def _per_token(head, logits, input_ids, vocab: int, temperature: float, positions) -> tuple[torch.Tensor, ...]:
    """Runs ``head(logits, targets, vocab, temperature, group)`` on the rows that have targets
    and lays each ``[rows]`` result out as ``[b, T]``."""
    group = parallel_state.get_tensor_model_parallel_group()
    group = group if torch.distributed.get_world_size(group) > 1 else None
    # The logits at t predict input_ids[t + 1]. The last position's have no target: they get a
    # dummy one and their results are dropped, rather than slicing the logits, whose gradient
    # would then be copied into a zeroed tensor of the full size.
    targets = F.pad(input_ids[:, 1:], (0, 1)).t()
    if positions is None:
        outs = head(logits, targets, vocab, temperature, group)
    else:
        rows = logit_rows(positions).bool().t()
        if logits.dim() == 3:  # every row was computed
            logits = logits[rows]
        outs = head(logits, targets[rows], vocab, temperature, group)
        outs = (rows.new_zeros(rows.shape, dtype=t.dtype).masked_scatter(rows, t) for t in outs)
    return tuple(F.pad(t.t()[:, :-1], (1, 0)) for t in outs)


def _logits_at(key: str):
    """The model's keywords for a micro-batch: logits only where they predict ``mb[key]``."""
    return lambda mb: {"loss_mask": logit_rows(mb[key])}


class MegatronActor(ModelShard):
    """``MegatronActor(hf_dir, cfg)`` trains; ``MegatronActor(hf_dir, cfg, trainable=False)`` is
    the frozen reference policy. Every method is collective over the trainer's ranks."""

    def __init__(self, hf_dir: str, cfg: Config, *, trainable: bool = True, load_weights: bool = True):
        super().__init__(hf_dir, cfg, trainable=trainable, load_weights=load_weights)

    def full_logits(self, input_ids: torch.Tensor, micro_batch_size: int | None = None) -> torch.Tensor:
        """``[B, T, vocab]`` logits gathered over TP, padding dropped: for parity checks and the
        conversion tools only (training never gathers the vocabulary)."""
        vocab = self.hf_config.vocab_size

        def head(logits, mb):  # [s, b, V / tp] -> [b, s, V]
            whole = gather_from_tensor_model_parallel_region(logits)[..., :vocab]
            return logits.sum() * 0, {"logits": whole.transpose(0, 1)}

        return self.infer({"input_ids": input_ids}, head, ("logits",), micro_batch_size)["logits"]

    def logprobs(self, input_ids: torch.Tensor, temperature: float = 1.0, micro_batch_size: int | None = None,
                 attention_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                 entropy: bool = True) -> dict:
        """``{"logprobs": [B, T], "entropy": [B, T]}`` for ``input_ids [B, T]`` (with an
        ``attention_mask``, micro-batches are only as wide as their sequences; with
        ``positions``, e.g. the loss mask, only those are computed and the rest hold 0). With
        ``entropy=False``, the log-probs alone, through the head's cheaper pass (the old and the
        reference policy's log-probs in training)."""
        vocab = self.hf_config.vocab_size

        def head(logits, mb):
            if entropy:
                logp, ent = token_logprobs_and_entropy(logits, mb["input_ids"], vocab, temperature, mb.get("positions"))
                return logp.sum() * 0, {"logprobs": logp, "entropy": ent}
            logp = token_logprobs(logits, mb["input_ids"], vocab, temperature, mb.get("positions"))
            return logp.sum() * 0, {"logprobs": logp}

        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "positions": positions}
        batch = {k: v for k, v in batch.items() if v is not None}
        return self.infer(batch, head, ("logprobs", "entropy") if entropy else ("logprobs",), micro_batch_size,
                          _logits_at("positions") if positions is not None else None)

    def update(self, batch: dict, loss_fn: PolicyLossFn, temperature: float = 1.0,
               micro_batch_size: int | None = None) -> dict:
        """One optimizer step: ``loss_fn`` gets the differentiable log-probs and entropy of each
        micro-batch of this DP rank's slice of ``batch`` (which holds ``input_ids`` and whatever
        the loss needs). With a ``loss_mask`` in ``batch``, log-probs and entropy are computed
        only where it is set (0 elsewhere): the loss must not look past it."""
        vocab = self.hf_config.vocab_size

        def head(logits, mb):
            logp, ent = token_logprobs_and_entropy(logits, mb["input_ids"], vocab, temperature, mb.get("loss_mask"))
            return loss_fn(logp, ent, mb)

        return self.train_step(batch, head, micro_batch_size, _logits_at("loss_mask") if "loss_mask" in batch else None)
