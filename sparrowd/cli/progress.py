"""A one-line progress display on stderr, shown only on a terminal."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, what: str, *, enabled: bool | None = None):
        self.total, self.what, self.done = total, what, 0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._last = 0.0
        self._t0 = time.monotonic()

    def step(self, label: str = "") -> None:
        self.at(self.done + 1, label)

    def at(self, done: int, label: str = "", total: int | None = None) -> None:
        self.done = done
        self.total = self.total if total is None else total
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or self.done == self.total):
            self._last = now
            sys.stderr.write(f"\r\x1b[K{self.what} {self.done}/{self.total} {label[:60]}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write(f"\r\x1b[K{self.what}: {self.done}/{self.total} in {time.monotonic() - self._t0:.1f} s\n")
