"""Whom a relay pushes a chunk to (swarm.push): pure, no sockets."""

from __future__ import annotations

import pytest

from sparrowd.swarm.picker import designated
from sparrowd.swarm.push import (
    PushPeer,
    parse_push,
    parse_stripe,
    push_heads,
    push_targets,
    region_tree,
    relay_fanout,
    stream_rate,
    stripe_blocks,
    stripe_plan,
    stripe_size,
    stripe_targets,
    stripes_handed_on,
    tree_timing,
)

REGIONS = {"eu": ["e1", "e2", "e3"], "us": ["u1", "u2"], "ap": ["a1", "a2", "a3"]}


def peers(have: set[str] = frozenset(), me: str = "e0") -> list[PushPeer]:
    return [PushPeer(n, r, n in have) for r, ns in REGIONS.items() for n in ns if n != me]


HEADS = {"eu": ["e0", "e1", "e2", "e3"], **{r: ns for r, ns in REGIONS.items() if r != "eu"}}  # as the tracker names


def heads(me: str = "e0") -> dict[str, list[str]]:
    return push_heads("eu", me, [p.node_id for p in peers(me=me)], HEADS)


def test_local_pushes_go_to_neighbours_that_lack_the_chunk_up_to_the_count():
    near, _ = push_targets(5, 0, "e0", "eu", peers(have={"e2"}), {}, local=2, cross=0)
    assert sorted(near) == ["e1", "e3"]
    near, _ = push_targets(5, 0, "e0", "eu", peers(have={"e2"}), {}, local=1, cross=0)
    assert len(near) == 1 and near[0] in ("e1", "e3")
    near, _ = push_targets(5, 0, "e0", "eu", peers(), {}, local=2, cross=0, sent=(2, 0))
    assert near == []  # topped up only: two went already
    near, _ = push_targets(5, 0, "e0", "eu", peers(have={"e1", "e2", "e3"}), {}, local=2, cross=0)
    assert near == []


def test_two_relays_of_a_region_push_to_different_neighbours_across_chunks():
    ps = [PushPeer(f"e{i}", "eu", False) for i in range(1, 9)]
    firsts = {push_targets(5, c, "e0", "eu", ps, {}, local=1, cross=0)[0][0] for c in range(64)}
    assert len(firsts) >= 6  # a rendezvous rank per (chunk, pusher > peer), not one favourite


def test_a_cross_push_goes_to_the_node_the_other_region_designates():
    h = heads()
    assert h == {"us": ["u1", "u2"], "ap": ["a1", "a2", "a3"]}
    for c in range(32):
        _, far = push_targets(5, c, "e0", "eu", peers(), h, local=0, cross=2)
        assert sorted(far) == sorted([designated(5, c, REGIONS["us"]), designated(5, c, REGIONS["ap"])])
        _, far = push_targets(5, c, "e0", "eu", peers(), h, local=0, cross=1)
        assert len(far) == 1 and far[0] in (designated(5, c, REGIONS["us"]), designated(5, c, REGIONS["ap"]))


def test_no_cross_push_where_a_node_has_it_or_its_crosser_does():
    _, far = push_targets(5, 3, "e0", "eu", peers(have={"u2"}), heads(), local=0, cross=2)
    assert far == [designated(5, 3, REGIONS["ap"])]  # "us" spreads it from u2
    d = designated(5, 3, REGIONS["ap"])
    _, far = push_targets(5, 3, "e0", "eu", peers(have={d}), heads(), local=0, cross=2)
    assert all(n.startswith("u") for n in far)  # not another "ap" node in its place: that would cross twice


def test_a_region_whose_heads_a_node_does_not_all_know_gets_no_cross_push_unless_it_is_a_head():
    # "ap" has 5 heads and this node knows 3 of them: it cannot tell whom "ap" designates, and "ap"'s
    # heads may not know it (a push from a stranger is refused) ...
    named = {**HEADS, "ap": ["a1", "a2", "a3", "a4", "a5"], "eu": ["e1", "e2"]}
    h = push_heads("eu", "e0", [p.node_id for p in peers()], named)
    assert h == {"us": ["u1", "u2"]}
    for c in range(16):
        _, far = push_targets(5, c, "e0", "eu", peers(), h, local=0, cross=2)
        assert far == [designated(5, c, REGIONS["us"])]
    assert push_targets(5, 0, "e0", "eu", peers(), {}, local=0, cross=2) == ([], [])
    # ... but a head of its own region knows every region's heads (the tracker names them all), and
    # they know it: it pushes into every other region, to the head that region designates.
    h = push_heads("eu", "e1", [], named)
    assert h == {"us": ["u1", "u2"], "ap": ["a1", "a2", "a3", "a4", "a5"]}
    ap = [PushPeer(f"a{i}", "ap", False) for i in range(1, 6)]
    for c in range(16):
        _, far = push_targets(5, c, "e1", "eu", ap, h, local=0, cross=1)
        assert far == [designated(5, c, named["ap"])]


@pytest.mark.parametrize("text, want", [("2,2", (2, 2)), ("1,0", (1, 0)), ("0,3", (0, 3)), ("off", (0, 0)),
                                        (" OFF ", (0, 0))])
def test_parse_push(text, want):
    assert parse_push(text) == want


