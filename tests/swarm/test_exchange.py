"""Picker, choker, super-seeding and rates: pure code, many simulated peers, no sockets."""

from __future__ import annotations

import random

import pytest

from sparrowd.swarm import versions
from sparrowd.swarm.choker import Choker, ChokerPeer
from sparrowd.swarm.picker import (
    CROSS_GRACE,
    CROSS_RATE,
    ENDGAME_AFTER,
    SLOW_CHUNKS,
    STRIPE_WAIT,
    PeerView,
    Picker,
    designated,
    slots_for_rate,
    stripes_stopped,
)
from sparrowd.swarm.rate import Rate
from sparrowd.swarm.superseed import CROSS_BUDGET, SuperSeed, far_first_copies, first_copies_near
from sparrowd.swarm.versions import from_bitmap, to_bitmap


def test_rarest_first_with_random_order_among_equals():
    peers = [PeerView("a", "eu", {0, 1, 2}), PeerView("b", "eu", {0, 1}), PeerView("c", "eu", {0})]
    p = Picker("me", "eu", rarest_window=1, endgame_left=0, rng=random.Random(0))
    reqs = p.pick(0.0, version=1, missing=[0, 1, 2], inflight={}, peers=peers, region_nodes=["me"], available_since={})
    assert [r.index for r in reqs] == [2, 1, 0]  # held by 1, 2, 3 peers
    firsts = set()
    for seed in range(20):
        p = Picker("me", "eu", rarest_window=4, rng=random.Random(seed))
        everyone = [PeerView(x, "eu", set(range(8)), slots=8) for x in "ab"]
        firsts.add(p.pick(0.0, version=1, missing=range(8), inflight={}, peers=everyone, region_nodes=["me"],
                          available_since={})[0].index)
    assert len(firsts) > 2  # equally rare chunks are not chased in lock-step


def test_sources_prefer_the_region_then_peers_over_the_trainer_then_speed():
    peers = [
        PeerView("trainer", "eu", {0}, is_trainer=True, rate=1e9),
        PeerView("far", "us", {0}, rate=1e8),
        PeerView("near-slow", "eu", {0}, rate=1e3),
        PeerView("near-fast", "eu", {0}, rate=1e6),
    ]
    p = Picker("me", "eu")

    def pick(ps):
        return p.pick(0.0, version=1, missing=[0], inflight={}, peers=ps, region_nodes=["me"], available_since={})

    assert pick(peers)[0].peer_id == "near-fast"
    assert pick(peers[:3] + [PeerView("near-fast", "eu", {0}, choking=True)])[0].peer_id == "near-slow"
    assert pick(peers[:1] + peers[2:3])[0].peer_id == "near-slow"  # a same-region peer before the trainer
    assert pick(peers[:2])[0].peer_id == "trainer"  # the trainer is in this region: no crossing needed


def test_a_chunk_crosses_into_a_region_once_unless_the_designated_node_is_slow():
    region = ["n1", "n2", "n3", "n4"]
    far = [PeerView("far", "us", set(range(40)), slots=100)]
    crossers = {}
    for me in region:
        p = Picker(me, "eu", cross_wait=3.0)
        for r in p.pick(0.0, version=7, missing=range(40), inflight={}, peers=far, region_nodes=region,
                        available_since=dict.fromkeys(range(40), 0.0)):
            crossers.setdefault(r.index, []).append(me)
    assert sorted(crossers) == list(range(40))
    assert all(len(v) == 1 and v[0] == designated(7, c, region) for c, v in crossers.items())
    assert len({v[0] for v in crossers.values()}) == 4  # the crossing work is spread over the region
    # Once a neighbour holds the chunk nobody else crosses for it, even past the wait.
    p = Picker("n1", "eu", cross_wait=3.0)
    neighbour = [PeerView("n2", "eu", {0}, inflight=2, slots=2)] + far
    assert p.pick(10.0, version=7, missing=[0], inflight={}, peers=neighbour, region_nodes=region,
                  available_since={0: 0.0}) == []
    # Nobody in the region has it after the wait: anyone crosses.
    not_mine = next(c for c in range(40) if designated(7, c, region) != "n1")
    got = p.pick(3.5, version=7, missing=[not_mine], inflight={}, peers=far, region_nodes=region,
                 available_since={not_mine: 0.0})
    assert [r.peer_id for r in got] == ["far"]


def test_a_designated_node_that_does_not_cross_is_reported_even_when_a_neighbour_crossed_in_its_place():
    region = ["n1", "n2", "idle"]
    c = next(c for c in range(40) if designated(7, c, region) == "idle")
    p = Picker("n1", "eu", cross_wait=3.0)

    def stalled(now, *, neighbour_fetching=(), idle_fetching=()):
        views = [PeerView("far", "us", {c}), PeerView("n2", "eu", set(), fetching=set(neighbour_fetching)),
                 PeerView("idle", "eu", set(), fetching=set(idle_fetching))]
        return p.stalled(now, version=7, missing=[c], peers=views, region_nodes=region, available_since={c: 0.0})

    assert stalled(2.9) == set()  # it still has time
    assert stalled(3.0) == {"idle"}
    # n2 already crossed for it (its view left "idle" out): n1 must leave it out too, or the two
    # nodes' designations disagree and each waits on a node the other does not count on.
    assert stalled(3.0, neighbour_fetching={c}) == {"idle"}
    assert stalled(3.0, idle_fetching={c}) == set()  # it is on it: not stalled
    # A chunk designated to this node itself is never a reason to report anyone.
    mine = next(c for c in range(40) if designated(7, c, region) == "n1")
    assert p.stalled(9.0, version=7, missing=[mine], peers=[PeerView("far", "us", {mine})], region_nodes=region,
                     available_since={mine: 0.0}) == set()


