"""``sparrowd bench sim``: the real picker, choker, super-seeding and lease table on a virtual clock."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sparrowd.bench.sim import MB, Config, Sim, simulate

pytestmark = pytest.mark.slow


def test_sixteen_nodes_get_every_version_near_the_bound_and_the_same_run_twice():
    cfg = Config(nodes=16, regions=4, patch=6 * MB, versions=2, seed=1)
    rows = simulate(cfg)
    assert [r["version"] for r in rows] == [1, 2]
    for r in rows:
        assert r["all_done"] and r["nodes"] == 16 and r["chunks"] == 16
        assert r["seconds"] >= cfg.bound  # nothing beats the trainer's uplink
        assert r["time_over_bound"] < 2.0, r
        assert r["trainer_upload_over_patch"] <= 1.1, r  # super-seeding: one copy, then the peers trade
        # Each region takes each chunk in once, about (first copies start in the trainer's region).
        assert 1.0 - 1e-9 <= r["cross_region_over_r_minus_1"] <= 1.3, r
    assert simulate(cfg) == rows  # a seed fixes the run


def test_star_is_what_the_swarm_beats():
    """The same link model with one node per region-free swarm: a single node can only be as fast as
    the trainer's uplink (the bound); sixteen get their copies far faster than sixteen sent by the trainer."""
    one = simulate(Config(nodes=1, regions=1, patch=2 * MB, versions=1))[0]
    assert one["all_done"] and 1.0 <= one["time_over_bound"] < 1.3
    many = simulate(Config(nodes=16, regions=4, patch=2 * MB, versions=1))[0]
    star = 16 * 2 * MB / Config().trainer_rate
    assert many["seconds"] < star / 4


def test_regions_larger_than_a_peer_list_are_reached_and_cross_once():
    """200 nodes in 2 regions: each region is larger than a peer list shows of it. Lists filled
    region-first left the trainer's other region with nobody to fetch from (nothing arrived); with
    gateways named by the tracker each chunk crosses about once."""
    sim = Sim(Config(nodes=200, regions=2, patch=1 * MB, versions=1, seed=2))
    assert all(len(n.gateways) == 8 for n in sim.nodes[1:])
    r = sim.run()[0]
    assert r["all_done"], r
    assert r["cross_region_over_r_minus_1"] < 1.26, r  # at most one of the 4 chunks crosses twice
    assert r["trainer_upload_over_patch"] <= 1.1, r


def test_nodes_leaving_mid_version_do_not_stop_the_rest():
    r = simulate(Config(nodes=40, regions=4, patch=6 * MB, versions=1, churn=0.1, churn_at=0.5, seed=3))[0]
    assert r["left"] == 4 and r["nodes"] == 36
    assert r["all_done"], r
    assert r["time_over_bound"] < 4.0, r


def test_nodes_leave_later_than_a_lease_lasts():
    """Simulated nodes renew their leases as the daemons do, so churn past the lease TTL (15 s; this
    version takes 16 s at the trainer's uplink) finds each leaver's lease live (it once found none, and
    the run stopped with an AttributeError)."""
    r = simulate(Config(nodes=4, regions=1, patch=64 * MB, versions=1, churn=0.5, churn_at=0.95))[0]
    assert r["left"] == 2 and r["nodes"] == 2 and r["all_done"], r
    assert r["seconds"] > 15, r


def _cli(*args, tmp_path):
    return subprocess.run([sys.executable, "-m", "sparrowd.cli.main", "bench", "sim", *args],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)


@pytest.mark.parametrize("bad", [["--nodes", "x"], ["--nodes", "0"], ["--churn", "1.5"], ["--trainer-rate", "0"],
                                 ["--push", "2"], ["--push", "a,b"], ["--push", "2,-1"], ["--rtt", "nan"],
                                 ["--rtt", "-1"], ["--patch-mib", "nan"], ["--patch-mib", "1,inf"],
                                 ["--plot", "."], ["--plot", ""], ["--plot", "nowhere/sim.svg"],
                                 ["--rate-burst", "-0.1"], ["--rate-burst", "inf"]])
