"""Whom a relay sends a chunk to unasked (push): a pure function of what it knows of its peers.

A pulled chunk costs each hop one and a half round trips before its blocks
move: the holder's have message, the request, the first block back. For a
patch of one or a few chunks that is most of the time to all (``sparrowd
bench sim``: one 256 KiB chunk to 16 nodes in 8 regions, 2.8x the bound).
So a relay that can serve a chunk (its first block checked out, or whole)
also sends it, unasked, to

* up to ``local`` peers of its own region that neither hold nor fetch it,
  ranked by a rendezvous hash of (version, chunk, pusher > peer), so that
  two relays of a region push to different neighbours; and
* up to ``cross`` other regions where it knows nobody who holds or fetches
  it: to the node that region's own designation names for the chunk (the
  rendezvous winner among its crossers, as ``Picker`` computes it there),
  so that the pushed copy is the region's one crossing, not an extra one.

Pushing across needs every node the other region designates among, or the
pusher names a node its region did not, and the chunk crosses twice (the
simulator, designating among the peers a pusher knew at 100 nodes: 3.2x
(R-1) x patch). ``heads`` holds only the regions a node knows whole (the
tracker tells each node how many rollouts each region has): in a swarm that
fits a peer list, all of them; in larger ones, the pushes stay local.

Pushes take only upload slots that requests leave idle (``idle``): a view
of what peers hold is a fraction of a round trip old, and on the real
daemons (8 nodes, 6 MiB in 14 chunks) pushes that queued with the requests
were declined more often than they were taken (the peer had meanwhile got or
asked for the chunk elsewhere) and held up the requests behind them: 1.3-1.5x
the bound against 1.1-1.2x pulling only. An idle uplink loses nothing to a
declined push. The receiver declines a push of a chunk it holds, fetches, or
cannot check (no signed block hashes yet) before reading a byte, and a push
starts with a single block, so a declined one costs the pusher's rate
limits little. (Pushing only while a relay knows at most two peers with the
chunk was tried: the simulator lost every gain, a one-chunk patch at 16
nodes back at 2.85x and 6 MiB at 1,000 nodes at 1.40x, since a tree across
8 regions needs pushes two levels deep.)
``sent`` counts the pushes this node already sent for the chunk, per kind,
so that calling again once the chunk is whole only tops them up.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from .picker import _score, designated

__all__ = ["DEFAULT_PUSH", "PushPeer", "parse_push", "push_heads", "push_targets"]

DEFAULT_PUSH = (2, 2)  # (local, cross) pushes a relay sends of each chunk (``--push``)


@dataclass(frozen=True)
class PushPeer:
    node_id: str
    region: str
    has: bool  # holds or fetches the chunk, or was pushed it, as far as this node knows (or is not to be pushed to)


def push_targets(tag: int | str, index: int, me: str, region: str, peers: Iterable[PushPeer],
                 heads: Mapping[str, Sequence[str]], *, local: int, cross: int,
                 sent: tuple[int, int] = (0, 0), idle: tuple[int, int] = (8, 8)) -> tuple[list[str], list[str]]:
    """The peers to push chunk ``index`` of version ``tag`` to now: (same region, other regions).
    ``peers`` are the rollout peers this node knows (not the trainer); ``heads`` each other region's
    crossers, for the regions this node knows whole (``push_heads``); ``idle`` the upload slots free
    in the (own region, other regions) lanes, nobody waiting: pushes only take what requests leave."""
    peers = list(peers)
    free_local = sorted((p.node_id for p in peers if p.region == region and not p.has),
                        key=lambda n: _score(tag, index, f"{me}>{n}"))
    near = free_local[:max(0, min(local - sent[0], idle[0]))]
    far: list[str] = []
    room = min(cross - sent[1], idle[1])
    if room <= 0:
        return near, far
    has = {p.node_id: p.has for p in peers}
    busy = {p.region for p in peers if p.has}
    for r in sorted(heads, key=lambda r: _score(tag, index, f"{me}>r{r}")):
        if len(far) >= room:
            break
        if r == region or r in busy:
            continue  # a peer there has it or is getting it: the region spreads it from there
        d = designated(tag, index, heads[r])
        if d is not None and d in has and not has[d]:
            far.append(d)
    return near, far


def push_heads(region: str, me: str, peers: Iterable[str], heads: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """The other regions' heads this node pushes across to (``heads``: region -> its heads, as the
    tracker names them, ``LeaseTable.all_heads``): all of them if ``me`` is a head of its region (every
    node knows every head, so a head's push is admitted), else those of the regions whose every head
    is among this node's rollout peers (``peers``, node ids; in a small swarm, every region)."""
    if me in heads.get(region, ()):
        return {r: sorted(hs) for r, hs in heads.items() if r != region and hs}
    known = set(peers)
    return {r: sorted(hs) for r, hs in heads.items() if r != region and hs and known.issuperset(hs)}


def parse_push(text: str) -> tuple[int, int]:
    """``LOCAL,CROSS`` (``--push 2,2``; ``off`` for 0,0) -> (local, cross), each 0 to 8."""
    if text.strip().lower() in ("off", "0", "none"):
        return 0, 0
    parts = text.split(",")
    try:
        local, cross = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"push takes LOCAL,CROSS (two counts, as in 2,2) or off, not {text!r}") from None
    if not (0 <= local <= 8 and 0 <= cross <= 8):
        raise ValueError(f"push counts must be 0 to 8, not {text!r}")
    return local, cross