def test_a_neighbours_claim_holds_a_node_back_only_while_it_is_worth_waiting_for():
    region = ["n1", "n2"]
    c = next(c for c in range(40) if designated(7, c, region) == "n2")  # n2 is to bring it across
    far = PeerView("far", "us", {c})
    p = Picker("n1", "eu", cross_wait=3.0)  # claim_wait: two cross_waits

    def pick(now, n2):
        return [r.peer_id for r in p.pick(now, version=7, missing=[c], inflight={}, peers=[far, n2],
                                          region_nodes=region, available_since={c: 0.0})]

    def stalled(now, n2):
        return p.stalled(now, version=7, missing=[c], peers=[far, n2], region_nodes=region, available_since={c: 0.0})

    fetching = PeerView("n2", "eu", set(), fetching={c})
    choking = PeerView("n2", "eu", {c}, choking=True)
    for claim in (fetching, choking):
        assert pick(5.9, claim) == [] and stalled(5.9, claim) == set()  # it is about to have it: wait
        assert pick(6.0, claim) == ["far"] and stalled(6.0, claim) == {"n2"}  # it did not: cross, pass it over
    # A neighbour that has never served this node is not waited on: its claim could be a lie.
    unproven = PeerView("n2", "eu", set(), fetching={c}, proven=False)
    assert pick(3.0, unproven) == ["far"] and stalled(6.0, unproven) == set()
    # One that holds the chunk and serves this node is: the node waits for a slot, however long.
    busy = PeerView("n2", "eu", {c}, inflight=2, slots=2)
    assert pick(60.0, busy) == [] and stalled(60.0, busy) == set()


def test_endgame_duplicates_the_last_requests_and_respects_slots():
    peers = [PeerView(x, "eu", {0, 1, 2}, slots=4) for x in ("a", "b", "c")]
    p = Picker("me", "eu", endgame_left=4)
    reqs = p.pick(0.0, version=1, missing=[0, 1], inflight={0: {"a"}, 1: {"b"}}, peers=peers, region_nodes=["me"],
                  available_since={})
    assert all(r.duplicate for r in reqs) and {r.index for r in reqs} == {0, 1}
    assert all(r.peer_id not in ({"a"} if r.index == 0 else {"b"}) for r in reqs)
    # A request out for less than endgame_after gets no second yet.
    p = Picker("me", "eu", endgame_left=4, endgame_after=2.0)
    args = dict(version=1, missing=[0, 1], inflight={0: {"a"}, 1: {"b"}}, peers=peers, region_nodes=["me"],
                available_since={})
    reqs = p.pick(10.0, **args, asked_at={0: 9.0, 1: 7.5})  # chunk 1 was asked for 2.5 s ago, chunk 0 1 s ago
    assert [(r.index, r.duplicate) for r in reqs] == [(1, True)] and reqs[0].peer_id != "b"
    assert p.pick(10.0, **args, asked_at={0: 9.0, 1: 8.5}) == []
    # Far from the end, no duplicates.
    p = Picker("me", "eu", endgame_left=1)
    assert p.pick(0.0, version=1, missing=[0, 1], inflight={0: {"a"}, 1: {"b"}}, peers=peers, region_nodes=["me"],
                  available_since={}) == []
    # Slots cap requests per peer.
    one = [PeerView("a", "eu", set(range(10)), slots=3, inflight=1)]
    assert len(Picker("me", "eu").pick(0.0, version=1, missing=range(10), inflight={}, peers=one,
                                       region_nodes=["me"], available_since={})) == 2


def test_the_waits_stretch_by_the_round_trip_between_regions():
    chunk = 512 << 10
    p = Picker("n1", "eu")
    p.pace(chunk)  # no round trip measured yet
    assert p.cross_wait == CROSS_GRACE + chunk / CROSS_RATE and p.endgame_after == ENDGAME_AFTER
    p.pace(chunk, 2.0)
    assert p.cross_wait == CROSS_GRACE + chunk / CROSS_RATE + 2.0 and p.endgame_after == ENDGAME_AFTER + 2.0
    # What that changes: 3 s after a chunk was asked for across a 2 s round trip, its first byte has
    # only just had time to come; no second request goes out for it yet. With the wait unstretched
    # (the round trip not measured), it would.
    peers = [PeerView(x, "us", {0, 1}, slots=4) for x in ("a", "b")]
    args = dict(version=1, missing=[0, 1], inflight={0: {"a"}, 1: {"b"}}, peers=peers, region_nodes=["n1"],
                available_since={0: 0.0, 1: 0.0}, asked_at={0: 7.0, 1: 7.0})
    assert p.pick(10.0, **args) == []
    assert {(r.index, r.duplicate) for r in p.pick(11.0, **args)} == {(0, True), (1, True)}
    p.pace(chunk, None)
    assert {(r.index, r.duplicate) for r in p.pick(10.0, **args)} == {(0, True), (1, True)}
    # A designated crosser that has not started is passed over only once its stretched wait is out.
    region = ["n1", "idle"]
    c = next(c for c in range(40) if designated(7, c, region) == "idle")
    views = [PeerView("far", "us", {c}), PeerView("idle", "eu", set())]
    p.pace(chunk, 2.0)
    late = CROSS_GRACE + chunk / CROSS_RATE + 1.0  # past the unstretched wait, within the stretched one
    assert p.stalled(late, version=7, missing=[c], peers=views, region_nodes=region, available_since={c: 0.0}) == set()
    assert p.stalled(late + 1.0, version=7, missing=[c], peers=views, region_nodes=region,
                     available_since={c: 0.0}) == {"idle"}


