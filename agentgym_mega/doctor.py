"""`agentgym-mega doctor`: proves this machine can run the stack, end to end, on its backend.

Two checks, each on the real libraries:

* ``megatron``: a small megatron-core ``GPTModel`` trains for a few steps inside
  ``torch.distributed`` (NCCL on GPU, gloo on CPU) at a given TP/PP/DP layout, through megatron's
  ``DistributedDataParallel``, its distributed optimizer and gradient clipping, and the pipeline
  schedules. It reports the loss per step, which must fall.
* ``vllm``: a Hugging Face model directory loads in vLLM and generates.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from functools import partial

import torch
import torch.distributed as dist

from agentgym_mega import platform
from agentgym_mega.models.tiny import TinySpec, make_tiny_model
from agentgym_mega.platform.local_ranks import run_on_local_ranks

# megatron, vLLM and transformers are imported where they are used: megatron only in the spawned
# ranks (the process that spawns them, and the vllm check, need not pay for it), vLLM after
# platform.vllm_environment() has set the variables it reads at import, transformers by that check.

SEQ_LEN = 32
VOCAB = 128
CLIP_GRAD = 1.0


@dataclasses.dataclass
class MegatronCheck:
    """One training run's layout and its outcome on one rank."""

    tp: int
    pp: int
    dp: int
    losses: list[float]
    grad_norms: list[float]  # before clipping, as megatron's optimizer reports them
    clipped_norms: list[float]  # recomputed after the step: at most the clip threshold
    optimizer: str = ""
    rank: int = 0


def _batch(step: int, micro_batch: int, seed: int) -> dict:
    """Token sequences with a learnable rule (an arithmetic progression mod VOCAB per row)."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    start = torch.randint(0, VOCAB, (micro_batch, 1), generator=g)
    stride = torch.randint(1, 4, (micro_batch, 1), generator=g)
    tokens = (start + stride * torch.arange(SEQ_LEN + 1)) % VOCAB
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "position_ids": torch.arange(SEQ_LEN).expand(micro_batch, SEQ_LEN).contiguous(),
    }


def _loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    loss = (output.float() * loss_mask).sum() / loss_mask.sum()
    # detach().clone(): the schedule divides the returned loss in place by the microbatch count.
    return loss, {"loss": loss.detach().clone()}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss_func, torch.ones_like(batch["labels"], dtype=torch.float))


def train_tiny_gpt(
    tp: int, pp: int, steps: int = 6, seed: int = 0, micro_batch: int = 4, microbatches: int = 2
) -> MegatronCheck:
    """Trains a 4-layer GPTModel in the already-joined process group; every rank returns the
    loss of the global batch (averaged over DP, taken from the last pipeline stage)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    platform.init_distributed(tp=tp, pp=pp, seed=seed)
    model, optimizer = _gpt_and_optimizer()
    forward_backward = get_forward_backward_func()
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    losses, grad_norms, clipped_norms = [], [], []
    for step in range(steps):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        data = iter(
            [_batch(step * microbatches + i, micro_batch, seed + dp_rank) for i in range(microbatches)]
        )
        outputs = forward_backward(
            forward_step_func=_forward_step,
            data_iterator=data,
            model=[model],
            num_microbatches=microbatches,
            seq_length=SEQ_LEN,
            micro_batch_size=micro_batch,
            forward_only=False,
        )
        ok, grad_norm, _ = optimizer.step()
        if not ok:
            raise RuntimeError(f"megatron optimizer step {step} was skipped (non-finite gradients)")
        losses.append(_global_loss(outputs) / dp_size)
        grad_norms.append(float(grad_norm))
        clipped_norms.append(float(optimizer.get_grad_norm()))
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return MegatronCheck(
        tp, pp, dp_size, losses, grad_norms, clipped_norms,
        optimizer="+".join(type(o).__name__ for o in inner), rank=dist.get_rank(),
    )


