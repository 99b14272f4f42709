"""The lease table as a pure state machine: a fake clock, no sockets."""

import random

import pytest

from sparrowd.daemon.leasedb import SqliteLeaseStore
from sparrowd.errors import InputError
from sparrowd.swarm.leases import GATEWAYS, LeaseGone, LeaseTable, node_state, renew_interval

TTL = 15.0


def table(now=1000.0, **kw):
    return LeaseTable(TTL, now=now, **kw)


def test_join_grants_a_lease_with_a_ttl_and_a_fresh_epoch():
    t = table()
    a = t.join("a", "rollout", "eu", "10.0.0.1:7070", now=1000.0)
    b = t.join("b", "rollout", "us", "10.0.0.2:7070", now=1001.0)
    assert a.expires_at == 1015.0 and b.expires_at == 1016.0
    assert b.epoch > a.epoch
    assert [n.node_id for n in t.live(1002.0)] == ["a", "b"]


def test_an_engine_that_detached_is_reported_as_none():
    t = table()
    a = t.join("a", "rollout", "eu", "h:1", now=1000.0)
    assert t.renew("a", a.epoch, 1001.0, engine_version=4).engine_version == 4
    assert t.renew("a", a.epoch, 1002.0).engine_version is None


def test_the_swarm_size_counts_live_rollouts_only():
    t = table()
    assert t.rollouts(1000.0) == 0
    t.join("trainer", "trainer", "eu", "h:0", now=1000.0)
    a = t.join("a", "rollout", "eu", "h:1", now=1000.0)
    t.join("b", "rollout", "us", "h:2", now=1001.0)
    t.join("c", "relay", "us", "h:3", now=1001.0)  # a patch spreads through relays alike
    assert t.rollouts(1002.0) == 3
    t.renew("a", a.epoch, 1005.0)
    assert t.rollouts(1016.0) == 1  # b's and c's leases ended at 1016, before a sweep; the trainer counts not
    t.leave("a", a.epoch, 1017.0)
    assert t.rollouts(1017.0) == 0


def test_renew_extends_and_records_what_the_node_reports():
    t = table()
    a = t.join("a", "rollout", "eu", "h:1", now=1000.0)
    r = t.renew("a", a.epoch, 1005.0, versions=[3, 1, 2, 3], engine_version=2, bytes_up=500, bytes_down=1000)
    assert r.expires_at == 1020.0 and r.epoch == a.epoch
    assert r.versions == (1, 2, 3) and r.engine_version == 2
    assert (r.bytes_up, r.bytes_down) == (500, 1000)
    assert r.rate_up == pytest.approx(100.0) and r.rate_down == pytest.approx(200.0)
    # A node whose daemon restarted reports counters from zero: no negative rate.
    r = t.renew("a", a.epoch, 1010.0, bytes_up=10, bytes_down=0)
    assert r.rate_up == pytest.approx(2.0) and r.rate_down == 0.0


def test_expiry_removes_the_node_from_every_peer_list():
    t = table()
    a = t.join("a", "rollout", "eu", "h:1", now=1000.0)
    t.join("b", "rollout", "eu", "h:2", now=1000.0)
    t.renew("a", a.epoch, 1010.0)
    assert {n.node_id for n in t.peers("x", "eu", 1014.9)} == {"a", "b"}
    # b's lease ends at 1015: from then on it is in no list, even before a sweep.
    assert [n.node_id for n in t.peers("x", "eu", 1015.0)] == ["a"]
    assert t.get("b", 1015.0) is None
    assert [n.node_id for n in t.expire(1015.0)] == ["b"]
    assert t.expire(1015.0) == []
    with pytest.raises(LeaseGone, match="no lease"):
        t.renew("b", 2, 1016.0)


def test_a_renewal_after_expiry_is_refused_even_before_the_sweep():
    t = table()
    a = t.join("a", "rollout", "eu", "h:1", now=1000.0)
    with pytest.raises(LeaseGone, match="expired"):
        t.renew("a", a.epoch, 1015.0)
    assert t.live(1015.0) == []


