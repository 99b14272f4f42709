"""Transfer rates from byte counts, with the clock passed in."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Rate"]


@dataclass
class Rate:
    """Exponentially weighted bytes per second; ``half_life`` seconds of memory."""

    half_life: float = 2.0
    _rate: float = 0.0
    _last: float | None = None
    total: int = 0

    def add(self, now: float, nbytes: int) -> None:
        self._decay(now)
        self.total += nbytes
        # Bytes spread over the half-life give the rate they would sustain.
        self._rate += nbytes * math.log(2) / self.half_life

    def rate(self, now: float) -> float:
        self._decay(now)
        return self._rate

    def _decay(self, now: float) -> None:
        if self._last is not None and now > self._last:
            self._rate *= 0.5 ** ((now - self._last) / self.half_life)
        if self._last is None or now > self._last:
            self._last = now
