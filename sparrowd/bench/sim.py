"""``sparrowd bench sim``: the swarm's own decision code at any scale, on a virtual clock.

A discrete-event simulation that drives the real pure state machines, the
same objects the daemon's drivers call: the lease table (joins, the peer
lists it samples), the picker (rarest first, the region's rendezvous
designation, stalled crossers, the endgame), the choker (upload slots,
free-slot admission), super-seeding and ``count_on``. What stands in for the
daemon's asyncio drivers is written here, step for step beside
``daemon/swarm.py``: a node re-plans when something it can see changed and
every 0.25 s, asks the chosen peer for a chunk, and is refused when choked
or over its per-peer cap; a server sends at most two chunks at once
(``RELAY_CONCURRENT``) in each of its lanes (a relay's uploads to its own
region and to other regions are separate lanes, as in the daemon) and queues
the rest; a node that stores a chunk tells
its peers (a have message, one one-way delay later); the trainer shows each
peer its super-seed offer (first copies in its own region where
``first_copies_near`` says so), unchokes its own region's peers first, and
decides again as each version begins.

The link model is fluid. Every upload shares its node's uplink with the
node's other uploads, an upload to another region is further held to the
node's WAN limit and to its share of the ordered pair of regions' link,
and what those leave of the uplink goes to the node's uploads inside its
region. Rates are re-shared every step (``Config.step``, 1-5 ms). A request reaches its
server one one-way delay after it is sent, and a chunk is stored one
one-way delay after its server sent the last byte. Nothing here costs CPU
time, so at 16 nodes the simulation shows what the protocol does where the
real benchmark (``sparrowd bench swarm``) shares two cores among 16 daemons.

Relays serve cut-through (``cut_through``, as the daemon's ``Partial``): a
node serves a chunk it is fetching as well as one it holds, from the first
of its requests for it (its partial), a whole block (``block_for``) at a time as
the blocks arrive. A stream served so never gets ahead of the whole blocks
its feeding request has delivered, and its last block waits until that
request's last byte has arrived (the chunk is then held whole, and what is
left is sent at the stream's share); chains of such streams are followed hop
by hop. The feed is counted as its server sends it, not one one-way delay
later: each hop's last block is delayed right, the blocks before it slightly
early. A stream held back by its feed leaves the rest of its share of a
cross-region upload unused, but what it leaves of the uplink goes to the
node's uploads inside its region. If the feeding request ends without the
chunk (refused, failed, cancelled, timed out, or its server left), its
streams are cut and their requesters, hearing one one-way delay later, pick
again without holding it against the peer; if the node gets the chunk whole
by another request, its streams go on from that copy.

While a chunk is still arriving, a relay streams it to no more peers at
once, pushed or asked for, than its uplink carries at the rate the chunk
comes in (``fanout``; ``swarm.push.relay_fanout`` of the uplink and the
rate the stream's server declared, ``stream_rate``, as on the daemons); a
request beyond waits outside the lanes (``Node.held``, the daemon's
``Partial.turn``) until a stream of it ends or it is whole.

A node serves a partial, and shows its peers it is fetching the chunk, only
once a block of it has checked out (``relay_after_block``): a partial that
has had data is fed, hop by hop, from a whole copy. Without that rule the
picker, which takes a neighbour fetching a chunk over a crossing, leads a
region's nodes to fetch it from each other with none fetching it from
outside: served from their start, partials end up fed by each other in a
circle (A streams from B, B from A) and wait until the daemon's request
timeout (``timed_out``), then form again; refused until a block has come,
the requests go round and round.

What it leaves out: TCP's own dynamics (slow start, loss), the exchange
long poll's own delays beyond one one-way delay, statements and have-maps
as bytes, and the trainer's CPU. A node sees at once what its peers fetch
(where the daemon's refused 404 drops a chunk from the peer's set until its
next exchange reply). Offers from the trainer are computed when a
node plans, as if its long poll had just answered.

``trace`` (``bench sim --trace FILE``) keeps every chunk request's events,
times counted from the version's start: ``asked`` when its node sends it
(``pushed`` when its server sent it unasked, below),
``refused``, ``failed`` or ``cut`` when its node hears so, ``stored`` or
``wasted`` (a copy the node already had) when its last byte arrives; a request
with no later event was cancelled (an endgame loser, a stream from a partial
past its timeout, or its version ended).
Where a version's time goes (which hop waited on what) is read from it.

Push (``push``, ``bench sim --push LOCAL,CROSS``, default 2,2 as the
daemons; ``off`` for pull alone): a relay that can serve a chunk (its first
block checked out, or whole) also sends it unasked to the peers
``swarm.push.push_targets`` names, from what the relay knows: up to LOCAL of
its region that neither hold nor fetch it, and the crosser of up to CROSS
other regions where it knows nobody with the chunk: the head that region
designates (``LeaseTable.heads``), from any head, or from a node that knows
every head of that region; or, where the relay knows the region the chunk
entered the swarm in (from the trainer, or from the stream it got it by, as
the daemons' ``X-Sparrowd-Root``), the regions the chunk's region tree gives
it (``swarm.push.region_tree``), timed as the trainer signs it: the chunk over
the trainer's uplink, and the one-way delay between regions (which the
daemons measure and the simulator knows) plus a block's time
(``Config(timed_tree=False)``: breadth first). The pushed node takes the
stream as if it had asked for it (its picker then leaves the chunk alone: the daemon's exchange
reply tells it of the push as the push starts). A push to a node already
fetching the chunk is not sent (a daemon declines it at once), unless the
node's one request for it has had no byte back: then the push takes the
request's place, as on the daemons (``unstarted``; without it the simulator
left requests queued behind a busy first holder: one chunk at 100 nodes
1.90x the bound, against 1.66x with it).

Churn: ``churn`` of the rollout nodes leave (``sparrowd leave``) at
``churn_at`` of the bound into the last version; their peers' requests to
them fail (the peer cools down, as the daemon does). The trainer, which
hosts the tracker, hears of each leave at once; the other peers at their
next renewal (within a third of the lease TTL).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..codec.patch import auto_chunk_size
from ..swarm import serving
from ..swarm.choker import Choker, ChokerPeer
from ..swarm.leases import DEFAULT_PEER_LIMIT, DEFAULT_TTL, LeaseTable, renew_interval
from ..swarm.picker import STRIPE_WAIT, PeerView, Picker, recount, slots_for_rate, stripes_stopped
from ..swarm.policy import (
    CHOKE_EVERY,
    OPTIMISTIC_EVERY,
    PLAN_EVERY,
    RELAY_CONCURRENT,
    SEED_CONCURRENT,
    SEED_PER_PEER,
    SEED_SINGLE_FROM,
    UPLOAD_SLOTS,
    UPLOADS_PER_PEER,
)
from ..swarm.push import (
    DEFAULT_PUSH,
    PushPeer,
    push_heads,
    push_targets,
    region_tree,
    relay_fanout,
    stream_rate,
    stripe_plan,
    stripe_size,
    stripe_targets,
    tree_timing,
)
from ..swarm.rate import Rate
from ..swarm.superseed import SuperSeed
from ..swarm.versions import block_for
from ..units import format_bytes, format_rate
from . import cross_region_over, ratio_text

MB = 1 << 20
CONCURRENT = {True: SEED_CONCURRENT, False: RELAY_CONCURRENT}  # chunks a node sends at once, by trainer or not
TICK_EVERY = 10.0  # seconds of wall time between progress lines of a long simulation


@dataclass
class Config:
    nodes: int = 16
    regions: int = 4
    patch: int = 64 * MB
    chunk: int | None = None  # None: auto_chunk_size, as the Publisher cuts a patch for this swarm and trainer
    block: int | None = None  # the blocks chunks are hashed in; None: ``block_for``, as the trainer's daemon does
    versions: int = 2
    trainer_rate: float = 4 * MB
    node_rate: float = 8 * MB
    wan_rate: float = 4 * MB
    link_rate: float = 32 * MB  # each ordered pair of regions
    rtt: float = 0.08
    local_rtt: float = 0.001
    peer_limit: int = DEFAULT_PEER_LIMIT
    churn: float = 0.0
    churn_at: float = 0.5
    dt: float | None = None  # the step; None: ``step`` (at most 5 ms, under half a block's time)
    seed: int = 0
    cut_through: bool = True  # relays serve chunks they are fetching, block by block (the trainer never fetches)
    relay_after_block: bool = True  # ...and shows it fetching, only once a block has checked out (False: at once)
    timed_tree: bool = True  # crossings planned by when they start (``region_tree``'s send, hop; False: breadth first)
    fanout: bool = True  # ...to no more peers at once than its uplink carries (``relay_fanout``; False: as lanes take)
    trace: bool = False  # keep every chunk request's events (``Sim.trace``; ``bench sim --trace``)
    push: tuple[int, int] = DEFAULT_PUSH  # relays push what they can serve to (local, cross) peers (daemons' --push)
    stripes: bool = True  # chunks cross in stripes where their region tree is deeper than one crossing (stripe_plan)
    burst: float = 0.0  # seconds of each uplink's and WAN limit's rate sent at once after a quiet spell, as the
    #                     daemons' token buckets let go (--rate-burst; 0: a link's steady rate from the first byte)

    @property
    def chunk_size(self) -> int:
        return self.chunk or auto_chunk_size(self.patch, self.nodes, send_rate=self.trainer_rate,
                                             round_trip=self.rtt if self.regions > 1 else None)

    @property
    def largest_chunk(self) -> int:
        """The largest chunk's size: the patch's, where it goes as one chunk smaller than the chunk
        size (the daemons pace their requests, and the trainer's daemon picks the block size, by the
        chunks as they are)."""
        return max(1, min(self.chunk_size, self.patch))

    @property
    def block_size(self) -> int:
        return self.block or block_for(self.largest_chunk)

    @property
    def step(self) -> float:
        """The simulation's step: ``dt``, else at most 5 ms and under half the time a node takes to send
        one block. A relay hands a chunk on once a block has checked out, and each such hop took at
        least two steps: at 5 ms, one 256 KiB chunk (16 KiB blocks, 2 ms each at 8 MiB/s) to 1,000
        nodes in 8 regions read 1.51x the bound where 1 ms steps read 1.29x."""
        if self.dt is not None:
            return self.dt
        return min(0.005, max(0.001, self.block_size / max(self.trainer_rate, self.node_rate) / 2))

    @property
    def plan_gap(self) -> float:
        """The least time between two plans of one node. A daemon runs a scheduling pass as soon as
        something changed, and a pass takes a fraction of a millisecond (0.19 ms of CPU median, 0.46 ms
        at the 99th percentile, 16 peers, ``bench swarm`` on a 2-core VM); the simulator plans a node at
        most once in a fifth of the time the trainer takes to send a chunk, between 1 and 10 ms, which
        costs it less at 1,000 nodes and holds no request back for long against a chunk's time. (A
        fixed 10 ms, over links 25 times faster, where a chunk leaves the trainer in 2.5 ms, kept the
        trainer's two near peers asking 10 ms apart: 4 MiB left it in 52 ms, not 40.)"""
        return min(0.01, max(0.001, self.largest_chunk / self.trainer_rate / 5))

    @property
    def wan_rtt(self) -> float:
        """The round trip between regions as a node measures it (``Swarm.wan_delay``, doubled): none
        where there is one region."""
        return self.rtt if self.regions > 1 else 0.0

    @property
    def bound(self) -> float:
        """The patch over the trainer's uplink, plus the longest round trip."""
        return self.patch / self.trainer_rate + (self.rtt if self.regions > 1 else self.local_rtt)