def test_the_waits_cover_a_slow_trainers_chunk_time():
    """Over links slow enough that the trainer's uplink takes longer than the waits to send a chunk
    (its signed tree timing, ``send``), a request is not duplicated, nor a designated crosser passed
    over, while a chunk moving at that rate still comes; where the uplink is fast (or unknown), the
    waits are as before."""
    chunk = 340 << 10
    p = Picker("n1", "eu")
    for send in (None, 0.0, 0.05):  # unknown, or fast: the waits of ``pace`` without it
        p.pace(chunk, 0.4, send)
        assert p.endgame_after == ENDGAME_AFTER + 0.4
        assert p.cross_wait == CROSS_GRACE + chunk / CROSS_RATE + 0.4
    p.pace(chunk, 0.4, 1.7)  # 340 KiB at 200 KiB/s
    assert p.endgame_after == pytest.approx(SLOW_CHUNKS * 1.7 + 0.4) and p.endgame_after > ENDGAME_AFTER + 0.4
    assert p.cross_wait == pytest.approx(CROSS_GRACE + SLOW_CHUNKS * 1.7 + 0.4)
    # A request out 3 s: past the fixed endgame wait, within a slow chunk's.
    peers = [PeerView(x, "us", {0, 1}, slots=4) for x in ("a", "b")]
    args = dict(version=1, missing=[0, 1], inflight={0: {"a"}, 1: {"b"}}, peers=peers, region_nodes=["n1"],
                available_since={0: 0.0, 1: 0.0}, asked_at={0: 7.0, 1: 7.0})
    assert p.pick(10.0, **args) == []
    assert {(r.index, r.duplicate) for r in p.pick(7.0 + p.endgame_after + 0.01, **args)} == {(0, True), (1, True)}
    p.pace(chunk, 0.4)
    assert {(r.index, r.duplicate) for r in p.pick(10.0, **args)} == {(0, True), (1, True)}


def test_a_chunk_in_stripes_is_waited_for_until_they_stop_or_a_region_mate_holds_it_whole():
    fed = 10.0
    # Stripes still coming: waited for, a round trip between regions longer than STRIPE_WAIT alone.
    assert not stripes_stopped(fed + STRIPE_WAIT - 0.01, fed, 0.0)
    assert stripes_stopped(fed + STRIPE_WAIT, fed, 0.0)
    assert not stripes_stopped(fed + STRIPE_WAIT + 0.1, fed, 0.3)
    assert stripes_stopped(fed + STRIPE_WAIT + 0.3, fed, 0.3)
    assert not stripes_stopped(fed + STRIPE_WAIT - 0.01, fed, -1.0)  # (a clock's jitter never shortens it)
    # A stripe failed, or a node of this region holds the chunk whole: asked for whole at once.
    assert stripes_stopped(fed, fed, 0.3, failed=True)
    assert stripes_stopped(fed + 0.001, fed, 0.3, near_whole=True)


def test_slots_follow_the_rate():
    assert slots_for_rate(0, 2 << 20) == 2
    assert slots_for_rate(1 << 20, 2 << 20) == 1
    assert slots_for_rate(20 << 20, 2 << 20) == 8
    assert slots_for_rate(6 << 20, 2 << 20) == 4


def test_choker_tit_for_tat_and_a_rotating_optimistic_unchoke():
    peers = [ChokerPeer(f"p{i}", True, rate_from=i * 100.0, rate_to=(10 - i) * 100.0) for i in range(10)]
    peers.append(ChokerPeer("idle", False, rate_from=1e9))
    c = Choker(slots=4, optimistic_interval=10.0, rng=random.Random(3))
    first = c.decide(0.0, peers, seed=False)
    assert len(first) == 4 and {"p9", "p8", "p7"} <= first and "idle" not in first
    assert c.decide(5.0, peers, seed=False) == first  # the optimistic slot holds for its interval
    seen = set()
    for t in range(10, 200, 10):
        seen |= c.decide(float(t), peers, seed=False) - {"p9", "p8", "p7"}
    assert len(seen) >= 3  # and then moves
    seed = Choker(slots=4, rng=random.Random(0)).decide(0.0, peers, seed=True)
    assert {"p0", "p1", "p2"} <= seed  # a seed favours the peers it uploads to fastest
    assert Choker(slots=4).decide(0.0, peers[:3], seed=False) == {"p0", "p1", "p2"}
    # ... of its own region first: first copies start there (``first_copies_near``)
    near = [ChokerPeer(p.peer_id, True, rate_to=p.rate_to, near=p.peer_id in ("p8", "p9")) for p in peers[:10]]
    assert {"p8", "p9", "p0"} <= Choker(slots=4, rng=random.Random(0)).decide(0.0, near, seed=True)
    # A peer that is not a seed ranks by what it gets, wherever the peer is.
    assert {"p9", "p8", "p7"} <= Choker(slots=4, rng=random.Random(0)).decide(
        0.0, [ChokerPeer(p.peer_id, True, rate_from=p.rate_from, near=p.peer_id == "p0") for p in peers[:10]],
        seed=False)


