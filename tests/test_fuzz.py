"""Fuzzing the decoders of everything that arrives from outside: patch files, manifests, signed
statements, engine-socket frames, decoded patches, and the daemon's listeners. Every input gets a
clear SparrowError (or HTTP 4xx), nothing crashes, nothing allocates what a header merely claims."""

from __future__ import annotations

import socket
import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparrowd.codec.manifest import Manifest
from sparrowd.codec.patchfile import parse_patch
from sparrowd.decoded import read_decoded
from sparrowd.enginewire import MAX_FRAME, parse
from sparrowd.errors import SparrowError
from sparrowd.schema import unpack
from sparrowd.swarm.signing import Signed
from sparrowd.swarm.versions import from_bitmap

# msgpack values of every kind, nested: what a hostile peer can encode
values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=64),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20)
garbage = st.binary(max_size=2048) | values.map(lambda v: msgpack.packb(v, use_bin_type=True))


def refused_cleanly(fn, data) -> None:
    try:
        fn(data)
    except SparrowError as e:
        assert str(e) and "\n" not in str(e)


@pytest.mark.slow  # many generated cases
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(garbage)
def test_patch_files(data):
    refused_cleanly(parse_patch, b"SPRW" + data[:4] + data)
    refused_cleanly(parse_patch, data)


@pytest.mark.slow  # many generated cases
@settings(max_examples=300, deadline=None)
@given(garbage)
def test_manifests_statements_frames_and_have_maps(data):
    refused_cleanly(Manifest.from_bytes, data)
    refused_cleanly(Signed.from_bytes, data)
    refused_cleanly(lambda d: parse(d, request=True), data)
    refused_cleanly(from_bitmap, data)


@pytest.mark.slow  # many generated cases
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 300), st.binary(max_size=512), st.integers(0, 40), values)
def test_ulp2_segments_from_outside(lo, body, count, v):
    """ulp2 chunks with hostile headers and coded streams (class table included), decoded against a
    real base."""
    import numpy as np
    import zstandard

    from sparrowd.codec.chunk import CHUNK_MAGIC, decode_chunk
    from sparrowd.schema import pack

    blobs = [len(body)]
    halves = [len(body) // 2, len(body) - len(body) // 2]  # row mode: the rows stream, then the coded one
    for seg in ({"name": "w", "dtype": "BF16", "kind": "sparse", "values": "ulp2", "start": 0, "stop": 4096,
                 "count": count, "index_k": 0, "blobs": blobs, "class_lo": lo},
                {"name": "w", "dtype": "BF16", "kind": "sparse", "values": "ulp2", "start": 0, "stop": 4096,
                 "count": count, "index_k": 0, "blobs": blobs, "class_lo": v},
                {"name": "w", "dtype": "BF16", "kind": "sparse", "values": "ulp2", "start": 0, "stop": 4096,
                 "count": count, "index_k": 0, "blobs": halves, "class_lo": lo, "rows": 1 + lo % 97},
                {"name": "w", "dtype": "BF16", "kind": "sparse", "values": "ulp2", "start": 0, "stop": 4096,
                 "count": count, "index_k": 0, "blobs": halves, "class_lo": lo, "rows": v}):
        head = pack({"segments": [seg]})
        raw = CHUNK_MAGIC + len(head).to_bytes(4, "little") + head + body
        data = zstandard.ZstdCompressor().compress(raw)
        base = {"w": np.random.default_rng(0).integers(0, 1 << 16, 4096, dtype=np.uint16)}
        refused_cleanly(lambda d: decode_chunk(d, base=base), data)


@pytest.mark.slow  # many generated cases
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=8),
       st.integers(-3, 3))
