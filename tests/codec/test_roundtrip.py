"""Patches round-trip bit for bit over dtypes, shapes, densities and special patterns."""

import math

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparrowd.codec import (
    ABSOLUTE,
    DTYPES,
    ULP,
    ULP2,
    Manifest,
    RawTensor,
    apply_patch,
    encode_patch,
    parse_patch,
    patch_parts,
)
from sparrowd.codec.bits import order_key, order_unkey, uint_type
from sparrowd.codec.patch import MIN_CHUNK_SIZE
from sparrowd.errors import BaseMismatchError, FormatError, InputError, IntegrityError

SHAPES = [(), (0,), (3, 0), (1,), (7,), (33, 5), (4, 4, 4), (1000,), (257, 31)]
DENSITIES = ["none", "one", "1%", "all"]


def specials(w: int) -> np.ndarray:
    """Zeros of both signs, infinities, NaNs with payloads, subnormals, extremes."""
    bits = 8 * w
    sign = 1 << (bits - 1)
    top = (1 << bits) - 1
    return np.array([0, sign, 1, sign | 1, top, sign - 1, sign + 1, top - 1, (sign >> 1) | 1, sign | (sign >> 1)],
                    dtype=object)


def make_pair(rng, dtype: str, shape, density: str, move: str):
    info = DTYPES[dtype]
    u = uint_type(info.itemsize)
    n = math.prod(shape)
    old = rng.integers(0, np.iinfo(u).max, size=n, dtype=u, endpoint=True)
    sp = np.array([int(x) for x in specials(info.itemsize)], dtype=u)
    if n:
        old[rng.random(n) < 0.2] = rng.choice(sp, size=int(np.count_nonzero(rng.random(n) < 0.2)) or 1)[:1]
    if dtype == "BOOL":
        old &= 1
    new = old.copy()
    if density == "none" or n == 0:
        pos = np.empty(0, np.int64)
    elif density == "one":
        pos = rng.integers(0, n, size=1)
    elif density == "1%":
        pos = np.flatnonzero(rng.random(n) < 0.01)
    else:
        pos = np.arange(n)
    if pos.size:
        if move == "ulp" and info.is_float:
            step = rng.choice(np.array([1, -1, 2, -300], dtype=np.int64), size=pos.size).astype(u)
            with np.errstate(over="ignore"):
                new[pos] = order_unkey(order_key(old[pos]) + step)
        elif move == "special":
            new[pos] = rng.choice(sp, size=pos.size)
        else:
            new[pos] = rng.integers(0, np.iinfo(u).max, size=pos.size, dtype=u, endpoint=True)
        if dtype == "BOOL":
            new[pos] = 1 - (old[pos] & 1)
    return RawTensor(dtype, shape, old), RawTensor(dtype, shape, new)


def roundtrip(old: dict, new: dict, values: str, chunk_size: int) -> Manifest:
    m, chunks = encode_patch(old, new, version=5, base_version=4, values=values, chunk_size=chunk_size)
    # through the file format too
    blob = b"".join(patch_parts(m, (c.data for c in chunks)))
    view = parse_patch(blob)
    assert view.manifest.to_bytes() == m.to_bytes()
    view.verify_chunks()
    out = apply_patch(view.manifest, list(view.chunks), old)
    for name in set(old) | set(new):
        if name not in new:
            assert out[name] is None
        elif name in out:
            assert out[name].dtype == new[name].dtype and out[name].shape == new[name].shape
            assert np.array_equal(out[name].bits, new[name].bits), name
        else:  # untouched: must really be unchanged
            assert np.array_equal(old[name].bits, new[name].bits), name
    return m


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(sorted(DTYPES)),
    shape=st.sampled_from(SHAPES),
    density=st.sampled_from(DENSITIES),
    move=st.sampled_from(["ulp", "random", "special"]),
    values=st.sampled_from([ULP2, ULP, ABSOLUTE]),
    chunk_size=st.sampled_from([MIN_CHUNK_SIZE, 2 << 20]),
    seed=st.integers(0, 2**32 - 1),
)
def test_single_tensor_round_trip(dtype, shape, density, move, values, chunk_size, seed):
    rng = np.random.default_rng(seed)
    a, b = make_pair(rng, dtype, shape, density, move)
    m = roundtrip({"t": a}, {"t": b}, values, chunk_size)
    changed = int(np.count_nonzero(a.bits != b.bits))
    assert m.elements_changed == changed
    if changed and values in (ULP, ULP2) and DTYPES[dtype].is_float:
        assert m.tensors[0].op == "patch"


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), values=st.sampled_from([ULP2, ULP, ABSOLUTE]))
def test_added_removed_retyped_reshaped_tensors(seed, values):
    rng = np.random.default_rng(seed)
    a1, b1 = make_pair(rng, "BF16", (40, 30), "1%", "ulp")
    a2, _ = make_pair(rng, "F32", (10,), "none", "random")
    _, b3 = make_pair(rng, "F16", (6, 7), "none", "random")
    a4, _ = make_pair(rng, "I64", (9,), "none", "random")
    _, b4 = make_pair(rng, "I32", (9,), "none", "random")  # retyped
    a5, _ = make_pair(rng, "F32", (4, 6), "none", "random")
    b5 = RawTensor("F32", (6, 4), a5.bits)  # reshaped, same bytes
    old = {"keep": a1, "gone": a2, "retyped": a4, "reshaped": a5}
    new = {"keep": b1, "added": b3, "retyped": b4, "reshaped": b5}
    m = roundtrip(old, new, values, MIN_CHUNK_SIZE)
    ops = {t.name: t.op for t in m.tensors}
    assert ops["gone"] == "remove" and ops["added"] == "full" and ops["retyped"] == "full" and ops["reshaped"] == "full"
    assert m.tensor("retyped").base_dtype == "I64" and m.tensor("reshaped").base_shape == (4, 6)