def test_epoch_fencing_refuses_messages_from_an_old_life():
    t = table()
    old = t.join("a", "rollout", "eu", "h:1", now=1000.0)
    t.expire(1020.0)
    new = t.join("a", "rollout", "eu", "h:1", now=1020.0)
    assert new.epoch > old.epoch
    with pytest.raises(LeaseGone, match="stale"):
        t.renew("a", old.epoch, 1021.0)
    with pytest.raises(LeaseGone, match="stale"):
        t.leave("a", old.epoch, 1021.0)
    assert t.get("a", 1021.0).epoch == new.epoch  # the old life's leave changed nothing
    # Re-joining while the lease is still live (a restarted node) also starts a new life.
    newer = t.join("a", "rollout", "eu", "h:1", now=1022.0)
    assert newer.epoch > new.epoch
    with pytest.raises(LeaseGone):
        t.renew("a", new.epoch, 1023.0)


def test_leave_ends_the_lease_now():
    t = table()
    a = t.join("a", "rollout", "eu", "h:1", now=1000.0)
    t.leave("a", a.epoch, 1001.0)
    assert t.live(1001.0) == []
    with pytest.raises(LeaseGone):
        t.leave("a", a.epoch, 1001.0)


def test_peer_lists_are_region_aware_and_limited():
    t = table()
    for i in range(6):
        t.join(f"eu{i}", "rollout", "eu", f"h:{i}", now=1000.0)
        t.join(f"us{i}", "rollout", "us", f"g:{i}", now=1000.0)
    peers = t.peers("eu0", "eu", 1001.0, rng=random.Random(1))
    assert [p.region for p in peers] == ["eu"] * 5 + ["us"] * 6
    assert "eu0" not in {p.node_id for p in peers}
    few = t.peers("eu0", "eu", 1001.0, limit=7, rng=random.Random(1))
    assert len(few) == 7 and [p.region for p in few] == ["eu"] * 5 + ["us"] * 2
    # Shuffled within a region, so simultaneous askers spread their load.
    orders = {tuple(p.node_id for p in t.peers("x", "us", 1001.0, rng=random.Random(s))[:6]) for s in range(10)}
    assert len(orders) > 1


