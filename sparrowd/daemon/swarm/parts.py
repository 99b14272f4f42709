"""The state every part of the swarm driver shares, and the node's own readings of it: ``Parts``
holds the per-version and per-peer tables, the change counter the long polls wait on, what the node
reports (position, what it wants, progress), and the signed statements it takes and retires. Each
job's part (``peers``, ``serve``, ``uplink``, ``fetch``, ``receive``, ``push``) subclasses it, and
``Swarm`` (``node``) is made of them all; the trainer's part (``seed.Seed``) is an object the
trainer's ``Parts`` constructs and holds (``seed``).

What a part calls of another part is declared here too, for the type checker only (``TYPE_CHECKING``):
the part that defines it overrides the declaration, and mypy holds the two to one signature.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from ...swarm.bucket import DEFAULT_BURST, TokenBucket
from ...swarm.budget import Budgets
from ...swarm.chain import Key, advance, retained, wanted
from ...swarm.identity import Ticket
from ...swarm.picker import Picker
from ...swarm.policy import DISCOVERY_EVERY, RELAY_CONCURRENT, SEED_CONCURRENT
from ...swarm.signing import Signed, Signer, Verifier
from ...swarm.versions import VersionState
from ..cutthrough import Partial
from ..logs import Throttle, event
from ..store import ChunkStore
from .context import SwarmHost
from .seed import Seed
from .state import PeerState, Remote

__all__ = ["Parts"]

log = logging.getLogger("sparrowd.swarm")


class Parts:
    """A node's swarm state: the tables below, shared by every part; the trainer's own part and
    state are ``seed`` (None on a relay)."""

    def __init__(self, host: SwarmHost, store: ChunkStore, *, signer: Signer | None, retain: int,
                 upload_rate: int | None, download_rate: int | None, wan_upload_rate: int | None,
                 rate_burst: float = DEFAULT_BURST) -> None:
        self.host = host  # all it takes of the daemon (``context.SwarmHost``)
        self.store = store
        self.signer = signer
        self.verifier: Verifier | None = Verifier(signer.public) if signer else None
        # The trainer's part (publishing, super-seeding, the choker), constructed on the trainer only.
        self.seed: Seed | None = Seed(self, signer) if signer is not None else None
        self.retain = retain
        # The version this node can produce, kept on disk: the base model (0) until it moves, or
        # nothing (-1) for a node that keeps a current folder, which starts from an anchor.
        self.at = -1 if host.settings.keeps_current else 0
        self.versions: dict[Key, VersionState] = {}  # patches and anchors
        self.trainer_heard = False  # an exchange with the trainer told this node what the chain holds
        self.engine_floor: int | None = None  # the oldest version an attached engine holds
        self.current_floor: int | None = None  # the current-version folder's version (-1: none yet)
        self.pinned: set[Key] = set()  # objects being read from disk (the folder's builder): kept from retention
        self.peers: dict[str, PeerState] = {}
        self.remotes: dict[str, Remote] = {}
        self.held_by: dict[Key, collections.Counter] = {}  # per object: chunk -> peers whose have-maps show it
        self._showing = 0  # peers whose have-maps show any chunk
        self._discovered_at = -DISCOVERY_EVERY  # last early renewal for a stranger (_discover)
        self.banned: set[str] = set()
        self.contacts: dict[str, PeerState] = {}  # other regions' heads met only through pushes (``_peer``)
        self._joins_seen = 0  # the latest join the trainer told of (its exchange replies' ``joins``)
        self._announced = asyncio.Event()  # set, and replaced, as peers' statements arrive (``handle_push``)
        self.refused: collections.Counter = collections.Counter()  # requests refused at the door, by reason
        self.bans: collections.Counter = collections.Counter()  # peers banned, by reason
        self.lies = 0  # chunks peers advertised and did not serve
        self._proofs_ok: dict[tuple[str, int, str], float] = {}  # (node, epoch, proof) -> checked at
        self._tickets: dict[str, Ticket | None] = {}  # ticket text -> its claims (None: not this swarm's)
        self.budgets = Budgets()  # what each peer's exchanges may cost this node (swarm.budget)
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
        self.picker = Picker(host.node_id, host.settings.region)
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
            one = asyncio.Semaphore(SEED_CONCURRENT)
            self._uploads = {False: one, True: one}
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
        return self.signer is None and self.host.settings.cut_through

    def latest(self) -> int | None:
        return max(self.held(), default=None)

    def _version(self, key: Key) -> VersionState:
        vs = self.versions.get(key)
        if vs is None:
            vs = self.versions[key] = VersionState(key.version, key.anchor)
        return vs

    def _take_statement(self, vs: VersionState, s: Signed) -> list[int]:
        assert self.verifier is not None  # statements come only once the trainer's key is known
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
        self.host.report_changed()

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
            if self.seed is not None:
                self.seed.superseed.pop(k, None)
            self.pushed.pop(k, None)
            self.striped_to.pop(k, None)
            self.fed_along.pop(k, None)
            for pk in [pk for pk, p in self.partials.items() if pk[0] == k and p.striped and not p.feeders]:
                self.partials.pop(pk).abort()  # stripes of it that stopped short, not yet given up
            event(log, logging.INFO, "dropped (retention)", object=str(k), retain=self.retain)

    if TYPE_CHECKING:
        # What one part calls of another (the defining part is named): declarations for the checker.

        # serve
        def _chunk_request(self, request: web.Request) -> tuple[Key, int, Remote] | web.Response: ...

        # uplink
        def _may_download(self, remote: Remote) -> bool: ...
        def _lane(self, remote: Remote) -> bool: ...
        def _upload_slot(self, lane: bool) -> AbstractAsyncContextManager[None]: ...
        def _paced(self, source: Path | Partial, wan: bool, block: int = ..., stripe: tuple[int, int] | None = None,
                   size: int = 0) -> AsyncIterator[bytes | memoryview]: ...
        def _rate_header(self, wan: bool, source: Path | Partial) -> dict[str, str]: ...

        # peers
        def _proof_for(self, ps: PeerState) -> dict[str, str]: ...
        def _tell_peers(self) -> None: ...
        def _lied(self, ps: PeerState, key: Key, index: int) -> None: ...
        def _ban(self, ps: PeerState, reason: str, kind: str = ...) -> None: ...
        def wan_delay(self) -> float | None: ...
        def _peer(self, node_id: str) -> PeerState | None: ...

        # fetch
        def _track(self, ps: PeerState, key: tuple[Key, int], task: asyncio.Task) -> None: ...

        # receive
        async def _receive(self, ps: PeerState, vs: VersionState, index: int,
                           pieces: AsyncIterator[object], *, whole: bool,
                           stripe: tuple[int, int] | None = None, into: Partial | None = None) -> bool: ...
        def _wake_announced(self) -> None: ...

        # push
        def _push_out(self, vs: VersionState, index: int) -> None: ...
        def _take_root(self, vs: VersionState, index: int, root: str | None) -> None: ...
