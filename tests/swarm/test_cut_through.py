"""Cut-through relaying, without sockets: block hashes in announcements, a chunk checked block by
block as it arrives, and the picker taking a peer's chunk in flight as a source."""

from __future__ import annotations

import asyncio
import os

import blake3
import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from sparrowd.daemon.cutthrough import Partial
from sparrowd.errors import FormatError, IntegrityError
from sparrowd.swarm.picker import PeerView, Picker
from sparrowd.swarm.push import stripe_blocks
from sparrowd.swarm.signing import ANNOUNCE, Signer, Verifier
from sparrowd.swarm.versions import BLOCK, BLOCK_HASH, ChunkRef, VersionState, announce_body, block_hashes

SIGNER = Signer(Ed25519PrivateKey.generate())
VERIFIER = Verifier(SIGNER.public)


def ref(data: bytes) -> ChunkRef:
    return ChunkRef(blake3.blake3(data).digest(), len(data))


def test_block_hashes_cover_every_block_the_last_one_short():
    data = os.urandom(2 * BLOCK + 100)
    h = block_hashes(data)
    assert len(h) == 3 * BLOCK_HASH
    assert h[2 * BLOCK_HASH :] == blake3.blake3(data[2 * BLOCK :]).digest(length=BLOCK_HASH)
    assert block_hashes(b"") == b""


def test_an_announcement_carries_block_hashes_and_they_must_fit_the_chunks():
    a, b = os.urandom(BLOCK + 1), os.urandom(10)
    vs = VersionState(3)
    vs.add(SIGNER.sign(ANNOUNCE, 3, announce_body(0, [ref(a), ref(b)], [block_hashes(a), block_hashes(b)])),
           VERIFIER)
    assert vs.block == BLOCK and vs.blocks == {0: block_hashes(a), 1: block_hashes(b)}
    # Without blocks (a trainer before cut-through): the chunks are known, and relayed whole only.
    old = VersionState(3)
    old.add(SIGNER.sign(ANNOUNCE, 3, announce_body(0, [ref(a)])), VERIFIER)
    assert old.chunks and old.block is None and old.blocks == {}
    for body, err in [
        (announce_body(0, [ref(a)], [block_hashes(a)[:BLOCK_HASH]]), "16 bytes per block"),  # one block short
        (announce_body(0, [ref(a), ref(b)], [block_hashes(a)]), "16 bytes per block"),  # a chunk without
        (announce_body(0, [ref(a)], [block_hashes(a, 1024)], block=1024), "block size 1024"),
        (msgpack.packb({"first": 0, "chunks": [[ref(a).hash, ref(a).size]], "blocks": [block_hashes(a)]}),
         "go together"),
    ]:
        with pytest.raises(FormatError, match=err):
            VersionState(3).add(SIGNER.sign(ANNOUNCE, 3, body), VERIFIER)
    # The same chunk announced again with other block hashes is a lie about the chunk.
    other = bytes(BLOCK_HASH) + block_hashes(a)[BLOCK_HASH:]
    with pytest.raises(IntegrityError, match="different block hashes"):
        vs.add(SIGNER.sign(ANNOUNCE, 3, announce_body(0, [ref(a)], [other])), VERIFIER)


def test_an_announcement_may_carry_its_chunks_tree_timing_signed_with_them():
    a, b = os.urandom(BLOCK + 1), os.urandom(10)
    vs = VersionState(3)
    vs.add(SIGNER.sign(ANNOUNCE, 3, announce_body(4, [ref(a), ref(b)], [block_hashes(a), block_hashes(b)],
                                                  tree=(0.0625, 0.044))), VERIFIER)
    assert vs.trees == {4: (0.0625, 0.044), 5: (0.0625, 0.044)}  # every node plans with the same figures
    plain = VersionState(3)
    plain.add(SIGNER.sign(ANNOUNCE, 3, announce_body(0, [ref(a)], [block_hashes(a)])), VERIFIER)
    assert plain.trees == {}  # without: the tree is breadth first
    body = {"first": 0, "chunks": [[ref(a).hash, ref(a).size]], "block": BLOCK, "blocks": [block_hashes(a)]}
    for tree in ([62500], [0, 44000], [62500, 61_000_000], [62500, -1], [62500, 4.4], "62500,44000"):
        with pytest.raises(FormatError, match="tree"):
            VersionState(3).add(SIGNER.sign(ANNOUNCE, 3, msgpack.packb({**body, "tree": tree})), VERIFIER)


