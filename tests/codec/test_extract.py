"""Extraction finds exactly the changed positions, with their old and new bits."""

import numpy as np
import pytest
import xxhash
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sparrowd.codec import extract
from sparrowd.codec.extract import diff_fingerprint, diff_values, fingerprint, split_ranges

# Both implementations must agree with a plain comparison; the C one is built at install time.
PATHS = [pytest.param(False, id="numpy"), pytest.param(True, id="native")]


def _pair(w, n: int, density: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    old = rng.integers(0, np.iinfo(w).max, size=n, dtype=w, endpoint=True)
    new = old.copy()
    pos = np.flatnonzero(rng.random(n) < density)
    new[pos] ^= w(1) << w(rng.integers(0, 8 * np.dtype(w).itemsize))  # any bit, the top one included
    if n:
        new[-1] ^= w(1 << 3)  # the ragged tail after the last whole group
    return old, new


def test_the_native_extension_is_built():
    # CI machines have a compiler; a silent fallback to numpy would hide a build break.
    assert extract._native is not None


def test_the_native_extension_is_built_from_this_source(tmp_path, monkeypatch):
    """The module carries its source's digest: a checkout whose rebuild failed (the build is
    optional, so quiet) still has the old module, and this fails rather than testing it."""
    from sparrowd.codec import bits

    assert bits._native.SOURCE and not bits.native_source_stale()
    monkeypatch.setattr(bits._native, "SOURCE", "0" * 16)  # built from something else
    assert bits.native_source_stale()


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("w", [np.uint8, np.uint16, np.uint32, np.uint64])
@pytest.mark.parametrize("n", [0, 1, 7, 9, 1000, (1 << 19) + 5])
def test_diff_values_matches_a_plain_comparison(native, w, n):
    old, new = _pair(w, n, 0.03, n)
    expect = np.flatnonzero(old != new)
    for lo, hi in split_ranges(n, 1 << 16) if n else [(0, 0)]:
        idx, ov, nv = diff_values(old, new, lo, hi, native=native)
        sel = expect[(expect >= lo) & (expect < hi)]
        assert idx.dtype == np.int64 and ov.dtype == old.dtype
        assert np.array_equal(idx, sel)
        assert np.array_equal(ov, old[sel]) and np.array_equal(nv, new[sel])


def _pairs(max_n: int, densities: list[float]):
    """Hypothesis: element width, length, density, where the scan starts, and a seed."""
    return given(
        w=st.sampled_from([np.uint8, np.uint16, np.uint32, np.uint64]),
        n=st.integers(0, max_n),
        density=st.sampled_from(densities),
        lo_frac=st.floats(0, 1),
        seed=st.integers(0, 2**32 - 1),
    )


@settings(max_examples=150, deadline=None)
@_pairs(70_000, [0.0, 1e-4, 0.01, 0.3, 1.0])
def test_native_and_numpy_agree(w, n, density, lo_frac, seed):
    # Dense changes make the native scan run out of room and grow its outputs;
    # odd offsets exercise the element-by-element head before the first group.
    old, new = _pair(w, n, density, seed)
    lo = int(lo_frac * n)
    a = diff_values(old, new, lo, native=True)
    b = diff_values(old, new, lo, native=False)
    for x, y in zip(a, b):
        assert np.array_equal(x, y)


@pytest.mark.parametrize("w", [np.uint16, np.uint32])
@pytest.mark.parametrize("n", [0, 5, (3 << 20) + 11])  # several fused blocks and a partial one
def test_diff_fingerprint_reads_once_and_agrees(w, n):
    old, new = _pair(w, n, 0.5, 7)
    idx, ov, nv, fo, fn = diff_fingerprint(old, new)
    expect = np.flatnonzero(old != new)
    assert np.array_equal(idx, expect) and np.array_equal(ov, old[expect]) and np.array_equal(nv, new[expect])
    assert fo == fingerprint(old) and fn == fingerprint(new)
    assert fo == xxhash.xxh3_128(old.tobytes()).digest()


def test_native_refuses_bad_arguments():
    from sparrowd.codec import _native

    a = np.zeros(64, np.uint16)
    out = np.empty(64, np.int64), np.empty(64, np.uint16), np.empty(64, np.uint16)
    with pytest.raises(ValueError, match="itemsize"):
        _native.diff_into(a, a, 3, 0, 64, *out)
    with pytest.raises(ValueError, match="equally long"):
        _native.diff_into(a, a[:32], 2, 0, 32, *out)
    with pytest.raises(ValueError, match="out of bounds"):
        _native.diff_into(a, a, 2, 10, 65, *out)
    with pytest.raises(ValueError, match="out of bounds"):
        _native.diff_into(a, a, 2, 10, 5, *out)
    with pytest.raises(ValueError, match="PyCapsule"):
        _native.diff_into(a, a, 2, 0, 64, *out, False, False, "not a hasher")
    with pytest.raises(BufferError):
        _native.diff_into(a.tobytes(), a, 2, 0, 64, *out, False, True)  # update needs a writable old side
    # ulp2's class scan riding along: a tuple, with buffers of the right sizes and a state that fits
    cls, rank, state = np.empty(64, np.uint8), np.empty(64, np.int64), np.zeros(18, np.int64)
    census = np.zeros((2, 16), np.int64)  # 64 elements, a row every 256: one row and the totals
    with pytest.raises(TypeError, match="tuple"):
        _native.diff_into(a, a, 2, 0, 64, *out, False, False, None, None, [7, 255])
    for bad in ((np.empty(8, np.uint8), rank, census, 256, state),  # no room beside the indices
                (cls, rank, np.zeros((3, 16), np.int64), 256, state),  # a census of the wrong height
                (cls, rank, census, 100, state),  # not a multiple of 256
                (cls, rank, census, 256, np.array([9, 1] + [0] * 16, np.int64))):  # resumes past where it starts
        with pytest.raises(ValueError, match="rank buffers"):
            _native.diff_into(a, a, 2, 0, 64, *out, False, False, None, None, (7, 255, 100, *bad[:4], bad[4], -1))
    assert _native.diff_into(a, a, 2, 0, 64, *out, False, False, None, None, (7, 255, 100, cls, rank, census, 256,
                                                                            state, -1)) == (0, 64)


def test_diff_fingerprint_can_skip_the_old_side():
    old, new = _pair(np.uint16, 100_003, 0.01, 3)
    idx, ov, nv, fo, fn = diff_fingerprint(old, new, hash_old=False)
    assert fo is None and fn == fingerprint(new) and np.array_equal(idx, np.flatnonzero(old != new))


def _cpu_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and flag in line.split() for line in f)
    except OSError:
        return False