def _gpt_and_optimizer():
    """This rank's stage of the GPTModel, wrapped in megatron's DDP, and its distributed optimizer
    with gradient clipping (bf16 on GPU, fp32 on CPU)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    dtype = torch.bfloat16 if platform.has_cuda() else torch.float32
    config = TransformerConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ_LEN,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    ).to(platform.device())
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True, overlap_grad_reduce=False
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=3e-3,
            clip_grad=CLIP_GRAD,
            use_distributed_optimizer=True,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
        ),
        [model],
    )
    return model, optimizer


def _global_loss(outputs: list) -> float:
    """The step's loss summed over pipeline stages (only the last has it) and over data parallel
    ranks (the caller averages)."""
    from megatron.core import parallel_state

    loss = torch.zeros(1, device=platform.device())
    if parallel_state.is_pipeline_last_stage():
        loss += torch.stack([o["loss"] for o in outputs]).mean()
    dist.all_reduce(loss, group=parallel_state.get_pipeline_model_parallel_group())
    dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
    return loss.item()


def run_megatron_check(world: int, tp: int, pp: int, steps: int) -> list[MegatronCheck]:
    """Spawns ``world`` ranks on this machine and returns each rank's result."""
    return run_on_local_ranks(train_tiny_gpt, world, tp, pp, steps)


def megatron_report(layouts: list[tuple[int, int, int]], steps: int) -> dict:
    """Runs each (tp, pp, world) layout; ok when every rank agrees and the loss fell."""
    runs = []
    for tp, pp, world in layouts:
        ranks = run_megatron_check(world, tp, pp, steps)
        losses = ranks[0].losses
        agree = all(r.losses == losses for r in ranks)
        fell = losses[-1] < losses[0]
        clipped = max(ranks[0].clipped_norms) <= CLIP_GRAD * (1 + 1e-4)
        runs.append({"tp": tp, "pp": pp, "dp": ranks[0].dp, "losses": losses,
                     "grad_norms": ranks[0].grad_norms, "clipped_norms": ranks[0].clipped_norms,
                     "ranks_agree": agree, "loss_fell": fell, "clipped": clipped})
        print(f"megatron tp={tp} pp={pp} dp={ranks[0].dp} ({platform.dist_backend()}): loss "
              f"{losses[0]:.4f} -> {losses[-1]:.4f}, ranks agree: {agree}, grad norm "
              f"{max(ranks[0].grad_norms):.2f} clipped to <= {CLIP_GRAD}: {clipped}")
    ok = all(r["ranks_agree"] and r["loss_fell"] and r["clipped"] for r in runs)
    return {"ok": ok, "runs": runs}


PROMPTS = ["Your goal: go to the red ball", "Goal: craft 1 crafting table.", "Action: inventory"]
LOGPROB_TOLERANCE = 1e-4


def vllm_report(model: str | None, max_tokens: int = 16) -> dict:
    """Greedy generation in vLLM; log-probs of the sampled tokens recomputed by transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    platform.vllm_environment()
    from vllm import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        model = model or make_tiny_model(os.path.join(tmp, "tiny"), TinySpec())
        tokenizer = AutoTokenizer.from_pretrained(model)
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            )
            for p in PROMPTS
        ]
        prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        llm = LLM(model=model, dtype="float32", enforce_eager=True, seed=0, max_model_len=1024)
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0),
            use_tqdm=False,
        )
        del llm
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        max_diff, same_greedy, samples = 0.0, True, []
        for prompt, out in zip(prompts, outputs):
            ids = list(out.outputs[0].token_ids)
            vllm_logp = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, ids)])
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
            hf_logp = torch.log_softmax(logits.float(), -1)
            hf_sampled = hf_logp.gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
            max_diff = max(max_diff, (hf_sampled - vllm_logp).abs().max().item())
            same_greedy &= hf_logp.argmax(-1).tolist() == ids
            samples.append(tokenizer.decode(ids))
    ok = max_diff <= LOGPROB_TOLERANCE and same_greedy
    print(f"vllm: {len(prompts)} prompts, greedy tokens match transformers: {same_greedy}, "
          f"max |logprob diff| = {max_diff:.2e} (tolerance {LOGPROB_TOLERANCE:g})")
    return {"ok": ok, "max_abs_logprob_diff": max_diff, "greedy_match": same_greedy, "samples": samples}
