"""Connections the daemon's port accepts: who may hold one, and for how long.

The port is on the internet. A connection is *authorised* once a request on
it has passed authentication (the swarm token, a credential, or a member's
ticket and proof); until then it is a stranger's, and the rules are:

* a request head that has begun must be complete within ``HEAD_TIMEOUT``
  seconds, and a connection whose request was refused is closed that long
  after its first byte: half-sent heads (slowloris) are shed;
* at most ``MAX_PENDING_PER_ADDRESS`` such connections per remote address;
* in all, at most ``max_total`` connections (three quarters of the open-file
  limit): past either cap, the oldest stranger's connection is closed to make
  room, and only when there is none is the new one refused. Authorised
  connections (a peer's long poll, tracker renewals, the local CLI) are never
  closed for a stranger.

A connection that has carried no byte yet (a peer's spare, opened ahead of its
first push) is kept, within the caps. Authorised connections stay open while
idle for aiohttp's keep-alive (``membership.SERVER_KEEPALIVE``).

:class:`ConnectionGuard` holds the rules over plain state and takes ``now``;
:class:`GuardedRunner` wires it into aiohttp's server.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import resource
import time
from dataclasses import dataclass

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from .logs import Throttle, event

__all__ = ["ConnectionGuard", "GuardedRunner", "HEAD_TIMEOUT", "MAX_PENDING_PER_ADDRESS"]

log = logging.getLogger("sparrowd.connections")

HEAD_TIMEOUT = 5.0  # seconds from a stranger's first byte to its request passing authentication
MAX_PENDING_PER_ADDRESS = 64  # connections one address holds that have not authenticated
SWEEP_EVERY = 1.0


def default_total() -> int:
    """Three quarters of the open-file limit: the rest is for chunk files, the lease database and
    this node's own connections to its peers."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 16
    return max(64, soft * 3 // 4)


@dataclass(slots=True)
class Conn:
    address: str
    opened: float
    first_byte: float | None = None  # of the request under way, while the connection is a stranger's
    authorised: bool = False


class ConnectionGuard:
    """The rules above over the connections open now; ``close(handle)`` closes one."""

    def __init__(self, close, *, max_total: int | None = None, per_address: int = MAX_PENDING_PER_ADDRESS,
                 head_timeout: float = HEAD_TIMEOUT):
        self._close = close
        self.max_total = max_total if max_total is not None else default_total()
        self.per_address = per_address
        self.head_timeout = head_timeout
        self.conns: dict[object, Conn] = {}
        self.strangers: dict[object, Conn] = {}  # insertion order: oldest first
        self.pending: collections.Counter = collections.Counter()  # address -> strangers' connections
        self.shed: collections.Counter = collections.Counter()  # reason -> connections closed (metrics)
        self._log = Throttle(10.0)

    def opened(self, handle, address: str, now: float) -> bool:
        """A new connection: False when it is refused (the caller closes it)."""
        c = Conn(address, now)
        if self.pending[address] >= self.per_address and not self._evict(address, now, "per-address"):
            self.shed["refused"] += 1
            return False
        if len(self.conns) >= self.max_total and not self._evict(None, now, "total"):
            self.shed["refused"] += 1
            return False
        self.conns[handle] = c
        self.strangers[handle] = c
        self.pending[address] += 1
        return True

    def received(self, handle, now: float) -> None:
        """Bytes arrived on a connection: a stranger's request head starts its clock."""
        c = self.strangers.get(handle)
        if c is not None and c.first_byte is None:
            c.first_byte = now

    def authorised(self, handle) -> None:
        """A request on this connection passed authentication: it is a member's (or the operator's) now."""
        c = self.strangers.pop(handle, None)
        if c is not None:
            c.authorised = True
            self._unpend(c.address)

    def closed(self, handle) -> None:
        c = self.conns.pop(handle, None)
        if c is not None and self.strangers.pop(handle, None) is not None:
            self._unpend(c.address)

    def sweep(self, now: float) -> int:
        """Close strangers' connections whose request did not authenticate within the head timeout."""
        late = [h for h, c in self.strangers.items()
                if c.first_byte is not None and now - c.first_byte >= self.head_timeout]
        for h in late:
            self._drop(h, "head-timeout")
        return len(late)

    def _evict(self, address: str | None, now: float, why: str) -> bool:
        """Close the oldest stranger's connection (from ``address``, if given) to make room."""
        for h, c in self.strangers.items():
            if address is None or c.address == address:
                self._drop(h, why)
                if self._log.due(why, now):
                    event(log, logging.WARNING, "shed a connection that had not authenticated", reason=why,
                          remote=c.address, open=len(self.conns))
                return True
        return False

    def _drop(self, handle, why: str) -> None:
        self.closed(handle)
        self.shed[why] += 1
        self._close(handle)

    def _unpend(self, address: str) -> None:
        self.pending[address] -= 1
        if self.pending[address] <= 0:
            del self.pending[address]


class _GuardedHandler(RequestHandler):
    """aiohttp's connection protocol, telling the guard when bytes arrive."""

    def data_received(self, data: bytes) -> None:
        guard = getattr(self._manager, "guard", None)
        if guard is not None:
            guard.received(self, time.monotonic())
        super().data_received(data)


class _GuardedServer(Server):
    guard: ConnectionGuard

    def __call__(self) -> RequestHandler:
        return _GuardedHandler(self, loop=self._loop, **self._kwargs)

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        peer = transport.get_extra_info("peername")
        address = peer[0] if isinstance(peer, tuple) and peer else "?"
        if not self.guard.opened(handler, address, time.monotonic()):
            transport.abort()

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        self.guard.closed(handler)
        super().connection_lost(handler, exc)


def _abort(handler: RequestHandler) -> None:
    transport = handler.transport
    if transport is not None:
        transport.abort()


class GuardedRunner(web.AppRunner):
    """An AppRunner whose server applies a :class:`ConnectionGuard` (``guard``) to every connection."""

    def __init__(self, app: web.Application, *, guard: ConnectionGuard | None = None, **kwargs):
        super().__init__(app, **kwargs)
        self.guard = guard if guard is not None else ConnectionGuard(_abort)
        self._sweeper: asyncio.Task | None = None

    async def _make_server(self) -> Server:
        server = await super()._make_server()
        server.__class__ = _GuardedServer  # the same object, its protocol factory and hooks guarded
        assert isinstance(server, _GuardedServer)  # (what the line above made it; tells the type checker)
        server.guard = self.guard
        return server

    async def setup(self) -> None:
        await super().setup()
        self._sweeper = asyncio.create_task(self._sweep(), name="connection-guard")

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_EVERY)
            self.guard.sweep(time.monotonic())

    async def cleanup(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        await super().cleanup()

    def authorise(self, request: web.Request) -> None:
        """The request passed authentication: its connection is kept as a member's."""
        self.guard.authorised(request.protocol)
