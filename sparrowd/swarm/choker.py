"""Who may download from this node now: upload slots, tit-for-tat, an optimistic unchoke.

A node has a few upload slots. Regular slots go to the interested peers that
give it the most (measured download rate from them); a node that already
holds everything (a seed) gives them to the peers of its own region first
(``near``: the trainer's first copies start there, ``first_copies_near``),
then to those it uploads to fastest, which finishes them soonest. One more
slot, the optimistic unchoke, goes to a random other interested peer and
moves every ``optimistic_interval`` seconds, so newcomers with nothing to give get a start and faster partners
are found. Between decisions, a slot left free (fewer peers were interested)
goes to the first peer that asks (``admit``). Pure: ``decide(now, ...)``
returns the unchoked set.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

__all__ = ["ChokerPeer", "Choker"]


@dataclass(frozen=True)
class ChokerPeer:
    peer_id: str
    interested: bool
    rate_from: float = 0.0  # bytes/s we download from it
    rate_to: float = 0.0  # bytes/s we upload to it
    near: bool = False  # in this node's region: a seed's regular slots go to such peers first


@dataclass
class Choker:
    slots: int = 4
    optimistic_interval: float = 10.0
    rng: random.Random = field(default_factory=random.Random)
    _optimistic: str | None = None
    _optimistic_since: float = float("-inf")

    def admit(self, unchoked: set[str], peer_id: str, *, reserved: int = 0) -> bool:
        """Whether ``peer_id`` may download now: it is unchoked, or a slot is free (the last decision
        found fewer interested peers than slots), which it then takes (added to ``unchoked``). A
        peer that became interested since the last decision (this node just got a chunk it lacks)
        is served at once rather than at the next one: waiting a decision period per hop is what
        made small patches slow in swarms of more than ``slots`` peers. ``reserved`` free slots are
        kept for others (a seed's, for its own region's peers: a peer of another region that took
        one as a version began was given no first copy and kept the near peer that would have
        taken it waiting)."""
        if peer_id in unchoked:
            return True
        if len(unchoked) + reserved < self.slots:
            unchoked.add(peer_id)
            return True
        return False

    def near_room(self, unchoked: set[str], near_unchoked: int, near_wanting: int, *,
                  far: bool = True) -> tuple[int, int]:
        """For a seed that serves its own region first: how many of its region's peers it may serve
        now (``near_unchoked`` of ``unchoked``, and as many of the others of the ``near_wanting`` that
        want a chunk as free slots admit when they ask), and, facing a peer of another region
        (``far``), how many free slots ``admit`` keeps for them (``reserved``; none facing a near peer).
        The first is the same whoever asks: it decides whether first copies stay near
        (``superseed.first_copies_near``). Taken as 0 facing a near peer, as it was, near peers were
        told that first copies did not stay near and were given one chunk at a time where two near
        peers take them all (16 rollouts in 8 regions over links 25 times faster: the seed sent 4 MiB
        in 77 ms where its uplink takes 40, ``sparrowd bench sim``)."""
        waiting = max(0, near_wanting - near_unchoked)
        return near_unchoked + min(max(0, self.slots - len(unchoked)), waiting), waiting if far else 0

    def decide(self, now: float, peers: list[ChokerPeer], *, seed: bool) -> set[str]:
        interested = [p for p in peers if p.interested]
        if len(interested) <= self.slots:
            return {p.peer_id for p in interested}
        if seed:
            ranked = sorted(interested, key=lambda p: (not p.near, -p.rate_to, p.peer_id))
        else:
            ranked = sorted(interested, key=lambda p: (-p.rate_from, p.peer_id))
        regular = {p.peer_id for p in ranked[: self.slots - 1]}
        rest = [p.peer_id for p in ranked if p.peer_id not in regular]
        if self._optimistic not in rest or now - self._optimistic_since >= self.optimistic_interval:
            self._optimistic = self.rng.choice(rest)
            self._optimistic_since = now
        return regular | {self._optimistic}