@pytest.mark.parametrize("text", ["2", "2,2,2", "a,b", "9,0", "-1,2", ""])
def test_parse_push_refuses_what_is_not_two_small_counts(text):
    with pytest.raises(ValueError, match="push"):
        parse_push(text)


def test_pushes_take_only_the_upload_slots_requests_leave_idle():
    h = heads()
    near, far = push_targets(5, 0, "e0", "eu", peers(), h, local=2, cross=2, idle=(1, 0))
    assert len(near) == 1 and far == []
    near, far = push_targets(5, 0, "e0", "eu", peers(), h, local=2, cross=2, idle=(0, 2))
    assert near == [] and len(far) == 2
    assert push_targets(5, 0, "e0", "eu", peers(), h, local=2, cross=2, idle=(0, 0)) == ([], [])


def test_a_chunk_still_arriving_has_its_crossing_first_then_the_locals_its_room_leaves():
    """``most``: the streams a chunk still arriving may have more of (``relay_fanout`` less those
    served): a crossing first (it seeds a whole region), then neighbours, up to ``most`` in all."""
    h = heads()
    whole = push_targets(5, 0, "e0", "eu", peers(), h, local=2, cross=2)
    assert len(whole[0]) == 2 and len(whole[1]) == 2
    near, far = push_targets(5, 0, "e0", "eu", peers(), h, local=2, cross=2, most=3)
    assert far == whole[1] and near == whole[0][:1]
    near, far = push_targets(5, 0, "e0", "eu", peers(), h, local=2, cross=2, most=1)
    assert near == [] and far == whole[1][:1]
    assert push_targets(5, 0, "e0", "eu", peers(), h, local=2, cross=2, most=0) == ([], [])
    assert push_targets(5, 0, "e0", "eu", peers(), h, local=2, cross=2, most=-1) == ([], [])
    near, far = push_targets(5, 0, "e0", "eu", peers(), h, local=2, cross=0, most=2)
    assert near == whole[0] and far == []  # no crossing to make: the room goes to neighbours


def test_a_relay_serves_a_chunk_arriving_to_as_many_as_its_uplink_carries_at_that_rate():
    assert relay_fanout(8e6, 4e6) == 2
    assert relay_fanout(8e6, 2.7e6) == 2 and relay_fanout(8e6, 2.6e6) == 3
    assert relay_fanout(4e6, 4e6) == 1 and relay_fanout(1e6, 4e6) == 1  # at least one
    assert relay_fanout(8e6, 8e6 / 3) == 3  # a share that divides it exactly, despite rounding
    for uplink, arriving in ((None, 4e6), (0, 4e6), (8e6, None), (8e6, 0.0), (8e6, -1.0)):
        assert relay_fanout(uplink, arriving) is None  # either unknown: no limit


def test_a_stream_declares_its_share_of_the_limits_and_no_more_than_its_chunk_arrives_at():
    assert stream_rate(8e6, 4e6, 2, 1, wan=False) == 4e6  # half the uplink, the WAN limit not its concern
    assert stream_rate(8e6, 4e6, 2, 2, wan=True) == 2e6  # half the WAN limit, under half the uplink
    assert stream_rate(8e6, None, 1, 1, wan=True) == 8e6
    assert stream_rate(8e6, 4e6, 1, 0, wan=False, arriving=3e6) == 3e6  # relayed as the chunk comes in
    assert stream_rate(None, None, 3, 0, wan=False, arriving=3e6) == 3e6
    assert stream_rate(None, None, 3, 3, wan=True) is None  # nothing paces it
    assert stream_rate(None, 4e6, 0, 0, wan=True) == 4e6  # a count of 0 read as this one alone


def test_a_partial_gives_a_stream_its_turn_when_one_ends_or_it_is_whole_or_failed():
    """``Partial.room``, ``turn`` and ``leave``: how many more streams may start now of a chunk
    still arriving, at a node whose upload limit is 8 MB/s."""
    import asyncio

    from sparrowd.daemon.cutthrough import Partial

    uplink = 8e6

    async def main():
        part = Partial(4 << 14, 1 << 14, None)
        assert part.room(uplink) is None  # the rate it arrives at is unknown: no limit
        part.rate = 4e6
        assert part.room(uplink) == 2
        part.streams = 2
        assert part.room(uplink) == 0
        waiting = asyncio.ensure_future(part.turn(uplink))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        part.leave()
        await asyncio.wait_for(waiting, 1)
        assert part.room(uplink) == 1 and part.room(None) is None
        part.streams = 2
        for end in (lambda: part.fill(b"x" * part.size), lambda: part.abort()):
            waiting = asyncio.ensure_future(part.turn(uplink))
            await asyncio.sleep(0.01)
            assert not waiting.done()
            end()
            await asyncio.wait_for(waiting, 1)
            part = Partial(4 << 14, 1 << 14, None)
            part.rate, part.streams = 4e6, 2
        await asyncio.wait_for(part.turn(None), 1)  # no limit: at once
        assert part.streams == 2

    asyncio.run(main())


def _depths(tree: dict[str, tuple[str, ...]], heads: dict[str, list[str]], root: str) -> dict[str, int]:
    region_of = {h: r for r, hs in heads.items() for h in hs}
    depth = {root: 0}
    for _ in heads:
        for h, rs in tree.items():
            for r in rs:
                if region_of[h] in depth:
                    depth.setdefault(r, depth[region_of[h]] + 1)
    return depth