@pytest.mark.parametrize("values", [ULP, ULP2])
def test_large_tensor_is_split_across_chunks_and_round_trips(values):
    rng = np.random.default_rng(3)
    a, b = make_pair(rng, "BF16", (1 << 22,), "1%", "ulp")
    m = roundtrip({"w": a}, {"w": b}, values, 8 << 10)
    assert len(m.chunks) > 4
    # A format 2 manifest does not list each chunk's segments; the chunks' headers do.
    assert all((c.segments is None) == (values == ULP2) for c in m.chunks)
    _, chunks = encode_patch({"w": a}, {"w": b}, version=5, base_version=4, values=values, chunk_size=8 << 10)
    ranges = sorted((s[1], s[2]) for c in chunks for s in c.segments)
    assert ranges[0][0] == 0 and ranges[-1][1] == a.numel
    assert all(x[1] == y[0] for x, y in zip(ranges, ranges[1:])), "segments must tile the tensor"
    sizes = [c.size for c in m.chunks[:-1]]
    assert max(sizes) < 2 * (8 << 10) and min(sizes) > (8 << 10) // 2, sizes


def test_manifest_bytes_are_deterministic():
    rng = np.random.default_rng(4)
    a, b = make_pair(rng, "BF16", (5000,), "1%", "ulp")
    m1, c1 = encode_patch({"x": a, "y": a}, {"x": b, "y": b}, version=1, base_version=0)
    m2, c2 = encode_patch({"y": a, "x": a}, {"y": b, "x": b}, version=1, base_version=0, threads=1)
    assert m1.to_bytes() == m2.to_bytes()
    assert [c.data for c in c1] == [c.data for c in c2]


@pytest.fixture
def patch():
    rng = np.random.default_rng(5)
    a, b = make_pair(rng, "BF16", (300, 200), "1%", "ulp")
    c, d = make_pair(rng, "F32", (5000,), "1%", "random")
    old, new = {"a": a, "c": c}, {"a": b, "c": d}
    m, chunks = encode_patch(old, new, version=2, base_version=1, chunk_size=MIN_CHUNK_SIZE)
    return old, new, m, [c.data for c in chunks]


