"""Bit-pattern transforms: exhaustive over bf16, property-based elsewhere."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparrowd.codec.bits import (
    class_sort,
    from_planes,
    order_key,
    order_unkey,
    rice_decode,
    rice_encode,
    rice_index,
    rice_k,
    rice_positions,
    rotl1,
    rotr1,
    to_planes,
    ulp_apply,
    ulp_codes,
    ulp_encode,
    ulp_streams,
    unzigzag,
    zigzag,
)
from sparrowd.errors import FormatError

ALL16 = np.arange(1 << 16, dtype=np.uint16)


def test_order_key_is_a_bijection_that_sorts_like_float16():
    # Every one of the 65536 patterns gets its own key, and keys sort like the floats (NaNs aside).
    key = order_key(ALL16)
    assert np.unique(key).size == 1 << 16
    assert np.array_equal(order_unkey(key), ALL16)
    f = ALL16.view(np.float16)
    ok = ~np.isnan(f)
    by_key = ALL16[ok][np.argsort(key[ok], kind="stable")].view(np.float16)
    assert np.all(np.diff(by_key.astype(np.float64)) >= 0)
    # -0.0 sorts just below +0.0, as neighbours
    assert int(order_key(np.array([0x0000], np.uint16))[0]) - int(order_key(np.array([0x8000], np.uint16))[0]) == 1


def test_ulp_round_trip_every_bf16_pattern_to_random_targets():
    rng = np.random.default_rng(0)
    for _ in range(4):
        new = rng.integers(0, 1 << 16, size=1 << 16, dtype=np.uint16)
        z = ulp_encode(ALL16, new)
        assert np.array_equal(ulp_apply(ALL16, z), new)


def test_one_ulp_moves_code_as_one_and_two():
    # +1.0 and -1.0 in bf16, moved one step up and down in float order
    old = np.array([0x3F80, 0x3F80, 0xBF80, 0xBF80, 0x0000, 0x8000], np.uint16)
    new = np.array([0x3F81, 0x3F7F, 0xBF7F, 0xBF81, 0x8000, 0x0000], np.uint16)
    z = ulp_encode(old, new)
    assert list(unzigzag(z)) == [1, -1, 1, -1, -1, 1]


@pytest.mark.parametrize("dt", [np.int8, np.int16, np.int32, np.int64])
def test_zigzag_round_trip_extremes(dt):
    info = np.iinfo(dt)
    d = np.array([0, -1, 1, info.min, info.max, -2, 2], dtype=dt)
    assert np.array_equal(unzigzag(zigzag(d)), d)
    assert list(zigzag(d[:3])) == [0, 1, 2]


@pytest.mark.parametrize("w", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_rotation_and_planes_round_trip(w):
    rng = np.random.default_rng(1)
    a = rng.integers(0, np.iinfo(w).max, size=1001, dtype=w, endpoint=True)
    assert np.array_equal(rotr1(rotl1(a)), a)
    assert np.array_equal(from_planes(to_planes(a), a.size, a.dtype.itemsize), a)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, (1 << 40) - 1), max_size=300), st.integers(0, 40))
def test_rice_round_trip(values, k):
    g = np.array(values, dtype=np.uint64)
    k = min(k, 40) if g.size and int(g.max() >> np.uint64(k)) < 1 << 20 else rice_k(g)
    u, r = rice_encode(g, k)
    assert np.array_equal(rice_decode(u, r, g.size, k), g)


def test_rice_reaches_the_geometric_entropy():
    # Gaps of a 1% Bernoulli mask: Rice must land within 0.1 bit of the entropy bound.
    rng = np.random.default_rng(2)
    mask = rng.random(2_000_000) < 0.01
    idx = np.flatnonzero(mask)
    g = (np.diff(idx, prepend=-1) - 1).astype(np.uint64)
    k = rice_k(g)
    u, r = rice_encode(g, k)
    bits = 8 * (u.size + r.size) / idx.size
    p = idx.size / mask.size
    bound = -(p * np.log2(p) + (1 - p) * np.log2(1 - p)) / p
    assert bound <= bits < bound + 0.1


def test_rice_rejects_streams_that_do_not_match_the_count():
    u, r = rice_encode(np.array([3, 1, 4], np.uint64), 1)
    with pytest.raises(FormatError):
        rice_decode(u, r, 4, 1)
    with pytest.raises(FormatError):
        rice_decode(u, r[:0], 3, 1)


# The C extension's encoders must give the very bytes of the numpy ones: a
# patch is the same wherever it is made, and the two paths check each other.


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, (1 << 62) - 1), max_size=400, unique=True),
    st.integers(0, 1000),
    st.sampled_from([1, 3, 100, 1 << 20]),
)
def test_rice_index_native_and_numpy_agree_and_round_trip(values, start, spread):
    idx = np.array(sorted(v // spread if spread > 1 and v < (1 << 40) else v for v in values), dtype=np.int64)
    idx = np.unique(idx) + start
    k, u, r = rice_index(idx, start)
    k2, u2, r2 = rice_index(idx, start, native=False)
    assert k == k2 and np.array_equal(u, u2) and np.array_equal(r, r2)
    gaps = rice_decode(u, r, idx.size, k)
    assert np.array_equal(np.cumsum(gaps.astype(np.int64) + 1) + (start - 1), idx)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, (1 << 62) - 1), max_size=400, unique=True),
    st.integers(0, 1000),
    st.sampled_from([1, 3, 100, 1 << 20]),
    st.integers(0, 2),
)
def test_rice_positions_native_and_numpy_agree_on_every_range(values, start, spread, slack):
    """A decoder's positions from the Rice streams, in C (one pass) and numpy: the same positions,
    and the same refusal when the range given is one too short (a position at stop) or when the
    count is wrong."""
    idx = np.array(sorted(v // spread if spread > 1 and v < (1 << 40) else v for v in values), dtype=np.int64)
    idx = np.unique(idx) + start
    k, u, r = rice_index(idx, start)
    stop = (int(idx[-1]) + 1 if idx.size else start) + slack
    got = rice_positions(u, r, idx.size, k, start, stop)
    assert got.dtype == np.int64 and np.array_equal(got, idx)
    assert np.array_equal(rice_positions(u, r, idx.size, k, start, stop, native=False), idx)
    if idx.size:
        for native in (True, False):
            with pytest.raises(FormatError, match="index beyond its range|index gap outside its range"):
                rice_positions(u, r, idx.size, k, start, int(idx[-1]), native=native)
            with pytest.raises(FormatError, match="Rice stream holds|Rice remainders hold"):
                rice_positions(u, r, idx.size + 1, k, start, stop, native=native)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=40), st.binary(max_size=40), st.integers(0, 60), st.integers(0, 12),
       st.integers(0, 5000))
def test_rice_positions_from_any_bytes_agree_or_both_refuse(unary, rem, n, k, span):
    """Damaged or hostile streams: the C decoder gives exactly numpy's positions or, where numpy
    refuses, refuses too (a FormatError, never a crash or a write past its output)."""
    def outcome(native):
        try:
            return rice_positions(unary, rem, n, k, 10, 10 + span, native=native).tolist()
        except FormatError:
            return "refused"

    assert outcome(True) == outcome(False)


def test_rice_index_refuses_positions_out_of_order():
    from sparrowd.codec import _native

    with pytest.raises(ValueError, match="increase"):
        _native.rice_index(np.array([5, 5], np.int64), 0, 0, 2)
    with pytest.raises(ValueError, match="increase"):
        _native.rice_index(np.array([3, 9], np.int64), 4, 0, 2)
    with pytest.raises(ValueError, match="Rice parameters"):
        _native.rice_index(np.array([3, 9], np.int64), 0, 39, 41)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 15), st.integers(0, 1 << 20)), max_size=300),
    st.sampled_from([np.uint8, np.uint16, np.uint32, np.uint64]),
    st.integers(0, 2**31),
)
def test_class_sort_native_and_numpy_agree(changes, w, seed):
    """ulp2's class table: the C counting sort and Rice choice give numpy's ranks, table and codes,
    for gaps from 0 (neighbours) to a million, and offsets that start each class's count anywhere."""
    from sparrowd.codec import _native

    if _native is None:
        pytest.skip("no C extension in this build")
    rng = np.random.default_rng(seed)
    cls = np.array([c for c, _ in changes], np.uint8)
    rank = np.empty(cls.size, np.int64)
    for c in range(16):  # ascending within each class: cumulative gaps
        m = cls == c
        rank[m] = np.cumsum(np.array([g for (cc, g) in changes if cc == c], np.int64) + 1)
    offset = rng.integers(0, 50, 16)
    rank += offset[cls]
    codes = rng.integers(1, np.iinfo(w).max, cls.size, dtype=w, endpoint=True)
    a, b = class_sort(cls, rank, codes, offset), class_sort(cls, rank, codes, offset, native=False)
    assert np.array_equal(a[0], b[0]) and a[1] == b[1] and np.array_equal(a[2], b[2]) and a[2].dtype == w
    assert sum(n for _, n, _ in a[1]) == cls.size and all(0 <= k <= 40 for _, _, k in a[1])


