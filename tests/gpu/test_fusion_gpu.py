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

# Relative error, ||a - b|| / ||b||, of the logits and of all gradients together; a single
# parameter's gradient may be off by PER_TENSOR times as much (a small gradient's rounding weighs
# more). A fusion that computes something else is off by tens of percent.
# fp32: fused against unfused within FP32_TOLERANCE. The fused kernels add and multiply in
# another order (and Transformer Engine's GEMMs may round inputs to TF32, 10 bits, where an
# operand differs in its last bit): 1e-7 per operation, grown over the layers, stays under 1e-4.
# (Through the CPU stand-ins, the 95M model's fp32 logits differ by 7e-7, its gradients by 9e-7.)
# bf16: the two bf16 models differ by their roundings (through the CPU stand-ins, 1.3e-2 in the
# tiny model's logits, 1.2e-2 in the 95M's), which no fixed bound separates from a small bug. So
# each is compared with the unfused fp32 model: a fused kernel computes in fp32 and rounds once
# where the unfused path rounds after each operation, so the fused bf16 model is no further from
# fp32 than the unfused one is (through the stand-ins: 1.002 times as far for the 95M's logits,
# 1.003 for its gradients); BF16_RATIO leaves room for which of the two roundings lands closer.
FP32_TOLERANCE = 1e-4
PER_TENSOR = 3
BF16_RATIO = 1.25
BATCH, SEQ = 2, 256


def own_copy(tensor: torch.Tensor) -> torch.Tensor:
    """fp32 on the host, in its own storage: a main_grad is a view into DDP's whole gradient
    buffer, which pickling a view would carry along for every parameter."""
    return tensor.detach().to("cpu", torch.float32, copy=True)


def fusion_job(hf_dir: str, dtype_name: str) -> dict:
    """Per build (fused, unfused; with bf16 also the unfused fp32 model): the fusion flags its
    config has, the logits of one batch and every parameter's gradient (megatron's DDP
    main_grad, which the fused weight-gradient GEMM writes into) after backpropagating the
    batch's mean next-token loss."""
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
    builds = {"fused": (dtype_name, True), "unfused": (dtype_name, False)}
    if dtype_name != "float32":
        builds["fp32"] = ("float32", False)
    for build, (dtype, fused) in builds.items():
        model = gpt.build_gpt(hf_config, gpt.ModelSplit(), gpt.resolve_dtype(dtype), fused=fused)
        weights.load_hf_weights(model, hf_dir, hf_config)
        ddp = shard.data_parallel()(config=model.config, module=model, ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False))
        logits = ddp(ids, positions, None)[..., :hf_config.vocab_size].float()  # [s, b, V]
        loss = torch.nn.functional.cross_entropy(logits[:-1].flatten(0, 1), ids.t()[1:].flatten())
        loss.backward()
        out[build] = {
            "flags": {name: getattr(model.config, name) for name in gpt.FUSIONS},
            "logits": own_copy(logits),
            "grads": {n: own_copy(p.main_grad) for n, p in model.named_parameters()},
        }
        del ddp, model, logits, loss
    return out


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def errors(build: dict, reference: dict) -> dict:
    """Relative errors of ``build`` to ``reference``: logits, all gradients together, and the
    worst parameter's gradient (its name, its error)."""
    names = list(reference["grads"])
    assert names == list(build["grads"])
    flat = [torch.cat([b["grads"][n].flatten() for n in names]) for b in (build, reference)]
    per_tensor = {n: relative(build["grads"][n], reference["grads"][n]) for n in names}
    worst = max(per_tensor, key=per_tensor.get)
    return {"logits": relative(build["logits"], reference["logits"]), "grads": relative(*flat),
            "worst": (worst, per_tensor[worst])}


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
    if dtype == "float32":
        error = errors(fused, unfused)
        print(f"fused to unfused: {error}")
        assert error["logits"] <= FP32_TOLERANCE and error["grads"] <= FP32_TOLERANCE, error
        assert error["worst"][1] <= PER_TENSOR * FP32_TOLERANCE, error
        return
    mine, theirs = errors(fused, out["fp32"]), errors(unfused, out["fp32"])
    print(f"to fp32: fused {mine}, unfused {theirs}")
    for key in ("logits", "grads"):
        assert mine[key] <= BF16_RATIO * theirs[key], (key, mine, theirs)
    assert mine["worst"][1] <= PER_TENSOR * BF16_RATIO * theirs["worst"][1], (mine, theirs)
