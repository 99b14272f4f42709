"""Super-seeding: the trainer hands distinct chunks to distinct peers before repeating any.

Instead of showing every peer every chunk (and uploading popular chunks many
times), the trainer shows each peer only the chunks it has assigned to it, a
few at a time. A new assignment is a chunk never given out before, so the
first copy of each chunk goes to a different peer (and, as peers of every
region ask, into every region), and the peers trade the rest among
themselves. A chunk is given out again only if no peer is known to hold it
and its peer left the swarm or was choked (``forget``), or its peer did not
even ask for it within ``claim_within`` seconds, or ``regive_after``
seconds after it was last given (its peer stalls mid-transfer).
Pure: ``offer(now, peer, holds, held_by)`` returns what to show that peer.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["SuperSeed"]


@dataclass
class SuperSeed:
    chunks: int
    per_peer: int = 2
    regive_after: float = 30.0
    claim_within: float = 3.0
    rng: random.Random = field(default_factory=random.Random)
    given_at: dict[int, float] = field(default_factory=dict)
    assigned: dict[str, set[int]] = field(default_factory=dict)
    claimed: set[int] = field(default_factory=set)

    def grow(self, chunks: int) -> None:
        """More chunks were announced (a version still being extracted)."""
        self.chunks = max(self.chunks, chunks)

    def claim(self, index: int) -> None:
        """Someone asked for chunk ``index``: its assignment is being used."""
        self.claimed.add(index)

    def forget(self, peer: str, *, unclaimed_only: bool = False) -> None:
        """``peer`` left (or was choked: ``unclaimed_only``, since a transfer it started goes on):
        what it was given and does not hold may be given to another at once."""
        keep = set()
        for c in self.assigned.pop(peer, ()):
            if unclaimed_only and c in self.claimed:
                keep.add(c)
            else:
                self.given_at[c] = float("-inf")
        if keep:
            self.assigned[peer] = keep

    def offer(self, now: float, peer: str, holds: set[int] | frozenset[int], held_by: Mapping[int, int]) -> set[int]:
        """Chunks to show ``peer``; ``held_by[c]``: how many peers are known to hold chunk ``c``."""
        pending = {c for c in self.assigned.get(peer, ()) if c not in holds}
        want = self.per_peer - len(pending)
        if want > 0:
            fresh = [c for c in range(self.chunks) if c not in self.given_at and c not in holds]
            lost = [c for c, t in self.given_at.items()
                    if c not in holds and c not in pending and not held_by.get(c)
                    and (now - t >= self.regive_after or (c not in self.claimed and now - t >= self.claim_within))]
            self.rng.shuffle(fresh)
            for c in (fresh + sorted(lost, key=self.given_at.get))[:want]:
                pending.add(c)
                self.given_at[c] = now
                self.claimed.discard(c)
        self.assigned[peer] = pending
        return set(pending)
