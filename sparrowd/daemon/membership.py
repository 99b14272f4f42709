"""A node's side of membership: join, renew about every third of the TTL, leave.

The loop keeps one lease. It joins (retrying with capped exponential backoff
while the tracker is unreachable), renews a little before each third of the
TTL (random jitter, never later, so one lost renewal leaves a third of the
lease spare), re-joins at once when a renewal finds its lease gone (expired,
or the tracker forgot it), and leaves on shutdown. A tracker that is down
does not end the lease on the node's side: the node keeps trying, and a
restarted tracker that kept its table accepts the next renewal as if nothing
happened.

Every message is sealed with the node's key (``swarm.identity.seal``) and
carries the node's clock, always later than the message before.

Two clients speak to a tracker: :class:`HttpTrackerClient` over the network,
and :class:`LocalTrackerClient` for the trainer, whose tracker is in-process.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeGuard

import aiohttp

from ..errors import FormatError, IntegrityError, SparrowError
from ..schema import pack, unpack
from ..swarm.identity import NodeKey, Refused, SessionKey, SessionUnknown, seal, seal_session
from ..swarm.leases import DEFAULT_PEER_LIMIT, GATEWAYS, LeaseGone, head_score
from .bodies import read_limited
from .logs import event
from .tracker import JOIN_NEWS, TrackerService

__all__ = [
    "Membership",
    "HttpTrackerClient",
    "LocalTrackerClient",
    "TrackerUnavailable",
    "Unauthorized",
    "MSGPACK",
    "MAX_TRACKER_MESSAGE",
]

log = logging.getLogger("sparrowd.membership")

MSGPACK = "application/msgpack"
MAX_TRACKER_MESSAGE = 256 << 10
MAX_REGIONS = 256  # regions whose heads a reply may name (more are dropped)
MAX_LEARNED_PEERS = 4 * DEFAULT_PEER_LIMIT  # a peer list grown by news of joins (learn) stops there
ENTRY_FIELDS = ("node_id", "role", "region", "address")  # a member's entry's text fields (and ``key``, bytes)


class TrackerUnavailable(SparrowError):
    """The tracker could not be reached or failed; try again later."""


class Unauthorized(SparrowError):
    """The tracker refused the swarm token or credential, or refused this node's key (403).
    ``reason``: the tracker's reason (``revoked``, ``expired``, ...), where it gave one."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason


# A join refused for these reasons will not succeed by trying again: the daemon stops.
FINAL_REFUSALS = ("revoked", "expired", "bad-credential", "role", "region", "credential", "impostor")


# How long an idle connection to a peer (or the tracker) is kept for the next request. A new one
# across regions costs TCP's handshake, a round trip before the first byte, and an RL step between two
# versions is often minutes long: aiohttp's default (15 s) had every version's first pushes and requests
# open new connections. The daemon's server keeps them a little longer (``SERVER_KEEPALIVE``), so that
# the client, not the server, closes an idle one (a request sent on a connection the server is closing
# fails).
KEEPALIVE = 3600.0
SERVER_KEEPALIVE = KEEPALIVE + 30


# TCP keepalive probes on outgoing connections: the first after this many seconds idle, then every
# KEEPALIVE_INTERVAL, KEEPALIVE_COUNT unanswered and the connection is dead. An idle connection kept for
# the next version is so also kept through NAT gateways and firewalls that drop silent flows after a
# few minutes (AWS's NAT gateway: 350 s; Azure's load balancers: 4 min), and one that died is found
# and dropped instead of reused.
KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_COUNT = 60, 20, 3


def keepalive_socket(addr_info) -> socket.socket:
    """A client socket (``aiohttp.TCPConnector``'s ``socket_factory``) with TCP keepalive probes."""
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=type_, proto=proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
                        ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
        if hasattr(socket, name):  # Linux; elsewhere the system's timing
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    return sock


def outgoing(source: str | None, limit: int = 100) -> aiohttp.TCPConnector:
    """Connections leave from ``source`` (the listen address, when it names one), so that on a
    multi-homed box peers see the address this node advertises; at most ``limit`` at once, idle ones
    kept ``KEEPALIVE`` seconds, probed while idle (``keepalive_socket``)."""
    return aiohttp.TCPConnector(local_addr=(source, 0) if source else None, limit=limit, keepalive_timeout=KEEPALIVE,
                                socket_factory=keepalive_socket)


def bearer(token: str) -> str:
    return f"Bearer {token}"


