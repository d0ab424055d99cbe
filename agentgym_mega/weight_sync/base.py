"""The weight-synchronisation interface the trainer loop calls once per step."""

from __future__ import annotations

import abc
from typing import Iterable, Sequence

import torch


class WeightSynchronizer(abc.ABC):
    @abc.abstractmethod
    def sync(self, named_tensors: Iterable[tuple[str, torch.Tensor]], engines: Sequence, version: int):
        """Delivers one complete version of the weights (Hugging Face names, full tensors) to
        every engine. Returns transfer statistics; raises SyncError if any engine did not take
        the update, in which case that engine still serves its previous version."""
