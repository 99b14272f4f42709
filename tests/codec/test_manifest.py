"""Manifests and chunks from outside are checked field by field."""

import msgpack
import numpy as np
import pytest
import zstandard

from sparrowd.codec import Manifest, RawTensor, decode_chunk, encode_patch
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
