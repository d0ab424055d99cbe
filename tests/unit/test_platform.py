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
