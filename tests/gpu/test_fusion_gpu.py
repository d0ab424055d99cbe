"""megatron's fused GPU paths (gpt.fusions: the torch.compiled SwiGLU and bias-dropout-add, and,
where their kernels are installed, Transformer Engine's rotary embedding, apex's softmax and
weight-gradient accumulation) compute what the unfused model computes: the logits and every
parameter's gradient after one backward pass, for the tiny Qwen2 and a ~95M Llama (12 layers,
hidden 768), in fp32 and bf16, the same weights loaded into both models. Skipped without CUDA."""

import pytest
import torch

from agentgym_mega.models import gpt
from agentgym_mega.platform.local_ranks import run_on_local_ranks
from tests.distributed.conftest import model_100m  # noqa: F401  (a fixture this module uses)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# Relative error, ||fused - unfused|| / ||unfused||, of the logits and of all gradients together;
# a single parameter's gradient may be off by PER_TENSOR times as much (a small gradient's
# rounding weighs more). A fusion that computes something else is off by tens of percent.
# fp32: the fused kernels add and multiply in another order (and Transformer Engine's GEMMs may
# round inputs to TF32, 10 bits, where an operand differs in its last bit): 1e-7 per operation,
# grown over the layers, stays well under 1e-4.
# bf16: a fused kernel computes in fp32 and rounds once where the unfused path rounds after each
# operation (silu, then the product; the residual add), so the two differ by about one bf16
# rounding (2^-9 = 2e-3) per element per layer; over 12 layers and back, ~1e-2 at most.
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}
PER_TENSOR = 3
BATCH, SEQ = 2, 256


def fusion_job(hf_dir: str, dtype_name: str) -> dict:
    """Per build (fused, unfused): the fusion flags its config has, the logits of one batch and
    every parameter's gradient (megatron's DDP main_grad, which the fused weight-gradient GEMM
    writes into) after backpropagating the batch's mean next-token loss."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from agentgym_mega import platform
    from agentgym_mega.models import shard, weights
    from tests.distributed import megatron_jobs as jobs

    platform.init_distributed(tp=1, pp=1, seed=0)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    hf_config = gpt.load_hf_config(hf_dir)
    device = platform.device()
    ids = jobs.tokens(hf_config.vocab_size, batch=BATCH, seq=SEQ, seed=1).to(device)
    positions = torch.arange(SEQ, device=device).expand_as(ids)
    out = {}
    for fused in (True, False):
        model = gpt.build_gpt(hf_config, gpt.ModelSplit(), gpt.resolve_dtype(dtype_name), fused=fused)
        weights.load_hf_weights(model, hf_dir, hf_config)
        ddp = shard.data_parallel()(config=model.config, module=model, ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False))
        logits = ddp(ids, positions, None)[..., :hf_config.vocab_size].float()  # [s, b, V]
        loss = torch.nn.functional.cross_entropy(logits[:-1].flatten(0, 1), ids.t()[1:].flatten())
        loss.backward()
        out["fused" if fused else "unfused"] = {
            "flags": {name: getattr(model.config, name) for name in gpt.FUSIONS},
            "logits": logits.detach().cpu(),
            "grads": {n: p.main_grad.detach().float().cpu() for n, p in model.named_parameters()},
        }
        del ddp, model, logits, loss
    return out


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def models(tiny_qwen2, model_100m):  # noqa: F811
    return {"qwen2-tiny": tiny_qwen2, "llama-95m": model_100m}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", ["qwen2-tiny", "llama-95m"])
def test_fused_paths_match_the_unfused_model(models, model, dtype):
    out = run_on_local_ranks(fusion_job, 1, models[model], dtype)[0]
    fused, unfused = out["fused"], out["unfused"]
    on = [name for name, value in fused["flags"].items() if value]
    print(f"\n{model} {dtype}: fusions in force: {', '.join(on) or 'none'}")
    # torch's CUDA build brings Triton, so SwiGLU and bias-dropout-add at least are fused
    assert fused["flags"]["bias_activation_fusion"] and fused["flags"]["bias_dropout_fusion"], fused["flags"]
    assert not any(unfused["flags"].values()), unfused["flags"]
    tol = TOLERANCE[dtype]
    logits = relative(fused["logits"], unfused["logits"])
    names = list(unfused["grads"])
    assert names == list(fused["grads"])
    everything = relative(torch.cat([fused["grads"][n].flatten() for n in names]),
                          torch.cat([unfused["grads"][n].flatten() for n in names]))
    worst = max(names, key=lambda n: relative(fused["grads"][n], unfused["grads"][n]))
    worst_error = relative(fused["grads"][worst], unfused["grads"][worst])
    print(f"relative errors: logits {logits:.2e}, gradients {everything:.2e}, worst {worst} {worst_error:.2e}")
    assert logits <= tol, (logits, tol)
    assert everything <= tol, (everything, tol)
    assert worst_error <= PER_TENSOR * tol, (worst, worst_error, tol)
