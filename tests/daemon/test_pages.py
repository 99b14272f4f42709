"""A version of many chunks: its signed statements reach a new peer a page at a time, each page at once."""

from __future__ import annotations

import time

import numpy as np
import pytest

from sparrowd.codec.bits import RawTensor
from sparrowd.codec.patch import MIN_CHUNK_SIZE, encode_patch
from sparrowd.codec.patchfile import patch_parts
from sparrowd.swarm.signing import Signed
from sparrowd.swarm.versions import PAGE_STATEMENTS
from tests.daemon.harness import Member, wait_for
from tests.daemon.patches import check_store, held, manifests, publish

pytestmark = pytest.mark.slow


def _many_chunks(path, chunks: int) -> None:
    """A patch of version 1 in about ``chunks`` chunks of 4 KiB (every element moved to a random
    value: dense, incompressible)."""
    rng = np.random.default_rng(0)
    n = chunks * MIN_CHUNK_SIZE // 2
    old = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    new = old ^ rng.integers(1, 1 << 16, n, dtype=np.uint16)
    m, cs = encode_patch({"w": RawTensor("BF16", (n,), old)}, {"w": RawTensor("BF16", (n,), new)}, version=1,
                         base_version=0, values="absolute", chunk_size=MIN_CHUNK_SIZE)
    with open(path, "wb") as f:
        for part in patch_parts(m, [c.data for c in cs]):
            f.write(part)


def test_a_new_peer_gets_a_large_versions_statements_a_page_at_a_time(cluster, tmp_path):
    path = tmp_path / "v1.sprw"
    _many_chunks(path, PAGE_STATEMENTS + 40)
    m = manifests([path])[1]
    total = len(m.chunks) + 1  # an announcement a chunk, and the manifest
    assert total > PAGE_STATEMENTS
    cluster.trainer(region="eu", ttl=10.0)
    relay = cluster.rollout("r0", "us", ttl=10.0)
    wait_for(lambda: len(cluster.nodes()) == 2, 15, "two nodes")
    publish(cluster, path)
    wait_for(lambda: held(cluster).get("r0") == [1], 60, "r0 to hold version 1")

    # By hand, from a relay: the first reply carries a page; asked again with the count, the rest
    # comes at once (the long poll does not wait the 5 s asked for: the peer lacks statements)...
    me = Member(cluster, "pager", "us")
    wait_for(lambda: me.known_to(relay), 15, "r0 to know the member")
    code, first = me.exchange(relay, [])
    assert code == 200, first
    (v,) = first["versions"]
    assert v["version"] == 1 and len(v["statements"]) == PAGE_STATEMENTS
    following = {"version": 1, "anchor": False, "statements": PAGE_STATEMENTS, "have": b"", "fetching": b""}
    t0 = time.monotonic()
    code, second = me.exchange(relay, [following], after=first["gen"], wait=5)
    assert code == 200 and time.monotonic() - t0 < 2.0
    (v2,) = second["versions"]
    rest = [Signed.from_bytes(s) for s in v2["statements"]]
    assert len(rest) == total - PAGE_STATEMENTS and rest[-1].is_manifest
    # ...and once it has them all, the poll waits again.
    t0 = time.monotonic()
    code, third = me.exchange(relay, [{**following, "statements": total}], after=second["gen"], wait=2)
    assert code == 200 and third["versions"][0]["statements"] == [] and time.monotonic() - t0 > 1.5

    # A real node that joins now, with both to ask, ends up with every chunk.
    node = cluster.rollout("late", "ap", ttl=10.0)
    wait_for(lambda: held(cluster).get("late") == [1], 60, "the new node to hold version 1")
    check_store(node, m)