def _reached(tree: dict[str, tuple[str, ...]], heads: dict[str, list[str]], root: str, send: float,
             hop: float) -> dict[str, float]:
    """When each region has the chunk's first block, as the tree's timing model has it: a head's k-th
    crossing starts k sends after its region has it, and lands a hop later."""
    region_of = {h: r for r, hs in heads.items() for h in hs}
    at = {root: 0.0}
    for _ in heads:
        for h, rs in tree.items():
            for k, r in enumerate(rs):
                if region_of[h] in at:
                    at.setdefault(r, at[region_of[h]] + k * send + hop)
    return at


def test_a_chunks_region_tree_gives_each_head_at_most_one_crossing_as_shallow_as_the_heads_allow():
    many = {f"r{j}": [f"r{j}h{i}" for i in range(8)] for j in range(8)}  # 100 nodes in 8 regions
    few = {f"r{j}": [f"r{j}h{i}" for i in range(2)] for j in range(8)}  # 16 nodes
    for heads, deepest in ((many, 1), (few, 3)):
        for c in range(16):
            tree = region_tree(7, c, "r3", heads)
            assert all(len(rs) == 1 for rs in tree.values())  # without timings, one crossing a head
            assert sorted(r for rs in tree.values() for r in rs) == sorted(r for r in heads if r != "r3")
            depth = _depths(tree, heads, "r3")
            assert len(depth) == 8 and max(depth.values()) == deepest, depth
            assert tree == region_tree(7, c, "r3", {r: list(reversed(hs)) for r, hs in heads.items()})  # same for all
    # Which heads cross, and where, changes from chunk to chunk: no head carries every chunk across.
    assert len({h for c in range(16) for h in region_tree(7, c, "r3", many)}) == 8
    assert region_tree(7, 0, "r3", {"r3": ["a"]}) == {}


def test_with_a_tree_a_node_crosses_only_where_the_tree_says_and_feeds_its_regions_crossers_first():
    heads = {"eu": ["e1", "e2"], "us": ["u1", "u2"], "ap": ["a1", "a2"]}
    ps = [PushPeer(n, r, False) for r, ns in {**heads, "eu": ["e1", "e2", "e3", "e4"]}.items() for n in ns]
    for c in range(16):
        tree = region_tree(5, c, "eu", heads)
        for me in ("e1", "e2"):
            mine = [p for p in ps if p.node_id != me]
            near, far = push_targets(5, c, me, "eu", mine, heads, local=1, cross=2, tree=tree)
            assert far == ([designated(5, c, heads[tree[me][0]])] if me in tree else [])
            other = "e2" if me == "e1" else "e1"
            if other in tree:
                assert near == [other]  # the region's other crosser gets it first
        _, far = push_targets(5, c, "e3", "eu", ps, heads, local=0, cross=2, tree=tree)
        assert far == []  # not a head: no crossing of its own in the tree


def test_a_timed_region_tree_crosses_again_once_whole_where_that_beats_a_deeper_crossing():
    """With the chunk's send time and a crossing's latency, a head may cross a second time once it holds
    the chunk whole, where that lands sooner than a crossing from deeper in the tree: one 256 KiB chunk
    at 4 MiB/s (62.5 ms) against 44 ms hops, 16 nodes in 8 regions: three crossings deep breadth first,
    the last region reached by a root head's second crossing instead. Where a send takes longer than
    two hops it is the breadth-first tree; where it takes a fraction of a hop, heads cross twice."""
    few = {f"r{j}": [f"r{j}h{i}" for i in range(2)] for j in range(8)}  # 16 nodes
    one = {f"r{j}": [f"r{j}h0"] for j in range(8)}  # a node a region
    many = {f"r{j}": [f"r{j}h{i}" for i in range(8)] for j in range(8)}  # 100 nodes
    for c in range(16):
        for heads in (few, one, many):
            plain = region_tree(7, c, "r3", heads)
            assert region_tree(7, c, "r3", heads, send=10.0, hop=0.044) == plain  # slow sends: breadth first
            for send in (0.0625, 0.002):
                tree = region_tree(7, c, "r3", heads, send=send, hop=0.044)
                crossed = [r for rs in tree.values() for r in rs]
                assert sorted(crossed) == sorted(r for r in heads if r != "r3")  # every other region, once
                assert all(len(rs) <= 2 for rs in tree.values())
                assert tree == region_tree(7, c, "r3", {r: list(reversed(hs)) for r, hs in heads.items()},
                                           send=send, hop=0.044)  # the same for every node
                timed = max(_reached(tree, heads, "r3", send, 0.044).values())
                flat = max(_reached(plain, heads, "r3", send, 0.044).values())
                assert timed <= flat + 1e-9
                if heads is many:
                    assert tree == plain  # the root's eight heads reach every region at once
        tree = region_tree(7, c, "r3", few, send=0.0625, hop=0.044)
        assert max(_depths(tree, few, "r3").values()) == 2  # not 3
        assert [len(tree[h]) for h in few["r3"]].count(2) == 1  # one root head crosses twice
        assert max(_reached(tree, few, "r3", 0.0625, 0.044).values()) < 0.11 < 3 * 0.044
        tree = region_tree(7, c, "r3", one, send=0.002, hop=0.044)
        assert max(_depths(tree, one, "r3").values()) <= 3  # breadth first: a chain seven deep
        assert max(_depths(region_tree(7, c, "r3", one), one, "r3").values()) == 7