def test_cli_refuses_bad_input_in_one_line(tmp_path, bad):
    p = _cli(*bad, tmp_path=tmp_path)
    assert p.returncode != 0
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr and ".tmp" not in p.stderr
    assert not p.stdout and not any(tmp_path.iterdir())  # refused before the run: nothing printed or written


def test_cli_prints_writes_json_and_a_plot(tmp_path):
    out, svg = tmp_path / "sim.json", tmp_path / "sim.svg"
    p = _cli("--nodes", "4,8", "--regions", "2", "--patch-mib", "1", "--versions", "1", "--json", str(out),
             "--plot", str(svg), tmp_path=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "x the bound" in p.stdout and "star" in p.stdout
    runs = json.loads(out.read_text())["runs"]
    assert [r["rollouts"] for r in runs] == [4, 8] and all(r["all_done"] for r in runs)
    assert svg.read_text().startswith("<svg") and svg.read_text().count("<circle") == 2


def test_the_trace_accounts_for_every_request_and_every_copy():
    """``--trace``'s events, one run: every node stores each chunk once, from a peer it asked or that
    pushed it; every request that ends was asked for (or pushed) first, by that node of that peer, and
    ends after that; a refusal or a stored copy from another region comes at least a round trip after
    the asking (half of one after a push)."""
    cfg = Config(nodes=8, regions=4, patch=1 * MB, versions=2, seed=4, trace=True)
    sim = Sim(cfg)
    rows = sim.run()
    events = sim.trace
    assert all(r["all_done"] for r in rows)
    starts = {(e["version"], e["node"], e["peer"], e["chunk"], e["asked"]): e["event"] for e in events
              if e["event"] in ("asked", "pushed")}
    stored = [e for e in events if e["event"] == "stored"]
    assert sorted((e["version"], e["node"], e["chunk"]) for e in stored) == sorted(
        (v, n.id, c) for v in (1, 2) for n in sim.nodes[1:] for c in range(rows[0]["chunks"]))
    for e in events:
        if e["event"] not in ("asked", "pushed"):
            start = starts[(e["version"], e["node"], e["peer"], e["chunk"], e["asked"])]
            assert e["t"] >= e["asked"], e
            if e["event"] in ("stored", "refused") and e["region"] != e["peer_region"]:
                # a request waits a round trip for its answer; a push, sent unasked, one way
                assert e["t"] - e["asked"] >= (cfg.rtt if start == "asked" else cfg.rtt / 2) - 1e-9, e
    for v in (1, 2):  # times count from each version's start, in the order things happened
        ts = [e["t"] for e in events if e["version"] == v]
        assert ts == sorted(ts) and ts[0] >= 0
        assert max(e["t"] for e in stored if e["version"] == v) == pytest.approx(rows[v - 1]["seconds"], abs=0.011)
    assert Sim(Config(nodes=8, regions=4, patch=1 * MB, versions=1, seed=4)).trace is None


def test_cli_writes_the_trace_as_json_lines(tmp_path):
    out = tmp_path / "trace.jsonl"
    p = _cli("--nodes", "6", "--regions", "3", "--patch-mib", "0.25", "--versions", "1", "--trace", str(out),
             tmp_path=tmp_path)
    assert p.returncode == 0, p.stderr
    events = [json.loads(line) for line in out.read_text().splitlines()]
    assert f"{len(events)} request events written" in p.stdout
    assert sum(e["event"] == "stored" for e in events) == 6  # one chunk to each node
    assert {e["rollouts"] for e in events} == {6} and {e["patch_mib"] for e in events} == {0.25}
    assert not list(tmp_path.glob("*.tmp*"))  # written whole, by a rename


# ---------------------------------------------------------------- cut-through relaying


class _Watched(Sim):
    """A run that checks cut-through as it goes: no stream from a partial gets ahead of what its feed
    has delivered, no partial is fed (through others) by a stream it serves, and a chunk streamed from
    a partial is stored only after its server stored it, one one-way delay earlier at least."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.stored: dict[tuple[str, int], float] = {}
        self.streamed = 0  # chunks stored from a partial
        self.depth = 0  # the longest chain of partials a stream was served through
        self.circles = 0
        self.cut_by_leave = 0  # partials aborted because their feeding request's server left

    def request_arrives(self, r):
        super().request_arrives(r)
        f, d = r.feed, 0
        while f is not None:
            d += 1
            if f is r or d > len(self.nodes):
                self.circles += 1
                break
            f = f.feed
        self.depth = max(self.depth, d)

    def step_flows(self, dt):
        fed = [(r, self.s_got[r.feed.serial]) for r in self.flows if r.feed is not None and
               not self.s_whole[r.feed.serial]]
        super().step_flows(dt)
        for r, feed_got in fed:
            assert self.s_got[r.serial] <= feed_got + 1e-6, "a stream got ahead of its feed"
            last = r.size - (r.size % self.block or self.block)
            assert self.s_got[r.serial] <= last + 1e-6, "last block before whole"

    def arrives(self, r):
        y, x = r.dst, r.src
        if r.version == self.version and y.alive and r.chunk not in y.have:
            if r.feed is not None:
                self.streamed += 1
                assert self.stored[x.id, r.chunk] <= self.now - self.owd(x, y) + 1e-9, (x.id, y.id, r.chunk)
            self.stored[y.id, r.chunk] = self.now
        super().arrives(r)

    def abort(self, f):
        if not f.src.alive and any(not r.cancelled for r in f.readers):
            self.cut_by_leave += 1
        super().abort(f)

    def publish(self):
        self.stored = {(self.trainer.id, c): -1.0 for c in range(self.chunks)}
        super().publish()


@pytest.mark.parametrize("regions", [1, 4])
def test_cut_through_moves_a_one_chunk_patch_faster_than_store_and_forward(regions):
    """A patch of one chunk is the case store-and-forward is worst at: a whole chunk's time at every
    hop. Streamed on as its blocks arrive it reaches all 16 nodes in well under that."""
    kw = dict(nodes=16, regions=regions, patch=MB, chunk=MB, versions=2, seed=1)
    streamed, stored = simulate(Config(**kw)), simulate(Config(cut_through=False, **kw))
    for a, b in zip(streamed, stored):
        assert a["all_done"] and b["all_done"]
        assert a["seconds"] < 0.85 * b["seconds"], (a, b)
        assert a["time_over_bound"] < 4.0, a  # (2.9 to 3.6 measured; store-and-forward 5.1 to 6.5)
        assert a["cut_through_over_patch"] > 10 and b["cut_through_over_patch"] == 0


def test_streams_from_partials_never_get_ahead_of_their_feed():
    sim = _Watched(Config(nodes=16, regions=4, patch=3 * MB, versions=1, seed=2))
    r = sim.run()[0]
    assert r["all_done"], r
    assert sim.streamed > 16 and sim.depth >= 2  # chunks went down chains of partials
    assert sim.circles == 0


class _LeavesMidChunk(_Watched):
    """The first rollout node found feeding a partial that serves a stream leaves, mid-chunk."""

    gone = None
    reader = None

    def step_flows(self, dt):
        super().step_flows(dt)
        if self.gone is not None:
            return
        for r in self.flows:
            f = r.feed
            if f is not None and not f.src.trainer and f in self.flows and \
                    self.block <= self.s_got[f.serial] < f.size - self.block:
                self.gone, self.reader = f.src, r
                self.leave([f.src])
                return


def test_a_partial_whose_feed_left_is_cut_and_everyone_still_completes():
    sim = _LeavesMidChunk(Config(nodes=16, regions=4, patch=4 * MB, chunk=512 << 10, versions=1, seed=1))
    r = sim.run()[0]
    assert sim.gone is not None and r["left"] == 1
    assert sim.cut_by_leave >= 1 and r["streams_cut"] >= 1 and sim.reader.cut, r
    assert r["all_done"] and r["nodes"] == 15, r
    assert sim.reader.dst.done_at is not None
    assert sim.reader.dst.known[sim.reader.src.id].strikes == 0  # the stream's server was not at fault


def test_partials_served_from_their_start_feed_each_other_in_circles():
    """Why a partial is served (and shown) only once a block of it has checked out: otherwise a
    region's nodes stream a chunk from each other, in a circle, with nothing flowing in."""
    # Pulling only: a push takes the place of a request with no byte back, which breaks such circles too.
    # The seed is one of the few that circle, and moves as the swarm's decisions do: seed 15 of 0-119
    # since a peer's chunk stored and not yet heard of shows as fetching (5.6x the bound, against
    # 1.19x), seed 43 since the trainer gives chunk 0 first, seed 34 since small chunks are hashed in
    # 4 KiB blocks, seed 5 since a node's WAN limit is shared as its token bucket shares it, seed 37
    # before, seeds 13 and 23 before relays were held to their uplink, and seeds 1 and 10 of 1-12
    # before first copies started in the trainer's region.
    cfg = dict(nodes=16, regions=4, patch=6 * MB, versions=1, seed=15, push=(0, 0))
    early = _Watched(Config(relay_after_block=False, **cfg))
    slow = early.run(horizon=8)[0]
    assert early.circles > 0
    later = _Watched(Config(**cfg))
    fast = later.run(horizon=8)[0]
    assert fast["all_done"] and later.circles == 0
    assert not slow["all_done"] or slow["time_over_bound"] > 3 * fast["time_over_bound"], (slow, fast)


def test_a_relays_neighbours_do_not_hold_up_the_crossers_of_other_regions():
    """A relay's uploads to its own region and to other regions are separate lanes (the daemon's
    ``_lane``): with both same-region slots busy, a crosser from another region is served at once,
    and each lane admits while at most ``QUEUE_ADMIT`` requests wait in it."""
    from sparrowd.bench.sim import Req
    from sparrowd.swarm.policy import QUEUE_ADMIT, RELAY_CONCURRENT

    sim = Sim(Config(nodes=32, regions=4, patch=2 * MB, versions=1, seed=0))
    sim.publish()
    x = sim.nodes[1]
    x.have = {0}
    near = [k.node for k in x.known.values() if k.node.region == x.region and not k.node.trainer]
    far = [k.node for k in x.known.values() if k.node.region != x.region and not k.node.trainer]
    assert len(near) >= RELAY_CONCURRENT + QUEUE_ADMIT + 1 and len(far) >= RELAY_CONCURRENT + QUEUE_ADMIT + 1

    def ask(y):
        r = Req(y, x, 0, sim.version, sim.sizes[0], serial=sim._serial(), readers=[])
        y.fetching.setdefault(0, {})[x.id] = r
        y.known[x.id].inflight += 1
        sim.request_arrives(r)
        return r

    for y in near[:RELAY_CONCURRENT + QUEUE_ADMIT]:
        ask(y)
    assert x.active == {False: RELAY_CONCURRENT, True: 0} and len(x.queue[False]) == QUEUE_ADMIT
    assert not sim.may_download(x, near[-1]) and sim.choked_for(x, near[-1])  # its own region: full
    assert sim.may_download(x, far[0]) and not sim.choked_for(x, far[0])  # other regions: free
    crossing = [ask(y) for y in far[:RELAY_CONCURRENT]]
    assert x.active == {False: RELAY_CONCURRENT, True: RELAY_CONCURRENT}
    assert all(r in sim.flows for r in crossing)  # sent now, not after the neighbours' chunks
    for y in far[RELAY_CONCURRENT:RELAY_CONCURRENT + QUEUE_ADMIT]:
        ask(y)
    assert sim.choked_for(x, far[-1]) and not sim.may_download(x, far[-1])


def test_a_small_patch_crosses_into_each_region_once():
    """A patch of one chunk is in the endgame from its first request. Asked of a second peer at once,
    the chunk crossed into every region twice (2.0x (R-1) x patch); now the second request waits for
    the first to be out ENDGAME_AFTER, and each region takes it once."""
    for r in simulate(Config(nodes=16, regions=8, patch=MB // 4, versions=2, seed=0)):
        assert r["all_done"], r
        assert r["cross_region_over_r_minus_1"] <= 1.15, r
        assert r["wasted_over_patch"] < 1.0, r


def test_push_takes_round_trips_out_of_a_one_chunk_patch():
    """``--push`` (the daemons' default 2,2): relays that send a chunk unasked as soon as they can serve
    it. A one-chunk patch to 16 nodes in 8 regions, whose pull costs each hop a round trip and a half
    before its first block, arrives much sooner, with the trainer still sending one copy and every
    region taking it about once; every pushed stream is one the traced node did not ask for, and
    each node stores the chunk once (a push is not sent to a node already fetching it)."""
    cfg = dict(nodes=16, regions=8, patch=MB // 4, versions=2, seed=0)
    pulled = simulate(Config(**cfg, push=(0, 0)))
    sim = Sim(Config(**cfg, push=(2, 2), trace=True))
    pushed = sim.run()
    for a, b in zip(pulled, pushed):
        assert b["all_done"] and b["seconds"] < 0.8 * a["seconds"], (a, b)
        assert b["trainer_upload_over_patch"] <= 1.1 and b["wasted_over_patch"] == 0, b
        assert b["cross_region_over_r_minus_1"] <= 1.15, b
    events = sim.trace
    starts = {(e["version"], e["node"], e["peer"], e["asked"]): e["event"] for e in events
              if e["event"] in ("asked", "pushed")}
    assert "pushed" in starts.values() and "asked" in starts.values()
    stored = [e for e in events if e["event"] == "stored"]
    assert len(stored) == len({(e["version"], e["node"]) for e in stored}) == 2 * 16
    assert any(starts[(e["version"], e["node"], e["peer"], e["asked"])] == "pushed" for e in stored)
    assert simulate(Config(**cfg, push=(2, 2))) == pushed  # still one run a seed


def test_a_push_takes_the_place_of_a_request_with_no_byte_back():
    """As on the daemons (``swarm.push.unstarted``, which both call): nodes that asked the trainer's
    first holder, queued behind its pushes, take a push from a neighbour instead of waiting their
    turn there."""

    class Waiting(Sim):
        def unstarted(self, z, c, pusher):
            return None

    # (In 16 KiB blocks: in the trainer's 4 KiB ones, the first holder's queue is short enough that
    # the two are alike, 0.118 s.)
    cfg = Config(nodes=100, regions=8, patch=MB // 4, versions=1, seed=0, block=16 << 10)
    waited, replaced = Waiting(cfg).run()[0], Sim(cfg).run()[0]
    assert waited["all_done"] and replaced["all_done"]
    assert replaced["seconds"] < 0.9 * waited["seconds"], (waited["seconds"], replaced["seconds"])
    assert replaced["cross_region_over_r_minus_1"] <= 1.0 + 1e-9 and replaced["trainer_upload_over_patch"] <= 1.0 + 1e-9


class _FanWatched(Sim):
    """Counts, every step, the streams each relay serves of a chunk still arriving to it."""

    most_over = 0

    def step_flows(self, dt):
        from sparrowd.swarm.push import relay_fanout

        feeds: dict[int, list] = {}
        for r in self.flows:
            if r.feed is not None and r.chunk not in r.src.have and not r.src.trainer:
                feeds.setdefault(id(r.feed), [r.feed, 0])[1] += 1
        for feed, n in feeds.values():
            most = relay_fanout(self.up[feed.dst.idx], feed.declared)
            self.most_over = max(self.most_over, n - (most if most is not None else n))
        super().step_flows(dt)


def test_relays_stream_a_chunk_still_arriving_to_no_more_peers_than_their_uplink_carries():
    """One 256 KiB chunk to 100 nodes in 8 regions, the relays' uplinks twice the trainer's. Streamed
    on to whoever asked or was pushed to, a head that crossed and fed two neighbours sent each a
    third of its uplink, and the heads those fed crossed slower again; held to ``relay_fanout``,
    every hop runs at the rate the chunk leaves the trainer."""
    cfg = dict(nodes=100, regions=8, patch=256 << 10, chunk=256 << 10, versions=1, seed=0)  # one chunk
    held = _FanWatched(Config(**cfg))
    free = _FanWatched(Config(fanout=False, **cfg))
    h, f = held.run()[0], free.run()[0]
    assert h["all_done"] and f["all_done"]
    assert held.most_over == 0 and free.most_over > 0
    assert h["time_over_bound"] < 1.05 and f["time_over_bound"] > 1.1, (h, f)
    assert h["cross_region_over_r_minus_1"] <= 1.01 and h["trainer_upload_over_patch"] <= 1.01, h


def test_the_step_is_under_half_a_blocks_time():
    """A hop costs a block's time; the simulator's step stays under half of it (at most 5 ms)."""
    assert Config(patch=256 << 10).step == 0.001  # 4 KiB blocks, 0.5 ms at 8 MiB/s: the floor
    assert 0.0019 < Config(patch=64 * MB).step < 0.002  # 2 MiB chunks, 32 KiB blocks
    assert 0.003 < Config(patch=64 * MB, block=64 << 10).step < 0.004
    assert Config(patch=256 << 10, node_rate=MB, trainer_rate=MB, block=16 << 10).step == 0.005
    assert Config(patch=256 << 10, dt=0.002).step == 0.002


@pytest.mark.parametrize("rates", ["default", "fast"])
def test_heads_cross_again_once_whole_where_that_beats_a_crossing_from_deeper_in_the_tree(rates):
    """One 256 KiB chunk to 16 nodes in 8 regions, two nodes a region: breadth first, the chunk's region
    tree is three crossings deep. Timed (``region_tree``'s send and hop, as each head computes them), a
    root head crosses a second time once it holds the chunk, and the last region has it a crossing
    sooner. With links 25 times faster (a send is 2.5 ms against a 40 ms one-way delay), more so."""
    fast = dict(trainer_rate=100 * MB, node_rate=200 * MB, wan_rate=100 * MB, link_rate=800 * MB)
    cfg = dict(nodes=16, regions=8, patch=256 << 10, versions=2, seed=0, stripes=False,  # trees, no stripes
               block=16 << 10,  # (in 4 KiB blocks each crossing is shorter: breadth first takes 1.31x)
               **(fast if rates == "fast" else {}))
    flat, timed = simulate(Config(timed_tree=False, **cfg)), simulate(Config(**cfg))
    for a, b in zip(flat, timed):
        assert a["all_done"] and b["all_done"]
        assert b["cross_region_over_r_minus_1"] <= 1.01 and b["trainer_upload_over_patch"] <= 1.01, b
    worst = max(r["time_over_bound"] for r in timed)
    assert max(r["time_over_bound"] for r in flat) > 1.35 and worst < (1.3 if rates == "default" else 1.15), \
        (flat, timed)


def test_two_near_peers_keep_a_quick_trainers_uplink_busy_in_a_swarm_that_chokes():
    """16 nodes in 8 regions over links 25 times faster: 4 MiB leaves the trainer in 40 ms, less than
    a round trip, so its first copies stay in its own region, whose two nodes are given two chunks
    each at a time. With more peers than upload slots the trainer chokes, and it used to count the
    near peers it may serve as none when a near peer asked: told that first copies did not stay
    near, each was given one chunk at a time, and the uplink waited between each chunk and the next
    request (the patch left in 77 ms)."""
    cfg = Config(nodes=16, regions=8, patch=4 * MB, versions=3, seed=0, trainer_rate=100 * MB,
                 node_rate=200 * MB, wan_rate=100 * MB, link_rate=800 * MB)
    for r in simulate(cfg):
        assert r["all_done"] and r["trainer_upload_over_patch"] <= 1.01, r
        assert r["trainer_sent_one_copy_seconds"] < 1.5 * cfg.patch / cfg.trainer_rate, r


@pytest.mark.parametrize("seed", [0, 1])
def test_chunk_0s_tree_is_timed_for_heads_that_have_nothing_else_to_send(seed):
    """Relays plan chunk 0's crossings as a version's first chunk's (``stripe_plan``: a region tree
    timed for idle heads, where that beats stripes), and the trainer gives it first. Given in a
    random turn, over links 25 times faster (16 nodes in 8 regions, 2 MiB, two nodes a region), it
    crossed in a tree behind the stripes of the chunks before it: up to 1.46x the bound."""
    cfg = Config(nodes=16, regions=8, patch=2 * MB, versions=3, seed=seed, trainer_rate=100 * MB,
                 node_rate=200 * MB, wan_rate=100 * MB, link_rate=800 * MB)
    for r in simulate(cfg):
        assert r["all_done"] and r["cross_region_over_r_minus_1"] <= 1.01, r
        assert r["time_over_bound"] < 1.2, r


@pytest.mark.parametrize("seed", [0, 1])
def test_no_node_fetches_across_what_a_region_mate_already_holds(seed):
    """A node that waits on a region-mate's claim (it fetches the chunk) sees the claim until it hears
    that the region-mate holds it: a daemon's have and fetching maps come in one exchange reply. The
    simulator showed a peer's fetching map at once and its have map half a local round trip later,
    and in that window the waiting node took the chunk for nobody's and fetched it across (16 nodes
    in 8 regions over links 25 times faster, 8 MiB: 2 to 4 such fetches a run, each a round trip)."""
    cfg = Config(nodes=16, regions=8, patch=8 * MB, versions=3, seed=seed, trainer_rate=100 * MB,
                 node_rate=200 * MB, wan_rate=100 * MB, link_rate=800 * MB, trace=True)
    sim = Sim(cfg)
    assert all(r["all_done"] for r in sim.run())
    held: dict[tuple, float] = {}  # (version, region, chunk, node) -> when that rollout stored it
    across = []
    for e in sim.trace:
        if e["event"] == "stored":
            held.setdefault((e["version"], e["region"], e["chunk"], e["node"]), e["t"])
        elif e["event"] == "asked" and e["peer"] != "trainer" and e["peer_region"] != e["region"]:
            if any(k[:3] == (e["version"], e["region"], e["chunk"]) and k[3] != e["node"] and t <= e["t"]
                   for k, t in held.items()):
                across.append(e)
    assert not across, across


@pytest.mark.parametrize("patch", [256 << 10, 2 * MB])
def test_a_chunk_crosses_into_regions_of_one_node_in_stripes_near_the_bound(patch):
    """8 nodes in 8 regions, a node a region: relayed whole, each chunk crosses from region to region
    (three crossings deep, each a chunk's time or a hop behind the last); in stripes every region is
    two crossings from the first holder and takes each block once (``swarm.push.stripe_plan``)."""
    cfg = dict(nodes=8, regions=8, patch=patch, versions=2, seed=0)
    trees, stripes = simulate(Config(stripes=False, **cfg)), simulate(Config(**cfg))
    for a, b in zip(trees, stripes):
        assert a["all_done"] and b["all_done"]
        assert b["time_over_bound"] < 1.3 and a["time_over_bound"] > b["time_over_bound"] + 0.15, (a, b)
        assert b["cross_region_over_r_minus_1"] <= 1.1 and b["trainer_upload_over_patch"] <= 1.01, b


def test_a_long_simulation_says_how_far_it_has_come(monkeypatch):
    """``tick`` reports, as a run goes, the version, the simulated time into it and how many of the
    live nodes hold it (``bench sim`` printed nothing for the 2.6 minutes of its 1,000-node run)."""
    import sparrowd.bench.sim.core as sim_core

    monkeypatch.setattr(sim_core, "TICK_EVERY", 0.0)
    ticks, rows = [], []
    Sim(Config(nodes=8, regions=2, patch=1 * MB, versions=2, seed=0)).run(
        progress=rows.append, tick=lambda *a: ticks.append(a))
    assert [r["version"] for r in rows] == [1, 2]
    for version in (1, 2):
        mine = [t for t in ticks if t[0] == version]
        assert mine and all(0 <= holding <= live == 8 for _, _, holding, live in mine)
        assert [t[1] for t in mine] == sorted(t[1] for t in mine)  # simulated time only goes on
        assert mine[0][2] < 8 and mine[-1][1] <= rows[version - 1]["seconds"] + 0.01


@pytest.mark.parametrize("seed", [0, 2])
def test_a_swarm_of_more_than_16_rollouts_is_at_the_bound_sooner_in_the_publishers_finer_chunks(seed):
    """2 MiB to 100 nodes in 8 regions: the Publisher cuts 16 chunks of 128 KiB for a swarm this large
    (``auto_chunk_size``), against 8 of 256 KiB for a small one. The last chunk off the trainer still
    spreads through a region of a dozen nodes, each hop in time proportional to the chunk."""
    cfg = dict(nodes=100, regions=8, patch=2 * MB, versions=1, seed=seed)
    assert Config(**cfg).chunk_size == 128 << 10
    fine, coarse = simulate(Config(**cfg))[0], simulate(Config(chunk=256 << 10, **cfg))[0]
    assert fine["all_done"] and coarse["all_done"]
    assert fine["time_over_bound"] < min(1.15, coarse["time_over_bound"] - 0.03), (fine, coarse)
    assert fine["cross_region_over_r_minus_1"] <= 1.01 and fine["trainer_upload_over_patch"] <= 1.01, fine


@pytest.mark.parametrize("nodes", [8, 100])
def test_a_patch_of_a_few_round_trips_is_at_the_bound_sooner_as_one_chunk(nodes):
    """0.5 MiB, which the trainer sends in 1.6 round trips: whole (``auto_chunk_size``) it crosses in
    stripes from its first block; in 256 or 128 KiB chunks they leave the trainer side by side, each
    at a fraction of its rate, and the later ones wait for relays busy with the first."""
    cfg = dict(nodes=nodes, regions=8, patch=MB // 2, versions=2, seed=0)
    assert Config(**cfg).chunk_size >= MB // 2
    cut = 256 << 10 if nodes <= 16 else 128 << 10  # as the Publisher cut it before
    whole, parts = simulate(Config(**cfg))[1], simulate(Config(chunk=cut, **cfg))[1]
    assert whole["all_done"] and parts["all_done"]
    assert whole["time_over_bound"] < min(1.2, parts["time_over_bound"] - 0.05), (whole, parts)
    assert whole["cross_region_over_r_minus_1"] <= 1.01 and whole["trainer_upload_over_patch"] <= 1.01, whole


def test_uplinks_that_burst_send_a_small_patch_sooner_than_the_fluid_bound():
    """``burst``: each limit's token bucket, as the daemons' (``--rate-burst``), lets a tenth of a
    second's worth go at once after a quiet spell: a patch of about that size leaves the trainer
    at once, so the swarm beats the fluid bound (the daemons read 0.63-0.73x for 0.5 MiB to 8
    rollouts in 8 regions); a large patch is sent at the steady rate but for its first tenth of a
    second. No burst is the fluid model, figure for figure."""
    small = dict(nodes=8, regions=8, patch=MB // 2, versions=2, seed=0)
    fluid, none, burst = (simulate(Config(**small, **kw))[1] for kw in ({}, {"burst": 0.0}, {"burst": 0.1}))
    assert fluid == none
    assert burst["all_done"] and burst["time_over_bound"] < min(0.8, fluid["time_over_bound"] - 0.3), (burst, fluid)
    assert burst["trainer_upload_over_patch"] <= 1.01 and burst["cross_region_over_r_minus_1"] <= 1.01, burst
    large = dict(nodes=8, regions=4, patch=6 * MB, versions=1, seed=0)
    fluid, burst = (simulate(Config(**large, **kw))[0] for kw in ({}, {"burst": 0.1}))
    assert 0.85 < burst["time_over_bound"] < fluid["time_over_bound"], (burst, fluid)
