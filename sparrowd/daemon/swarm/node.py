"""The swarm driver, wired: ``Swarm`` is made of the parts beside it (``peers``, ``serve``, ``uplink``,
``seed``, ``fetch``, ``receive``, ``push``) over the state they share (``parts.Parts``). Here: its
lifecycle (load, start, stop).
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from ...swarm.identity import NODE_HEADER
from ...swarm.signing import Verifier
from ..logs import event
from .fetch import Fetching
from .peers import Peers
from .push import Pushing
from .receive import Receiving
from .seed import Seeding
from .serve import Serving
from .state import _superseed
from .uplink import Uplink
from .wire import REGION_HEADER, _new_connections

__all__ = ["Swarm"]

log = logging.getLogger("sparrowd.swarm")


class Swarm(Seeding, Serving, Uplink, Peers, Fetching, Receiving, Pushing):
    """A node's swarm driver: the state of ``Parts`` (``Swarm(host, store, signer=..., ...)``, host: what
    it takes of the daemon, ``context.SwarmHost``), and the jobs of the parts it is made of (each
    part's module says what it does)."""

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
        self._session = aiohttp.ClientSession(connector=self.host.outgoing(), connector_owner=False, headers={
            NODE_HEADER: self.host.node_id, REGION_HEADER: self.host.settings.region},
            trace_configs=[_new_connections()])
        if self.signer is not None:
            self._tasks.append(asyncio.create_task(self._choke_loop(), name="choker"))
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
