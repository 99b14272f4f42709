"""Manifests and chunks from outside are checked field by field."""

import msgpack
import numpy as np
import pytest
import zstandard

from sparrowd.codec import Manifest, RawTensor, decode_chunk, encode_patch
from sparrowd.codec.manifest import MAX_MANIFEST
from sparrowd.errors import FormatError


@pytest.fixture
def manifest():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 1 << 16, size=4000, dtype=np.uint16)
    b = a.copy()
    b[::50] ^= 1
    m, chunks = encode_patch({"w": RawTensor("BF16", (4000,), a)}, {"w": RawTensor("BF16", (4000,), b)},
                             version=3, base_version=2)
    return m, chunks


def mutate(m: Manifest, fn) -> bytes:
    d = msgpack.unpackb(m.to_bytes(), raw=False)
    fn(d)
    return msgpack.packb(d, use_bin_type=True)


@pytest.mark.parametrize(
    "fn,match",
    [
        (lambda d: d.pop("version"), "missing field 'version'"),
        (lambda d: d.update(version="3"), "'version' must be"),
        (lambda d: d.update(version=True), "'version' must be"),
        (lambda d: d.update(format="other"), "not a sparrowd patch"),
        (lambda d: d.update(format_version=99), "not supported"),
        (lambda d: d.update(values="fancy"), "value mode"),
        (lambda d: d["tensors"][0].update(op="merge"), "unknown op"),
        (lambda d: d["tensors"][0].update(dtype="Q7"), "unsupported dtype"),
        (lambda d: d["tensors"][0].update(shape=[-1]), "shape"),
        (lambda d: d["tensors"][0].update(changed=5), "claims 5 changes"),
        (lambda d: d["chunks"][0].update(hash=b"short"), "32 bytes"),
        (lambda d: d["chunks"][0]["segments"][0].__setitem__(2, 10**9), "does not fit"),
        (lambda d: d["chunks"][0]["segments"][0].__setitem__(0, "other"), "unknown tensor"),
        (lambda d: d["tensors"].append(dict(d["tensors"][0])), "unique"),
    ],
)
def test_malformed_manifests_are_refused(manifest, fn, match):
    m, _ = manifest
    with pytest.raises(FormatError, match=match):
        Manifest.from_bytes(mutate(m, fn))


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x92\x01", msgpack.packb([1, 2]), b"\xdd\xff\xff\xff\xff"])
def test_garbage_manifests_are_refused(data):
    with pytest.raises(FormatError):
        Manifest.from_bytes(data)


def test_manifest_round_trips_exactly(manifest):
    m, _ = manifest
    assert Manifest.from_bytes(m.to_bytes()) == m


def test_format_2_manifests_are_compressed_and_checked_like_plain_ones():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 1 << 14, size=4000, dtype=np.uint16)  # finite bf16 patterns
    b = a.copy()
    b[::50] ^= 1
    m, _ = encode_patch({"w": RawTensor("BF16", (4000,), a)}, {"w": RawTensor("BF16", (4000,), b)},
                        version=3, base_version=2, values="ulp2")
    raw = m.to_bytes()
    plain = zstandard.ZstdDecompressor().decompress(raw)
    assert Manifest.from_bytes(raw) == m and Manifest.from_bytes(plain) == m  # the plain form still reads
    cctx = zstandard.ZstdCompressor()
    bad = [
        cctx.compress(b"\0" * (MAX_MANIFEST + 1)),  # a bomb
        raw[:-3],  # truncated
        cctx.compress(msgpack.packb([1, 2])),  # not a map
        cctx.compress(b""),
        b"\x28\xb5\x2f\xfd" + b"\0" * 20,  # the magic and garbage
    ]
    for data in bad:
        with pytest.raises(FormatError):
            Manifest.from_bytes(data)