def test_peer_lists_of_a_large_swarm_are_uniform_samples_and_cheap():
    """Every renewal asks for a peer list: with 10,000 nodes it samples instead of sorting the
    table, and stays region-first with a quarter from other regions, live-only and spread over the
    whole swarm; the trainer is on every list."""
    import collections
    import time

    t = table()
    for i in range(10_000):
        t.join(f"n{i}", "rollout", "eu" if i < 300 else f"r{i % 7}", f"h:{i}", now=1000.0 if i % 10 else 990.0)
    now = 1010.0  # one node in ten joined at 990 and has expired by now
    rng = random.Random(3)
    t0 = time.perf_counter()
    lists = [t.peers("n1", "eu", now, limit=32, rng=rng) for _ in range(2000)]
    per_call = (time.perf_counter() - t0) / 2000
    assert per_call < 0.002, f"{per_call * 1e3:.2f} ms per peer list"
    seen, far = collections.Counter(), collections.Counter()
    for peers in lists:
        assert len(peers) == 32 and len({p.node_id for p in peers}) == 32
        assert all(p.node_id != "n1" and p.expires_at > now for p in peers)
        # A region bigger than a list still leaves a quarter of it to the others: else its nodes
        # know nobody outside it and nothing reaches it.
        assert [p.region for p in peers] == ["eu"] * 24 + [p.region for p in peers[24:]]
        assert all(p.region != "eu" for p in peers[24:])
        seen.update(p.node_id for p in peers[:24])
        far.update(p.region for p in peers[24:])
    live_eu = {f"n{i}" for i in range(300) if i % 10 and i != 1}
    assert set(seen) == live_eu  # every live peer of the region turns up, no dead one
    # The region is larger than a list shows of it: its 8 gateways head every list (the same for
    # every node of the region, live rollouts only), the rest are uniform samples.
    gateways = [n.node_id for n in t.gateways("eu", now)]
    assert len(gateways) == GATEWAYS and set(gateways) <= live_eu | {"n1"}
    assert all([p.node_id for p in peers[:len(gateways)]] == [g for g in gateways if g != "n1"] for peers in lists)
    rest = [c for i, c in seen.items() if i not in gateways]
    assert max(rest) < 3 * min(rest)
    assert set(far) == {f"r{j}" for j in range(7)} and max(far.values()) < 1.5 * min(far.values())
    # The trainer heads every list, whatever its region.
    t.join("trainer", "trainer", "r3", "h:t", now=1009.0)
    for _ in range(20):
        peers = t.peers("n1", "eu", now, limit=32, rng=rng)
        assert peers[0].node_id == "trainer" and len(peers) == 32
        assert [p.region for p in peers[1:25]] == ["eu"] * 24
    assert t.peers("trainer", "r3", now, rng=rng)[0].node_id != "trainer"
    t.leave("trainer", t.get("trainer", now).epoch, now)
    assert all(p.node_id != "trainer" for p in t.peers("n1", "eu", now, limit=32, rng=rng))
    # A node of a small region gets its region, then the others sampled across all regions.
    t.join("lone", "rollout", "tiny", "h:lone", now=1009.0)
    t.join("mate", "rollout", "tiny", "h:mate", now=1009.0)
    peers = t.peers("lone", "tiny", now, rng=rng)
    assert [p.node_id for p in peers[:1]] == ["mate"] and len(peers) == 32
    assert len({p.region for p in peers[1:]}) > 3 and all(p.region != "tiny" for p in peers[1:])
    # Re-joining in another region moves the node between the region lists; leaving drops it.
    t.join("mate", "rollout", "eu", "h:mate", now=1009.5)
    assert t.peers("lone", "tiny", now, limit=1, rng=rng)[0].region != "tiny"
    t.leave("lone", t.get("lone", now).epoch, now)
    assert all(p.node_id != "lone" for p in t.peers("n2", "tiny", now, limit=10_000, rng=rng))


def test_bad_join_input_is_refused():
    t = table()
    with pytest.raises(InputError, match="role"):
        t.join("a", "boss", "eu", "h:1", now=1000.0)
    with pytest.raises(InputError, match="region"):
        t.join("a", "rollout", "eu west", "h:1", now=1000.0)
    with pytest.raises(InputError, match="node id"):
        t.join("../a", "rollout", "eu", "h:1", now=1000.0)
    with pytest.raises(InputError, match="address"):
        t.join("a", "rollout", "eu", "", now=1000.0)
    a = t.join("a", "rollout", "eu", "h:1", now=1000.0)
    with pytest.raises(InputError, match="versions"):
        t.renew("a", a.epoch, 1001.0, versions=list(range(5000)))
    with pytest.raises(InputError, match="TTL"):
        LeaseTable(0, now=0)


def test_states_and_the_snapshot():
    t = table()
    a = t.join("a", "rollout", "eu", "h:1", now=1000.0)
    t.join("b", "relay", "us", "h:2", now=1000.0)
    t.renew("a", a.epoch, 1004.0, versions=[7], engine_version=6, error="x" * 500)
    t.set_latest_version(5)
    snap = t.snapshot(1005.0, tracker={"node_id": "trainer"})
    assert snap["latest_version"] == 7  # a node already reports 7
    assert snap["lease_ttl"] == TTL and snap["tracker"] == {"node_id": "trainer"}
    rows = {n["node_id"]: n for n in snap["nodes"]}
    assert rows["a"]["state"] == "up" and rows["a"]["lease_expires_in"] == 14.0
    assert rows["a"]["versions"] == [7] and rows["a"]["engine_version"] == 6
    assert rows["a"]["error"] == "x" * 300 and rows["b"]["error"] is None  # reported, and bounded
    assert rows["b"]["state"] == "joining"
    # A node that missed a renewal and a half is stale, before it expires.
    assert node_state(t.get("b", 1008.0), 1008.0, TTL) == "stale"
    assert renew_interval(TTL) == 5.0
    for key in ("node_id", "role", "region", "address", "lease_expires_in", "versions", "engine_version",
                "bytes_up", "bytes_down"):
        assert key in rows["b"]


def test_restart_from_the_persisted_state(tmp_path):
    db = tmp_path / "tracker.db"
    store = SqliteLeaseStore(db)
    t = table(store=store)
    a = t.join("a", "rollout", "eu", "h:1", now=1000.0)
    b = t.join("b", "rollout", "us", "h:2", now=1000.0)
    t.renew("a", a.epoch, 1003.0, versions=[1, 2], engine_version=2, bytes_up=10, bytes_down=20)
    assert store.flush() == 1  # renewals are written together, every second in the daemon
    t.renew("a", a.epoch, 1003.5, versions=[1, 2, 3], engine_version=3)  # not flushed: lost in the crash
    c = t.join("c", "rollout", "us", "h:3", now=1000.0)
    t.leave("c", c.epoch, 1004.0)
    t.set_latest_version(2)

    # The tracker comes back 5 s later: same nodes, same epochs, no re-join.
    t2 = table(now=1009.0, store=SqliteLeaseStore(db))
    assert [n.node_id for n in t2.live(1009.0)] == ["a", "b"]
    ra = t2.get("a", 1009.0)
    assert (ra.epoch, ra.versions, ra.engine_version, ra.bytes_down) == (a.epoch, (1, 2), 2, 20)
    assert t2.latest_version == 2
    t2.renew("a", a.epoch, 1010.0)
    t2.renew("b", b.epoch, 1010.0)
    # Epochs keep growing across restarts: no new life can reuse an old epoch.
    assert t2.join("d", "rollout", "eu", "h:4", now=1010.0).epoch > c.epoch

    # Down longer than a TTL: leases get one TTL of grace from the restart, then expire as usual.
    t3 = table(now=2000.0, store=SqliteLeaseStore(db))
    assert {n.node_id for n in t3.live(2014.9)} == {"a", "b", "d"}
    t3.renew("a", a.epoch, 2005.0)
    assert [n.node_id for n in t3.expire(2015.0)] == ["b", "d"]
    t4 = table(now=2016.0, store=SqliteLeaseStore(db))
    assert [n.node_id for n in t4.live(2016.0)] == ["a"]


def test_every_region_has_heads_and_one_of_more_than_eight_has_them_as_gateways():
    """A region's heads are its 8 top-scored live rollouts (all of a smaller one), the same for every
    asker: other regions push to them, and in a region of more than 8 they are its gateways too, so
    that a pushed chunk lands on the node the region designates to bring it across."""
    now = 1000.0
    t = LeaseTable(15.0, now=now)
    t.join("trainer", "trainer", "eu", "h:t", now=now)
    for i in range(12):
        t.join(f"e{i}", "rollout", "eu", f"h:e{i}", now=now)
    for i in range(5):
        t.join(f"u{i}", "rollout", "us", f"h:u{i}", now=now)
    heads = {r: [n.node_id for n in hs] for r, hs in t.all_heads(now).items()}
    assert sorted(heads["us"]) == [f"u{i}" for i in range(5)] and "trainer" not in heads["eu"]
    assert len(heads["eu"]) == GATEWAYS and len(set(heads["eu"])) == GATEWAYS
    assert [n.node_id for n in t.gateways("eu", now)] == heads["eu"] and t.gateways("us", now) == []
    gone = heads["eu"][0]
    t.leave(gone, t.get(gone, now).epoch, now)
    after = [n.node_id for n in t.heads("eu", now)]
    assert gone not in after and after[:GATEWAYS - 1] == heads["eu"][1:]  # the next in rank steps in
