"""The chain planner: what a node fetches to reach the newest version, and what retention keeps."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparrowd.swarm.chain import Key, Obj, advance, listed_whole, retained, wanted


def chain(patches=(), anchors=(), complete=(), streaming=()):
    """Known objects: patches v (base v-1 unless given as (v, base)), anchors, which are held whole."""
    out = {}
    for p in patches:
        v, b = p if isinstance(p, tuple) else (p, p - 1)
        out[Key(v)] = Obj(b, Key(v) in complete)
    for a in anchors:
        out[Key(a, True)] = Obj(None, Key(a, True) in complete)
    for v in streaming:
        out[Key(v)] = Obj(None, False)
    return out


def test_a_node_on_the_chain_fetches_the_patches_after_it():
    assert wanted(3, chain(patches=range(1, 7), anchors=[4])) == {Key(4), Key(5), Key(6)}


def test_a_late_node_takes_the_newest_anchor_that_reaches_the_end():
    known = chain(patches=range(5, 9), anchors=[4, 6])
    assert wanted(0, known) == {Key(6, True), Key(7), Key(8)}
    # A node past the newest anchor needs none.
    assert wanted(6, known) == {Key(7), Key(8)}


def test_the_anchor_chosen_is_one_from_which_every_patch_is_there():
    # Patch 7 is missing: from anchor 6 the chain stops at 6; anchor 8 reaches the end.
    known = chain(patches=[5, 6, 9, 10], anchors=[4, 6, 8])
    known[Key(9)] = Obj(8, False)
    assert wanted(0, known) == {Key(8, True), Key(9), Key(10)}
    # No anchor from which the chain reaches version 10: the node holds the chain the swarm has.
    known = chain(patches=[5, 6, 8, 9, 10], anchors=[4])
    assert wanted(0, known) == {Key(8), Key(9), Key(10)}


def test_an_anchor_at_the_newest_version_alone_is_enough():
    assert wanted(2, chain(patches=[5], anchors=[5])) == {Key(5, True)}


def test_no_anchor_until_the_trainer_said_what_it_retains():
    known = chain(patches=range(5, 9), anchors=[6])
    assert wanted(0, known, chain_known=False) == set()
    assert wanted(4, known, chain_known=False) == {Key(5), Key(6), Key(7), Key(8)}


def test_a_cut_page_of_the_trainers_listing_is_not_the_whole_chain():
    """The trainer lists 1-7 and anchor 6; a reply's page, newest first, brought the manifests of
    7, anchor 6 and 6-3 and none of 1 and 2 (or half of 2's statements): the node at 0 knows the
    chain is not whole, so its gap sends it for the patches' next page, not for the anchor."""
    listed = [Key(v) for v in range(1, 8)] + [Key(3, True), Key(6, True)]
    page = {Key(v) for v in range(3, 8)} | {Key(6, True)}
    assert not listed_whole(0, listed, page)
    whole = page | {Key(1), Key(2), Key(3, True)}
    assert not listed_whole(0, listed, whole - {Key(3, True)})  # every object listed, anchors too
    assert listed_whole(0, listed, whole)
    assert listed_whole(3, listed, page)  # a node at 3 needs nothing older
    assert not listed_whole(3, listed, page - {Key(6, True)})  # an anchor it may want, cut
    # The newest, still being published (no manifest yet anywhere), leaves the listing whole.
    assert listed_whole(0, listed + [Key(8)], whole)
    # What the cut page alone would have made of it: the anchor, with its chain broken.
    known = chain(patches=range(3, 8), anchors=[6])
    assert wanted(0, known, chain_known=listed_whole(0, listed, page)) == set()
    assert wanted(0, known, chain_known=True) == {Key(6, True), Key(7)}


def test_streaming_patches_build_on_the_newest_version():
    known = chain(patches=[1, 2], streaming=[3])
    assert wanted(0, known) == {Key(1), Key(2), Key(3)}
    # A late node fetches the stream after the anchor.
    known = chain(patches=[5, 6], anchors=[6], streaming=[7])
    assert wanted(0, known) == {Key(6, True), Key(7)}


def test_advance_follows_held_patches_and_anchors():
    assert advance(0, {}) == 0
    done = chain(patches=[1, 2, 3], complete={Key(1), Key(2)})
    assert advance(0, done) == 2
    # After retention dropped 1 and 2, the node's recorded position still holds.
    done = chain(patches=[3, 4], complete={Key(3), Key(4)})
    assert advance(2, done) == 4 and advance(4, done) == 4
    done = chain(patches=[7, 8, 9], anchors=[6], complete={Key(6, True), Key(7), Key(8)})
    assert advance(0, done) == 8
    # A patch that came before its anchor moves nothing; nor does an anchor not yet whole.
    assert advance(0, chain(patches=[7], anchors=[6], complete={Key(7)})) == 0
    assert advance(0, chain(anchors=[6])) == 0
    # An anchor older than the position does not move it back.
    assert advance(9, chain(anchors=[6], complete={Key(6, True)})) == 9


def test_retention_keeps_the_anchor_and_the_patches_after_it():
    def keep(patches, anchors, retain):
        objs = chain(patches=patches, anchors=anchors,
                     complete={Key(p) for p in patches} | {Key(a, True) for a in anchors})
        return retained(objs.items(), retain)

    assert keep(range(1, 11), [], 3) == {Key(8), Key(9), Key(10)}
    assert keep(range(1, 11), [0, 5], 3) == {Key(5, True)} | {Key(v) for v in range(6, 11)}
    assert keep(range(1, 11), [0, 5, 10], 3) == {Key(10, True), Key(8), Key(9), Key(10)}


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 30), every=st.integers(1, 8), retain=st.integers(1, 10), at=st.integers(0, 40))
def test_retained_objects_always_let_any_node_reach_the_newest_version(n, every, retain, at):
    """Publish n patches with an anchor every ``every`` versions (and the base as anchor 0),
    apply retention after each; a node at any version reaches n from what is kept."""
    kept: dict[Key, Obj] = {Key(0, True): Obj(None, True)}
    for v in range(1, n + 1):
        kept[Key(v)] = Obj(v - 1, True)
        if v % every == 0:
            kept[Key(v, True)] = Obj(None, True)
        keep = retained(kept.items(), retain)
        kept = {k: o for k, o in kept.items() if k in keep}
    assert sum(1 for k in kept if not k.anchor) >= min(retain, n)
    at = min(at, n)
    plan = wanted(at, kept)
    reached = advance(at, {k: kept[k] for k in plan})
    assert reached == n, (at, sorted(plan), sorted(kept))


