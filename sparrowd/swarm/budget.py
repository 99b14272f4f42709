"""What one peer may cost a node: CPU time and bytes per second.

Every exchange a node answers (and every exchange reply it reads) is charged
to the peer on the other side: the CPU time spent decoding and building it,
and its bytes. Each peer has two token buckets. A peer that overdraws either
is *choked* for ``CHOKE`` seconds (its exchanges are refused with 429, or not
sent); a peer choked ``STRIKES`` times within ``STRIKE_WINDOW`` seconds is
*banned* for ``BAN`` seconds. Honest peers spend a small fraction of these
budgets: an exchange costs well under a millisecond and a few hundred bytes
per version it describes.

Pure: every call takes ``now``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .bucket import TokenBucket

__all__ = ["PeerBudget", "Budgets", "CPU_RATE", "CPU_BURST", "BYTE_RATE", "BYTE_BURST", "CHOKE", "STRIKES",
           "STRIKE_WINDOW", "BAN"]

CPU_RATE, CPU_BURST = 0.25, 2.0  # seconds of CPU per second one peer may cost this node, and at once
BYTE_RATE, BYTE_BURST = 4 << 20, 16 << 20  # exchange bytes per second one peer may cost, and at once
CHOKE = 5.0  # seconds a peer over its budget is refused
STRIKES, STRIKE_WINDOW = 3, 60.0  # chokes within the window that ban a peer
BAN = 300.0  # seconds a banned peer is refused
MAX_PEERS = 8192  # budgets kept; the oldest are dropped past it


@dataclass
class PeerBudget:
    cpu: TokenBucket = field(default_factory=lambda: TokenBucket(CPU_RATE, burst=CPU_BURST))
    bytes: TokenBucket = field(default_factory=lambda: TokenBucket(BYTE_RATE, burst=BYTE_BURST))
    choked_until: float = float("-inf")
    banned_until: float = float("-inf")
    strikes: deque[float] = field(default_factory=deque)

    def spend(self, now: float, cpu: float, nbytes: int) -> str | None:
        """Charge one exchange; returns "choked" or "banned" when this one overdrew the budget."""
        over = (self.cpu.take(now, cpu) > 0) | (self.bytes.take(now, nbytes) > 0)
        if not over or now < self.choked_until:
            return None
        self.choked_until = now + CHOKE
        self.strikes.append(now)
        while self.strikes and now - self.strikes[0] > STRIKE_WINDOW:
            self.strikes.popleft()
        if len(self.strikes) >= STRIKES:
            self.banned_until = now + BAN
            self.strikes.clear()
            return "banned"
        return "choked"

    def refused(self, now: float) -> str | None:
        """Why this peer's exchanges are refused now ("banned", "choked"), or None."""
        if now < self.banned_until:
            return "banned"
        if now < self.choked_until:
            return "choked"
        return None


class Budgets:
    """Every peer's budget, by node id."""

    def __init__(self) -> None:
        self._by_peer: dict[str, PeerBudget] = {}

    def of(self, node_id: str) -> PeerBudget:
        b = self._by_peer.get(node_id)
        if b is None:
            if len(self._by_peer) >= MAX_PEERS:
                self._by_peer.pop(next(iter(self._by_peer)))
            b = self._by_peer[node_id] = PeerBudget()
        return b

    def refused(self, node_id: str, now: float) -> str | None:
        b = self._by_peer.get(node_id)
        return b.refused(now) if b is not None else None