def test_a_seed_keeps_free_slots_for_its_own_regions_peers_that_want_a_chunk():
    """``near_room``: the near peers a seed may serve now (unchoked, or admitted to a free slot when
    they ask) and the free slots kept from other regions' peers for them (``admit``'s ``reserved``)."""
    c = Choker(slots=4)
    assert c.near_room(set(), 0, 3) == (3, 3)  # a version begins: three near peers want it, four slots free
    assert c.near_room({"n1", "f1"}, 1, 3) == (3, 2)  # one near unchoked; two free slots, kept for the two
    assert c.near_room({"n1", "f1", "f2", "f3"}, 1, 3) == (1, 2)  # no slot free: only the unchoked one
    assert c.near_room({"f1"}, 0, 0) == (0, 0)  # the near region holds everything: nothing kept
    # Facing a near peer: the same room (whether first copies stay near is one answer for every
    # asker), and no slot kept from it.
    assert c.near_room({"n1", "f1"}, 1, 3, far=False) == (3, 0)
    unchoked = {"n1", "f1"}
    assert not c.admit(unchoked, "f2", reserved=2) and c.admit(unchoked, "n2", reserved=0)


def test_a_slot_left_free_goes_to_the_first_peer_that_asks_before_the_next_decision():
    c = Choker(slots=3)
    # Nobody was interested at the last decision (the version had just started): nobody unchoked.
    unchoked = c.decide(0.0, [ChokerPeer(f"p{i}", False) for i in range(6)], seed=False)
    assert unchoked == set()
    # This node gets its first chunk; the peers that ask are served at once, up to the slots.
    assert [c.admit(unchoked, f"p{i}") for i in range(5)] == [True, True, True, False, False]
    assert unchoked == {"p0", "p1", "p2"} and c.admit(unchoked, "p1")
    # The next decision ranks them again, by what they give.
    peers = [ChokerPeer(f"p{i}", True, rate_from=i * 10.0) for i in range(6)]
    assert {"p5", "p4"} <= c.decide(1.0, peers, seed=False)


def test_super_seed_gives_distinct_chunks_before_repeating_any():
    s = SuperSeed(chunks=8, per_peer=1, regive_after=5.0, claim_within=100.0, rng=random.Random(0))
    offers = [s.offer(0.0, f"n{i}", set(), {}) for i in range(8)]
    assert sorted(next(iter(o)) for o in offers) == list(range(8))  # eight peers, eight different chunks
    assert s.offer(1.0, "n8", set(), {}) == set()  # nothing is repeated while its first copy may still spread
    assert s.offer(1.0, "n0", set(), {}) == offers[0]  # a pending assignment stays until the peer has it
    # A peer that leaves before passing its chunk on gives the assignment back at once.
    c5 = next(iter(offers[5]))
    held = {c: 1 for c in range(8) if c != c5}
    assert s.offer(2.0, "n9", set(), held) == set()  # n5 may still be fetching it
    s.forget("n5")
    assert s.offer(2.0, "n9", set(), held) == {c5}
    # One that leaves after receiving its chunk, before anyone else got it, takes the only copy away:
    # that chunk goes again at once too (not ``regive_after`` later), unless a peer is known to hold it.
    c6 = next(iter(offers[6]))
    assert s.offer(2.0, "n6", offers[6], held) == set()  # n6 holds c6 now: nothing pending
    nobody = {c: 1 for c in range(8) if c not in (c5, c6)}
    assert s.offer(2.5, "n10", set(), nobody) == set()
    s.forget("n6")
    assert s.offer(2.5, "n10", set(), nobody) == {c6}
    s.forget("n10")
    assert s.offer(2.5, "n11", set(), held | {c6: 1}) == set()  # another peer holds it: not given again
    # n3's chunk never showed up anywhere (n3 stalls): after the wait it is given again, to someone else.
    lost = next(iter(offers[3]))
    held = {c: 1 for c in range(8) if c != lost}
    assert s.offer(4.0, "n8", set(), held) == set()
    assert s.offer(6.0, "n8", set(), held) == {lost}
    # A peer that never even asks for what it was given loses it after ``claim_within``.
    q = SuperSeed(chunks=2, per_peer=1, claim_within=1.0, regive_after=100.0, rng=random.Random(0))
    lazy, busy = q.offer(0.0, "lazy", set(), {}), q.offer(0.0, "busy", set(), {})
    q.claim(next(iter(busy)))
    assert q.offer(2.0, "third", set(), {}) == lazy
    # A peer holding its chunk gets the next one; with more chunks announced, fresh ones first.
    s.grow(10)
    assert s.offer(6.0, "n0", offers[0], held) <= {8, 9}


