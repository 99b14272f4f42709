"""Which chunk to ask for next, and from whom: a pure function of what peers hold.

Piece choice is rarest first: chunks held by the fewest peers go first, in a
random order within small windows of equally rare ones, so that nodes asking
at once do not all chase the same chunk. Near the end (every missing chunk
already requested and few left) the endgame asks a second peer for each
outstanding chunk once its request has been out ``endgame_after`` seconds;
the driver cancels the loser when one arrives. (A patch of a few chunks is
in the endgame from its first request: asked at once, every crossing went
twice and a region's crossers served each other's duplicates.)

Peer choice ranks sources: same region first, then other peers before the
trainer (whose uplink is the one thing the swarm must spare), then measured
throughput. A chunk is fetched across a region boundary only when no peer in
the region has it or is fetching it, and then only by one node of the
region: the one that wins a rendezvous hash of (version, chunk, node id)
among the region's live nodes (in a region larger than a peer list shows,
among its gateways, which the tracker names to all of them), or the one the trainer offered the chunk to
(super-seeding picks a node per chunk too). Every node computes the same
winner without talking, so each chunk crosses into a region about once and
spreads inside it from there. If the chunk has still not appeared in the
region ``cross_wait`` seconds after it became available outside (the winner
is slow, or dead), anyone may fetch it across.

A neighbour that relays cut-through (``PeerView.cut_through``: it serves a
chunk's verified blocks while it is still fetching the chunk) is a source
for what it is fetching as well as for what it holds, after those that hold
the chunk whole: the region's crosser is fetched from while its chunk is
still crossing, and a chunk moves down a chain of nodes a block behind the
first, not a whole chunk behind at each hop.

A neighbour that holds the chunk and serves this node keeps it from crossing
(it waits for a slot). A neighbour's claim (fetching the chunk, or holding it
while choking this node) does too, but only if that neighbour has served
this node before (``PeerView.proven``) and only for ``claim_wait`` times
``cross_wait``: a member that claims everything and serves nothing must not
hold the region back.

Requests per peer are capped by ``PeerView.slots``, which the driver sizes
from the peer's measured rate (several streams to a fast peer, one to a slow
one). A node designated for a chunk that did not bring it across in time is
reported by :meth:`Picker.stalled`, and left out of the designation from then on.
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from .policy import CROSS_GRACE, CROSS_RATE, ENDGAME_AFTER, SLOW_CHUNKS, STRIPE_WAIT

__all__ = ["PeerView", "Request", "Picker", "count_on", "designated", "recount", "slots_for_rate", "ENDGAME_AFTER",
           "SLOW_CHUNKS", "CROSS_GRACE", "CROSS_RATE", "STRIPE_WAIT"]


def stripes_stopped(now: float, fed_at: float, round_trip: float, *, failed: bool = False,
                    near_whole: bool = False) -> bool:
    """Whether a chunk arriving in stripes, last fed at ``fed_at``, is to be asked for whole now: no
    stripe came for ``STRIPE_WAIT`` plus the ``round_trip`` between regions, a stripe failed, or a peer
    of this node's own region holds the chunk whole (``near_whole``). That last is a region-mate's hop,
    not a crossing: in a swarm just formed, two members of a region can each be taken for its crosser
    by nodes that had not heard of the other yet, and the one whose stripes all came has the chunk
    while the other would wait out ``STRIPE_WAIT`` for stripes sent to its region-mate (evidence:
    docs/history/DESIGN-NOTES.md#picker-near-whole-stops-stripes)."""
    return failed or near_whole or now - fed_at >= STRIPE_WAIT + max(0.0, round_trip)


def _claimed(p: PeerView) -> tuple[set[int] | frozenset[int], ...]:
    """The sets of chunks a neighbour says it will have for this node: those it is fetching, and
    those it holds while it chokes this node for now (none for the trainer)."""
    if p.is_trainer:
        return ()
    return (p.fetching, p.have) if p.choking else (p.fetching,)


def _claims(p: PeerView, c: int) -> bool:
    """Whether a neighbour says it will have chunk ``c`` for this node (``_claimed``)."""
    return any(c in s for s in _claimed(p))


@dataclass
class PeerView:
    peer_id: str
    region: str
    have: set[int] | frozenset[int]  # for the trainer: what it offers this node (super-seeding)
    is_trainer: bool = False
    fetching: set[int] | frozenset[int] = frozenset()  # chunks it has asked for: it is "about to" have them
    choking: bool = False
    inflight: int = 0
    slots: int = 2
    rate: float = 0.0  # bytes/s measured from this peer
    proven: bool = True  # it has served this node (a neighbour's claims are waited on only then)
    cut_through: bool = False  # it serves chunks it is fetching, block by block as they arrive


@dataclass(frozen=True)
class Request:
    peer_id: str
    index: int
    duplicate: bool = False


@functools.lru_cache(maxsize=1 << 16)
def _score(version: int | str, index: int, node: str) -> bytes:
    return hashlib.blake2b(f"{version}/{index}/{node}".encode(), digest_size=8).digest()


def designated(version: int | str, index: int, nodes: Iterable[str]) -> str | None:
    """Rendezvous hashing: the node of a region that fetches this chunk across the boundary. (Scores
    are cached: every scheduling pass asks again for every missing chunk.)"""
    best, best_key = None, b""
    for n in nodes:
        key = _score(version, index, n)
        if best is None or key > best_key:
            best, best_key = n, key
    return best


def count_on(neighbours: Iterable[tuple[str, int]]) -> frozenset[str]:
    """The peers of this node's region it counts on for a version (to share the region's
    cross-region fetches, the rendezvous designation, and to deliver what they claim to be
    fetching), from ``(peer id, chunks it has shown holding)`` for each non-trainer peer of the
    region (what its exchange replies' have maps have shown, over all versions, counted only from
    maps that lacked some chunks of their version: a member whose map claims a whole version at
    once, as a liar's does, shows none): those that have shown holding chunks, or all of them
    while none has (a swarm just formed).

    Every node of the region polls the same peers' have maps, so their views agree, and so do
    their designations: each chunk crosses into the region once; counting on the peers that served
    this node would give each node its own set, and chunks would cross twice (evidence:
    docs/history/DESIGN-NOTES.md#picker-count-on-shown-holders). A member that never holds anything
    (a dead box) is not counted on, nor one whose maps claim every chunk at once (else, designated
    and slow to show a new version, it costs each node ``cross_wait``). One that fakes a map's
    growth is asked for the chunks it shows and banned; one that holds chunks and never crosses
    costs each node that counted on it one ``cross_wait``: it is passed over (``Picker.stalled``)
    until it delivers. The driver fixes the set per version, so that designations do not move under
    a version in flight (they would, as peers show their first chunks)."""
    neighbours = list(neighbours)
    shown = any(h for _, h in neighbours)
    return frozenset(p for p, h in neighbours if h or not shown)


def recount(counted: frozenset[str] | None, known: frozenset[str],
            neighbours: Iterable[tuple[str, int]]) -> tuple[frozenset[str], frozenset[str]]:
    """``(counted, known)`` for a version in flight: whom this node counts on (``count_on``) and
    the region's peers it knew when it decided. Decided once, when the version starts (``counted``
    None), and from then on only grown: by the peers of the region it learns of since, those of
    them ``count_on`` would take.

    A swarm that has just formed starts its first version while its nodes still learn of each
    other: the set grows so that a node that started on the version before it heard of its region's
    other node does not fetch every chunk across itself while the other counts on it (evidence:
    docs/history/DESIGN-NOTES.md#picker-recount)."""
    neighbours = list(neighbours)
    ids = frozenset(p for p, _ in neighbours)
    if counted is None:
        return count_on(neighbours), ids
    new = ids - known
    if not new:
        return counted, known
    return counted | (count_on(neighbours) & new), known | ids


def slots_for_rate(rate: float, chunk_size: int, *, target_seconds: float = 1.0, lo: int = 1, hi: int = 8) -> int:
    """Requests in flight to keep a peer busy for about ``target_seconds``: rate x time / chunk size."""
    if rate <= 0 or chunk_size <= 0:
        return 2
    return max(lo, min(hi, int(rate * target_seconds / chunk_size) + 1))


@dataclass
class Picker:
    me: str
    region: str
    rarest_window: int = 4
    cross_wait: float = 3.0
    endgame_left: int = 8
    claim_wait: float = 2.0  # a proven neighbour's claim holds this node back this many cross_waits
    endgame_after: float = ENDGAME_AFTER
    rng: random.Random = field(default_factory=random.Random)

    def pace(self, chunk_size: int, round_trip: float | None = None, send: float | None = None) -> None:
        """Time this pass's waits for a version of chunks up to ``chunk_size`` bytes, between regions
        ``round_trip`` seconds apart (None: not measured yet, taken as none), whose largest chunk the
        trainer's uplink sends in ``send`` seconds (its signed tree timing; None: unknown). A region's
        designated crosser has ``CROSS_GRACE``, its chunk's time at ``CROSS_RATE`` and the round trip
        its request and the chunk's first byte take before anyone else crosses for the chunk
        (``cross_wait``); a request is out ``ENDGAME_AFTER`` plus that round trip before the endgame
        asks a second peer (``endgame_after``). The round trip is counted so that chunks still
        crossing are not asked for again, across (evidence: docs/history/DESIGN-NOTES.md#picker-pace).

        Where ``SLOW_CHUNKS`` times ``send`` is longer than the chunk's time at ``CROSS_RATE`` or than
        ``ENDGAME_AFTER``, that is the wait: over slow links a chunk moving at its rate is not late,
        and its designated crosser is not passed over nor its request asked again."""
        rt = max(0.0, round_trip or 0.0)
        slow = SLOW_CHUNKS * send if send is not None and send > 0 else 0.0
        self.cross_wait = CROSS_GRACE + max(chunk_size / CROSS_RATE, slow) + rt
        self.endgame_after = max(ENDGAME_AFTER, slow) + rt

    def _order(self, chunks: list[int], peers: list[PeerView]) -> list[int]:
        count = {c: 0 for c in chunks}
        wanted = set(chunks)
        for p in peers:  # (set operations: every scheduling pass orders every missing chunk)
            offers = wanted.intersection(p.have)
            if p.cut_through:
                offers.update(wanted.intersection(p.fetching))
            for c in offers:
                count[c] += 1
        by_rarity = sorted(chunks, key=lambda c: count[c])
        out = []
        w = max(1, self.rarest_window)
        for s in range(0, len(by_rarity), w):
            window = by_rarity[s : s + w]
            self.rng.shuffle(window)
            out += window
        return out

    def stalled(
        self,
        now: float,
        *,
        version: int | str,
        missing: Iterable[int],
        peers: list[PeerView],
        region_nodes: Iterable[str],
        available_since: Mapping[int, float],
    ) -> set[str]:
        """Region peers that held this node back and did not deliver, for the driver to pass over
        (leave out of ``region_nodes``, and stop waiting on their claims) until they deliver
        something to it:

        * a node designated to bring a chunk across that, ``cross_wait`` after the chunk became
          available outside, neither holds it nor is fetching it, whether or not a neighbour crossed
          in its place (that neighbour's view may already leave it out; for designations to agree,
          every node that counted on it must too);
        * a neighbour whose claim (fetching the chunk, or holding it while choking this node) has
          not turned into a chunk this node can fetch ``claim_wait`` times ``cross_wait`` after the
          chunk became available.

        So a dead or slow node, or a member that claims chunks and never serves them, costs each
        node that waited on it one wait, not one per chunk or per version."""
        nodes = sorted(set(region_nodes))
        local = {p.peer_id: p for p in peers if p.region == self.region}
        out: set[str] = set()
        for c in missing:
            d = designated(version, c, nodes)
            p = local.get(d) if d is not None else None
            if d is not None and d != self.me and p is not None and c not in p.have and c not in p.fetching and \
                    self._overdue(now, c, available_since):
                out.add(d)
            if self._overdue(now, c, available_since, self.claim_wait):
                out |= {p.peer_id for p in local.values() if p.proven and _claims(p, c)}
        return out

    def _overdue(self, now: float, c: int, available_since: Mapping[int, float], factor: float = 1.0) -> bool:
        """Whether ``factor`` times ``cross_wait`` has passed since the chunk became available."""
        return now - available_since.get(c, now) >= self.cross_wait * factor

    def pick(
        self,
        now: float,
        *,
        version: int | str,  # a Key.tag: "12", or "a12" for an anchor
        missing: Iterable[int],
        inflight: Mapping[int, set[str]],
        peers: list[PeerView],
        region_nodes: Iterable[str],
        available_since: Mapping[int, float],
        asked_at: Mapping[int, float] | None = None,
    ) -> list[Request]:
        """Requests to send now. ``missing``: chunk indices this node lacks (and knows of);
        ``inflight``: chunk -> peers already asked; ``region_nodes``: the nodes of this region
        that share its cross-region fetches (this one and the neighbours it counts on; in a region
        larger than a peer list shows, its gateways, this node only if it is one);
        ``available_since``: when this node first saw a peer offering each chunk; ``asked_at``: when
        each chunk in flight was asked for (without it, the endgame duplicates at once)."""
        missing = list(missing)
        nodes = sorted(set(region_nodes))
        free = {p.peer_id: max(0, p.slots - p.inflight) for p in peers if not p.choking}
        usable = [p for p in peers if not p.choking]
        serving_here = [p for p in usable if p.region == self.region]
        proven_here = [p for p in peers if p.region == self.region and p.proven]
        # Per chunk below: does a neighbour that serves this node hold it, does a proven one claim it
        # (``_claimed``); gathered once a pass rather than asked of every neighbour for every chunk.
        held_here = set().union(*(p.have for p in serving_here))
        claimed_here = set().union(*(s for p in proven_here for s in _claimed(p)))
        out: list[Request] = []

        def sources(c: int, exclude: set[str]) -> list[PeerView]:
            holders = [p for p in usable if (c in p.have or (p.cut_through and c in p.fetching))
                       and free[p.peer_id] > 0 and p.peer_id not in exclude]
            rank = lambda p: (c not in p.have, p.is_trainer, -p.rate)  # noqa: E731
            local = [p for p in holders if p.region == self.region]
            if local:
                return sorted(local, key=rank)
            if c in held_here:
                return []  # a neighbour that serves this node has it: wait for a slot rather than cross
            if c in claimed_here and not self._overdue(now, c, available_since, self.claim_wait):
                return []  # a neighbour is about to have it: wait for it rather than cross (for a while)
            overdue = self._overdue(now, c, available_since)
            if designated(version, c, nodes) == self.me or overdue:
                return sorted(holders, key=rank)
            return [p for p in holders if p.is_trainer]  # the trainer offered it to this node: take it

        for c in self._order([c for c in missing if not inflight.get(c)], peers):
            for p in sources(c, set())[:1]:
                free[p.peer_id] -= 1
                out.append(Request(p.peer_id, c))

        asked = {c for c in missing if inflight.get(c)} | {r.index for r in out}
        if len(asked) == len(missing) and 0 < len(missing) <= self.endgame_left:
            for c in self._order(sorted(asked), peers):
                already = set(inflight.get(c, ())) | {r.peer_id for r in out if r.index == c}
                if len(already) >= 2 or (asked_at is not None and now - asked_at.get(c, now) < self.endgame_after):
                    continue
                for p in sources(c, already)[:1]:
                    free[p.peer_id] -= 1
                    out.append(Request(p.peer_id, c, duplicate=True))
        return out
