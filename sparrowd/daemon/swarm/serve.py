"""The serving side: admitting a peer from its headers (ticket and proof), answering exchanges (the
long poll: statements, have-maps, the choke flag) and chunk requests, and the ping that opens a spare
connection.
"""

from __future__ import annotations

import collections
import logging
import time
from pathlib import Path

from aiohttp import web

from ...errors import FormatError, SparrowError
from ...schema import fields, pack, unpack
from ...swarm.chain import Key
from ...swarm.identity import NODE_HEADER, PROOF_HEADER, PROOF_TTL, TICKET_HEADER, Refused, Ticket, check_proof
from ...swarm.policy import DISCOVERY_EVERY, ROW_EVERY, UPLOADS_PER_PEER
from ...swarm.versions import MAX_TREE_US, StatementPage, from_bitmap, to_bitmap
from ..bodies import read_limited
from ..cutthrough import Partial
from ..logs import event
from .parts import Parts
from .state import Remote
from .wire import (
    _EXCHANGE_REQ,
    _VERSION_REQ,
    MAX_EXCHANGE_REQUEST,
    MAX_VERSIONS_SHOWN,
    MSGPACK,
    PIECE,
    ROOT_HEADER,
    _bounded,
    _Cut,
)

__all__ = ["Serving"]

log = logging.getLogger("sparrowd.swarm")


class Serving(Parts):
    """``Swarm``'s serving side: admission, the exchange, chunk and ping handlers."""

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
        m, t = self.host.membership, self.host.tracker
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
        if self.signer is None and self.host.member(node) is None:
            self._discover(node)  # a relay with no entry of this member: the tracker lists it soon
        return self._remote(node, ticket.region)

    def _remote(self, node: str, region: str) -> Remote:
        """The admitted peer's state here, heard from now."""
        r = self.remotes.get(node)
        if r is None:
            r = self.remotes[node] = Remote(node, region)
        r.last_seen = time.monotonic()
        if self.seed is not None and r.region not in self.seed.live_regions:
            # A region not counted yet is counted again at once, so that the trainer's first copies
            # stay near from the first exchange of that region (``first_copies_near``).
            self.seed.recount()
        return r

    def forget(self, node_id: str) -> None:
        """A node's lease ended: what super-seeding gave it goes to others, its view is dropped."""
        if self.seed is not None:
            self.seed.forget(node_id)
        if (r := self.remotes.pop(node_id, None)) is not None:
            self._set_have(r, {})

    def _set_have(self, remote: Remote, have: dict[Key, frozenset[int]]) -> None:
        """A peer's have-maps changed: the counts of holders (``held_by``, and ``_showing``, the peers
        whose maps show any chunk) follow, so that answering an exchange never walks every peer's
        maps (a swarm of thousands polls the trainer)."""
        self._showing += any(have.values()) - any(remote.have.values())
        for k in remote.have.keys() | have.keys():
            before: frozenset[int] = remote.have.get(k, frozenset())
            after = have.get(k, frozenset())
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
        if not check_proof(proof[:200], key, node, self.host.node_id, now, epoch):
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
        m = self.host.membership
        if m is None or self.signer is not None:
            return
        m.ask(node)
        now = time.monotonic()
        if now - self._discovered_at >= DISCOVERY_EVERY:
            self._discovered_at = now
            m.want_peers()

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
            for raw in m["versions"][:MAX_VERSIONS_SHOWN]:
                v = fields(raw, _VERSION_REQ, what="exchange version")
                k = Key(v["version"], bool(v.get("anchor")))
                theirs[k] = (v["statements"], from_bitmap(_bounded(v["have"], self.versions.get(k))))
        except (FormatError, SparrowError) as e:
            return web.json_response({"error": str(e)}, status=400)
        if m.get("delay_us") is not None:
            if remote.delay is None and self.seed is not None:
                self.seed.recount()  # a first figure: the trainer takes the median again at once
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
            entry = {"version": k.version, "anchor": k.anchor, "statements": page.take(vs.statements, known),
                     "have": to_bitmap(vs.have if self.seed is None else self.seed.shows(remote, vs), n),
                     "fetching": to_bitmap(self._fetching(k), n)}
            if pushing := {i for (p, o, i) in self.pushing_to if p == remote.node_id and o == k}:
                entry["pushing"] = to_bitmap(pushing, n)
            out.append(entry)
        if self.seed is None:
            choked = not self._may_download(remote)  # its lane's queue (a relay owes nothing)
        else:
            choked = self.seed.chokes(remote)
        reply = {"gen": self.gen, "versions": out, "choked": choked,
                 "cut_through": self._relays_partials()}
        if (t := self.host.tracker) is not None:
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
        assert vs is not None  # a chunk being fetched is of a version this node knows
        if (remote.node_id, key, i) in self.pushing_to:  # it asked as the push went out: it takes the push
            return web.json_response({"error": "being pushed to you"}, status=409)
        if not (self._may_download(remote) if self.seed is None else self.seed.may_fetch(remote, key, i)):
            return web.json_response({"error": "choked"}, status=503)
        if remote.uploads >= UPLOADS_PER_PEER:
            return web.json_response({"error": "too many requests in flight"}, status=429)
        ss = self.seed.superseed.get(key) if self.seed is not None else None  # the trainer's, for this version
        if ss is not None:
            ss.claim(i, remote.node_id)
        size = vs.chunks[i].size
        wan = remote.region != self.host.settings.region
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
            if ss is not None:  # it hung up before it had the chunk: give it again soon if need be
                ss.unclaim(i, remote.node_id)
            return resp
        remote.rate_to.add(time.monotonic(), size)
        self.host.count_bytes("up", size, wan)
        if self.seed is not None and (now := time.monotonic()) - self.seed.row_told >= ROW_EVERY:
            self.seed.row_told = now
            self.host.report_changed()  # the trainer's own row counts its uploads within a second
        return resp

    async def _send(self, request: web.Request, source: Path | Partial, size: int,
                    wan: bool, root: str | None = None, block: int = PIECE) -> tuple[web.StreamResponse, bool]:
        """The chunk's bytes, from its file or, cut-through, from a fetch in progress, paced by the
        rate limits; False when the peer hung up (an endgame loser cancelled: not an error) or the
        fetch it was fed by failed (the connection is cut: the requester must not take what it got
        for the whole chunk)."""
        headers = {"Content-Type": "application/octet-stream", **({ROOT_HEADER: root} if root else {}),
                   **self._rate_header(wan, source)}
        if isinstance(source, Path) and not (self.up.rate or (wan and self.wan_up.rate)):
            whole = web.FileResponse(source, headers=headers)
            try:
                await whole.prepare(request)  # sendfile where the event loop supports it
            except ConnectionError:
                return whole, False
            return whole, True
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

    async def handle_ping(self, request: web.Request) -> web.Response:
        """A peer opening a spare connection to this node (``_warm``): nothing to answer."""
        return web.Response(status=204)