def test_a_first_copy_asked_for_and_hung_up_on_is_given_again_after_the_claim_wait():
    """A push took the place of the request (the node hung up before a byte came), then the pushed
    copy's feed left: the chunk must not wait ``regive_after`` for its first copy."""
    s = SuperSeed(chunks=1, per_peer=1, claim_within=1.0, regive_after=30.0, rng=random.Random(0))
    assert s.offer(0.0, "a", set(), {}) == {0}
    s.claim(0, "a")
    assert s.offer(2.0, "b", set(), {}) == set()  # claimed: given again only after regive_after
    s.unclaim(0, "b")  # not its to drop
    assert s.offer(2.0, "b", set(), {}) == set()
    s.unclaim(0, "a")
    assert s.offer(2.0, "b", set(), {}) == {0}
    assert s.offer(2.5, "a", set(), {}) == set()  # a's assignment went to b


def test_rate_estimate_tracks_a_steady_flow_and_decays():
    r = Rate(half_life=1.0)
    for i in range(200):
        r.add(i * 0.05, 5000)  # 100 kB/s
    assert r.rate(10.0) == pytest.approx(100_000, rel=0.05)
    assert r.rate(11.0) == pytest.approx(r.rate(10.0) / 2, rel=0.01) or r.rate(12.0) < 30_000
    assert r.total == 1_000_000


def simulate(nodes_per_region: int, regions: int, chunks: int, *, seed: int, star: bool = False,
             upload_slots: int = 2, trainer_slots: int = 2):
    """Discrete rounds: each transfer takes one round; each node serves ``upload_slots`` per round.
    Returns (rounds until every node holds every chunk, trainer uploads, cross-region transfers)."""
    rng = random.Random(seed)
    regs = [f"r{i}" for i in range(regions)]
    nodes = {f"{r}-{j}": r for r in regs for j in range(nodes_per_region)}
    have = {n: set() for n in nodes}
    have["trainer"] = set(range(chunks))
    region_of = dict(nodes, trainer=regs[0])
    ss = SuperSeed(chunks, per_peer=trainer_slots, regive_after=60.0, rng=rng)
    pickers = {n: Picker(n, r, cross_wait=4.0, rng=random.Random(rng.random())) for n, r in nodes.items()}
    seen = {n: {} for n in nodes}
    fetching = {n: set() for n in nodes}  # asked for but not served yet: queued at the peer in a real swarm
    trainer_up = cross = 0
    for rnd in range(1, 500):
        held_by = {c: sum(c in have[n] for n in nodes) for c in range(chunks)}
        requests = []
        for n, r in nodes.items():
            missing = [c for c in range(chunks) if c not in have[n]]
            if not missing:
                continue
            offer = have["trainer"] if star else ss.offer(float(rnd), n, have[n], held_by)
            views = [PeerView("trainer", regs[0], offer, is_trainer=True, slots=trainer_slots)]
            if not star:
                views += [PeerView(m, nodes[m], set(have[m]), slots=upload_slots, fetching=fetching[m])
                          for m in nodes if m != n]
            for v in views:
                for c in v.have:
                    seen[n].setdefault(c, float(rnd))
            region_nodes = [m for m in nodes if nodes[m] == r]
            reqs = pickers[n].pick(float(rnd), version=1, missing=missing, inflight={}, peers=views,
                                   region_nodes=region_nodes, available_since=seen[n])
            requests += [(n, q) for q in reqs]
        rng.shuffle(requests)
        load = {}
        done = []
        for n, q in requests:
            cap = trainer_slots if q.peer_id == "trainer" else upload_slots
            if load.get(q.peer_id, 0) < cap:
                load[q.peer_id] = load.get(q.peer_id, 0) + 1
                done.append((n, q))
        served = set(done)
        fetching = {n: set() for n in nodes}
        for n, q in requests:
            if (n, q) not in served:
                fetching[n].add(q.index)
        for n, q in requests:
            if q.peer_id == "trainer":
                ss.claim(q.index)
        for n, q in done:
            if q.index in have[n]:
                continue
            have[n].add(q.index)
            trainer_up += q.peer_id == "trainer"
            cross += region_of[q.peer_id] != nodes[n]
        if all(len(have[n]) == chunks for n in nodes):
            return rnd, trainer_up, cross
    raise AssertionError("the swarm did not finish")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_simulated_swarm_spares_the_trainer_and_the_region_links(seed):
    # The benchmark shape: 16 nodes in 4 regions. Each chunk should leave the
    # trainer about once and cross into each other region about once.
    chunks, regions = 32, 4
    rounds, trainer_up, cross = simulate(4, regions, chunks, seed=seed)
    assert trainer_up <= 1.3 * chunks, trainer_up
    assert cross <= 1.3 * (regions - 1) * chunks, cross
    star_rounds, star_up, _ = simulate(4, regions, chunks, seed=seed, star=True)
    assert star_up == 16 * chunks
    assert star_rounds >= 4 * rounds, (star_rounds, rounds)


