"""The swarm driver, wired: ``Swarm`` is made of the parts beside it (``peers``, ``serve``, ``uplink``,
``seed``, ``fetch``, ``receive``, ``push``) over the state they share (``parts.Parts``). Here: its
lifecycle (load, start, stop).
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from ...swarm.chain import Key
from ...swarm.identity import NODE_HEADER
from ...swarm.signing import Verifier
from ..logs import event
from .fetch import Fetching
from .peers import Peers
from .push import Pushing
from .receive import Receiving
from .seed import Seed
from .serve import Serving
from .uplink import Uplink
from .wire import REGION_HEADER, _new_connections

__all__ = ["Swarm"]

log = logging.getLogger("sparrowd.swarm")


class Swarm(Serving, Uplink, Peers, Fetching, Receiving, Pushing):
    """A node's swarm driver: the state of ``Parts`` (``Swarm(host, store, signer=..., ...)``, host: what
    it takes of the daemon, ``context.SwarmHost``), and the jobs of the parts it is made of (each
    part's module says what it does); on the trainer (a signer given), its part ``seed``."""

    def load(self) -> None:
        self.versions = self.store.load(self.verifier)
        self.at = self.store.read_position(self.at)
        if self.seed is not None:
            for vs in self.versions.values():
                self.seed.load(vs)
        if self.versions:
            event(log, logging.INFO, "chunk store loaded", versions=len(self.versions),
                  chunks=sum(len(v.have) for v in self.versions.values()))

    def set_verifier(self, verifier: Verifier) -> None:
        if self.verifier is None:
            self.verifier = verifier
            self.load()

    def start(self) -> None:
        # No Authorization header: a join secret goes to the tracker only, never to a peer.
        self._session = aiohttp.ClientSession(connector=self.host.outgoing(), connector_owner=False, headers={
            NODE_HEADER: self.host.node_id, REGION_HEADER: self.host.settings.region},
            trace_configs=[_new_connections()])
        if self.seed is not None:
            self._tasks.append(asyncio.create_task(self.seed.choke_loop(), name="choker"))
        else:  # relays admit by queue depth (_may_download)
            self._tasks.append(asyncio.create_task(self._peer_manager(), name="peers"))
            self._tasks.append(asyncio.create_task(self._scheduler(), name="scheduler"))

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

    # What the daemon asks of the trainer's part (its routes, its metrics).

    def _trainer(self) -> Seed:
        assert self.seed is not None, "publishing is the trainer's"  # (its routes are the tracker's only)
        return self.seed

    async def publish_chunk(self, key: Key, index: int, data: bytes) -> dict:
        return await self._trainer().publish_chunk(key, index, data)

    async def publish_manifest(self, data: bytes) -> dict:
        return await self._trainer().publish_manifest(data)

    def published(self) -> dict:
        return self._trainer().published()

    def delay(self) -> float | None:
        """The one-way delay between regions: on the trainer, the median of what the nodes it heard
        from in the last 30 s measured (``Seed.delay``); on a relay, its own measurement (``wan_delay``)."""
        return self.seed.delay() if self.seed is not None else self.wan_delay()
