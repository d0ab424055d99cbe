"""Packing named tensors into fixed-size byte buckets: pure planning, no I/O.

A bucket is a list of segments, each a byte range of one tensor. Tensors are laid out in order;
one larger than the space left in a bucket is split across buckets, so every bucket except the
last holds exactly `bucket_bytes` bytes and the sender never needs more than one bucket of
staging memory, whatever the tensor sizes.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=to_dtype(self.dtype)).element_size()

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorSpec":
        return cls(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))


@dataclasses.dataclass(frozen=True)
class Segment:
    index: int  # position of the tensor in the spec list
    offset: int  # first byte of this segment within the tensor
    nbytes: int


def to_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    return dtype


def plan_buckets(specs: list[TensorSpec], bucket_bytes: int) -> list[list[Segment]]:
    """Splits the concatenated bytes of `specs` into buckets of at most `bucket_bytes`."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[list[Segment]] = [[]]
    room = bucket_bytes
    for index, spec in enumerate(specs):
        offset, left = 0, spec.nbytes
        while left > 0:
            if room == 0:
                buckets.append([])
                room = bucket_bytes
            take = min(left, room)
            buckets[-1].append(Segment(index, offset, take))
            offset, left, room = offset + take, left - take, room - take
    return [b for b in buckets if b]