@dataclass(eq=False)
class Req:
    dst: "Node"
    src: "Node"
    chunk: int
    version: int
    size: int
    cancelled: bool = False
    left: float = 0.0
    serial: int = -1  # its slot in the Sim's per-request arrays (bytes delivered, whether its partial is whole)
    whole: bool = True  # the requester saw its server hold the chunk (else a cut-through stream: no strike)
    feed: "Req | None" = None  # the server's request whose partial this is served from, cut-through
    readers: list["Req"] | None = None  # as a node's partial: the streams served from it
    cut: bool = False  # its partial was aborted: its requester hears one one-way delay later
    sent: float = 0.0  # when its requester asked
    declared: float | None = None  # the rate its server paces it at, as it declares it (``swarm.push.stream_rate``)
    held: bool = False  # waiting for its server's partial to have room for another stream (``relay_fanout``)
    stripe: tuple[int, int] | None = None  # (s, n): a push of that stripe of the chunk (``swarm.push.stripe_plan``)
    asm: "Req | None" = None  # a stripe's: the partial it fills at its node with the others (``parts``)
    parts: dict[int, "Req"] | None = None  # as a node's partial of a chunk arriving in stripes: the stripes' pushes
    done: set[int] | None = None  # ...the stripes that arrived
    fed_at: float = 0.0  # ...when a stripe last began or arrived
    ended: bool = False  # its last byte was sent


@dataclass
class Known:
    """What a node knows of one peer (the daemon's ``PeerState``)."""

    node: "Node"
    have: set[int] = field(default_factory=set)  # from its have messages
    held: int = 0  # chunks it has shown holding while it lacked others, over all versions (``count_on``)
    stalled: bool = False
    strikes: int = 0
    cooldown_until: float = 0.0
    inflight: int = 0
    rate: Rate = field(default_factory=Rate)
    rate_to: Rate = field(default_factory=Rate)  # what this node uploads to it (the choker's view as a server)
    uploads: int = 0  # its requests this node is serving or has queued


class Node:
    """A daemon: what it holds and fetches, what it knows of its peers, its upload queue."""

    def __hash__(self) -> int:  # sets of nodes iterate in the same order in every run of a seed
        return self.idx

    def __init__(self, idx: int, node_id: str, region: int, trainer: bool, cfg: Config, rng: random.Random):
        self.idx, self.id, self.region, self.trainer = idx, node_id, region, trainer
        self.rname = f"r{region}"
        self.up = cfg.trainer_rate if trainer else cfg.node_rate
        self.wan = float("inf") if trainer else cfg.wan_rate
        self.known: dict[str, Known] = {}
        self.have: set[int] = set()
        self.fetching: dict[int, dict[str, Req]] = {}
        self.partial: dict[int, Req] = {}  # chunks being fetched that it relays cut-through: their first requests
        self.unstriped: set[int] = set()  # chunks whose stripes stopped short, asked for whole (``Swarm.unstriped``)
        self.available_since: dict[int, float] = {}
        self.counted: frozenset[str] | None = None
        self.counted_known: frozenset[str] = frozenset()  # the region's peers known when counted was decided
        self.gateways: list[str] = []
        self.picker = Picker(node_id, self.rname, rng=random.Random(rng.random()))
        self.choker = Choker(slots=UPLOAD_SLOTS, optimistic_interval=OPTIMISTIC_EVERY, rng=random.Random(rng.random()))
        self.unchoked: set[str] = set()
        # Upload lanes (the daemon's ``_lane``): a relay's uploads to other regions (True) and to its own
        # (False) are admitted, queued and served apart; the trainer's are all one lane (False).
        self.queue: dict[bool, deque[Req]] = {False: deque(), True: deque()}
        self.held: list[Req] = []  # requests waiting for room in the partial they are served from (``Req.held``)
        self.active = {False: 0, True: 0}
        self.alive = True
        self.aware = trainer  # knows of the current version
        self.done_at: float | None = None
        self.superseed: SuperSeed | None = None
        self.held_by: dict[int, int] = {}  # the trainer: how many peers it knows hold each chunk
        self.planned_at = -1.0
        self.pushed: dict[int, list[int]] = {}  # chunk -> [local, cross] pushes sent (``Config.push``)
        self.root: dict[int, str] = {}  # chunk -> the region it entered the swarm in (its tree's root)
        self.striped_to: dict[int, set[str]] = {}  # chunk -> the receivers it pushed a stripe of it to
        self.first_hand: set[int] = set()  # chunks it took from the trainer (``stripe_targets``)


