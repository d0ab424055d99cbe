"""CUDA IPC handles: what the sender's ring sends for a bucket slot (a pickle, from torch's
reduce_tensor) and how an engine worker maps it. A handle is read by an unpickler that resolves
nothing but the few torch names a handle consists of, and its device index is rewritten for the
same physical GPU in the receiving process."""

from __future__ import annotations

import io
import pickle
from typing import Sequence

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, rebuild_tensor, reduce_tensor

from agentgym_mega.weight_sync.base import SyncError
from agentgym_mega.weight_sync.buckets import TensorSpec
from agentgym_mega.weight_sync.topology import logical_device


def _storage_from_bytes(data: bytes):
    """What a pickled CPU storage loads through (torch.storage._load_from_bytes), with torch's
    weights-only loader instead of an unrestricted one."""
    return torch.load(io.BytesIO(data), weights_only=True)


class HandleUnpickler(pickle.Unpickler):
    """Resolves only the names `reduce_tensor` output consists of: a handle that names anything
    else (os.system, builtins, ...) is refused before any of it runs."""

    ALLOWED = {
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
        ("torch.multiprocessing.reductions", "rebuild_tensor"),
        ("torch", "Tensor"),
        ("torch._tensor", "Tensor"),
        ("torch.nn.parameter", "Parameter"),
        ("torch", "Size"),
        ("torch", "TypedStorage"),
        ("torch", "UntypedStorage"),
        ("torch.storage", "TypedStorage"),
        ("torch.storage", "UntypedStorage"),
    }

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _storage_from_bytes
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise SyncError(f"refusing a CUDA IPC handle that names {module}.{name}")


def device_uuid(index: int | None) -> str:
    """The physical identity of a CUDA device of this process (its index depends on the process's
    CUDA_VISIBLE_DEVICES; the UUID does not)."""
    return str(torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index).uuid)


def device_id(worker: int = 0) -> str | None:
    """This process's device as weight sync pairs it (see topology): its current GPU's UUID, else
    the logical device its placement gave it (`worker`: its rank within an engine), else None."""
    return device_uuid(None) if torch.cuda.is_available() else logical_device(worker)


_STORAGE_DEVICE = 6  # rebuild_cuda_tensor's argument naming the sender's device index


def rewrite_device(args: tuple, sender_uuid: str | None, local_uuids: Sequence[str]) -> tuple:
    """rebuild_cuda_tensor's arguments with the sender's device index replaced by this process's
    index of the same physical GPU: under Ray each process sees its own CUDA_VISIBLE_DEVICES, so
    the trainer's cuda:0 can be the engine's cuda:3. A GPU this process cannot see is an error."""
    if sender_uuid is None:
        raise SyncError("a CUDA IPC handle without the sender's device UUID: cannot tell which GPU it is on")
    if sender_uuid not in local_uuids:
        raise SyncError(f"CUDA IPC handle on GPU {sender_uuid}, which this engine worker cannot see "
                        f"(it sees {', '.join(local_uuids) or 'none'}): CUDA IPC needs the trainer rank and the "
                        "engine worker on the same GPU; use weight_sync.transport=collective")
    args = list(args)
    args[_STORAGE_DEVICE] = list(local_uuids).index(sender_uuid)
    return tuple(args)


def handle_of(slot: torch.Tensor) -> bytes:
    """The CUDA IPC handle of a bucket slot, as the HANDLE message's frame carries it."""
    return pickle.dumps(reduce_tensor(slot))


def load_handle(data: bytes, spec: TensorSpec, sender_uuid: str | None) -> torch.Tensor:
    """The slot a handle names, mapped into this process (checked against `spec`)."""
    try:
        loaded = HandleUnpickler(io.BytesIO(data)).load()
    except SyncError:
        raise
    except Exception as exc:
        raise SyncError(f"malformed CUDA IPC handle for {spec.name}: {type(exc).__name__}: {exc}") from None
    if not (isinstance(loaded, tuple) and len(loaded) == 2 and loaded[0] in (rebuild_cuda_tensor, rebuild_tensor)
            and isinstance(loaded[1], tuple)):
        raise SyncError(f"malformed CUDA IPC handle for {spec.name}")
    fn, args = loaded
    if fn is rebuild_cuda_tensor:
        args = rewrite_device(args, sender_uuid, [device_uuid(i) for i in range(torch.cuda.device_count())])
    tensor = fn(*args)
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != spec.shape \
            or str(tensor.dtype).removeprefix("torch.") != spec.dtype:
        raise SyncError(f"CUDA IPC handle for {spec.name} does not match its spec {spec.dtype}{list(spec.shape)}")
    return tensor