def test_ulp2_coded_streams_damaged(flips, trim):
    """A real ulp2 chunk whose coded stream has bytes changed, cut or padded: refused, or decoded
    to positions inside the segment (which the result's fingerprint then refuses)."""
    import numpy as np
    import zstandard

    from sparrowd.codec import RawTensor, decode_chunk, encode_patch

    rng = np.random.default_rng(7)
    a = (rng.normal(0, 0.02, 20_000).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    b = a.copy()
    b[rng.random(a.size) < 0.02] += 1
    rowed = b.copy()  # an embedding-like matrix: changes in 5 of its 200 rows (row mode)
    rowed[:] = a
    rowed[np.arange(5)[:, None] * 100 * 40 + np.arange(0, 100, 3)] += 1
    for shape, new in (((a.size,), b), ((200, 100), rowed)):
        _, chunks = encode_patch({"w": RawTensor("BF16", shape, a)}, {"w": RawTensor("BF16", shape, new)},
                                 version=2, base_version=1, values="ulp2")
        raw = bytearray(zstandard.ZstdDecompressor().decompress(chunks[0].data))
        head = 8 + int.from_bytes(raw[4:8], "little")
        assert (b"rows" in raw[:head]) == (len(shape) == 2)
        for at, byte in flips:
            raw[head + at % (len(raw) - head)] = byte
        body = bytes(raw) + b"\0" * max(trim, 0) if trim >= 0 else bytes(raw[:trim])
        data = zstandard.ZstdCompressor().compress(body)
        try:
            segs = decode_chunk(data, base={"w": a})
        except SparrowError as e:
            assert str(e) and "\n" not in str(e)
        else:
            assert all(s.indices.size == 0 or (0 <= s.indices.min() and s.indices.max() < a.size) for s in segs)


@settings(max_examples=100, deadline=None)
@given(values)
def test_well_formed_msgpack_of_the_wrong_shape(v):
    data = msgpack.packb(v, use_bin_type=True)
    for fn in (Manifest.from_bytes, Signed.from_bytes, lambda d: parse(d, request=True)):
        refused_cleanly(fn, data)
    refused_cleanly(lambda d: parse(d, request=True), msgpack.packb({"op": "hello", "engine": v, "rank": v,
                                                                      "version": v, "token": v}, use_bin_type=True))


@pytest.mark.parametrize("header", [
    b"\xc6\xff\xff\xff\xff",  # bin32 claiming 4 GiB
    b"\xdb\xff\xff\xff\xff",  # str32 claiming 4 GiB
    b"\xdd\xff\xff\xff\xff",  # array32 claiming 4 billion items
    b"\xdf\xff\xff\xff\xff",  # map32 claiming 4 billion pairs
])
def test_declared_lengths_are_not_believed(header):
    with pytest.raises(SparrowError):
        unpack(header + b"\x00" * 16, what="message", max_len=1 << 20)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=4096), head=st.integers(0, 2**64 - 1))
def test_decoded_patch_files(tmp_path, data, head):
    p = tmp_path / "d.safetensors"
    p.write_bytes(struct.pack("<Q", head % 5000) + data)
    refused_cleanly(read_decoded, p)


