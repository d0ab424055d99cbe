"""Core attention on CPU: the local layer spec computes megatron's attention with torch's fused
scaled-dot-product kernel (models.gpt.sdpa_attention), which must equal megatron's own
DotProductAttention, output and gradients, with grouped query heads (4 heads, 2 groups).
Tolerance: 1e-5 absolute and relative (fp32; the kernels only sum in a different order)."""

import pytest
import torch

from agentgym_mega.platform.local_ranks import run_on_local_ranks
from tests.distributed import megatron_jobs as jobs

pytestmark = pytest.mark.slow


def test_fused_attention_equals_megatrons(megatron_models):
    out = run_on_local_ranks(jobs.attention_job, 1, megatron_models["qwen2"])[0]
    assert out["core_attention"] == "SdpaAttention"
    for case in ("causal", "mask"):
        # an explicit mask takes megatron's own path: the same numbers, bit for bit
        tol = 1e-5 if case == "causal" else 0.0
        for name, fused, reference in zip(("context", "dq", "dk", "dv"), out[f"sdpa_{case}"], out[f"megatron_{case}"]):
            assert torch.allclose(fused, reference, rtol=tol, atol=tol), (case, name, (fused - reference).abs().max())
    assert out["sdpa_causal"][0].abs().mean() > 0.1  # a real output, not zeros
