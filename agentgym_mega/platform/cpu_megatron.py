"""Lets megatron-core run on CPU processes (gloo) when CUDA is absent.

megatron-core has no CPU path: it allocates with ``device="cuda"`` or
``torch.cuda.current_device()``, records CUDA streams and events, seeds CUDA generators and
checks tensor types against ``torch.cuda.FloatTensor`` strings. Rather than fork megatron, we
make the CPU look like "device 0" to it:

* a ``TorchFunctionMode`` rewrites every CUDA device argument to CPU, makes ``Tensor.cuda()`` and
  ``pin_memory()`` identity operations and reports CPU float tensors under their CUDA type name
  (which is what megatron's grad clipping and distributed optimizer assert on);
* the ``torch.cuda`` calls megatron makes get CPU stand-ins (streams and events become
  synchronous no-ops, the CUDA RNG becomes the CPU generator);
* megatron's own CUDA RNG helpers are pointed at the CPU generator;
* apex's weight-gradient accumulation kernel gets a CPU stand-in, so that megatron's
  ``gradient_accumulation_fusion`` works here too (:class:`WgradAccumulation`), and so do the
  fused rotary embedding (Transformer Engine's, :class:`RotaryEmbedding`) and megatron's fused
  SwiGLU (:class:`SwiGLU`), which megatron would otherwise hand to ``torch.compile``.

Everything here is installed only by :func:`enable`, which does nothing when CUDA is available,
so GPU behaviour is untouched.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch.overrides import TorchFunctionMode

# megatron is imported inside the functions that patch it: `platform` imports this module in
# every process, megatron is imported only by those that build a model.

_CPU = torch.device("cpu")
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}
_enabled = False


def _is_cuda_device(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # megatron passes torch.cuda.current_device(), an ordinal
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _identity(tensor, *args, **kwargs):
    return tensor


def _to(tensor, *args, **kwargs):
    # Tensor.to(device, ...), Tensor.to("cuda"), Tensor.to(device=...): drop CUDA targets.
    if args and _is_cuda_device(args[0]):
        args = (_CPU,) + tuple(args[1:])
    if _is_cuda_device(kwargs.get("device")):
        kwargs["device"] = _CPU
    return torch.Tensor.to(tensor, *args, **kwargs)


def _type(tensor, *args, **kwargs):
    name = torch.Tensor.type(tensor, *args, **kwargs)
    if args or kwargs:
        return name
    return _CUDA_TYPE_NAMES.get(name, name)


class CudaAsCpuMode(TorchFunctionMode):
    """Maps CUDA placement requests to CPU for every torch call made while it is active."""

    _METHODS = {
        torch.Tensor.cuda: _identity,
        torch.Tensor.pin_memory: _identity,
        torch.Tensor.to: _to,
        torch.Tensor.type: _type,
    }

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        replacement = self._METHODS.get(func)
        if replacement is not None:
            return replacement(*args, **kwargs)  # the mode is off inside its own handler
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        return func(*args, **kwargs)


class CpuEvent:
    """Stand-in for ``torch.cuda.Event``: CPU work is synchronous, so an event is a timestamp."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self._time = None

    def record(self, stream=None):
        self._time = time.perf_counter()

    def wait(self, stream=None):
        pass

    def query(self) -> bool:
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, end: "CpuEvent") -> float:
        return (end._time - self._time) * 1000.0


