"""When a version has reached the swarm: pure, over the tracker's status snapshot.

An RL loop that must be on-policy waits until every rollout node holds (or its
engine has applied) version ``v`` before it samples, and should wait exactly as
long as the transfer, not a polling interval more. The tracker answers that
question as renewals arrive (``GET /v1/tracker/wait``, a long poll); this is
the decision it takes each time, tested without a socket.

Which nodes count: every live node except the trainer, or only those named;
with ``engines`` (always when ``applied``) only nodes with an engine attached.
A named node that is not live counts as missing. ``fraction`` relaxes "every"
to "at least that share" (rounded up) of the nodes that count.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["Arrival", "arrival"]


@dataclass(frozen=True)
class Arrival:
    done: bool
    version: int
    reached: list[str]  # the nodes that hold (or applied) the version
    missing: list[str]  # the nodes that count and do not yet
    needed: int  # how many must have it

    def to_json(self) -> dict[str, Any]:
        return {"done": self.done, "version": self.version, "reached": self.reached, "missing": self.missing,
                "needed": self.needed}


def arrival(nodes: Iterable[dict[str, Any]], version: int, *, applied: bool = False, engines: bool = False,
            names: Iterable[str] | None = None, fraction: float | None = None) -> Arrival:
    """``nodes``: the snapshot's node views (docs/STATUS.md)."""
    live = {n["node_id"]: n for n in nodes if n.get("state") != "stale" and n.get("role") != "trainer"}
    if names is not None:
        wanted = sorted(set(names))
    else:
        wanted = sorted(i for i, n in live.items() if not (applied or engines) or n.get("engine_version") is not None)

    def has(node_id: str) -> bool:
        n = live.get(node_id)
        if n is None:
            return False
        if applied:
            return n.get("engine_version") is not None and n["engine_version"] >= version
        return version in n.get("versions", ())

    reached = [i for i in wanted if has(i)]
    missing = [i for i in wanted if not has(i)]
    needed = len(wanted) if fraction is None else math.ceil(fraction * len(wanted) - 1e-9)
    return Arrival(len(reached) >= needed, version, reached, missing, needed)
