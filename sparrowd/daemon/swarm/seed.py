"""The trainer's part, ``Seed``: publishing (each chunk signed as it arrives, then the manifest), the
live peers it counts, its choke loop, and what its super-seeding shows and owes each peer
(``swarm.serving``). Only the trainer's ``Swarm`` constructs one (``Swarm.seed``; None on a relay);
it holds the trainer's own state (the signer, super-seeding, the choker, the live counts) and reads
the rest of the node's (``node``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
from typing import TYPE_CHECKING

import blake3

from ...codec.chunk import check_chunk_frame
from ...codec.manifest import Manifest
from ...errors import FormatError, IntegrityError
from ...swarm import serving
from ...swarm.chain import Key
from ...swarm.choker import Choker, ChokerPeer
from ...swarm.policy import CHOKE_EVERY, LIVE_EVERY, LIVE_WITHIN, OPTIMISTIC_EVERY, UPLOAD_SLOTS
from ...swarm.push import tree_timing
from ...swarm.serving import Slots
from ...swarm.signing import Signer, announce_kind, manifest_kind
from ...swarm.superseed import SuperSeed
from ...swarm.versions import ChunkRef, VersionState, announce_body, block_for, block_hashes, check_kind
from ..logs import event
from .state import Remote, _superseed

if TYPE_CHECKING:
    from .parts import Parts

__all__ = ["Seed"]

log = logging.getLogger("sparrowd.swarm")


class Seed:
    """The trainer's part of ``Swarm``: publishing, the live peers, the choke loop, super-seeding's offers."""

    def __init__(self, node: Parts, signer: Signer) -> None:
        self.node = node  # the swarm whose trainer this is: its versions, peers, store, uplink
        self.signer = signer
        self.superseed: dict[Key, SuperSeed] = {}
        self.choker = Choker(slots=UPLOAD_SLOTS, optimistic_interval=OPTIMISTIC_EVERY)
        self.unchoked: set[str] = set()
        # Set when a new version begins (the trainer's first chunk of it): every peer is interested
        # again, and slots held by peers of other regions since the last version would keep the first
        # copies from the trainer's own region for up to a second (``first_copies_near``).
        self.rechoke = asyncio.Event()
        self.live_regions: set[str] = set()  # the regions of the peers ``live`` counted
        self.live_delay: float | None = None  # the median one-way delay they measured (``live``)
        self.live_at, self.live_count = float("-inf"), (0, 0, 0, 0)  # ``live``: peers heard from lately, when
        self.row_told = float("-inf")  # when the trainer last renewed early to report its uploads

    def load(self, vs: VersionState) -> None:
        """A version loaded from the store: super-seeding starts on it again."""
        if vs.total is not None:
            self.superseed[vs.key] = _superseed(vs.total)

    def recount(self) -> None:
        """Count the live peers again at the next ``live``, not a second later."""
        self.live_at = float("-inf")

    async def publish_chunk(self, key: Key, index: int, data: bytes) -> dict:
        """Sign and store one chunk as it arrives. It must be a zstd frame of a sane size, so
        garbage is refused here rather than signed and sent everywhere (a full decode would cost
        the publisher tens of milliseconds a chunk; the engines decode and check every chunk)."""
        check_chunk_frame(data)
        node = self.node
        vs = node._version(key)
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
                                           tree=tree_timing(len(data), block, node.up.rate, self.delay())))
        node._take_statement(vs, s)
        await asyncio.to_thread(node.store.put_chunk, vs, index, data)
        if not vs.have:  # a new version: every peer wants it; decide whom to serve now, and count again
            self.rechoke.set()
            self.recount()
        vs.have.add(index)
        self.superseed.setdefault(key, _superseed(0)).grow(len(vs.chunks))
        await node.notify()
        return {"index": index, "new": True}

    def delay(self) -> float | None:
        """The one-way delay between regions: the median of what the nodes the trainer heard from in
        the last 30 s measured."""
        self.live()
        return self.live_delay

    def published(self) -> dict:
        """The chain as published: the newest version, its manifest's BLAKE3, the newest anchor; and
        what the Publisher cuts the next patch by (``auto_chunk_size``): the swarm's size, this
        daemon's upload limit (None: unlimited) and the round trip between regions."""
        done = [vs for vs in self.node.versions.values() if vs.complete]
        latest = max(done, key=lambda vs: (vs.version, not vs.anchor), default=None)
        anchors = [vs.version for vs in done if vs.anchor]
        manifest = latest.manifest if latest else None  # a complete version's
        return {"latest": latest.version if latest else None,
                "manifest": blake3.blake3(manifest.to_bytes()).hexdigest() if manifest is not None else None,
                "anchor": max(anchors, default=None), "rollouts": self.rollouts(),
                "uplink": self.node.up.rate or None, "round_trip": self._round_trip()}

    def _round_trip(self) -> float | None:
        """The round trip between regions as the rollouts measured it (twice ``delay``), None before
        any did: with the uplink, the Publisher sends a patch of a few round trips' sending whole."""
        d = self.delay()
        return None if d is None else 2 * d

    def rollouts(self) -> int | None:
        """The live rollouts (and relays) the tracker holds leases for, None where this daemon hosts no
        tracker: the Publisher cuts the next patch for a swarm of that size (``auto_chunk_size``)."""
        t = self.node.host.tracker
        return None if t is None else t.table.rollouts(t.clock())

    async def publish_manifest(self, data: bytes) -> dict:
        """A patch's manifest (it names its base) or an anchor's (it applies to nothing).
        A patch must apply to the newest version published and be newer; an anchor snapshots
        the newest version, or starts a newer one (for a change a patch cannot carry)."""
        node = self.node
        m = Manifest.from_bytes(data)
        key = Key(m.version, m.base_version is None)
        check_kind(m, key.anchor)
        vs = node._version(key)
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
        node._take_statement(vs, self.signer.sign(manifest_kind(key.anchor), m.version, m.to_bytes()))
        self.superseed.setdefault(key, _superseed(0)).grow(len(vs.chunks))
        if node.host.tracker is not None:
            node.host.tracker.table.set_latest_version(max(m.version, latest or 0))
        event(log, logging.INFO, "anchor published" if key.anchor else "version published", version=m.version,
              chunks=len(m.chunks), bytes=m.patch_bytes, base_version=m.base_version)
        node.retire()
        await node.notify()
        node.host.report_changed()  # the trainer's own row shows the version now, as a node's does
        return {"version": m.version, "anchor": key.anchor, "chunks": len(m.chunks), "new": True}

    def forget(self, node_id: str) -> None:
        """A node's lease ended: what super-seeding gave it goes to others."""
        for ss in self.superseed.values():
            ss.forget(node_id)

    def shows(self, remote: Remote, vs: VersionState) -> set[int]:
        """What the trainer shows a peer of a version: the super-seed's offer (``serving.trainer_shows``)."""
        node, settings = self.node, self.node.host.settings
        return serving.trainer_shows(
            vs.have, self.slots(), self.superseed.get(vs.key), time.monotonic(), remote.node_id,
            remote.have.get(vs.key, frozenset()), node.held_by.get(vs.key, {}),
            far=remote.region != settings.region, announced=len(vs.chunks), total=vs.total,
            super_seed=settings.super_seed,
            trusted=serving.trusted(any(remote.have.values()), bool(node._showing)), quick=self._quick(vs))

    def _quick(self, vs: VersionState) -> bool:
        """Whether the trainer sends this version in less than a round trip between regions
        (``serving.quick``): its size taken as its chunk count (the manifest's, else the chunks
        announced so far) times its first chunk's size, so no walk over a large version's chunks."""
        first = next(iter(vs.chunks.values()), None)
        return serving.quick(None if first is None else first.size, vs.total or len(vs.chunks), self.node.up.rate,
                             self.delay())

    def slots(self) -> Slots:
        """The trainer's upload slots as they stand (``serving.Slots``)."""
        here, remotes = self.node.host.settings.region, self.node.remotes
        live, near, regions, wanting = self.live()
        return Slots(self.choker, self.unchoked,
                     lambda p: (r := remotes.get(p)) is not None and r.region == here,
                     live, near, regions, wanting)

    def admits(self, remote: Remote) -> bool:
        """Whether the trainer serves ``remote`` now, as its slots admit (``serving.Slots.admits``)."""
        return self.slots().admits(remote.node_id, remote.region != self.node.host.settings.region)

    def chokes(self, remote: Remote) -> bool:
        """The ``choked`` flag of the trainer's exchange reply to ``remote`` (``serving.trainer_chokes``)."""
        return serving.trainer_chokes(self.slots(), remote.node_id, remote.region != self.node.host.settings.region,
                                      wants=self.wants(remote), owes=lambda: self._owes(remote))

    def owed(self, remote: Remote, key: Key) -> frozenset[int]:
        """The chunks of ``key`` super-seeding gave ``remote`` and it may still fetch (``serving.owed``)."""
        return serving.owed(self.superseed.get(key), remote.node_id, remote.have.get(key, frozenset()))

    def _owes(self, remote: Remote) -> bool:
        """Whether ``remote`` is owed a chunk (``owed``) of any version."""
        return any(self.owed(remote, k) for k in self.superseed)

    def may_fetch(self, remote: Remote, key: Key, index: int) -> bool:
        """Whether ``remote``'s request for chunk ``index`` of ``key`` is served now (else 503, "choked")."""
        return serving.may_fetch(self.admits(remote), index, self.owed(remote, key))

    def live(self) -> tuple[int, int, int, int]:
        """The peers heard from in the last 30 s: how many, how many of them in this node's region, how
        many regions they are in, and how many of this region's lack a chunk this node holds; counted
        at most once a second, and again when a version begins: the trainer asks on
        every exchange it answers, and every node of the swarm polls it."""
        now = time.monotonic()
        if now - self.live_at >= LIVE_EVERY:
            self.live_at = now
            here = self.node.host.settings.region
            live = [r for r in self.node.remotes.values() if now - r.last_seen < LIVE_WITHIN]
            near = [r for r in live if r.region == here]
            self.live_regions = {r.region for r in live}
            delays = [r.delay for r in live if r.delay is not None]
            self.live_delay = statistics.median(delays) if delays else None
            self.live_count = (len(live), len(near), len(self.live_regions),
                               sum(1 for r in near if self.wants(r)))
        return self.live_count

    def wants(self, remote: Remote) -> bool:
        """Whether this node holds a chunk the peer lacks (as far as its last exchange told)."""
        return any(vs.have - remote.have.get(k, frozenset()) for k, vs in self.node.versions.items())

    async def choke_loop(self) -> None:
        node = self.node
        while True:
            now = time.monotonic()
            peers = []
            for r in node.remotes.values():
                if now - r.last_seen > LIVE_WITHIN:
                    continue
                p = node.peers.get(r.node_id)
                peers.append(ChokerPeer(r.node_id, self.wants(r), rate_from=p.rate.rate(now) if p else 0.0,
                                        rate_to=r.rate_to.rate(now), near=r.region == node.host.settings.region))
            # Only the trainer chokes, and it is a seed even while a version is being published: it
            # downloads nothing, so it ranks peers by what it sends them (its own region's first).
            unchoked = self.choker.decide(now, peers, seed=True)
            if any(ss.lapsing(now, node.held_by.get(k, {}).keys())
                   for k, ss in self.superseed.items()):
                await node.notify()  # an assignment lapsed: the peers' long polls answer, one gets it now
            if unchoked != self.unchoked:
                for pid in self.unchoked - unchoked:  # what a choked peer was given, and not asked for, goes
                    for ss in self.superseed.values():
                        ss.forget(pid, unclaimed_only=True)
                self.unchoked = unchoked
                await node.notify()  # peers waiting in an exchange learn their new choke state now
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.rechoke.wait(), CHOKE_EVERY)
            self.rechoke.clear()
