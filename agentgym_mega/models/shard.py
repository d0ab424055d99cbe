"""What the actor, the reference policy and the critic share: a model shard, one trainer rank's
part of a megatron ``GPTModel`` built from a Hugging Face directory, run over micro-batches
through megatron's pipeline schedule, and, when trainable, megatron's DDP, distributed optimizer
(grad clipping) and LR scheduler.

Batches are dicts of ``[B, T]`` tensors, right-padded (the causal mask then needs no attention
mask: padding only follows real tokens), with an optional ``attention_mask`` giving each
sequence's real length. Every rank is handed the whole batch and works on its data-parallel slice
(``B / dp`` sequences), cut into micro-batches (``trainer.micro_batch_size`` sequences, or
``trainer.max_tokens_per_gpu`` tokens: see :mod:`agentgym_mega.models.micro_batches`), each padded
only to its own longest sequence; megatron's schedule runs them (pipelined when PP > 1), so no
more than one micro-batch's logits exist at a time. Per-sequence results are broadcast from the
last pipeline stage, put back in order and all-gathered over DP, so every rank returns the whole
batch's results in order, ``[B, T, ...]`` (0 past a sequence's micro-batch width).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func

from agentgym_mega.models import checkpoint, gpt, offload, weights
from agentgym_mega.models.micro_batches import fixed_bins, padded_width, token_bins

if TYPE_CHECKING:
    from agentgym_mega.config import Config

# (model output on the last stage, micro-batch) -> (loss, results per sample) when only running
# forward; when training (loss total, count, metric totals), see ModelShard.train_step.
HeadFn = Callable[[torch.Tensor, dict], tuple]
# micro-batch -> keywords of the model's forward pass for it
ModelKwargsFn = Callable[[dict], dict]


@functools.cache
def data_parallel() -> type:
    """megatron's ``DistributedDataParallel`` minus the gradient reduction over a data-parallel
    group of one rank.
    There the reduction is an identity (per-token losses keep every gradient scaling factor at
    1, and the grads are reduced synchronously), yet gloo still runs it as a clone of the whole
    gradient buffer and a copy back, a cost every step pays for nothing (docs/results.md)."""
    class DataParallel(DistributedDataParallel):
        def finish_grad_sync(self, force_all_reduce: bool = False):
            if self.dp_cp_group.size() > 1 or self.expert_parallel_bucket_groups:
                super().finish_grad_sync(force_all_reduce)

    return DataParallel


def lr_decay_steps(trainer) -> int:
    """Optimizer steps in the whole run: one per mini-batch, per PPO epoch, per RL step."""
    return trainer.total_steps * (trainer.batch_size // trainer.mini_batch_size) * trainer.ppo_epochs


class ModelShard:
    """One role's megatron model on one trainer rank (its TP/PP shard, its DP replica).
    Not a vLLM worker: those are the engines' processes."""

    def __init__(self, hf_dir: str, cfg: Config, *, trainable: bool = True, value_head: bool = False,
                 load_weights: bool = True):
        """``hf_dir``: the HF model (config, tokenizer and, with ``load_weights``, the weights;
        without, the weights come from :meth:`load_checkpoint`)."""
        self.hf_dir = hf_dir
        self.hf_config = gpt.load_hf_config(hf_dir)
        self.split = gpt.ModelSplit.of(cfg.parallel)
        self.dtype = gpt.resolve_dtype(cfg.model.dtype)
        self.value_head = value_head
        model = gpt.build_gpt(self.hf_config, self.split, self.dtype, value_head=value_head)
        # Micro-batches differ in width (and, with a token budget, in sequences): pipeline
        # stages then send each activation's shape ahead of it.
        model.config.variable_seq_lengths = self.split.pp > 1
        self.micro_batch_size = cfg.trainer.micro_batch_size
        self.max_tokens = cfg.trainer.max_tokens_per_gpu
        # Sequence parallel splits each micro-batch's sequence over the TP ranks.
        self.width_multiple = self.split.tp if cfg.parallel.sequence_parallel else 1
        if load_weights:
            weights.load_hf_weights(model, hf_dir, self.hf_config)
        self.optimizer = self.scheduler = None
        self._released: list = []  # what release_memory freed, for restore_memory
        if not trainable:
            model.eval()
            model.requires_grad_(False)
            self.model = model
            return
        config = model.config
        # Losses come back as (total, count): megatron sums them over micro-batches and DP ranks
        # and divides the gradients by the global count, so a DP slice weighs by its share of the
        # trained tokens (or sequences) rather than by 1 / dp.
        config.calculate_per_token_loss = True
        self.model = data_parallel()(
            config=config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=True, overlap_grad_reduce=False
            ),
            module=model,
        )
        # The schedule calls these: DP grad reduction, tied-embedding and sequence-parallel
        # norm grads across ranks.
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = self.model.no_sync
        self.optimizer, self.scheduler = self._build_optimizer(cfg.trainer)

    def _build_optimizer(self, trainer):
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=trainer.lr,
                min_lr=trainer.min_lr,
                weight_decay=trainer.weight_decay,
                clip_grad=trainer.grad_clip,
                bf16=self.dtype == torch.bfloat16,
                params_dtype=self.dtype,
                use_distributed_optimizer=True,
            ),
            [self.model],
        )
        steps = lr_decay_steps(trainer)
        scheduler = OptimizerParamScheduler(
            optimizer,
            init_lr=0.0 if trainer.warmup_steps else trainer.lr,
            max_lr=trainer.lr,
            min_lr=trainer.min_lr,
            lr_warmup_steps=trainer.warmup_steps,
            lr_decay_steps=max(steps, trainer.warmup_steps + 1),
            lr_decay_style=trainer.lr_schedule,
            start_wd=trainer.weight_decay,
            end_wd=trainer.weight_decay,
            wd_incr_steps=steps,
            wd_incr_style="constant",
        )
        return optimizer, scheduler

    # -- data parallelism --------------------------------------------------------------------

    def dp_slice(self, batch: dict) -> dict:
        """This DP rank's contiguous share of a whole batch (every rank is given the whole batch)."""
        dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        size = len(batch["input_ids"])
        if size % dp:
            raise ValueError(f"batch of {size} sequences does not split over {dp} data-parallel ranks")
        share = size // dp
        return {k: v[rank * share: (rank + 1) * share] for k, v in batch.items()}

    def dp_gather(self, local: torch.Tensor) -> torch.Tensor:
        """The DP slices' results concatenated in DP rank order (the inverse of dp_slice)."""
        group = parallel_state.get_data_parallel_group()
        if dist.get_world_size(group) == 1:
            return local.cpu()
        local = local.to(next(self.model.parameters()).device).contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local, group=group)
        return torch.cat(parts).cpu()

    def infer(self, batch: dict, head: HeadFn, keys: tuple, micro_batch_size: int | None = None,
              model_kwargs: ModelKwargsFn | None = None) -> dict:
        """Forward only over this rank's DP slice; ``{key: [B, T, ...]}`` for the whole batch."""
        local = self.dp_slice(batch)
        size, seq = local["input_ids"].shape
        with torch.no_grad():
            bins, results = self.run(local, head, micro_batch_size, model_kwargs=model_kwargs)
        out = {}
        for key in keys:
            first = results[0][key]
            whole = first.new_zeros((size, seq, *first.shape[2:]))
            for rows, result in zip(bins, results):
                width = min(result[key].shape[1], seq)
                whole[rows, :width] = result[key][:, :width]
            out[key] = self.dp_gather(whole)
        return out

    # -- running micro-batches -------------------------------------------------------------

    def micro_batches(self, lengths: list[int], micro_batch_size: int | None = None) -> list[list[int]]:
        """Rows of each micro-batch of this rank's slice: ``micro_batch_size`` sequences when
        given, else the configured token budget or micro-batch size. Token-budget bins are as
        many on every DP rank (the most any needs), so that all run the same schedule."""
        if micro_batch_size is None and self.max_tokens is not None:
            bins = token_bins(lengths, self.max_tokens, self.width_multiple)
            most = torch.tensor([len(bins)], device=next(self.model.parameters()).device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=parallel_state.get_data_parallel_group())
            if int(most) > len(bins):
                bins = token_bins(lengths, self.max_tokens, self.width_multiple, min_bins=int(most))
            return bins
        return fixed_bins(len(lengths), micro_batch_size or self.micro_batch_size)

    def run(self, batch: dict, head: HeadFn, micro_batch_size: int | None = None,
            forward_only: bool = True, model_kwargs: ModelKwargsFn | None = None
            ) -> tuple[list[list[int]], list[dict]]:
        """Runs ``batch`` through the model in micro-batches; ``head`` turns the last stage's
        output into (loss, per-micro-batch results). Returns the rows of each micro-batch and
        its results, on every rank. With ``forward_only=False`` the losses are backpropagated
        (grads accumulate). ``model_kwargs`` gives the model's forward keywords for a
        micro-batch (the policy's logit rows)."""
        size, seq = batch["input_ids"].shape
        mask = batch.get("attention_mask")
        lengths = mask.sum(-1).tolist() if mask is not None else [seq] * size
        bins = self.micro_batches([int(n) for n in lengths], micro_batch_size)
        device = next(self.model.parameters()).device
        chunks = []
        for rows in bins:
            width = padded_width(max(lengths[i] for i in rows), self.width_multiple)
            chunks.append({k: F.pad(v[rows, :width], (0, max(0, width - seq))).to(device) for k, v in batch.items()})

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            ids = mb["input_ids"]
            output = model(ids, torch.arange(ids.shape[1], device=device).expand_as(ids), None,
                           **(model_kwargs(mb) if model_kwargs else {}))
            return output, lambda out: head(out, mb)

        results = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(chunks),
            model=[self.model],
            num_microbatches=len(chunks),
            # shapes of the first micro-batch; later ones send theirs (variable_seq_lengths)
            seq_length=chunks[0]["input_ids"].shape[1],
            micro_batch_size=len(bins[0]),
            forward_only=forward_only,
        )
        return bins, self._from_last_stage(results)

    def _from_last_stage(self, results: list[dict]) -> list[dict]:
        group = parallel_state.get_pipeline_model_parallel_group()
        ranks = dist.get_process_group_ranks(group)
        if len(ranks) == 1:
            return results
        box = [[{k: v.detach().cpu() for k, v in r.items()} for r in results]]
        dist.broadcast_object_list(box, src=ranks[-1], group=group)
        return box[0]

    def step(self) -> dict:
        """Applies the accumulated gradients: clip, optimizer step, LR schedule."""
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("optimizer step skipped: non-finite gradients")
        self.scheduler.step(increment=1)
        return {"grad_norm": float(grad_norm), "lr": lr}

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def train_step(self, batch: dict, head: HeadFn, micro_batch_size: int | None = None,
                   model_kwargs: ModelKwargsFn | None = None) -> dict:
        """One optimizer step on the whole ``batch``, each DP rank running its slice. ``head``
        returns ``(loss total, count, {metric: total})`` for a micro-batch: totals and counts add
        up over micro-batches and DP ranks, and the step's loss is their global ratio (megatron
        divides the gradients by the global count). Returns each metric's total over the global
        count, with ``loss``, grad norm and lr."""
        def counted(out, mb):
            total, count, metrics = head(out, mb)
            count = count.to(torch.int)  # megatron adds the counts up in an int tensor
            return total, count, {"loss": total.detach(), "count": count} | {k: v.detach() for k, v in metrics.items()}

        self.zero_grad()
        _, results = self.run(self.dp_slice(batch), counted, micro_batch_size, forward_only=False,
                              model_kwargs=model_kwargs)
        names = sorted(results[0])
        totals = torch.stack([torch.stack([r[k] for r in results]).double().sum() for k in names])
        totals = totals.to(next(self.model.parameters()).device)
        dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
        sums = dict(zip(names, totals.tolist()))
        count = max(sums.pop("count"), 1.0)
        return {k: v / count for k, v in sums.items()} | self.step()

    # -- device memory while the engines generate (cluster.offload) ------------------------

    def release_memory(self, params: bool = True) -> None:
        """Frees this role's device memory: gradient buffers (discarded), optimizer state and
        fp32 main parameters (kept on the host) and, with ``params``, the parameters (kept on the
        host). May be called again to release the parameters later (after a weight sync)."""
        keep, drop = [], []
        if self.optimizer is not None:
            for inner in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                keep += [p for group in inner.optimizer.param_groups for p in group["params"]]
                keep += [v for state in inner.optimizer.state.values() for v in state.values()
                         if isinstance(v, torch.Tensor)]
            drop += [b.grad_data for b in self.model.buffers + self.model.expert_parallel_buffers]
        if params:
            keep += list(self.model.parameters())
        else:  # parameters stay: their storage may hold main parameters too (fp32 training)
            resident = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
            keep = [t for t in keep if t.untyped_storage().data_ptr() not in resident]
        self._released += offload.release(keep, drop)

    def restore_memory(self) -> None:
        """Takes back everything :meth:`release_memory` freed, bytes as they were."""
        offload.restore(self._released)
        self._released = []

    # -- weights out and checkpoints -------------------------------------------------------

    def export_hf(self, to: str = "first"):
        """``(hf_name, full tensor)`` pairs on the ranks `to` names (the model-parallel group's
        first rank by default); see :func:`weights.export_hf` (collective)."""
        return weights.export_hf(self.model, self.hf_config, to)

    def save_hf(self, out: str) -> str | None:
        return weights.save_hf(self.model, self.hf_config, self.hf_dir, out)

    def save_checkpoint(self, root: str, step: int, trainer_state: dict | None = None) -> str:
        return checkpoint.save(root, step, self, trainer_state or {})

    def load_checkpoint(self, path: str, load_optimizer: bool = True) -> dict:
        """Loads model (and optimizer, scheduler, RNG when the layout matches); returns the
        trainer state saved with it."""
        return checkpoint.load(path, self, load_optimizer=load_optimizer)
