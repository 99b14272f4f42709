"""Receiving a chunk's stream, asked for or pushed: each block checked as it arrives, served on
cut-through once a block has checked out, stored once whole; and whether a push is taken.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time

import aiohttp
from aiohttp import web

from ...errors import FormatError, IntegrityError
from ...swarm.chain import Key
from ...swarm.policy import PUSH_STATEMENT_WAIT
from ...swarm.push import NO_HASHES, STRIPE_HEADER, Arriving, declines, parse_stripe, unstarted
from ...swarm.serving import store_pause, stream_timeout
from ...swarm.signing import Signed, announce_kind
from ...swarm.versions import BLOCK_HASH, VersionState
from ..cutthrough import Partial
from ..logs import event
from .parts import Parts
from .state import PeerState
from .wire import (
    ALSO_HEADER,
    ALSO_HEADER_MAX,
    ROOT_HEADER,
    STATEMENT_HEADER,
    STATEMENT_HEADER_MAX,
    _body,
    _send_time,
    _Served,
)

__all__ = ["Receiving"]

log = logging.getLogger("sparrowd.swarm")


class Receiving(Parts):
    """``Swarm``'s receiving side: a chunk's stream coming in, and whether a push is taken."""

    async def _receive(self, ps: PeerState, vs: VersionState, index: int, pieces, *, whole: bool,
                       stripe: tuple[int, int] | None = None, into: Partial | None = None) -> bool:
        """One stream of a chunk from ``ps``, asked for (``_fetch``) or pushed (``handle_push``): each
        block checked as it arrives, the chunk served on cut-through once a block has checked out (and
        pushed on), stored once whole. ``pieces`` yields ``_Served`` once the stream is served
        (nothing before: refused), with the rate its sender declared, then the bytes. ``whole``: the
        sender holds it whole, so a failed or short stream counts against it; a stream fed by a fetch
        in progress there (or pushed) may be cut without its fault. The caller tracks its task
        (``_track``). Whether it stored the chunk. ``stripe``: the stream is that stripe of the chunk,
        fed with the others into ``into`` (registered, its ``feeders`` counting this stream); the one
        that completes the chunk stores it."""
        key = (vs.key, index)
        ref = vs.chunks[index]
        wan = ps.region != self.host.settings.region
        if into is not None:
            buf = into
        else:
            buf = Partial(ref.size, vs.block, vs.blocks.get(index), what=f"chunk {index} of {vs.key}")
            if buf.hashes is not None and self._relays_partials():
                self.partials.setdefault(key, buf)  # the first fetch of a chunk feeds what this node relays
        served = False
        try:
            async with contextlib.aclosing(pieces):
                async for piece in pieces:
                    if isinstance(piece, _Served):
                        served, buf.rate = True, piece.rate
                        continue
                    if stripe is not None:
                        first, shown = not buf.has_block(stripe[0]), buf.ready == 0
                        buf.feed_stripe(stripe, piece)
                        if first and buf.has_block(stripe[0]) and self.partials.get(key) is buf:
                            self._push_out(vs, index)  # a receiver hands its own stripe on from here
                            if shown and buf.ready:
                                await self.notify()
                    else:
                        first = buf.ready == 0
                        buf.feed(piece)  # each block checked as it completes
                        if first and buf.ready and self.partials.get(key) is buf:
                            self._push_out(vs, index)
                            await self.notify()  # its first block checked out: peers may fetch it from here now
                    ps.rate.add(time.monotonic(), len(piece))
                    delay = self.down.take(time.monotonic(), len(piece))
                    if delay:
                        await asyncio.sleep(delay)
            if not served:
                return False  # refused (choked, not held): the picker goes on
            if stripe is not None:
                got = buf.stripe_got.get(stripe, 0)
                if not buf.stripe_whole(stripe) and not buf.whole:
                    raise aiohttp.ClientPayloadError(f"stripe {stripe[0]}/{stripe[1]}: {got} bytes short")
                self.host.count_bytes("down", got, wan)
                if buf.stripe_whole(stripe):
                    self.stripes["received"] += 1
                if not buf.whole or buf.storing or index in vs.have:
                    return False  # its part is in; the stream that completes the chunk stores it
                buf.storing = True
            elif buf.got < ref.size:  # ended early, cleanly
                if whole:
                    raise IntegrityError(f"{buf.what}: {buf.got} of its {ref.size} bytes")
                raise aiohttp.ClientPayloadError(f"{buf.got} of {ref.size} bytes")  # as a cut stream
            else:
                self.host.count_bytes("down", buf.got, wan)
            data = buf.buf
            if index in vs.have:
                return False
            try:
                await asyncio.to_thread(self.store.put_chunk, vs, index, data)
            except OSError as e:  # a full or failing disk: say so, keep serving what is stored
                self.error = f"storing chunks in {self.store.root}: {e.strerror or e}"
                self.store_failures += 1
                pause = store_pause(self.store_failures)
                self.store_paused_until = time.monotonic() + pause
                event(log, logging.ERROR, "cannot store a chunk; fetching pauses", object=str(vs.key), index=index,
                      reason=self.error, seconds=pause)
                return False
            vs.have.add(index)
            if (relayed := self.partials.get(key)) is not None and relayed is not buf:
                relayed.fill(data)  # streams fed by another fetch of it go on from this copy
                if relayed.striped and not relayed.feeders:
                    del self.partials[key]
            self.store_failures = 0
            ps.strikes = 0
            ps.stalled = False
            self.error = None
            event(log, logging.DEBUG, "chunk stored", object=str(vs.key), index=index, peer=ps.node_id,
                  bytes=len(data), wan=wan)
            for pid, t in self.inflight.get(key, {}).items():  # endgame: cancel the losers
                if pid != ps.node_id:
                    t.cancel()
            if vs.complete:
                self._complete(vs)
            self._push_out(vs, index)  # tops up what was pushed from the partial (peers that lack it since)
            await self.notify()
            self._tell_peers()
            return True
        except IntegrityError as e:
            self._ban(ps, str(e))
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
            if not whole:  # a stream cut-through: its feeding fetch failed there, not this peer's doing
                ps.fetching.get(vs.key, set()).discard(index)
                event(log, logging.DEBUG, "cut-through stream ended early", peer=ps.node_id, object=str(vs.key),
                      index=index, reason=type(e).__name__)
                return False
            # The request ends and the chunk goes back to the picker; the peer sits out a while
            # (longer each time in a row), so a stalled peer does not get the chunk again.
            ps.strikes += 1
            ps.cooldown_until = time.monotonic() + min(60.0, 2.0 ** ps.strikes)
            ps.stalled = True  # a peer that fails requests (gone, say) is not counted on to cross until it delivers
            event(log, logging.INFO, "chunk request failed; peer cools down", peer=ps.node_id, object=str(vs.key),
                  index=index, reason=type(e).__name__, seconds=min(60.0, 2.0 ** ps.strikes))
        finally:
            if stripe is not None:
                buf.feeders -= 1
                if not buf.stripe_whole(stripe):
                    buf.drop_stripe(stripe)  # another pusher's copy of it may be taken
            # A chunk's stripes arrive on their own streams, begun as each sender has its first block:
            # the one from the root may end before the others begin (``_schedule`` asks for the chunk
            # whole if the rest stop coming: ``STRIPE_WAIT``).
            if self.partials.get(key) is buf and (stripe is None or index in vs.have):
                del self.partials[key]
                if not buf.whole:
                    buf.abort()  # streams served from it are cut; their requesters pick again
        return False

    def _take_pushed_statement(self, request: web.Request, key: Key, i: int, pusher: str) -> str | None:
        """The statement a push carries (``STATEMENT_HEADER``), taken where this node lacks chunk
        ``i``'s block hashes, as an exchange reply's would be: a node that has not heard of the version
        yet checks the push at once rather than waiting for the trainer's announcement, which a swarm
        just formed hears of a long poll's round trip late (evidence:
        docs/history/DESIGN-NOTES.md#pushed-statement). The
        trainer's signature vouches for it, not the pusher; one that does not check bans the pusher,
        as a forged statement in an exchange reply does. Why it does not hold, or None."""
        raw = request.headers.get(STATEMENT_HEADER)
        vs = self.versions.get(key)
        if raw is None or self.signer is not None or (vs is not None and vs.blocks.get(i) is not None):
            return None
        if key.version <= self.floor() and vs is None:
            return None  # older than this node's position: of no use to it (declined below)
        try:
            if len(raw) > STATEMENT_HEADER_MAX:
                raise FormatError(f"over {STATEMENT_HEADER_MAX} characters")
            st = Signed.from_bytes(base64.b64decode(raw, validate=True), what="pushed statement")
            if st.kind != announce_kind(key.anchor) or st.version != key.version:
                raise FormatError(f"not an announcement of {key}")
            fresh = vs or VersionState(key.version, key.anchor)
            self._take_statement(fresh, st)
            if fresh.blocks.get(i) is None:
                raise FormatError(f"announces no block hashes for chunk {i}")
        except (FormatError, IntegrityError, ValueError) as e:
            if isinstance(e, IntegrityError) and (ps := self._peer(pusher)) is not None:
                self._ban(ps, f"pushed a statement that does not check: {e}")
            return f"pushed statement: {e}"
        if vs is None:
            self.versions[key] = fresh
        self._touch()
        self._wake_announced()
        return None

    def _wake_announced(self) -> None:
        """New statements: pushes waiting for their chunk's block hashes look again (``handle_push``)."""
        self._announced.set()
        self._announced = asyncio.Event()

    def _declines(self, key: Key, i: int, ps: PeerState | None, *, replacing: bool = False,
                  stripe: str | None = None) -> str | None:
        """Why a push of chunk ``i`` of ``key`` from ``ps`` is not taken now, if it is not
        (``swarm.push.declines``)."""
        vs = self.versions.get(key)
        hashes = None if vs is None or i not in vs.chunks else vs.blocks.get(i)
        part = self.partials.get((key, i))
        arriving = Arriving(
            blocks=None if hashes is None else len(hashes) // BLOCK_HASH,
            held=vs is not None and i in vs.have,
            wanted=key in self.wanted(),
            asked=(key, i) in self.inflight,
            asked_whole=(key, i) in self.unstriped,
            stripes=part.holds_stripe if part is not None and part.striped and not part.failed else None,
            paused_until=self.store_paused_until,
            taking=len(self._taking) - len(self._taking_stripes),
            striping=sum(1 for p in self.partials.values() if p.striped and not p.whole))
        return declines(arriving, time.monotonic(), stripe, replacing=replacing, trainer=self.signer is not None,
                        peer=ps is not None and ps.role != "trainer")

    def _unstarted(self, key: Key, i: int, pusher: str) -> asyncio.Task | None:
        """The one request out for chunk ``i`` of ``key``, if no byte of it has arrived yet and it went
        to a rollout, not to the trainer: super-seeding counts that request as a first copy taken, and
        if the push's feed then failed the chunk would wait for it until the trainer gives the copy
        again (evidence: docs/history/DESIGN-NOTES.md#replace-unstarted-requests). A request whose
        response has not begun has no partial yet: it is the most unstarted of all, and is replaced
        too, or a swarm's first pushes are declined for requests that went out a moment before. A
        request to the pusher itself is replaced too: across regions it reaches the pusher a one-way
        delay after its push has begun here, and the pusher refuses a request for a chunk it is pushing to the asker
        (``handle_chunk``); kept, it would be served a round trip late (``swarm.push.unstarted``)."""
        part = self.partials.get((key, i))
        return unstarted(self.inflight.get((key, i), {}), part is not None and part.got > 0,
                         lambda p: (ps := self.peers.get(p)) is not None and ps.role != "trainer", self._taking)

    async def handle_push(self, request: web.Request) -> web.Response:
        """A chunk a peer sends unasked (``_push_to``): taken only from a rollout peer this node knows,
        for a chunk it wants, neither holds nor fetches, and can check block by block against the
        trainer's signed hashes; then received as if fetched (``_receive``), so it is relayed on at
        once. A bad block bans the sender, as for a chunk asked for."""
        asked = self._chunk_request(request)
        if isinstance(asked, web.Response):
            return asked
        key, i, remote = asked
        if (bad := self._take_pushed_statement(request, key, i, remote.node_id)) is not None:
            self.pushes["declined"] += 1
            event(log, logging.WARNING, "declined a push: its statement does not hold", peer=remote.node_id,
                  object=str(key), index=i, reason=bad)
            return web.json_response({"error": bad}, status=400)
        stripe = request.headers.get(STRIPE_HEADER)
        why = self._declines(key, i, self._peer(remote.node_id), stripe=stripe)
        give_up = time.monotonic() + PUSH_STATEMENT_WAIT
        while why == NO_HASHES and (left := give_up - time.monotonic()) > 0:
            # The push outran the trainer's announcement (the pusher had it first): wait for it, on
            # ``_announced``, not ``changed``, since taking statements only touches ``gen``.
            announced = self._announced
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await announced.wait()
            why = self._declines(key, i, self._peer(remote.node_id), stripe=stripe)
        # Asked of another peer a moment ago, and not a byte back yet: the push, here now, takes the
        # request's place (declined, it held the pusher's slot for a round trip for nothing). Looked
        # for after the wait too: the announcement that ends it also starts this node's own request,
        # and a swarm's first version declined the pushes into its other regions so, each region's
        # nodes then pulling across from the trainer's first holder at a share of its uplink.
        pull = self._unstarted(key, i, remote.node_id) if why == "being fetched" else None
        if pull is not None:
            why = self._declines(key, i, self._peer(remote.node_id), replacing=True, stripe=stripe)
        if why is not None:
            self.pushes["declined"] += 1
            event(log, logging.DEBUG, "declined a push", peer=remote.node_id, object=str(key), index=i, reason=why)
            return web.json_response({"error": why}, status=409)
        ps, vs = self._peer(remote.node_id), self.versions[key]
        assert ps is not None  # (``_declines`` takes pushes from peers only)
        part = self.partials.get((key, i))
        # (``_declines`` checked the header: it parses)
        striped = None if stripe is None else parse_stripe(stripe, len(vs.blocks[i]) // BLOCK_HASH)
        self._take_root(vs, i, request.headers.get(ROOT_HEADER))
        if (also := request.headers.get(ALSO_HEADER, "")) and len(also) <= ALSO_HEADER_MAX:
            self.fed_along.setdefault(key, {})[i] = frozenset(also.split(",")) - {self.host.node_id}
        if pull is not None:  # replaced before any await, so the scheduler cannot ask again meanwhile
            self.partials.pop((key, i), None)  # the request's, if its response began: nothing served from it
            pull.cancel()
            part = None
        into = None
        if striped is not None:  # the stripes of a chunk share one buffer, made before any await
            if part is None or not part.striped or part.failed:
                into = Partial(vs.chunks[i].size, vs.block, vs.blocks[i], what=f"chunk {i} of {key}")
                into.stripe()
                self.partials[(key, i)] = into
            else:
                into = part
            into.stripe_got[striped] = 0
            into.fed_at = time.monotonic()
            if ps.region == vs.roots.get(i):
                into.own.setdefault(striped)  # from the root region: handed on if a receiver (``_stripe_out``)
            into.feeders += 1
        event(log, logging.DEBUG, "taking a push", peer=remote.node_id, object=str(key), index=i, stripe=stripe)
        task = asyncio.create_task(self._receive(ps, vs, i, _body(request), whole=False, stripe=striped, into=into),
                                   name=f"pushed-{key.tag}-{i}")
        self._track(ps, (key, i), task)
        self._taking.add(task)
        if into is not None:
            self._taking_stripes.add(task)
        try:  # as long as a fetch of it may take; a stalled push makes way for a request
            await asyncio.wait({task}, timeout=stream_timeout(vs.chunks[i].size, _send_time(vs, i)))
        finally:
            self._taking.discard(task)
            self._taking_stripes.discard(task)
            if not task.done():  # it stalled, or this handler was cancelled (the sender hung up)
                task.cancel()
                await asyncio.wait({task})
        stored = not task.cancelled() and task.exception() is None and task.result()
        if not task.cancelled() and task.exception() is not None:
            event(log, logging.ERROR, "a push could not be taken", peer=remote.node_id, object=str(key), index=i,
                  reason=repr(task.exception()))
        if stored:
            self.pushes["received"] += 1
        return web.json_response({"stored": bool(stored)})