def test_a_heads_later_crossings_wait_until_it_holds_the_chunk_whole():
    heads = {f"r{j}": [f"r{j}h0"] for j in range(4)}
    ps = [PushPeer(h, r, False) for r, hs in heads.items() for h in hs]
    for c in range(8):
        tree = region_tree(2, c, "r0", heads, send=0.002, hop=0.044)
        first, second = tree["r0h0"]
        mine = [p for p in ps if p.node_id != "r0h0"]
        _, far = push_targets(2, c, "r0h0", "r0", mine, heads, local=2, cross=2, tree=tree, whole=False)
        assert far == [heads[first][0]]  # while it arrives: the first crossing alone
        pushed = [PushPeer(p.node_id, p.region, p.node_id == heads[first][0]) for p in mine]
        _, far = push_targets(2, c, "r0h0", "r0", pushed, heads, local=2, cross=2, sent=(0, 1), tree=tree)
        assert far == [heads[second][0]]  # whole: the second
        busy = [PushPeer(p.node_id, p.region, p.region in (first, second)) for p in mine]
        _, far = push_targets(2, c, "r0h0", "r0", busy, heads, local=2, cross=2, sent=(0, 1), tree=tree)
        assert far == []  # a region that has it meanwhile is left to spread it


def test_a_push_takes_the_place_of_a_request_with_no_byte_back_even_before_its_response_began():
    """``swarm.push.unstarted``: the one request out for the chunk, to a rollout (the pusher too),
    that has had no byte back; a request whose response has not begun has no partial yet and is the
    most unstarted of all (a swarm's first version declined pushes as the nodes' first requests went
    out), and so is one to the pusher itself (across regions, the push began before the request got
    there). Requests to the trainer or with bytes back stay."""
    from sparrowd.swarm.push import unstarted

    task = object()

    def rollout(peer):
        return peer != "trainer"

    assert unstarted({"r1": task}, False, rollout, set()) is task  # asked, no byte back (or no response yet)
    assert unstarted({"r1": task}, True, rollout, set()) is None  # bytes back: it goes on
    assert unstarted({"r1": task, "r2": object()}, False, rollout, set()) is None  # asked twice (the endgame)
    assert unstarted({}, False, rollout, set()) is None  # nothing asked
    assert unstarted({"trainer": task}, False, rollout, set()) is None  # super-seeding counted it as a first copy
    assert unstarted({"r1": task}, False, rollout, {task}) is None  # that one is a push being taken


def test_a_chunk_whose_stripes_stopped_short_takes_no_stripes_while_it_is_asked_for_whole():
    """Once a chunk's stripes stopped short it is asked for whole; a stripe pushed meanwhile would take
    that request's place (``unstarted``) and stop short again, so it is declined, and the pusher hands
    it to its fallbacks. A whole push is still taken in the request's place, and once no request is
    out for the chunk (it failed), stripes are welcome again."""
    from sparrowd.swarm.push import Arriving, declines

    asked = Arriving(64, asked=True)
    assert declines(asked, 0.0, "1/4") == "being fetched"  # a request out: it may still take that one's place...
    assert declines(asked, 0.0, "1/4", replacing=True) is None
    whole = Arriving(64, asked=True, asked_whole=True)  # ...but not once its stripes stopped short
    assert declines(whole, 0.0, "1/4") == declines(whole, 0.0, "1/4", replacing=True) == "asked for whole"
    assert declines(whole, 0.0, replacing=True) is None  # the chunk whole may still take the request's place
    assert declines(Arriving(64, asked_whole=True), 0.0, "1/4") is None  # the request failed: stripes again


def test_a_push_is_taken_only_of_a_chunk_wanted_checkable_and_neither_held_nor_asked_for():
    """``swarm.push.declines``, the receiver's whole decision, reason by reason: only from a rollout
    peer, never on the trainer, only once the chunk's signed block hashes are here, and within the
    store's and the buffers' limits; a stripe joins its chunk's other stripes unless it is held."""
    from sparrowd.swarm.policy import PUSHES_TAKEN, STRIPED_TAKEN
    from sparrowd.swarm.push import NO_HASHES, Arriving, declines

    fresh = Arriving(8)
    assert declines(fresh, 0.0) is None and declines(fresh, 0.0, "3/8") is None
    assert declines(fresh, 0.0, trainer=True) == "the trainer takes no pushes"
    assert declines(fresh, 0.0, peer=False) == "not a peer of this node"
    assert declines(Arriving(None), 0.0) == NO_HASHES  # the push outran the trainer's announcement
    assert declines(Arriving(8, held=True), 0.0) == "held"
    assert declines(Arriving(8, wanted=False), 0.0) == "not wanted"
    assert declines(fresh, 0.0, "8/8") == "no stripe 8/8 of a chunk of 8 blocks"
    assert declines(fresh, 0.0, "1/9") == "no stripe 1/9 of a chunk of 8 blocks"
    assert declines(fresh, 0.0, "x") == "a stripe is s/n, not 'x'"
    paused = Arriving(8, paused_until=10.0)  # the store pushes back until then
    assert declines(paused, 9.9) == "busy" and declines(paused, 10.0) is None
    assert declines(Arriving(8, taking=PUSHES_TAKEN), 0.0) == "busy"
    assert declines(Arriving(8, taking=PUSHES_TAKEN), 0.0, "1/2") is None  # stripes are counted apart
    assert declines(Arriving(8, taking=PUSHES_TAKEN - 1), 0.0) is None
    assert declines(Arriving(8, striping=STRIPED_TAKEN), 0.0, "1/2") == "busy"
    held = {(0, 2)}
    joining = Arriving(8, asked=True, striping=STRIPED_TAKEN, stripes=held.__contains__)
    assert declines(joining, 0.0, "0/2") == "stripe held"
    assert declines(joining, 0.0, "1/2") is None  # joins the stripes arriving, however many chunks stripe
    assert declines(joining, 0.0) == "being fetched"  # the chunk whole waits for its stripes