class HttpTrackerClient:
    """Tracker calls over HTTP: msgpack bodies, the swarm token as a bearer token."""

    def __init__(self, url: str, token: str, *, timeout: float = 5.0, source: str | None = None,
                 connections: int = 100, connector: aiohttp.BaseConnector | None = None):
        """``connector``: connections shared with others (the daemon's, ``outgoing``), not closed here."""
        self.url = url.rstrip("/")
        self._source, self._connections, self._connector = source, connections, connector
        self._headers = {"Authorization": bearer(token), "Content-Type": MSGPACK}
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    def set_token(self, token: str) -> None:
        self._headers["Authorization"] = bearer(token)

    async def _call(self, path: str, msg: dict) -> dict:
        if self._session is None:
            shared = self._connector is not None
            self._session = aiohttp.ClientSession(timeout=self._timeout, connector_owner=not shared,
                                                  connector=self._connector if shared else
                                                  outgoing(self._source, self._connections))
        try:
            async with self._session.post(f"{self.url}{path}", data=pack(msg), headers=self._headers) as r:
                body = await read_limited(r.content, MAX_TRACKER_MESSAGE)
                if body is None:
                    raise FormatError(f"tracker reply to {path}: over {MAX_TRACKER_MESSAGE} bytes")
                if r.status == 200:
                    reply = unpack(body, what=f"tracker reply to {path}", max_len=MAX_TRACKER_MESSAGE)
                    if not isinstance(reply, dict):
                        raise FormatError(f"tracker reply to {path}: not a map")
                    return reply
                reason = _error_text(body)
                if r.status == 401:
                    why = _error_field(body, "reason")
                    if why in ("revoked", "expired"):
                        raise Unauthorized(f"tracker {self.url} refused this node: {reason}", why)
                    raise Unauthorized(f"tracker {self.url} refused the swarm token ({reason})", "token")
                if r.status == 403:
                    raise Unauthorized(f"tracker {self.url} refused {path.rsplit('/', 1)[-1]}: {reason}",
                                       _error_field(body, "reason"))
                if r.status == 410:
                    raise LeaseGone(reason)
                if r.status == 409:
                    boot = _error_field(body, "boot")
                    raise SessionUnknown(reason, boot=bytes.fromhex(boot) if _is_hex(boot, 16) else None)
                if r.status == 400:
                    raise FormatError(f"tracker refused {path}: {reason}")
                raise TrackerUnavailable(f"tracker {self.url}{path}: HTTP {r.status} {reason}")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise TrackerUnavailable(f"tracker {self.url} unreachable: {type(e).__name__} {e}".rstrip()) from None

    async def join(self, msg: dict) -> dict:
        return await self._call("/v1/tracker/join", msg)

    async def renew(self, msg: dict) -> dict:
        return await self._call("/v1/tracker/renew", msg)

    async def leave(self, msg: dict) -> dict:
        return await self._call("/v1/tracker/leave", msg)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _error_field(body: bytes, name: str) -> str | None:
    try:
        value = json.loads(body[:4096])[name]
    except (ValueError, KeyError, TypeError):
        return None
    return value[:64] if isinstance(value, str) else None


def _is_hex(text: str | None, length: int) -> TypeGuard[str]:
    return text is not None and len(text) == length and all(c in "0123456789abcdef" for c in text)


def _error_text(body: bytes) -> str:
    try:
        return str(json.loads(body[:4096])["error"])[:300]
    except (ValueError, KeyError, TypeError):
        return "(no reason given)"


class LocalTrackerClient:
    """The trainer's own membership: straight into its tracker service."""

    def __init__(self, service: TrackerService):
        self.service = service

    async def join(self, msg: dict) -> dict:
        return self._call(self.service.join, msg)

    async def renew(self, msg: dict) -> dict:
        return self._call(self.service.renew, msg)

    async def leave(self, msg: dict) -> dict:
        return self._call(self.service.leave, msg)

    @staticmethod
    def _call(method, msg: dict) -> dict:
        try:
            return method(dict(msg))
        except Refused as e:
            raise Unauthorized(str(e), e.reason) from None

    async def close(self) -> None:
        pass


