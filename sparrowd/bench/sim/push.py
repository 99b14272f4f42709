"""Push: a relay sends what it can serve unasked (``swarm.push``), whole or in stripes, and a push
takes the place of a request with no byte back.
"""

from __future__ import annotations

from ...swarm.picker import stripes_stopped
from ...swarm.push import (
    Arriving,
    PushPeer,
    StripePlan,
    declines,
    push_heads,
    push_targets,
    region_tree,
    stream_rate,
    stripe_plan,
    stripe_size,
    stripe_targets,
    tree_timing,
    unstarted,
)
from .model import CONCURRENT, Known, Node, Req
from .parts import SimParts

__all__ = ["Pushing"]


class Pushing(SimParts):
    """``Sim``'s pushes: what a relay sends unasked, whole or in stripes."""

    def push(self, y: Node, c: int) -> None:
        """Push (``Config.push``, the daemon's ``Swarm._push_out``): y, as soon as it can serve chunk c
        (its first block checked out, or whole), sends it unasked to up to ``push[0]`` peers of its region
        and ``push[1]`` of other regions that neither hold nor fetch it, as the daemon decides
        (``swarm.push``)."""
        if y.trainer or not y.alive:
            return
        feed = None if c in y.have else y.partial.get(c)
        if c not in y.have and feed is None:
            return  # (called once its first block checked out, or once whole)
        sent = y.pushed.setdefault(c, [0, 0])
        known = [k.node for k in y.known.values() if not k.node.trainer and k.node.alive]
        heads = push_heads(y.rname, y.id, (z.id for z in known), self.heads)
        known += [z for hs in heads.values() for h in hs if h not in y.known and (z := self.by_id[h]).alive]
        views = [PushPeer(z.id, z.rname, c in z.have or (bool(z.fetching.get(c)) and self.unstarted(z, c, y) is None))
                 for z in known]
        idle = (max(0, CONCURRENT[False] - y.active[False] - len(y.queue[False])),
                max(0, CONCURRENT[False] - y.active[True] - len(y.queue[True])))
        tree = None
        if y.root.get(c) in self.heads:  # timed as the trainer signs it (the simulator knows the delay)
            timing = tree_timing(self.sizes[c], self.block, self.cfg.trainer_rate, self.cfg.rtt / 2) \
                if self.cfg.timed_tree else None
            send, hop = timing if timing is not None else (None, None)
            plan = stripe_plan(self.version, c, y.root[c], self.heads, -(-self.sizes[c] // self.block),
                               send=send, hop=hop) if self.cfg.stripes else None
            if plan is not None:  # across in stripes, not in the tree
                self.stripe_out(y, c, plan, feed)
                tree = {}
            else:
                tree = region_tree(self.version, c, y.root[c], self.heads, send=send, hop=hop)
        near, far = push_targets(self.version, c, y.id, y.rname, views, heads, local=self.cfg.push[0],
                                 cross=self.cfg.push[1], sent=(sent[0], sent[1]), idle=idle, tree=tree,
                                 most=None if feed is None else self.room(y, feed), whole=c in y.have)
        sent[0] += len(near)
        sent[1] += len(far)
        targets = [self.by_id[i] for i in near + far]
        for z in targets:
            if (u := self.unstarted(z, c, y)) is not None:  # the push takes the place of z's request
                self.withdraw(u)
            r = Req(z, y, c, self.version, self.sizes[c], serial=self._serial(), whole=c in y.have, sent=self.now)
            z.fetching.setdefault(c, {})[y.id] = r
            z.partial.setdefault(c, r)
            z.aware = True  # a push carries the version's statements
            if c in y.root:
                z.root.setdefault(c, y.root[c])  # and the chunk's tree's root
            z.known.setdefault(y.id, Known(y)).inflight += 1
            y.known.setdefault(z.id, Known(z)).uploads += 1
            if feed is not None:
                r.feed = feed
                feed.readers.append(r)
            self.note("pushed", r)
            y.queue[self.lane(y, z)].append(r)
        if targets:
            self.start_uploads(y)

    def stripe_out(self, y: Node, c: int, plan: StripePlan, feed: Req | None) -> None:
        """The daemon's ``Swarm._stripe_out``: y pushes the stripes of chunk c it sends under ``plan``
        (``stripe_targets``), the first holder's as the chunk arrives, a receiver's own from its first
        block; in no upload slot. The receiver takes the first into a new partial of the chunk
        (``Req.parts``, in place of an unstarted request) and the rest beside it."""
        if c not in y.have:
            if feed is None:
                return
            mine = plan.stripe.get(y.rname)
            if mine is not None and feed.parts is not None:
                if (own := feed.parts.get(mine)) is None:
                    return  # its own stripe is not coming here (yet)
                feed = own  # handed on as it arrives (a fetch of the whole chunk: from that, as its blocks do)
        first = c in y.first_hand
        for pid, s in stripe_targets(plan, y.id, y.rname, first):
            if not self.stripe_to(y, c, self.by_id[pid], (s, plan.n), feed) and first:
                # declined: the first holder hands it to the other receivers itself (the daemon hears so
                # a round trip later)
                others = [self.by_id[h] for h in plan.receiver.values() if h != pid]
                self.at(self.now + 2 * self.owd(y, self.by_id[pid]), self.stripe_fallback, y, c, (s, plan.n), others)

    def stripe_fallback(self, y: Node, c: int, stripe: tuple[int, int], to: list[Node]) -> None:
        if y.alive:  # (the events of a version end with it)
            feed = None if c in y.have else y.partial.get(c)
            for z in to:
                self.stripe_to(y, c, z, stripe, feed)

    def stripe_to(self, y: Node, c: int, z: Node, stripe: tuple[int, int], feed: Req | None) -> bool:
        """One stripe push from y to z (the daemon's ``_stripe_to``, ``handle_push``): whether z took it."""
        s, n = stripe
        sent = y.striped_to.setdefault(c, set())
        if (z.id, s) in sent or not z.alive or c in z.have or (c not in y.have and feed is None):
            return True  # (nothing to send: not a decline)
        sent.add((z.id, s))
        a = z.partial.get(c)
        parts = a.parts if a is not None else None
        if parts is not None and y.id in z.fetching.get(c, {}):
            return False  # declined: y feeds z this chunk already (a pair has one request here)
        arriving = Arriving(-(-self.sizes[c] // self.block), asked=bool(z.fetching.get(c)),
                            asked_whole=c in z.unstriped,
                            stripes=None if parts is None else (lambda stripe: stripe[0] in parts))
        why = declines(arriving, self.now, f"{s}/{n}")
        if why == "being fetched" and (u := self.unstarted(z, c, y)) is not None:
            if (why := declines(arriving, self.now, f"{s}/{n}", replacing=True)) is None:
                self.withdraw(u)
                a = None
        if why is not None:
            return False  # declined (the daemon's ``handle_push``)
        if a is None or a.parts is None:
            a = Req(z, z, c, self.version, self.sizes[c], serial=self._serial(), parts={}, done=set())
            z.partial[c] = a
            self.assemblies.add(a)
        r = Req(z, y, c, self.version, stripe_size(self.sizes[c], self.block, s, n), serial=self._serial(),
                whole=c in y.have, sent=self.now, stripe=(s, n), asm=a)
        assert a.parts is not None  # (an assembly: made above if it was not one)
        a.parts[s] = r
        a.fed_at = self.now
        z.fetching.setdefault(c, {})[y.id] = r
        z.aware = True  # a push carries the version's statements
        if c in y.root:
            z.root.setdefault(c, y.root[c])
        z.known.setdefault(y.id, Known(y)).inflight += 1
        y.known.setdefault(z.id, Known(z)).uploads += 1
        if c not in y.have:
            assert feed is not None  # (returned above otherwise)
            r.feed = feed
            feed.readers.append(r)
        self.note("pushed", r)
        r.declared = stream_rate(y.up, y.wan, y.active[False] + y.active[True] + 1, y.active[True] + 1, wan=True,
                                 arriving=r.feed.declared if r.feed is not None else None)
        r.left = float(r.size)
        self._add_flow(r)
        return True

    def assembled(self, a: Req) -> float:
        """The checked prefix of a chunk arriving in stripes (``Partial.ready``): up to its first block
        that no stripe has brought whole."""
        parts, done = a.parts, a.done
        assert parts is not None and done is not None  # (an assembly: ``Sim.assemblies``)
        stripe = next(iter(parts.values())).stripe
        assert stripe is not None  # (its parts are stripes)
        n = stripe[1]
        blocks = -(-a.size // self.block)
        first = blocks
        for s in range(n):
            r = parts.get(s)
            if r is None:
                got = 0
            elif s in done:
                got = len(range(s, blocks, n))
            else:
                got = int(self.s_got[r.serial] // self.block)
            first = min(first, s + got * n)
        return min(first * self.block, a.size)

    def stripes_stopped(self, a: Req) -> None:
        """The daemon's ``STRIPE_WAIT`` (plus the round trip between regions): no stripe of a chunk came for
        that long, or a region-mate holds it whole (``picker.stripes_stopped``); it is asked for whole."""
        y = a.dst
        if y.partial.get(a.chunk) is not a or any(q.stripe is not None for q in y.fetching.get(a.chunk, {}).values()):
            return
        near = any(a.chunk in k.have for k in y.known.values()
                   if k.node.region == y.region and not k.node.trainer and not k.stalled)
        if not stripes_stopped(self.now + 1e-9, a.fed_at, self.cfg.wan_rtt, near_whole=near):
            return
        del y.partial[a.chunk]
        y.unstriped.add(a.chunk)
        self.assemblies.discard(a)
        self.abort(a)
        self.dirty.add(y)

    def unstarted(self, z: Node, c: int, pusher: Node) -> Req | None:
        """z's one request out for chunk c that a push takes the place of (``swarm.push.unstarted``, as
        the daemons decide it); a request whose stream has begun (``left`` set) has got something."""
        reqs = z.fetching.get(c) or {}
        got = any(r.left != 0.0 or self.s_got[r.serial] > 0 for r in reqs.values())
        r = unstarted(reqs, got, lambda peer: not reqs[peer].src.trainer, ())
        return r if r is not None and not r.cancelled else None
