"""Releasing a role's device memory while vLLM uses the GPUs, and taking it back.

A released tensor keeps its Python object, its views and its shape, but its storage is resized to
zero bytes; what must survive (parameters, Adam moments, fp32 main parameters) is first copied to
host memory (pinned on GPU, so the copy back is one DMA). Restoring resizes each storage back and
copies the bytes in, so every view (a parameter inside megatron's contiguous buffer, its
``main_grad``, an optimizer shard) is valid again. Gradient buffers are not copied: they are
zeroed before every step anyway. Working on storages rather than tensors covers views once.

megatron-core has offload helpers of its own (``_ParamAndGradBuffer.offload_to_cpu``,
``MegatronOptimizer.offload_to_cpu``), but they pin host memory unconditionally and move only
tensors that report ``is_cuda``, so on the CPU platform they fail or do nothing, and they do not
cover a frozen model without DDP buffers (the reference policy). This module is the one code path
for both.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class _Released:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # uint8 copy of the bytes; None: contents need not survive


def _storages(tensors) -> list[torch.UntypedStorage]:
    seen, out = set(), []
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            out.append(storage)
    return out


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def release(keep: list[torch.Tensor], drop: list[torch.Tensor]) -> list[_Released]:
    """Frees the storages of `keep` (copied to host first) and of `drop` (contents discarded);
    a storage in both is kept. Returns what :func:`restore` needs."""
    pin = torch.cuda.is_available()
    released = []
    kept = _storages(keep)
    kept_ptrs = {s.data_ptr() for s in kept}
    for storage in kept:
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
        host.copy_(_bytes_of(storage))
        released.append(_Released(storage, storage.nbytes(), host))
    released += [_Released(s, s.nbytes(), None) for s in _storages(drop) if s.data_ptr() not in kept_ptrs]
    for item in released:
        item.storage.resize_(0)
    if pin:
        torch.cuda.empty_cache()
    return released


def restore(released: list[_Released]) -> None:
    """Gives every released storage its bytes back (zeros where contents were discarded)."""
    for item in released:
        item.storage.resize_(item.nbytes)
        data = _bytes_of(item.storage)
        if item.host is None:
            data.zero_()
        else:
            data.copy_(item.host, non_blocking=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
