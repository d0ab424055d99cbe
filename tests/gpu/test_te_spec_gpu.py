"""With Transformer Engine installed, the actor is built from TE's layer spec (fused QKV with its
layer norm, TE linears) and still computes what transformers computes from the same checkpoint.
Skipped without CUDA or without TE."""

import pytest
import torch

from agentgym_mega.models import gpt
from agentgym_mega.platform.local_ranks import run_on_local_ranks

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
    from tests.distributed import megatron_jobs as jobs

    platform.init_distributed(tp=1, pp=1, seed=0)
    cfg = validate(apply_overrides(to_dict(jobs.make_config(1, 1, 1)), ["model.dtype=float32"]))
    actor = MegatronActor(hf_dir, cfg, trainable=False)
    ids = jobs.tokens(actor.hf_config.vocab_size)
    modules = {type(m).__module__ for m in actor.model.modules()}
    return {"ids": ids, "logits": actor.full_logits(ids.cuda(), 2).float().cpu(),
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
