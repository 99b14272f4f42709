"""The fetching side: the scheduler asks the picker for requests whenever something changed, and
starts each chunk request; the region's crossers it counts on.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from ...swarm import serving
from ...swarm.chain import Key
from ...swarm.picker import PeerView, recount, slots_for_rate, stripes_stopped
from ...swarm.policy import PLAN_EVERY, PUSH_CLAIM
from ...swarm.serving import stream_timeout
from ...swarm.versions import VersionState
from ..logs import event
from .parts import Parts
from .state import PeerState
from .wire import PIECE, ROOT_HEADER, _declared_rate, _send_time, _Served

__all__ = ["Fetching"]

log = logging.getLogger("sparrowd.swarm")


class Fetching(Parts):
    """``Swarm``'s fetching side: the scheduler and its chunk requests."""

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
                                               if p.role != "trainer" and p.region == self.host.settings.region
                                               and not p.stalled))
                near = i in near_whole
                if not stripes_stopped(now, part.fed_at, round_trip, failed=part.failed, near_whole=near):
                    inflight[i].add("")
                else:
                    del self.partials[(k, i)]
                    part.abort()
                    self.unstriped.add((k, i))
                    checked = int(part.checked.sum()) if part.checked is not None else 0  # (a striped partial's)
                    event(log, logging.DEBUG, "stripes stopped short; asking for the chunk whole", object=str(k),
                          index=i, stripes=len(part.stripe_got), blocks=checked, of=part.blocks,
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
        code, so only the done callback releases its entry, the chunk's "being fetched" and the
        peer's request slot (evidence: docs/history/DESIGN-NOTES.md#fetch-track-release)."""
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
        m = self.host.membership
        return serving.crossers(self.host.node_id, m.state.gateways if m is not None else [],
                        lambda g: g in self.peers and not self.peers[g].stalled, trusted)

    def _neighbours(self) -> list[tuple[str, int]]:
        """The region's peers and the chunks each has shown holding, for ``recount``: a node counts on
        those that have shown holding chunks, which every node of the region sees alike, decided
        when it starts fetching a version and grown by the peers it learns of since; for the version
        only until they hold this node back (``Picker.stalled``)."""
        region = self.host.settings.region
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
                self._take_root(vs, index, self.host.settings.region if ps.role == "trainer"
                                else r.headers.get(ROOT_HEADER))
                if ps.role == "trainer":
                    vs.first_hand.add(index)
                yield _Served(_declared_rate(r.headers))  # what follows is the chunk
                async for piece in r.content.iter_chunked(PIECE):
                    yield piece

        await self._receive(ps, vs, index, pieces(), whole=whole)