def test_the_simd_scan_is_chosen_where_the_cpu_has_it():
    from sparrowd.codec import _native

    assert _native.SIMD == ("avx2" if _cpu_has("avx2") and _cpu_has("bmi1") else "portable")


def _scan(old, new, lo, portable: bool):
    """diff_into from ``lo`` to the end with small outputs (so it stops for room and is restarted),
    both fingerprints and the update of ``old``, as the Publisher runs it."""
    from sparrowd.codec import _native

    n = old.size - lo
    cap = 64
    out = np.empty(cap, np.int64), np.empty(cap, old.dtype), np.empty(cap, old.dtype)
    ho, hn = _native.hasher(), _native.hasher()
    count = pos = 0
    while True:
        got, pos = _native.diff_into(old, new, old.dtype.itemsize, max(pos, lo), old.size, out[0][count:],
                                     out[1][count:], out[2][count:], portable, True, ho, hn)
        count += got
        if pos == old.size:
            break
        cap *= 2
        out = tuple(np.concatenate([x[:count], np.empty(cap - count, x.dtype)]) for x in out)
    assert count <= n
    return tuple(x[:count] for x in out), _native.digest(ho), _native.digest(hn)


@settings(max_examples=150, deadline=None)
@_pairs(20_000, [0.0, 1e-3, 0.01, 0.3, 1.0])
def test_the_simd_and_portable_scans_agree(w, n, density, lo_frac, seed):
    old, new = _pair(w, n, density, seed)
    lo = int(lo_frac * n)
    expect = np.flatnonzero(old[lo:] != new[lo:]) + lo
    for portable in (False, True):
        kept = old.copy()
        (idx, ov, nv), fo, fn = _scan(kept, new, lo, portable)
        assert np.array_equal(idx, expect)
        assert np.array_equal(ov, old[expect]) and np.array_equal(nv, new[expect])
        # The fingerprints cover exactly the scanned range, the old side's taken before the update.
        assert fo == xxhash.xxh3_128(old[lo:].tobytes()).digest()
        assert fn == xxhash.xxh3_128(new[lo:].tobytes()).digest()
        assert np.array_equal(kept[lo:], new[lo:]) and np.array_equal(kept[:lo], old[:lo])


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("w", [np.uint16, np.uint32])
def test_diff_fingerprint_can_bring_the_old_side_up_to_date(native, w, monkeypatch):
    # The Publisher's kept copy is updated in the diff's own pass; the returned old values undo it.
    if not native:
        monkeypatch.setattr(extract, "_native", None)
    old, new = _pair(w, (3 << 20) + 11, 0.01, 5)  # several fused blocks and a partial one
    kept = old.copy()
    idx, ov, nv, fo, fn = diff_fingerprint(kept, new, hash_old=False, update_old=True)
    assert np.array_equal(kept, new) and np.array_equal(idx, np.flatnonzero(old != new))
    assert fo is None and fn == fingerprint(new)
    kept[idx] = ov
    assert np.array_equal(kept, old)
    with pytest.raises(ValueError, match="writable"):
        ro = old.copy()
        ro.flags.writeable = False
        diff_fingerprint(ro, new, update_old=True)


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(["BF16", "F16", "F32"]),
    st.integers(0, 300_000),
    st.sampled_from([0.0, 0.001, 0.01, 0.2]),
    st.integers(0, 2),
    st.booleans(),
    st.integers(0, 2**31),
)
@example("BF16", 162_848, 0.2, 0, False, 1)  # the outputs fill up in the ragged tail: the scan resumes there
@example("BF16", 300_000, 0.2, 0, True, 7)
def test_the_diff_ranks_classes_in_its_own_pass(dtype, n, density, part, update, seed):
    """ulp2's class scan done by the diff block by block (ClassRanks) gives what a separate
    class_scan of the old side gives: for whole tensors and for parts, with the kept copy updated
    in the same pass or not, at densities that make the outputs grow (and the scan restart), with
    every SIMD width this CPU runs, and in the numpy fallback. Positions of a change history, some of
    them changes, get their classes in the old side (before any update) in the same pass."""
    from sparrowd.codec.bits import ClassRanks, class_lo, class_scan, exponent_field
    from sparrowd.codec.chunk import CENSUS

    rng = np.random.default_rng(seed)
    shift, mask = exponent_field(dtype)
    w = {"BF16": np.uint16, "F16": np.uint16, "F32": np.uint32}[dtype]
    f = rng.normal(0, 0.02, n).astype(np.float32)
    old = (f.view(np.uint32) >> 16).astype(w) if dtype == "BF16" else f.astype(np.float16 if w == np.uint16 else
                                                                                 np.float32).view(w)
    new = old.copy()
    moved = np.flatnonzero(rng.random(n) < density)
    new[moved] ^= w(1)
    new[moved[::2]] ^= w(1 << shift)  # some move to another class: classes are the old side's
    lo = class_lo(old, 0, n, shift, mask)
    a = (n // 3 // CENSUS) * CENSUS if part else 0  # a part starts at a multiple of CENSUS
    b = n if part != 1 else max(a, n - 1000)
    want_idx = moved[(moved >= a) & (moved < b)]
    want = class_scan(old, a, b, want_idx, shift, mask, lo) if want_idx.size else None
    hist = np.union1d(rng.choice(np.arange(a, b), min(b - a, 1 + n // 50), replace=False), want_idx[::3])
    want_hist = np.clip(((old[hist] >> w(shift)) & w(mask)).astype(np.int64) - lo, 0, 15)
    for native in (True, False):
        for widest in range(extract._native.CLASS_SIMD + 1) if native else [-1]:
            kept = old.copy()
            classes = ClassRanks(shift, mask, lo, widest=widest, hist_pos=hist - a)
            if part:
                idx = diff_values(kept, new, a, b, native=native, classes=classes)[0]
            elif native:
                idx = diff_fingerprint(kept, new, update_old=update, classes=classes)[0]
            else:
                idx = diff_values(kept, new, native=False, classes=classes)[0]
            assert np.array_equal(idx, want_idx)
            if want is None:
                assert classes.cls is None
                continue
            for got, exp in zip((classes.cls, classes.rank, classes.census), want):
                assert np.array_equal(got, exp), (native, widest)
            assert np.array_equal(classes.hist_cls, want_hist), (native, widest)


@pytest.mark.parametrize("native", PATHS)
def test_ranks_and_fingerprint_in_one_read_are_those_of_two(native, monkeypatch):
    """A torch compare's host mirror is ranked and fingerprinted in one pass (the hash fed as the
    class scan goes), its change history classed in it too: the same ranks, census, fingerprint and
    history classes as rank_changes, fingerprint and history_classes, for a mirror already holding
    the new bits at the changes (their old bits given) and one that does not. The history holds
    entries that changed again (whose class is the old bits'), and entries in the last stretch."""
    import sparrowd.codec.bits as bits
    from sparrowd.codec.chunk import rank_and_fingerprint, rank_changes

    if not native:
        monkeypatch.setattr(bits, "_native", None)
    old, new = _pair(np.uint16, (1 << 18) + 333, 0.01, 11)
    idx = np.flatnonzero(old != new)
    # history entries that change again, into another exponent class
    lo = bits.class_lo(old, 0, old.size, *bits.exponent_field("BF16"))
    again = idx[[0, 7, -1]]
    old[again], new[again] = (lo + 3) << 7, (lo + 9) << 7
    rng = np.random.default_rng(5)
    hpos = np.union1d(rng.choice(old.size, 4000, replace=False), [*again, old.size - 1])
    for base, ov in ((new.copy(), old[idx]), (old.copy(), None)):
        ranked, fp = rank_and_fingerprint(base, "BF16", idx, ov)
        want = rank_changes(base, "BF16", idx, ov)
        assert ranked.lo == want[0] and ranked.hist_cls is None
        assert all(np.array_equal(a, b) for a, b in zip((ranked.cls, ranked.rank, ranked.census), want[1:]))
        assert fp == fingerprint(base)
        with_hist, fp2 = rank_and_fingerprint(base, "BF16", idx, ov, hpos)
        assert fp2 == fp and np.array_equal(with_hist.rank, ranked.rank)
        assert np.array_equal(with_hist.hist_cls, bits.history_classes(base, "BF16", ranked.lo, hpos, idx, ov))
        # the classes are the old side's: where the mirror holds new bits, from the old bits given
        assert np.array_equal(with_hist.hist_cls, bits.history_classes(old, "BF16", ranked.lo, hpos, idx, None))
