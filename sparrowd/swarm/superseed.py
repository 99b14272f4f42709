"""Super-seeding: the trainer hands distinct chunks to distinct peers before repeating any.

Instead of showing every peer every chunk (and uploading popular chunks many
times), the trainer shows each peer only the chunks it has assigned to it, a
few at a time. A new assignment is a chunk never given out before, so the
first copy of each chunk goes to a different peer, and the peers trade the
rest among themselves. First copies go to peers of the seed's own region
while it has enough of them (``first_copies_near``), else to whoever asks,
in every region, but for a share kept at home (``far_first_copies``). A
chunk is given out again only if no peer is known to hold it and its peer
left the swarm or was choked (``forget``), or its peer did not
even ask for it within ``claim_within`` seconds, or ``regive_after``
seconds after it was last given (its peer stalls mid-transfer).

A peer is given ``per_peer`` chunks at a time, so that the trainer's uplink
never waits on a peer's next request; in a swarm of ``single_from`` peers or
more the others' requests fill that gap, and each is given one at a time:
the first copies of a small patch then start in twice as many places.
Three peers are enough to keep the uplink busy one chunk
each; two near peers need two each (evidence:
docs/history/DESIGN-NOTES.md#super-seeding-per-peer).

Chunk 0 is always the first given out, the rest in a random order. Relays
plan chunk 0's crossings as the version's first (``push.stripe_plan``: its
region tree, timed for heads with nothing else to send, where that beats
stripes), and every node plans alike, so the premise must hold however the
chunks arrive, including when every chunk is there at once: otherwise a
tree timed for idle heads crosses behind the stripes of the chunks given
before it (evidence: docs/history/DESIGN-NOTES.md#super-seeding-chunk-zero-first).

Assignments go only to peers the caller marks ``trusted`` (the driver: peers
whose have-maps show chunks, once any peer's do; a swarm just formed trusts
everyone). A peer that let an assignment lapse unclaimed gets none for
``regive_after`` seconds (it fetches from its peers meanwhile). So a member
that joins and never fetches gets nothing to hold back, and one that takes
chunks and drops them (stalled, or hostile) costs ``claim_within`` at most
once per ``regive_after``, not once per version.
Pure: ``offer(now, peer, holds, held_by)`` returns what to show that peer.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass, field
from typing import cast

from .policy import CROSS_BUDGET, SEED_PER_PEER, SEED_SINGLE_FROM

__all__ = ["CROSS_BUDGET", "SuperSeed", "far_first_copies", "first_copies_near"]


def first_copies_near(chunks: int | None, regions: int, near: int, servable: int, *, quick: bool = False) -> bool:
    """Whether a version's first copies go only to peers in the seed's own region: ``near`` live peers
    there, ``servable`` of them the seed may serve now; ``regions`` with peers, the seed's own
    counted; ``chunks`` the version's chunks (before its manifest, those announced so far). A
    first copy given into another region must still reach the seed's region, so it crosses a
    region boundary once more than (R-1) per chunk: first copies spread over every region cost
    1/R of the patch more (evidence: docs/history/DESIGN-NOTES.md#super-seeding-first-copies-near).
    They stay near when the seed may serve a near peer for a one-chunk version, or two
    for a larger one (with one, the seed's uplink waits on it), and, for a larger one, when the
    region has a node for every two other regions: its WAN uplinks then start every chunk's way
    out. ``quick``: the patch leaves the seed in less
    than a round trip between regions (its size over the seed's upload rate); then a first copy
    given into another region, which reaches that region a round trip after it is asked for rather
    than a one-way delay after a near peer has it, costs more than the near region's uplinks gain
    by sharing the crossings, and first copies stay near wherever two near peers may take them."""
    if chunks is None or chunks <= 0 or regions <= 1:
        return False
    return servable >= min(chunks, 2) and (chunks == 1 or quick or 2 * near >= regions - 1)


def far_first_copies(chunks: int | None, regions: int, near: int) -> int | None:
    """The most first copies of a version's ``chunks`` the seed gives peers of other regions, where
    ``first_copies_near`` does not keep them all near: each such chunk must cross back into the
    seed's own region, once more than the (R-1) crossings every chunk takes, so no more than
    ``CROSS_BUDGET`` x (R-1) x the chunks go far, and the rest start at home (evidence:
    docs/history/DESIGN-NOTES.md#super-seeding-far-first-copies).
    None (no limit) where the seed's region has no rollouts (``near`` 0: no chunk need come back) or
    the count is unknown."""
    if not chunks or chunks <= 0 or near <= 0 or regions <= 1:
        return None
    return int(CROSS_BUDGET * (regions - 1) * chunks + 1e-9)


@dataclass
class SuperSeed:
    chunks: int
    per_peer: int = SEED_PER_PEER
    single_from: int = SEED_SINGLE_FROM  # with this many peers or more, each is given one chunk at a time
    regive_after: float = 30.0
    claim_within: float = 3.0
    rng: random.Random = field(default_factory=random.Random)
    given_at: dict[int, float] = field(default_factory=dict)
    assigned: dict[str, set[int]] = field(default_factory=dict)
    claimed: set[int] = field(default_factory=set)
    owner: dict[int, str] = field(default_factory=dict)  # who a chunk was last given to
    lapsed: dict[str, float] = field(default_factory=dict)  # peer -> when it let an assignment lapse
    far: set[int] = field(default_factory=set)  # chunks whose first copy went to a peer of another region
    capped_at: float | None = None  # when ``far_most`` first held a peer of another region back
    home_at: float = float("-inf")  # when a peer of the seed's region was last given a first copy
    home_wait: float = 10.0  # seconds the seed's region may take none of them while the cap holds others back

    def grow(self, chunks: int) -> None:
        """More chunks were announced (a version still being extracted)."""
        self.chunks = max(self.chunks, chunks)

    def claim(self, index: int, peer: str | None = None) -> None:
        """``peer`` asked for chunk ``index``: its assignment is being used (and the peer works)."""
        self.claimed.add(index)
        if peer is not None:
            self.lapsed.pop(peer, None)

    def unclaim(self, index: int, peer: str) -> None:
        """``peer`` hung up on its request for chunk ``index`` before it had it (its daemon restarted
        without leaving, say): the assignment counts as never asked for, so that if the chunk reaches
        nobody it is given again after ``claim_within``, not ``regive_after`` (``sparrowd bench sim``,
        10% of 40 nodes leaving, when pushes replaced requests to the trainer: the pushed copy's feed
        left, and the chunk waited 30 s)."""
        if self.owner.get(index) == peer:
            self.claimed.discard(index)

    def given_to(self, peer: str) -> frozenset[int]:
        """The chunks ``peer`` was given and may still be fetching: its standing assignments, until
        it holds them, it is choked (``forget``) or they go to another (``offer``)."""
        return frozenset(self.assigned.get(peer, ()))

    def forget(self, peer: str, *, unclaimed_only: bool = False) -> None:
        """``peer`` left (or was choked: ``unclaimed_only``, since a transfer it started goes on):
        what it was given and does not hold may be given to another at once. A peer that left also
        takes away the first copies it held: those nobody else is known to hold go again at once,
        not ``regive_after`` after they were given (``sparrowd bench sim``: a node that left with
        a chunk it had not passed on yet held 40 nodes up for 30 s)."""
        keep = set()
        for c in self.assigned.pop(peer, ()):
            if unclaimed_only and c in self.claimed:
                keep.add(c)
            else:
                self.given_at[c] = float("-inf")
        if keep:
            self.assigned[peer] = keep
        if not unclaimed_only:
            for c, owner in self.owner.items():
                if owner == peer:
                    self.given_at[c] = float("-inf")

    def lapsing(self, now: float, held: Set[int]) -> bool:
        """Whether a chunk nobody holds (``held``: chunks some peer holds) waits to be given again: its
        assignment went unclaimed past ``claim_within``, or its peer left. The driver then wakes the
        peers' long polls, so it goes to another now rather than at their next poll."""
        return any(c not in held and c not in self.claimed and now - t >= self.claim_within
                   for c, t in self.given_at.items())

    def offer(self, now: float, peer: str, holds: Set[int], held_by: Mapping[int, int], *,
              trusted: bool = True, peers: int = 0, fresh: bool = True, far: bool = False,
              far_most: int | None = None) -> set[int]:
        """Chunks to show ``peer``; ``held_by[c]``: how many peers are known to hold chunk ``c``;
        ``peers``: how many peers take the seed's first copies (from ``single_from`` on, one chunk
        each at a time; the near ones alone while ``first_copies_near`` keeps them home, since
        fewer near peers given one chunk at a time leave the trainer's uplink idle between each
        chunk and the next request);
        ``fresh``: whether it may be given a chunk never given before (``first_copies_near``: not a
        peer of another region, while those go to the seed's own); one given and lost may still go
        to it, so that a chunk whose near peer stalls is not held up. ``far``: the peer is of another
        region than the seed's; then no more than ``far_most`` chunks' first copies, counted over the
        version, go to such peers (``far_first_copies``; None: no limit), until the seed's own
        region has taken none of the rest for ``home_wait`` seconds while the cap held one back
        (its node stalled, or never fetches): then they go to whoever asks. (``claim_within``,
        3 s, was too short: two home nodes fetching 2 MiB first copies at a share of the
        trainer's uplink took none for that long in some simulated 64 MiB versions.)"""
        pending = {c for c in self.assigned.get(peer, ()) if c not in holds}
        want = (1 if peers >= self.single_from else self.per_peer) - len(pending)
        if want > 0:
            lost = [c for c, t in self.given_at.items()
                    if c not in holds and c not in pending and not held_by.get(c)
                    and (now - t >= self.regive_after or (c not in self.claimed and now - t >= self.claim_within))]
            for c in lost:
                if c not in self.claimed and self.owner.get(c) not in (None, peer):
                    self.lapsed[self.owner[c]] = now
            if not trusted or now - self.lapsed.get(peer, float("-inf")) < self.regive_after:
                want = 0
            new = [c for c in range(self.chunks) if c not in self.given_at and c not in holds] if fresh else []
            self.rng.shuffle(new)
            if 0 in new:  # chunk 0 first (module doc); the rest stay shuffled
                new.remove(0)
                new.insert(0, 0)
            if far and far_most is not None and new:
                room = far_most - len(self.far)
                if room <= 0:  # capped: held back while the seed's region keeps taking the rest
                    self.capped_at = now if self.capped_at is None else self.capped_at
                    room = 0 if now - max(self.capped_at, self.home_at) < self.home_wait else len(new)
                new = new[:room]
            for c in (new + sorted(lost, key=cast(Callable[[int], float], self.given_at.get)))[:want]:
                before = self.owner.get(c)
                if before is not None and before != peer:
                    self.assigned.get(before, set()).discard(c)  # it is this peer's to fetch now
                pending.add(c)
                if c not in self.given_at:
                    if far:
                        self.far.add(c)
                    else:
                        self.home_at = now
                self.given_at[c] = now
                self.owner[c] = peer
                self.claimed.discard(c)
        self.assigned[peer] = pending
        return set(pending)