def test_choking_a_peer_takes_back_only_what_it_has_not_asked_for():
    s = SuperSeed(chunks=4, per_peer=2, claim_within=100.0, regive_after=100.0, rng=random.Random(0))
    given = sorted(s.offer(0.0, "p", set(), {}))
    s.claim(given[0])
    s.forget("p", unclaimed_only=True)
    assert s.offer(1.0, "p", set(), {}) >= {given[0]}  # the transfer it started stays its own
    others = s.offer(1.0, "q", set(), {})
    assert given[1] in others and given[0] not in others


def test_token_bucket_paces_to_its_rate_after_a_small_burst():
    from sparrowd.swarm.bucket import TokenBucket

    b = TokenBucket(100_000)  # burst: a tenth of a second, at least 16 KiB
    assert b.take(0.0, 16 << 10) == 0.0
    wait = b.take(0.0, 50_000)
    assert wait == pytest.approx(0.5)
    # Sending at the pace it asks for holds the average at the rate.
    t, sent = 0.5, 0
    for _ in range(100):
        t += b.take(t, 10_000)
        sent += 10_000
    assert sent / t == pytest.approx(100_000, rel=0.05)
    assert TokenBucket(None).take(0.0, 1 << 30) == 0.0


def test_a_token_buckets_burst_is_its_seconds_of_rate_at_least_16_kib():
    from sparrowd.swarm.bucket import TokenBucket

    rate = 4 << 20
    assert TokenBucket(rate).take(0.0, 256 << 10) == 0.0  # a tenth of a second (410 KiB) goes at once
    # held to its steady rate from the first byte but 16 KiB (the daemons' --rate-burst 0)
    assert TokenBucket(rate, burst_seconds=0).take(0.0, 256 << 10) == pytest.approx((240 << 10) / rate)
    assert TokenBucket(rate, burst_seconds=0.5).take(0.0, 2 << 20) == 0.0


@pytest.mark.parametrize("seed", range(8))
def test_super_seed_gives_chunk_0_first_and_the_rest_in_a_random_order(seed):
    """Relays time chunk 0's region tree as the version's first chunk (``push.stripe_plan``): it is the
    first given out, to whoever asks first, near or far, one at a time or two."""
    assert SuperSeed(chunks=16, rng=random.Random(seed)).offer(0.0, "far", set(), {}, peers=8, far=True) == {0}
    s = SuperSeed(chunks=16, rng=random.Random(seed))
    first = s.offer(0.0, "n0", set(), {})
    assert 0 in first and len(first) == 2  # two a peer (per_peer) in a small swarm
    rest = [c for i in range(14) for c in s.offer(0.0, f"m{i}", set(), {}, peers=8)]  # one a peer in a large one
    assert sorted(rest + sorted(first)) == list(range(16))  # every chunk once
    assert rest != sorted(rest)  # in no fixed order


def test_super_seed_gives_nothing_to_untrusted_peers_and_rests_a_peer_that_let_a_chunk_lapse():
    s = SuperSeed(2, per_peer=2, claim_within=3.0, regive_after=30.0, rng=random.Random(0))
    assert s.offer(0.0, "lurker", set(), {}, trusted=False) == set()  # a member that shows no chunks
    given = s.offer(0.0, "idle", set(), {})
    assert given == {0, 1} and not s.lapsing(2.9, set())
    assert s.lapsing(3.0, set()) and not s.lapsing(3.0, given)  # unclaimed; unless a peer holds them now
    # The lapsed chunks go to a peer that works; the one that let them lapse gets none for 30 s.
    assert s.offer(3.0, "worker", set(), {}) == given and not s.lapsing(3.0, set())
    for c in given:
        s.claim(c, "worker")
    s.grow(4)
    assert s.offer(4.0, "idle", set(), {}) == set()
    assert s.offer(34.0, "idle", set(), {}) == {2, 3}  # rested long enough: trusted with chunks again


def test_have_maps_round_trip_at_every_size_and_small_ones_are_cached():
    rng = random.Random(5)
    for n in (1, 7, 8, 9, 255, 256, 257, 4096):
        have = {i for i in range(n) if rng.random() < 0.4}
        data = to_bitmap(have, n)
        assert len(data) == (n + 7) // 8 and from_bitmap(data) == have
        assert to_bitmap(sorted(have), n) == data and to_bitmap(iter(have), n) == data  # any iterable
        assert to_bitmap(have | {n, n + 5, -1}, n) == data  # indices outside the version are left out
    assert from_bitmap(bytes([0b1010_0000])) == {0, 2}
    hits = versions._to_bitmap_cached.cache_info().hits
    assert to_bitmap({0, 2}, 8) == to_bitmap([2, 0], 8)  # the second from the cache
    assert versions._to_bitmap_cached.cache_info().hits >= hits + 1


