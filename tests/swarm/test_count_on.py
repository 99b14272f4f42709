"""Who a node counts on to share its region's cross-region fetches (``count_on``): the region's
peers that have shown holding chunks, which every node of the region sees alike, so that the
rendezvous designation agrees between them and each chunk crosses into the region once."""

from __future__ import annotations

from sparrowd.swarm.picker import PeerView, Picker, count_on, designated, recount

REGION = ["a", "b", "c", "d"]


def test_a_swarm_just_formed_counts_on_every_neighbour():
    assert count_on([("b", 0), ("c", 0)]) == {"b", "c"}
    assert count_on([]) == frozenset()


def test_a_member_that_never_showed_a_chunk_is_not_counted_on():
    assert count_on([("b", 12), ("c", 0), ("d", 3)]) == {"b", "d"}


def test_nodes_of_a_region_agree_on_the_designated_crosser_whoever_served_them():
    # After a first version, each node saw every neighbour hold chunks (the have maps are the same
    # for all), though each was served by only some of them: their designation sets are the same.
    held = {"a": 40, "b": 35, "c": 50, "d": 20}
    views = {me: frozenset({me}) | count_on((p, held[p]) for p in REGION if p != me) for me in REGION}
    assert len(set(views.values())) == 1
    for chunk in range(64):
        assert len({designated(2, chunk, sorted(v)) for v in views.values()}) == 1


def test_each_chunk_held_outside_the_region_is_fetched_across_by_one_node():
    held = {"a": 40, "b": 35, "c": 50, "d": 20}
    outside = PeerView("x", "far", have=set(range(16)), slots=64)
    askers: dict[int, list[str]] = {}
    for me in REGION:
        nodes = [me, *count_on((p, held[p]) for p in REGION if p != me)]
        local = [PeerView(p, "here", have=set()) for p in REGION if p != me]
        picker = Picker(me, "here")
        for r in picker.pick(0.0, version=2, missing=range(16), inflight={}, peers=[outside, *local],
                             region_nodes=nodes, available_since={c: 0.0 for c in range(16)}):
            askers.setdefault(r.index, []).append(me)
    assert sorted(askers) == list(range(16))
    assert all(len(who) == 1 for who in askers.values())


def test_a_member_that_shows_chunks_and_never_crosses_costs_one_wait():
    # "d" is counted on (it showed chunks) but fetches nothing: once cross_wait has passed, the
    # picker reports it, and the driver leaves it out of the designation.
    me = "a"
    nodes = [me, *count_on((p, 10) for p in REGION if p != me)]
    outside = PeerView("x", "far", have=set(range(32)), slots=64)
    local = [PeerView(p, "here", have=set()) for p in REGION if p != me]
    picker = Picker(me, "here", cross_wait=3.0)
    theirs = [c for c in range(32) if designated(2, c, sorted(nodes)) == "d"]
    assert theirs
    kw = dict(version=2, missing=theirs, peers=[outside, *local], region_nodes=nodes,
              available_since={c: 0.0 for c in theirs})
    assert picker.stalled(1.0, **kw) == set()
    assert picker.stalled(3.0, **kw) == {"d"}
    nodes.remove("d")  # passed over: its chunks go to the others, with no further wait
    assert all(designated(2, c, sorted(nodes)) != "d" for c in theirs)


def test_a_version_in_flight_counts_on_neighbours_learned_of_later():
    # n5 starts on a swarm's first version before it has heard of n1, its region's other node,
    # which joined a moment later: it counts on nobody. Once it learns of n1 it counts on n1 too,
    # as n1 counts on it, so both designate alike and each chunk crosses into the region once.
    counted, known = recount(None, frozenset(), [])
    assert counted == frozenset() and known == frozenset()
    counted, known = recount(counted, known, [("n1", 0)])
    assert counted == {"n1"} and known == {"n1"}
    n1_view = recount(None, frozenset(), [("n5", 0)])[0]
    for chunk in range(32):
        assert designated(1, chunk, sorted({"n5"} | counted)) == designated(1, chunk, sorted({"n1"} | n1_view))


def test_a_version_in_flight_keeps_its_set_as_peers_show_chunks():
    # Decided at the version's start; a known peer's first chunks do not move the designation
    # under the version (they count from the next one), and a newcomer that never showed a chunk,
    # in a region whose peers have, is known but not counted on.
    counted, known = recount(None, frozenset(), [("b", 0), ("c", 0)])
    assert counted == {"b", "c"}
    assert recount(counted, known, [("b", 9), ("c", 0)]) == (counted, known)
    counted, known = recount(counted, known, [("b", 9), ("c", 0), ("d", 0)])
    assert counted == {"b", "c"} and known == {"b", "c", "d"}
    counted, known = recount(counted, known, [("b", 9), ("c", 0), ("d", 0), ("e", 4)])
    assert counted == {"b", "c", "e"} and known == {"b", "c", "d", "e"}