def test_a_manifest_after_the_last_chunk_completes_the_version_like_the_chunk_would(tmp_path):
    """A pushed chunk can outrun the version's manifest: every chunk is here before the manifest
    names them. The exchange reply that brings the manifest completes the version then, as the
    last chunk would have (``Swarm._complete``: the event, the prompt report, ``held_at``); it once
    completed it unannounced, and ``bench swarm`` waited for a time that never came."""
    import asyncio
    from types import SimpleNamespace

    import blake3
    import numpy as np
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from sparrowd.bench.swarm import _write_patch
    from sparrowd.codec.patchfile import parse_patch
    from sparrowd.daemon.swarm import PeerState, Swarm
    from sparrowd.swarm.chain import Key
    from sparrowd.swarm.signing import Signer, Verifier, announce_kind, manifest_kind
    from sparrowd.swarm.versions import ChunkRef, VersionState, announce_body, block_for, block_hashes, to_bitmap

    path = tmp_path / "v1.sprw"
    _write_patch(path, 1, (256 << 10) - 4096, 256 << 10, np.random.default_rng(0))
    view = parse_patch(path.read_bytes())
    data = bytes(view.chunks[0])
    signer = Signer(Ed25519PrivateKey.generate())
    block = block_for(len(data))
    ref = ChunkRef(blake3.blake3(data).digest(), len(data))
    announce = signer.sign(announce_kind(False), 1, announce_body(0, [ref], [block_hashes(data, block)], block))
    manifest = signer.sign(manifest_kind(False), 1, view.manifest.to_bytes())
    vs = VersionState(1)
    vs.add(announce, Verifier(signer.public))
    vs.have.add(0)  # the pushed chunk, stored
    assert not vs.complete
    completed = []
    me = SimpleNamespace(versions={Key(1, False): vs}, floor=lambda: 0, signer=None, available_since={},
                         _touch=lambda: None, _announced=asyncio.Event(), _changed=asyncio.Event(),
                         trainer_heard=False, _complete=completed.append,
                         verifier=Verifier(signer.public), store=SimpleNamespace(add_statement=lambda vs, s: None))
    me._take_statement = lambda v, s: Swarm._take_statement(me, v, s)
    trainer = PeerState("trainer", "a:1", "eu", "trainer")
    reply = {"gen": 1, "versions": [{"version": 1, "statements": [manifest.to_bytes()],
                                     "have": to_bitmap({0}, 1), "fetching": to_bitmap(set(), 1)}]}
    Swarm._ingest(me, trainer, reply)
    assert vs.complete and completed == [vs]
    Swarm._ingest(me, trainer, reply)  # the same reply again: nothing new completes
    assert completed == [vs]


def _slots(live, near, regions, *, slots=8, unchoked=None):
    """The trainer's upload slots (``serving.Slots``) with ``live`` peers heard from, ``near`` of them in
    its region "eu" (all wanting a chunk), in ``regions`` regions."""
    from sparrowd.swarm.choker import Choker
    from sparrowd.swarm.serving import Slots

    return Slots(Choker(slots=slots), set() if unchoked is None else unchoked, lambda p: p.startswith("e"),
                 live, near, regions, near)


def _shown(vs, slots, ss, peer, region, have=frozenset()):
    """``serving.trainer_shows`` as the trainer in region "eu" calls it."""
    import time

    from sparrowd.swarm.serving import trainer_shows

    return trainer_shows(vs.have, slots, ss, time.monotonic(), peer, have, {}, far=region != "eu",
                         announced=len(vs.chunks), total=vs.total, super_seed=True, trusted=True, quick=False)


