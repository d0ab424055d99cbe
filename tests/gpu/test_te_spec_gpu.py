"""With Transformer Engine installed, the actor is built from TE's layer spec (fused QKV with its
layer norm, TE linears) and still computes what transformers computes from the same checkpoint:
the logits, and log-probs at some positions only (the LM head run on those rows alone).
Skipped without CUDA or without TE."""

import pytest
import torch

from agentgym_mega.models import gpt
from agentgym_mega.platform.local_ranks import run_on_local_ranks
from tests.distributed import megatron_jobs as jobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(not gpt.te_available(), reason="needs Transformer Engine")]

# Max |logit difference| to transformers in fp32 on the GPU: TE's fp32 GEMMs may run in TF32
# (10-bit mantissa), so looser than the CPU parity tests' 1e-4; a wrong weight mapping is off by
# whole units.
TE_LOGIT_TOL = 2e-2


def te_logits_job(hf_dir: str) -> dict:
    from agentgym_mega import platform
    from agentgym_mega.config import apply_overrides, to_dict, validate
    from agentgym_mega.models.actor import MegatronActor

    platform.init_distributed(tp=1, pp=1, seed=0)
    cfg = validate(apply_overrides(to_dict(jobs.make_config(1, 1, 1)), ["model.dtype=float32"]))
    actor = MegatronActor(hf_dir, cfg, trainable=False)
    ids = jobs.tokens(actor.hf_config.vocab_size)
    modules = {type(m).__module__ for m in actor.model.modules()}
    at = actor.logprobs(ids.cuda(), micro_batch_size=2, positions=jobs.some_positions(ids).cuda())["logprobs"]
    return {"ids": ids, "logits": actor.full_logits(ids.cuda(), 2).float().cpu(), "logprobs_at": at.float().cpu(),
            "te_modules": sorted(m for m in modules if m.startswith("transformer_engine"))}


def test_the_te_layer_spec_matches_transformers(tiny_qwen2):
    from transformers import AutoModelForCausalLM

    out = run_on_local_ranks(te_logits_job, 1, tiny_qwen2)[0]
    assert out["te_modules"], "the model was not built from TE's modules"
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).cuda()
    with torch.no_grad():
        reference = model(out["ids"].cuda()).logits.float().cpu()
    diff = (out["logits"] - reference).abs().max().item()
    assert diff <= TE_LOGIT_TOL, diff
    at = jobs.some_positions(out["ids"]).bool()
    token_logp = torch.log_softmax(reference, -1)[:, :-1].gather(-1, out["ids"][:, 1:, None]).squeeze(-1)
    want = torch.nn.functional.pad(token_logp, (1, 0)) * at
    # a log-prob is a logit minus a log-sum-exp of logits: each within TE_LOGIT_TOL
    assert (out["logprobs_at"] - want).abs().max().item() <= 2 * TE_LOGIT_TOL
    assert torch.all(out["logprobs_at"][~at] == 0)