class CpuStream:
    """Stand-in for ``torch.cuda.Stream``: everything already ran in order on the CPU."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        event = event or CpuEvent()
        event.record()
        return event

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True


_STREAM = CpuStream()


def _noop():
    # A new function object per stand-in: torch._dynamo keys its trace rules by function identity
    # and rejects one object registered under two torch.cuda names.
    def noop(*args, **kwargs):
        return None

    return noop


def _cpu_generator_seed(seed):
    # torch.manual_seed calls torch.cuda.manual_seed_all, so seeding must not go through it.
    torch.default_generator.manual_seed(int(seed))


def _cuda_stand_ins() -> dict:
    return {
        "current_device": lambda: 0,
        "set_device": _noop(),
        "synchronize": _noop(),
        "empty_cache": _noop(),
        "Stream": CpuStream,
        "Event": CpuEvent,
        "current_stream": lambda device=None: _STREAM,
        "default_stream": lambda device=None: _STREAM,
        "stream": lambda stream=None: contextlib.nullcontext(),
        "set_stream": _noop(),
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        "set_rng_state": lambda state, device="cuda": torch.set_rng_state(state),
        "manual_seed": _cpu_generator_seed,
        "manual_seed_all": _noop(),
    }


def _patch_torch_cuda():
    for name, value in _cuda_stand_ins().items():
        setattr(torch.cuda, name, value)
    for name in ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all"):
        setattr(torch.cuda.random, name, getattr(torch.cuda, name))
    torch.cuda.nvtx.range_push = _noop()
    torch.cuda.nvtx.range_pop = _noop()
    torch.cuda.nvtx.range = lambda *a, **k: contextlib.nullcontext()


class WgradAccumulation:
    """Stand-in for apex's ``fused_weight_gradient_mlp_cuda``: the weight-gradient GEMM of
    megatron's linear layers adds straight into the parameter's fp32 ``main_grad``. Unfused,
    megatron computes each weight gradient into a new tensor that DDP's hook then adds to
    ``main_grad``: one more allocation and pass over every gradient per micro-batch."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
        main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` over the first ``cos.shape[-1]`` channels (the rest pass
    through), or with ``backward`` the gradient of that map, each half written into its place in
    one output: no negated copy, no concatenation."""
    h = cos.shape[-1] // 2
    c1, c2, s1, s2 = cos[..., :h], cos[..., h:], sin[..., :h], sin[..., h:]
    x1, x2 = x[..., :h], x[..., h:2 * h]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1, o2 = out[..., :h], out[..., h:2 * h]
    if backward:  # d/dx1 = g1 c1 + g2 s2, d/dx2 = g2 c2 - g1 s1
        torch.mul(x1, c1, out=o1).addcmul_(x2, s2)
        torch.mul(x2, c2, out=o2).addcmul_(x1, s1, value=-1)
    else:  # y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2
        torch.mul(x1, c1, out=o1).addcmul_(x2, s1, value=-1)
        torch.mul(x2, c2, out=o2).addcmul_(x1, s2)
    if x.shape[-1] > 2 * h:
        out[..., 2 * h:] = x[..., 2 * h:]
    return out


class RotaryEmbedding(torch.autograd.Function):
    """Stand-in for Transformer Engine's fused rotary embedding (``[s, b, heads, d]``, halves not
    interleaved), computing what megatron's unfused ``_apply_rotary_pos_emb_bshd`` does in four
    half-width passes each way. Unfused, megatron slices, negates and concatenates q and k in the
    forward pass and concatenates their gradients again in the backward pass. With
    :class:`SwiGLU`, this shortens a CPU training step (docs/results.md)."""

    @staticmethod
    def forward(ctx, t, freqs):
        # cos and sin in fp32 then cast, as megatron's unfused path does
        cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
        ctx.save_for_backward(cos, sin)
        return _rope(t, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rope(grad, cos, sin, backward=True), None


def fused_apply_rotary_pos_emb(t, freqs, transpose_output_memory=False, interleaved=False):
    """megatron's name and signature for the fused kernel (``rope_utils``); interleaved channels
    go to megatron's own unfused path."""
    if interleaved:
        from megatron.core.models.common.embeddings import rope_utils

        return rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=True)
    return RotaryEmbedding.apply(t, freqs)


class SwiGLU(torch.autograd.Function):
    """``silu(a) * b`` of ``y = [a, b]`` (megatron's fused SwiGLU, ``bias_swiglu_impl``). It keeps
    ``y`` alone for the backward pass and writes both halves of the gradient into one tensor;
    megatron's unfused GLU keeps ``y`` and two more half-size tensors, adds a zero offset and
    concatenates the gradient."""

    @staticmethod
    def forward(ctx, y):
        a, b = y.chunk(2, dim=-1)
        ctx.save_for_backward(y)
        return torch.nn.functional.silu(a).mul_(b)

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        a, b = y.chunk(2, dim=-1)
        grad_y = torch.empty_like(y)
        grad_a, grad_b = grad_y.chunk(2, dim=-1)
        torch.ops.aten.silu.out(a, out=grad_b).mul_(grad)
        torch.mul(grad, b, out=grad_a)
        torch.ops.aten.silu_backward.grad_input(grad_a, a, grad_input=grad_a)
        return grad_y


def bias_swiglu_impl(input, bias, fp8_input_store=False, cpu_offload_input=False):
    """megatron's name and signature (``fused_bias_swiglu``)."""
    if fp8_input_store:
        raise NotImplementedError("activation_func_fp8_input_store: FP8 activations need Transformer Engine on GPU")
    return SwiGLU.apply(input if bias is None else input + bias)


def _patch_megatron():
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.tensor_parallel import layers
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer import mlp
    from megatron.core.transformer.moe import shared_experts

    layers.fused_weight_gradient_mlp_cuda = WgradAccumulation
    layers._grad_accum_fusion_available = True
    rope_utils.fused_apply_rotary_pos_emb = fused_apply_rotary_pos_emb
    mlp.bias_swiglu_impl = shared_experts.bias_swiglu_impl = bias_swiglu_impl

    mp_random._get_cuda_rng_state = lambda *a, clone=False, **k: (
        torch.get_rng_state().clone() if clone else torch.get_rng_state()
    )
    mp_random._set_cuda_rng_state = lambda new_state, *a, **k: torch.set_rng_state(new_state)


def _patch_autograd_backward():
    # The autograd engine runs Python backward functions without the thread's TorchFunctionMode
    # stack, so megatron code running there (activation recompute re-runs the forward, which
    # allocates on "cuda") needs the mode entered again.
    function = torch.autograd.function.BackwardCFunction
    original = function.apply

    def apply(self, *args):
        with CudaAsCpuMode():
            return original(self, *args)

    function.apply = apply


def enable() -> bool:
    """Installs the CPU layer once per process. Returns True when it is (now) active.

    A no-op returning False when CUDA is available: GPU runs use megatron-core unchanged.
    """
    global _enabled
    if torch.cuda.is_available():
        return False
    if not _enabled:
        _patch_megatron()
        _patch_torch_cuda()
        _patch_autograd_backward()
        # Entered for the life of the process: megatron allocates on "cuda" at any time.
        CudaAsCpuMode().__enter__()
        _enabled = True
    return True


def is_enabled() -> bool:
    return _enabled