def test_before_its_manifest_a_one_chunk_versions_first_copy_stays_in_the_trainers_region():
    """Chunks go out as they are published, before the manifest: the trainer's super-seed then
    counts the chunks announced so far (``first_copies_near``). Taken as unknown, a one-chunk
    version's only chunk went to whoever asked first, in any region, and crossed once more than
    (R-1) times."""
    import blake3
    import numpy as np
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from sparrowd.swarm.policy import SEED_PER_PEER, SEED_SINGLE_FROM
    from sparrowd.swarm.signing import Signer, Verifier, announce_kind
    from sparrowd.swarm.superseed import SuperSeed
    from sparrowd.swarm.versions import ChunkRef, VersionState, announce_body, block_for, block_hashes

    data = np.random.default_rng(0).bytes(256 << 10)
    signer = Signer(Ed25519PrivateKey.generate())
    block = block_for(len(data))
    announce = signer.sign(announce_kind(False), 1, announce_body(0, [ChunkRef(blake3.blake3(data).digest(),
                                                                              len(data))],
                                                                 [block_hashes(data, block)], block))
    vs = VersionState(1)
    vs.add(announce, Verifier(signer.public))
    vs.have.add(0)  # published; the manifest has not come
    assert vs.total is None
    ss, slots = SuperSeed(1, per_peer=SEED_PER_PEER, single_from=SEED_SINGLE_FROM), _slots(6, 3, 3)
    assert _shown(vs, slots, ss, "u1", "us") == set()  # another region's peer: not a first copy
    assert _shown(vs, slots, ss, "e1", "eu") == {0}
    assert _shown(vs, slots, ss, "u1", "us") == set()


def test_while_first_copies_stay_near_the_trainer_paces_them_by_its_near_peers():
    """With 4 or more live peers the trainer gives each one chunk at a time, counting on the
    others' requests to keep its uplink busy between a peer's chunk and its next request. While
    ``first_copies_near`` keeps the first copies in its region, only the near peers take them: two
    near peers of 6 (8 rollouts in 4 regions) given one chunk at a time left the uplink waiting
    between each chunk and the next request. Each near peer gets two."""
    import random
    from types import SimpleNamespace

    from sparrowd.swarm.policy import SEED_PER_PEER, SEED_SINGLE_FROM
    from sparrowd.swarm.superseed import SuperSeed

    def trainer(live, near, regions):
        vs = SimpleNamespace(have=set(range(6)), chunks=[None] * 6, total=6)
        ss = SuperSeed(6, per_peer=SEED_PER_PEER, single_from=SEED_SINGLE_FROM, rng=random.Random(0))
        return vs, _slots(live, near, regions), ss

    assert SEED_PER_PEER == 2 and SEED_SINGLE_FROM <= 6
    vs, slots, ss = trainer(6, 2, 4)  # two near peers and two in each of three other regions: first copies near
    assert len(_shown(vs, slots, ss, "e1", "eu")) == 2
    assert len(_shown(vs, slots, ss, "e2", "eu")) == 2
    assert _shown(vs, slots, ss, "u1", "us") == set()  # no first copy abroad
    vs, slots, ss = trainer(6, 1, 4)  # one near peer for three other regions: first copies spread, one at a time
    assert len(_shown(vs, slots, ss, "e1", "eu")) == 1
    assert len(_shown(vs, slots, ss, "u1", "us")) == 1


def test_the_trainer_serves_a_peer_the_chunk_it_gave_it_once_its_choker_would_refuse_the_peer():
    """A swarm forming: the trainer gives first copies while it has no more live peers than upload
    slots (its choker idle), and the swarm grows past them before the peers ask. A peer the choker
    never unchoked is then refused (503, "choked") but never choked either, which would hand its
    assignment to another, so the chunk reached nobody until ``claim_within`` (3 s) had passed.
    Its assignment is shown and served to it (``serving.owed``); other chunks are not."""
    import random
    from types import SimpleNamespace

    from sparrowd.swarm.serving import may_fetch, owed
    from sparrowd.swarm.superseed import SuperSeed

    vs = SimpleNamespace(have={0, 1, 2}, chunks=[None] * 3, total=3)
    ss = SuperSeed(3, single_from=4, rng=random.Random(0))
    slots = _slots(6, 3, 1, slots=4)  # more live peers than slots: the choker decides; a slot is free
    given = _shown(vs, slots, ss, "e1", "eu")
    assert len(given) == 1 and slots.unchoked == {"e1"}
    (mine,) = given
    slots.unchoked = {"x1", "x2", "x3", "x4"}  # the swarm grew past the upload slots; the choker left e1 out
    assert not slots.admits("e1", False)
    assert _shown(vs, slots, ss, "e1", "eu") == given  # still shown to it...
    assert may_fetch(slots.admits("e1", False), mine, owed(ss, "e1", frozenset()))  # ...and served
    assert not any(may_fetch(False, c, owed(ss, "e1", frozenset())) for c in {0, 1, 2} - given)  # the rest: refused
    assert _shown(vs, slots, ss, "e2", "eu") == set() and not owed(ss, "e2", frozenset())
    assert not owed(ss, "e1", frozenset(given))  # it holds it: nothing more is owed


def test_the_trainer_knows_a_version_quick_when_it_leaves_in_less_than_a_round_trip():
    """``serving.quick``, ``first_copies_near``'s ``quick``: the version's bytes (the chunks announced so
    far standing for the rest until the manifest) over the trainer's upload limit, against twice the
    median one-way delay its peers measured. No limit, no delay or no chunk: not quick."""
    from sparrowd.swarm.serving import quick as serving_quick

    MB = 1 << 20

    def quick(rate, delay, sizes, total=None):
        return serving_quick(sizes[0] if sizes else None, total or len(sizes), rate, delay)

    assert quick(100 * MB, 0.04, [MB] * 2)  # 2 MiB at 100 MiB/s: 20 ms, under an 80 ms round trip
    assert not quick(100 * MB, 0.04, [MB] * 2, total=8)  # 8 MiB once the manifest says 8 chunks: 80 ms
    assert not quick(4 * MB, 0.04, [MB] * 2)  # at 4 MiB/s: half a second
    assert not quick(None, 0.04, [MB]) and not quick(100 * MB, None, [MB]) and not quick(100 * MB, 0.04, [])


