"""The CPU platform layer: what it changes on CPU, and that it changes nothing when CUDA exists."""

import subprocess
import sys

import pytest
import torch

from agentgym_mega import platform
from agentgym_mega.platform import cpu_megatron

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")


@pytest.fixture(scope="module", autouse=True)
def cpu_layer():
    assert cpu_megatron.enable() is True
    assert cpu_megatron.enable() is True  # idempotent


def test_device_and_backend_on_cpu():
    assert platform.device() == torch.device("cpu")
    assert platform.dist_backend() == "gloo"


def test_cuda_placement_requests_land_on_cpu():
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.empty(3, device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.ones(1, device=torch.device("cuda", 0)).device.type == "cpu"
    t = torch.arange(4.0)
    assert t.cuda() is t
    assert t.to("cuda").device.type == "cpu"
    assert t.to(device="cuda", dtype=torch.float64).dtype == torch.float64
    assert t.to(torch.float16).dtype == torch.float16  # non-device .to() still works


def test_cpu_float_tensors_report_cuda_type_names():
    # megatron's grad clipping and distributed optimizer assert on these strings.
    assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
    assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.zeros(1, dtype=torch.int64).type() == "torch.LongTensor"
    assert torch.zeros(1).type(torch.float64).dtype == torch.float64  # conversion form untouched


def test_streams_and_events_are_synchronous_stand_ins():
    stream = torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        torch.ones(10).sum()
        end.record()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert start.query() and end.elapsed_time(start) <= 0 <= start.elapsed_time(end)


def test_megatron_rng_tracker_is_seeded_and_separate_from_the_default_stream():
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()

    def draws():
        tracker.reset()
        torch.manual_seed(1)
        tracker.add("model-parallel-rng", 1234)  # what model_parallel_cuda_manual_seed does per TP rank
        with tracker.fork():
            forked = torch.rand(4)
        return forked, torch.rand(4)

    forked_a, default_a = draws()
    forked_b, default_b = draws()
    assert torch.equal(forked_a, forked_b) and torch.equal(default_a, default_b)  # reproducible
    assert not torch.equal(forked_a, default_a)  # the tracker has its own state


def test_enable_changes_nothing_when_cuda_is_available():
    # A fresh interpreter that believes CUDA exists: the layer must leave torch untouched.
    code = (
        "import torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "before = (torch.cuda.current_device, torch.cuda.Stream, torch.cuda.manual_seed, torch.Tensor.type)\n"
        "from agentgym_mega.platform import cpu_megatron\n"
        "assert cpu_megatron.enable() is False and not cpu_megatron.is_enabled()\n"
        "after = (torch.cuda.current_device, torch.cuda.Stream, torch.cuda.manual_seed, torch.Tensor.type)\n"
        "assert before == after\n"
        "assert torch._C._len_torch_function_stack() == 0\n"
        "assert torch.zeros(1).type() == 'torch.FloatTensor'\n"
        "print('untouched')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and "untouched" in result.stdout, result.stderr


def test_cuda_placement_is_mapped_inside_python_backward_functions():
    # Activation recompute re-runs megatron's forward inside an autograd Function's backward,
    # where the autograd engine does not carry the thread's TorchFunctionMode.
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * torch.full_like(grad, 2.0, device="cuda")

    x = torch.ones(3, requires_grad=True)
    Double.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def _values_and_grads(fn, *inputs, grad_seed=0):
    inputs = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*inputs)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out.dtype)
    out.backward(upstream)
    return [out.detach()] + [x.grad for x in inputs]


def _rope_case(dtype, rot_dim, halves_equal=True):
    g = torch.Generator().manual_seed(1)
    s, b, heads, d = 7, 3, 4, 16
    # q as megatron has it: a [s, b, heads, d] view into the mixed QKV projection, not contiguous
    t = torch.randn(s, b, heads, 3 * d, generator=g)[..., d:2 * d].to(dtype)
    half = torch.outer(torch.arange(s, dtype=torch.float32), 10000.0 ** -torch.arange(0, 1, 2 / rot_dim))
    other = half if halves_equal else torch.randn(half.shape, generator=g)
    freqs = torch.cat([half, other], dim=-1)[:, None, None, :]
    return t, freqs


@pytest.mark.parametrize("dtype,rot_dim,halves_equal", [
    (torch.float32, 16, True), (torch.float32, 16, False), (torch.float32, 8, True), (torch.bfloat16, 16, True)])
def test_rotary_stand_in_matches_megatrons_unfused_rope(dtype, rot_dim, halves_equal):
    from megatron.core.models.common.embeddings import rope_utils

    assert rope_utils.fused_apply_rotary_pos_emb is cpu_megatron.fused_apply_rotary_pos_emb
    t, freqs = _rope_case(dtype, rot_dim, halves_equal)
    ours = _values_and_grads(lambda x: cpu_megatron.fused_apply_rotary_pos_emb(x, freqs), t)
    megatron = _values_and_grads(lambda x: rope_utils._apply_rotary_pos_emb_bshd(x, freqs), t)
    for mine, theirs in zip(ours, megatron):  # output, then the gradient of t
        assert mine.dtype == theirs.dtype == dtype
        # fp32: the same products, added in another order; bf16: its own rounding (~4e-3)
        tolerance = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 2e-2}
        torch.testing.assert_close(mine, theirs, **tolerance)


def test_rotary_stand_in_hands_interleaved_channels_to_megatron():
    from megatron.core.models.common.embeddings import rope_utils

    t, freqs = _rope_case(torch.float32, 16)
    assert torch.equal(cpu_megatron.fused_apply_rotary_pos_emb(t, freqs, interleaved=True),
                       rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=True))


@pytest.mark.parametrize("with_bias", [False, True])
def test_swiglu_stand_in_matches_megatrons_unfused_glu(with_bias):
    from megatron.core.transformer import mlp

    assert mlp.bias_swiglu_impl is cpu_megatron.bias_swiglu_impl
    g = torch.Generator().manual_seed(2)
    y, bias = torch.randn(5, 3, 2 * 12, generator=g), torch.randn(2 * 12, generator=g)

    def unfused(y, bias):  # megatron's MLP with bias_activation_fusion off
        a, b = torch.chunk(y + bias if with_bias else y, 2, dim=-1)
        return torch.nn.functional.silu(a) * (b + 0.0)

    ours = _values_and_grads(lambda y, bias: cpu_megatron.bias_swiglu_impl(y, bias if with_bias else None), y, bias)
    reference = _values_and_grads(unfused, y, bias)
    assert ours[0].shape == (5, 3, 12)
    assert (ours[2] is None) == (reference[2] is None) == (not with_bias)
    for mine, theirs in zip(ours, reference):  # output, gradient of y, of the bias
        if theirs is not None:
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)


def test_swiglu_stand_in_refuses_fp8_activations_by_name():
    with pytest.raises(NotImplementedError, match="fp8"):
        cpu_megatron.bias_swiglu_impl(torch.zeros(2, 4), None, fp8_input_store=True)


def test_megatron_runs_the_fused_paths_through_the_stand_ins_on_cpu():
    from transformers import Qwen2Config

    from agentgym_mega.models import gpt

    hf_config = Qwen2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                            num_hidden_layers=2, vocab_size=128, architectures=["Qwen2ForCausalLM"])
    config = gpt.transformer_config(hf_config, gpt.ModelSplit(), torch.float32)
    assert config.apply_rope_fusion and config.bias_activation_fusion and config.gradient_accumulation_fusion