def test_class_sort_refuses_ranks_out_of_order_and_classes_above_15():
    from sparrowd.codec import _native

    if _native is None:
        pytest.skip("no C extension in this build")
    codes = np.ones(3, np.uint16)
    with pytest.raises(ValueError, match="ascend"):
        class_sort(np.array([2, 1, 2], np.uint8), np.array([5, 0, 5]), codes)
    with pytest.raises(ValueError, match="above 15"):
        class_sort(np.array([2, 16, 2], np.uint8), np.array([5, 0, 6]), codes)


@pytest.mark.parametrize("w", [np.uint8, np.uint16, np.uint32, np.uint64])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 4097])
def test_ulp_codes_and_streams_native_and_numpy_agree(w, n):
    rng = np.random.default_rng(n)
    old = rng.integers(0, np.iinfo(w).max, n, dtype=w, endpoint=True)
    new = rng.integers(0, np.iinfo(w).max, n, dtype=w, endpoint=True)
    new[: n // 2] = old[: n // 2] + w(1)  # small moves beside arbitrary ones, sign crossings included
    new[new == old] ^= w(1)
    z = ulp_encode(old, new)
    assert np.array_equal(z, ulp_encode(old, new, native=False))
    assert np.array_equal(ulp_apply(old, z), new)
    streams = ulp_streams(z)
    for a, b in zip(streams, ulp_streams(z, native=False)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    # and back: the codes from the streams, the decoder's way, in C and numpy
    signs, narrow, esc = (x.tobytes() for x in streams)
    if z.dtype.itemsize > 1 and n > 100:
        assert narrow.count(255) > 0  # arbitrary moves of wide codes escape
    for native in (True, False):
        back = ulp_codes(signs, narrow, esc, n, z.dtype.itemsize, native=native)
        assert back.dtype == z.dtype and np.array_equal(back, z)
        with pytest.raises(FormatError, match="byte planes"):
            ulp_codes(signs, narrow, esc + b"\0", n, z.dtype.itemsize, native=native)
        with pytest.raises(FormatError, match="do not match"):
            ulp_codes(signs, narrow[:-1], esc, n, z.dtype.itemsize, native=native)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=30), st.binary(max_size=60), st.binary(max_size=40), st.sampled_from([1, 2, 4, 8]))