@pytest.mark.parametrize("tag,key", [("12", Key(12)), ("a12", Key(12, True)), ("0", Key(0))])
def test_key_tags(tag, key):
    assert Key.parse(tag) == key and key.tag == tag


@pytest.mark.parametrize("tag", ["", "a", "b1", "-1", "1a", "a-1", "１", "9" * 19])
def test_bad_key_tags(tag):
    with pytest.raises(ValueError):
        Key.parse(tag)


def test_producible_names_the_anchor_and_patches_for_each_version():
    from sparrowd.swarm.chain import producible

    held = {Key(3, True): Obj(None, True), Key(4): Obj(3, True), Key(5): Obj(4, True), Key(6): Obj(5, False),
            Key(1): Obj(0, True), Key(2): Obj(1, True)}
    got = producible(held)
    # 1 and 2 have no anchor at or before them; 6 is not whole; the newest anchor starts the chain.
    assert got == {3: (3, []), 4: (3, [4]), 5: (3, [4, 5])}
    assert producible({**held, Key(0, True): Obj(None, True)})[2] == (0, [1, 2])
    assert producible({Key(4): Obj(3, True)}) == {}


def test_a_newer_anchor_known_elsewhere_retires_the_old_one_and_its_chain():
    complete = [(Key(0, True), Obj(None, True))] + [(Key(v), Obj(v - 1, True)) for v in range(1, 9)]
    # Holding only anchor 0: every patch after it stays (a late node may start from 0).
    assert retained(complete, 2) == {Key(0, True)} | {Key(v) for v in range(1, 9)}
    # Anchor 6 exists in the swarm: late nodes start there; anchor 0 and patches up to 6 go.
    assert retained(complete, 2, newest_anchor=6) == {Key(7), Key(8)}
    assert retained(complete, 4, newest_anchor=6) == {Key(5), Key(6), Key(7), Key(8)}


def test_a_version_held_but_not_producible_is_named_with_the_base_it_lacks():
    from sparrowd.swarm.chain import Key, Obj, unproducible

    held = {Key(1): Obj(0, True), Key(2): Obj(1, True), Key(3): Obj(2, True)}
    ulp2 = {1, 2, 3}
    u = unproducible(held, ulp2, set(), None, keeps_folder=True)
    assert (u.version, u.base) == (3, 0) and "start it with --base or publish an anchor" in u.reason
    assert "--current on" in unproducible(held, ulp2, set(), None, keeps_folder=False).reason
    assert unproducible(held, ulp2, set(), 0, keeps_folder=True) is None  # the folder holds the base
    assert unproducible(held, ulp2, set(), 3, keeps_folder=True) is None  # or is there already
    assert unproducible({**held, Key(1, True): Obj(None, True)}, ulp2, set(), None, keeps_folder=True) is None
    assert unproducible(held, {1, 2}, set(), None, keeps_folder=True).version == 2  # v3 is plain ulp
    assert unproducible(held, ulp2, {1, 2, 3}, None, keeps_folder=True) is None  # decoded already
    assert unproducible(held, ulp2, set(), None, keeps_folder=True, target=2).version == 2
    assert unproducible(held, ulp2, set(), None, keeps_folder=True, target=9) is None  # not held: not yet
    partial = {Key(1): Obj(0, True), Key(2): Obj(1, False)}
    assert unproducible(partial, ulp2, set(), None, keeps_folder=True).version == 1
