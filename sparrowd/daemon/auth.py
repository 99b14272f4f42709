"""Who may ask this daemon anything: the shared tokens, join credentials, and the HTTP gate.

Every HTTP route needs the swarm token (``Authorization: Bearer TOKEN``,
compared in constant time) or a join credential the trainer signed and did not
revoke (``swarm.identity``); swarm routes need a member's ticket and proof
instead (``Swarm.admit``), checked from the headers before a byte of the body
is read. Anything else gets 401 and a log line, and learns nothing about the
swarm, not even which paths exist. A request that passes counts against its
peer's and its address's requests in flight; past either limit it gets 429.

Imports the pure core (``swarm.identity``) and the daemon's own ``logs``,
``membership`` (the bearer header), ``settings`` and ``swarm`` (its header
name); nothing here holds the daemon.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import ipaddress
import logging
import time
from collections.abc import Callable, Collection
from pathlib import Path

from aiohttp import web

from ..client import read_tokens
from ..errors import FormatError
from ..swarm.identity import CREDENTIAL_PREFIX, Credential, Refused
from .logs import Throttle, event
from .membership import bearer
from .swarm import NODE_HEADER

__all__ = ["Tokens", "Credentials", "Gate", "loopback", "route_label",
           "MAX_INFLIGHT_PER_PEER", "MAX_INFLIGHT_PER_ADDRESS"]

log = logging.getLogger("sparrowd.daemon")

MAX_INFLIGHT_PER_PEER = 32  # a node needs one long poll, a few have-pushes and up to 8 chunk requests
MAX_INFLIGHT_PER_ADDRESS = 1024  # many daemons may share an address (NAT, a proxy, one box)
_UNAUTHORIZED_LOG_EVERY = 10.0


def loopback(request: web.Request) -> bool:
    """Whether the request came from this machine."""
    try:
        return ipaddress.ip_address((request.remote or "").split("%")[0]).is_loopback
    except ValueError:
        return False


def route_label(request: web.Request) -> str:
    """The route's template for metrics labels (never the raw path: that is the client's choice,
    and every distinct label is memory kept for the process's life)."""
    route = request.match_info.route
    return route.resource.canonical if route.resource is not None else "other"


class Tokens:
    """The token file: its first line is what this node presents, every shared token on it is
    accepted. Credentials in it are checked by signature (``Credentials``), not by digest: a
    credential file admits this node only."""

    def __init__(self, token_file: Path):
        self.token_file = token_file
        self.token = ""
        self.digests: list[bytes] = []  # SHA-256 of "Bearer <token>" per accepted token

    def load(self) -> None:
        """(Re-)read the token file; a bad file raises and leaves the tokens in use."""
        tokens, too_open = read_tokens(self.token_file)
        if too_open:
            event(log, logging.WARNING, "token file is readable by group or others; chmod 600 it",
                  path=self.token_file)
        shared = [t for t in tokens if not t.startswith(CREDENTIAL_PREFIX)]
        self.digests = [hashlib.sha256(bearer(t).encode()).digest() for t in shared]
        self.token = tokens[0]

    def accepted(self) -> int:
        """How many tokens this node accepts (its own credential counted)."""
        return len(self.digests) + (1 if self.token.startswith(CREDENTIAL_PREFIX) else 0)

    def ok(self, header: str) -> bool:
        """Whether an Authorization header carries one of the shared tokens this node accepts."""
        given = hashlib.sha256(header.encode()).digest()
        ok = False
        for d in self.digests:  # every one compared: the time taken says nothing about which matched
            ok |= hmac.compare_digest(given, d)
        return ok

    def own(self, request: web.Request, header: str) -> bool:
        """The credential this node presents, from this machine: a local command (``sparrowd leave``)
        on a box whose token file holds a credential rather than the shared token."""
        if not self.token.startswith(CREDENTIAL_PREFIX) or not loopback(request):
            return False
        return hmac.compare_digest(hashlib.sha256(header.encode()).digest(),
                                   hashlib.sha256(bearer(self.token).encode()).digest())

    def local_ok(self, token: str) -> bool:
        """The engine socket: a shared token, or the credential this node itself presents."""
        own = hmac.compare_digest(hashlib.sha256(token.encode()).digest(),
                                  hashlib.sha256(self.token.encode()).digest())
        return self.ok(bearer(token)) or own