def test_a_partial_checks_each_block_as_it_completes_and_serves_only_what_checked_out():
    data = os.urandom(3 * BLOCK + 5)
    p = Partial(len(data), BLOCK, block_hashes(data))
    p.feed(data[: BLOCK - 1])
    assert p.ready == 0 and not p.servable  # no block complete yet: not served, not shown as being fetched
    p.feed(data[BLOCK - 1 : 2 * BLOCK + 7])
    assert p.ready == 2 * BLOCK and not p.whole and p.servable
    p.feed(data[2 * BLOCK + 7 :])
    assert p.ready == len(data) and p.whole and bytes(p.buf) == data
    with pytest.raises(IntegrityError, match="longer than signed"):
        p.feed(b"x")

    bad = bytearray(data)
    bad[BLOCK + 3] ^= 1
    q = Partial(len(data), BLOCK, block_hashes(data), what="chunk 4 of 9")
    with pytest.raises(IntegrityError, match="chunk 4 of 9: block 1 does not match"):
        q.feed(bytes(bad[: 2 * BLOCK]))
    assert q.ready == BLOCK  # the good block before it had checked out; the bad one never does
    q.abort()
    assert not q.servable  # its fetch failed: what checked out is served no further

    whole = Partial(len(data))  # no block hashes: nothing is ready (relayed) before the chunk is stored
    whole.feed(data)
    assert whole.ready == 0 and not whole.servable and bytes(whole.buf) == data


@pytest.mark.asyncio
async def test_readers_wait_for_blocks_and_learn_of_a_failed_fetch():
    data = os.urandom(2 * BLOCK)
    p = Partial(len(data), BLOCK, block_hashes(data))
    waiting = asyncio.create_task(p.wait(0))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    p.feed(data[:BLOCK])
    await asyncio.wait_for(waiting, 1)
    assert p.ready == BLOCK
    more = asyncio.create_task(p.wait(BLOCK))
    await asyncio.sleep(0.01)
    p.abort()
    await asyncio.wait_for(more, 1)
    assert p.failed and not p.whole
    # Another fetch of the chunk stored it whole: the readers go on from that copy.
    r = Partial(len(data), BLOCK, block_hashes(data))
    r.feed(data[:100])
    later = asyncio.create_task(r.wait(0))
    r.fill(data)
    await asyncio.wait_for(later, 1)
    assert r.whole and bytes(r.buf) == data


def test_the_picker_fetches_from_a_neighbour_still_fetching_the_chunk_when_it_relays_cut_through():
    p = Picker("me", "eu", endgame_left=0)

    def pick(*peers):
        return [(r.peer_id, r.index) for r in p.pick(0.0, version=1, missing=[0], inflight={}, peers=list(peers),
                                                    region_nodes=["me", "n2"], available_since={0: 0.0})]

    far = PeerView("far", "us", {0})
    relaying = PeerView("n2", "eu", set(), fetching={0}, cut_through=True)
    whole = PeerView("n3", "eu", {0})
    assert pick(far, relaying) == [("n2", 0)]  # not across the boundary, and not a wait for the chunk to land
    assert pick(far, relaying, whole) == [("n3", 0)]  # one that holds it whole goes first
    # A neighbour that relays whole chunks only is a claim to wait for (or to cross past, later), not a source.
    assert pick(far, PeerView("n2", "eu", set(), fetching={0})) in ([], [("far", 0)])
    assert ("n2", 0) not in pick(far, PeerView("n2", "eu", set(), fetching={0}))
    # Nor is one that chokes this node, or has no slot free.
    assert ("n2", 0) not in pick(far, PeerView("n2", "eu", set(), fetching={0}, cut_through=True, choking=True))
    assert ("n2", 0) not in pick(far, PeerView("n2", "eu", set(), fetching={0}, cut_through=True, inflight=2,
                                               slots=2))


