"""ulp2 patches coded against the change history of the patches before them (codec.history)."""

import msgpack
import numpy as np
import pytest
import zstandard

from sparrowd.codec import History, Manifest, RawTensor, apply_patch, decode_chunk, encode_patch
from sparrowd.codec.history import DEPTH, DOWN, MOVED, TensorHistory, changes_between
from sparrowd.codec.patch import MIN_CHUNK_SIZE
from sparrowd.errors import BaseMismatchError, FormatError


def momentum_chain(rng, n: int, steps: int, dtype: str = "BF16") -> list[dict[str, RawTensor]]:
    """Snapshots of a tensor whose elements move as under momentum: most of a step's movers move
    again, the same way, the next step; a few new ones start; small elements move more."""
    exps = np.clip(rng.normal(118, 3, n).astype(np.int64), 100, 130)
    bits = ((exps << 7) | rng.integers(0, 128, n)).astype(np.uint16)
    velocity = np.zeros(n, np.int8)
    snaps = [{"w": RawTensor(dtype, (n // 64, 64), bits.copy())}]
    for _ in range(steps):
        keep = rng.random(n) < 0.7
        velocity[~keep] = 0
        start = (velocity == 0) & (rng.random(n) < 0.004 * np.exp2(120 - exps).clip(0.1, 8))
        velocity[start] = rng.choice(np.array([-1, 1], np.int8), int(start.sum()))
        bits = (bits.astype(np.int64) + velocity).astype(np.uint16)
        snaps.append({"w": RawTensor(dtype, (n // 64, 64), bits.copy())})
    return snaps


def test_a_chain_coded_against_its_history_round_trips_and_is_smaller():
    rng = np.random.default_rng(3)
    snaps = momentum_chain(rng, 1 << 19, 5)
    sent, receiver = History(), History()
    for v in range(1, len(snaps)):
        old, new = snaps[v - 1], snaps[v]
        m, chunks = encode_patch(old, new, version=v, base_version=v - 1, values="ulp2", history=sent,
                                 chunk_size=MIN_CHUNK_SIZE)
        bare, _ = encode_patch(old, new, version=v, base_version=v - 1, values="ulp2", chunk_size=MIN_CHUNK_SIZE)
        assert len(chunks) > 1  # segments cut across chunks each take their part of the history
        if sent.versions:
            assert m.history == (sent.versions, sent.fingerprint())
            assert m.patch_bytes < 0.9 * bare.patch_bytes, (v, m.patch_bytes, bare.patch_bytes)
        else:
            assert m.history is None and m.patch_bytes == bare.patch_bytes
        got = apply_patch(Manifest.from_bytes(m.to_bytes()), [c.data for c in chunks], old, receiver)
        assert np.array_equal(got["w"].bits, new["w"].bits)
        parts = {"w": [s for c in chunks for s in decode_chunk(c.data, base={"w": old["w"].bits}, history=receiver)]}
        sent = sent.after(v, changes_between(old, new))
        receiver = receiver.after_patch(m, parts)  # what a decoder learns from the segments it decoded
        assert receiver.fingerprint() == sent.fingerprint() and receiver.versions == sent.versions
    assert len(sent.versions) == 3


def test_a_patch_names_its_history_and_any_other_is_refused_before_decoding():
    rng = np.random.default_rng(4)
    snaps = momentum_chain(rng, 1 << 16, 3)
    h1 = History().after(1, changes_between(snaps[0], snaps[1]))
    h2 = h1.after(2, changes_between(snaps[1], snaps[2]))
    m, chunks = encode_patch(snaps[2], snaps[3], version=3, base_version=2, values="ulp2", history=h2)
    data = [c.data for c in chunks]
    for wrong in (None, History(), h1):
        with pytest.raises(BaseMismatchError, match="history"):
            apply_patch(m, data, snaps[2], wrong)
    # Decoded with another history regardless, it never comes out right in silence.
    try:
        segs = decode_chunk(chunks[0].data, base={"w": snaps[2]["w"].bits}, history=h1)
        assert not np.array_equal(segs[0].indices, np.flatnonzero(snaps[2]["w"].bits != snaps[3]["w"].bits))
    except FormatError:
        pass


def test_history_ages_one_patch_at_a_time():
    """An entry's state is its last direction and the mask of the last three patches that moved it
    (MOVED for the latest, 2 * MOVED for the one before, 4 * MOVED for the one before that)."""
    assert DEPTH == 3
    h = History().after(1, {"a": (np.array([2, 5, 9]), np.array([2, 1, 2], np.uint16))})  # up, down, up
    a = h.get("a")
    assert h.versions == (1,) and a.positions.tolist() == [2, 5, 9]
    assert a.state.tolist() == [MOVED, MOVED | DOWN, MOVED]
    h = h.after(2, {"a": (np.array([5, 7]), np.array([2, 1], np.uint16))}, reset=["gone"])
    a = h.get("a")  # 5 moved again (now up), 7 is new; 2 and 9 age
    assert h.versions == (2, 1)
    assert a.positions.tolist() == [2, 5, 7, 9] and a.state.tolist() == [2 * MOVED, 3 * MOVED, MOVED | DOWN, 2 * MOVED]
    h = h.after(3, {"a": (np.array([9]), np.array([1], np.uint16))})
    assert h.versions == (3, 2, 1) and h.get("a").positions.tolist() == [2, 5, 7, 9]
    assert h.get("a").state.tolist() == [4 * MOVED, 6 * MOVED, 2 * MOVED | DOWN, 5 * MOVED | DOWN]
    h = h.after(4, {})  # nothing moved: the moves of the oldest patch drop out, and with them 2
    assert h.versions == (4, 3, 2) and h.get("a").positions.tolist() == [5, 7, 9]
    assert h.get("a").state.tolist() == [4 * MOVED, 4 * MOVED | DOWN, 2 * MOVED | DOWN]
    assert not h.after(5, {}, reset=["a"]).versions
    assert h.after(5, {}).after(6, {}).after(7, {}).versions == ()  # all forgotten: no history at all
    assert h.get("a").within(6, 8).positions.tolist() == [7]
    same = History((4, 3, 2), {"a": TensorHistory(np.array([5, 7, 9]),
                                                  np.array([4 * MOVED, 4 * MOVED | DOWN, 2 * MOVED | DOWN], np.uint8))})
    assert same.fingerprint() == h.fingerprint() != History().fingerprint()


def test_a_history_merged_on_a_pool_is_the_one_merged_in_line():
    """The Publisher and a rollout's current folder merge each tensor's history on threads, side by
    side: the same history (entries, states, versions, fingerprint), with tensors that leave it
    (reset, or aged out) and tensors that join it."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(3)

    def step(names):
        out = {}
        for name in names:
            idx = np.unique(rng.integers(0, 50_000, 800)).astype(np.int64)
            out[name] = (idx, rng.integers(1, 5, idx.size).astype(np.uint16))
        return out

    line = pooled = History()
    with ThreadPoolExecutor(3) as pool:
        for v, names in enumerate([[f"t{i}" for i in range(9)], ["t1", "t2", "t9"], [], ["t4"], ["t0", "t4"]], 1):
            changes, reset = step(names), (["t2"] if v == 3 else [])
            line = line.after(v, changes, reset)
            pooled = pooled.after(v, changes, reset, pool=pool)
            assert pooled.versions == line.versions and set(pooled.tensors) == set(line.tensors)
            for name, t in line.tensors.items():
                assert np.array_equal(pooled.get(name).positions, t.positions)
                assert np.array_equal(pooled.get(name).state, t.state)
            assert pooled.fingerprint() == line.fingerprint()
    assert "t2" not in line.tensors and "t4" in line.tensors


def test_history_is_for_ulp2_and_a_manifest_records_it_checked():
    from sparrowd.errors import InputError

    rng = np.random.default_rng(5)
    snaps = momentum_chain(rng, 1 << 14, 2)
    h = History().after(1, changes_between(snaps[0], snaps[1]))
    with pytest.raises(InputError):
        encode_patch(snaps[1], snaps[2], version=2, base_version=1, values="ulp", history=h)
    m, _ = encode_patch(snaps[1], snaps[2], version=2, base_version=1, values="ulp2", history=h)
    assert Manifest.from_bytes(m.to_bytes()) == m
    wire = msgpack.unpackb(zstandard.ZstdDecompressor().decompress(m.to_bytes()))
    for bad in ({"versions": [], "fp": b"\0" * 8}, {"versions": [1], "fp": b"\0" * 3}, {"versions": ["x"]}, 7):
        with pytest.raises(FormatError):
            Manifest.from_bytes(msgpack.packb({**wire, "history": bad}))


def test_the_one_pass_merge_ages_as_numpy_does(monkeypatch):
    import sparrowd.codec.bits as bits

    rng = np.random.default_rng(8)
    h = History()
    for v in range(1, 5):
        idx = np.unique(rng.integers(0, 50_000, 3_000))
        if v > 1:  # some of the last patch's elements move again
            last = h.get("w").positions
            idx = np.union1d(idx, last[rng.random(last.size) < 0.3])
        codes = rng.integers(1, 6, idx.size).astype(np.uint16)
        native = h.after(v, {"w": (idx, codes)})
        with monkeypatch.context() as m:
            m.setattr(bits, "_native", None)
            plain = h.after(v, {"w": (idx, codes)})
        assert native.fingerprint() == plain.fingerprint()
        assert native.versions == plain.versions == (v, *h.versions)[:DEPTH]
        h = native


@pytest.mark.parametrize("parts", [False, True])
def test_history_classes_taken_by_the_diff_give_the_same_bytes(parts, monkeypatch):
    """The diff classes the history's entries in its own pass (the encoder then reads no base for
    them): the chunks are byte for byte those of an encoder that reads the base per entry, for a
    tensor diffed whole and one diffed in parts, and the chain applies."""
    import sparrowd.codec.patch as patch
    from sparrowd.codec import PatchEncoder

    if parts:
        monkeypatch.setattr(patch, "split_ranges", lambda n: [(0, 1 << 17), (1 << 17, n)])
    rng = np.random.default_rng(9)
    snaps = momentum_chain(rng, 1 << 18, 4)
    h = History()
    for v in range(1, len(snaps)):
        old, new = snaps[v - 1], snaps[v]
        m, chunks = encode_patch(old, new, version=v, base_version=v - 1, values="ulp2", history=h,
                                 chunk_size=MIN_CHUNK_SIZE)
        enc = PatchEncoder(version=v, base_version=v - 1, values="ulp2", chunk_size=MIN_CHUNK_SIZE, history=h)
        plain = enc.add("w", old["w"], new["w"])  # ranks by a separate scan; history classes from the base
        m2, rest = enc.finish()
        assert [c.data for c in chunks] == [c.data for c in plain + rest]
        assert m.tensors == m2.tensors and m.history == m2.history
        got = apply_patch(m, [c.data for c in chunks], old, h)
        assert np.array_equal(got["w"].bits, new["w"].bits)
        h = h.after(v, changes_between(old, new))


def test_history_classes_read_from_a_kept_copy_are_the_base_s():
    """Without the diff's classes the encoder reads them from the base; where the base is a kept copy
    already holding the new bits, the entries that changed take theirs from the old bits."""
    from sparrowd.codec.bits import _classes, class_lo, exponent_field, history_classes

    rng = np.random.default_rng(10)
    base = rng.integers(0, 1 << 16, 100_000).astype(np.uint16)
    idx = np.unique(rng.integers(0, base.size, 3_000))
    kept = base.copy()
    kept[idx] ^= np.uint16(0x3F80)  # other exponents: other classes
    hpos = np.union1d(np.unique(rng.integers(0, base.size, 5_000)), idx[::2])
    shift, mask = exponent_field("BF16")
    lo = class_lo(base, 0, base.size, shift, mask)
    want = _classes(base[hpos], 0, hpos.size, shift, mask, lo)
    assert np.array_equal(history_classes(kept, "BF16", lo, hpos, idx, base[idx]), want)
    assert np.array_equal(history_classes(base, "BF16", lo, hpos, idx, None), want)
    assert not np.array_equal(history_classes(kept, "BF16", lo, hpos, idx, None), want)
    with pytest.raises(ValueError, match="outside the base"):
        history_classes(base, "BF16", lo, np.array([base.size]), idx, None)


def test_the_next_history_lets_go_of_the_changes_positions_once_merged():
    """The Publisher merges the next history on a thread after ``publish`` returns; the positions
    are views of its page-locked buffer, so the encoder must let go of them once merged, not when
    the thread that ran the merge drops it. The merge is taken once."""
    import weakref

    from sparrowd.codec.patch import PatchEncoder

    rng = np.random.default_rng(5)
    old, new = momentum_chain(rng, 1 << 16, 1)
    idx = np.flatnonzero(old["w"].bits != new["w"].bits).astype(np.int64)
    enc = PatchEncoder(version=1, base_version=0, values="ulp2", chunk_size=MIN_CHUNK_SIZE)
    enc.add_extract("w", new["w"], new["w"], idx, b"f" * 16, b"g" * 16, old["w"].bits[idx], new["w"].bits[idx])
    enc.finish()
    ref = weakref.ref(idx)
    del idx
    assert ref() is not None  # the encoder holds the positions until the merge
    merged = enc.next_history()
    assert ref() is None and merged.get("w").positions.size > 0
    with pytest.raises(RuntimeError, match="twice"):
        enc.next_history()