class Sim:
    """One run: ``run()`` returns a row per version."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.now = 0.0
        self.events: list = []
        self.seq = itertools.count()
        self.dirty: set[Node] = set()
        self.chunk_size = cfg.largest_chunk
        self.chunks = max(1, math.ceil(cfg.patch / cfg.chunk_size))
        self.block = cfg.block_size  # as the trainer's daemon hashes the version's chunks
        self.sizes = [min(self.chunk_size, cfg.patch - i * self.chunk_size) for i in range(self.chunks)]
        self.version = 0
        self.cross_bytes = 0
        self.wasted = 0
        self.relayed = 0.0  # bytes sent by streams served from a partial (cut-through)
        self.cuts = 0  # streams cut because their partial was aborted
        self.shown_fetching: dict[int, tuple[float, set[int]]] = {}  # by node: (when, what shows_fetching said)
        self.trace: list[dict] | None = [] if cfg.trace else None
        self.version_start = 0.0
        r = cfg.regions
        self.trainer = Node(0, "trainer", 0, True, cfg, self.rng)
        self.nodes = [self.trainer] + [Node(i + 1, f"n{i}-r{i % r}", i % r, False, cfg, self.rng)
                                       for i in range(cfg.nodes)]
        self.by_id = {n.id: n for n in self.nodes}
        # Each region's heads, as the tracker names them in a renewal's reply (push_heads): set at
        # join, less the nodes that leave (the pushers learn of replacements only at their renewals).
        self.heads: dict[str, list[str]] = {}
        self._join()
        # The trainer's peers in its own region (for first_copies_near), less those that leave.
        self.near_trainer = sum(1 for n in self.nodes if not n.trainer and n.region == self.trainer.region)
        self.near_wanting = 0  # of them, those still short of the version (set at each publish)
        # Flows (uploads being sent): parallel arrays of capacity ``len(self.flows)``..., swap-removed.
        self.flows: list[Req] = []
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
        self.assemblies: set[Req] = set()  # partials of chunks arriving in stripes (``Req.parts``)
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
        self.pending: set[Node] = set()  # live rollout nodes without the current version

    # ------------------------------------------------------------ membership (the real lease table)

    def _join(self) -> None:
        """Every node joins, then takes a peer list from the table as its first renewal would; a node
        that another lists learns of it when it is first contacted (the daemon's ``ask``), so peer
        relations are symmetric."""
        table = LeaseTable(DEFAULT_TTL, now=0.0)
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

    # ------------------------------------------------------------ events

    def at(self, t: float, fn, *args) -> None:
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

    # ------------------------------------------------------------ the server side (handle_exchange, handle_chunk)

    def wants(self, x: Node, y: Node) -> bool:
        k = x.known.get(y.id)
        return bool(x.have - k.have) if k is not None else bool(x.have)

    def slots(self, x: Node) -> serving.Slots:
        """The trainer's upload slots (``serving.Slots``): every peer it knows counts as live, and the
        near ones still short of the version as wanting."""
        return serving.Slots(x.choker, x.unchoked, lambda p: self.by_id[p].region == x.region, len(x.known),
                             self.near_trainer, self.cfg.regions, self.near_wanting)

    @staticmethod
    def lane(x: Node, y: Node) -> bool:
        return serving.lane(x.trainer, x.region, y.region)

    def may_download(self, x: Node, y: Node) -> bool:
        if not x.trainer:
            return serving.relay_admits(len(x.queue[self.lane(x, y)]))
        return self.slots(x).admits(y.id, y.region != x.region)

    def owed(self, x: Node, y: Node) -> frozenset[int]:
        k = x.known.get(y.id)
        return serving.owed(x.superseed, y.id, k.have if k is not None else set())

    def choked_for(self, x: Node, y: Node) -> bool:
        """The ``choked`` flag of x's exchange reply to y."""
        if not x.trainer:
            return not serving.relay_admits(len(x.queue[self.lane(x, y)]))
        return serving.trainer_chokes(self.slots(x), y.id, y.region != x.region, wants=self.wants(x, y),
                                      owes=lambda: bool(self.owed(x, y)))

    def shown(self, x: Node, y: Node) -> set[int]:
        """What x shows y of the version: all it holds, or for the trainer its super-seed offer."""
        if not x.trainer:
            return x.have
        k = x.known.get(y.id)
        have = k.have if k is not None else set()
        n = len(self.sizes)
        delay = self.cfg.rtt / 2 if self.cfg.regions > 1 else None  # as the daemons measure it: between regions
        return serving.trainer_shows(
            x.have, self.slots(x), x.superseed, self.now, y.id, have, x.held_by, far=y.region != x.region,
            announced=n, total=n, super_seed=True, trusted=serving.trusted(bool(have), any(x.held_by.values())),
            quick=serving.quick(self.sizes[0], n, self.cfg.trainer_rate, delay))

    def choke(self, x: Node) -> None:
        peers = [ChokerPeer(pid, self.wants(x, k.node), rate_from=k.rate.rate(self.now),
                            rate_to=k.rate_to.rate(self.now), near=k.node.region == x.region)
                 for pid, k in x.known.items()]
        seed = len(x.have) == self.chunks
        unchoked = x.choker.decide(self.now, peers, seed=seed)
        if unchoked != x.unchoked:
            if x.superseed is not None:
                for pid in x.unchoked - unchoked:
                    x.superseed.forget(pid, unclaimed_only=True)
            x.unchoked = unchoked
            self.dirty.update(k.node for k in x.known.values())

    def request_arrives(self, r: Req) -> None:
        x, y = r.src, r.dst
        if r.cancelled or r.version != self.version:
            return self.release(r)
        if not x.alive:
            return self.at(self.now + self.owd(x, y), self.failed, r)
        k = x.known.get(y.id)
        feed = None if r.chunk in x.have or not self.cfg.cut_through else x.partial.get(r.chunk)
        if feed is not None and self.cfg.relay_after_block and not self.ready(feed):
            feed = None  # nothing has come of it yet: it may be fed, in a circle, by the streams it would serve
        if k is None or (r.chunk not in x.have and feed is None) \
                or not (self.may_download(x, y) or r.chunk in self.owed(x, y)) or k.uploads >= UPLOADS_PER_PEER:
            return self.at(self.now + self.owd(x, y), self.refused, r)  # the daemon's 404 (not a lie) or 503
        k.uploads += 1
        if x.trainer:
            y.root.setdefault(r.chunk, y.rname)  # it enters the swarm here
            y.first_hand.add(r.chunk)
        elif r.chunk in x.root:
            y.root.setdefault(r.chunk, x.root[r.chunk])  # (the reply's headers say so)
        if x.superseed is not None:
            x.superseed.claim(r.chunk, y.id)
        if feed is not None:
            r.feed = feed
            room = self.room(x, feed)  # (before it counts itself)
            feed.readers.append(r)
            if room is not None and room <= 0:  # the daemon's ``Partial.turn``: out of the lane until there is
                r.held = True
                x.held.append(r)
                return
        x.queue[self.lane(x, y)].append(r)
        self.start_uploads(x)

    def room(self, x: Node, feed: Req) -> int | None:
        """How many more streams x may serve now from its partial ``feed``, None for no limit (the
        daemon's ``Partial.room``): ``relay_fanout`` of x's uplink and the rate the chunk arrives at,
        less the streams served or about to be served from it."""
        if feed.chunk in x.have or not self.cfg.fanout:
            return None
        most = relay_fanout(self.up[x.idx], feed.declared)
        if most is None:
            return None
        return most - sum(1 for q in feed.readers if not (q.held or q.ended or q.cancelled or q.stripe))

    def start_uploads(self, x: Node) -> None:
        if x.held:  # requests for a partial's stream: into their lane once it has room (or is whole, or cut)
            for r in list(x.held):
                room = None if r.cancelled else self.room(x, r.feed)
                if room is None or room > 0:
                    r.held = False
                    x.held.remove(r)
                    x.queue[self.lane(x, r.dst)].append(r)
        for lane, queue in x.queue.items():
            while x.active[lane] < CONCURRENT[x.trainer] and queue:
                r = queue.popleft()
                if r.cancelled:
                    if x.superseed is not None:  # as the daemon's trainer: its node hung up before a byte
                        x.superseed.unclaim(r.chunk, r.dst.id)
                    x.known[r.dst.id].uploads -= 1
                    self.dropped(r)
                    continue
                x.active[lane] += 1
                fed = r.feed is not None and r.chunk not in x.have
                r.declared = stream_rate(x.up, x.wan, x.active[False] + x.active[True], x.active[True], wan=lane,
                                         arriving=r.feed.declared if fed else None)
                r.left = float(r.size)
                self._add_flow(r)

    def _flow_arrays(self) -> tuple[np.ndarray, ...]:
        return (self.f_src, self.f_pair, self.f_cross, self.f_left, self.f_size, self.f_serial, self.f_feed,
                self.f_last, self.f_ss, self.f_sn, self.f_fsize)

    def _add_flow(self, r: Req) -> None:
        i = len(self.flows)
        if i == len(self.f_src):
            (self.f_src, self.f_pair, self.f_cross, self.f_left, self.f_size, self.f_serial, self.f_feed,
             self.f_last, self.f_ss, self.f_sn, self.f_fsize) = (np.concatenate([a, np.zeros_like(a)])
                                                                  for a in self._flow_arrays())
        self.flows.append(r)
        self.f_src[i] = r.src.idx
        self.f_pair[i] = r.src.region * self.cfg.regions + r.dst.region
        self.f_cross[i] = r.src.region != r.dst.region
        self.f_left[i] = r.left
        self.f_size[i] = r.size
        self.f_serial[i] = r.serial
        self.f_feed[i] = r.feed.serial if r.feed is not None else -1
        self.f_last[i] = r.size - (r.size % self.block or self.block)
        striped = r.stripe is not None and r.feed is not None and r.feed.size != r.size  # fed by the whole chunk
        self.f_ss[i], self.f_sn[i] = r.stripe if striped else (0, 0)
        self.f_fsize[i] = r.feed.size if r.feed is not None else 0.0

    def _remove_flow(self, i: int) -> None:
        last = len(self.flows) - 1
        if i != last:
            self.flows[i] = self.flows[last]
            for a in self._flow_arrays():
                a[i] = a[last]
        self.flows.pop()

    def _serial(self) -> int:
        s = self.nreq
        self.nreq += 1
        if s == len(self.s_got):
            self.s_got = np.concatenate([self.s_got, np.zeros_like(self.s_got)])
            self.s_whole = np.concatenate([self.s_whole, np.zeros_like(self.s_whole)])
        return s

    def step_flows(self, dt: float) -> None:
        """Share the links for ``dt`` seconds; finished (or cancelled) flows end."""
        nf = len(self.flows)
        if not nf:
            self._refill(dt, 0.0, 0.0)
            return
        n = len(self.nodes)
        up, wan = self.up + self.tok_up / dt, self.wan + self.tok_wan / dt  # this step's, with the buckets
        src, cross, left, size = self.f_src[:nf], self.f_cross[:nf], self.f_left[:nf], self.f_size[:nf]
        # A stream served from a partial sends no further than the whole blocks its feed has delivered,
        # and its last block only once the chunk arrived whole there; as a rate for this step.
        feed = self.f_feed[:nf]
        fed = feed >= 0
        cap = None
        if fed.any():
            fi = feed[fed]
            ready = np.where(self.s_whole[fi], np.inf,
                             np.minimum(np.floor(self.s_got[fi] / self.block) * self.block, self.f_last[:nf][fed]))
            sn = self.f_sn[:nf][fed]
            if sn.any():  # a stripe of a chunk still arriving: its blocks within the checked prefix
                st = sn > 0
                fsize = self.f_fsize[:nf][fed][st]
                prefix = np.minimum(np.floor(self.s_got[fi[st]] / self.block) * self.block,
                                    fsize - (fsize % self.block + (fsize % self.block == 0) * self.block))
                count = np.maximum(0, np.ceil((prefix / self.block - self.f_ss[:nf][fed][st]) / sn[st]))
                ready[st] = np.where(self.s_whole[fi[st]], np.inf, count * self.block)
            cap = np.full(nf, np.inf)
            cap[fed] = np.maximum(ready - (size[fed] - left[fed]), 0) / dt
        n_src = np.bincount(src, minlength=n)
        rate = up[src] / n_src[src]
        used = None
        if cross.any():
            xs = src[cross]
            pairs = self.f_pair[:nf][cross]
            n_pair = np.bincount(pairs, minlength=self.cfg.regions ** 2)
            lim = np.minimum(rate[cross], self.cfg.link_rate / n_pair[pairs])
            if cap is not None:
                lim = np.minimum(lim, cap[cross])
            # The node's WAN limit shared among its streams across, what a stream held back by its feed
            # (or its link) leaves going to the others, as the daemon's token bucket does (water-filling).
            slow = np.zeros(len(xs), bool)
            for i in range(4):
                share = np.maximum(wan - np.bincount(xs[slow], weights=lim[slow], minlength=n), 0) / \
                    np.maximum(np.bincount(xs[~slow], minlength=n), 1)
                more = ~slow & (lim < share[xs])
                if i == 3 or not more.any():
                    break
                slow |= more
            xr = np.minimum(share[xs], lim)
            rate[cross] = xr
            used = np.bincount(xs, weights=xr, minlength=n)
        if used is not None or cap is not None:
            # What the node's cross-region uploads leave of its uplink goes to its uploads inside the region,
            # shared evenly but for streams held back by their feeds (water-filling, a few rounds).
            local = ~cross
            ls = src[local]
            room = up - used if used is not None else up
            lim = cap[local] if cap is not None else np.full(len(ls), np.inf)
            slow = np.zeros(len(ls), bool)
            for i in range(4):
                share = np.maximum(room - np.bincount(ls[slow], weights=lim[slow], minlength=n), 0) / \
                    np.maximum(np.bincount(ls[~slow], minlength=n), 1)
                more = ~slow & (lim < share[ls])
                if i == 3 or not more.any():
                    break
                slow |= more
            rate[local] = np.minimum(share[ls], lim)
        sent = np.minimum(left, rate * dt)
        if self.cfg.cut_through and self.cfg.relay_after_block:  # a partial's first block checked out
            b = self.block
            for i in np.nonzero((size - left < b) & (size - left + sent >= b) & (size > b))[0].tolist():
                r = self.flows[i]
                if r.stripe is not None and r.asm is r.dst.partial.get(r.chunk) and not r.cancelled:
                    self.push(r.dst, r.chunk)  # a receiver hands its stripe on from its first block
                elif r.dst.partial.get(r.chunk) is r and not r.cancelled:
                    self.tell(r.dst, r.chunk, have=False)  # its peers may fetch it from there now
                    if any(self.cfg.push):
                        self.push(r.dst, r.chunk)
        left -= sent
        self.s_got[self.f_serial[:nf]] = size - left
        for a in self.assemblies:
            self.s_got[a.serial] = self.assembled(a)
        if cap is not None:
            self.relayed += float(sent[fed].sum())
        by_node = np.bincount(src, weights=sent, minlength=n)
        self.sent += by_node
        self.cross_bytes += float(sent[cross].sum())
        self._refill(dt, by_node, np.bincount(src[cross], weights=sent[cross], minlength=n))
        done = left <= 1e-6
        if self.cancel_pending:
            self.cancel_pending = False
            done |= np.fromiter((r.cancelled for r in self.flows), bool, nf)
        ended = []
        for i in sorted(np.nonzero(done)[0].tolist(), reverse=True):
            r = self.flows[i]
            r.left = float(left[i])
            ended.append(r)
            self._remove_flow(i)
        for r in ended:
            r.ended = True
            x = r.src
            if r.stripe is None:  # (stripes take no upload slot)
                x.active[self.lane(x, r.dst)] -= 1
            if r.dst.id in x.known:
                x.known[r.dst.id].uploads -= 1
            if r.cancelled:
                self.wasted += r.size - r.left
                self.dropped(r)
            else:
                if r.dst.id in x.known:
                    x.known[r.dst.id].rate_to.add(self.now, r.size)
                self.at(self.now + self.owd(x, r.dst), self.arrives, r)
            self.start_uploads(x)

    def _refill(self, dt: float, sent, sent_across) -> None:
        """The token buckets after ``dt`` seconds in which each node sent ``sent`` bytes, ``sent_across``
        of them to other regions (``Config.burst``)."""
        if self.cfg.burst > 0:
            self.tok_up = np.clip(self.tok_up + np.where(np.isfinite(self.up), self.up * dt, 0.0) - sent, 0,
                                  self.burst_up)
            self.tok_wan = np.clip(self.tok_wan + np.where(np.isfinite(self.wan), self.wan * dt, 0.0) - sent_across,
                                   0, self.burst_wan)

    # ------------------------------------------------------------ the fetching side (_fetch, _ingest, _schedule)

    def dropped(self, r: Req) -> None:
        """A cancelled request left its server: a loser's node already knows; a cut stream's node hears
        one one-way delay later."""
        if r.cut:
            self.at(self.now + self.owd(r.src, r.dst), self.heard_cut, r)
        else:
            self.release(r)

    def heard_cut(self, r: Req) -> None:
        self.note("cut", r)
        self.release(r)

    def shows_fetching(self, x: Node):
        """The chunks x tells its peers it is fetching: all it has asked for, or, where it relays only
        once a block has checked out, those (which it serves)."""
        if not (self.cfg.cut_through and self.cfg.relay_after_block) or x.trainer:
            return x.fetching.keys()
        at, shown = self.shown_fetching.get(x.idx, (None, None))
        if at != self.now:  # once a step: nothing is received while nodes plan
            shown = {c for c, f in x.partial.items() if self.ready(f)}
            self.shown_fetching[x.idx] = (self.now, shown)
        return shown

    def ready(self, f: Req) -> float:
        """The bytes of the partial ``f`` feeds that have checked out (the last block only once it is whole)."""
        if self.s_whole[f.serial]:
            return f.size
        return min(self.s_got[f.serial] // self.block * self.block, f.size - (f.size % self.block or self.block))

    def timed_out(self, r: Req) -> None:
        """The daemon's request timeout, for a stream from a partial (which waits as long as its feed
        does: in a circle of partials, each fed by the next, for ever)."""
        if r.dst.fetching.get(r.chunk, {}).get(r.src.id) is r:
            r.cancelled = True
            self.cancel_pending = True
            self.release(r)

    def whole(self, y: Node, c: int) -> None:
        """y got chunk c whole: the streams served from its partial go on from this copy."""
        if (f := y.partial.pop(c, None)) is not None:
            self.s_whole[f.serial] = True
            self.assemblies.discard(f)

    def abort(self, f: Req) -> None:
        """The request feeding its node's partial ended without the chunk: the streams served from it
        are cut (their requesters pick again; not the server's fault, so no strike)."""
        for r in f.readers:
            if r.cancelled or r.version != self.version:
                continue
            r.cancelled = r.cut = True
            self.cuts += 1
            self.cancel_pending = True  # a queued one is dropped when its turn comes, an active one now
        if f.dst.held:
            self.start_uploads(f.dst)  # and a held one now

    def release(self, r: Req) -> None:
        """The request is over for its node: the chunk goes back to the picker (and a partial it fed
        without the chunk arriving is aborted)."""
        y = r.dst
        if y.partial.get(r.chunk) is r:
            del y.partial[r.chunk]
            self.abort(r)
        reqs = y.fetching.get(r.chunk)
        if reqs is not None and reqs.get(r.src.id) is r:
            del reqs[r.src.id]
            if not reqs:
                del y.fetching[r.chunk]
            k = y.known.get(r.src.id)
            if k is not None:
                k.inflight -= 1
        if r.stripe is not None and y.partial.get(r.chunk) is r.asm and \
                not any(q.stripe is not None for q in y.fetching.get(r.chunk, {}).values()):
            # The last stripe out: the rest may not come.
            self.at(self.now + STRIPE_WAIT + self.cfg.wan_rtt, self.stripes_stopped, r.asm)
        self.dirty.add(y)

    def refused(self, r: Req) -> None:
        self.note("refused", r)
        self.release(r)

    def failed(self, r: Req) -> None:
        self.note("failed", r)
        k = r.dst.known.get(r.src.id)
        if k is not None and r.whole:  # a cut-through stream's end is not held against its server
            k.strikes += 1
            k.cooldown_until = self.now + min(60.0, 2.0 ** k.strikes)
            k.stalled = True  # not counted on to cross until it delivers again
        self.release(r)

    def arrives(self, r: Req) -> None:
        y, x = r.dst, r.src
        if r.stripe is not None:  # one stripe in: the chunk is stored once all are (the daemon's ``_receive``)
            a = r.asm
            self.s_whole[r.serial] = True  # the stripe's last block may go on now
            a.done.add(r.stripe[0])
            a.fed_at = self.now
            if len(a.done) < r.stripe[1] or r.version != self.version or r.chunk in y.have or not y.alive:
                return self.release(r)
        fresh = r.version == self.version and y.alive and r.chunk not in y.have
        self.note("stored" if fresh else "wasted", r)
        if fresh:
            y.have.add(r.chunk)
            self.whole(y, r.chunk)
        if (a := y.partial.get(r.chunk)) is not None and a.parts is not None and r.chunk in y.have:
            self.whole(y, r.chunk)  # arrived whole by a request, in place of the stripes
        self.release(r)
        if y.held:
            self.start_uploads(y)  # streams held for its partial go now, from the whole copy
        if r.version != self.version or not y.alive:
            return
        if not fresh:
            self.wasted += r.size
            return
        k = y.known.get(x.id)
        if k is not None:
            k.stalled = False
            k.strikes = 0
            k.rate.add(self.now, r.size)
        for other in list(y.fetching.get(r.chunk, {}).values()):  # endgame: cancel the losers
            other.cancelled = True
            self.cancel_pending = True
        if len(y.have) == self.chunks:
            y.done_at = self.now
            self.near_wanting -= y.region == self.trainer.region
            self.pending.discard(y)
        self.tell(y, r.chunk)
        if any(self.cfg.push):
            self.push(y, r.chunk)

    def push(self, y: Node, c: int) -> None:
        """Push (``Config.push``, the daemon's ``Swarm._push_out``): y, as soon as it can serve chunk c
        (its first block checked out, or whole), sends it unasked to up to ``push[0]`` peers of its region
        and ``push[1]`` of other regions that neither hold nor fetch it, as the daemon decides
        (``swarm.push``)."""
        if y.trainer or not y.alive:
            return
        feed = None if c in y.have else y.partial.get(c)
        if c not in y.have and feed is None:
            return  # (called once its first block checked out, or once whole)
        sent = y.pushed.setdefault(c, [0, 0])
        known = [k.node for k in y.known.values() if not k.node.trainer and k.node.alive]
        heads = push_heads(y.rname, y.id, (z.id for z in known), self.heads)
        known += [z for hs in heads.values() for h in hs if h not in y.known and (z := self.by_id[h]).alive]
        views = [PushPeer(z.id, z.rname, c in z.have or (bool(z.fetching.get(c)) and self.unstarted(z, c, y) is None))
                 for z in known]
        idle = tuple(max(0, CONCURRENT[False] - y.active[lane] - len(y.queue[lane])) for lane in (False, True))
        tree = None
        if y.root.get(c) in self.heads:  # timed as the trainer signs it (the simulator knows the delay)
            send, hop = tree_timing(self.sizes[c], self.block, self.cfg.trainer_rate, self.cfg.rtt / 2) \
                if self.cfg.timed_tree else (None, None)
            plan = stripe_plan(self.version, c, y.root[c], self.heads, -(-self.sizes[c] // self.block),
                               send=send, hop=hop) if self.cfg.stripes else None
            if plan is not None:  # across in stripes, not in the tree
                self.stripe_out(y, c, plan, feed)
                tree = {}
            else:
                tree = region_tree(self.version, c, y.root[c], self.heads, send=send, hop=hop)
        near, far = push_targets(self.version, c, y.id, y.rname, views, heads, local=self.cfg.push[0],
                                 cross=self.cfg.push[1], sent=(sent[0], sent[1]), idle=idle, tree=tree,
                                 most=None if feed is None else self.room(y, feed), whole=c in y.have)
        sent[0] += len(near)
        sent[1] += len(far)
        targets = [self.by_id[i] for i in near + far]
        for z in targets:
            if (u := self.unstarted(z, c, y)) is not None:  # the push takes the place of z's request
                u.cancelled = True
                self.cancel_pending = True
                self.release(u)
            r = Req(z, y, c, self.version, self.sizes[c], serial=self._serial(), whole=c in y.have, readers=[],
                    sent=self.now)
            z.fetching.setdefault(c, {})[y.id] = r
            z.partial.setdefault(c, r)
            z.aware = True  # a push carries the version's statements
            if c in y.root:
                z.root.setdefault(c, y.root[c])  # and the chunk's tree's root
            z.known.setdefault(y.id, Known(y)).inflight += 1
            y.known.setdefault(z.id, Known(z)).uploads += 1
            if feed is not None:
                r.feed = feed
                feed.readers.append(r)
            self.note("pushed", r)
            y.queue[self.lane(y, z)].append(r)
        if targets:
            self.start_uploads(y)

    def stripe_out(self, y: Node, c: int, plan, feed: Req | None) -> None:
        """The daemon's ``Swarm._stripe_out``: y pushes the stripes of chunk c it sends under ``plan``
        (``stripe_targets``), the first holder's as the chunk arrives, a receiver's own from its first
        block; in no upload slot. The receiver takes the first into a new partial of the chunk
        (``Req.parts``, in place of an unstarted request) and the rest beside it."""
        if c not in y.have and feed is None:
            return
        mine = plan.stripe.get(y.rname)
        if c not in y.have and mine is not None and feed.parts is not None:
            if (own := feed.parts.get(mine)) is None:
                return  # its own stripe is not coming here (yet)
            feed = own  # handed on as it arrives (a fetch of the whole chunk: from that, as its blocks do)
        first = c in y.first_hand
        for pid, s in stripe_targets(plan, y.id, y.rname, first):
            if not self.stripe_to(y, c, self.by_id[pid], (s, plan.n), feed) and first:
                # declined: the first holder hands it to the other receivers itself (the daemon hears so
                # a round trip later)
                others = [self.by_id[h] for h in plan.receiver.values() if h != pid]
                self.at(self.now + 2 * self.owd(y, self.by_id[pid]), self.stripe_fallback, y, c, (s, plan.n), others)

    def stripe_fallback(self, y: Node, c: int, stripe: tuple[int, int], to: list[Node]) -> None:
        if y.alive:  # (the events of a version end with it)
            feed = None if c in y.have else y.partial.get(c)
            for z in to:
                self.stripe_to(y, c, z, stripe, feed)

    def stripe_to(self, y: Node, c: int, z: Node, stripe: tuple[int, int], feed: Req | None) -> bool:
        """One stripe push from y to z (the daemon's ``_stripe_to``, ``handle_push``): whether z took it."""
        s, n = stripe
        sent = y.striped_to.setdefault(c, set())
        if (z.id, s) in sent or not z.alive or c in z.have or (c not in y.have and feed is None):
            return True  # (nothing to send: not a decline)
        sent.add((z.id, s))
        a = z.partial.get(c)
        if a is not None and a.parts is not None:
            if s in a.parts or y.id in z.fetching.get(c, {}):
                return False  # declined: a stripe held
        elif z.fetching.get(c):
            if c in z.unstriped:
                return False  # declined: asked for whole
            if (u := self.unstarted(z, c, y)) is None:
                return False  # declined: being fetched
            u.cancelled = True
            self.cancel_pending = True
            self.release(u)
            a = None
        if a is None or a.parts is None:
            a = Req(z, z, c, self.version, self.sizes[c], serial=self._serial(), readers=[], parts={}, done=set())
            z.partial[c] = a
            self.assemblies.add(a)
        r = Req(z, y, c, self.version, stripe_size(self.sizes[c], self.block, s, n), serial=self._serial(),
                whole=c in y.have, readers=[], sent=self.now, stripe=(s, n), asm=a)
        a.parts[s] = r
        a.fed_at = self.now
        z.fetching.setdefault(c, {})[y.id] = r
        z.aware = True  # a push carries the version's statements
        if c in y.root:
            z.root.setdefault(c, y.root[c])
        z.known.setdefault(y.id, Known(y)).inflight += 1
        y.known.setdefault(z.id, Known(z)).uploads += 1
        if c not in y.have:
            r.feed = feed
            feed.readers.append(r)
        self.note("pushed", r)
        fed = r.feed is not None
        r.declared = stream_rate(y.up, y.wan, y.active[False] + y.active[True] + 1, y.active[True] + 1, wan=True,
                                 arriving=r.feed.declared if fed else None)
        r.left = float(r.size)
        self._add_flow(r)
        return True

    def assembled(self, a: Req) -> float:
        """The checked prefix of a chunk arriving in stripes (``Partial.ready``): up to its first block
        that no stripe has brought whole."""
        n = next(iter(a.parts.values())).stripe[1]
        blocks = -(-a.size // self.block)
        first = blocks
        for s in range(n):
            r = a.parts.get(s)
            if r is None:
                got = 0
            elif s in a.done:
                got = len(range(s, blocks, n))
            else:
                got = int(self.s_got[r.serial] // self.block)
            first = min(first, s + got * n)
        return min(first * self.block, a.size)

    def stripes_stopped(self, a: Req) -> None:
        """The daemon's ``STRIPE_WAIT`` (plus the round trip between regions): no stripe of a chunk came for
        that long, or a region-mate holds it whole (``picker.stripes_stopped``); it is asked for whole."""
        y = a.dst
        if y.partial.get(a.chunk) is not a or any(q.stripe is not None for q in y.fetching.get(a.chunk, {}).values()):
            return
        near = any(a.chunk in k.have for k in y.known.values()
                   if k.node.region == y.region and not k.node.trainer and not k.stalled)
        if not stripes_stopped(self.now + 1e-9, a.fed_at, self.cfg.wan_rtt, near_whole=near):
            return
        del y.partial[a.chunk]
        y.unstriped.add(a.chunk)
        self.assemblies.discard(a)
        self.abort(a)
        self.dirty.add(y)

    def unstarted(self, z: Node, c: int, pusher: Node) -> Req | None:
        """z's one request out for chunk c, if no byte of it has come and it went to a rollout, the pusher
        itself included, not to the trainer (the daemon's ``Swarm._unstarted``: a push takes its place)."""
        reqs = z.fetching.get(c)
        if not reqs or len(reqs) != 1:
            return None
        (r,) = reqs.values()
        return r if r.left == 0.0 and self.s_got[r.serial] == 0 and not r.cancelled and not r.src.trainer else None

    def tell(self, y: Node, c: int, have: bool = True) -> None:
        """Have messages (or, ``have=False``, the exchange reply that shows a chunk y relays): every peer
        hears one one-way delay later."""
        near = [k.node for k in y.known.values() if k.node.region == y.region]
        far = [k.node for k in y.known.values() if k.node.region != y.region]
        fn = self.heard if have else self.heard_relaying
        if near:
            self.at(self.now + self.cfg.local_rtt / 2, fn, y, c, near)
        if far:
            self.at(self.now + self.cfg.rtt / 2, fn, y, c, far)

    def heard_relaying(self, y: Node, c: int, nodes: list[Node]) -> None:
        for z in nodes:
            if z.alive and z.done_at is None and c not in z.have and y.id in z.known:
                self.dirty.add(z)

    def heard(self, y: Node, c: int, nodes: list[Node]) -> None:
        for z in nodes:
            k = z.known.get(y.id)
            if k is None or not z.alive:
                continue
            if c not in k.have:
                k.have.add(c)
                if z.region == y.region and not y.trainer and (a := z.partial.get(c)) is not None \
                        and a.parts is not None:
                    self.at(self.now, self.stripes_stopped, a)  # a region-mate holds it whole: wait no more
                if len(k.have) < self.chunks:  # seen partly held (the daemon counts only partial have maps)
                    k.held += 1
                if z.trainer:
                    z.held_by[c] = z.held_by.get(c, 0) + 1
            if not z.aware and not z.trainer:
                z.aware = True  # the statements come with the first exchange that shows the version
            z.available_since.setdefault(c, self.now)
            if z.done_at is None and c not in z.have:
                self.dirty.add(z)
            if z.trainer:
                self.dirty.add(y)  # the trainer may offer it more now

    def plan(self, y: Node) -> None:
        """The daemon's ``_schedule`` for the current version."""
        now = self.now
        if y.trainer or not y.alive or not y.aware or y.done_at is not None:
            return
        if now - y.planned_at < self.cfg.plan_gap:
            self.dirty.add(y)  # again at the next tick: a daemon's scheduler runs one pass at a time
            return
        y.planned_at = now
        missing = [c for c in range(self.chunks) if c not in y.have]
        asked = [max(len(y.fetching.get(c, ())), c in y.partial) for c in missing]
        if min(asked) >= (2 if len(missing) <= y.picker.endgame_left else 1):
            return  # everything it lacks is asked for (twice in the endgame): nothing to decide
        y.counted, y.counted_known = recount(y.counted, y.counted_known,
                                             [(pid, k.held) for pid, k in y.known.items()
                                              if k.node.region == y.region and not k.node.trainer])
        trusted = {p for p in y.counted if p in y.known and not y.known[p].stalled}
        region_nodes = serving.crossers(y.id, y.gateways, lambda g: g in y.known and not y.known[g].stalled, trusted)
        # (the chunk's signed send time, as the trainer's daemon times it, where it signs one: ``Swarm._send_time``)
        y.picker.pace(self.chunk_size, self.cfg.wan_rtt,
                      self.chunk_size / self.cfg.trainer_rate if self.cfg.timed_tree else None)
        views = []
        haves = {}
        for pid, k in y.known.items():
            x = k.node
            if x.trainer:
                have = self.shown(x, y)
                for c in have:
                    y.available_since.setdefault(c, now)
            else:
                have = k.have
            haves[pid] = have
            fetching = self.shows_fetching(x)
            if not x.trainer and len(have) < len(x.have):
                # What x stored that y has not heard of yet still shows as fetching, as x's last reply
                # showed it: a daemon's have and fetching maps come in one reply, never neither.
                fetching = fetching | (x.have - have)
            views.append(PeerView(pid, x.rname, have, is_trainer=x.trainer, fetching=fetching,
                                  choking=self.choked_for(x, y) or now < k.cooldown_until, inflight=k.inflight,
                                  slots=slots_for_rate(rate := k.rate.rate(now), self.chunk_size),
                                  rate=rate, proven=pid in trusted, cut_through=self.cfg.cut_through and not x.trainer))
        inflight = {c: set(y.fetching.get(c, ())) for c in missing}
        for c in missing:  # arriving in stripes, between streams: not asked for until they stop coming
            if (a := y.partial.get(c)) is not None and a.parts is not None:
                inflight[c].add("")
        since = {c: y.available_since.get(c, now) for c in missing}
        for pid in y.picker.stalled(now, version=self.version, missing=missing, peers=views,
                                    region_nodes=region_nodes, available_since=since):
            y.known[pid].stalled = True
        asked_at = {c: min(r.sent for r in y.fetching[c].values()) for c in missing if y.fetching.get(c)}
        for q in y.picker.pick(now, version=self.version, missing=missing, inflight=inflight, peers=views,
                               region_nodes=region_nodes, available_since=since, asked_at=asked_at):
            x = self.by_id[q.peer_id]
            r = Req(y, x, q.index, self.version, self.sizes[q.index], serial=self._serial(),
                    whole=q.index in haves[x.id], readers=[], sent=now)
            y.fetching.setdefault(q.index, {})[x.id] = r
            y.partial.setdefault(q.index, r)  # the first request for a chunk feeds what the node relays
            if not r.whole:  # (requests for whole chunks are not held to the timeout here: they always move)
                send = r.size / self.cfg.trainer_rate if self.cfg.timed_tree else None  # its signed send time
                self.at(now + serving.stream_timeout(r.size, send), self.timed_out, r)
            y.known[x.id].inflight += 1
            self.note("asked", r)
            self.at(now + self.owd(y, x), self.request_arrives, r)

    # ------------------------------------------------------------ churn

    def leave(self, gone: list[Node]) -> None:
        for g in gone:
            g.alive = False
            self.near_trainer -= g.region == self.trainer.region
            self.near_wanting -= g.region == self.trainer.region and g in self.pending
            g.fetching, g.partial = {}, {}  # its peers learn it fetches nothing when their requests to it fail
            self.pending.discard(g)
            self.table.leave(g.id, self.table.get(g.id, self.now).epoch, self.now)
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
            z.superseed.forget(g.id)
        z.unchoked.discard(g.id)
        z.gateways = [i for i in z.gateways if i != g.id]
        if z.counted is not None:
            z.counted = z.counted - {g.id}
        self.dirty.add(z)

    # ------------------------------------------------------------ the run

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


def simulate(cfg: Config, progress=None) -> list[dict]:
    return Sim(cfg).run(progress=progress)


def _svg(points: dict[str, list[tuple[int, float]]], path: str) -> None:
    """A small line plot (log N against time to all over the bound), with no plotting library."""
    from pathlib import Path

    from ..checkpoint import atomic_file

    w, h, m = 560, 320, 50
    xs = [x for pts in points.values() for x, _ in pts]
    ys = [y for pts in points.values() for _, y in pts] + [1.0, 1.25]
    lx0, lx1 = math.log10(min(xs)), math.log10(max(xs)) + 1e-9
    y1 = max(ys) * 1.1

    def px(x):
        return m + (math.log10(x) - lx0) / (lx1 - lx0) * (w - 2 * m)

    def py(y):
        return h - m - y / y1 * (h - 2 * m)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
           f'font-size="12"><rect width="{w}" height="{h}" fill="white"/>',
           f'<line x1="{m}" y1="{h - m}" x2="{w - m}" y2="{h - m}" stroke="black"/>',
           f'<line x1="{m}" y1="{m}" x2="{m}" y2="{h - m}" stroke="black"/>',
           f'<line x1="{m}" y1="{py(1.25):.1f}" x2="{w - m}" y2="{py(1.25):.1f}" stroke="gray" '
           f'stroke-dasharray="4 3"/><text x="{w - m - 70}" y="{py(1.25) - 4:.1f}" fill="gray">target 1.25x</text>']
    for x in sorted(set(xs)):
        out.append(f'<text x="{px(x):.1f}" y="{h - m + 16}" text-anchor="middle">{x}</text>')
    for i in range(0, int(y1 * 2) + 1):
        y = i / 2
        out.append(f'<text x="{m - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
    out.append(f'<text x="{w / 2}" y="{h - 10}" text-anchor="middle">rollout nodes (log scale)</text>')
    out.append(f'<text x="14" y="{h / 2}" transform="rotate(-90 14 {h / 2})" text-anchor="middle">'
               'time to all / bound</text>')
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    for (name, pts), col in zip(points.items(), colours):
        pts = sorted(pts)
        path_d = " ".join(f"{'M' if i == 0 else 'L'}{px(x):.1f},{py(y):.1f}" for i, (x, y) in enumerate(pts))
        out.append(f'<path d="{path_d}" fill="none" stroke="{col}" stroke-width="2"/>')
        for x, y in pts:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{col}"/>')
        out.append(f'<text x="{m + 10}" y="{m + 14 + 16 * list(points).index(name)}" fill="{col}">{name}</text>')
    out.append("</svg>")
    with atomic_file(Path(path)) as tmp:
        tmp.write_text("\n".join(out) + "\n")


def run(*, nodes: list[int], regions: int, patch_mib: list[float], versions: int, chunk: int | None,
        trainer_rate: float, node_rate: float, wan_rate: float, link_rate: float, rtt: float, churn: float,
        seed: int, json_path: str | None = None, plot: str | None = None, cut_through: bool = True,
        trace_path: str | None = None, push: tuple[int, int] = DEFAULT_PUSH, burst: float = 0.0) -> int:
    from . import write_json, write_lines

    results, traces = [], []
    print(f"sparrowd bench sim: {regions} regions, trainer uplink {format_rate(trainer_rate)}, nodes "
          f"{format_rate(node_rate)} ({format_rate(wan_rate)} to other regions), links "
          f"{format_rate(link_rate)}, RTT {rtt * 1000:.0f} ms, relays "
          + ("cut-through" if cut_through else "store-and-forward")
          + (f", pushing to {push[0]} local and {push[1]} cross-region peers" if any(push) else ", pull only")
          + (f", {churn:.0%} of the nodes leave mid-version" if churn else "")
          + (f"; limits burst {burst:g} s" if burst else "")
          )
    for p in patch_mib:
        for n in nodes:
            cfg = Config(nodes=n, regions=regions, patch=int(p * MB), chunk=chunk, versions=versions,
                         trainer_rate=trainer_rate, node_rate=node_rate, wan_rate=wan_rate, link_rate=link_rate,
                         rtt=rtt, churn=churn, seed=seed, cut_through=cut_through, trace=trace_path is not None,
                         push=push, burst=burst)
            t = time.monotonic()
            sim = Sim(cfg)

            def row(r, n=n, p=p, cfg=cfg) -> None:
                r.update(patch_mib=p, rollouts=n, regions=regions)
                results.append(r)
                star = n * cfg.patch / cfg.trainer_rate + rtt
                print(f"   {n:>6} nodes, {format_bytes(cfg.patch):>9} in {r['chunks']:>3} chunks, version "
                      f"{r['version']}: all in {r['seconds']:7.2f} s ({r['time_over_bound']:.2f}x the bound of "
                      f"{cfg.bound:.2f} s{'' if r['all_done'] else ', NOT ALL'}; star {star / r['seconds']:.0f}x "
                      f"slower); trainer {r['trainer_upload_over_patch']:.2f}x the patch; cross-region "
                      f"{ratio_text(r['cross_region_over_r_minus_1'])} (R-1) x patch"
                      + (f"; {r['left']} left mid-version" if r["left"] else ""), flush=True)

            def tick(version: int, simulated: float, holding: int, live: int, n=n, cfg=cfg) -> None:
                print(f"   {n:>6} nodes, version {version}: {holding} of {live} hold it {simulated:.2f} s in (the "
                      f"bound {cfg.bound:.2f} s; {time.monotonic() - t:.0f} s of simulating so far)", flush=True)

            sim.run(progress=row, tick=tick)
            wall = time.monotonic() - t
            if sim.trace is not None:
                traces += [{"patch_mib": p, "rollouts": n, **e} for e in sim.trace]
            print(f"          (simulated in {wall:.1f} s)", flush=True)
    if plot:
        series: dict[str, list[tuple[int, float]]] = {}
        for r in results:
            if r["version"] == versions:
                series.setdefault(f"{r['patch_mib']:g} MiB", []).append((r["rollouts"], r["time_over_bound"]))
        _svg(series, plot)
        print(f"   plot written to {plot}")
    if json_path:
        write_json(json_path, {"runs": results})
    if trace_path:
        write_lines(trace_path, traces)
        print(f"   {len(traces)} request events written to {trace_path}")
    return 0