def test_the_trainer_counts_its_peers_again_when_one_of_a_region_it_did_not_count_asks():
    """``Seed.live`` counts the peers heard from at most once a second. A count taken as a swarm
    formed, before any peer of another region was heard, said one region, and ``first_copies_near``
    let first copies go anywhere until the next count (6 MiB to 8 daemons crossed 1.20x (R-1) x
    patch). A peer of a region it did not count now has it counted again at once."""
    import time
    from types import SimpleNamespace

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from sparrowd.daemon.swarm import Remote, Swarm
    from sparrowd.daemon.swarm.seed import Seed
    from sparrowd.swarm.signing import Signer

    regions = {"e1": "eu", "e2": "eu", "u1": "us", "a1": "ap"}
    me = SimpleNamespace(remotes={}, versions={}, host=SimpleNamespace(settings=SimpleNamespace(region="eu")))
    me.seed = Seed(me, Signer(Ed25519PrivateKey.generate()))
    me.seed.wants = lambda r: True

    def ask(node):
        r = Swarm._remote(me, node, regions[node])
        assert isinstance(r, Remote) and r.region == regions[node]

    def live():
        return me.seed.live()

    ask("e1")
    ask("e2")
    assert live() == (2, 2, 1, 2)
    ask("e1")
    assert live() == (2, 2, 1, 2)  # cached: nothing new
    ask("u1")
    assert live() == (3, 2, 2, 2)  # counted again at once, not a second later
    ask("u1")
    me.remotes["x"] = Remote("x", "us", last_seen=time.monotonic())  # heard, of a counted region: still cached
    assert live() == (3, 2, 2, 2)
    ask("a1")
    assert live() == (5, 2, 3, 2)


def test_a_neighbour_the_trainer_tells_of_is_a_peer_before_the_version_in_the_same_reply_starts():
    """A swarm just formed: the trainer's exchange reply that brings the first version also tells of a
    neighbour that joined a moment ago. The neighbour is a peer, and counted among the region's
    crossers, before the node starts on the version: counting on nobody, the node designated itself
    for every chunk and crossed for it while the neighbour brought it too (``bench swarm``, 8 rollouts,
    one chunk: 1.33x (R-1) x patch in some first versions)."""
    import asyncio
    from types import SimpleNamespace

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from sparrowd.daemon.membership import Membership
    from sparrowd.daemon.swarm import PeerState, Swarm
    from sparrowd.swarm.identity import NodeKey
    from sparrowd.swarm.picker import recount

    async def main():
        membership = Membership(None, {"node_id": "n6", "role": "rollout", "region": "r2", "address": "a:6"},
                                NodeKey(Ed25519PrivateKey.generate()))
        trainer = PeerState("trainer", "a:1", "r0", "trainer")
        started = []

        async def loop(ps):
            started.append(ps.node_id)

        me = SimpleNamespace(host=SimpleNamespace(membership=membership, node_id="n6",
                                                  settings=SimpleNamespace(region="r2")),
                             peers={"trainer": trainer}, banned=set(), _peer_loop=loop, _joins_seen=0,
                             versions={}, floor=lambda: 0, signer=None, available_since={}, _touch=lambda: None,
                             _announced=asyncio.Event(), _changed=asyncio.Event(), trainer_heard=False,
                             contacts={}, _warm=lambda ps: warmed.append(ps.node_id))
        warmed = []
        me._take_listed = lambda: Swarm._take_listed(me)
        joined = [{"node_id": "n2", "role": "rollout", "region": "r2", "address": "a:2", "key": b"k" * 32}]
        Swarm._ingest(me, trainer, {"gen": 1, "versions": [], "joins": 9, "joined": joined})
        assert "n2" in me.peers and me._joins_seen == 9
        assert warmed == ["n2"]  # a spare connection opened to it (Swarm._warm)
        counted, _ = recount(None, frozenset(), Swarm._neighbours(me))
        assert counted == {"n2"}  # the region's crossers, for the version this reply starts: n6 and n2
        await asyncio.sleep(0)
        assert started == ["n2"]  # its long poll runs

    asyncio.run(main())


def test_a_trees_timing_is_the_chunk_at_the_trainers_uplink_and_a_crossings_delay_plus_a_block():
    from sparrowd.swarm.push import tree_timing

    assert tree_timing(256 << 10, 16 << 10, 4 << 20, 0.04) == (0.0625, 0.04 + 0.00390625)
    assert tree_timing(256 << 10, 16 << 10, None, 0.04) is None  # no upload limit at the trainer
    assert tree_timing(256 << 10, 16 << 10, 4 << 20, None) is None  # no delay measured yet