def test_ulp_codes_from_any_bytes_agree_or_both_refuse(signs, narrow, esc, w):
    def outcome(native):
        try:
            return ulp_codes(signs, narrow, esc, len(narrow), w, native=native).tolist()
        except FormatError:
            return "refused"

    assert outcome(True) == outcome(False)


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32", "F64", "F8_E4M3"])
def test_class_lo_native_and_numpy_agree(dtype):
    """ulp2's class_lo (12 below the commonest exponent of a sample of the range): the C histogram
    and numpy's bincount pick the same, ties included, over whole ranges, short ones and parts."""
    from sparrowd.codec import _native
    from sparrowd.codec.bits import DTYPES, class_lo, exponent_field, uint_type

    if _native is None:
        pytest.skip("no C extension in this build")
    rng = np.random.default_rng(3)
    shift, mask = exponent_field(dtype)
    w = uint_type(DTYPES[dtype].itemsize)
    for n in (1, 7, 4096, 65536, 65537, 1 << 20):
        base = rng.integers(0, np.iinfo(w).max, n, dtype=w, endpoint=True)
        if dtype == "BF16":
            base = (rng.normal(0, 0.02, n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        for start, stop in ((0, n), (n // 3, n), (0, max(1, n // 2))):
            assert class_lo(base, start, stop, shift, mask) == class_lo(base, start, stop, shift, mask, native=False)
    hi, lower = mask, mask - 1  # two exponents twice each: the lower one counts as the commonest
    tie = np.array([hi << shift, lower << shift, lower << shift, hi << shift], w)
    assert class_lo(tie, 0, 4, shift, mask) == class_lo(tie, 0, 4, shift, mask, native=False) == lower - 12


def test_ulp2_pack_refuses_ranks_that_do_not_ascend():
    """The coder sizes its buffer from each class's last rank, and checks the order as it codes:
    ranks out of order, repeated, negative or absurdly large are refused, not coded (nor looped on)."""
    from sparrowd.codec import _native
    from sparrowd.codec.bits import ulp2_pack

    if _native is None:
        pytest.skip("no C extension in this build")
    e = np.empty(0, np.uint8)
    codes = np.ones(3, np.uint16)
    for ranks in ([5, 3, 9], [5, 5, 9], [-1, 3, 9]):
        with pytest.raises(ValueError, match="ascend"):
            ulp2_pack(np.array(ranks, np.int64), [[4, 3, 2]], codes, e, e, e, codes[:0])
    with pytest.raises(ValueError, match="2\\^48"):
        ulp2_pack(np.array([1, 2, 1 << 50], np.int64), [[4, 3, 2]], codes, e, e, e, codes[:0])
    assert ulp2_pack(np.array([1, 2, 1 << 40], np.int64), [[4, 3, 30]], codes, e, e, e, codes[:0])
