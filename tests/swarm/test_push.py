"""Whom a relay pushes a chunk to (swarm.push): pure, no sockets."""

from __future__ import annotations

import pytest

from sparrowd.swarm.picker import designated
from sparrowd.swarm.push import PushPeer, parse_push, push_heads, push_targets

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
