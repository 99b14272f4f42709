"""Follow mode's decision: when to move the co-located vLLM server to a newer version.

The daemon drives its own server through vLLM's RL routes (pause, update,
resume) as versions become ready, under a staleness policy: ``every = 0``
applies each version as soon as it is ready; ``every = T`` applies at most
once every T seconds, always to the newest ready version, so a server that
serves long requests pauses less often at the price of running up to T
seconds behind. Failures back off (1, 2, 4, 8, then 10 s) so a broken server
is not paused in a loop. Pure: ``decide`` takes ``now`` and returns what to do.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Decision", "decide", "retry_pause"]

IDLE = 5.0  # seconds between looks when nothing is to be done (a version arriving wakes the driver sooner)


@dataclass(frozen=True)
class Decision:
    target: int | None  # the version to move the server to now, or None
    wait: float  # seconds until deciding again, when there is no target


def retry_pause(failures: int) -> float:
    """Seconds to wait after ``failures`` failed attempts in a row (0: none)."""
    return 0.0 if failures <= 0 else min(10.0, 2.0 ** (failures - 1))


def decide(now: float, *, server: int | None, ready: int | None, every: float, last_update: float | None,
           failures: int = 0, failed_at: float | None = None) -> Decision:
    """``server``: the version the server's weights are (None: not attached); ``ready``: the
    newest version the node can move it to (the end of its planned chain), or None."""
    if server is None or ready is None or ready <= server:
        return Decision(None, IDLE)
    if failures and failed_at is not None:
        left = failed_at + retry_pause(failures) - now
        if left > 0:
            return Decision(None, left)
    if every > 0 and last_update is not None:
        left = last_update + every - now
        if left > 0:
            return Decision(None, left)
    return Decision(ready, 0.0)