class Credentials:
    """Join credentials in Authorization headers, checked against the trainer's key (``trainer_key()``,
    None until one is known) and the revocations ``revoked()`` returns."""

    def __init__(self, trainer_key: Callable[[], bytes | None], revoked: Callable[[], Collection]):
        self._trainer_key = trainer_key
        self._revoked = revoked
        self._seen: dict[str, Credential | None] = {}  # credential text -> claims (None: bad)
        self.refused: Refused | None = None  # why ``check`` refused the last one it checked

    def check(self, header: str) -> Credential | None:
        """The claims of a valid, unrevoked, unexpired credential in an Authorization header, else None."""
        self.refused = None
        text = header[7:] if header.startswith("Bearer ") else ""
        if not text.startswith(CREDENTIAL_PREFIX):
            return None
        trainer = self._trainer_key()
        if trainer is None:  # no trainer key pinned yet: nothing can be checked
            return None
        if text not in self._seen:
            if len(self._seen) > 4096:
                self._seen.clear()
            try:
                self._seen[text] = Credential.parse(text, trainer)
            except (FormatError, Refused):
                self._seen[text] = None
        c = self._seen[text]
        if c is None:
            return None
        try:
            c.check(time.time(), self._revoked())
        except Refused as e:
            self.refused = e
            return None
        return c


class Gate:
    """The middleware in front of every route: who is asking (``admit`` for peers on ``/v1/swarm/``,
    ``tokens`` and ``credentials`` for the rest), and how many of their requests are in flight.
    ``metrics`` counts requests by route and status; ``authorise`` keeps a passed request's
    connection as a member's."""

    def __init__(self, tokens: Tokens, credentials: Credentials, admit: Callable, metrics,
                 authorise: Callable[[web.Request], None] = lambda request: None):
        self.tokens = tokens
        self.credentials = credentials
        self.admit = admit
        self.metrics = metrics
        self.authorise = authorise
        self._unauthorized_log = Throttle(_UNAUTHORIZED_LOG_EVERY)  # a warning per address, not per request
        self._flood_log = Throttle(_UNAUTHORIZED_LOG_EVERY)
        self._inflight: collections.Counter = collections.Counter()

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        header = request.headers.get("Authorization", "")
        request["credential"] = None
        if request.path.startswith("/v1/swarm/"):
            # Between peers, a member proves who it is with its lease's ticket and its key, never with
            # a join secret; checked from the headers, before any of the body is read.
            admitted = self.admit(request)
            if isinstance(admitted, web.Response):
                if admitted.status == 401:
                    self.metrics.unauthorized += 1
                return admitted
            request["peer"] = admitted
        elif self.tokens.ok(header) or self.tokens.own(request, header):
            pass  # an operator (or a member, with the shared token)
        elif header.startswith("Bearer " + CREDENTIAL_PREFIX) and \
                (credential := self.credentials.check(header)) is not None:
            request["credential"] = credential
        elif header.startswith("Bearer " + CREDENTIAL_PREFIX) and self.credentials.refused is not None:
            # This swarm's credential, revoked or expired: its holder is told so, and stops.
            e, self.credentials.refused = self.credentials.refused, None
            self.metrics.unauthorized += 1
            return web.json_response({"error": str(e), "reason": e.reason}, status=401)
        else:
            self.metrics.unauthorized += 1
            peer = request.remote or "?"
            if self._unauthorized_log.due(peer, time.monotonic()):
                event(log, logging.WARNING, "refused a request without the swarm token", remote=peer,
                      method=request.method, path=request.path[:100])
            return web.json_response({"error": "unauthorized"}, status=401)
        self.authorise(request)
        # Requests in flight per peer (its address and node id) and per address: a flood from one
        # peer gets 429s and leaves the others their share of the event loop.
        addr = request.remote or "?"
        peer_key = (addr, request.headers.get(NODE_HEADER, "")[:64])
        if self._inflight[peer_key] >= MAX_INFLIGHT_PER_PEER or self._inflight[addr] >= MAX_INFLIGHT_PER_ADDRESS:
            self.metrics.requests[(route_label(request), 429)] += 1
            if self._flood_log.due(addr, time.monotonic()):
                event(log, logging.WARNING, "refused requests over the in-flight limit", remote=addr,
                      node=peer_key[1] or "?", path=request.path[:100])
            return web.json_response({"error": "too many requests in flight from this peer"}, status=429)
        self._inflight[peer_key] += 1
        self._inflight[addr] += 1
        try:
            response = await handler(request)
        except web.HTTPException as e:
            self.metrics.requests[(route_label(request), e.status)] += 1
            raise
        except RecursionError:  # a body nested deeper than any message of the protocol
            response = web.json_response({"error": "message nested too deeply"}, status=400)
        finally:
            for k in (peer_key, addr):
                self._inflight[k] -= 1
                if not self._inflight[k]:
                    del self._inflight[k]
        self.metrics.requests[(route_label(request), response.status)] += 1
        return response
