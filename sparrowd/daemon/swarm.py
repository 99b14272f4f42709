"""The swarm driver: have-map exchange, chunk requests and uploads over HTTP.

Thin asyncio around the pure parts (``Picker``, ``Choker``, ``SuperSeed``,
``VersionState``, ``TokenBucket``, ``Rate``):

* Each node keeps one long-polling *exchange* with each peer in its tracker
  peer list: the request carries its own have-maps and what it is fetching,
  the reply (when something changed, or after a few seconds) carries the
  peer's signed statements it lacks, the peer's have-maps, and whether the
  peer chokes it. Have messages therefore arrive within one round trip: storing a
  chunk answers the long polls waiting on this node (and a quick exchange tells the trainer).
* What a node fetches is what ``chain.wanted`` says: the patches from its
  position to the newest version, or, when that chain is broken (a late
  node), the newest anchor and the patches after it.
* A scheduler asks the picker for requests whenever something changed and
  fetches chunks (``GET /v1/swarm/chunk/KEY/I``, KEY ``12`` for version 12's
  patch, ``a12`` for its anchor), oldest first. Each
  chunk is checked against its signed BLAKE3 hash before it is stored or
  served; a peer that sends a bad chunk is banned for the session.
* Cut-through (``cutthrough.Partial``): each block of a chunk is checked
  against the block hashes the trainer's announcement signed as it arrives,
  and a relay serves the chunks it is fetching as well as those it holds,
  block by block, so a chunk moves down a chain of nodes a block behind the
  first instead of a chunk behind at each hop. While a chunk arrives, a relay
  streams it to no more peers at once than its upload limit carries at the
  rate it comes in (every stream declares its rate, ``RATE_HEADER``;
  ``swarm.push.relay_fanout``); the rest wait until it is whole. Exchange replies say
  ``cut_through``, and a node's ``fetching`` map is then a source for its
  peers' pickers; starting a fetch wakes the peers' long polls so they learn
  it at once. A stream whose feeding fetch fails is cut, and the requester
  goes back to its picker, without holding it against that peer.
* Push (``swarm.push``): a relay sends what it can serve unasked, to its
  neighbours and across along the chunk's region tree; where regions are
  small the chunk crosses in stripes instead (``stripe_plan``: the first
  holder sends each region's receiver one stripe of its blocks, each
  receiver hands its stripe to every other), taken into one ``Partial``.
* The serving side answers exchanges and chunk requests. A relay serves
  whoever asks while fewer than ``QUEUE_ADMIT`` requests wait in the request's
  lane (503 "choked" beyond; uploads to its own region and to other regions
  are separate lanes, each with ``RELAY_CONCURRENT`` slots); the trainer serves the peers its choker unchokes and
  shows each only what super-seeding offers it. Unlimited uploads are aiohttp FileResponses: sendfile on asyncio's
  loop; uvloop does not implement loop.sendfile, so there aiohttp reads and
  writes in pieces: one copy through user space per chunk served.
* The trainer publishes through ``/v1/publish/...``: each chunk is signed
  into an announcement as it arrives, so chunks move before the manifest.
* Peers are members the tracker vouches for: a request names its node
  (``X-Sparrowd-Node``), carries its lease's ticket (``X-Sparrowd-Ticket``,
  signed by the trainer) and a proof made with the ticket's key for this
  receiver and that lease (``X-Sparrowd-Proof``, ``swarm.identity``). ``admit``
  checks them from the headers alone, before any body is read; the region a
  peer is treated as in is the ticket's, not what it says. No join secret is
  ever sent to a peer. A peer that advertises a chunk it then does not serve is
  banned for the session.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import json
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import blake3
from aiohttp import web
from yarl import URL

from ..codec.chunk import check_chunk_frame
from ..codec.manifest import Manifest
from ..errors import FormatError, IntegrityError, SparrowError
from ..schema import Bool, Bytes, Int, List, NonNegInt, Opt, Str, fields, pack, unpack
from ..swarm import serving
from ..swarm.bucket import DEFAULT_BURST, TokenBucket
from ..swarm.budget import Budgets
from ..swarm.chain import Key, advance, retained, wanted
from ..swarm.choker import Choker, ChokerPeer
from ..swarm.identity import (
    NODE_HEADER,
    PROOF_HEADER,
    PROOF_TTL,
    TICKET_HEADER,
    Refused,
    Ticket,
    check_proof,
    make_proof,
)
from ..swarm.picker import PeerView, Picker, recount, slots_for_rate, stripes_stopped
from ..swarm.policy import (
    CHOKE_EVERY,
    DISCOVERY_EVERY,
    EXCHANGE_WAIT,
    LIVE_EVERY,
    LIVE_WITHIN,
    MIN_RATE,
    NOT_YET_RETRY,
    OPTIMISTIC_EVERY,
    PLAN_EVERY,
    PUSH_CLAIM,
    PUSH_STATEMENT_WAIT,
    PUSH_TRIES,
    PUSHES_TAKEN,
    QUEUE_ADMIT,
    QUICK_PACE,
    QUICK_REPLIES,
    RELAY_CONCURRENT,
    ROW_EVERY,
    SEED_CONCURRENT,
    SEED_PER_PEER,
    SEED_SINGLE_FROM,
    STORE_PAUSE_MAX,
    STRIPED_TAKEN,
    UPLOAD_SLOTS,
    UPLOADS_PER_PEER,
)
from ..swarm.push import (
    RATE_HEADER,
    STRIPE_HEADER,
    PushPeer,
    parse_stripe,
    push_heads,
    push_targets,
    region_tree,
    stream_rate,
    stripe_blocks,
    stripe_plan,
    stripe_size,
    stripe_targets,
    stripes_handed_on,
    tree_timing,
)
from ..swarm.rate import Rate
from ..swarm.serving import Slots, store_pause, stream_timeout
from ..swarm.signing import Signed, Signer, Verifier, announce_kind, manifest_kind
from ..swarm.superseed import SuperSeed
from ..swarm.versions import (
    BLOCK_HASH,
    MAX_TREE_US,
    ChunkRef,
    StatementPage,
    VersionState,
    announce_body,
    block_for,
    block_hashes,
    check_kind,
    from_bitmap,
    to_bitmap,
)
from .bodies import read_limited
from .cutthrough import Partial
from .logs import Throttle, event
from .store import ChunkStore

__all__ = ["Swarm", "MSGPACK", "MAX_CHUNK", "NODE_HEADER", "REGION_HEADER", "MIN_RATE", "QUEUE_ADMIT",
           "RELAY_CONCURRENT", "SEED_PER_PEER", "SEED_SINGLE_FROM", "STORE_PAUSE_MAX", "UPLOAD_SLOTS", "store_pause",
           "stream_timeout"]

log = logging.getLogger("sparrowd.swarm")

MSGPACK = "application/msgpack"
MAX_CHUNK = 64 << 20
MAX_EXCHANGE = 16 << 20  # an exchange reply (its statements); a request carries have-maps only:
MAX_EXCHANGE_REQUEST = 1 << 20
MAX_VERSIONS_SHOWN = 256  # versions one exchange request may describe (a node retains a few)
UNKNOWN_HAVE_BYTES = 1024  # of a have-map for a version this node does not know yet
REGION_HEADER = "X-Sparrowd-Region"
ROOT_HEADER = "X-Sparrowd-Root"  # on a chunk's stream: the region it entered the swarm in (swarm.push.region_tree)
# On a push: the trainer's signed statement announcing the chunk (base64), so that a node that has not
# heard of the version yet can check its blocks at once; left off above STATEMENT_HEADER_MAX characters.
STATEMENT_HEADER, STATEMENT_HEADER_MAX = "X-Sparrowd-Statement", 6144
# On a push: the other peers the pusher sends the same chunk to, comma-separated; the receiver does
# not push it to them (siblings fed by the same sender). Ignored past ALSO_HEADER_MAX characters.
ALSO_HEADER, ALSO_HEADER_MAX = "X-Sparrowd-Also", 2048
PIECE = 256 << 10
NO_HASHES = "no signed block hashes for that chunk here yet"


class NotYet(SparrowError):
    """A peer answered an exchange 503: it does not know this node yet (it joined a moment ago and
    the peer asks the tracker about it) or it is stopping. Alive, so not stalled: in a swarm just
    formed every node meets these, and marking the peer stalled kept its neighbours from counting
    on it to cross for the first version (``bench swarm``, 8 nodes: a third of a region's chunks
    crossed twice)."""


_EXCHANGE_REQ = {"node_id": Str, "region": Str, "after": Int, "wait": Opt(Int), "versions": List,
                 "joined_after": Opt(Int),  # to the trainer: the latest join it told of (TrackerService.joined_since)
                 "delay_us": Opt(NonNegInt)}  # to the trainer: its one-way delay between regions (Swarm.wan_delay)
_VERSION_REQ = {"version": NonNegInt, "anchor": Opt(Bool), "statements": NonNegInt, "have": Bytes, "fetching": Bytes}
_VERSION_REP = {"version": NonNegInt, "anchor": Opt(Bool), "statements": List, "have": Bytes, "fetching": Bytes,
                "pushing": Opt(Bytes)}


@dataclass
class PeerState:
    node_id: str
    address: str
    region: str
    role: str
    have: dict[Key, set[int]] = field(default_factory=dict)
    fetching: dict[Key, set[int]] = field(default_factory=dict)
    choking: bool = False
    inflight: int = 0
    rate: Rate = field(default_factory=Rate)
    task: asyncio.Task | None = None
    gen: int = -1
    telling: bool = False  # a quick exchange with it (a have message) is under way
    tell_again: bool = False
    strikes: int = 0  # requests that timed out or failed in a row
    cooldown_until: float = 0.0  # no requests to it before then (a stalled or failing peer)
    quick: int = 0  # exchange replies in a row that came back early with nothing new
    stalled: bool = False  # designated to bring chunks across and did not: left out until it delivers
    held: int = 0  # chunks its have maps showed while partial, all versions (``count_on``)
    pushing: dict[Key, set[int]] = field(default_factory=dict)  # chunks it said it is pushing to this node...
    pushing_at: float = 0.0  # ...in the reply taken then (a claim kept for PUSH_CLAIM seconds at most)
    cut_through: bool = False  # it serves the chunks it is fetching too (its exchange replies say so)
    proof: tuple[float, int, str] = (0.0, -1, "")  # (made at, epoch, proof) for this peer: remade every PROOF_TTL / 2
    rtt: float | None = None  # the shortest exchange with it, seconds: the round trip (one answered at once;
    #                           one that opened its connection counts half, TCP's handshake being a round trip)


@dataclass
class Remote:
    """A peer as seen from the serving side."""

    node_id: str
    region: str
    have: dict[Key, set[int]] = field(default_factory=dict)
    last_seen: float = 0.0
    rate_to: Rate = field(default_factory=Rate)
    uploads: int = 0
    delay: float | None = None  # its one-way delay between regions, as it measured it (to the trainer)


def _view(ps: PeerState) -> tuple:
    """What an exchange reply can tell about a peer: a reply that changes none of it was empty."""
    return ({k: frozenset(v) for k, v in ps.have.items()}, {k: frozenset(v) for k, v in ps.fetching.items()},
            ps.choking)


def _new_connections() -> aiohttp.TraceConfig:
    """Marks a request that opened a connection of its own (``trace_request_ctx``'s ``new``): its
    time counts TCP's handshake, a round trip, before the request's own."""
    trace = aiohttp.TraceConfig()

    async def opened(session, ctx, params) -> None:
        if isinstance(ctx.trace_request_ctx, dict):
            ctx.trace_request_ctx["new"] = True

    trace.on_connection_create_end.append(opened)
    return trace


class Swarm:
    def __init__(self, daemon, store: ChunkStore, *, signer: Signer | None, retain: int,
                 upload_rate: int | None, download_rate: int | None, wan_upload_rate: int | None,
                 rate_burst: float = DEFAULT_BURST):
        self.daemon = daemon
        self.store = store
        self.signer = signer
        self.verifier: Verifier | None = Verifier(signer.public) if signer else None
        self.retain = retain
        # The version this node can produce, kept on disk: the base model (0) until it moves, or
        # nothing (-1) for a node that keeps a current folder, which starts from an anchor.
        self.at = -1 if daemon.settings.keeps_current else 0
        self.versions: dict[Key, VersionState] = {}  # patches and anchors
        self.trainer_heard = False  # an exchange with the trainer told this node what the chain holds
        self.engine_floor: int | None = None  # the oldest version an attached engine holds
        self.current_floor: int | None = None  # the current-version folder's version (-1: none yet)
        self.pinned: set[Key] = set()  # objects being read from disk (the folder's builder): kept from retention
        self.peers: dict[str, PeerState] = {}
        self.remotes: dict[str, Remote] = {}
        self._live_regions: set[str] = set()  # the regions of the peers _live() counted
        self._live_delay: float | None = None  # the median one-way delay they measured (the trainer's, _live)
        self._live_at, self._live_count = float("-inf"), (0, 0, 0, 0)  # _live(): peers heard from lately, when
        self.held_by: dict[Key, collections.Counter] = {}  # per object: chunk -> peers whose have-maps show it
        self._showing = 0  # peers whose have-maps show any chunk
        self._discovered_at = -DISCOVERY_EVERY  # last early renewal for a stranger (_discover)
        self.banned: set[str] = set()
        self.contacts: dict[str, PeerState] = {}  # other regions' heads met only through pushes (``_peer``)
        self._joins_seen = 0  # the latest join the trainer told of (its exchange replies' ``joins``)
        self._announced = asyncio.Event()  # set, and replaced, as peers' statements arrive (``handle_push``)
        # Set when a new version begins (the trainer's first chunk of it): every peer is interested
        # again, and slots held by peers of other regions since the last version would keep the first
        # copies from the trainer's own region for up to a second (``first_copies_near``).
        self._rechoke = asyncio.Event()
        self.refused: collections.Counter = collections.Counter()  # requests refused at the door, by reason
        self.bans: collections.Counter = collections.Counter()  # peers banned, by reason
        self.lies = 0  # chunks peers advertised and did not serve
        self._proofs_ok: dict[tuple[str, int, str], float] = {}  # (node, epoch, proof) -> checked at
        self._tickets: dict[str, Ticket | None] = {}  # ticket text -> its claims (None: not this swarm's)
        self.budgets = Budgets()  # what each peer's exchanges may cost this node (swarm.budget)
        self._row_told = float("-inf")  # when the trainer last renewed early to report its uploads
        self._refusal_log = Throttle(10.0)  # a warning per refusal reason every 10 s
        self.gen = 0
        self._changed = asyncio.Event()
        self._waiters = asyncio.Condition()
        self._closing = False  # set by stop: long polls answer at once
        self.inflight: dict[tuple[Key, int], dict[str, asyncio.Task]] = {}
        self.asked_at: dict[tuple[Key, int], float] = {}  # when a chunk in flight was asked for (the endgame)
        self.available_since: dict[tuple[Key, int], float] = {}
        self.partials: dict[tuple[Key, int], Partial] = {}  # chunks being fetched, served cut-through
        self.unstriped: set[tuple[Key, int]] = set()  # chunks whose stripes stopped short: asked for whole
        self.cut_through_bytes = 0  # bytes served from chunks still arriving
        self.turns_waited = 0  # requests for a chunk still arriving that waited for a stream of it to end
        self.pushed: dict[Key, dict[int, dict[str, bool]]] = {}  # per chunk: the peers pushed to (True: across)
        self.striped_to: dict[Key, dict[int, set[tuple[str, tuple[int, int]]]]] = {}  # per chunk: (receiver, (s, n))
        self.fed_along: dict[Key, dict[int, frozenset[str]]] = {}  # per chunk: the peers its pusher also fed
        self.pushes: collections.Counter = collections.Counter()  # taken, refused, failed; received, declined
        self.stripes: collections.Counter = collections.Counter()  # sent (pushed and taken), received (whole)
        self._background: set[asyncio.Task] = set()  # pushes being sent, wake-ups: stop() ends them
        self.pushing_to: set[tuple[str, Key, int]] = set()  # (peer, object, chunk) being pushed (its exchange
        # replies say so, so that it does not ask for them meanwhile: both news reach it at the same moment)
        self._taking: set[asyncio.Task] = set()  # pushes being received
        self._taking_stripes: set[asyncio.Task] = set()  # ...of them, stripes (``STRIPED_TAKEN``)
        self.picker = Picker(daemon.node_id, daemon.settings.region)
        self.choker = Choker(slots=UPLOAD_SLOTS, optimistic_interval=OPTIMISTIC_EVERY)
        self.unchoked: set[str] = set()
        self.superseed: dict[Key, SuperSeed] = {}
        # Per version: the region's peers counted on, and those known when that was decided (recount).
        self.counted: dict[Key, tuple[frozenset[str], frozenset[str]]] = {}
        self.up = TokenBucket(upload_rate, burst_seconds=rate_burst)
        self.down = TokenBucket(download_rate, burst_seconds=rate_burst)
        self.wan_up = TokenBucket(wan_upload_rate, burst_seconds=rate_burst)
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        # A node's uplink finishes a few chunks at a time rather than many at once: a finished chunk
        # can be relayed, a half-sent one cannot. A relay has two lanes (``_lane``), each with its own
        # slots and queue; the trainer one.
        if signer:
            seed = asyncio.Semaphore(SEED_CONCURRENT)
            self._uploads = {False: seed, True: seed}
        else:
            self._uploads = {lane: asyncio.Semaphore(RELAY_CONCURRENT) for lane in (False, True)}
        self._waiting = {False: 0, True: 0}  # chunk requests waiting, by lane (a relay admits while few do)
        self._busy = {False: 0, True: 0}  # uploads being sent, by lane
        self._spawned = {False: 0, True: 0}  # pushes started that have not taken their slot yet
        self._told_choked = {False: False, True: False}  # a peer heard "choked" for the lane since it had room
        self.error: str | None = None
        # After a chunk could not be stored (a full disk), fetching pauses, longer each time in a row,
        # rather than downloading chunks only to drop them.
        self.store_failures = 0
        self.store_paused_until = 0.0

    # ------------------------------------------------------------ lifecycle

    def load(self) -> None:
        self.versions = self.store.load(self.verifier)
        self.at = self.store.read_position(self.at)
        for vs in self.versions.values():
            if self.signer and vs.total is not None:
                self.superseed[vs.key] = _superseed(vs.total)
        if self.versions:
            event(log, logging.INFO, "chunk store loaded", versions=len(self.versions),
                  chunks=sum(len(v.have) for v in self.versions.values()))

    def set_verifier(self, verifier: Verifier) -> None:
        if self.verifier is None:
            self.verifier = verifier
            self.load()

    def start(self) -> None:
        # No Authorization header: a join secret goes to the tracker only, never to a peer.
        self._session = aiohttp.ClientSession(connector=self.daemon.outgoing(), connector_owner=False, headers={
            NODE_HEADER: self.daemon.node_id, REGION_HEADER: self.daemon.settings.region},
            trace_configs=[_new_connections()])
        if self.signer is not None:
            self._tasks.append(asyncio.create_task(self._choke_loop(), name="choker"))
        else:  # relays admit by queue depth (_may_download)
            self._tasks.append(asyncio.create_task(self._peer_manager(), name="peers"))
            self._tasks.append(asyncio.create_task(self._scheduler(), name="scheduler"))

    def _proof_for(self, ps: PeerState) -> dict:
        """The headers that prove to ``ps`` that this request comes from this node, a member: the
        lease's ticket and a proof for ``ps`` and that lease."""
        m = self.daemon.membership
        ticket, epoch = (m.state.ticket, m.state.epoch) if m is not None else (None, None)
        if ticket is None or epoch is None:
            return {}
        now = time.time()
        made, made_for, proof = ps.proof
        if now - made > PROOF_TTL / 2 or made_for != epoch:
            proof = make_proof(self.daemon.key, self.daemon.node_id, ps.node_id, now, epoch)
            ps.proof = (now, epoch, proof)
        return {TICKET_HEADER: ticket, PROOF_HEADER: proof}

    async def stop(self) -> None:
        # Peers' long polls end now, answered, instead of holding the shutdown for their wait.
        async with self._waiters:
            self._closing = True
            self._waiters.notify_all()
        tasks = self._tasks + [p.task for p in self.peers.values() if p.task]
        tasks += [t for ts in self.inflight.values() for t in ts.values()] + list(self._background)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def changed(self, after: int, wait: float) -> None:
        """Return once ``gen`` moves past ``after`` (something was stored, signed or decided), or
        after ``wait`` seconds."""
        if after >= self.gen and wait > 0 and not self._closing:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancel that
            # lands as the wait ends, and the loops that call this would then never stop.
            try:
                async with asyncio.timeout(wait), self._waiters:
                    await self._waiters.wait_for(lambda: self.gen > after or self._closing)
            except TimeoutError:
                pass

    def _touch(self) -> None:
        self.gen += 1
        self._changed.set()

    async def notify(self) -> None:
        """Wake everything waiting on ``changed`` (also the current folder, once it decoded a version
        for the engines)."""
        self._touch()
        async with self._waiters:
            self._waiters.notify_all()

    def wake(self) -> None:
        """``notify`` from synchronous code: the tracker's join hook (its news goes out with the
        exchange replies the long polls then get)."""
        task = asyncio.get_running_loop().create_task(self.notify())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------ what the node reports

    def held(self) -> list[int]:
        """Versions this node holds whole (a patch, or an anchor)."""
        return sorted({k.version for k, vs in self.versions.items() if vs.complete})

    def held_at(self) -> dict[str, float]:
        """When this node came to hold each patch it fetched in this run, whole: wall-clock seconds."""
        return {str(k.version): vs.held_at for k, vs in sorted(self.versions.items())
                if vs.held_at is not None and not k.anchor}

    def position(self) -> int:
        """The newest version this node can produce: from the base model (or an anchor) through
        the patches it completed (``chain.advance``). The trainer's is the newest it published."""
        if self.signer is not None:
            return max(self.held(), default=self.at)
        at = advance(self.at, {k: vs.obj for k, vs in self.versions.items()})
        if at != self.at:
            self.at = at
            self.store.write_position(at)
        return at

    def wanted(self) -> set[Key]:
        """What this node fetches: ``chain.wanted`` from its position, and from its engine's and
        its folder's when they are behind (they may need an anchor the node itself does not)."""
        known = {k: vs.obj for k, vs in self.versions.items()}
        starts = {self.position()} | {v for v in (self.engine_floor, self.current_floor) if v is not None}
        return set().union(*(wanted(at, known, chain_known=self.trainer_heard) for at in starts))

    def floor(self) -> int:
        """The oldest version this node, its engine or its folder stands at."""
        return min([self.position()] + [v for v in (self.engine_floor, self.current_floor) if v is not None])

    def progress(self) -> tuple[int, int, int] | None:
        pending = [self.versions[k] for k in self.wanted() if k in self.versions and not self.versions[k].complete]
        if not pending:
            return None
        vs = min(pending, key=lambda x: x.key)
        return vs.version, len(vs.have), vs.total if vs.total is not None else len(vs.chunks)

    def _fetching(self, key: Key) -> set[int]:
        """Chunks of ``key`` this node tells its peers it is "about to" have: those it has requests
        out for or, relaying cut-through, those of them it can serve already (a block checked out).
        Shown from the request on, partials would be picked as sources before they had data and
        could end up fed by each other in a circle, none fetching from a whole copy (``bench sim``:
        versions never finished)."""
        if self._relays_partials():
            return {i for (k, i), part in self.partials.items() if k == key and part.servable}
        return {i for (k, i) in self.inflight if k == key}

    def _relays_partials(self) -> bool:
        return self.signer is None and self.daemon.settings.cut_through

    def latest(self) -> int | None:
        return max(self.held(), default=None)

    # ------------------------------------------------------------ statements

    def _version(self, key: Key) -> VersionState:
        vs = self.versions.get(key)
        if vs is None:
            vs = self.versions[key] = VersionState(key.version, key.anchor)
        return vs

    def _take_statement(self, vs: VersionState, s: Signed) -> list[int]:
        before = len(vs.statements)
        new = vs.add(s, self.verifier)
        if len(vs.statements) == before:
            return new  # seen before
        self.store.add_statement(vs, s)
        if new and log.isEnabledFor(logging.DEBUG):
            for i in new:
                event(log, logging.DEBUG, "chunk announced", object=str(vs.key), index=i, tree=vs.trees.get(i))
        if s.is_manifest:
            event(log, logging.INFO, "manifest received", version=vs.version, anchor=vs.anchor, chunks=vs.total,
                  base_version=vs.base_version)
        return new

    def _complete(self, vs: VersionState) -> None:
        """This node came to hold ``vs`` whole: by its last chunk, or by its manifest when every chunk
        it names was here first (a pushed chunk can outrun the manifest, which then completed the
        version unannounced: no event, no prompt report, no ``held_at``)."""
        vs.held_at = time.time()
        event(log, logging.INFO, "anchor complete" if vs.anchor else "version complete", version=vs.version,
              chunks=vs.total, position=self.position())
        self.retire()
        self.daemon.report_changed()

    def retire(self) -> None:
        """Retention (``chain.retained``): the last ``retain`` patches, the newest anchor and every
        patch after it. Of what is not complete, what this node will never want goes too."""
        known = [k.version for k, vs in self.versions.items() if k.anchor and vs.manifest is not None]
        keep = retained(((k, vs.obj) for k, vs in self.versions.items() if vs.complete), self.retain,
                        max(known, default=None))
        at = self.floor()
        # What this node's engine or folder still has to apply stays too.
        keep.update(k for k, vs in self.versions.items() if not k.anchor and vs.complete and k.version > at)
        want = self.wanted() if self.signer is None else set()
        for k, vs in list(self.versions.items()):
            if k in keep or k in self.pinned or (
                    not vs.complete and (self.signer is not None or k.version > at or k in want)):
                continue
            self.store.drop(k)
            del self.versions[k]
            self.superseed.pop(k, None)
            self.pushed.pop(k, None)
            self.striped_to.pop(k, None)
            self.fed_along.pop(k, None)
            for pk in [pk for pk, p in self.partials.items() if pk[0] == k and p.striped and not p.feeders]:
                self.partials.pop(pk).abort()  # stripes of it that stopped short, not yet given up
            event(log, logging.INFO, "dropped (retention)", object=str(k), retain=self.retain)

    # ------------------------------------------------------------ publishing (trainer)

    async def publish_chunk(self, key: Key, index: int, data: bytes) -> dict:
        """Sign and store one chunk as it arrives. It must be a zstd frame of a sane size, so
        garbage is refused here rather than signed and sent everywhere (a full decode would cost
        the publisher tens of milliseconds a chunk; the engines decode and check every chunk)."""
        check_chunk_frame(data)
        vs = self._version(key)
        ref = ChunkRef(blake3.blake3(data).digest(), len(data))
        known = vs.chunks.get(index)
        if vs.manifest is not None and known is None:
            raise FormatError(f"{key} is complete; it has no chunk {index}")
        if known is not None:
            if known != ref:
                raise IntegrityError(f"{key}: chunk {index} was published with another hash")
            return {"index": index, "new": False}
        block = vs.block or block_for(len(data))  # one block size a version, from its first chunk
        s = self.signer.sign(announce_kind(key.anchor), key.version,
                             announce_body(index, [ref], [block_hashes(data, block)], block,
                                           tree=tree_timing(len(data), block, self.up.rate, self.delay())))
        self._take_statement(vs, s)
        await asyncio.to_thread(self.store.put_chunk, vs, index, data)
        if not vs.have:  # a new version: every peer wants it; decide whom to serve now, and count again
            self._rechoke.set()
            self._live_at = float("-inf")
        vs.have.add(index)
        self.superseed.setdefault(key, _superseed(0)).grow(len(vs.chunks))
        await self.notify()
        return {"index": index, "new": True}

    def delay(self) -> float | None:
        """The one-way delay between regions: on the trainer, the median of what the nodes it heard
        from in the last 30 s measured; on a relay, its own measurement (``wan_delay``)."""
        if self.signer is not None:
            self._live()
            return self._live_delay
        return self.wan_delay()

    def published(self) -> dict:
        """The chain as published: the newest version, its manifest's BLAKE3, the newest anchor; and
        what the Publisher cuts the next patch by (``auto_chunk_size``): the swarm's size, this
        daemon's upload limit (None: unlimited) and the round trip between regions."""
        done = [vs for vs in self.versions.values() if vs.complete]
        latest = max(done, key=lambda vs: (vs.version, not vs.anchor), default=None)
        anchors = [vs.version for vs in done if vs.anchor]
        return {"latest": latest.version if latest else None,
                "manifest": blake3.blake3(latest.manifest.to_bytes()).hexdigest() if latest else None,
                "anchor": max(anchors, default=None), "rollouts": self.rollouts(),
                "uplink": self.up.rate or None, "round_trip": self._round_trip()}

    def _round_trip(self) -> float | None:
        """The round trip between regions as the rollouts measured it (twice ``delay``), None before
        any did: with the uplink, the Publisher sends a patch of a few round trips' sending whole."""
        d = self.delay()
        return None if d is None else 2 * d

    def rollouts(self) -> int | None:
        """The live rollouts (and relays) the tracker holds leases for, None where this daemon hosts no
        tracker: the Publisher cuts the next patch for a swarm of that size (``auto_chunk_size``)."""
        t = self.daemon.tracker
        return None if t is None else t.table.rollouts(t.clock())

    async def publish_manifest(self, data: bytes) -> dict:
        """A patch's manifest (it names its base) or an anchor's (it applies to nothing).
        A patch must apply to the newest version published and be newer; an anchor snapshots
        the newest version, or starts a newer one (for a change a patch cannot carry)."""
        m = Manifest.from_bytes(data)
        key = Key(m.version, m.base_version is None)
        check_kind(m, key.anchor)
        vs = self._version(key)
        if vs.manifest is not None:
            if vs.manifest.to_bytes() == m.to_bytes():
                return {"version": m.version, "anchor": key.anchor, "chunks": vs.total, "new": False}
            raise FormatError(f"{key} was published with another manifest")
        missing = [i for i in range(len(m.chunks)) if i not in vs.have]
        if missing:
            raise FormatError(f"{key}: {len(missing)} chunks not published yet (first {missing[0]})")
        latest = self.published()["latest"]
        if latest is not None:
            if key.anchor and m.version < latest:
                raise FormatError(f"anchor {m.version} is older than the latest published version, {latest}")
            if not key.anchor and m.version <= latest:
                raise FormatError(f"version {m.version} is not newer than the latest published, {latest}")
            if not key.anchor and m.base_version != latest:
                raise FormatError(f"version {m.version} applies to {m.base_version}, "
                                  f"but the latest published is {latest}")
        self._take_statement(vs, self.signer.sign(manifest_kind(key.anchor), m.version, m.to_bytes()))
        self.superseed.setdefault(key, _superseed(0)).grow(len(vs.chunks))
        if self.daemon.tracker is not None:
            self.daemon.tracker.table.set_latest_version(max(m.version, latest or 0))
        event(log, logging.INFO, "anchor published" if key.anchor else "version published", version=m.version,
              chunks=len(m.chunks), bytes=m.patch_bytes, base_version=m.base_version)
        self.retire()
        await self.notify()
        self.daemon.report_changed()  # the trainer's own row shows the version now, as a node's does
        return {"version": m.version, "anchor": key.anchor, "chunks": len(m.chunks), "new": True}

    # ------------------------------------------------------------ serving side

    def forget(self, node_id: str) -> None:
        """A node's lease ended: what super-seeding gave it goes to others, its view is dropped."""
        for ss in self.superseed.values():
            ss.forget(node_id)
        if (r := self.remotes.pop(node_id, None)) is not None:
            self._set_have(r, {})

    def admit(self, request: web.Request) -> Remote | web.Response:
        """The peer a request comes from, from its headers alone: a ticket this swarm's trainer signed,
        neither expired nor revoked, naming the node the request names, and a proof made with the
        ticket's key for this node and that lease. Otherwise the refusal to send (401: no member;
        403: a member's ticket without its key; 503: this node cannot check yet), counted and logged
        at most every few seconds per reason. Nothing of the body has been read."""
        node = request.headers.get(NODE_HEADER, "")[:64]
        text = request.headers.get(TICKET_HEADER, "")
        if not node or not text:
            return self._refuse(request, node, "no-ticket", 401,
                                f"a peer request carries {NODE_HEADER}, {TICKET_HEADER} and {PROOF_HEADER}")
        trainer = self.signer.public if self.signer is not None else \
            self.verifier.public if self.verifier is not None else None
        if trainer is None:
            return self._refuse(request, node, "unknown", 503, "this node has no lease yet (try again)")
        ticket = self._ticket(text, trainer)
        if ticket is None or ticket.node_id != node:
            return self._refuse(request, node, "bad-ticket", 401, "not a ticket of this swarm for that node")
        now = time.time()
        m, t = self.daemon.membership, self.daemon.tracker
        try:
            ticket.check(now, t.credentials if t is not None else m.state.revoked if m is not None else ())
        except Refused as e:
            return self._refuse(request, node, e.reason, 401, str(e))
        if t is not None:  # the tracker's own table: a lease that ended is refused at once
            lease = t.table.get(node, now)
            if lease is None or lease.epoch != ticket.epoch:
                return self._refuse(request, node, "lease-ended", 401, f"node {node!r} holds no lease at "
                                                                       f"epoch {ticket.epoch}")
        if not self._proof_ok(node, ticket.key, ticket.epoch, request.headers.get(PROOF_HEADER, "")):
            return self._refuse(request, node, "impostor", 403, f"no valid proof of being node {node!r}")
        if self.signer is None and self.daemon.member(node) is None:
            self._discover(node)  # a relay with no entry of this member: the tracker lists it soon
        return self._remote(node, ticket.region)

    def _remote(self, node: str, region: str) -> Remote:
        """The admitted peer's state here, heard from now."""
        r = self.remotes.get(node)
        if r is None:
            r = self.remotes[node] = Remote(node, region)
        r.last_seen = time.monotonic()
        if r.region not in self._live_regions:
            # A region not counted yet is counted again at once, so that the trainer's first copies
            # stay near from the first exchange of that region (``first_copies_near``).
            self._live_at = float("-inf")
        return r

    def _ticket(self, text: str, trainer: bytes) -> Ticket | None:
        """A ticket's claims, its signature checked once per text (None: not signed by this trainer)."""
        if text not in self._tickets:
            if len(self._tickets) > 8192:
                self._tickets.clear()
            try:
                self._tickets[text] = Ticket.parse(text, trainer)
            except (FormatError, Refused):
                self._tickets[text] = None
        return self._tickets[text]

    def _proof_ok(self, node: str, key: bytes, epoch: int, proof: str) -> bool:
        now = time.time()
        checked = self._proofs_ok.get((node, epoch, proof))
        if checked is not None and now - checked < PROOF_TTL:
            return True
        if not check_proof(proof[:200], key, node, self.daemon.node_id, now, epoch):
            return False
        if len(self._proofs_ok) > 8192:
            self._proofs_ok.clear()
        self._proofs_ok[(node, epoch, proof)] = now
        return True

    def _refuse(self, request: web.Request, node: str, reason: str, status: int, text: str) -> web.Response:
        self.refused[reason] += 1
        if reason != "unknown" and self._refusal_log.due(reason, time.monotonic()):
            event(log, logging.WARNING, "refused a peer request", reason=reason, node=node or "?",
                  remote=request.remote or "?", path=request.path[:100])
        return web.json_response({"error": text}, status=status, headers={"Retry-After": "1"})

    def _discover(self, node: str) -> None:
        """A node this one does not know asked for something: it joined after this node's last
        renewal, or is not in this node's sample of a large swarm. Ask the tracker about it (and
        for a fresh peer list) with a renewal now, at most once a second: the tracker's word, not
        what the stranger says about itself, so a swarm just formed relays at once."""
        m = self.daemon.membership
        if m is None or self.signer is not None:
            return
        m.ask(node)
        now = time.monotonic()
        if now - self._discovered_at >= DISCOVERY_EVERY:
            self._discovered_at = now
            m.want_peers()

    def _shown(self, remote: Remote, vs: VersionState) -> set[int]:
        """What this node shows a peer of a version: all it holds, or the super-seed's offer
        (``serving.trainer_shows``)."""
        if self.signer is None:
            return vs.have
        return serving.trainer_shows(
            vs.have, self._slots(), self.superseed.get(vs.key), time.monotonic(), remote.node_id,
            remote.have.get(vs.key, frozenset()), self.held_by.get(vs.key, {}),
            far=remote.region != self.daemon.settings.region, announced=len(vs.chunks), total=vs.total,
            super_seed=self.daemon.settings.super_seed,
            trusted=serving.trusted(any(remote.have.values()), bool(self._showing)), quick=self._quick(vs))

    def _quick(self, vs: VersionState) -> bool:
        """Whether the trainer sends this version in less than a round trip between regions
        (``serving.quick``): its size taken as its chunk count (the manifest's, else the chunks
        announced so far) times its first chunk's size, so no walk over a large version's chunks."""
        first = next(iter(vs.chunks.values()), None)
        return serving.quick(None if first is None else first.size, vs.total or len(vs.chunks), self.up.rate,
                             self.delay())

    def _slots(self) -> Slots:
        """The trainer's upload slots as they stand (``serving.Slots``)."""
        here = self.daemon.settings.region
        live, near, regions, wanting = self._live()
        return Slots(self.choker, self.unchoked,
                     lambda p: (r := self.remotes.get(p)) is not None and r.region == here,
                     live, near, regions, wanting)

    def _owed(self, remote: Remote, key: Key) -> frozenset[int]:
        """The chunks of ``key`` super-seeding gave ``remote`` and it may still fetch (``serving.owed``)."""
        return serving.owed(self.superseed.get(key), remote.node_id, remote.have.get(key, frozenset()))

    def _owes(self, remote: Remote) -> bool:
        """Whether ``remote`` is owed a chunk (``_owed``) of any version."""
        return any(self._owed(remote, k) for k in self.superseed)

    def _may_fetch(self, remote: Remote, key: Key, index: int) -> bool:
        """Whether ``remote``'s request for chunk ``index`` of ``key`` is served now (else 503, "choked")."""
        return serving.may_fetch(self._may_download(remote), index, self._owed(remote, key))

    def _set_have(self, remote: Remote, have: dict[Key, frozenset[int]]) -> None:
        """A peer's have-maps changed: the counts of holders (``held_by``, and ``_showing``, the peers
        whose maps show any chunk) follow, so that answering an exchange never walks every peer's
        maps (a swarm of thousands polls the trainer)."""
        self._showing += any(have.values()) - any(remote.have.values())
        for k in remote.have.keys() | have.keys():
            before, after = remote.have.get(k, frozenset()), have.get(k, frozenset())
            if before == after:
                continue
            counts = self.held_by.setdefault(k, collections.Counter())
            counts.update(after - before)
            gone = before - after
            counts.subtract(gone)
            for c in gone:
                if counts[c] <= 0:
                    del counts[c]
            if not counts:
                del self.held_by[k]
        remote.have = have

    async def handle_exchange(self, request: web.Request) -> web.Response:
        remote = request["peer"]  # admitted from its headers (``admit``) before a byte of the body is read
        if (why := self.budgets.refused(remote.node_id, time.monotonic())) is not None:
            return self._refuse(request, remote.node_id, f"budget-{why}", 403 if why == "banned" else 429,
                                f"{why}: this peer's exchanges cost this node past its budget (swarm.budget)")
        cpu = time.thread_time()
        if (request.content_length or 0) > MAX_EXCHANGE_REQUEST:
            return web.json_response({"error": "exchange message too large"}, status=413)
        body = await read_limited(request.content, MAX_EXCHANGE_REQUEST)
        if body is None:
            return web.json_response({"error": "exchange message too large"}, status=413)
        try:
            m = fields(unpack(body, what="exchange", max_len=MAX_EXCHANGE_REQUEST), _EXCHANGE_REQ, what="exchange")
            theirs = {}
            for e in m["versions"][:MAX_VERSIONS_SHOWN]:
                e = fields(e, _VERSION_REQ, what="exchange version")
                k = Key(e["version"], bool(e.get("anchor")))
                theirs[k] = (e["statements"], from_bitmap(_bounded(e["have"], self.versions.get(k))))
        except (FormatError, SparrowError) as e:
            return web.json_response({"error": str(e)}, status=400)
        if m.get("delay_us") is not None:
            if remote.delay is None:
                self._live_at = float("-inf")  # a first figure: the median is taken again at once
            remote.delay = min(m["delay_us"], MAX_TREE_US) / 1e6
        new_have = {v: h for v, (_, h) in theirs.items()}
        wait = min(float(m["wait"] or 0), 15.0)
        if new_have != remote.have:
            self._set_have(remote, new_have)
            if self.signer is not None:
                # Its offer may have grown: this reply carries it at once. Nobody else's grew (a chunk
                # one more peer holds is only ever offered less), so the other peers' long polls sleep
                # on: waking them all cost the trainer a reply to every peer for every chunk any peer
                # stored.
                wait = 0
        if any(k in theirs and theirs[k][0] < len(vs.statements) for k, vs in self.versions.items()):
            wait = 0  # it follows a version and lacks statements of it (the last reply was a page): at once
        cpu = time.thread_time() - cpu
        await self.changed(m["after"], wait)
        built = time.thread_time()
        # The statements go out a page at a time (StatementPage): first of the versions the peer follows,
        # then of the others newest first (it may not want the old ones; it lists those it takes).
        out, page = [], StatementPage()
        for k in sorted(self.versions, key=lambda k: (0, k.version) if k in theirs else (1, -k.version)):
            vs = self.versions[k]
            known = theirs.get(k, (0, None))[0]
            n = len(vs.chunks)
            e = {"version": k.version, "anchor": k.anchor, "statements": page.take(vs.statements, known),
                 "have": to_bitmap(self._shown(remote, vs), n), "fetching": to_bitmap(self._fetching(k), n)}
            if pushing := {i for (p, o, i) in self.pushing_to if p == remote.node_id and o == k}:
                e["pushing"] = to_bitmap(pushing, n)
            out.append(e)
        if self.signer is None:
            choked = not self._may_download(remote)  # its lane's queue (a relay owes nothing)
        else:
            choked = serving.trainer_chokes(self._slots(), remote.node_id, remote.region != self.daemon.settings.region,
                                    wants=self._wants(remote), owes=lambda: self._owes(remote))
        reply = {"gen": self.gen, "versions": out, "choked": choked,
                 "cut_through": self._relays_partials()}
        if (t := self.daemon.tracker) is not None:
            reply["joins"], joined = t.joined_since(m.get("joined_after") or 0, time.time())
            if joined:
                reply["joined"] = joined
        packed = pack(reply)
        cpu += time.thread_time() - built
        if (verdict := self.budgets.of(remote.node_id).spend(time.monotonic(), cpu, len(body) + len(packed))):
            self.refused[f"budget-{verdict}"] += 1
            event(log, logging.WARNING, "peer over its budget", peer=remote.node_id, now=verdict,
                  remote=request.remote or "?")
        return web.Response(body=packed, content_type=MSGPACK)

    def _live(self) -> tuple[int, int, int, int]:
        """The peers heard from in the last 30 s: how many, how many of them in this node's region, how
        many regions they are in, and how many of this region's lack a chunk this node holds; counted
        at most once a second, and again when a version begins: the trainer asks on
        every exchange it answers, and every node of the swarm polls it."""
        now = time.monotonic()
        if now - self._live_at >= LIVE_EVERY:
            self._live_at = now
            here = self.daemon.settings.region
            live = [r for r in self.remotes.values() if now - r.last_seen < LIVE_WITHIN]
            near = [r for r in live if r.region == here]
            self._live_regions = {r.region for r in live}
            delays = [r.delay for r in live if r.delay is not None]
            self._live_delay = statistics.median(delays) if delays else None
            self._live_count = (len(live), len(near), len(self._live_regions),
                                sum(1 for r in near if self._wants(r)))
        return self._live_count

    def _wants(self, remote: Remote) -> bool:
        """Whether this node holds a chunk the peer lacks (as far as its last exchange told)."""
        return any(vs.have - remote.have.get(k, frozenset()) for k, vs in self.versions.items())

    def _may_download(self, remote: Remote) -> bool:
        """Whether this node serves ``remote`` now: a relay while few requests wait in its lane
        (``serving.relay_admits``), the trainer as its slots admit (``serving.Slots.admits``)."""
        if self.signer is None:
            which = self._lane(remote)
            if serving.relay_admits(self._waiting[which]):
                return True
            self._told_choked[which] = True  # woken when the lane has room again
            return False
        return self._slots().admits(remote.node_id, remote.region != self.daemon.settings.region)

    def _lane(self, remote: Remote) -> bool:
        """This node's upload lane for ``remote`` (``serving.lane``)."""
        return serving.lane(self.signer is not None, self.daemon.settings.region, remote.region)

    def _chunk_request(self, request: web.Request) -> tuple[Key, int, Remote] | web.Response:
        """``/v1/swarm/chunk/{key}/{index}``'s object, chunk and peer, or the refusal to send."""
        try:
            key, i = Key.parse(request.match_info["key"]), int(request.match_info["index"])
        except ValueError:
            return web.json_response({"error": "key must be a version (12) or an anchor (a12), index an integer"},
                                     status=400)
        return key, i, request["peer"]

    async def handle_chunk(self, request: web.Request) -> web.StreamResponse:
        asked = self._chunk_request(request)
        if isinstance(asked, web.Response):
            return asked
        key, i, remote = asked
        vs = self.versions.get(key)
        source: Path | Partial | None = None
        if vs is not None and i in vs.have:
            source = self.store.chunk_path(key, i)
        elif (part := self.partials.get((key, i))) is not None and part.servable:
            source = part  # being fetched: served block by block as the blocks check out (see _fetching)
        if source is None:
            return web.json_response({"error": "not held"}, status=404)
        if (remote.node_id, key, i) in self.pushing_to:  # it asked as the push went out: it takes the push
            return web.json_response({"error": "being pushed to you"}, status=409)
        if not self._may_fetch(remote, key, i):
            return web.json_response({"error": "choked"}, status=503)
        if remote.uploads >= UPLOADS_PER_PEER:
            return web.json_response({"error": "too many requests in flight"}, status=429)
        if key in self.superseed:
            self.superseed[key].claim(i, remote.node_id)
        size = vs.chunks[i].size
        wan = remote.region != self.daemon.settings.region
        part = source if isinstance(source, Partial) else None
        remote.uploads += 1
        try:
            if part is not None:  # still arriving: its turn among the streams the uplink carries at its rate
                if (room := part.room(self.up.rate)) is not None and room <= 0:
                    self.turns_waited += 1
                    event(log, logging.DEBUG, "a request waits its turn", peer=remote.node_id, object=str(key),
                          index=i, streams=part.streams)
                await part.turn(self.up.rate)
                if part.failed:
                    return web.json_response({"error": "not held"}, status=404)
                part.streams += 1
            try:
                async with self._upload_slot(self._lane(remote)):
                    resp, sent = await self._send(request, source, size, wan, vs.roots.get(i), vs.block or PIECE)
            finally:
                if part is not None:
                    part.leave()
        finally:
            remote.uploads -= 1
        if not sent:
            if key in self.superseed:  # it hung up before it had the chunk: give it again soon if need be
                self.superseed[key].unclaim(i, remote.node_id)
            return resp
        remote.rate_to.add(time.monotonic(), size)
        self.daemon.count_bytes("up", size, wan)
        if self.signer is not None and (now := time.monotonic()) - self._row_told >= ROW_EVERY:
            self._row_told = now
            self.daemon.report_changed()  # the trainer's own row counts its uploads within a second
        return resp

    @contextlib.asynccontextmanager
    async def _upload_slot(self, lane: bool):
        """One of the lane's upload slots, waited for in its queue (what ``_may_download`` counts)."""
        self._waiting[lane] += 1
        waiting = True
        try:
            async with self._uploads[lane]:
                self._waiting[lane] -= 1
                waiting = False
                self._busy[lane] += 1
                try:
                    if self.signer is None and self._waiting[lane] == QUEUE_ADMIT - 1 and self._told_choked[lane]:
                        self._told_choked[lane] = False
                        await self.notify()  # the lane has room again: peers told "choked" learn it now
                    yield
                finally:
                    self._busy[lane] -= 1
        finally:
            if waiting:
                self._waiting[lane] -= 1

    async def _paced(self, source: Path | Partial, wan: bool, block: int = PIECE,
                     stripe: tuple[int, int] | None = None, size: int = 0):
        """A chunk's pieces (``_pieces``), held to the upload limits; counted as relayed cut-through
        when they come from a chunk still arriving.

        Under a limit the pieces are ``block`` bytes (the version's hashing block): a relay hands a
        chunk on from its first block checked out, and a bucket that let one 256 KiB piece go only
        once it had the tokens for all of it held every block of that piece back: at 1 MiB/s the
        trainer's first holder saw its first block of a one-chunk version 0.15 s after the version's
        manifest, and every paced hop after it waited so again (``bench swarm --log-level debug``
        at 16 nodes; the simulator sends fluidly). ``stripe``: only that stripe's blocks, of a chunk
        of ``size`` bytes hashed in ``block``-byte blocks."""
        relayed = isinstance(source, Partial)
        paced = bool(self.up.rate or (wan and self.wan_up.rate))
        pieces = _pieces(source, block, block if paced else PIECE) if stripe is None \
            else _stripe_pieces(source, *stripe, block, size)
        async for piece in pieces:
            if relayed:
                self.cut_through_bytes += len(piece)  # counted as it goes: a chunk still arriving
            now = time.monotonic()
            delay = max(self.up.take(now, len(piece)), self.wan_up.take(now, len(piece)) if wan else 0)
            if delay:
                await asyncio.sleep(delay)
            yield piece

    def _rate_header(self, wan: bool, source: Path | Partial) -> dict[str, str]:
        """``RATE_HEADER`` for a stream this node starts now (in its upload slot): its share of the
        limits, no faster than the chunk arrives if it still does (``swarm.push.stream_rate``); none
        where nothing limits it."""
        arriving = source.rate if isinstance(source, Partial) and not source.whole else None
        rate = stream_rate(self.up.rate, self.wan_up.rate, self._busy[False] + self._busy[True], self._busy[True],
                           wan=wan, arriving=arriving)
        return {RATE_HEADER: str(round(rate))} if rate else {}

    async def _send(self, request: web.Request, source: Path | Partial, size: int,
                    wan: bool, root: str | None = None, block: int = PIECE) -> tuple[web.StreamResponse, bool]:
        """The chunk's bytes, from its file or, cut-through, from a fetch in progress, paced by the
        rate limits; False when the peer hung up (an endgame loser cancelled: not an error) or the
        fetch it was fed by failed (the connection is cut: the requester must not take what it got
        for the whole chunk)."""
        headers = {"Content-Type": "application/octet-stream", **({ROOT_HEADER: root} if root else {}),
                   **self._rate_header(wan, source)}
        if isinstance(source, Path) and not (self.up.rate or (wan and self.wan_up.rate)):
            resp = web.FileResponse(source, headers=headers)
            try:
                await resp.prepare(request)  # sendfile where the event loop supports it
            except ConnectionError:
                return resp, False
            return resp, True
        resp = web.StreamResponse(headers={**headers, "Content-Length": str(size)})
        try:
            await resp.prepare(request)
            async for piece in self._paced(source, wan, block):
                await resp.write(piece)
            await resp.write_eof()
        except ConnectionError:
            return resp, False
        except _Cut:
            if request.transport is not None:
                request.transport.abort()
            return resp, False
        return resp, True

    async def _choke_loop(self) -> None:
        while True:
            now = time.monotonic()
            peers = []
            for r in self.remotes.values():
                if now - r.last_seen > LIVE_WITHIN:
                    continue
                p = self.peers.get(r.node_id)
                peers.append(ChokerPeer(r.node_id, self._wants(r), rate_from=p.rate.rate(now) if p else 0.0,
                                        rate_to=r.rate_to.rate(now), near=r.region == self.daemon.settings.region))
            # Only the trainer chokes, and it is a seed even while a version is being published: it
            # downloads nothing, so it ranks peers by what it sends them (its own region's first).
            unchoked = self.choker.decide(now, peers, seed=True)
            if any(ss.lapsing(now, self.held_by.get(k, {}).keys())
                   for k, ss in self.superseed.items()):
                await self.notify()  # an assignment lapsed: the peers' long polls answer, one gets it now
            if unchoked != self.unchoked:
                for pid in self.unchoked - unchoked:  # what a choked peer was given, and not asked for, goes
                    for ss in self.superseed.values():
                        ss.forget(pid, unclaimed_only=True)
                self.unchoked = unchoked
                await self.notify()  # peers waiting in an exchange learn their new choke state now
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._rechoke.wait(), CHOKE_EVERY)
            self._rechoke.clear()

    # ------------------------------------------------------------ fetching side

    def _take_listed(self) -> dict[str, dict]:
        """Peers from the membership's list that this node has no exchanges with yet: taken, their long
        polls started. The listed entries."""
        state = self.daemon.membership.state
        listed = {p["node_id"]: p for p in state.peers}
        for pid, p in listed.items():
            if pid in self.banned or pid in self.peers:
                continue
            ps = self.peers[pid] = PeerState(pid, p["address"], p["region"], p["role"])
            ps.task = asyncio.create_task(self._peer_loop(ps), name=f"peer-{pid}")
            self._warm(ps)
        here = self.daemon.settings.region
        if self.signer is None and any(e["node_id"] == self.daemon.node_id for e in state.heads.get(here, ())):
            # A head pushes across to the other regions' heads, peers or not: their contacts, each with
            # its spare connection, made now rather than at the first push.
            for r, es in state.heads.items():
                for e in es if r != here else ():
                    if e["node_id"] not in listed:
                        self._contact(e)
        return listed

    def _warm(self, ps: PeerState) -> None:
        """Open a spare connection to a peer, kept idle for its first push or chunk request: its long
        poll holds the connection it has, and a new one across regions costs TCP's handshake, a round
        trip, before the first byte (``bench swarm``, the WAN emulator's handshake on, 8 rollouts, one
        chunk: later versions 1.21-1.72x the bound opening 2-5 connections across regions each,
        0.59-0.94x opening 0-1 with one spare a peer).

        The connection is opened bare, through the session's connector, and put in its pool as soon
        as the handshake is done: opened by a request (``GET /v1/swarm/ping``, still the fallback
        where aiohttp's connector takes other arguments), it stayed busy a round trip longer, and in
        a swarm just formed every stripe pushed meanwhile opened a connection of its own (at 300 ms
        round trips, one chunk to 8 rollouts in 8 regions: each of the two crossings took a handshake
        more, 1.0 s to all against a bound of 0.36 s)."""
        if self._session is None or self._closing:
            return
        session = self._session

        async def ping() -> None:
            async with session.get(f"http://{ps.address}/v1/swarm/ping", headers=self._proof_for(ps),
                                   timeout=aiohttp.ClientTimeout(total=10.0)) as r:
                await r.read()

        async def connect() -> None:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                try:
                    req = aiohttp.ClientRequest("GET", URL(f"http://{ps.address}/"), loop=asyncio.get_running_loop())
                    conn = await session.connector.connect(req, [], aiohttp.ClientTimeout(total=10.0))
                except (TypeError, AttributeError, ValueError):  # another aiohttp's internals
                    await ping()
                    return
                conn.release()  # idle in the pool, the next request's

        task = asyncio.create_task(connect(), name=f"warm-{ps.node_id}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def handle_ping(self, request: web.Request) -> web.Response:
        """A peer opening a spare connection to this node (``_warm``): nothing to answer."""
        return web.Response(status=204)

    async def _peer_manager(self) -> None:
        while True:
            listed = self._take_listed()
            for pid in [pid for pid in self.peers if pid not in listed or pid in self.banned]:
                ps = self.peers.pop(pid)
                if ps.task:
                    ps.task.cancel()
                self._changed.set()
            changed = self.daemon.membership.peers_changed
            try:  # a renewal that lists new peers wakes it at once
                async with asyncio.timeout(0.5):
                    await changed.wait()
            except TimeoutError:
                pass
            changed.clear()

    def _my_versions(self) -> list[dict]:
        out = []
        for k, vs in sorted(self.versions.items()):
            n = len(vs.chunks)
            out.append({"version": k.version, "anchor": k.anchor, "statements": len(vs.statements),
                        "have": to_bitmap(vs.have, n), "fetching": to_bitmap(self._fetching(k), n)})
        return out

    async def _exchange(self, ps: PeerState, wait: float) -> None:
        msg = {"node_id": self.daemon.node_id, "region": self.daemon.settings.region, "after": ps.gen,
               "wait": int(wait), "versions": self._my_versions()}
        if ps.role == "trainer":
            msg["joined_after"] = self._joins_seen
            if (delay := self.wan_delay()) is not None:
                msg["delay_us"] = round(delay * 1e6)
        t0, traced = time.monotonic(), {}
        async with self._session.post(f"http://{ps.address}/v1/swarm/exchange", data=pack(msg),
                                      headers={"Content-Type": MSGPACK, **self._proof_for(ps)},
                                      timeout=aiohttp.ClientTimeout(total=wait + 10), trace_request_ctx=traced) as r:
            body = await read_limited(r.content, MAX_EXCHANGE)
            if body is None:
                raise FormatError(f"exchange reply from {ps.node_id}: over {MAX_EXCHANGE} bytes")
            if r.status != 200:
                raise (NotYet if r.status == 503 else SparrowError)(f"exchange with {ps.node_id}: HTTP {r.status}")
        # A long poll held is longer; one answered at once is the round trip, and on a connection it
        # opened, two: TCP's handshake first (a swarm's second version at 2 s round trips had its
        # crossings timed for 2 s one way, and took 1.33x the bound where later ones took 1.08x).
        took = (time.monotonic() - t0) / (2 if traced.get("new") else 1)
        ps.rtt = took if ps.rtt is None else min(ps.rtt, took)
        cpu = time.thread_time()
        self._ingest(ps, unpack(body, what=f"exchange reply from {ps.node_id}", max_len=MAX_EXCHANGE))
        if self.budgets.of(ps.node_id).spend(time.monotonic(), time.thread_time() - cpu, len(body)) == "banned":
            self._ban(ps, "its exchange replies cost this node past its budget", kind="budget")

    async def _peer_loop(self, ps: PeerState) -> None:
        """The long poll: returns when the peer changed (or after a few seconds), then asks again."""
        backoff = 0.5
        while True:
            try:
                t0, before = time.monotonic(), (_view(ps), self._joins_seen)
                await self._exchange(ps, EXCHANGE_WAIT)
                backoff = 0.5
                # An honest peer holds the poll until something changed; one that answers early
                # with nothing new, again and again, would keep this node busy: pace it. (News of a
                # join from the trainer is new: a swarm forming woke the first node's poll at every
                # join, and paced, it heard of the first version 0.2 s late.)
                early = time.monotonic() - t0 < EXCHANGE_WAIT / 2
                ps.quick = ps.quick + 1 if early and (_view(ps), self._joins_seen) == before else 0
                if ps.quick >= QUICK_REPLIES:
                    event(log, logging.DEBUG, "pacing a peer's polls", peer=ps.node_id, quick=ps.quick)
                    await asyncio.sleep(QUICK_PACE)
            except asyncio.CancelledError:
                raise
            except IntegrityError as e:
                self._ban(ps, str(e))
                return
            except (SparrowError, aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                event(log, logging.DEBUG, "exchange failed", peer=ps.node_id, reason=str(e) or type(e).__name__)
                if isinstance(e, NotYet):
                    # It asked the tracker about this node, one round trip: ask again soon. Waiting the
                    # failure backoff, a swarm just formed lost up to half a second a hop on its first
                    # version (bench swarm, 8 nodes, one chunk: 3.9x the bound, the last node waiting
                    # 0.5 s on a neighbour that had the chunk).
                    await asyncio.sleep(min(backoff, NOT_YET_RETRY))
                    continue
                ps.stalled = True  # gone or failing: its neighbours do not wait on it to cross until it delivers
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def _tell_peers(self) -> None:
        """Have messages: after a new chunk, a quick exchange with the trainer carries the new have-map,
        and its reply the chunks super-seeding offers now. The other peers learn it from their long
        polls here, which ``notify`` answers: an exchange sent to a relay told its picker nothing
        (a node's picker reads only the replies to its own exchanges), so it was a second message per
        peer and chunk for the same news."""
        for ps in [p for p in self.peers.values() if p.role == "trainer"]:
            if ps.telling:
                ps.tell_again = True
                continue
            ps.telling = True
            asyncio.create_task(self._tell(ps), name=f"have-{ps.node_id}")

    async def _tell(self, ps: PeerState) -> None:
        try:
            while True:
                ps.tell_again = False
                try:
                    await self._exchange(ps, 0)
                except IntegrityError as e:
                    self._ban(ps, str(e))
                    return
                except (SparrowError, aiohttp.ClientError, asyncio.TimeoutError, OSError):
                    return
                if not ps.tell_again:
                    return
        finally:
            ps.telling = False

    def _ingest(self, ps: PeerState, reply) -> None:
        if not isinstance(reply, dict) or not isinstance(reply.get("versions"), list):
            raise FormatError(f"exchange reply from {ps.node_id}: not a map with versions")
        ps.gen = int(reply.get("gen", -1)) if isinstance(reply.get("gen"), int) else -1
        if ps.role == "trainer" and isinstance(joins := reply.get("joins"), int):
            if isinstance(joined := reply.get("joined"), list) and self.daemon.membership is not None:
                # Peers before versions, and at once: a reply that brings a swarm's first version and
                # a neighbour that joined a moment ago must count the neighbour among the region's
                # crossers when the version starts, or the node designates itself for every chunk
                # and crosses for them while the neighbour brings them too (``bench swarm``, 8
                # rollouts, one chunk: 1.33x (R-1) x patch in some first versions).
                self.daemon.membership.learn(joined)
                self._take_listed()
            self._joins_seen = joins
        ps.choking = bool(reply.get("choked"))
        ps.cut_through = reply.get("cut_through") is True
        at = self.floor()
        now = time.monotonic()
        seen = set()
        took = False
        done = []  # versions whose manifest came after their last chunk
        for e in reply["versions"][:4096]:
            e = fields(e, _VERSION_REP, what="exchange reply version")
            k = Key(e["version"], bool(e.get("anchor")))
            seen.add(k)
            if k.version <= at and k not in self.versions:
                continue  # nothing older than this node's position is of use to it
            vs = self.versions.get(k) or VersionState(k.version, k.anchor)
            was = vs.complete
            for raw in e["statements"][:1 << 16]:
                if not isinstance(raw, bytes):
                    raise FormatError("statement must be bytes")
                if self._take_statement(vs, Signed.from_bytes(raw)):
                    self._touch()
                    took = True
            if vs.complete and not was and self.signer is None:
                done.append(vs)
            if not vs.statements:
                continue  # nothing signed yet: not an object this node knows
            self.versions.setdefault(k, vs)
            have = {i for i in from_bitmap(_bounded(e["have"], vs)) if i in vs.chunks}
            if len(have) < len(vs.chunks):  # seen partly held: fetched, not claimed whole at once (a liar's map)
                ps.held += len(have - ps.have.get(k, set()))
            ps.have[k] = have
            ps.fetching[k] = {i for i in from_bitmap(_bounded(e["fetching"], vs)) if i in vs.chunks}
            ps.pushing[k] = {i for i in from_bitmap(_bounded(e["pushing"], vs)) if i in vs.chunks} \
                if e.get("pushing") else set()
            ps.pushing_at = now
            for i in have:
                self.available_since.setdefault((k, i), now)
        for k in list(ps.have):
            if k not in seen:
                del ps.have[k]
        for k in list(ps.pushing):
            if k not in seen:
                del ps.pushing[k]
        if took:
            self._wake_announced()
        for vs in done:
            self._complete(vs)
        if ps.role == "trainer":
            self.trainer_heard = True  # the trainer lists everything it retains
        self._changed.set()

    def _lied(self, ps: PeerState, key: Key, index: int) -> None:
        """A peer answered "not held" for a chunk it advertised: banned for the session, as for a bad
        chunk. Its claims would otherwise keep the region waiting for it rather than fetching
        elsewhere. (An honest peer that retired the version between its have-map and the request
        would be caught too; it retires only versions older than what its peers still fetch.)"""
        self.lies += 1
        self._ban(ps, f"advertised chunk {index} of {key} and did not serve it", kind="false-have")

    def _ban(self, ps: PeerState, reason: str, kind: str = "bad-chunk") -> None:
        if ps.node_id in self.banned:
            return
        self.banned.add(ps.node_id)
        self.bans[kind] += 1
        event(log, logging.WARNING, "peer banned for the session", peer=ps.node_id, reason=reason)
        if ps.task and ps.task is not asyncio.current_task():
            ps.task.cancel()
        self.peers.pop(ps.node_id, None)
        self._changed.set()

    async def _scheduler(self) -> None:
        while True:
            try:
                async with asyncio.timeout(PLAN_EVERY):  # not wait_for: see changed()
                    await self._changed.wait()
            except TimeoutError:
                pass
            self._changed.clear()
            if self._schedule() and not self._relays_partials():
                await self.notify()  # peers' long polls learn what this node now fetches (its claims)

    def _schedule(self) -> int:
        """Start the requests the picker chooses; returns how many."""
        started = 0
        now = time.monotonic()
        if now < self.store_paused_until:
            return 0
        self.counted = {k: c for k, c in self.counted.items() if k in self.versions and not self.versions[k].complete}
        round_trip = 2 * (self.wan_delay() or 0.0)  # between regions, as this node measured it
        if self.unstriped:
            self.unstriped = {(k, i) for k, i in self.unstriped
                              if k in self.versions and i not in self.versions[k].have}
        for k in sorted(self.wanted()):
            vs = self.versions.get(k)
            if vs is None or vs.complete:
                continue
            missing = vs.missing()
            if not missing:
                continue
            counted, known = self.counted.get(k, (None, frozenset()))
            counted, known = self.counted[k] = recount(counted, known, self._neighbours())
            # Counted on for this version, less those that held this node back since it started.
            trusted = {p for p in counted if p in self.peers and not self.peers[p].stalled}
            region_nodes = self._crossers(trusted)
            chunk_size = max((c.size for c in vs.chunks.values()), default=1)
            # Give the region's designated crosser time to move a chunk before anyone else crosses for it,
            # and a request time to come back before the endgame duplicates it: both wait a round trip more.
            self.picker.pace(chunk_size, round_trip, _send_time(vs))
            views = [PeerView(p.node_id, p.region, p.have.get(k, set()), is_trainer=p.role == "trainer",
                              choking=p.choking or now < p.cooldown_until, inflight=p.inflight,
                              fetching=p.fetching.get(k, set()),
                              slots=slots_for_rate(p.rate.rate(now), chunk_size), rate=p.rate.rate(now),
                              proven=p.node_id in trusted, cut_through=p.cut_through and p.role != "trainer")
                     for p in self.peers.values()]
            inflight = {i: set(self.inflight.get((k, i), {})) for i in missing}
            near_whole: set[int] | None = None  # chunks a rollout of this node's region holds whole
            for i in missing:  # arriving in stripes, between streams: not asked for until they stop coming
                part = self.partials.get((k, i))
                if part is None or not part.striped or part.feeders:
                    continue
                if near_whole is None:
                    near_whole = set().union(*(p.have.get(k, ()) for p in self.peers.values()
                                               if p.role != "trainer" and p.region == self.daemon.settings.region
                                               and not p.stalled))
                near = i in near_whole
                if not stripes_stopped(now, part.fed_at, round_trip, failed=part.failed, near_whole=near):
                    inflight[i].add("")
                else:
                    del self.partials[(k, i)]
                    part.abort()
                    self.unstriped.add((k, i))
                    event(log, logging.DEBUG, "stripes stopped short; asking for the chunk whole", object=str(k),
                          index=i, stripes=len(part.stripe_got), blocks=int(part.checked.sum()), of=part.blocks,
                          why="a peer of this region holds it" if near else "no stripe came")
            for p in self.peers.values():  # chunks on their way here unasked: not asked for meanwhile
                for i in p.pushing.get(k, ()) if now - p.pushing_at < PUSH_CLAIM + (p.rtt or round_trip) else ():
                    if i in inflight:
                        inflight[i].add(p.node_id)
            since = {i: self.available_since.get((k, i), now) for i in missing}
            for pid in self.picker.stalled(now, version=k.tag, missing=missing, peers=views,
                                           region_nodes=region_nodes, available_since=since):
                if (ps := self.peers.get(pid)) is not None and not ps.stalled:
                    ps.stalled = True
                    event(log, logging.INFO, "peer held this node back (it did not bring its share of chunks across, "
                          "or claimed chunks it did not deliver); passed over until it delivers", peer=pid,
                          object=str(k))
            asked_at = {i: self.asked_at[(k, i)] for i in missing if (k, i) in self.asked_at}
            for req in self.picker.pick(now, version=k.tag, missing=missing, inflight=inflight, peers=views,
                                        region_nodes=region_nodes, available_since=since, asked_at=asked_at):
                ps = self.peers.get(req.peer_id)
                if ps is None:
                    continue
                event(log, logging.DEBUG, "asking for a chunk", peer=ps.node_id, object=str(k), index=req.index)
                self._track(ps, (k, req.index),
                            asyncio.create_task(self._fetch(ps, vs, req.index), name=f"fetch-{k.tag}-{req.index}"))
                started += 1
        return started

    def _track(self, ps: PeerState, key: tuple[Key, int], task: asyncio.Task) -> None:
        """A stream of chunk ``key`` from ``ps`` (a request, or a push taken) in flight until ``task``
        ends, however it ends: counted in the peer's requests and in ``inflight`` (the chunk is being
        fetched), released by the task's done callback. A task cancelled before its first step
        (an endgame loser, a request a push replaced the moment it was made) never runs its own
        code: released in ``_receive``, as before, its entry stayed, the chunk stayed "being
        fetched" and the peer's request slot taken, and a node held every other chunk of a version
        but that one for 30 s (``tests/daemon/test_trust.py``, a lying peer banned mid-version)."""
        ps.inflight += 1
        self.inflight.setdefault(key, {})[ps.node_id] = task
        self.asked_at.setdefault(key, time.monotonic())

        def done(t: asyncio.Task) -> None:
            ps.inflight -= 1
            tasks = self.inflight.get(key)
            if tasks is not None and tasks.get(ps.node_id) is t:  # not a later stream from the same peer
                del tasks[ps.node_id]
                if not tasks:
                    del self.inflight[key]
                    self.asked_at.pop(key, None)
            self._changed.set()

        task.add_done_callback(done)

    def _crossers(self, trusted: set[str]) -> list[str]:
        """The nodes that share this region's cross-region fetches, as this node sees them
        (``serving.crossers``): the gateways the tracker names, less those that held this node back,
        else itself and the neighbours it counts on."""
        m = self.daemon.membership
        return serving.crossers(self.daemon.node_id, m.state.gateways if m is not None else [],
                        lambda g: g in self.peers and not self.peers[g].stalled, trusted)

    def _neighbours(self) -> list[tuple[str, int]]:
        """The region's peers and the chunks each has shown holding, for ``recount``: a node counts on
        those that have shown holding chunks, which every node of the region sees alike, decided
        when it starts fetching a version and grown by the peers it learns of since; for the version
        only until they hold this node back (``Picker.stalled``)."""
        region = self.daemon.settings.region
        return [(p.node_id, p.held) for p in self.peers.values() if p.region == region and p.role != "trainer"]

    async def _fetch(self, ps: PeerState, vs: VersionState, index: int) -> None:
        """A chunk request to a peer the picker chose: its stream goes to ``_receive``."""
        whole = index in ps.have.get(vs.key, ())  # else the peer is fetching it too: served cut-through

        async def pieces():
            timeout = aiohttp.ClientTimeout(total=stream_timeout(vs.chunks[index].size, _send_time(vs, index)))
            async with self._session.get(f"http://{ps.address}/v1/swarm/chunk/{vs.key.tag}/{index}",
                                         timeout=timeout,
                                         headers=self._proof_for(ps)) as r:
                if r.status != 200:
                    event(log, logging.DEBUG, "chunk request not served", peer=ps.node_id, object=str(vs.key),
                          index=index, status=r.status)
                if r.status == 503:
                    ps.choking = True
                    return
                if r.status == 404:
                    if whole:
                        self._lied(ps, vs.key, index)
                    else:  # its fetch ended (or moved to another node) since it said so
                        ps.fetching.get(vs.key, set()).discard(index)
                    return
                if r.status != 200:
                    return
                self._take_root(vs, index, self.daemon.settings.region if ps.role == "trainer"
                                else r.headers.get(ROOT_HEADER))
                if ps.role == "trainer":
                    vs.first_hand.add(index)
                yield _Served(_declared_rate(r.headers))  # what follows is the chunk
                async for piece in r.content.iter_chunked(PIECE):
                    yield piece

        await self._receive(ps, vs, index, pieces(), whole=whole)

    async def _receive(self, ps: PeerState, vs: VersionState, index: int, pieces, *, whole: bool,
                       stripe: tuple[int, int] | None = None, into: Partial | None = None) -> bool:
        """One stream of a chunk from ``ps``, asked for (``_fetch``) or pushed (``handle_push``): each
        block checked as it arrives, the chunk served on cut-through once a block has checked out (and
        pushed on), stored once whole. ``pieces`` yields ``_Served`` once the stream is served
        (nothing before: refused), with the rate its sender declared, then the bytes. ``whole``: the
        sender holds it whole, so a failed or short stream counts against it; a stream fed by a fetch
        in progress there (or pushed) may be cut without its fault. The caller tracks its task
        (``_track``). Whether it stored the chunk. ``stripe``: the stream is that stripe of the chunk,
        fed with the others into ``into`` (registered, its ``feeders`` counting this stream); the one
        that completes the chunk stores it."""
        key = (vs.key, index)
        ref = vs.chunks[index]
        wan = ps.region != self.daemon.settings.region
        if into is not None:
            buf = into
        else:
            buf = Partial(ref.size, vs.block, vs.blocks.get(index), what=f"chunk {index} of {vs.key}")
            if buf.hashes is not None and self._relays_partials():
                self.partials.setdefault(key, buf)  # the first fetch of a chunk feeds what this node relays
        served = False
        try:
            async with contextlib.aclosing(pieces):
                async for piece in pieces:
                    if isinstance(piece, _Served):
                        served, buf.rate = True, piece.rate
                        continue
                    if stripe is not None:
                        first, shown = not buf.has_block(stripe[0]), buf.ready == 0
                        buf.feed_stripe(stripe, piece)
                        if first and buf.has_block(stripe[0]) and self.partials.get(key) is buf:
                            self._push_out(vs, index)  # a receiver hands its own stripe on from here
                            if shown and buf.ready:
                                await self.notify()
                    else:
                        first = buf.ready == 0
                        buf.feed(piece)  # each block checked as it completes
                        if first and buf.ready and self.partials.get(key) is buf:
                            self._push_out(vs, index)
                            await self.notify()  # its first block checked out: peers may fetch it from here now
                    ps.rate.add(time.monotonic(), len(piece))
                    delay = self.down.take(time.monotonic(), len(piece))
                    if delay:
                        await asyncio.sleep(delay)
            if not served:
                return False  # refused (choked, not held): the picker goes on
            if stripe is not None:
                got = buf.stripe_got.get(stripe, 0)
                if not buf.stripe_whole(stripe) and not buf.whole:
                    raise aiohttp.ClientPayloadError(f"stripe {stripe[0]}/{stripe[1]}: {got} bytes short")
                self.daemon.count_bytes("down", got, wan)
                if buf.stripe_whole(stripe):
                    self.stripes["received"] += 1
                if not buf.whole or buf.storing or index in vs.have:
                    return False  # its part is in; the stream that completes the chunk stores it
                buf.storing = True
            elif buf.got < ref.size:  # ended early, cleanly
                if whole:
                    raise IntegrityError(f"{buf.what}: {buf.got} of its {ref.size} bytes")
                raise aiohttp.ClientPayloadError(f"{buf.got} of {ref.size} bytes")  # as a cut stream
            else:
                self.daemon.count_bytes("down", buf.got, wan)
            data = buf.buf
            if index in vs.have:
                return False
            try:
                await asyncio.to_thread(self.store.put_chunk, vs, index, data)
            except OSError as e:  # a full or failing disk: say so, keep serving what is stored
                self.error = f"storing chunks in {self.store.root}: {e.strerror or e}"
                self.store_failures += 1
                pause = store_pause(self.store_failures)
                self.store_paused_until = time.monotonic() + pause
                event(log, logging.ERROR, "cannot store a chunk; fetching pauses", object=str(vs.key), index=index,
                      reason=self.error, seconds=pause)
                return False
            vs.have.add(index)
            if (relayed := self.partials.get(key)) is not None and relayed is not buf:
                relayed.fill(data)  # streams fed by another fetch of it go on from this copy
                if relayed.striped and not relayed.feeders:
                    del self.partials[key]
            self.store_failures = 0
            ps.strikes = 0
            ps.stalled = False
            self.error = None
            event(log, logging.DEBUG, "chunk stored", object=str(vs.key), index=index, peer=ps.node_id,
                  bytes=len(data), wan=wan)
            for pid, t in self.inflight.get(key, {}).items():  # endgame: cancel the losers
                if pid != ps.node_id:
                    t.cancel()
            if vs.complete:
                self._complete(vs)
            self._push_out(vs, index)  # tops up what was pushed from the partial (peers that lack it since)
            await self.notify()
            self._tell_peers()
            return True
        except IntegrityError as e:
            self._ban(ps, str(e))
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
            if not whole:  # a stream cut-through: its feeding fetch failed there, not this peer's doing
                ps.fetching.get(vs.key, set()).discard(index)
                event(log, logging.DEBUG, "cut-through stream ended early", peer=ps.node_id, object=str(vs.key),
                      index=index, reason=type(e).__name__)
                return False
            # The request ends and the chunk goes back to the picker; the peer sits out a while
            # (longer each time in a row), so a stalled peer does not get the chunk again.
            ps.strikes += 1
            ps.cooldown_until = time.monotonic() + min(60.0, 2.0 ** ps.strikes)
            ps.stalled = True  # a peer that fails requests (gone, say) is not counted on to cross until it delivers
            event(log, logging.INFO, "chunk request failed; peer cools down", peer=ps.node_id, object=str(vs.key),
                  index=index, reason=type(e).__name__, seconds=min(60.0, 2.0 ** ps.strikes))
        finally:
            if stripe is not None:
                buf.feeders -= 1
                if not buf.stripe_whole(stripe):
                    buf.drop_stripe(stripe)  # another pusher's copy of it may be taken
            # A chunk's stripes arrive on their own streams, begun as each sender has its first block:
            # the one from the root may end before the others begin (``_schedule`` asks for the chunk
            # whole if the rest stop coming: ``STRIPE_WAIT``).
            if self.partials.get(key) is buf and (stripe is None or index in vs.have):
                del self.partials[key]
                if not buf.whole:
                    buf.abort()  # streams served from it are cut; their requesters pick again
        return False

    # ------------------------------------------------------------ push

    def _push_out(self, vs: VersionState, index: int) -> None:
        """Send a chunk this node can serve now (a block of it checked out, or whole) unasked to the
        peers ``swarm.push.push_targets`` names, through the upload lanes; a relay's only."""
        local, cross = self.daemon.settings.push
        if self.signer is not None or not (local or cross) or self._closing:
            return
        k = vs.key
        done = self.pushed.setdefault(k, {}).setdefault(index, {})
        now = time.monotonic()
        rollouts = [p for p in self.peers.values() if p.role != "trainer"]
        m = self.daemon.membership
        named = {r: [e["node_id"] for e in es] for r, es in (m.state.heads if m is not None else {}).items()}
        heads = push_heads(self.daemon.settings.region, self.daemon.node_id, (p.node_id for p in rollouts), named)
        # Other regions' heads this node does not peer with (it is a head): pushed to without a view of
        # what they hold, so a push there may be declined at its first block.
        rollouts += [c for hs in heads.values() for h in hs if h not in self.peers and (c := self._peer(h)) is not None]
        # Not pushed to: the peers this node receives the chunk from, and those its pusher feeds too
        # (their exchanges may not have told yet that they fetch it: one chunk to 16 daemons in 4
        # regions, two nodes fed by the same head pushed it to each other and to their own feeder,
        # leaving their region's crossing head to ask, 1.3-1.8x the bound where the rest ran at 0.6-1.0x).
        feeding = self.inflight.get((k, index), {}).keys() | self.fed_along.get(k, {}).get(index, frozenset())
        views = [PushPeer(p.node_id, p.region, p.node_id in done or p.node_id in self.banned or p.node_id in feeding
                          or now < p.cooldown_until or index in p.have.get(k, ()) or index in p.fetching.get(k, ()))
                 for p in rollouts]
        idle = tuple(max(0, RELAY_CONCURRENT - self._busy[lane] - self._waiting[lane] - self._spawned[lane])
                     for lane in (False, True))
        tree = None
        part = None if index in vs.have else self.partials.get((k, index))  # still arriving
        if (root := vs.roots.get(index)) in named:  # timed as the trainer signed it: the same tree everywhere
            send, hop = vs.trees.get(index, (None, None))
            plan = stripe_plan(k.tag, index, root, named, len(vs.blocks.get(index) or b"") // BLOCK_HASH,
                               send=send, hop=hop)
            if plan is not None:  # across in stripes, not in the tree
                self._stripe_out(vs, index, plan, part)
                tree = {}
            else:
                tree = region_tree(k.tag, index, root, named, send=send, hop=hop)
        near, far = push_targets(k.tag, index, self.daemon.node_id, self.daemon.settings.region, views, heads,
                                 local=local, cross=cross, sent=(len(done) - sum(done.values()), sum(done.values())),
                                 idle=idle, tree=tree, most=None if part is None else part.room(self.up.rate),
                                 whole=index in vs.have)
        for pid in near + far:
            done[pid] = pid in far
            self.pushing_to.add((pid, k, index))
            self._spawned[done[pid]] += 1  # its slot, kept from the next decision until the task takes it
            if part is not None:
                part.streams += 1  # its stream, counted from now
            task = asyncio.create_task(self._push_to(self._peer(pid), vs, index, part), name=f"push-{k.tag}-{index}")
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _stripe_out(self, vs: VersionState, index: int, plan, part: Partial | None) -> None:
        """Push the stripes of chunk ``index`` this node sends under ``plan`` (``stripe_targets``): the
        first holder's as the chunk arrives, a receiver's own once a block of it has (each stream sends
        its blocks as they check out here). Stripes take no upload slot: all of a chunk's together
        are one chunk's bytes across, and in the lane's two slots most would wait for the first to
        end, a chunk behind."""
        if index not in vs.have and (part is None or part.failed):
            return
        region = self.daemon.settings.region
        took = part is not None and part.striped and bool(part.own)  # a stripe from the root region
        if index in vs.handed_on or took or (region in plan.stripe and plan.receiver[region] == self.daemon.node_id):
            # A receiver hands on the stripe the first holder sent it, as that one dealt them (in a swarm
            # just formed, a node that did not know every region's heads yet dealt 6 stripes where the
            # first holder dealt 7, and its stripe fitted nobody's: every region waited out
            # ``STRIPE_WAIT``), and the one its own plan deals it if that came too (``stripes_handed_on``),
            # each once a block of it is here. One that fetches the chunk whole, having asked before its
            # stripe came, hands its own on from that fetch as the blocks arrive (held back until the
            # fetch was whole, the other receivers waited for it and fetched the chunk across again).
            mine = set(vs.handed_on.get(index, ()))
            if part is not None and part.striped:
                dealt = (plan.stripe[region], plan.n) if region in plan.stripe else None
                mine |= {st for st in stripes_handed_on(part.own, dealt)
                         if part.has_block(st[0])}  # (not begun here yet: handed on once it has)
            elif not mine and (index in vs.have or part.servable):
                mine = {(plan.stripe[region], plan.n)}
            if not mine:
                return
            vs.handed_on[index] = mine
            for st in sorted(mine):
                for r, h in plan.receiver.items():
                    if r != region:
                        self._stripe_to(vs, index, h, st)
            return
        first = index in vs.first_hand
        for pid, s in stripe_targets(plan, self.daemon.node_id, region, first):
            # The first holder hands a stripe its receiver declines (a node of a swarm just formed that
            # does not know every region's heads yet, one fetching the chunk whole from elsewhere) to
            # the other receivers itself: lost, every region waited out ``STRIPE_WAIT`` for it.
            self._stripe_to(vs, index, pid, (s, plan.n),
                            [h for h in plan.receiver.values() if h != pid] if first else ())

    def _stripe_to(self, vs: VersionState, index: int, pid: str, stripe: tuple[int, int], fallback=()) -> None:
        """Push stripe ``stripe`` of chunk ``index`` to ``pid`` (once); if it declines, to ``fallback``."""
        sent = self.striped_to.setdefault(vs.key, {}).setdefault(index, set())
        if (pid, stripe) in sent or pid in self.banned or (ps := self._peer(pid)) is None or \
                index in ps.have.get(vs.key, ()):
            return
        sent.add((pid, stripe))
        task = asyncio.create_task(self._push_to(ps, vs, index, stripe=stripe, fallback=fallback),
                                   name=f"stripe-{vs.key.tag}-{index}-{stripe[0]}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _push_to(self, ps: PeerState, vs: VersionState, index: int, counted: Partial | None = None,
                       stripe: tuple[int, int] | None = None, fallback=()) -> None:
        """One push: the chunk's stream, from its file or from the fetch in progress, paced and in its
        lane like an upload asked for. The receiver refuses (409) what it holds, fetches or cannot
        check; a stream from a partial that fails is cut short, and the receiver drops it.
        ``counted``: the partial whose ``streams`` count this push, released when it ends. ``stripe``:
        only that stripe of the chunk (``_stripe_out``), in no upload slot; refused, it goes to the
        receivers in ``fallback``."""
        key = (vs.key, index)
        wan = ps.region != self.daemon.settings.region
        size = vs.chunks[index].size
        outcome, why = "failed", None
        if stripe is None:
            self._spawned[wan] -= 1
        try:
            async with self._upload_slot(wan) if stripe is None else contextlib.nullcontext():
                if index in vs.have:
                    source: Path | Partial = self.store.chunk_path(vs.key, index)
                elif (part := self.partials.get(key)) is not None and (part.servable or
                                                                       (stripe and part.striped and not part.failed)):
                    source = part
                else:
                    return  # its fetch failed while this push waited for a slot
                if stripe is not None:
                    size = stripe_size(size, vs.block, *stripe)
                event(log, logging.DEBUG, "pushing a chunk", peer=ps.node_id, object=str(vs.key), index=index,
                      whole=index in vs.have, stripe=stripe and f"{stripe[0]}/{stripe[1]}")
                for attempt in range(PUSH_TRIES):
                    async with self._session.post(
                            f"http://{ps.address}/v1/swarm/chunk/{vs.key.tag}/{index}",
                            # a first piece of one block: what a push declined at once has cost the limits
                            data=self._paced(source, wan, vs.block or PIECE, stripe, vs.chunks[index].size),
                            headers={"Content-Type": "application/octet-stream", **self._proof_for(ps),
                                     **({ROOT_HEADER: root} if (root := vs.roots.get(index)) else {}),
                                     **({STRIPE_HEADER: f"{stripe[0]}/{stripe[1]}"} if stripe else {}),
                                     **_statement_header(vs, index), **self._rate_header(wan, source),
                                     **self._also_header(vs.key, index, ps.node_id)},
                            timeout=aiohttp.ClientTimeout(total=stream_timeout(size, _send_time(vs, index)))) as r:
                        body = await r.read()
                        outcome = "taken" if r.status == 200 else "refused"
                        if r.status == 409:
                            with contextlib.suppress(ValueError, TypeError, AttributeError):
                                why = json.loads(body).get("error")
                    # 503: the receiver does not know this node yet (one of them joined a moment ago;
                    # it asks the tracker, a round trip). A swarm's first version, published as it
                    # formed, meets this, and a stripe lost so cost every region ``STRIPE_WAIT`` (with
                    # spare connections opened without a request, so pushes came sooner, two first
                    # versions in three of one chunk to 8 daemons in 8 regions took 10x the bound).
                    if r.status != 503 or attempt == PUSH_TRIES - 1 or self._closing:
                        break
                    await asyncio.sleep(NOT_YET_RETRY)
        except (_Cut, aiohttp.ClientError, asyncio.TimeoutError, OSError):
            pass
        finally:
            self.pushing_to.discard((ps.node_id, vs.key, index))
            if counted is not None:
                counted.leave()
        self.pushes[outcome] += 1
        event(log, logging.DEBUG, "pushed a chunk", peer=ps.node_id, object=str(vs.key), index=index, outcome=outcome,
              contact=ps.node_id not in self.peers,  # contact: a head of another region this node does not peer with
              root=vs.roots.get(index))
        if outcome == "taken":
            self.daemon.count_bytes("up", size, wan)
            if stripe is not None:
                self.stripes["sent"] += 1
        elif outcome == "refused" and stripe is not None and why != "being fetched" and not self._closing:
            for pid in fallback:  # (one fetching the chunk whole hands its stripe on from that)
                self._stripe_to(vs, index, pid, stripe)

    def _also_header(self, key: Key, index: int, to: str) -> dict[str, str]:
        """A push's ``ALSO_HEADER``: the other peers this node pushes the chunk to now, if it fits."""
        also = ",".join(sorted(p for (p, o, i) in self.pushing_to if o == key and i == index and p != to))
        return {ALSO_HEADER: also} if also and len(also) <= ALSO_HEADER_MAX else {}

    def _take_root(self, vs: VersionState, index: int, root: str | None) -> None:
        """Where chunk ``index`` entered the swarm (a stream's ``ROOT_HEADER``, or this node's region for
        a chunk from the trainer), kept when it names a region whose heads this node knows: its pushes
        then follow the chunk's region tree. A stream that names none, or a false one, leaves the
        greedy choice (a false root can only make a chunk cross later, by pull)."""
        m = self.daemon.membership
        if root and index not in vs.roots and m is not None and root in m.state.heads:
            vs.roots[index] = root

    def wan_delay(self) -> float | None:
        """The one-way delay between regions as this node measured it, seconds: half the median, over
        the other regions it peers with, of the shortest round trip to any of their nodes (its
        exchanges, ``PeerState.rtt``, an exchange that opened its connection counted half); None before
        any. It times the chunks' region trees."""
        me = self.daemon.settings.region
        best: dict[str, float] = {}
        for p in self.peers.values():
            if p.rtt is not None and p.region != me:
                best[p.region] = min(best.get(p.region, math.inf), p.rtt)
        return statistics.median(best.values()) / 2 if best else None

    def _peer(self, node_id: str) -> PeerState | None:
        """A peer's state, or for a head of another region this node does not peer with (heads push
        to each other across regions), a contact's: no exchanges with it, only pushes."""
        if (ps := self.peers.get(node_id)) is not None:
            return ps
        m = self.daemon.membership
        e = m.head(node_id) if m is not None else None
        return None if e is None else self._contact(e)

    def _contact(self, e: dict) -> PeerState | None:
        """The contact for a head's tracker entry ``e`` (``_peer``), made (and a spare connection opened
        to it) the first time and when its address changed; None for one that is no rollout or banned."""
        node_id = e["node_id"]
        if e.get("role") != "rollout" or node_id in self.banned:
            return None
        c = self.contacts.get(node_id)
        if c is None or c.address != e.get("address"):
            if len(self.contacts) > 1024:  # heads of regions long gone
                self.contacts.clear()
            c = self.contacts[node_id] = PeerState(node_id, str(e.get("address")), str(e.get("region")), "rollout")
            self._warm(c)
        return c

    def _take_pushed_statement(self, request: web.Request, key: Key, i: int, pusher: str) -> str | None:
        """The statement a push carries (``STATEMENT_HEADER``), taken where this node lacks chunk
        ``i``'s block hashes, as an exchange reply's would be: a node that has not heard of the version
        yet checks the push at once rather than waiting for the trainer's announcement (a swarm just
        formed hears of its first version a long poll's round trip late: one chunk to 4 daemons in 4
        regions over 200 ms round trips, 2.0-2.4x the bound, every region's push waiting for it). The
        trainer's signature vouches for it, not the pusher; one that does not check bans the pusher,
        as a forged statement in an exchange reply does. Why it does not hold, or None."""
        raw = request.headers.get(STATEMENT_HEADER)
        vs = self.versions.get(key)
        if raw is None or self.signer is not None or (vs is not None and vs.blocks.get(i) is not None):
            return None
        if key.version <= self.floor() and vs is None:
            return None  # older than this node's position: of no use to it (declined below)
        try:
            if len(raw) > STATEMENT_HEADER_MAX:
                raise FormatError(f"over {STATEMENT_HEADER_MAX} characters")
            st = Signed.from_bytes(base64.b64decode(raw, validate=True), what="pushed statement")
            if st.kind != announce_kind(key.anchor) or st.version != key.version:
                raise FormatError(f"not an announcement of {key}")
            fresh = vs or VersionState(key.version, key.anchor)
            self._take_statement(fresh, st)
            if fresh.blocks.get(i) is None:
                raise FormatError(f"announces no block hashes for chunk {i}")
        except (FormatError, IntegrityError, ValueError) as e:
            if isinstance(e, IntegrityError) and (ps := self._peer(pusher)) is not None:
                self._ban(ps, f"pushed a statement that does not check: {e}")
            return f"pushed statement: {e}"
        if vs is None:
            self.versions[key] = fresh
        self._touch()
        self._wake_announced()
        return None

    def _wake_announced(self) -> None:
        """New statements: pushes waiting for their chunk's block hashes look again (``handle_push``)."""
        self._announced.set()
        self._announced = asyncio.Event()

    def _declines(self, key: Key, i: int, ps: PeerState | None, *, replacing: bool = False,
                  stripe: str | None = None) -> str | None:
        """Why a push of chunk ``i`` of ``key`` from ``ps`` is not taken now, if it is not (``replacing``:
        it is to take the place of the request out for the chunk; ``stripe``: it is one stripe of the
        chunk, its ``STRIPE_HEADER``, taken beside the other stripes arriving)."""
        vs = self.versions.get(key)
        if self.signer is not None:
            return "the trainer takes no pushes"
        if ps is None or ps.role == "trainer":
            return "not a peer of this node"
        if vs is None or i not in vs.chunks or vs.blocks.get(i) is None:
            return NO_HASHES
        if i in vs.have:
            return "held"
        part = self.partials.get((key, i))
        joining = stripe is not None and part is not None and part.striped and not part.failed
        if stripe is not None:
            try:
                s, n = parse_stripe(stripe, len(vs.blocks[i]) // BLOCK_HASH)
            except ValueError as e:
                return str(e)
        if stripe is not None and (key, i) in self.unstriped and (key, i) in self.inflight:
            # Its stripes stopped short and it is asked for whole: stripes pushed now would replace that
            # request (``_unstarted``) and stop short again (at 2 s round trips, a chunk's fallback across
            # was so replaced by four stripes of a seventh, and the region waited out STRIPE_WAIT twice).
            return "asked for whole"
        if joining:
            # (Not who pushes it: a request this node made to the same peer, just replaced by a stripe
            # from another, is still in flight until its task has run its cancellation, and declining
            # the first holder's stripe for it lost that stripe to every region.)
            if part.holds_stripe((s, n)):
                return "stripe held"
        elif (key, i) in self.inflight and not replacing:
            return "being fetched"
        if key not in self.wanted():
            return "not wanted"
        if time.monotonic() < self.store_paused_until:
            return "busy"
        if stripe is None and len(self._taking) - len(self._taking_stripes) >= PUSHES_TAKEN:
            return "busy"
        if stripe is not None and not joining and \
                sum(1 for p in self.partials.values() if p.striped and not p.whole) >= STRIPED_TAKEN:
            return "busy"
        return None

    def _unstarted(self, key: Key, i: int, pusher: str) -> asyncio.Task | None:
        """The one request out for chunk ``i`` of ``key``, if no byte of it has arrived yet and it went
        to a rollout, not to the trainer: super-seeding counts that request as a first copy taken, and
        if the push's feed then failed the chunk waited for it (``bench sim``, 10% of 40 nodes leaving:
        2.67x the bound with such requests replaced, the trainer giving the copy again ``claim_within``
        after its node hung up; 1.19x keeping them; on 8 daemons without churn the two were alike). A
        request whose response has not begun has no partial yet: it is the most unstarted of all (it
        was not replaced: in a swarm's first version the pushes into two of three regions were
        declined, their nodes' first requests having gone out a moment before). A request to the
        pusher itself is replaced too: across regions it reaches the pusher a one-way delay after its
        push has begun here, and the pusher refuses a request for a chunk it is pushing to the asker
        (``handle_chunk``). Kept, it was served a round trip late: one chunk to 4 daemons in 4 regions
        over 200 ms round trips, the second crossing of the chunk's region tree declined for the
        request its target had just sent to the same head, 1.5x the bound."""
        tasks = self.inflight.get((key, i), {})
        part = self.partials.get((key, i))
        if len(tasks) != 1 or (part is not None and part.got):
            return None
        ((peer, t),) = tasks.items()
        if (ps := self.peers.get(peer)) is None or ps.role == "trainer":
            return None
        return None if t in self._taking else t

    async def handle_push(self, request: web.Request) -> web.Response:
        """A chunk a peer sends unasked (``_push_to``): taken only from a rollout peer this node knows,
        for a chunk it wants, neither holds nor fetches, and can check block by block against the
        trainer's signed hashes; then received as if fetched (``_receive``), so it is relayed on at
        once. A bad block bans the sender, as for a chunk asked for."""
        asked = self._chunk_request(request)
        if isinstance(asked, web.Response):
            return asked
        key, i, remote = asked
        if (bad := self._take_pushed_statement(request, key, i, remote.node_id)) is not None:
            self.pushes["declined"] += 1
            event(log, logging.WARNING, "declined a push: its statement does not hold", peer=remote.node_id,
                  object=str(key), index=i, reason=bad)
            return web.json_response({"error": bad}, status=400)
        stripe = request.headers.get(STRIPE_HEADER)
        why = self._declines(key, i, self._peer(remote.node_id), stripe=stripe)
        give_up = time.monotonic() + PUSH_STATEMENT_WAIT
        while why == NO_HASHES and (left := give_up - time.monotonic()) > 0:
            # The push outran the trainer's announcement (the pusher had it first): wait for it. (On
            # ``changed`` this waited out the whole 0.5 s: taking statements only touches ``gen``. A
            # swarm's first version waited so at every region's first push: 4.3-4.8x the bound.)
            announced = self._announced
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await announced.wait()
            why = self._declines(key, i, self._peer(remote.node_id), stripe=stripe)
        # Asked of another peer a moment ago, and not a byte back yet: the push, here now, takes the
        # request's place (declined, it held the pusher's slot for a round trip for nothing). Looked
        # for after the wait too: the announcement that ends it also starts this node's own request,
        # and a swarm's first version declined the pushes into its other regions so, each region's
        # nodes then pulling across from the trainer's first holder at a share of its uplink.
        pull = self._unstarted(key, i, remote.node_id) if why == "being fetched" else None
        if pull is not None:
            why = self._declines(key, i, self._peer(remote.node_id), replacing=True, stripe=stripe)
        if why is not None:
            self.pushes["declined"] += 1
            event(log, logging.DEBUG, "declined a push", peer=remote.node_id, object=str(key), index=i, reason=why)
            return web.json_response({"error": why}, status=409)
        ps, vs = self._peer(remote.node_id), self.versions[key]
        part = self.partials.get((key, i))
        # (``_declines`` checked the header: it parses)
        striped = None if stripe is None else parse_stripe(stripe, len(vs.blocks[i]) // BLOCK_HASH)
        self._take_root(vs, i, request.headers.get(ROOT_HEADER))
        if (also := request.headers.get(ALSO_HEADER, "")) and len(also) <= ALSO_HEADER_MAX:
            self.fed_along.setdefault(key, {})[i] = frozenset(also.split(",")) - {self.daemon.node_id}
        if pull is not None:  # replaced before any await, so the scheduler cannot ask again meanwhile
            self.partials.pop((key, i), None)  # the request's, if its response began: nothing served from it
            pull.cancel()
            part = None
        into = None
        if striped is not None:  # the stripes of a chunk share one buffer, made before any await
            if part is None or not part.striped or part.failed:
                into = Partial(vs.chunks[i].size, vs.block, vs.blocks[i], what=f"chunk {i} of {key}")
                into.stripe()
                self.partials[(key, i)] = into
            else:
                into = part
            into.stripe_got[striped] = 0
            into.fed_at = time.monotonic()
            if ps.region == vs.roots.get(i):
                into.own.setdefault(striped)  # from the root region: handed on if a receiver (``_stripe_out``)
            into.feeders += 1
        event(log, logging.DEBUG, "taking a push", peer=remote.node_id, object=str(key), index=i, stripe=stripe)
        task = asyncio.create_task(self._receive(ps, vs, i, _body(request), whole=False, stripe=striped, into=into),
                                   name=f"pushed-{key.tag}-{i}")
        self._track(ps, (key, i), task)
        self._taking.add(task)
        if into is not None:
            self._taking_stripes.add(task)
        try:  # as long as a fetch of it may take; a stalled push makes way for a request
            await asyncio.wait({task}, timeout=stream_timeout(vs.chunks[i].size, _send_time(vs, i)))
        finally:
            self._taking.discard(task)
            self._taking_stripes.discard(task)
            if not task.done():  # it stalled, or this handler was cancelled (the sender hung up)
                task.cancel()
                await asyncio.wait({task})
        stored = not task.cancelled() and task.exception() is None and task.result()
        if not task.cancelled() and task.exception() is not None:
            event(log, logging.ERROR, "a push could not be taken", peer=remote.node_id, object=str(key), index=i,
                  reason=repr(task.exception()))
        if stored:
            self.pushes["received"] += 1
        return web.json_response({"stored": bool(stored)})


def _superseed(chunks: int) -> SuperSeed:
    return SuperSeed(chunks, per_peer=SEED_PER_PEER, single_from=SEED_SINGLE_FROM)


@dataclass(frozen=True)
class _Served:
    """The start of a chunk stream's pieces (``Swarm._receive``): it is served, at the rate its sender
    declared (None: not said)."""

    rate: float | None


def _send_time(vs: VersionState, index: int | None = None) -> float | None:
    """The trainer's signed time to send chunk ``index`` (``tree_timing``'s ``send``), or the longest of
    the version's chunks; None where no announcement timed one."""
    trees = vs.trees.values() if index is None else [vs.trees.get(index)]
    return max((t[0] for t in trees if t is not None), default=None)


def _declared_rate(headers) -> float | None:
    """A stream's ``RATE_HEADER``: bytes a second, positive and finite, else None."""
    try:
        rate = float(headers.get(RATE_HEADER, ""))
    except ValueError:
        return None
    return rate if math.isfinite(rate) and rate > 0 else None


def _bounded(bitmap: bytes, vs: VersionState | None) -> bytes:
    """A peer's have-map cut to the chunks this node knows of that version (its chunk count, once the
    manifest gives it; else the chunks announced, with room for a few more): a have-map never costs
    more than the version it describes, whatever its sender claims."""
    if vs is None:
        return bitmap[:UNKNOWN_HAVE_BYTES]
    n = vs.total if vs.total is not None else len(vs.chunks) + 64
    return bitmap[:(n + 7) // 8]


def _statement_header(vs: VersionState, index: int) -> dict[str, str]:
    """A push's ``STATEMENT_HEADER``: the statement announcing chunk ``index``, if it fits."""
    st = vs.announced.get(index)
    raw = base64.b64encode(st.to_bytes()).decode() if st is not None else ""
    return {STATEMENT_HEADER: raw} if raw and len(raw) <= STATEMENT_HEADER_MAX else {}


async def _body(request: web.Request):
    """A push's body in pieces, as ``_receive`` reads them (an async generator, which it closes)."""
    yield _Served(_declared_rate(request.headers))
    async for piece in request.content.iter_chunked(PIECE):
        yield piece


class _Cut(Exception):
    """The fetch a cut-through stream was fed by failed."""


async def _pieces(source: Path | Partial, first: int = PIECE, most: int = PIECE):
    """A chunk's bytes in pieces of at most ``most`` (the first of at most ``first``): from its file,
    or from a fetch in progress as its blocks check out (``_Cut`` if that fetch fails first)."""
    if isinstance(source, Path):
        with open(source, "rb") as f:
            piece = f.read(first)
            while piece:
                yield piece
                piece = f.read(most)
        return
    mv, sent = memoryview(source.buf), 0
    while sent < source.size:
        await source.wait(sent)
        if source.failed:
            raise _Cut()
        end = min(source.ready, first) if sent == 0 else source.ready
        for o in range(sent, end, most):
            yield mv[o : min(o + most, end)]
        sent = end


async def _stripe_pieces(source: Path | Partial, s: int, n: int, block: int, size: int):
    """Stripe ``s`` of ``n`` of a chunk of ``size`` bytes hashed in ``block``-byte blocks, a block a
    piece, in order: from its file, or as each block checks out in a fetch in progress (``_Cut`` if
    that fetch fails first)."""
    blocks = -(-size // block)
    if isinstance(source, Path):
        with open(source, "rb") as f:
            for b in stripe_blocks(s, n, blocks):
                f.seek(b * block)
                yield f.read(min(block, size - b * block))
        return
    mv = memoryview(source.buf)
    for b in stripe_blocks(s, n, blocks):
        await source.wait_block(b)
        if source.failed:
            raise _Cut()
        yield mv[b * block : min((b + 1) * block, size)]