def test_format_2_carries_short_fingerprints_and_they_still_catch_a_wrong_base():
    from sparrowd.codec import apply_patch, fingerprint
    from sparrowd.codec.extract import SHORT_FP, fp_equal
    from sparrowd.errors import BaseMismatchError

    rng = np.random.default_rng(1)
    a = rng.integers(0, 1 << 14, size=4000, dtype=np.uint16)
    b = a.copy()
    b[::40] += 1
    old, new = {"w": RawTensor("BF16", (4000,), a)}, {"w": RawTensor("BF16", (4000,), b)}
    m1, _ = encode_patch(old, new, version=3, base_version=2, values="ulp")
    m2, chunks = encode_patch(old, new, version=3, base_version=2, values="ulp2")
    assert len(m1.tensors[0].base_fp) == 16 and len(m2.tensors[0].base_fp) == SHORT_FP
    assert m2.tensors[0].base_fp == m1.tensors[0].base_fp[:SHORT_FP]
    assert fp_equal(fingerprint(a), m2.tensors[0].base_fp)
    assert fp_equal(m1.tensors[0].result_fp, m2.tensors[0].result_fp)
    assert not fp_equal(fingerprint(b), m2.tensors[0].base_fp)
    assert not fp_equal(fingerprint(a), fingerprint(a)[:4]) and not fp_equal(None, b"x" * 16)
    with pytest.raises(BaseMismatchError):
        apply_patch(m2, [c.data for c in chunks], {"w": RawTensor("BF16", (4000,), a ^ 1)})
    wire = msgpack.unpackb(zstandard.ZstdDecompressor().decompress(m2.to_bytes()))
    wire["tensors"][0]["base_fp"] = b"\1" * 5
    with pytest.raises(FormatError, match="fingerprint"):
        Manifest.from_bytes(msgpack.packb(wire))


def test_chunk_decoder_refuses_bombs_and_garbage(manifest):
    _, chunks = manifest
    with pytest.raises(FormatError):
        decode_chunk(b"not zstd at all")
    # a frame that claims a huge content size
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (300 << 20))
    with pytest.raises(FormatError, match="oversized"):
        decode_chunk(bomb)
    # valid zstd, wrong magic
    with pytest.raises(FormatError, match="magic"):
        decode_chunk(zstandard.ZstdCompressor().compress(b"XXXX\0\0\0\0"))
    # a valid chunk decodes
    assert decode_chunk(chunks[0].data)[0].name == "w"


def test_files_ride_in_file_chunks_checked_against_their_hash():
    import blake3
    import numpy as np
    import pytest

    from sparrowd.codec import Manifest, RawTensor, decode_chunk
    from sparrowd.codec.chunk import decode_file_chunk
    from sparrowd.codec.patch import PatchEncoder
    from sparrowd.errors import FormatError, InputError

    enc = PatchEncoder(version=5, base_version=None, chunk_size=4096)
    chunks = enc.add("w", None, RawTensor("BF16", (8,), np.arange(8, dtype=np.uint16)))
    config = b'{"model_type": "qwen3"}' * 400
    chunks += enc.add_file("config.json", config)
    with pytest.raises(InputError, match="not carried"):
        enc.add_file("model.safetensors", b"x")
    with pytest.raises(InputError, match="plain name"):
        enc.add_file("../escape", b"x")
    m, rest = enc.finish()
    chunks += rest
    back = Manifest.from_bytes(m.to_bytes())
    assert back == m and [f.name for f in back.files] == ["config.json"]
    assert back.files[0].hash == blake3.blake3(config).digest()
    spans = [c.file for c in back.chunks if c.file]
    assert spans[0][1] == 0 and spans[-1][2] == len(config) and len(spans) == 3
    body = b"".join(bytes(decode_file_chunk(c.data, expect_hash=c.hash)[1]) for c in chunks if c.file)
    assert body == config
    assert all(decode_chunk(c.data) == [] for c in chunks if c.file)  # tensor decoders pass over them
    # A manifest whose file chunks do not tile the file is refused.
    wire = m.to_bytes()
    bad = Manifest(m.version, m.base_version, m.values, m.chunk_size, m.tensors, m.chunks[1:], m.meta, m.files)
    with pytest.raises(FormatError, match="file"):
        Manifest.from_bytes(bad.to_bytes())
    # Without files, a manifest has the bytes it always had (no "files" key).
    plain = Manifest(m.version, m.base_version, m.values, m.chunk_size, m.tensors,
                     tuple(c for c in m.chunks if not c.file), m.meta)
    assert b"files" not in plain.to_bytes() and b"files" in wire