@pytest.mark.slow
def test_every_listener_survives_garbage_and_slow_senders(cluster):
    """Random bodies to every POST endpoint, garbage and lying frames on the engine socket, a sender
    that stalls mid-request: clear refusals, and the daemons keep serving."""
    import random
    import time

    from tests.daemon.harness import get, wait_for

    trainer, node = cluster.pair()
    rnd = random.Random(0)
    bodies = [bytes(rnd.getrandbits(8) for _ in range(rnd.randint(0, 3000))) for _ in range(20)]
    bodies += [msgpack.packb(v) for v in ({}, [], {"node_id": 1}, {"versions": "x"}, "s", 2**63)]
    for path in ("/v1/tracker/join", "/v1/tracker/renew", "/v1/tracker/leave", "/v1/swarm/exchange",
                 "/v1/publish/manifest", "/v1/publish/1/chunk/0", "/v1/publish/a1/chunk/0", "/v1/publish/x/chunk/0"):
        for b in bodies:
            code, _ = get(f"{cluster.tracker}{path}", cluster.token, method="POST", data=b)
            assert 400 <= code < 500, (path, code)
    for path in ("/v1/swarm/chunk/zz/0", "/v1/swarm/chunk/1/-1", "/v1/swarm/chunk/a99/0", "/v1/swarm/chunk/5/x"):
        assert 400 <= get(f"{node.url}{path}", cluster.token)[0] < 500
    sock = str(node.data_dir / "engine.sock")
    for frame in (b"\x00\x00\x00\x05hello", struct.pack(">I", MAX_FRAME + 1) + b"x",
                  struct.pack(">I", 3) + msgpack.packb([1]), b"\xff" * 64,
                  struct.pack(">I", 20) + msgpack.packb({"op": "fetch", "version": 1})[:20]):
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(sock)
            s.sendall(frame)
            s.shutdown(socket.SHUT_WR)
            reply = s.recv(4096)
            assert reply == b"" or b"error" in reply
    # A slow sender: half a request, then nothing. Others are still served meanwhile.
    slow = socket.create_connection(("127.0.0.1", cluster.port))
    slow.sendall(b"POST /v1/swarm/exchange HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\nabc")
    t0 = time.monotonic()
    assert get(f"{cluster.tracker}/v1/tracker/status", cluster.token)[0] == 200
    assert time.monotonic() - t0 < 2
    slow.close()
    wait_for(lambda: len(cluster.nodes()) == 2, 10, "both daemons to still be in the swarm")
    assert trainer.proc.poll() is None and node.proc.poll() is None


@pytest.mark.slow
def test_a_flood_from_one_peer_gets_429s_and_does_not_starve_the_others(cluster, tmp_path):
    """200 long polls at once from one peer (with the token): beyond 32 in flight it is refused,
    and meanwhile a version still reaches another node as usual."""
    import threading
    import time

    from tests import members
    from tests.daemon.harness import get, wait_for
    from tests.daemon.patches import check_store, held, publish, write_chain

    paths = write_chain(tmp_path / "patches", 1, mib=8, chunk_kib=8)
    trainer, node = cluster.pair()
    # The flooder is a member (a key, a lease): a stranger's requests are not even held.
    key = members.new_key()
    code, lease = get(f"{cluster.tracker}/v1/tracker/join", cluster.token, method="POST",
                      headers={"Content-Type": "application/msgpack"},
                      data=msgpack.packb(members.join(key, "flood", address="127.0.0.1:9")))
    assert code == 200
    lease = msgpack.unpackb(lease)  # its ticket admits it to peers at once (leases here last long enough)
    assert get(f"{node.url}/v1/swarm/chunk/1/0", None, headers=members.peer(key, "flood", "r1", lease))[0] != 401
    codes: list[int] = []
    body = msgpack.packb({"node_id": "flood", "region": "eu", "after": 10**9, "wait": 4, "versions": []})

    def long_poll():
        codes.append(get(f"{node.url}/v1/swarm/exchange", None, method="POST", data=body,
                         headers={"Content-Type": "application/msgpack", **members.peer(key, "flood", "r1", lease)},
                         timeout=30)[0])

    threads = [threading.Thread(target=long_poll, daemon=True) for _ in range(200)]
    for t in threads:
        t.start()
    wait_for(lambda: codes.count(429) >= 150, 20, "the flood to be refused")  # 32 held, the rest refused
    t0 = time.monotonic()
    publish(cluster, paths[0])
    wait_for(lambda: held(cluster).get("r1") == [1], 20, "the flooded node to complete a version")
    assert time.monotonic() - t0 < 15
    check_store(node, parse_patch(paths[0].read_bytes()).manifest)
    assert get(f"{node.url}/v1/node", cluster.token)[0] == 200  # others are served meanwhile
    for t in threads:
        t.join(10)
    assert len(codes) == 200 and codes.count(429) >= 150 and set(codes) <= {200, 429}, sorted(set(codes))
