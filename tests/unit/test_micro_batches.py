"""Cutting a rank's slice into micro-batches (models.micro_batches), by hand."""

import pytest

from agentgym_mega.errors import BadInput
from agentgym_mega.models.micro_batches import fixed_bins, padded_width, token_bins

LENGTHS = [24, 10, 17, 5, 24, 12, 8, 20]  # 120 real tokens


def test_bins_by_hand():
    # ceil(120 / 48) = 3 bins first: longest first into the emptiest gives [24, 12, 5], whose
    # padded size 24 x 3 = 72 > 48. So 4 bins: [24], [24], [20], [17]; then 12 -> the 17's (29),
    # 10 -> the 20's (30), 8 -> the first 24's (32; ties go to the first), 5 -> the second 24's.
    bins = token_bins(LENGTHS, 48)
    assert bins == [[0, 6], [3, 4], [1, 7], [2, 5]]
    assert [padded_width(max(LENGTHS[i] for i in b)) * len(b) for b in bins] == [48, 48, 40, 34]
    assert token_bins([5, 5, 5, 5], 100) == [[0, 1, 2, 3]]
    assert token_bins([5, 5, 5, 5], 100, min_bins=2) == [[0, 2], [1, 3]]
    assert padded_width(17, 2) == 18 and padded_width(18, 2) == 18 and padded_width(0) == 1
    assert fixed_bins(5, 2) == [[0, 1], [2, 3], [4]] and fixed_bins(3, None) == [[0, 1, 2]]
    with pytest.raises(BadInput, match="a sequence of 25 tokens .* at least 26"):
        token_bins([25, 3], 24, multiple=2)