def test_small_chunks_are_hashed_in_small_blocks():
    """About a 64th of a chunk, a power of two between 4 and 64 KiB: a relay hands a chunk on after
    its first block, and a stripe's last block is sent on to every other region, so small chunks
    move in small steps."""
    from sparrowd.swarm.versions import RELAY_BLOCK_MIN, block_for

    assert block_for(8 << 20) == block_for(4 << 20) == BLOCK == 64 << 10
    assert block_for(64 << 20) == BLOCK  # never larger: a relay's first step stays short
    assert block_for(2 << 20) == 32 << 10 and block_for(1 << 20) == 16 << 10
    assert block_for(384 << 10) == block_for(256 << 10) == RELAY_BLOCK_MIN == 4 << 10
    assert block_for(1) == RELAY_BLOCK_MIN  # never smaller: hashes stay a small part of an announcement
    for size in (1, 5000, 300 << 10, 1 << 20, 3 << 20):
        b = block_for(size)
        assert b & (b - 1) == 0 and RELAY_BLOCK_MIN <= b <= BLOCK


@pytest.mark.asyncio
async def test_a_paced_stream_goes_in_blocks_so_the_first_leaves_at_once(tmp_path):
    """Under an upload limit a chunk leaves in pieces of the version's block: a relay downstream
    checks its first block and hands the chunk on while the rest is paced out. (In 256 KiB pieces the
    bucket held the first piece back until it could pay for all of it: a quarter of a second at
    1 MiB/s before the next relay saw a byte.) Unlimited, a file goes in large pieces."""
    from types import SimpleNamespace

    from sparrowd.daemon.swarm import PIECE, Swarm
    from sparrowd.swarm.bucket import TokenBucket

    path = tmp_path / "chunk"
    path.write_bytes(os.urandom(256 << 10))
    block = 16 << 10

    async def pieces(rate: int | None) -> list[tuple[float, int]]:
        me = SimpleNamespace(up=TokenBucket(rate, burst=block), wan_up=TokenBucket(None), cut_through_bytes=0)
        loop = asyncio.get_running_loop()
        t0, out = loop.time(), []
        async for piece in Swarm._paced(me, path, False, block):
            out.append((loop.time() - t0, len(piece)))
        return out

    paced = await pieces(4 << 20)  # 64 ms for the chunk
    assert all(n <= block for _, n in paced) and sum(n for _, n in paced) == 256 << 10
    assert paced[0][0] < 0.01 and paced[-1][0] > 0.04, paced
    free = await pieces(None)
    # The first piece a block (all that a push declined at once costs), then the rest in large ones.
    assert [n for _, n in free] == [block, min(PIECE, (256 << 10) - block)]