@dataclass
class LeaseState:
    epoch: int | None = None
    ttl: float | None = None
    renew_interval: float = 5.0
    expires_at: float | None = None  # time.monotonic() on this node
    peers: list[dict] = field(default_factory=list)
    gateways: list[str] = field(default_factory=list)  # a large region's crossers (LeaseTable.gateways)
    heads: dict[str, list[dict]] = field(default_factory=dict)  # each region's heads' entries (LeaseTable.heads)
    heads_tag: bytes | None = None  # their digest, echoed in renewals (the tracker resends them on a change)
    revoked: frozenset[str] = frozenset()  # credential ids the trainer revoked: refused at this node's door
    ticket: str | None = None  # the lease's ticket (identity.Ticket): every peer request carries it
    boot: bytes | None = None  # the tracker process's id: signed renewals and leaves name it
    tracker_reachable: bool = False
    joins: int = 0


class Membership:
    """Keeps this node's lease. ``report()`` gives what renewals carry (versions, bytes)."""

    MAX_BACKOFF = 10.0
    NUDGE_COALESCE = 0.1  # seconds a nudged renewal waits for more changes to report with it
    PEER_REFRESH = 30.0  # seconds a full peer list is kept before a renewal asks for a fresh one

    def __init__(
        self,
        client,
        me: dict,
        key: NodeKey,
        *,
        report: Callable[[], dict] | None = None,
        rng: random.Random | None = None,
        on_fatal: Callable[[Exception], None] | None = None,
        on_lease: Callable[[dict], None] | None = None,
    ):
        self.client, self.me, self.key = client, dict(me), key
        self._last_ts = 0.0
        self.members: dict[str, tuple[float, dict]] = {}  # strangers the tracker confirmed (``ask``): (when, entry)
        self._asking: set[str] = set()
        self._secret: bytes | None = None  # the lease's session secret (identity.SessionKey): renewals by HMAC
        self.report = report or (lambda: {})
        self.rng = rng or random.Random(
            int.from_bytes(hashlib.sha256(me["node_id"].encode()).digest()[:8]) ^ time.time_ns())
        self.on_fatal = on_fatal
        self.on_lease = on_lease
        self.state = LeaseState()
        self.joined = asyncio.Event()
        self._in_outage = False
        self._nudged = asyncio.Event()
        self.peers_changed = asyncio.Event()  # set when a reply lists other peers than the one before
        self._peers_at = -self.PEER_REFRESH  # when the last peer list came
        self._peers_wanted = False

    def nudge(self) -> None:
        """Something renewals report changed (a version completed, the engine applied one): renew
        soon instead of at the next interval, so the tracker's view is not a third of a TTL behind.
        Bursts are coalesced into one renewal; an idle node sends no more than before."""
        self._nudged.set()

    def _ts(self) -> float:
        """The node's clock for a message: never equal to or before the last one sent."""
        self._last_ts = max(time.time(), self._last_ts + 0.001)
        return self._last_ts

    def member(self, node_id: str) -> dict | None:
        """A member's tracker entry (role, region, address, key), if this node has heard of it."""
        for p in self.state.peers:
            if p.get("node_id") == node_id:
                return p
        if (e := self.head(node_id)) is not None:  # the heads push across regions to each other (swarm.push)
            return e
        at, entry = self.members.get(node_id, (0.0, None))
        return entry if time.monotonic() - at < self.PEER_REFRESH else None  # then asked again

    def head(self, node_id: str) -> dict | None:
        """The entry of a region's head (``LeaseState.heads``), if ``node_id`` is one."""
        for es in self.state.heads.values():
            for e in es:
                if e["node_id"] == node_id:
                    return e
        return None

    def learn(self, entries: list) -> None:
        """Nodes that joined lately, as the trainer's exchange replies tell (``TrackerService.joined_since``,
        a swarm that fits a peer list): known at once, and peers from now on, rather than at the next
        renewal. A node that joined again (a restart: a new epoch, maybe another address) replaces
        its old entry."""
        peers = {p.get("node_id"): i for i, p in enumerate(self.state.peers)}
        changed = False
        heads = self.state.heads
        for e in entries[:JOIN_NEWS]:
            if not (isinstance(e, dict) and all(isinstance(e.get(f), str) for f in ENTRY_FIELDS)
                    and isinstance(e.get("key", b""), bytes)) or e["node_id"] == self.me["node_id"]:
                continue
            self.members[e["node_id"]] = (time.monotonic(), e)
            if e["role"] == "rollout" and len(heads) < MAX_REGIONS:
                # A head iff it ranks among its region's top GATEWAYS, as the tracker ranks (so its
                # region is pushed to at once); the next list with the heads sets them right.
                mine = [h for h in heads.get(e["region"], []) if h["node_id"] != e["node_id"]] + [e]
                heads[e["region"]] = sorted(mine, key=lambda h: head_score(h["region"], h["node_id"]),
                                            reverse=True)[:GATEWAYS]
                self.state.heads_tag = None  # the next renewal gets the tracker's heads whole
            if (i := peers.get(e["node_id"])) is not None:
                if self.state.peers[i] != e:
                    self.state.peers[i], changed = e, True
            elif len(self.state.peers) < MAX_LEARNED_PEERS:
                peers[e["node_id"]] = len(self.state.peers)
                self.state.peers.append(e)
                changed = True
        if changed:
            self.peers_changed.set()

    def ask(self, node_id: str) -> None:
        """Ask the tracker about a node that contacted this one, with the next (early) renewal."""
        if len(self._asking) < 64:
            self._asking.add(node_id)
        self.want_peers()

    def lease_left(self) -> float | None:
        if self.state.expires_at is None:
            return None
        return max(0.0, self.state.expires_at - time.monotonic())

    def _take(self, reply: dict, sent_at: float) -> None:
        if self.on_lease is not None:
            self.on_lease(reply)  # may refuse the lease (a trainer key other than the pinned one)
        s = self.state
        s.epoch = int(reply["epoch"])
        s.ttl = float(reply["lease_ttl"])
        s.renew_interval = float(reply["renew_interval"])
        s.expires_at = sent_at + float(reply["expires_in"])  # measured from sending: errs on the short side
        if "peers" in reply:  # a renewal that did not ask for the list keeps the one it has
            peers = list(reply.get("peers") or [])
            if {p.get("node_id") for p in peers} != {p.get("node_id") for p in s.peers}:
                self.peers_changed.set()
            s.peers = peers
            s.gateways = [g for g in reply.get("gateways") or [] if isinstance(g, str)][:64]
            heads = reply.get("heads")
            if isinstance(heads, dict):
                s.heads = {r: [e for e in es[:GATEWAYS] if isinstance(e, dict) and isinstance(e.get("node_id"), str)]
                           for r, es in list(heads.items())[:MAX_REGIONS]
                           if isinstance(r, str) and isinstance(es, list)}
            if isinstance(heads, dict) or reply.get("heads_tag") is None:
                tag = reply.get("heads_tag")
                s.heads_tag = tag if isinstance(tag, bytes) else None
            self._peers_at = time.monotonic()
        for m in reply.get("members") or []:
            if isinstance(m, dict) and isinstance(m.get("node_id"), str):
                if len(self.members) > 4096:
                    self.members.clear()
                self.members[m["node_id"]] = (time.monotonic(), m)
                self.peers_changed.set()
        if isinstance(reply.get("revoked"), list):
            s.revoked = frozenset(i for i in reply["revoked"] if isinstance(i, str))
        if isinstance(reply.get("ticket"), str):
            s.ticket = reply["ticket"]
        if isinstance(reply.get("boot"), bytes):
            s.boot = reply["boot"]
        s.tracker_reachable = True
        if self._in_outage:
            event(log, logging.INFO, "tracker reachable again", epoch=s.epoch)
            self._in_outage = False

    async def _join(self) -> None:
        sent = time.monotonic()
        kx = SessionKey()
        msg = {**self.me, "key": self.key.public, "ts": self._ts(), "kx": kx.public}
        reply = await self.client.join(seal(self.key, "join", msg))
        self._take(reply, sent)
        self._start_session(kx, reply)
        self.state.joins += 1
        self.joined.set()
        event(log, logging.INFO, "joined the swarm", node_id=self.me["node_id"], epoch=self.state.epoch,
              lease_ttl=self.state.ttl, peers=len(self.state.peers))

    def _start_session(self, kx: SessionKey, reply: dict) -> None:
        """Renewals from now on are sealed with the session secret (an HMAC the tracker checks in
        microseconds) rather than signed; a tracker that offered no session gets signatures."""
        theirs = reply.get("kx")
        epoch = self.state.epoch
        assert epoch is not None  # (_take has just set it from the same reply)
        self._secret = kx.secret(theirs, self.me["node_id"], epoch) if isinstance(theirs, bytes) \
            and len(theirs) == 32 else None

    def want_peers(self) -> None:
        """Ask for a fresh peer list with the next renewal, and renew soon (a stranger asked this
        node for something: it joined after the last list)."""
        self._peers_wanted = True
        self.nudge()

    def _wants_peers(self) -> bool:
        """A renewal asks for the peer list when it was asked to, when the list is due (every
        PEER_REFRESH seconds), and always while the list is short of the tracker's usual limit
        (a small swarm, where lists are cheap and every newcomer matters)."""
        return (self._peers_wanted or len(self.state.peers) < DEFAULT_PEER_LIMIT
                or time.monotonic() - self._peers_at >= self.PEER_REFRESH)

    async def _renew(self) -> None:
        sent = time.monotonic()
        want = self._wants_peers()
        asking, self._asking = sorted(self._asking), set()
        msg = {"node_id": self.me["node_id"], "epoch": self.state.epoch, "ts": self._ts(), **self.report(),
               "want_peers": want}
        if asking:
            msg["ask"] = asking
        if want and self.state.heads_tag is not None:
            msg["heads_seen"] = self.state.heads_tag
        if self._secret is not None:
            try:
                self._take(await self.client.renew(seal_session(self._secret, "renew", msg)), sent)
            except SessionUnknown as e:  # the tracker restarted: this renewal again, signed, with a new kx
                event(log, logging.INFO, "tracker session unknown; renewing signed", reason=str(e))
                self._secret = None
                self.state.boot = e.boot or self.state.boot
                msg["ts"] = self._ts()
        if self._secret is None:
            kx = SessionKey()
            try:
                reply = await self.client.renew(seal(self.key, "renew",
                                                     {**msg, "kx": kx.public, "boot": self.state.boot}))
            except SessionUnknown as e:  # the tracker restarted: sign again, naming its new boot
                if e.boot is None or e.boot == self.state.boot:
                    raise TrackerUnavailable(str(e)) from None
                self.state.boot = e.boot
                msg["ts"] = self._ts()
                reply = await self.client.renew(seal(self.key, "renew", {**msg, "kx": kx.public, "boot": e.boot}))
            self._take(reply, sent)
            self._start_session(kx, reply)
        if want:
            self._peers_wanted = False

    async def run(self) -> None:
        backoff = 0.5
        while True:
            if self.state.epoch is None:
                try:
                    await self._join()
                    backoff = 0.5
                except (TrackerUnavailable, FormatError) as e:
                    self._unreachable(e)
                    await asyncio.sleep(backoff * self.rng.uniform(0.5, 1.0))
                    backoff = min(backoff * 2, self.MAX_BACKOFF)
                    continue
                except (Unauthorized, IntegrityError) as e:
                    final = isinstance(e, Unauthorized) and e.reason in FINAL_REFUSALS
                    if (self.state.joins == 0 or final) and self.on_fatal:
                        # a wrong token or trainer key at start, or a credential revoked or expired: stop
                        self.on_fatal(e)
                        return
                    self._unreachable(e)
                    await asyncio.sleep(self.MAX_BACKOFF)
                    continue
            try:  # asyncio.timeout, not wait_for (see Swarm.changed)
                async with asyncio.timeout(self.state.renew_interval * self.rng.uniform(0.85, 1.0)):
                    await self._nudged.wait()
                await asyncio.sleep(self.NUDGE_COALESCE)
            except TimeoutError:
                pass
            self._nudged.clear()
            try:
                await self._renew()
            except LeaseGone as e:
                event(log, logging.WARNING, "lease gone; re-joining", reason=str(e))
                self.state.epoch = None
            except Unauthorized as e:
                if e.reason in FINAL_REFUSALS and self.on_fatal:  # its credential was revoked or expired
                    self.on_fatal(e)
                    return
                self._unreachable(e)
            except (TrackerUnavailable, FormatError, IntegrityError) as e:
                self._unreachable(e)

    def _unreachable(self, e: Exception) -> None:
        """One warning per outage, not one per retry."""
        if not self._in_outage:
            event(log, logging.WARNING, "tracker unavailable; will retry", reason=str(e))
            self._in_outage = True
        self.state.tracker_reachable = False

    async def leave(self, timeout: float = 3.0) -> bool:
        """End the lease at the tracker; False if it could not be told (the lease then just expires)."""
        if self.state.epoch is None:
            return False
        try:
            async with asyncio.timeout(timeout):
                msg = {"node_id": self.me["node_id"], "epoch": self.state.epoch, "ts": self._ts(),
                       "boot": self.state.boot}
                await self.client.leave(seal(self.key, "leave", msg))
        except (TimeoutError, SparrowError) as e:
            event(log, logging.WARNING, "could not leave cleanly; the lease will expire", reason=str(e))
            return False
        event(log, logging.INFO, "left the swarm", node_id=self.me["node_id"], epoch=self.state.epoch)
        self.state.epoch = None
        self.state.expires_at = None
        return True
