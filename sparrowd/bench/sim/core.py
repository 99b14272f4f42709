"""One run: the nodes, the event queue, membership (the real lease table), churn, and the loop that
steps the links and plans the nodes version by version.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections.abc import Callable

import numpy as np

from ...swarm.leases import DEFAULT_TTL, LeaseTable, renew_interval
from ...swarm.policy import CHOKE_EVERY, PLAN_EVERY, SEED_PER_PEER, SEED_SINGLE_FROM
from ...swarm.superseed import SuperSeed
from .. import cross_region_over
from .fetch import Fetching
from .links import Links
from .model import Config, Known, Node, Req
from .push import Pushing
from .serve import Serving

__all__ = ["Sim"]

TICK_EVERY = 10.0  # seconds of wall time between progress lines of a long simulation


class Sim(Serving, Links, Fetching, Pushing):
    """One run: ``run()`` returns a row per version."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.now = 0.0
        self.events: list = []
        self.seq = itertools.count()
        self.dirty = set()
        self.chunk_size = cfg.largest_chunk
        self.chunks = max(1, math.ceil(cfg.patch / cfg.chunk_size))
        self.block = cfg.block_size  # as the trainer's daemon hashes the version's chunks
        self.sizes = [min(self.chunk_size, cfg.patch - i * self.chunk_size) for i in range(self.chunks)]
        self.version = 0
        self.cross_bytes = 0
        self.wasted = 0
        self.relayed = 0.0  # bytes sent by streams served from a partial (cut-through)
        self.cuts = 0  # streams cut because their partial was aborted
        self.shown_fetching = {}  # by node: (when, what shows_fetching said)
        self.trace: list[dict] | None = [] if cfg.trace else None
        self.version_start = 0.0
        r = cfg.regions
        self.trainer = Node(0, "trainer", 0, True, cfg, self.rng)
        self.nodes = [self.trainer] + [Node(i + 1, f"n{i}-r{i % r}", i % r, False, cfg, self.rng)
                                       for i in range(cfg.nodes)]
        self.by_id = {n.id: n for n in self.nodes}
        # Each region's heads, as the tracker names them in a renewal's reply (push_heads): set at
        # join, less the nodes that leave (the pushers learn of replacements only at their renewals).
        self.heads = {}
        self._join()
        # The trainer's peers in its own region (for first_copies_near), less those that leave.
        self.near_trainer = sum(1 for n in self.nodes if not n.trainer and n.region == self.trainer.region)
        self.near_wanting = 0  # of them, those still short of the version (set at each publish)
        # Flows (uploads being sent): parallel arrays of capacity ``len(self.flows)``..., swap-removed.
        self.flows = []
        self.f_src = np.zeros(1024, np.int64)
        self.f_pair = np.zeros(1024, np.int64)
        self.f_cross = np.zeros(1024, bool)
        self.f_left = np.zeros(1024, np.float64)
        self.f_size = np.zeros(1024, np.float64)
        self.f_serial = np.zeros(1024, np.int64)
        self.f_feed = np.zeros(1024, np.int64)  # the serial of its feeding request; -1: served whole
        self.f_last = np.zeros(1024, np.float64)  # the bytes before its last block
        # A stripe served from a partial of the whole chunk (a root head's): its stripe (s, n; n 0 for any
        # other flow) and its feed's size, to count the stripe's blocks in the feed's checked prefix.
        self.f_ss = np.zeros(1024, np.int64)
        self.f_sn = np.zeros(1024, np.int64)
        self.f_fsize = np.zeros(1024, np.float64)
        self.assemblies = set()  # partials of chunks arriving in stripes (``Req.parts``)
        # Per request (by serial, grown as requests are made): bytes its server has sent of it, and
        # whether the partial it feeds is whole (its node got the chunk, by it or another request).
        self.nreq = 0
        self.s_got = np.zeros(1024, np.float64)
        self.s_whole = np.zeros(1024, bool)
        self.cancel_pending = False
        self.up = np.array([n.up for n in self.nodes], np.float64)
        self.wan = np.array([n.wan for n in self.nodes], np.float64)
        # Each limit's token bucket, as the daemons' (``TokenBucket``: a burst of ``burst`` seconds' rate, at
        # least 16 KiB), full when a version starts: what a step may send beyond the steady rate.
        self.burst_up, self.burst_wan = (np.where(np.isfinite(r), np.maximum(16 << 10, r * cfg.burst), 0.0)
                                         if cfg.burst > 0 else np.zeros(len(self.nodes)) for r in (self.up, self.wan))
        self.tok_up, self.tok_wan = self.burst_up.copy(), self.burst_wan.copy()
        self.sent = np.zeros(len(self.nodes), np.float64)  # bytes each node uploaded
        self.pending = set()  # live rollout nodes without the current version

    def _join(self) -> None:
        """Every node joins, then takes a peer list from the table as its first renewal would; a node
        that another lists learns of it when it is first contacted (the daemon's ``ask``), so peer
        relations are symmetric."""
        table = LeaseTable(math.inf, now=0.0)  # its nodes renew (unsimulated): a lease ends when its node leaves
        for n in self.nodes:
            table.join(n.id, "trainer" if n.trainer else "rollout", n.rname, n.id, 0.0)
        rng = random.Random(self.cfg.seed + 1)
        for n in self.nodes:
            n.gateways = [g.node_id for g in table.gateways(n.rname, 0.0)]
            for p in table.peers(n.id, n.rname, 0.0, limit=self.cfg.peer_limit, rng=rng):
                m = self.by_id[p.node_id]
                n.known.setdefault(m.id, Known(m))
                m.known.setdefault(n.id, Known(n))
        self.table = table
        self.heads = {r: [n.node_id for n in hs] for r, hs in table.all_heads(0.0).items()}

    def at(self, t: float, fn: Callable[..., object], *args: object) -> None:
        heapq.heappush(self.events, (t, next(self.seq), fn, args))

    def note(self, event: str, r: Req) -> None:
        """One event of a chunk request, for ``--trace``: ``asked`` (its node sent it; ``pushed``: its
        server sent it unasked), ``refused``,
        ``failed`` or ``cut`` (its node heard), ``stored`` or ``wasted`` (its last byte arrived)."""
        if self.trace is not None:
            t0 = self.version_start
            self.trace.append({"t": round(self.now - t0, 6), "version": r.version, "event": event,
                               "node": r.dst.id, "region": r.dst.region, "peer": r.src.id,
                               "peer_region": r.src.region, "chunk": r.chunk, "asked": round(r.sent - t0, 6),
                               "cut_through": not r.whole})

    def owd(self, a: Node, b: Node) -> float:
        return (self.cfg.local_rtt if a.region == b.region else self.cfg.rtt) / 2

    def leave(self, gone: list[Node]) -> None:
        for g in gone:
            g.alive = False
            self.near_trainer -= g.region == self.trainer.region
            self.near_wanting -= g.region == self.trainer.region and g in self.pending
            g.fetching, g.partial = {}, {}  # its peers learn it fetches nothing when their requests to it fail
            self.pending.discard(g)
            lease = self.table.get(g.id, self.now)
            assert lease is not None  # (leases end only here)
            self.table.leave(g.id, lease.epoch, self.now)
            for queue in g.queue.values():
                for r in queue:
                    self.at(self.now + self.owd(g, r.dst), self.failed, r)
                queue.clear()
            for r in self.flows:
                if r.src is g or r.dst is g:
                    r.cancelled = True  # its uploads end; the requester hears below
                    self.cancel_pending = True
                    if r.src is g:
                        self.at(self.now + self.owd(g, r.dst), self.failed,
                                Req(r.dst, g, r.chunk, r.version, 0, whole=r.whole))
            for k in g.known.values():  # the trainer hosts the tracker: it hears of the leave at once;
                # the other peers at their next renewal
                later = 0.0 if k.node.trainer else self.rng.random() * renew_interval(DEFAULT_TTL)
                self.at(self.now + later, self.forget, k.node, g)
                self.at(self.now + self.owd(g, k.node), self.hung_up, k.node, g)
        gone_ids = {g.id for g in gone}
        self.heads = {r: [h for h in hs if h not in gone_ids] for r, hs in self.heads.items()}

    def hung_up(self, z: Node, g: Node) -> None:
        """z's long poll to g failed (g's daemon stopped): g is not counted on to cross."""
        if (k := z.known.get(g.id)) is not None:
            k.stalled = True
            self.dirty.add(z)

    def forget(self, z: Node, g: Node) -> None:
        k = z.known.pop(g.id, None)
        if k is None:
            return
        if z.trainer:
            for c in k.have:
                z.held_by[c] -= 1
            assert z.superseed is not None  # the trainer's, since the first version's publish
            z.superseed.forget(g.id)
        z.unchoked.discard(g.id)
        z.gateways = [i for i in z.gateways if i != g.id]
        if z.counted is not None:
            z.counted = z.counted - {g.id}
        self.dirty.add(z)

    def publish(self) -> None:
        self.version += 1
        t = self.trainer
        t.have = set(range(self.chunks))
        t.held_by = {}
        t.superseed = SuperSeed(self.chunks, per_peer=SEED_PER_PEER, single_from=SEED_SINGLE_FROM,
                                rng=random.Random(self.rng.random()))
        for n in self.nodes:
            for k in n.known.values():
                k.have = set(t.have) if k.node.trainer else set()
            if n.trainer:
                continue
            n.have, n.fetching, n.partial, n.available_since, n.counted, n.done_at = set(), {}, {}, {}, None, None
            n.counted_known = frozenset()
            n.pushed = {}
            n.striped_to = {}
            n.unstriped = set()
            n.first_hand = set()
            n.root = {}
            n.aware = False
            if n.alive:
                self.pending.add(n)
            if t.id in n.known:  # the trainer's long poll answers with the version's statements
                self.at(self.now + self.owd(t, n), self._aware, n)
        self.near_wanting = sum(1 for n in self.pending if n.region == t.region)
        self.choke(t)  # a new version: every peer wants it, and the trainer decides whom it serves at once
        self.at(self.now + self.rng.random() * CHOKE_EVERY, self._choke_tick, t)  # only the trainer chokes

    def _choke_tick(self, n: Node) -> None:
        if n.alive:
            self.choke(n)
            self.at(self.now + CHOKE_EVERY, self._choke_tick, n)

    def _aware(self, n: Node) -> None:
        n.aware = True
        self.dirty.add(n)

    def run(self, *, progress=None, tick=None, horizon: float = 60.0) -> list[dict]:
        """Simulate every version; ``progress(row)`` after each, ``tick(version, simulated seconds,
        nodes holding it, live nodes)`` every ``TICK_EVERY`` seconds of wall time while one runs."""
        cfg = self.cfg
        dt = cfg.step
        rows = []
        ticked = time.monotonic()
        for v in range(cfg.versions):
            t0 = self.version_start = self.now
            sent0, cross0, wasted0 = self.sent[0], self.cross_bytes, self.wasted
            relayed0, cuts0 = self.relayed, self.cuts
            self.publish()
            churn_left = cfg.churn > 0 and v == cfg.versions - 1
            limit = t0 + horizon * cfg.bound
            next_plan = self.now
            one_copy = None
            while self.pending and self.now <= limit:
                if churn_left and self.now - t0 >= cfg.churn_at * cfg.bound:
                    churn_left = False
                    live = [n for n in self.nodes[1:] if n.alive]
                    self.leave(self.rng.sample(live, max(1, round(cfg.churn * len(live)))))
                while self.events and self.events[0][0] <= self.now:
                    _, _, fn, args = heapq.heappop(self.events)
                    fn(*args)
                if self.now >= next_plan:  # the scheduler's 0.25 s timeout
                    next_plan += PLAN_EVERY
                    self.dirty |= self.pending
                dirty, self.dirty = self.dirty, set()
                for n in dirty:
                    self.plan(n)
                self.step_flows(dt)
                self.now += dt
                if one_copy is None and self.sent[0] - sent0 >= cfg.patch - 1:
                    one_copy = self.now - t0
                if tick is not None and time.monotonic() - ticked >= TICK_EVERY:
                    ticked = time.monotonic()
                    live = [n for n in self.nodes[1:] if n.alive]
                    tick(self.version, self.now - t0, sum(n.done_at is not None for n in live), len(live))
            live = [n for n in self.nodes[1:] if n.alive]
            finished = [n.done_at for n in live if n.done_at is not None]
            elapsed = (max(finished) if len(finished) == len(live) else self.now) - t0
            row = {"version": self.version, "nodes": len(live), "chunks": self.chunks,
                   "seconds": elapsed, "lower_bound_seconds": cfg.bound, "time_over_bound": elapsed / cfg.bound,
                   "all_done": len(finished) == len(live), "trainer_sent_one_copy_seconds": one_copy,
                   "done_quartiles": [float(q) - t0 for q in np.quantile(finished, [0.25, 0.5, 0.75])]
                   if finished else None,
                   "trainer_upload_over_patch": (self.sent[0] - sent0) / cfg.patch,
                   "cross_region_over_r_minus_1": cross_region_over(self.cross_bytes - cross0, cfg.regions, cfg.nodes,
                                                                    cfg.patch),
                   "wasted_over_patch": (self.wasted - wasted0) / cfg.patch,
                   "cut_through_over_patch": (self.relayed - relayed0) / cfg.patch, "streams_cut": self.cuts - cuts0,
                   "left": cfg.nodes - len(live)}
            rows.append(row)
            if progress:
                progress(row)
            for n in self.nodes:  # the next version starts from a quiet swarm, as the benchmark's does
                for lane in n.queue:
                    n.queue[lane].clear()
                    n.active[lane] = 0
                for k in n.known.values():
                    k.inflight = k.uploads = 0
            self.flows, self.events, self.dirty = [], [], set()
            self.assemblies = set()
            self.now += 0.5
            self.tok_up, self.tok_wan = self.burst_up.copy(), self.burst_wan.copy()  # full after the quiet spell
        return rows