def _stripe(data: bytes, s: int, n: int) -> bytes:
    blocks = -(-len(data) // BLOCK)
    return b"".join(data[b * BLOCK : (b + 1) * BLOCK] for b in stripe_blocks(s, n, blocks))


def test_a_chunk_in_stripes_fills_out_of_order_each_block_checked_and_serves_the_prefix_checked():
    data = os.urandom(7 * BLOCK + 100)  # 8 blocks, the last short
    p = Partial(len(data), BLOCK, block_hashes(data), what="chunk 2 of 5")
    p.stripe()
    body = {s: _stripe(data, s, 3) for s in range(3)}
    assert sum(p.stripe_size((s, 3)) for s in range(3)) == len(data)
    p.feed_stripe((1, 3), body[1][: BLOCK + 10])  # block 1 whole, block 4 begun
    assert p.has_block(1) and not p.has_block(0) and not p.has_block(4)
    assert p.ready == 0 and not p.servable  # nothing from the start yet
    p.feed_stripe((0, 3), body[0][:BLOCK])  # block 0
    assert p.ready == 2 * BLOCK  # blocks 0 and 1: the prefix served on to streams of the whole chunk
    p.feed_stripe((2, 3), body[2])  # blocks 2 and 5
    assert p.ready == 3 * BLOCK and p.stripe_whole((2, 3)) and not p.whole
    p.feed_stripe((1, 3), body[1][BLOCK + 10 :])
    p.feed_stripe((0, 3), body[0][BLOCK:])
    assert p.whole and bytes(p.buf) == data and p.got == len(data)
    p.feed_stripe((0, 3), b"late")  # whole already (another stream completed it): ignored

    q = Partial(len(data), BLOCK, block_hashes(data), what="chunk 2 of 5")
    q.stripe()
    bad = bytearray(_stripe(data, 2, 3))
    bad[BLOCK + 1] ^= 1  # in block 5, the stripe's second
    with pytest.raises(IntegrityError, match="chunk 2 of 5: block 5 does not match"):
        q.feed_stripe((2, 3), bytes(bad))
    assert q.has_block(2) and not q.has_block(5)
    with pytest.raises(IntegrityError, match="stripe 1 of 3 is longer than signed"):
        q.feed_stripe((1, 3), _stripe(data, 1, 3) + b"x")


def test_stripes_of_different_counts_overlap_without_trusting_either():
    """A stripe's count is its pusher's word: stripes of 3 and of 2 fill one buffer, a block two of
    them bring is written once, a bad copy of a block already checked is still caught, and a stripe
    whose blocks have all checked out is held (a push of it would be declined)."""
    data = os.urandom(6 * BLOCK)
    hashes = block_hashes(data)
    p = Partial(len(data), BLOCK, hashes)
    p.stripe()
    two = _stripe(data, 0, 2)  # blocks 0, 2, 4
    three = _stripe(data, 0, 3)  # blocks 0, 3
    p.feed_stripe((0, 2), two[: BLOCK // 2])  # half of block 0, kept apart
    p.feed_stripe((0, 3), three[: BLOCK + 7])  # block 0 whole from this stream, block 3 begun
    assert p.has_block(0) and not p.has_block(3)
    p.feed_stripe((0, 2), two[BLOCK // 2 :])  # block 0 again (checked, not written), then 2 and 4
    assert [p.has_block(b) for b in range(6)] == [True, False, True, False, True, False]
    assert p.holds_stripe((0, 2))  # being taken
    assert p.holds_stripe((2, 4))  # block 2 alone: checked out already
    assert not p.holds_stripe((2, 3)) and not p.holds_stripe((3, 4))  # block 5, block 3: still to come
    p.feed_stripe((0, 3), three[BLOCK + 7 :])
    assert p.stripe_whole((0, 3)) and p.holds_stripe((3, 4)) and not p.whole
    p.feed_stripe((1, 2), _stripe(data, 1, 2))  # blocks 1, 3 (checked already), 5
    assert p.whole and bytes(p.buf) == data

    q = Partial(len(data), BLOCK, hashes)
    q.stripe()
    q.feed_stripe((0, 3), _stripe(data, 0, 3))  # blocks 0 and 3
    bad = bytearray(_stripe(data, 1, 2))
    bad[BLOCK + 3] ^= 1  # block 3: checked here already, and this copy is bad
    with pytest.raises(IntegrityError, match="block 3 does not match"):
        q.feed_stripe((1, 2), bytes(bad))
    assert bytes(q.buf[3 * BLOCK : 4 * BLOCK]) == data[3 * BLOCK : 4 * BLOCK]  # the checked copy kept
    q.drop_stripe((1, 2))
    assert not q.holds_stripe((1, 2))  # another pusher's copy of it may be taken


@pytest.mark.asyncio
async def test_a_stripe_is_served_on_block_by_block_as_each_checks_out():
    data = os.urandom(4 * BLOCK)
    p = Partial(len(data), BLOCK, block_hashes(data))
    p.stripe()
    waiting = asyncio.create_task(p.wait_block(3))
    p.feed_stripe((1, 2), data[BLOCK : 2 * BLOCK])
    await asyncio.sleep(0.01)
    assert not waiting.done()
    p.feed_stripe((1, 2), data[3 * BLOCK :])
    await asyncio.wait_for(waiting, 1)
    again = asyncio.create_task(p.wait_block(0))
    p.abort()
    await asyncio.wait_for(again, 1)
    assert p.failed
    whole = Partial(len(data), BLOCK, block_hashes(data))
    whole.feed(data[: 2 * BLOCK])  # a fetch of the whole chunk: its blocks in order
    assert whole.has_block(1) and not whole.has_block(2)
