"""What the actor, the reference policy and the critic share: one megatron ``GPTModel`` built
from a Hugging Face directory, run over micro-batches through megatron's pipeline schedule, and,
when trainable, megatron's DDP, distributed optimizer (grad clipping) and LR scheduler.

Batches are dicts of ``[B, T]`` tensors, right-padded (the causal mask then needs no attention
mask: padding only follows real tokens). Every rank is handed the whole batch and works on its
data-parallel slice (``B / dp`` sequences); per-sequence results are broadcast from the last
pipeline stage and all-gathered over DP, so every rank returns the whole batch's results in order.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from agentgym_mega.models import checkpoint, gpt, weights

# (model output on the last stage, micro-batch) -> (loss, results per sample) when only running
# forward; when training (loss total, count, metric totals), see ModelWorker.train_step.
HeadFn = Callable[[torch.Tensor, dict], tuple]


def lr_decay_steps(trainer) -> int:
    """Optimizer steps in the whole run: one per mini-batch, per PPO epoch, per RL step."""
    return trainer.total_steps * (trainer.batch_size // trainer.mini_batch_size) * trainer.ppo_epochs


class ModelWorker:
    def __init__(self, hf_dir: str, cfg, *, trainable: bool = True, value_head: bool = False,
                 load_weights: bool = True):
        """``hf_dir``: the HF model (config, tokenizer and, with ``load_weights``, the weights;
        without, the weights come from :meth:`load_checkpoint`)."""
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        self.hf_dir = hf_dir
        self.hf_config = gpt.load_hf_config(hf_dir)
        self.layout = gpt.Layout.of(cfg.parallel)
        self.dtype = gpt.resolve_dtype(cfg.model.dtype)
        self.value_head = value_head
        model = gpt.build_gpt(self.hf_config, self.layout, self.dtype, value_head=value_head)
        if load_weights:
            weights.load_hf_weights(model, hf_dir, self.hf_config)
        self.optimizer = self.scheduler = None
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
        self.model = DistributedDataParallel(
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
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

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
        from megatron.core import parallel_state

        dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        size = len(batch["input_ids"])
        if size % dp:
            raise ValueError(f"batch of {size} sequences does not split over {dp} data-parallel ranks")
        share = size // dp
        return {k: v[rank * share: (rank + 1) * share] for k, v in batch.items()}

    def dp_gather(self, local: torch.Tensor) -> torch.Tensor:
        """The DP slices' results concatenated in DP rank order (the inverse of dp_slice)."""
        from megatron.core import parallel_state

        group = parallel_state.get_data_parallel_group()
        if dist.get_world_size(group) == 1:
            return local.cpu()
        local = local.to(next(self.model.parameters()).device).contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local, group=group)
        return torch.cat(parts).cpu()

    def infer(self, batch: dict, head: HeadFn, keys: tuple, micro_batch_size: int | None = None) -> dict:
        """Forward only over this rank's DP slice; ``{key: [B, ...]}`` for the whole batch."""
        with torch.no_grad():
            results = self.run(self.dp_slice(batch), head, micro_batch_size)
        return {k: self.dp_gather(torch.cat([r[k] for r in results])) for k in keys}

    # -- running micro-batches -------------------------------------------------------------

    def run(self, batch: dict, head: HeadFn, micro_batch_size: int | None = None,
            forward_only: bool = True) -> list[dict]:
        """Runs ``batch`` through the model in micro-batches; ``head`` turns the last stage's
        output into (loss, per-micro-batch results). Returns the results of each micro-batch on
        every rank. With ``forward_only=False`` the losses are backpropagated (grads accumulate)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        input_ids = batch["input_ids"]
        size, seq = input_ids.shape
        micro = micro_batch_size or size
        if size % micro:
            raise ValueError(f"batch of {size} sequences does not split into micro-batches of {micro}")
        device = next(self.model.parameters()).device
        positions = torch.arange(seq, device=device).expand(micro, seq)
        chunks = [{k: v[i: i + micro].to(device) for k, v in batch.items()} for i in range(0, size, micro)]

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            output = model(mb["input_ids"], positions, None)
            return output, lambda out: head(out, mb)

        results = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(chunks),
            model=[self.model],
            num_microbatches=len(chunks),
            seq_length=seq,
            micro_batch_size=micro,
            forward_only=forward_only,
        )
        return self._from_last_stage(results)

    def _from_last_stage(self, results: list[dict]) -> list[dict]:
        from megatron.core import parallel_state

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

    def train_step(self, batch: dict, head: HeadFn, micro_batch_size: int | None = None) -> dict:
        """One optimizer step on the whole ``batch``, each DP rank running its slice. ``head``
        returns ``(loss total, count, {metric: total})`` for a micro-batch: totals and counts add
        up over micro-batches and DP ranks, and the step's loss is their global ratio (megatron
        divides the gradients by the global count). Returns each metric's total over the global
        count, with ``loss``, grad norm and lr."""
        from megatron.core import parallel_state

        def counted(out, mb):
            total, count, metrics = head(out, mb)
            count = count.to(torch.int)  # megatron adds the counts up in an int tensor
            return total, count, {"loss": total.detach(), "count": count} | {k: v.detach() for k, v in metrics.items()}

        self.zero_grad()
        results = self.run(self.dp_slice(batch), counted, micro_batch_size, forward_only=False)
        names = sorted(results[0])
        totals = torch.stack([torch.stack([r[k] for r in results]).double().sum() for k in names])
        totals = totals.to(next(self.model.parameters()).device)
        dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
        sums = dict(zip(names, totals.tolist()))
        count = max(sums.pop("count"), 1.0)
        return {k: v / count for k, v in sums.items()} | self.step()

    # -- weights out and checkpoints -------------------------------------------------------

    def export_hf(self):
        """``(hf_name, full tensor)`` pairs on the model-parallel group's first rank; see
        :func:`weights.export_hf` (collective)."""
        return weights.export_hf(self.model, self.hf_config)

    def save_hf(self, out: str) -> str | None:
        return weights.save_hf(self.model, self.hf_config, self.hf_dir, out)

    def save_checkpoint(self, root: str, step: int, trainer_state: dict | None = None) -> str:
        return checkpoint.save(root, step, self, trainer_state or {})

    def load_checkpoint(self, path: str, load_optimizer: bool = True) -> dict:
        """Loads model (and optimizer, scheduler, RNG when the layout matches); returns the
        trainer state saved with it."""
        return checkpoint.load(path, self, load_optimizer=load_optimizer)
