"""How a rank's slice of a batch is cut into micro-batches, each padded only to its own width.

Two ways, as verl offers: a fixed number of sequences per micro-batch (`trainer.micro_batch_size`,
in order), or a token budget (`trainer.max_tokens_per_gpu`): whole sequences dealt, longest first,
into the fewest bins whose padded size (longest sequence x sequences) stays within the budget,
each sequence going to the bin holding the fewest tokens so far (balanced bins). Pure functions:
the worker applies them and puts the results back in the slice's order.
"""

from __future__ import annotations

import math

from agentgym_mega.errors import BadInput


def padded_width(longest: int, multiple: int = 1) -> int:
    """A micro-batch's width: its longest sequence rounded up to `multiple` (the TP size when
    sequence parallel splits the sequence over TP ranks)."""
    return -(-max(longest, 1) // multiple) * multiple


def _deal(lengths: list[int], bins: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out: list[list[int]] = [[] for _ in range(bins)]
    load = [0] * bins
    for i in order:
        target = min(range(bins), key=lambda b: (load[b], b))
        out[target].append(i)
        load[target] += lengths[i]
    return [sorted(b) for b in out if b]


def token_bins(lengths: list[int], max_tokens: int, multiple: int = 1, min_bins: int = 1) -> list[list[int]]:
    """Indices into `lengths` per micro-batch: at least `min_bins` bins (so that data-parallel
    ranks can agree on one count) and as few as keep every bin's padded size within `max_tokens`."""
    longest = padded_width(max(lengths), multiple)
    if longest > max_tokens:
        raise BadInput(f"trainer.max_tokens_per_gpu={max_tokens}: a sequence of {max(lengths)} tokens "
                       f"(padded to {longest}) does not fit in one micro-batch; raise it to at least {longest}")
    bins = max(min_bins, math.ceil(sum(lengths) / max_tokens))
    while True:
        dealt = _deal(lengths, min(bins, len(lengths)))
        if all(padded_width(max(lengths[i] for i in b), multiple) * len(b) <= max_tokens for b in dealt):
            return dealt
        bins += 1


def fixed_bins(count: int, micro_batch_size: int | None) -> list[list[int]]:
    """Consecutive micro-batches of `micro_batch_size` sequences (the last may be smaller); None:
    one micro-batch of all."""
    size = micro_batch_size or max(count, 1)
    return [list(range(start, min(start + size, count))) for start in range(0, count, size)]
