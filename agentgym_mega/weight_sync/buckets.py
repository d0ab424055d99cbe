"""Packing a stream of named tensors into byte buckets of a fixed size: no I/O here.

Tensors are laid out in order and split wherever a bucket is full: the receiver writes every
segment straight into its place in the tensor, so a split costs nothing. Packing is lazy: a
bucket is yielded as soon as it is full, so the sender holds one bucket and the tensor being
packed, never the whole model.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Iterator

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

    def view_of(self, data: torch.Tensor) -> torch.Tensor:
        """The tensor whose bytes `data` (uint8, flat) holds."""
        return data.view(to_dtype(self.dtype)).view(self.shape)


@dataclasses.dataclass(frozen=True)
class Segment:
    index: int  # position of the tensor in the stream
    offset: int  # first byte of this segment within the tensor
    nbytes: int


@dataclasses.dataclass
class Bucket:
    specs: dict[int, TensorSpec]  # tensors introduced here; their bytes start here or later
    segments: list[Segment]
    payloads: list[torch.Tensor]  # uint8 views, one per segment, sharing the tensors' memory


def to_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    return dtype


def as_bytes(tensor: torch.Tensor, device: str | torch.device = "cpu") -> torch.Tensor:
    """A flat uint8 view of the tensor on `device` (no copy when it is already a contiguous tensor there)."""
    return tensor.detach().to(device).contiguous().view(-1).view(torch.uint8)


def pack(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
         device: str | torch.device = "cpu") -> Iterator[Bucket]:
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket, room = Bucket({}, [], []), bucket_bytes
    for index, (name, tensor) in enumerate(named_tensors):
        bucket.specs[index] = TensorSpec.of(name, tensor)
        data, offset = as_bytes(tensor, device), 0
        while offset < data.numel():
            if room == 0:
                yield bucket
                bucket, room = Bucket({}, [], []), bucket_bytes
            take = min(data.numel() - offset, room)
            bucket.segments.append(Segment(index, offset, take))
            bucket.payloads.append(data[offset : offset + take])
            offset, room = offset + take, room - take
    if bucket.specs or bucket.segments:
        yield bucket


def fill(buffer: torch.Tensor, bucket: Bucket) -> int:
    """Copies a bucket's payloads into the front of `buffer`, in order; returns the bytes used."""
    offset = 0
    for payload in bucket.payloads:
        buffer[offset : offset + payload.numel()].copy_(payload)
        offset += payload.numel()
    return offset


def bucket_header(op: str, bucket: Bucket, **extra) -> dict:
    """A bucket's description as its stream carries it (JSON): the specs of the tensors it
    introduces and its segments."""
    return {"op": op, "specs": {i: dataclasses.astuple(s) for i, s in bucket.specs.items()},
            "segments": [dataclasses.astuple(s) for s in bucket.segments], **extra}
