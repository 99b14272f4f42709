"""Tracker messages as a member sends them: sealed with a node key, stamped with a clock that
only moves forward. Used by the tests that speak to a tracker without a daemon, and by the
hostile-member tests that speak to one as an attacker would."""

from __future__ import annotations

import time

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from sparrowd.swarm.identity import NodeKey, peer_headers, seal

_last = 0.0


def new_key() -> NodeKey:
    return NodeKey(Ed25519PrivateKey.generate())


def clock() -> float:
    global _last
    _last = max(time.time(), _last + 0.001)
    return _last


def join(key: NodeKey, node_id: str, *, role: str = "rollout", region: str = "eu", address: str = "127.0.0.1:1",
         ts: float | None = None) -> dict:
    return seal(key, "join", {"node_id": node_id, "role": role, "region": region, "address": address,
                              "key": key.public, "ts": clock() if ts is None else ts})


def renew(key: NodeKey, node_id: str, epoch: int, *, ts: float | None = None, **fields) -> dict:
    return seal(key, "renew", {"node_id": node_id, "epoch": epoch, "ts": clock() if ts is None else ts, **fields})


def leave(key: NodeKey, node_id: str, epoch: int, *, ts: float | None = None) -> dict:
    return seal(key, "leave", {"node_id": node_id, "epoch": epoch, "ts": clock() if ts is None else ts})


def peer(key: NodeKey, node_id: str, to: str, lease: dict) -> dict[str, str]:
    """The headers a member's request to peer ``to`` carries: its id, the ticket of ``lease`` (a join or
    renewal reply) and a proof for ``to``."""
    return peer_headers(key, node_id, to, lease["ticket"], lease["epoch"], time.time())