def test_a_page_of_statements_stops_at_its_count_or_its_bytes_but_always_moves_on():
    from sparrowd.swarm.signing import Signed
    from sparrowd.swarm.versions import StatementPage

    small = [Signed("announce", 1, bytes(100), bytes(64)) for _ in range(10)]
    page = StatementPage(count=4, size=1 << 20)
    assert len(page.take(small, 0)) == 4
    page = StatementPage(count=100, size=1 << 20)
    assert [Signed.from_bytes(b) for b in page.take(small, 7)] == small[7:]
    assert page.take(small, 10) == []

    # Over two versions: what the first took, the second cannot.
    page = StatementPage(count=6, size=1 << 20)
    assert len(page.take(small, 0)) == 6 and page.take(small, 0) == []

    # By bytes: each takes about 190; the first is taken whatever its size.
    one = len(small[0].to_bytes())
    page = StatementPage(count=100, size=3 * one + 1)
    assert len(page.take(small, 0)) == 3
    big = [Signed("manifest", 1, bytes(10_000), bytes(64))]
    page = StatementPage(count=100, size=1000)
    assert len(page.take(big, 0)) == 1
    assert page.take(small, 0) == []


def test_a_peer_keeps_what_it_was_given_until_it_is_choked_or_the_chunk_goes_to_another():
    """``given_to``: the assignments the trainer shows and serves a peer even once its choker would
    refuse it (``serving.owed``). They last until the peer is choked (``forget``, its unclaimed ones
    only) or the chunk, unasked for past ``claim_within``, goes to another peer."""
    s = SuperSeed(2, per_peer=1, claim_within=3.0, regive_after=30.0, rng=random.Random(0))
    (a,) = s.offer(0.0, "a", set(), {})
    (b,) = s.offer(0.0, "b", set(), {})
    assert s.given_to("a") == {a} and s.given_to("b") == {b} and s.given_to("c") == frozenset()
    s.claim(b, "b")
    s.forget("a", unclaimed_only=True)
    s.forget("b", unclaimed_only=True)
    assert s.given_to("a") == frozenset() and s.given_to("b") == {b}  # b's transfer goes on
    assert s.offer(0.5, "c", set(), {}) == {a} and s.given_to("c") == {a}  # a's went at once
    assert s.offer(4.0, "d", set(), {}) == {a}  # c never asked for it: it lapsed to d
    assert s.given_to("c") == frozenset() and s.given_to("d") == {a}


def test_a_seed_with_many_peers_gives_each_one_chunk_at_a_time():
    """The first copies of a small patch start in as many places as there are chunks: two a peer
    put 8 chunks into 4 peers (and at 16 nodes in 8 regions, into 2 regions)."""
    def first_copies(peers: int) -> dict[str, set[int]]:
        ss = SuperSeed(8, per_peer=2, single_from=4, rng=random.Random(0))
        return {p: got for p in (f"n{i}" for i in range(peers))
                if (got := ss.offer(0.0, p, set(), {}, peers=peers))}

    many = first_copies(16)
    assert len(many) == 8 and all(len(g) == 1 for g in many.values())
    few = first_copies(3)  # too few to keep the seed's slots busy one chunk each: two a peer
    assert [len(g) for g in few.values()] == [2, 2, 2]
    ss = SuperSeed(8, per_peer=2, single_from=4)
    assert len(ss.offer(0.0, "a", set(), {}, peers=16)) == 1
    assert len(ss.offer(1.0, "a", {next(iter(ss.assigned["a"]))}, {}, peers=16)) == 1  # the next once it holds it
    # The daemon's and the simulator's: three peers are enough (three near peers of 12 rollouts in 4
    # regions took 2 MiB in 1.17x the bound two a peer, 1.10x one); two are not.
    from sparrowd.swarm.policy import SEED_PER_PEER, SEED_SINGLE_FROM
    seed = SuperSeed(8, per_peer=SEED_PER_PEER, single_from=SEED_SINGLE_FROM)
    assert [len(seed.offer(0.0, p, set(), {}, peers=3)) for p in "abc"] == [1, 1, 1]
    assert [len(seed.offer(0.0, p, set(), {}, peers=2)) for p in "de"] == [2, 2]
    assert SuperSeed(8).single_from == SEED_SINGLE_FROM  # one default


def test_first_copies_stay_in_the_seeds_region_while_it_has_peers_to_take_them():
    """A first copy given into another region crosses once more than (R-1) per chunk: first copies
    go to the seed's own region while it may serve a peer there for a one-chunk version, two for a
    larger one, and (for a larger one) the region has a node for every two other regions. A chunk
    given to a near peer that never asks goes, once lost, to anyone."""
    assert first_copies_near(1, 8, 1, 1)  # one chunk: one near peer it may serve, whatever the regions
    assert first_copies_near(16, 4, 2, 2) and first_copies_near(16, 8, 12, 3)
    assert not first_copies_near(16, 4, 4, 1)  # one it may serve: the seed's uplink would wait on it
    assert not first_copies_near(16, 8, 2, 2)  # two near nodes to start 7 regions' crossings: spread
    assert not first_copies_near(1, 4, 0, 0)  # nobody near
    assert not first_copies_near(4, 1, 8, 8)  # one region: nothing to cross
    assert not first_copies_near(None, 4, 8, 8) and not first_copies_near(0, 4, 8, 8)  # no manifest yet
    # A version that leaves the seed in less than a round trip stays near wherever two near peers may take it.
    assert first_copies_near(16, 8, 2, 2, quick=True) and not first_copies_near(16, 8, 2, 1, quick=True)
    ss = SuperSeed(1, single_from=4, claim_within=3.0)
    assert ss.offer(0.0, "far", set(), {}, peers=16, fresh=False) == set()
    assert ss.offer(0.1, "near", set(), {}, peers=16) == {0}
    assert ss.offer(1.0, "far", set(), {}, peers=16, fresh=False) == set()  # given, not yet lost
    assert ss.offer(3.2, "far", set(), {}, peers=16, fresh=False) == {0}  # near never asked: lost, anyone's



