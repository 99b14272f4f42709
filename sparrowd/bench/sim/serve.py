"""The server side of a simulated node (the daemon's exchange and chunk handlers): what it shows and
whom it serves (``swarm.serving``), its lanes and upload queues, the trainer's choke decisions.
"""

from __future__ import annotations

from ...swarm import serving
from ...swarm.choker import ChokerPeer
from ...swarm.policy import UPLOADS_PER_PEER
from ...swarm.push import relay_fanout, stream_rate
from .model import CONCURRENT, Node, Req
from .parts import SimParts

__all__ = ["Serving"]


class Serving(SimParts):
    """``Sim``'s server side: what a node shows and whom it serves, its lanes and upload queues."""

    def wants(self, x: Node, y: Node) -> bool:
        k = x.known.get(y.id)
        return bool(x.have - k.have) if k is not None else bool(x.have)

    def slots(self, x: Node) -> serving.Slots:
        """The trainer's upload slots (``serving.Slots``): every peer it knows counts as live, and the
        near ones still short of the version as wanting."""
        return serving.Slots(x.choker, x.unchoked, lambda p: self.by_id[p].region == x.region, len(x.known),
                             self.near_trainer, self.cfg.regions, self.near_wanting)

    @staticmethod
    def lane(x: Node, y: Node) -> bool:
        return serving.lane(x.trainer, x.rname, y.rname)

    def may_download(self, x: Node, y: Node) -> bool:
        if not x.trainer:
            return serving.relay_admits(len(x.queue[self.lane(x, y)]))
        return self.slots(x).admits(y.id, y.region != x.region)

    def owed(self, x: Node, y: Node) -> frozenset[int]:
        k = x.known.get(y.id)
        return serving.owed(x.superseed, y.id, k.have if k is not None else set())

    def choked_for(self, x: Node, y: Node) -> bool:
        """The ``choked`` flag of x's exchange reply to y."""
        if not x.trainer:
            return not serving.relay_admits(len(x.queue[self.lane(x, y)]))
        return serving.trainer_chokes(self.slots(x), y.id, y.region != x.region, wants=self.wants(x, y),
                                      owes=lambda: bool(self.owed(x, y)))

    def shown(self, x: Node, y: Node) -> set[int]:
        """What x shows y of the version: all it holds, or for the trainer its super-seed offer."""
        if not x.trainer:
            return x.have
        k = x.known.get(y.id)
        have = k.have if k is not None else set()
        n = len(self.sizes)
        delay = self.cfg.rtt / 2 if self.cfg.regions > 1 else None  # as the daemons measure it: between regions
        return serving.trainer_shows(
            x.have, self.slots(x), x.superseed, self.now, y.id, have, x.held_by, far=y.region != x.region,
            announced=n, total=n, super_seed=True, trusted=serving.trusted(bool(have), any(x.held_by.values())),
            quick=serving.quick(self.sizes[0], n, self.cfg.trainer_rate, delay))

    def choke(self, x: Node) -> None:
        peers = [ChokerPeer(pid, self.wants(x, k.node), rate_from=k.rate.rate(self.now),
                            rate_to=k.rate_to.rate(self.now), near=k.node.region == x.region)
                 for pid, k in x.known.items()]
        seed = len(x.have) == self.chunks
        unchoked = x.choker.decide(self.now, peers, seed=seed)
        if unchoked != x.unchoked:
            if x.superseed is not None:
                for pid in x.unchoked - unchoked:
                    x.superseed.forget(pid, unclaimed_only=True)
            x.unchoked = unchoked
            self.dirty.update(k.node for k in x.known.values())

    def request_arrives(self, r: Req) -> None:
        x, y = r.src, r.dst
        if r.cancelled or r.version != self.version:
            return self.release(r)
        if not x.alive:
            return self.at(self.now + self.owd(x, y), self.failed, r)
        k = x.known.get(y.id)
        feed = None if r.chunk in x.have or not self.cfg.cut_through else x.partial.get(r.chunk)
        if feed is not None and self.cfg.relay_after_block and not self.ready(feed):
            feed = None  # nothing has come of it yet: it may be fed, in a circle, by the streams it would serve
        if k is None or (r.chunk not in x.have and feed is None) \
                or not (self.may_download(x, y) or r.chunk in self.owed(x, y)) or k.uploads >= UPLOADS_PER_PEER:
            return self.at(self.now + self.owd(x, y), self.refused, r)  # the daemon's 404 (not a lie) or 503
        k.uploads += 1
        if x.trainer:
            y.root.setdefault(r.chunk, y.rname)  # it enters the swarm here
            y.first_hand.add(r.chunk)
        elif r.chunk in x.root:
            y.root.setdefault(r.chunk, x.root[r.chunk])  # (the reply's headers say so)
        if x.superseed is not None:
            x.superseed.claim(r.chunk, y.id)
        if feed is not None:
            r.feed = feed
            room = self.room(x, feed)  # (before it counts itself)
            feed.readers.append(r)
            if room is not None and room <= 0:  # the daemon's ``Partial.turn``: out of the lane until there is
                r.held = True
                x.held.append(r)
                return
        x.queue[self.lane(x, y)].append(r)
        self.start_uploads(x)

    def room(self, x: Node, feed: Req) -> int | None:
        """How many more streams x may serve now from its partial ``feed``, None for no limit (the
        daemon's ``Partial.room``): ``relay_fanout`` of x's uplink and the rate the chunk arrives at,
        less the streams served or about to be served from it."""
        if feed.chunk in x.have or not self.cfg.fanout:
            return None
        most = relay_fanout(self.up[x.idx], feed.declared)
        if most is None:
            return None
        return most - sum(1 for q in feed.readers if not (q.held or q.ended or q.cancelled or q.stripe))

    def start_uploads(self, x: Node) -> None:
        if x.held:  # requests for a partial's stream: into their lane once it has room (or is whole, or cut)
            for r in list(x.held):
                assert r.feed is not None  # (held for room in the partial it is served from)
                room = None if r.cancelled else self.room(x, r.feed)
                if room is None or room > 0:
                    r.held = False
                    x.held.remove(r)
                    x.queue[self.lane(x, r.dst)].append(r)
        for lane, queue in x.queue.items():
            while x.active[lane] < CONCURRENT[x.trainer] and queue:
                r = queue.popleft()
                if r.cancelled:
                    if x.superseed is not None:  # as the daemon's trainer: its node hung up before a byte
                        x.superseed.unclaim(r.chunk, r.dst.id)
                    x.known[r.dst.id].uploads -= 1
                    self.dropped(r)
                    continue
                x.active[lane] += 1
                feed = r.feed if r.chunk not in x.have else None  # a partial's stream: no faster than it arrives
                r.declared = stream_rate(x.up, x.wan, x.active[False] + x.active[True], x.active[True], wan=lane,
                                         arriving=feed.declared if feed is not None else None)
                r.left = float(r.size)
                self._add_flow(r)