def test_a_flipped_byte_in_any_chunk_is_detected(patch):
    old, _, m, chunks = patch
    rng = np.random.default_rng(6)
    for i, data in enumerate(chunks):
        for pos in {0, len(data) // 2, len(data) - 1, int(rng.integers(0, len(data)))}:
            bad = bytearray(data)
            bad[pos] ^= 1 << int(rng.integers(0, 8))
            tampered = chunks[:i] + [bytes(bad)] + chunks[i + 1 :]
            with pytest.raises(IntegrityError):
                apply_patch(m, tampered, old)


def test_a_flipped_byte_in_the_file_is_detected(patch):
    old, _, m, chunks = patch
    blob = b"".join(patch_parts(m, chunks))
    for pos in range(0, len(blob), max(1, len(blob) // 97)):
        bad = bytearray(blob)
        bad[pos] ^= 0x10
        with pytest.raises((FormatError, IntegrityError)):
            view = parse_patch(bytes(bad))
            view.verify_chunks()
            apply_patch(view.manifest, list(view.chunks), old)


def test_a_wrong_base_is_refused(patch):
    old, new, m, chunks = patch
    with pytest.raises(BaseMismatchError, match="'a'"):
        apply_patch(m, chunks, {**old, "a": new["a"]})
    with pytest.raises(BaseMismatchError, match="missing"):
        apply_patch(m, chunks, {"c": old["c"]})
    reshaped = RawTensor("BF16", (200, 300), old["a"].bits)
    with pytest.raises(BaseMismatchError, match="expects"):
        apply_patch(m, chunks, {**old, "a": reshaped})


def test_chunks_from_another_patch_are_refused(patch):
    old, new, m, chunks = patch
    m2, chunks2 = encode_patch(new, old, version=3, base_version=2, chunk_size=MIN_CHUNK_SIZE)
    with pytest.raises(IntegrityError):
        apply_patch(m, [c.data for c in chunks2][: len(chunks)] + chunks[len(chunks2):], old)


def test_ulp2_is_decoded_against_the_base_and_a_wrong_base_is_caught_before_any_write():
    from sparrowd.codec import decode_chunk

    rng = np.random.default_rng(11)
    a, b = make_pair(rng, "BF16", (64, 512), "1%", "ulp")
    m, chunks = encode_patch({"w": a}, {"w": b}, version=2, base_version=1, values=ULP2)
    raw = m.to_bytes()  # format 2 manifests travel as one zstd frame
    assert raw[:4] == b"\x28\xb5\x2f\xfd" and Manifest.from_bytes(raw).values == ULP2
    assert zstandard.ZstdDecompressor().decompress(raw).count(b"format_version") == 1
    with pytest.raises(FormatError, match="base"):
        decode_chunk(chunks[0].data)  # no base given: it cannot be decoded
    other = RawTensor("BF16", a.shape, b.bits)
    with pytest.raises(BaseMismatchError):  # the fingerprint check comes before any decoding or write
        apply_patch(m, [c.data for c in chunks], {"w": other})
    # Against another base the positions come out elsewhere (or not at all): never silently right.
    try:
        segs = decode_chunk(chunks[0].data, base={"w": np.roll(a.bits, 7)})
        assert not np.array_equal(segs[0].indices, np.flatnonzero(a.bits != b.bits))
    except FormatError:
        pass


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(["BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2"]), n=st.integers(1, 5000),
       seed=st.integers(0, 2**32 - 1), share=st.sampled_from([0.0, 0.05, 0.5, 1.0]),
       chunk_size=st.sampled_from([MIN_CHUNK_SIZE, 1 << 20]))
def test_ulp2_with_any_history_round_trips(dtype, n, seed, share, chunk_size):
    """Against a history of any shape (none of the changes in it, some, all; entries at the ends of
    segments; every state; special bit patterns in the base), the patch applies bit for bit."""
    from sparrowd.codec import History
    from sparrowd.codec.history import TensorHistory

    rng = np.random.default_rng(seed)
    a, b = make_pair(rng, dtype, (n,), "1%", "ulp")
    changed = np.flatnonzero(a.bits != b.bits)
    pick = np.union1d(changed[rng.random(changed.size) < share], np.flatnonzero(rng.random(n) < 0.03))
    pick = np.union1d(pick, [0, n - 1]).astype(np.int64)
    h = History((4, 3), {"a": TensorHistory(pick, rng.integers(2, 16, pick.size).astype(np.uint8))})  # any mask
    m, chunks = encode_patch({"a": a}, {"a": b}, version=5, base_version=4, values=ULP2, history=h,
                             chunk_size=chunk_size)
    got = apply_patch(Manifest.from_bytes(m.to_bytes()), [c.data for c in chunks], {"a": a}, h)
    assert np.array_equal(got["a"].bits if "a" in got else a.bits, b.bits)


def test_ulp2_class_tables_of_every_shape_round_trip_in_the_stream():
    """The class table travels in the coded stream: all 16 classes, counts from 1 to thousands, gap
    parameters from 0 to large (one change at the far end of a big class), and distances of many
    ulps. A header whose count disagrees with the stream's table is refused."""
    from sparrowd.codec import decode_chunk
    from sparrowd.codec.chunk import CHUNK_MAGIC
    from sparrowd.schema import pack, unpack

    rng = np.random.default_rng(5)
    n = 1 << 20
    exps = np.clip(rng.normal(120, 6, n).astype(np.int64), 90, 150)  # exponents well past 16 classes
    a = ((exps << 7) | rng.integers(0, 128, n)).astype(np.uint16)
    b = a.copy()
    hot = np.flatnonzero(exps < 112)  # dense where small
    b[hot[rng.random(hot.size) < 0.3]] += 1
    b[n - 1] += 3  # a lone change far from the others, in a class of its own
    b[rng.integers(0, n, 50)] -= rng.integers(1, 200, 50).astype(np.uint16)
    old, new = {"w": RawTensor("BF16", (n,), a)}, {"w": RawTensor("BF16", (n,), b)}
    m, chunks = encode_patch(old, new, version=2, base_version=1, values=ULP2)
    got = apply_patch(m, [c.data for c in chunks], old)
    assert np.array_equal(got["w"].bits, b)
    raw = zstandard.ZstdDecompressor().decompress(chunks[0].data)
    hlen = int.from_bytes(raw[4:8], "little")
    head = unpack(raw[8:8 + hlen], what="chunk header")
    assert "classes" not in head["segments"][0]  # the table is in the stream
    head["segments"][0]["count"] -= 1
    packed = pack(head)
    bad = CHUNK_MAGIC + len(packed).to_bytes(4, "little") + packed + raw[8 + hlen:]
    with pytest.raises(FormatError, match="class"):
        decode_chunk(zstandard.ZstdCompressor().compress(bad), base={"w": a})


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32", "F64", "F8_E4M3"])
def test_ulp2_native_scans_match_numpy(dtype):
    from sparrowd.codec.bits import _native, class_lo, class_positions, class_ranks, exponent_field

    if _native is None:
        pytest.skip("no C extension in this build")
    rng = np.random.default_rng(5)
    w = DTYPES[dtype].itemsize
    shift, mask = exponent_field(dtype)
    # Real-looking weights (most exponents in a narrow band) with a few extremes, over 5000 elements.
    if w == 2 and dtype == "BF16":
        base = (rng.normal(0, 0.02, 5000).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    else:
        base = rng.integers(0, 1 << (8 * w) - 1, size=5000, dtype=np.uint64).astype(uint_type(w))
    base[::500] = np.array([int(x) for x in specials(w)], dtype=uint_type(w))  # NaNs, infinities, zeros, ...
    for lo_i in (0, 37, 100):
        idx = np.sort(rng.choice(np.arange(lo_i, 5000), 300, replace=False)).astype(np.int64)
        lo = class_lo(base, lo_i, 5000, shift, mask)
        got = [class_ranks(base, lo_i, idx, shift, mask, lo, native=n) for n in (True, False)]
        assert np.array_equal(got[0][0], got[1][0]) and np.array_equal(got[0][1], got[1][1])
        cls, rank = got[0]
        order = np.argsort(cls, kind="stable")
        counts = np.bincount(cls, minlength=16)
        for n in (True, False):
            pos, perm = class_positions(base, lo_i, 5000, shift, mask, lo, counts, rank[order], native=n)
            assert np.array_equal(pos, idx) and np.array_equal(order[perm], np.arange(idx.size))
        with pytest.raises(FormatError):  # a rank beyond its class
            class_positions(base, lo_i, 5000, shift, mask, lo, counts, rank[order] + 10_000)
        # A base that already holds the new bits at the changed positions, with the old ones given.
        moved = base.copy()
        moved[idx] = rng.integers(0, 1 << (8 * w) - 1, size=idx.size, dtype=np.uint64).astype(uint_type(w))
        for n in (True, False):
            c2, r2 = class_ranks(moved, lo_i, idx, shift, mask, lo, base[idx], native=n)
            assert np.array_equal(c2, cls) and np.array_equal(r2, rank)


@pytest.mark.parametrize("length,start,density,every", [(300_000, 0, 0.01, 1 << 16), (290_001, 1000, 0.3, 256),
                                                        (700, 5, 0.05, 256), (70_000, 0, 0.0, 512)])
def test_ulp2_class_census_matches_numpy(length, start, density, every):
    """The scan's census (class counts every `every` elements) and ranks, each C scan the CPU runs
    against numpy, over lengths that end mid-block, dense and empty change sets, and a base that
    already moved."""
    from sparrowd.codec.bits import _native, class_lo, class_scan, exponent_field

    if _native is None:
        pytest.skip("no C extension in this build")
    rng = np.random.default_rng(length)
    shift, mask = exponent_field("BF16")
    base = (rng.normal(0, 0.02, length + 10).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    idx = (np.flatnonzero(rng.random(length - start) < density) + start).astype(np.int64)
    lo = class_lo(base, 0, base.size, shift, mask)
    levels = range(_native.CLASS_SIMD + 1)  # every scan this CPU runs: portable, AVX2, AVX-512
    for old in (None, rng.integers(0, 1 << 15, idx.size).astype(np.uint16)):
        want = class_scan(base, start, length, idx, shift, mask, lo, old, every=every, native=False)
        for widest in levels:
            got = class_scan(base, start, length, idx, shift, mask, lo, old, every=every, widest=widest)
            for a, b in zip(got, want):
                assert np.array_equal(a, b), widest
        census = got[2]
        assert census.shape == ((length - start + every - 1) // every + 1, 16) and census[-1].sum() == length - start


def test_ulp2_ranks_found_in_parts_give_the_same_chunks(monkeypatch):
    """A large tensor is diffed and ranked in parts by the worker threads (a part without changes
    still counts its classes); the chunks, split across segments at any element, are the bytes
    one whole-tensor scan gives, and decode bit-exact."""
    import sparrowd.codec.patch as patch_mod
    from sparrowd.codec.extract import split_ranges

    rng = np.random.default_rng(3)
    n = 600_000
    a = (rng.normal(0, 0.02, n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    b = a.copy()
    hit = np.flatnonzero(rng.random(n) < 0.02)
    hit = hit[(hit < 131072) | (hit >= 262144)]  # the second part of 131072 elements has no change
    b[hit] += 1
    old, new = {"w": RawTensor("BF16", (n,), a)}, {"w": RawTensor("BF16", (n,), b)}
    whole = encode_patch(old, new, version=2, base_version=1, values=ULP2, chunk_size=MIN_CHUNK_SIZE)
    monkeypatch.setattr(patch_mod, "split_ranges", lambda size: split_ranges(size, 1 << 17))
    parts = encode_patch(old, new, version=2, base_version=1, values=ULP2, chunk_size=MIN_CHUNK_SIZE)
    assert len(whole[1]) > 3 and [c.data for c in parts[1]] == [c.data for c in whole[1]]
    assert np.array_equal(apply_patch(parts[0], [c.data for c in parts[1]], old)["w"].bits, b)


def test_ulp2_without_the_c_extension_says_so(monkeypatch):
    """ulp2's range coder lives in the C extension: an install without it refuses in one line."""
    from sparrowd.codec import bits

    rng = np.random.default_rng(2)
    a, b = make_pair(rng, "BF16", (64, 64), "1%", "ulp")
    monkeypatch.setattr(bits, "_native", None)
    with pytest.raises(FormatError, match="C extension") as e:
        encode_patch({"w": a}, {"w": b}, version=2, base_version=1, values=ULP2)
    assert "\n" not in str(e.value)


def _ulp2_stream_parts(rng, n):
    """What an ulp2 stream codes for ``n`` changes spread over three classes, with no history."""
    from sparrowd.codec.bits import ulp2_context  # noqa: F401  (skips below without the extension)

    counts = [(c, k) for c, k in zip((2, 5, 9), (n // 2, n // 3, n - n // 2 - n // 3)) if k]
    ranks = np.concatenate([np.sort(rng.choice(50 * n, k, replace=False)) for _, k in counts]).astype(np.int64)
    table = [[c, k, 6] for c, k in counts]
    codes = np.where(rng.random(n) < 0.9, rng.integers(1, 3, n), rng.integers(3, 40, n)).astype(np.uint16)
    none = np.empty(0, np.uint8)
    return ranks, table, codes, none, none, none, codes[:0]


def test_ulp2_contexts_carry_from_one_segment_to_the_next():
    """A chunk's ulp2 segments are coded in order, each from the contexts the one before left: the
    decoder, moving its contexts on the same way, gets every segment back and ends in the encoder's
    state; decoding a later segment from fresh contexts does not give it back."""
    from sparrowd.codec.bits import _native, ulp2_context, ulp2_pack, ulp2_unpack

    if _native is None:
        pytest.skip("no C extension in this build")
    rng = np.random.default_rng(11)
    parts = [_ulp2_stream_parts(rng, n) for n in (300, 40, 2000)]
    enc, dec = ulp2_context(), ulp2_context()
    assert enc == dec and len(enc) > 0
    streams = [ulp2_pack(*p, state=enc) for p in parts]
    assert enc != ulp2_context()  # the contexts moved on
    for (ranks, _, codes, *_), data in zip(parts, streams):
        counts, got_ranks, got_codes, _, _ = ulp2_unpack(data, 50 * codes.size, codes.size, 2,
                                                         np.empty(0, np.uint8), np.empty(0, np.uint8), dec)
        assert np.array_equal(got_ranks, ranks) and np.array_equal(got_codes, codes)
    assert dec == enc
    # The third segment was coded from where the second left the contexts, not from fresh ones.
    ranks, _, codes, *_ = parts[2]
    try:
        _, got_ranks, got_codes, _, _ = ulp2_unpack(streams[2], 50 * codes.size, codes.size, 2,
                                                    np.empty(0, np.uint8), np.empty(0, np.uint8))
    except FormatError:
        pass
    else:
        assert not (np.array_equal(got_ranks, ranks) and np.array_equal(got_codes, codes))
    with pytest.raises(ValueError, match="context state"):
        ulp2_pack(*parts[0], state=bytearray(len(enc)))  # probabilities of 0: not a state a coder makes
    with pytest.raises(ValueError, match="context state"):
        ulp2_pack(*parts[0], state=bytearray(enc[:-2]))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_ulp2_chunks_coded_on_a_pool_are_the_bytes_coded_in_line(threads):
    """With a pool, each chunk's ulp2 streams are coded segment by segment as the segments are
    encoded (codec.patch._ChunkCoder), not when the chunk closes: the chunks are the bytes of an
    encoder without a pool, for chunks of many segments (small tensors, row mode among them) and
    segments split across chunks, on one worker or several."""
    from concurrent.futures import ThreadPoolExecutor

    from sparrowd.codec.bits import _native
    from sparrowd.codec.patch import PatchEncoder

    if _native is None:
        pytest.skip("no C extension in this build")
    rng = np.random.default_rng(21)
    old, new = {}, {}
    for i in range(40):
        shape = (int(rng.integers(20, 120)), int(rng.integers(200, 600)))
        o = (rng.normal(0, 0.02, shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        n = o.copy()
        if i % 7 == 3:  # a few live rows: row mode
            n[rng.integers(0, shape[0], 2)] += np.uint16(1)
        else:
            n.reshape(-1)[rng.random(o.size) < 0.03] += np.uint16(1)
        old[f"t{i:02d}"] = RawTensor("BF16", shape, o.reshape(-1))
        new[f"t{i:02d}"] = RawTensor("BF16", shape, n.reshape(-1))

    def run(pool):
        enc = PatchEncoder(version=1, base_version=0, values=ULP2, chunk_size=MIN_CHUNK_SIZE, pool=pool)
        chunks = [c for name in sorted(new) for c in enc.add(name, old[name], new[name])]
        manifest, rest = enc.finish()
        return manifest, chunks + rest

    want_manifest, want = run(None)
    assert len(want) > 3 and max(len(c.segments) for c in want) > 3
    with ThreadPoolExecutor(threads) as pool:
        got_manifest, got = run(pool)
    assert [c.data for c in got] == [c.data for c in want]
    assert got_manifest.to_bytes() == want_manifest.to_bytes()
    out = apply_patch(got_manifest, [c.data for c in got], old)
    assert all(np.array_equal(out[k].bits, new[k].bits) for k in new)


def test_ulp2_a_segment_failing_on_a_pool_fails_the_patch_and_nothing_waits(monkeypatch):
    """A segment whose encoding raises fails the encode with that error: the chunk coder hands the
    failure on to the segments after it and to the chunk, and no worker is left waiting."""
    import sparrowd.codec.patch as patch_mod
    from sparrowd.codec.bits import _native

    if _native is None:
        pytest.skip("no C extension in this build")
    real, calls = patch_mod.encode_segment, []

    def flaky(seg):
        calls.append(seg.name)
        if len(calls) == 3:
            raise RuntimeError("disk on fire")
        return real(seg)

    monkeypatch.setattr(patch_mod, "encode_segment", flaky)
    rng = np.random.default_rng(22)
    old = {f"t{i}": RawTensor("BF16", (5000,), (rng.normal(0, 0.02, 5000).astype(np.float32).view(np.uint32)
                                                  >> 16).astype(np.uint16)) for i in range(6)}
    new = {k: RawTensor("BF16", (5000,), t.bits + np.uint16(1) * (rng.random(5000) < 0.05)) for k, t in old.items()}
    with pytest.raises(RuntimeError, match="disk on fire"):
        encode_patch(old, new, version=1, base_version=0, values=ULP2, threads=2)


def test_ulp2_streams_end_without_slack():
    """No stream starts with LZMA's constant zero byte nor ends in the zero bytes a decoder reads past
    the end anyway; bytes beyond what the decoder reads are refused, and a byte lost is refused or
    decodes to something else."""
    from sparrowd.codec.bits import _native, ulp2_pack, ulp2_unpack

    if _native is None:
        pytest.skip("no C extension in this build")
    rng = np.random.default_rng(12)
    none = np.empty(0, np.uint8)
    firsts, lasts = set(), []
    for n in (1, 2, 7, 64, 500):
        for _ in range(20):
            parts = _ulp2_stream_parts(rng, n)
            ranks, _, codes, *_ = parts
            data = ulp2_pack(*parts)
            firsts.add(data[0])
            lasts.append(data[-1])
            got = ulp2_unpack(data, 50 * n, n, 2, none, none)
            assert np.array_equal(got[1], ranks) and np.array_equal(got[2], codes)
            with pytest.raises(FormatError, match="bytes over"):
                ulp2_unpack(data + b"\x01" * 5, 50 * n, n, 2, none, none)
            try:
                short = ulp2_unpack(data[:-1], 50 * n, n, 2, none, none)
            except FormatError:
                continue
            assert not (np.array_equal(short[1], ranks) and np.array_equal(short[2], codes))
    assert firsts != {0}
    assert sum(b != 0 for b in lasts) >= 0.9 * len(lasts)  # the flush's zero bytes are left out


def test_ulp2_manifest_lists_no_segments_and_a_chunk_must_fit_its_tensors():
    """A format 2 manifest leaves each chunk's segment list to the chunk's header (the signed hash
    vouches for it); a decoded chunk is still refused when its segments name a tensor the manifest
    lacks or run past one, and format 1 keeps listing them."""
    from sparrowd.codec import decode_chunk
    from sparrowd.codec.patch import check_segments

    rng = np.random.default_rng(8)
    a, b = make_pair(rng, "BF16", (5000,), "1%", "ulp")
    m, chunks = encode_patch({"w": a}, {"w": b}, version=2, base_version=1, values=ULP2)
    assert b"segments" not in zstandard.ZstdDecompressor().decompress(m.to_bytes())
    assert Manifest.from_bytes(m.to_bytes()) == m and m.chunks[0].segments is None
    segs = decode_chunk(chunks[0].data, expect_hash=m.chunks[0].hash, base={"w": a.bits})
    check_segments(m, m.chunks[0], segs)
    other, _ = encode_patch({"v": a}, {"v": b}, version=2, base_version=1, values=ULP2)
    with pytest.raises(FormatError, match="no tensor"):
        check_segments(other, other.chunks[0], segs)
    small = RawTensor("BF16", (100,), a.bits[:100])
    short, _ = encode_patch({"w": small}, {"w": RawTensor("BF16", (100,), b.bits[:100] ^ 1)}, version=2,
                            base_version=1, values=ULP2)
    with pytest.raises(FormatError, match="no tensor"):
        check_segments(short, short.chunks[0], segs)
    m1, _ = encode_patch({"w": a}, {"w": b}, version=2, base_version=1, values=ULP)
    assert Manifest.from_bytes(m1.to_bytes()).chunks[0].segments == (("w", 0, 5000, m1.tensor("w").changed),)


def _check_kept_copy(snaps: list[RawTensor], min_chunks: int) -> list[bytes]:
    """The Publisher's path, coded against the history of the first two steps: its kept copy of the
    base already holds the new bits where they changed, and the old bits come aside (``add_extract``
    with ``old_values``). The chunks must be byte for byte those ``encode_patch`` codes from the
    untouched base, and decode to the new version. Returns them."""
    from sparrowd.codec import History, PatchEncoder
    from sparrowd.codec.history import changes_between

    h = History()
    for v in (1, 2):
        h = h.after(v, changes_between({"t": snaps[v - 1]}, {"t": snaps[v]}))
    old, new = snaps[2], snaps[3]
    idx = np.flatnonzero(old.bits != new.bits).astype(np.int64)
    enc = PatchEncoder(version=3, base_version=2, values=ULP2, history=h, chunk_size=MIN_CHUNK_SIZE)
    moved = RawTensor(new.dtype, new.shape, new.bits.copy())  # the kept copy, brought up to date
    got = enc.add_extract("t", moved, new, idx, b"f" * 16, b"g" * 16, old.bits[idx], new.bits[idx])
    _, rest = enc.finish()
    got = [c.data for c in got + rest]
    m, ref = encode_patch({"t": old}, {"t": new}, version=3, base_version=2, values=ULP2, history=h,
                          chunk_size=MIN_CHUNK_SIZE)
    assert len(got) >= min_chunks and got == [c.data for c in ref]
    assert np.array_equal(apply_patch(m, got, {"t": old}, h)["t"].bits, new.bits)
    return got


def test_ulp2_from_a_kept_copy_already_moved_gives_the_same_chunks():
    """The Publisher's path: its kept copy of the base already holds the new bits where they changed,
    and the old bits come aside (``add_extract`` with ``old_values``). Against a history, the chunks
    are byte for byte those coded from the untouched base."""
    rng = np.random.default_rng(21)
    n = 1 << 21
    snaps = [make_pair(rng, "BF16", (n,), "1%", "ulp")[0]]
    for _ in range(3):
        b = snaps[-1].bits.copy()
        moved = rng.choice(n, 20_000, replace=False)
        b[moved[:10_000]] += 1
        b[moved[10_000:]] -= 1
        b[rng.choice(40_000, 5_000, replace=False)] += 1  # some of the first elements move again and again
        snaps.append(RawTensor("BF16", (n,), b))
    _check_kept_copy(snaps, min_chunks=4)


def _row_sparse_chain(rng, rows: int, cols: int, live: float, steps: int = 3) -> list[RawTensor]:
    """An embedding-like matrix: each step moves elements of a few rows only (those of the tokens in
    the batch), a share of them rows that moved the step before."""
    n = rows * cols
    bits = (rng.normal(0, 0.02, n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    snaps, hot = [RawTensor("BF16", (rows, cols), bits.copy())], np.empty(0, np.int64)
    for _ in range(steps):
        fresh = rng.choice(rows, max(1, int(rows * live)), replace=False)
        hot = np.union1d(fresh, hot[rng.random(hot.size) < 0.5])
        pos = (hot[:, None] * cols + np.arange(cols)).reshape(-1)
        moved = pos[rng.random(pos.size) < 0.05]
        bits[moved] += np.where(rng.random(moved.size) < 0.5, 1, 0xFFFF).astype(np.uint16)
        snaps.append(RawTensor("BF16", (rows, cols), bits.copy()))
    return snaps


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 700), cols=st.sampled_from([1, 3, 64, 384]), live=st.sampled_from([0.01, 0.1, 0.9]),
       seed=st.integers(0, 2**32 - 1), chunk_size=st.sampled_from([MIN_CHUNK_SIZE, 1 << 20]))
def test_ulp2_row_mode_round_trips(rows, cols, live, seed, chunk_size):
    """Matrices whose changes sit in a few rows take row mode (a rows stream, then the changes within
    those rows laid end to end); any shape, cut across chunks anywhere, against a history, comes back
    bit for bit."""
    from sparrowd.codec import History
    from sparrowd.codec.history import changes_between

    snaps = _row_sparse_chain(np.random.default_rng(seed), rows, cols, live)
    h = History()
    for v in range(1, len(snaps)):
        old, new = {"e": snaps[v - 1]}, {"e": snaps[v]}
        m, chunks = encode_patch(old, new, version=v, base_version=v - 1, values=ULP2, history=h or None,
                                 chunk_size=chunk_size)
        got = apply_patch(Manifest.from_bytes(m.to_bytes()), [c.data for c in chunks], old, h or None)
        assert np.array_equal(got["e"].bits if "e" in got else old["e"].bits, new["e"].bits)
        h = h.after(v, changes_between(old, new))


def test_ulp2_row_mode_is_taken_where_it_pays_and_costs_less():
    """An embedding whose changes sit in 2% of its rows is coded in row mode and comes out smaller
    than without it; a matrix that changes in every row is not; a rows stream that names no row, or
    row mode on a segment that is not ulp2, is refused."""
    import sparrowd.codec.chunk as chunk_mod
    from sparrowd.codec import decode_chunk
    from sparrowd.codec.chunk import CHUNK_MAGIC
    from sparrowd.schema import pack, unpack

    def header(data):
        raw = zstandard.ZstdDecompressor().decompress(data)
        hlen = int.from_bytes(raw[4:8], "little")
        return raw, hlen, unpack(raw[8:8 + hlen], what="chunk header")

    snaps = _row_sparse_chain(np.random.default_rng(30), 4000, 256, 0.02, steps=1)
    old, new = {"e": snaps[0]}, {"e": snaps[1]}
    m, chunks = encode_patch(old, new, version=1, base_version=0, values=ULP2)
    raw, hlen, head = header(chunks[0].data)
    assert head["segments"][0]["rows"] == 256 and len(head["segments"][0]["blobs"]) == 2
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(chunk_mod, "ROW_MODE_MIN_ROWS", 1 << 40)
        plain, _ = encode_patch(old, new, version=1, base_version=0, values=ULP2)
    assert m.patch_bytes < 0.8 * plain.patch_bytes, (m.patch_bytes, plain.patch_bytes)
    dense = _row_sparse_chain(np.random.default_rng(31), 400, 256, 1.0, steps=1)
    _, dchunks = encode_patch({"e": dense[0]}, {"e": dense[1]}, version=1, base_version=0, values=ULP2)
    assert "rows" not in header(dchunks[0].data)[2]["segments"][0]

    def redo(seg_edit, blob_edit=None):
        h = unpack(raw[8:8 + hlen], what="chunk header")
        seg_edit(h["segments"][0])
        body = raw[8 + hlen:]
        if blob_edit is not None:
            body = blob_edit(body, h["segments"][0])
        packed = pack(h)
        return zstandard.ZstdCompressor().compress(CHUNK_MAGIC + len(packed).to_bytes(4, "little") + packed + body)

    with pytest.raises(FormatError, match="row mode"):
        decode_chunk(redo(lambda s: s.update(rows=0)), base={"e": snaps[0].bits})
    n_rows = head["segments"][0]["blobs"][0]
    # the rows stream goes last in the body (stream order): all zero bytes name no row
    no_rows = redo(lambda s: None, lambda body, s: body[:len(body) - n_rows] + b"\0" * n_rows)
    with pytest.raises(FormatError):
        decode_chunk(no_rows, base={"e": snaps[0].bits})


def test_ulp2_row_mode_from_a_kept_copy_gives_the_same_chunks():
    """Row mode on the Publisher's path (a kept copy already moved, the old bits aside), against a
    history and cut across chunks: byte for byte the chunks coded from the untouched base."""
    snaps = _row_sparse_chain(np.random.default_rng(33), 6000, 384, 0.03)
    got = _check_kept_copy(snaps, min_chunks=3)
    assert all(b"rows" in zstandard.ZstdDecompressor().decompress(c) for c in got)


@pytest.mark.parametrize("lag", [1, 2, 5])
def test_an_anchor_closed_on_a_pool_with_any_lag_is_the_bytes_closed_in_line(lag):
    """Whole tensors (an anchor) with `lag` chunks compressing at once on a pool (the Publisher's
    anchors, lag = its threads): the chunks are those of an encoder without a pool and the same lag,
    and they load back to the tensors."""
    from concurrent.futures import ThreadPoolExecutor

    from sparrowd.codec.patch import PatchEncoder

    rng = np.random.default_rng(lag)
    tensors = {f"t{i}": RawTensor("BF16", (64, 2048), (rng.normal(0, 0.02, 64 * 2048).astype(np.float32)
                                                          .view(np.uint32) >> 16).astype(np.uint16))
               for i in range(6)}

    def run(pool):
        enc = PatchEncoder(version=0, base_version=None, chunk_size=MIN_CHUNK_SIZE, pool=pool, lag=lag)
        chunks = [c for name in sorted(tensors) for c in enc.add(name, None, tensors[name])]
        manifest, rest = enc.finish()
        return manifest, chunks + rest

    want_manifest, want = run(None)
    assert len(want) > lag + 2
    with ThreadPoolExecutor(3) as pool:
        got_manifest, got = run(pool)
    assert [c.data for c in got] == [c.data for c in want]
    assert got_manifest.to_bytes() == want_manifest.to_bytes()
    out = apply_patch(got_manifest, [c.data for c in got], {})
    assert all(np.array_equal(out[k].bits, tensors[k].bits) for k in tensors)
    with pytest.raises(InputError, match="lag"):
        PatchEncoder(version=0, base_version=None, lag=0)
