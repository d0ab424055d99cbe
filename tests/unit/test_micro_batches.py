"""Cutting a rank's slice into micro-batches (models.micro_batches), by hand."""

import pytest

from agentgym_mega.errors import BadInput
from agentgym_mega.models.micro_batches import fixed_bins, padded_width, token_bins

LENGTHS = [24, 10, 17, 5, 24, 12, 8, 20]  # 120 real tokens


def test_bins_by_hand():
    # Longest first: 24, 24, 20, 17, 12, 10, 8, 5. A third sequence in the 24s' bin would pad to
    # 72 > 48, so 20 opens a bin; 12 would make it 60, so 12 opens one, which takes 10, 8 and 5
    # (12 x 4 = 48). 136 padded tokens for 120 real ones.
    bins = token_bins(LENGTHS, 48)
    assert bins == [[0, 4], [2, 7], [1, 3, 5, 6]]
    assert [padded_width(max(LENGTHS[i] for i in b)) * len(b) for b in bins] == [48, 40, 48]
    assert token_bins([5, 5, 5, 5], 100) == [[0, 1, 2, 3]]
    # Too few bins for the other DP ranks: the bin with the most padded tokens is halved, the
    # longer sequences in its first half.
    assert token_bins([5, 5, 5, 5], 100, min_bins=2) == [[0, 1], [2, 3]]
    assert token_bins(LENGTHS, 48, min_bins=4) == [[0], [4], [2, 7], [1, 3, 5, 6]]
    # then the 12-10-8-5 bin (48) splits into 12, 10 and 8, 5
    assert token_bins(LENGTHS, 48, min_bins=5) == [[0], [4], [2, 7], [1, 5], [3, 6]]
    assert padded_width(17, 2) == 18 and padded_width(18, 2) == 18 and padded_width(0) == 1
    assert fixed_bins(5, 2) == [[0, 1], [2, 3], [4]] and fixed_bins(3, None) == [[0, 1, 2]]
    with pytest.raises(BadInput, match="a sequence of 25 tokens .* at least 26"):
        token_bins([25, 3], 24, multiple=2)