def test_first_copies_given_into_other_regions_stay_within_the_cross_region_budget():
    """Where first copies are not kept near, each one given into another region crosses back into
    the seed's region once more than (R-1) per chunk: no more than CROSS_BUDGET x (R-1) x the chunks
    go far, the rest start at home; no limit where the seed's region has no rollout (nothing comes
    back) or the count is unknown."""
    assert far_first_copies(8, 8, 1) == int(CROSS_BUDGET * 7 * 8) == 5  # 3 of 8 first copies at home
    assert far_first_copies(24, 4, 2) == 7 and far_first_copies(10, 2, 1) == 1
    assert far_first_copies(8, 8, 0) is None  # nobody at home: every chunk must cross anyway
    assert far_first_copies(None, 8, 1) is None and far_first_copies(0, 8, 1) is None
    assert far_first_copies(8, 1, 4) is None
    ss = SuperSeed(8, single_from=4)
    far = set()
    for i in range(8):  # 8 peers of other regions, each asking for a first copy
        far |= ss.offer(0.0, f"far{i}", set(), {}, peers=16, far=True, far_most=5)
    assert len(far) == 5 and ss.far == far
    assert ss.offer(0.0, "far0", far, {}, peers=16, far=True, far_most=5) == set()  # holds its one: none new
    home = set()
    for i in range(3):
        home |= ss.offer(0.0, f"near{i}", set(), {}, peers=16)
    assert home == set(range(8)) - far and ss.far == far  # the rest start at home, and count as near
    # A far first copy lost (its peer left) and given again is not counted twice.
    ss.forget("far1")
    again = ss.offer(0.1, "far8", set(), {}, peers=16, far=True, far_most=5)
    assert len(again) == 1 and again <= far and len(ss.far) == 5
    # A seed's region that takes none of the rest (its node stalled, or never fetches) holds the
    # others back for home_wait at most: then the rest go to whoever asks.
    ss = SuperSeed(4, single_from=4, claim_within=3.0, home_wait=3.0)
    for peer in ("a", "b"):
        (given,) = ss.offer(0.0, peer, set(), {}, peers=8, far=True, far_most=2)
        ss.claim(given, peer)  # asked for: not lost, not given again
    assert ss.offer(0.5, "c", set(), {}, peers=8, far=True, far_most=2) == set()  # capped from now
    assert ss.offer(3.4, "c", set(), {}, peers=8, far=True, far_most=2) == set()
    assert len(ss.offer(3.6, "c", set(), {}, peers=8, far=True, far_most=2)) == 1 and len(ss.far) == 3
    # ... counted from the last first copy the seed's region took: one that keeps taking them holds on.
    ss = SuperSeed(6, single_from=4, claim_within=3.0, home_wait=3.0)
    for peer in ("a", "b"):
        (given,) = ss.offer(0.0, peer, set(), {}, peers=8, far=True, far_most=2)
        ss.claim(given, peer)
    assert ss.offer(0.5, "c", set(), {}, peers=8, far=True, far_most=2) == set()
    (home,) = ss.offer(2.0, "h", set(), {}, peers=8)
    ss.claim(home, "h")
    assert ss.offer(3.6, "c", set(), {}, peers=8, far=True, far_most=2) == set()  # 1.6 s after h took one
    assert len(ss.offer(5.1, "c", set(), {}, peers=8, far=True, far_most=2)) == 1

def test_the_trainers_counts_of_holders_follow_every_change_of_have_maps():
    """The trainer keeps, per object, how many peers' have-maps show each chunk, as maps change and
    peers go, instead of walking every peer's maps for each exchange it answers."""
    from types import SimpleNamespace

    from sparrowd.daemon.swarm import Remote, Swarm
    from sparrowd.swarm.chain import Key

    rng = random.Random(0)
    keys = [Key(1, False), Key(2, False), Key(2, True)]
    me = SimpleNamespace(held_by={}, _showing=0)
    remotes = {f"p{i}": Remote(f"p{i}", "eu") for i in range(12)}
    for _ in range(400):
        r = remotes[rng.choice(sorted(remotes))]
        have = {k: frozenset(rng.sample(range(20), rng.randint(0, 6))) for k in keys if rng.random() < 0.6}
        Swarm._set_have(me, r, {} if rng.random() < 0.1 else have)  # now and then, as when it leaves
        want = {}
        for x in remotes.values():
            for k, chunks in x.have.items():
                for c in chunks:
                    want.setdefault(k, {}).setdefault(c, 0)
                    want[k][c] += 1
        assert {k: dict(v) for k, v in me.held_by.items()} == want
        assert me._showing == sum(any(x.have.values()) for x in remotes.values())
