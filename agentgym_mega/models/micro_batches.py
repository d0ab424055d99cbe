"""How a rank's slice of a batch is cut into micro-batches, each padded only to its own width.

Two ways, as verl offers: a fixed number of sequences per micro-batch (`trainer.micro_batch_size`,
in order), or a token budget (`trainer.max_tokens_per_gpu`): whole sequences, sorted longest
first, cut into consecutive bins whose padded size (longest sequence x sequences) stays within the
budget, so that sequences of like length are padded together. (Bins balanced by real tokens, as
verl deals them for packed sequences, mix long and short ones; padded, they made the demo model's
log-prob pass and updates slower, docs/results.md.) Pure functions: the model shard applies them and puts
the results back in the slice's order.
"""

from __future__ import annotations

from agentgym_mega.errors import BadInput


def padded_width(longest: int, multiple: int = 1) -> int:
    """A micro-batch's width: its longest sequence rounded up to `multiple` (the TP size when
    sequence parallel splits the sequence over TP ranks)."""
    return -(-max(longest, 1) // multiple) * multiple


def _split_largest(lengths: list[int], bins: list[list[int]], multiple: int) -> None:
    """Halves (in place) the bin with the most padded tokens; its first half keeps the longer."""
    largest = max(range(len(bins)), key=lambda b: (padded_width(lengths[bins[b][0]], multiple) * len(bins[b]), -b))
    run = bins[largest]
    half = -(-len(run) // 2)
    bins[largest:largest + 1] = [run[:half], run[half:]]


def token_bins(lengths: list[int], max_tokens: int, multiple: int = 1, min_bins: int = 1) -> list[list[int]]:
    """Indices into `lengths` per micro-batch: at least `min_bins` bins (so that data-parallel
    ranks can agree on one count), cut from the sequences sorted longest first, each bin taking
    the next sequences while its padded size (its first sequence's width x sequences) stays within
    `max_tokens`. Sequences of like length share a bin, so little of a bin is padding."""
    longest = padded_width(max(lengths), multiple)
    if longest > max_tokens:
        raise BadInput(f"trainer.max_tokens_per_gpu={max_tokens}: a sequence of {max(lengths)} tokens "
                       f"(padded to {longest}) does not fit in one micro-batch; raise it to at least {longest}")
    bins: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if bins and padded_width(lengths[bins[-1][0]], multiple) * (len(bins[-1]) + 1) <= max_tokens:
            bins[-1].append(i)
        else:
            bins.append([i])
    while len(bins) < min(min_bins, len(lengths)):
        _split_largest(lengths, bins, multiple)
    return [sorted(b) for b in bins]


def fixed_bins(count: int, micro_batch_size: int | None) -> list[list[int]]:
    """Consecutive micro-batches of `micro_batch_size` sequences (the last may be smaller); None:
    one micro-batch of all."""
    size = micro_batch_size or max(count, 1)
    return [list(range(start, min(start + size, count))) for start in range(0, count, size)]
