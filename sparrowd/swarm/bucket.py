"""Token buckets for rate limits, with the clock passed in."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_BURST", "TokenBucket"]

DEFAULT_BURST = 0.1  # seconds of a limit's rate a bucket lets go at once (the daemons' --rate-burst)


@dataclass
class TokenBucket:
    """``rate`` bytes per second (0 or None: unlimited), bursts up to ``burst`` bytes
    (default: ``burst_seconds``' worth, at least 16 KiB)."""

    rate: float | None
    burst: float | None = None
    burst_seconds: float = DEFAULT_BURST
    _tokens: float = 0.0
    _last: float | None = None

    def take(self, now: float, n: float) -> float:
        """Spend ``n`` bytes; returns how long to wait before sending them (0 if at once)."""
        if not self.rate:
            return 0.0
        if self.burst is None:
            self.burst = max(16 << 10, self.rate * self.burst_seconds)
        if self._last is None:
            self._tokens, self._last = self.burst, now
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        self._tokens -= n
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate
