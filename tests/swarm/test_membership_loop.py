"""The membership loop against an in-process tracker with a fake failure switch: no sockets."""

import asyncio
import statistics
import time

import msgpack
import pytest

from sparrowd.daemon.membership import LocalTrackerClient, Membership, TrackerUnavailable, Unauthorized
from sparrowd.daemon.tracker import TrackerService
from sparrowd.swarm.leases import LeaseTable
from tests import members
from tests.members import new_key

TTL = 0.6


class FlakyClient(LocalTrackerClient):
    """The real tracker service behind a switch that makes every call fail."""

    def __init__(self, service, calls):
        super().__init__(service)
        self.down = False
        self.calls = calls

    async def _maybe(self, name, msg):
        self.calls.append((name, time.monotonic()))
        if self.down:
            raise TrackerUnavailable("switched off")
        return await getattr(super(), name)(msg)

    async def join(self, msg):
        return await self._maybe("join", msg)

    async def renew(self, msg):
        return await self._maybe("renew", msg)


def me(node_id="a"):
    return {"node_id": node_id, "role": "rollout", "region": "eu", "address": "127.0.0.1:1"}


class Stalls:
    """When the event loop itself did not run (a loaded 2-CPU machine can hold it up a second or
    two): a sleeper of ``tick`` woken over ``slack`` late. A schedule is judged only where the loop
    could keep it."""

    def __init__(self, tick: float = 0.02, slack: float = 0.1):
        self.tick, self.slack, self.spans = tick, slack, []

    async def run(self) -> None:
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(self.tick)
            if (t1 := time.monotonic()) - t0 > self.tick + self.slack:
                self.spans.append((t0, t1))

    def within(self, a: float, b: float) -> bool:
        return any(s < b and e > a for s, e in self.spans)


async def until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@pytest.mark.asyncio
async def test_renews_about_every_third_of_the_ttl_and_rejoins_when_the_lease_is_gone():
    service = TrackerService(LeaseTable(TTL, now=time.time()), tracker_id="t", peer_limit=8)
    calls = []
    m = Membership(FlakyClient(service, calls), me(), new_key(), report=lambda: {"versions": [4], "bytes_up": 10})
    stalls = Stalls()
    watch = asyncio.create_task(stalls.run())
    task = asyncio.create_task(m.run())
    try:
        await asyncio.wait_for(m.joined.wait(), 2)
        first_epoch = m.state.epoch

        def renews():
            return [t for name, t in calls if name == "renew"]

        await until(lambda: len(renews()) >= 13, 30 * TTL, "a dozen renewals")
        times = renews()
        gaps = [(b - a, stalls.within(a, b)) for a, b in zip(times, times[1:])]
        kept = [g for g, stalled in gaps if not stalled]
        # Jittered around a third of the TTL and never early, stalled or not; late only by a hiccup
        # where the loop ran, while the median holds the schedule to 10%.
        assert all(g >= 0.8 * TTL / 3 - 0.01 for g, _ in gaps), gaps
        assert len(kept) >= 6 and all(g <= 1.1 * TTL / 3 + 0.25 for g in kept), gaps
        assert 0.85 * TTL / 3 <= statistics.median(kept) <= 1.1 * TTL / 3, gaps
        assert len({round(g, 3) for g in kept}) > 1  # jitter: not lock-step
        assert service.table.get("a", time.time()).versions == (4,)

        # The tracker forgets the node (say its table was lost): the next renewal re-joins.
        service.table.leave("a", first_epoch, time.time())
        await until(lambda: m.state.epoch is not None and m.state.epoch > first_epoch, 2 * TTL, "a re-join")
        assert service.table.get("a", time.time()) is not None

        # The tracker goes away for longer than a lease: the node keeps its epoch and keeps trying...
        kept_epoch = m.state.epoch
        m.client.down = True
        await until(lambda: m.state.tracker_reachable is False, 2 * TTL, "the outage to be noticed")
        await asyncio.sleep(TTL)
        assert m.state.tracker_reachable is False and m.state.epoch == kept_epoch
        m.client.down = False
        # ...and when it is back, the lease that expired there meanwhile is joined again.
        await until(lambda: m.state.tracker_reachable is True, 2 * TTL, "the tracker to be reached again")
        await until(lambda: m.state.epoch > kept_epoch, 2 * TTL, "a re-join after the outage")
    finally:
        task.cancel()
        watch.cancel()
    assert await m.leave() is True
    assert service.table.live(time.time()) == []


@pytest.mark.asyncio
async def test_join_backs_off_while_the_tracker_is_down_and_a_refused_token_is_fatal():
    service = TrackerService(LeaseTable(TTL, now=time.time()), tracker_id="t", peer_limit=8)
    calls = []
    client = FlakyClient(service, calls)
    client.down = True
    m = Membership(client, me(), new_key())
    task = asyncio.create_task(m.run())
    await asyncio.sleep(2.0)
    joins = [t for name, t in calls if name == "join"]
    gaps = [b - a for a, b in zip(joins, joins[1:])]
    assert 3 <= len(joins) <= 7 and gaps[-1] > gaps[0]  # exponential backoff, not a busy loop
    client.down = False
    await asyncio.wait_for(m.joined.wait(), 5)
    task.cancel()

    class Refusing(LocalTrackerClient):
        async def join(self, msg):
            raise Unauthorized("tracker refused the swarm token")

    fatal = []
    m2 = Membership(Refusing(service), me("b"), new_key(), on_fatal=fatal.append)
    await asyncio.wait_for(m2.run(), 2)  # returns instead of retrying forever
    assert len(fatal) == 1 and "refused" in str(fatal[0])


@pytest.mark.asyncio
async def test_a_full_peer_list_is_asked_for_only_when_due_or_wanted():
    """In a large swarm a renewal leaves the 32-peer list out (most of the reply and of the
    tracker's work) unless the list is due, short, or a stranger made the node want a fresh one."""
    service = TrackerService(LeaseTable(60.0, now=time.time()), tracker_id="t", peer_limit=32)
    for i in range(40):
        service.join(members.join(new_key(), f"n{i}", address=f"127.0.0.1:{i + 2}"))
    sent = []

    class Recording(LocalTrackerClient):
        async def renew(self, msg):
            sent.append(msgpack.unpackb(msg["msg"]).get("want_peers"))  # what the sealed message says
            return await super().renew(msg)

    m = Membership(Recording(service), me(), new_key(), report=dict)
    await m._join()
    listed = m.state.peers
    assert len(listed) == 32 and m.peers_changed.is_set()  # the join brought the first list
    m.peers_changed.clear()
    await m._renew()  # the list is full and fresh: not asked for, and kept
    assert sent == [False] and m.state.peers == listed and not m.peers_changed.is_set()
    m.want_peers()  # a stranger asked this node for chunks
    await m._renew()
    assert sent == [False, True] and len(m.state.peers) == 32 and m.state.peers != listed
    await m._renew()
    assert sent[-1] is False
    m._peers_at -= Membership.PEER_REFRESH  # the list has aged
    await m._renew()
    assert sent[-1] is True
    # Without the field the tracker answers as it always did (an older node), and a short list is
    # always refreshed (a small swarm).
    # Stamped on the member's own clock, which a fast run can put ahead of the wall clock.
    assert "peers" in service.renew(members.renew(m.key, "a", m.state.epoch, ts=m._ts()))
    assert "peers" not in service.renew(members.renew(m.key, "a", m.state.epoch, ts=m._ts(), want_peers=False))
    small = TrackerService(LeaseTable(60.0, now=time.time()), tracker_id="t", peer_limit=32)
    m2 = Membership(Recording(small), me("b"), new_key(), report=dict)
    await m2._join()
    await m2._renew()
    assert sent[-1] is True


@pytest.mark.asyncio
async def test_a_region_larger_than_a_peer_list_learns_its_gateways():
    """Every node of a large region gets the same gateways, first on its peer list: they share the
    region's cross-region fetches. A region of 8 or fewer has none (its nodes all cross for it)."""
    service = TrackerService(LeaseTable(60.0, now=time.time()), tracker_id="t", peer_limit=32)
    for i in range(40):
        service.join(members.join(new_key(), f"n{i}", address=f"127.0.0.1:{i + 2}"))
    service.join(members.join(new_key(), "far", region="us", address="127.0.0.1:99"))
    gateways = [n.node_id for n in service.table.gateways("eu", time.time())]
    assert len(gateways) == 8
    for node_id in ("a", "b"):
        m = Membership(LocalTrackerClient(service), me(node_id), new_key(), report=dict)
        await m._join()
        assert m.state.gateways == gateways
        assert [p["node_id"] for p in m.state.peers[:8]] == gateways
        assert "far" in {p["node_id"] for p in m.state.peers}  # a quarter of the list is kept for other regions
    lone = Membership(LocalTrackerClient(service), {**me("c"), "region": "us"}, new_key(), report=dict)
    await lone._join()
    assert lone.state.gateways == []


@pytest.mark.asyncio
async def test_every_node_learns_every_regions_heads_and_gets_them_again_only_when_they_change():
    """The heads (a region's 8 top-scored rollouts, all of a smaller one) are where other regions push
    chunks: every node holds their entries, so that a head admits a push from a head it does not peer
    with. A renewal echoes their tag, and the reply leaves them out until they change."""
    service = TrackerService(LeaseTable(60.0, now=time.time()), tracker_id="t", peer_limit=4)
    for i in range(12):
        service.join(members.join(new_key(), f"e{i}", address=f"127.0.0.1:{i + 2}"))
    for i in range(3):
        service.join(members.join(new_key(), f"u{i}", region="us", address=f"127.0.0.1:{i + 40}"))
    replies = []

    class Recording(LocalTrackerClient):
        async def renew(self, msg):
            replies.append(await super().renew(msg))
            return replies[-1]

    m = Membership(Recording(service), me("a"), new_key(), report=dict)
    await m._join()
    now = time.time()
    want = {r: [n.node_id for n in hs] for r, hs in service.table.all_heads(now).items()}
    assert len(want["eu"]) == 8 and sorted(want["us"]) == ["u0", "u1", "u2"]
    assert {r: [e["node_id"] for e in es] for r, es in m.state.heads.items()} == want
    stranger = next(u for u in want["us"] if u not in {p["node_id"] for p in m.state.peers})  # lists of 3 peers
    assert m.member(stranger)["address"].startswith("127.0.0.1:4")
    await m._renew()
    assert "peers" in replies[-1] and "heads" not in replies[-1]  # the same heads: only their tag
    assert {r: [e["node_id"] for e in es] for r, es in m.state.heads.items()} == want
    service.join(members.join(new_key(), "u3", region="us", address="127.0.0.1:50"))
    await m._renew()
    assert "u3" in [e["node_id"] for e in replies[-1]["heads"]["us"]] and len(m.state.heads["us"]) == 4
    await m._renew()
    assert "heads" not in replies[-1]


