"""Device, distributed backend and megatron-core start-up for GPU (NCCL) and CPU (gloo) alike.

Every process that builds megatron-core models calls :func:`init_distributed` first; it is the
only place that decides between CUDA + NCCL and CPU + gloo.
"""

from __future__ import annotations

import datetime
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist

from agentgym_mega.platform import cpu_megatron

# megatron is imported inside the functions that use it: the trainer's driver and the vLLM engines
# import this module for the device and vLLM's environment, and build no megatron model.

# A collective of the world group waits this long for its peers (torch's default for NCCL); the
# trainer's ranks wait longer where a checkpoint save may take longer (agentgym_mega.checkpoint_timing).
PROCESS_GROUP_TIMEOUT_S = 600.0
MEGATRON_GROUP_TIMEOUT_MIN = 30  # megatron-core's default for the TP/PP/DP groups it builds


def has_cuda() -> bool:
    return torch.cuda.is_available()


def device() -> torch.device:
    """The device this process computes on: its local GPU, or the CPU."""
    if has_cuda():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def dist_backend() -> str:
    return "nccl" if has_cuda() else "gloo"


def init_distributed(tp: int = 1, pp: int = 1, seed: int = 0, timeout_s: float = PROCESS_GROUP_TIMEOUT_S) -> None:
    """Joins the process group (env:// rendezvous, as torchrun sets it), then megatron's groups.
    A collective waits `timeout_s` for its peers, in megatron's groups at least their default.

    On CPU this first installs the layer that lets megatron-core run without CUDA.
    """
    from megatron.core import parallel_state

    cpu_megatron.enable()
    if os.environ.get("MASTER_ADDR", "127.0.0.1").startswith("127."):
        # All ranks on this host: keep gloo's connections on loopback too (it would otherwise
        # use the address the hostname resolves to).
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if has_cuda():
        torch.cuda.set_device(device())
    if not dist.is_initialized():
        dist.init_process_group(
            backend=dist_backend(), timeout=datetime.timedelta(seconds=timeout_s)
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            distributed_timeout_minutes=max(MEGATRON_GROUP_TIMEOUT_MIN, math.ceil(timeout_s / 60)),
        )
    seed_everything(seed)


def seed_everything(seed: int) -> None:
    """Seeds Python, NumPy and torch, and megatron's tensor-parallel RNG tracker."""
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def shutdown() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def vllm_environment() -> None:
    """Environment defaults vLLM needs on this platform; values already set are kept."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are local directories
    if not has_cuda():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes far more
