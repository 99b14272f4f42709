"""Extraction finds exactly the changed positions, with their old and new bits."""

import numpy as np
import pytest

from sparrowd.codec.extract import diff_values, split_ranges


@pytest.mark.parametrize("w", [np.uint8, np.uint16, np.uint32, np.uint64])
@pytest.mark.parametrize("n", [0, 1, 7, 9, 1000, (1 << 19) + 5])
def test_diff_values_matches_a_plain_comparison(w, n):
    rng = np.random.default_rng(n)
    old = rng.integers(0, np.iinfo(w).max, size=n, dtype=w, endpoint=True)
    new = old.copy()
    pos = np.flatnonzero(rng.random(n) < 0.03)
    new[pos] ^= w(1)
    if n:
        new[-1] ^= w(1 << 3)  # the ragged tail after the last whole word
    expect = np.flatnonzero(old != new)
    for lo, hi in split_ranges(n, 1 << 16) if n else [(0, 0)]:
        idx, ov, nv = diff_values(old, new, lo, hi)
        sel = expect[(expect >= lo) & (expect < hi)]
        assert np.array_equal(idx, sel)
        assert np.array_equal(ov, old[sel]) and np.array_equal(nv, new[sel])
