"""The peers this node fetches from: taking them from the tracker's list, their long polls
(exchanges) and what the replies say, have messages to the trainer, bans, the contacts (other
regions' heads met only through pushes), spare connections, and the delay between regions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import statistics
import time

import aiohttp
from yarl import URL

from ...errors import FormatError, IntegrityError, SparrowError
from ...schema import fields, pack, unpack
from ...swarm.chain import Key, listed_whole
from ...swarm.identity import PROOF_HEADER, PROOF_TTL, TICKET_HEADER, make_proof
from ...swarm.policy import EXCHANGE_WAIT, NOT_YET_RETRY, QUICK_PACE, QUICK_REPLIES
from ...swarm.signing import Signed
from ...swarm.versions import VersionState, from_bitmap, to_bitmap
from ..bodies import read_limited
from ..logs import event
from .parts import Parts
from .state import PeerState, _view
from .wire import _VERSION_REP, MAX_EXCHANGE, MSGPACK, NotYet, _bounded

__all__ = ["Peers"]

log = logging.getLogger("sparrowd.swarm")


class Peers(Parts):
    """``Swarm``'s peers: their long polls and what the replies say, contacts, bans."""

    def _proof_for(self, ps: PeerState) -> dict:
        """The headers that prove to ``ps`` that this request comes from this node, a member: the
        lease's ticket and a proof for ``ps`` and that lease."""
        m = self.host.membership
        ticket, epoch = (m.state.ticket, m.state.epoch) if m is not None else (None, None)
        key = self.host.key
        if ticket is None or epoch is None or key is None:
            return {}
        now = time.time()
        made, made_for, proof = ps.proof
        if now - made > PROOF_TTL / 2 or made_for != epoch:
            proof = make_proof(key, self.host.node_id, ps.node_id, now, epoch)
            ps.proof = (now, epoch, proof)
        return {TICKET_HEADER: ticket, PROOF_HEADER: proof}

    def _take_listed(self) -> dict[str, dict]:
        """Peers from the membership's list that this node has no exchanges with yet: taken, their long
        polls started. The listed entries."""
        assert self.host.membership is not None  # a relay's peers come with its lease
        state = self.host.membership.state
        listed = {p["node_id"]: p for p in state.peers}
        for pid, p in listed.items():
            if pid in self.banned or pid in self.peers:
                continue
            ps = self.peers[pid] = PeerState(pid, p["address"], p["region"], p["role"])
            ps.task = asyncio.create_task(self._peer_loop(ps), name=f"peer-{pid}")
            self._warm(ps)
        here = self.host.settings.region
        if self.signer is None and any(e["node_id"] == self.host.node_id for e in state.heads.get(here, ())):
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
        trip, before the first byte. The connection is opened bare, through the session's connector,
        and goes into its pool as soon as the handshake is done; a request (``GET /v1/swarm/ping``)
        opens it only where aiohttp's connector takes other arguments, since it holds the connection
        a round trip longer (evidence: docs/history/DESIGN-NOTES.md#spare-connections)."""
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
                    if session.connector is None:  # (a session closed meanwhile)
                        raise AttributeError("no connector")
                    conn = await session.connector.connect(req, [], aiohttp.ClientTimeout(total=10.0))
                except (TypeError, AttributeError, ValueError):  # another aiohttp's internals
                    await ping()
                    return
                conn.release()  # idle in the pool, the next request's

        task = asyncio.create_task(connect(), name=f"warm-{ps.node_id}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _peer_manager(self) -> None:
        while True:
            listed = self._take_listed()
            for pid in [pid for pid in self.peers if pid not in listed or pid in self.banned]:
                ps = self.peers.pop(pid)
                if ps.task:
                    ps.task.cancel()
                self._changed.set()
            assert self.host.membership is not None  # a relay starts with its lease
            changed = self.host.membership.peers_changed
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
        msg = {"node_id": self.host.node_id, "region": self.host.settings.region, "after": ps.gen,
               "wait": int(wait), "versions": self._my_versions()}
        if ps.role == "trainer":
            msg["joined_after"] = self._joins_seen
            if (delay := self.wan_delay()) is not None:
                msg["delay_us"] = round(delay * 1e6)
        t0, traced = time.monotonic(), dict[str, bool]()
        assert self._session is not None  # made by start
        async with self._session.post(f"http://{ps.address}/v1/swarm/exchange", data=pack(msg),
                                      headers={"Content-Type": MSGPACK, **self._proof_for(ps)},
                                      timeout=aiohttp.ClientTimeout(total=wait + 10), trace_request_ctx=traced) as r:
            body = await read_limited(r.content, MAX_EXCHANGE)
            if body is None:
                raise FormatError(f"exchange reply from {ps.node_id}: over {MAX_EXCHANGE} bytes")
            if r.status != 200:
                raise (NotYet if r.status == 503 else SparrowError)(f"exchange with {ps.node_id}: HTTP {r.status}")
        # A long poll held is longer; one answered at once is the round trip, and on a connection it
        # opened, two: TCP's handshake first, else crossings are timed for twice the one-way delay
        # (evidence: docs/history/DESIGN-NOTES.md#round-trip-new-connection).
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
                await self._exchange(ps, 0 if ps.more else EXCHANGE_WAIT)
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
                    # It asked the tracker about this node, one round trip: ask again soon, not after the
                    # failure backoff, which would cost a swarm just formed up to half a second a hop on
                    # its first version (evidence: docs/history/DESIGN-NOTES.md#not-yet-retry).
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
            if isinstance(joined := reply.get("joined"), list) and self.host.membership is not None:
                # Peers before versions, and at once: a reply that brings a swarm's first version and
                # a neighbour that joined a moment ago must count the neighbour among the region's
                # crossers when the version starts, or the node designates itself for every chunk
                # and crosses for them while the neighbour brings them too (evidence:
                # docs/history/DESIGN-NOTES.md#peers-before-versions).
                self.host.membership.learn(joined)
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
            # The trainer lists everything it retains, its statements a page at a time: the chain is
            # known once the listing is whole (chain.listed_whole); until then, the next page at once.
            whole = listed_whole(at, seen, {k for k, vs in self.versions.items() if vs.manifest is not None})
            self.trainer_heard, ps.more = whole, not whole
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

    def wan_delay(self) -> float | None:
        """The one-way delay between regions as this node measured it, seconds: half the median, over
        the other regions it peers with, of the shortest round trip to any of their nodes (its
        exchanges, ``PeerState.rtt``, an exchange that opened its connection counted half); None before
        any. It times the chunks' region trees."""
        me = self.host.settings.region
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
        m = self.host.membership
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
