"""What a simulation is made of: its ``Config``, the nodes (``Node``, what each knows of a peer:
``Known``) and the chunk requests (``Req``).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from ...codec.patch import auto_chunk_size
from ...swarm.choker import Choker
from ...swarm.leases import DEFAULT_PEER_LIMIT
from ...swarm.picker import Picker
from ...swarm.policy import OPTIMISTIC_EVERY, RELAY_CONCURRENT, SEED_CONCURRENT, UPLOAD_SLOTS
from ...swarm.push import DEFAULT_PUSH
from ...swarm.rate import Rate
from ...swarm.superseed import SuperSeed
from ...swarm.versions import block_for

__all__ = ["MB", "Config", "Req", "Known", "Node"]


MB = 1 << 20
CONCURRENT = {True: SEED_CONCURRENT, False: RELAY_CONCURRENT}  # chunks a node sends at once, by trainer or not


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
        one block. A relay hands a chunk on once a block has checked out, and each such hop takes at
        least two steps, so coarser steps overstate the time to all (evidence:
        docs/history/DESIGN-NOTES.md#sim-step)."""
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
    readers: list["Req"] = field(default_factory=list)  # as a node's partial: the streams served from it
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
        self.striped_to: dict[int, set[tuple[str, int]]] = {}  # chunk -> the (receiver, stripe)s it pushed
        self.first_hand: set[int] = set()  # chunks it took from the trainer (``stripe_targets``)
