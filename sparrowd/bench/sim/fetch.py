"""The fetching side of a simulated node (the daemon's scheduler, exchanges and streams coming in):
requests ending, chunks arriving, have messages, and the plan (the real picker).
"""

from __future__ import annotations

from ...swarm import serving
from ...swarm.picker import STRIPE_WAIT, PeerView, recount, slots_for_rate
from .model import Node, Req
from .parts import SimParts

__all__ = ["Fetching"]


class Fetching(SimParts):
    """``Sim``'s fetching side: requests ending, chunks arriving, have messages and the plan."""

    def dropped(self, r: Req) -> None:
        """A cancelled request left its server: a loser's node already knows; a cut stream's node hears
        one one-way delay later."""
        if r.cut:
            self.at(self.now + self.owd(r.src, r.dst), self.heard_cut, r)
        else:
            self.release(r)

    def heard_cut(self, r: Req) -> None:
        self.note("cut", r)
        self.release(r)

    def shows_fetching(self, x: Node):
        """The chunks x tells its peers it is fetching: all it has asked for, or, where it relays only
        once a block has checked out, those (which it serves)."""
        if not (self.cfg.cut_through and self.cfg.relay_after_block) or x.trainer:
            return x.fetching.keys()
        at, shown = self.shown_fetching.get(x.idx, (None, None))
        if at != self.now:  # once a step: nothing is received while nodes plan
            shown = {c for c, f in x.partial.items() if self.ready(f)}
            self.shown_fetching[x.idx] = (self.now, shown)
        return shown

    def ready(self, f: Req) -> float:
        """The bytes of the partial ``f`` feeds that have checked out (the last block only once it is whole)."""
        if self.s_whole[f.serial]:
            return f.size
        return min(self.s_got[f.serial] // self.block * self.block, f.size - (f.size % self.block or self.block))

    def timed_out(self, r: Req) -> None:
        """The daemon's request timeout, for a stream from a partial (which waits as long as its feed
        does: in a circle of partials, each fed by the next, for ever)."""
        if r.dst.fetching.get(r.chunk, {}).get(r.src.id) is r:
            self.withdraw(r)

    def withdraw(self, r: Req) -> None:
        """Its node gives the request up: its flow ends at the next step and the chunk goes back to the
        picker."""
        r.cancelled = True
        self.cancel_pending = True
        self.release(r)

    def whole(self, y: Node, c: int) -> None:
        """y got chunk c whole: the streams served from its partial go on from this copy."""
        if (f := y.partial.pop(c, None)) is not None:
            self.s_whole[f.serial] = True
            self.assemblies.discard(f)

    def abort(self, f: Req) -> None:
        """The request feeding its node's partial ended without the chunk: the streams served from it
        are cut (their requesters pick again; not the server's fault, so no strike)."""
        for r in f.readers:
            if r.cancelled or r.version != self.version:
                continue
            r.cancelled = r.cut = True
            self.cuts += 1
            self.cancel_pending = True  # a queued one is dropped when its turn comes, an active one now
        if f.dst.held:
            self.start_uploads(f.dst)  # and a held one now

    def release(self, r: Req) -> None:
        """The request is over for its node: the chunk goes back to the picker (and a partial it fed
        without the chunk arriving is aborted)."""
        y = r.dst
        if y.partial.get(r.chunk) is r:
            del y.partial[r.chunk]
            self.abort(r)
        reqs = y.fetching.get(r.chunk)
        if reqs is not None and reqs.get(r.src.id) is r:
            del reqs[r.src.id]
            if not reqs:
                del y.fetching[r.chunk]
            k = y.known.get(r.src.id)
            if k is not None:
                k.inflight -= 1
        if r.stripe is not None and y.partial.get(r.chunk) is r.asm and \
                not any(q.stripe is not None for q in y.fetching.get(r.chunk, {}).values()):
            # The last stripe out: the rest may not come.
            self.at(self.now + STRIPE_WAIT + self.cfg.wan_rtt, self.stripes_stopped, r.asm)
        self.dirty.add(y)

    def refused(self, r: Req) -> None:
        self.note("refused", r)
        self.release(r)

    def failed(self, r: Req) -> None:
        self.note("failed", r)
        k = r.dst.known.get(r.src.id)
        if k is not None and r.whole:  # a cut-through stream's end is not held against its server
            k.strikes += 1
            k.cooldown_until = self.now + min(60.0, 2.0 ** k.strikes)
            k.stalled = True  # not counted on to cross until it delivers again
        self.release(r)

    def arrives(self, r: Req) -> None:
        y, x = r.dst, r.src
        if r.stripe is not None:  # one stripe in: the chunk is stored once all are (the daemon's ``_receive``)
            a = r.asm
            assert a is not None and a.done is not None  # the partial a stripe fills (``stripe_to``)
            self.s_whole[r.serial] = True  # the stripe's last block may go on now
            a.done.add(r.stripe[0])
            a.fed_at = self.now
            if len(a.done) < r.stripe[1] or r.version != self.version or r.chunk in y.have or not y.alive:
                return self.release(r)
        fresh = r.version == self.version and y.alive and r.chunk not in y.have
        self.note("stored" if fresh else "wasted", r)
        if fresh:
            y.have.add(r.chunk)
            self.whole(y, r.chunk)
        if (a := y.partial.get(r.chunk)) is not None and a.parts is not None and r.chunk in y.have:
            self.whole(y, r.chunk)  # arrived whole by a request, in place of the stripes
        self.release(r)
        if y.held:
            self.start_uploads(y)  # streams held for its partial go now, from the whole copy
        if r.version != self.version or not y.alive:
            return
        if not fresh:
            self.wasted += r.size
            return
        k = y.known.get(x.id)
        if k is not None:
            k.stalled = False
            k.strikes = 0
            k.rate.add(self.now, r.size)
        for other in list(y.fetching.get(r.chunk, {}).values()):  # endgame: cancel the losers
            other.cancelled = True
            self.cancel_pending = True
        if len(y.have) == self.chunks:
            y.done_at = self.now
            self.near_wanting -= y.region == self.trainer.region
            self.pending.discard(y)
        self.tell(y, r.chunk)
        if any(self.cfg.push):
            self.push(y, r.chunk)

    def tell(self, y: Node, c: int, have: bool = True) -> None:
        """Have messages (or, ``have=False``, the exchange reply that shows a chunk y relays): every peer
        hears one one-way delay later."""
        near = [k.node for k in y.known.values() if k.node.region == y.region]
        far = [k.node for k in y.known.values() if k.node.region != y.region]
        fn = self.heard if have else self.heard_relaying
        if near:
            self.at(self.now + self.cfg.local_rtt / 2, fn, y, c, near)
        if far:
            self.at(self.now + self.cfg.rtt / 2, fn, y, c, far)

    def heard_relaying(self, y: Node, c: int, nodes: list[Node]) -> None:
        for z in nodes:
            if z.alive and z.done_at is None and c not in z.have and y.id in z.known:
                self.dirty.add(z)

    def heard(self, y: Node, c: int, nodes: list[Node]) -> None:
        for z in nodes:
            k = z.known.get(y.id)
            if k is None or not z.alive:
                continue
            if c not in k.have:
                k.have.add(c)
                if z.region == y.region and not y.trainer and (a := z.partial.get(c)) is not None \
                        and a.parts is not None:
                    self.at(self.now, self.stripes_stopped, a)  # a region-mate holds it whole: wait no more
                if len(k.have) < self.chunks:  # seen partly held (the daemon counts only partial have maps)
                    k.held += 1
                if z.trainer:
                    z.held_by[c] = z.held_by.get(c, 0) + 1
            if not z.aware and not z.trainer:
                z.aware = True  # the statements come with the first exchange that shows the version
            z.available_since.setdefault(c, self.now)
            if z.done_at is None and c not in z.have:
                self.dirty.add(z)
            if z.trainer:
                self.dirty.add(y)  # the trainer may offer it more now

    def plan(self, y: Node) -> None:
        """The daemon's ``_schedule`` for the current version."""
        now = self.now
        if y.trainer or not y.alive or not y.aware or y.done_at is not None:
            return
        if now - y.planned_at < self.cfg.plan_gap:
            self.dirty.add(y)  # again at the next tick: a daemon's scheduler runs one pass at a time
            return
        y.planned_at = now
        missing = [c for c in range(self.chunks) if c not in y.have]
        asked = [max(len(y.fetching.get(c, ())), c in y.partial) for c in missing]
        if min(asked) >= (2 if len(missing) <= y.picker.endgame_left else 1):
            return  # everything it lacks is asked for (twice in the endgame): nothing to decide
        y.counted, y.counted_known = recount(y.counted, y.counted_known,
                                             [(pid, k.held) for pid, k in y.known.items()
                                              if k.node.region == y.region and not k.node.trainer])
        trusted = {p for p in y.counted if p in y.known and not y.known[p].stalled}
        region_nodes = serving.crossers(y.id, y.gateways, lambda g: g in y.known and not y.known[g].stalled, trusted)
        # (the chunk's signed send time, as the trainer's daemon times it, where it signs one: ``Swarm._send_time``)
        y.picker.pace(self.chunk_size, self.cfg.wan_rtt,
                      self.chunk_size / self.cfg.trainer_rate if self.cfg.timed_tree else None)
        views = []
        haves = {}
        for pid, k in y.known.items():
            x = k.node
            if x.trainer:
                have = self.shown(x, y)
                for c in have:
                    y.available_since.setdefault(c, now)
            else:
                have = k.have
            haves[pid] = have
            fetching = self.shows_fetching(x)
            if not x.trainer and len(have) < len(x.have):
                # What x stored that y has not heard of yet still shows as fetching, as x's last reply
                # showed it: a daemon's have and fetching maps come in one reply, never neither.
                fetching = fetching | (x.have - have)
            views.append(PeerView(pid, x.rname, have, is_trainer=x.trainer, fetching=fetching,
                                  choking=self.choked_for(x, y) or now < k.cooldown_until, inflight=k.inflight,
                                  slots=slots_for_rate(rate := k.rate.rate(now), self.chunk_size),
                                  rate=rate, proven=pid in trusted, cut_through=self.cfg.cut_through and not x.trainer))
        inflight = {c: set(y.fetching.get(c, ())) for c in missing}
        for c in missing:  # arriving in stripes, between streams: not asked for until they stop coming
            if (a := y.partial.get(c)) is not None and a.parts is not None:
                inflight[c].add("")
        since = {c: y.available_since.get(c, now) for c in missing}
        for pid in y.picker.stalled(now, version=self.version, missing=missing, peers=views,
                                    region_nodes=region_nodes, available_since=since):
            y.known[pid].stalled = True
        asked_at = {c: min(r.sent for r in y.fetching[c].values()) for c in missing if y.fetching.get(c)}
        for q in y.picker.pick(now, version=self.version, missing=missing, inflight=inflight, peers=views,
                               region_nodes=region_nodes, available_since=since, asked_at=asked_at):
            x = self.by_id[q.peer_id]
            r = Req(y, x, q.index, self.version, self.sizes[q.index], serial=self._serial(),
                    whole=q.index in haves[x.id], sent=now)
            y.fetching.setdefault(q.index, {})[x.id] = r
            y.partial.setdefault(q.index, r)  # the first request for a chunk feeds what the node relays
            if not r.whole:  # (requests for whole chunks are not held to the timeout here: they always move)
                send = r.size / self.cfg.trainer_rate if self.cfg.timed_tree else None  # its signed send time
                self.at(now + serving.stream_timeout(r.size, send), self.timed_out, r)
            y.known[x.id].inflight += 1
            self.note("asked", r)
            self.at(now + self.owd(y, x), self.request_arrives, r)