def test_the_tracker_tells_of_joins_while_the_swarm_fits_a_peer_list():
    """The trainer's exchange replies carry ``joined_since``: the entries of live nodes that joined
    after the last join a node heard of, and its long polls are woken on a join (``on_join``); in a
    swarm larger than a peer list, nothing (a newcomer is on few lists; it is learned when it asks)."""
    service = TrackerService(LeaseTable(60.0, now=time.time()), tracker_id="t", peer_limit=4)
    woken = []
    service.on_join = lambda: woken.append(True)
    keys = {n: new_key() for n in "abcdefg"}
    epoch_a = service.join(members.join(keys["a"], "a", address="127.0.0.1:2"))["epoch"]
    latest, news = service.joined_since(0, time.time())
    assert latest == epoch_a and [e["node_id"] for e in news] == ["a"] and len(woken) == 1
    epoch_b = service.join(members.join(keys["b"], "b", region="us", address="127.0.0.1:3"))["epoch"]
    latest, news = service.joined_since(epoch_a, time.time())
    assert latest == epoch_b
    assert [(e["node_id"], e["region"], e["key"]) for e in news] == [("b", "us", keys["b"].public)]
    assert service.joined_since(epoch_b, time.time()) == (epoch_b, [])
    service.leave(members.leave(keys["b"], "b", epoch_b))
    assert service.joined_since(epoch_a, time.time())[1] == []  # gone: not news any more
    for n in "cdefg":
        service.join(members.join(keys[n], n, address=f"127.0.0.1:{ord(n)}"))
    assert len(service.table) == 6 and len(woken) == 6  # g's join made it larger than a list (and 4 peers)
    assert service.joined_since(epoch_a, time.time())[1] == []


@pytest.mark.asyncio
async def test_news_of_a_join_makes_the_newcomer_a_peer_and_a_head_at_once():
    service = TrackerService(LeaseTable(60.0, now=time.time()), tracker_id="t", peer_limit=32)
    m = Membership(LocalTrackerClient(service), me("a"), new_key(), report=dict)
    await m._join()
    m.peers_changed.clear()
    key = new_key()
    new = service.join(members.join(key, "n", region="us", address="127.0.0.1:7"))["epoch"]
    _, news = service.joined_since(0, time.time())
    m.learn([*news, "junk", {"node_id": 5}, {**news[0], "node_id": "a"}])  # itself and junk are passed over
    assert m.peers_changed.is_set() and [p["node_id"] for p in m.state.peers] == ["n"]
    assert m.member("n")["address"] == "127.0.0.1:7" and [h["node_id"] for h in m.state.heads["us"]] == ["n"]
    assert m.state.heads_tag is None  # the next renewal brings the tracker's heads whole
    await m._renew()
    assert [h["node_id"] for h in m.state.heads["us"]] == ["n"] and m.state.heads_tag is not None
    # It joined again (a restart on another port: a new epoch): its entry is replaced, not doubled.
    service.join(members.join(key, "n", region="us", address="127.0.0.1:8"))
    m.learn(service.joined_since(new, time.time())[1])
    assert [(p["node_id"], p["address"]) for p in m.state.peers] == [("n", "127.0.0.1:8")]


@pytest.mark.asyncio
async def test_outgoing_connections_leave_from_the_listen_address_kept_alive_and_probed():
    """The connector every swarm and tracker call goes through: connections leave from the address
    the node listens on (a benchmark region's block, a multi-homed box's advertised address), idle
    ones are kept an hour for the next version, and TCP keepalive probes go out while one idles, so
    that a NAT gateway does not drop it unseen."""
    import socket

    import aiohttp
    from aiohttp import web

    from sparrowd.daemon.membership import KEEPALIVE, KEEPALIVE_IDLE, keepalive_socket, outgoing

    seen = []

    async def hello(request):
        seen.append(request.transport.get_extra_info("peername"))
        return web.json_response({})

    app = web.Application()
    app.add_routes([web.get("/", hello)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession(connector=outgoing("127.0.0.7")) as session:
            for _ in range(2):
                async with session.get(f"http://127.0.0.1:{port}/") as r:
                    assert r.status == 200
            assert session.connector._keepalive_timeout == KEEPALIVE
        assert [host for host, _ in seen] == ["127.0.0.7"] * 2
        assert seen[0][1] == seen[1][1]  # the same connection, kept alive
    finally:
        await runner.cleanup()
    sock = keepalive_socket((socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", 0)))
    with sock:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        if hasattr(socket, "TCP_KEEPIDLE"):
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE_IDLE