def test_a_receiver_hands_on_the_first_stripe_from_the_root_region_and_its_own_but_no_more():
    real, a, b = (2, 7), (0, 7), (5, 7)
    assert stripes_handed_on([real], real) == [real]  # honest: the first holder's stripe, its own
    assert stripes_handed_on([a], real) == [a]  # a first holder whose plan differed (a swarm just formed)
    assert stripes_handed_on([a, b, real], real) == [a, real]  # a member's own choosing pushed first
    assert stripes_handed_on({a: None, real: None}, real) == [a, real]  # (the receiver's ordered dict)
    assert stripes_handed_on([a, b], real) == [a]  # its own never came: the first alone
    assert stripes_handed_on([], real) == [] and stripes_handed_on([b], None) == [b]


def test_a_chunk_crosses_in_stripes_one_per_region_each_handed_on_by_its_receiver_to_every_other():
    """A node a region, 8 regions: the region tree is three crossings deep, so the chunk crosses in 7
    stripes. The first holder sends each region's receiver its stripe; each receiver sends its own to
    the 6 others; everyone else sends none: every region takes each block once."""
    heads = {f"r{j}": [f"n{j}"] for j in range(8)}
    for c in range(8):
        plan = stripe_plan(4, c, "r2", heads, blocks=16)
        assert plan is not None and plan.n == 7
        assert sorted(plan.stripe.values()) == list(range(7)) and "r2" not in plan.stripe
        assert plan.receiver == {r: designated(4, c, hs) for r, hs in heads.items() if r != "r2"}
        first = stripe_targets(plan, "n2", "r2", first=True)
        assert sorted(s for _, s in first) == list(range(7))
        assert {h: s for h, s in first} == {plan.receiver[r]: s for r, s in plan.stripe.items()}
        assert stripe_targets(plan, "n2", "r2", first=False) == []  # took it from a peer: sends none
        received = {h: [s] for h, s in first}
        for r, h in plan.receiver.items():
            out = stripe_targets(plan, h, r, first=False)
            assert {s for _, s in out} == {plan.stripe[r]} and len(out) == 6
            for to, s in out:
                received[to].append(s)
        for h, got in received.items():
            assert sorted(got) == list(range(7)), (h, got)  # every stripe once: the whole chunk, once
        assert stripe_plan(4, c, "r2", {r: list(reversed(hs)) for r, hs in heads.items()}, blocks=16) == plan


def test_stripes_only_where_the_tree_is_deeper_than_one_crossing_and_each_region_has_a_block():
    many = {f"r{j}": [f"r{j}h{i}" for i in range(8)] for j in range(8)}  # 100 nodes: one crossing deep
    few = {f"r{j}": [f"r{j}h{i}" for i in range(2)] for j in range(8)}
    assert stripe_plan(1, 3, "r0", many, blocks=32) is None
    assert stripe_plan(1, 3, "r0", few, blocks=32) is not None  # no timings: wherever the tree is deeper
    assert stripe_plan(1, 3, "r0", few, blocks=6) is None  # fewer blocks than stripes
    assert stripe_plan(1, 3, "r0", {"r0": ["a"], "r1": ["b"]}, blocks=32) is None  # one other region
    assert stripe_plan(1, 3, "r0", {"r0": ["a"], "r1": ["b"], "r2": []}, blocks=32) is None


def test_a_first_chunk_takes_stripes_only_where_the_timed_tree_would_start_its_last_crossing_later():
    """The stripes' tail: the receiver of the last block sends it on n-1 times. One 256 KiB chunk to
    a node a region at 4 MiB/s over 40 ms: stripes. Two nodes a region at 1 MiB/s, where a 16 KiB
    block takes 16 ms: the timed tree. A later chunk of the same patch crosses beside others: stripes."""
    one = {f"r{j}": [f"n{j}"] for j in range(8)}
    two = {f"r{j}": [f"n{j}", f"m{j}"] for j in range(8)}
    fast = tree_timing(256 << 10, 16 << 10, 4 * 2**20, 0.04)
    slow = tree_timing(256 << 10, 16 << 10, 2**20, 0.04)
    assert stripe_plan(9, 0, "r0", one, blocks=16, send=fast[0], hop=fast[1]) is not None
    assert stripe_plan(9, 0, "r0", two, blocks=16, send=slow[0], hop=slow[1]) is None
    assert stripe_plan(9, 1, "r0", two, blocks=16, send=slow[0], hop=slow[1]) is not None


@pytest.mark.parametrize("size", [16, 17, 100, 16 * 1024 + 5, 7 * 16 * 1024])
@pytest.mark.parametrize("n", [2, 3, 7])
def test_a_chunks_stripes_deal_out_its_blocks_each_once_and_their_sizes_add_up_to_it(size, n):
    block = 16
    blocks = -(-size // block)
    if blocks < n:
        return
    dealt = sorted(b for s in range(n) for b in stripe_blocks(s, n, blocks))
    assert dealt == list(range(blocks))
    assert sum(stripe_size(size, block, s, n) for s in range(n)) == size


@pytest.mark.parametrize("text", ["", "3", "3/", "/7", "a/7", "-1/7", "7/7", "3/40", "1/2/3", "１/7"])
def test_parse_stripe_refuses_what_names_no_stripe_of_the_chunk(text):
    with pytest.raises(ValueError):
        parse_stripe(text, 32)


def test_parse_stripe():
    assert parse_stripe(None, 32) is None
    assert parse_stripe("3/7", 32) == (3, 7)
