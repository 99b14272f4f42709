"""The per-peer tables: ``PeerState`` (a peer as the fetching side knows it, from its exchange
replies) and ``Remote`` (a peer as the serving side knows it, from its requests).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ...swarm.chain import Key
from ...swarm.policy import SEED_PER_PEER, SEED_SINGLE_FROM
from ...swarm.rate import Rate
from ...swarm.superseed import SuperSeed

__all__ = ["PeerState", "Remote", "_view", "_superseed"]

@dataclass
class PeerState:
    node_id: str
    address: str
    region: str
    role: str
    have: dict[Key, set[int]] = field(default_factory=dict)
    fetching: dict[Key, set[int]] = field(default_factory=dict)
    choking: bool = False
    inflight: int = 0
    rate: Rate = field(default_factory=Rate)
    task: asyncio.Task | None = None
    gen: int = -1
    more: bool = False  # its last exchange reply left statements out (a page): ask again at once
    telling: bool = False  # a quick exchange with it (a have message) is under way
    tell_again: bool = False
    strikes: int = 0  # requests that timed out or failed in a row
    cooldown_until: float = 0.0  # no requests to it before then (a stalled or failing peer)
    quick: int = 0  # exchange replies in a row that came back early with nothing new
    stalled: bool = False  # designated to bring chunks across and did not: left out until it delivers
    held: int = 0  # chunks its have maps showed while partial, all versions (``count_on``)
    pushing: dict[Key, set[int]] = field(default_factory=dict)  # chunks it said it is pushing to this node...
    pushing_at: float = 0.0  # ...in the reply taken then (a claim kept for PUSH_CLAIM seconds at most)
    cut_through: bool = False  # it serves the chunks it is fetching too (its exchange replies say so)
    proof: tuple[float, int, str] = (0.0, -1, "")  # (made at, epoch, proof) for this peer: remade every PROOF_TTL / 2
    rtt: float | None = None  # the shortest exchange with it, seconds: the round trip (one answered at once;


@dataclass
class Remote:
    """A peer as seen from the serving side."""

    node_id: str
    region: str
    have: dict[Key, frozenset[int]] = field(default_factory=dict)
    last_seen: float = 0.0
    rate_to: Rate = field(default_factory=Rate)
    uploads: int = 0
    delay: float | None = None  # its one-way delay between regions, as it measured it (to the trainer)


def _view(ps: PeerState) -> tuple:
    """What an exchange reply can tell about a peer: a reply that changes none of it was empty."""
    return ({k: frozenset(v) for k, v in ps.have.items()}, {k: frozenset(v) for k, v in ps.fetching.items()},
            ps.choking)


def _superseed(chunks: int) -> SuperSeed:
    return SuperSeed(chunks, per_peer=SEED_PER_PEER, single_from=SEED_SINGLE_FROM)
