"""What a node says about itself: the report its renewals carry to the tracker, the ``/v1/node`` body,
and why a version it holds cannot be made here (``unproducible``).

Read-only over the node's parts, named by the ``Node`` protocol (``app.Daemon`` is one). Imports the
pure core and the daemon's ``folder`` (where decoded versions lie); nothing here changes state.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..codec.chunk import ULP2
from ..swarm.chain import Unproducible
from ..swarm.chain import unproducible as chain_unproducible
from ..swarm.identity import NodeKey
from ..swarm.leases import MAX_VERSIONS_REPORTED
from .folder import decoded_path

if TYPE_CHECKING:
    from .engine import EngineServer
    from .folder import FolderKeeper
    from .follow import VllmFollower
    from .membership import Membership
    from .metrics import DaemonMetrics
    from .settings import Settings
    from .tracker import TrackerService

__all__ = ["Node", "unproducible", "renewal_report", "node_info"]


class SwarmView(Protocol):
    """What the reports read of a node's swarm (``daemon.swarm.Swarm``)."""

    @property
    def error(self) -> str | None: ...

    def held(self) -> list[int]: ...

    def held_at(self) -> dict[str, float]: ...

    def progress(self) -> tuple[int, int, int] | None: ...


class Node(Protocol):
    """The parts of a node its reports read; None where this node runs without one. Read-only
    (properties), so a node's own attributes, of the narrower types, match."""

    node_id: str
    address: str
    url: str
    key: NodeKey | None

    @property
    def settings(self) -> Settings: ...

    @property
    def metrics(self) -> DaemonMetrics: ...  # .bytes: (direction, "same" | "other") -> bytes moved

    @property
    def swarm(self) -> SwarmView | None: ...

    @property
    def tracker(self) -> TrackerService | None: ...

    @property
    def membership(self) -> Membership | None: ...

    @property
    def keeper(self) -> FolderKeeper | None: ...

    @property
    def engines(self) -> EngineServer | None: ...

    @property
    def follower(self) -> VllmFollower | None: ...

    def unproducible(self, target: int | None = None) -> Unproducible | None: ...


def unproducible(swarm, keeper, data_dir: Path, *, rollout: bool, target: int | None = None) -> Unproducible | None:
    """Why a version this rollout holds whole (``target``, else the newest) cannot be made here:
    an ``ulp2`` patch whose base no folder of this node holds or can reach. Never silent: renewals,
    ``/v1/node`` and the engine socket say it (``swarm.chain.unproducible``)."""
    if swarm is None or not rollout or (keeper is not None and keeper.base_pending()):
        return None
    held = {k: vs.obj for k, vs in swarm.versions.items()}
    based = {k.version for k, vs in swarm.versions.items()
             if not k.anchor and vs.manifest is not None and vs.manifest.values == ULP2}
    decoded = {v for v in based if decoded_path(data_dir, v).exists()}
    folder = keeper.version if keeper is not None else None
    return chain_unproducible(held, based, decoded, folder, keeps_folder=keeper is not None, target=target)


def versions_held(node: Node) -> list[int]:
    return node.swarm.held() if node.swarm else []


def renewal_report(node: Node) -> dict:
    """What each renewal tells the tracker about this node."""
    b, sw, f, k = node.metrics.bytes, node.swarm, node.follower, node.keeper
    return {
        "versions": versions_held(node)[-MAX_VERSIONS_REPORTED:],
        "engine_version": node.engines.floor() if node.engines else None,
        "bytes_up": b[("up", "same")] + b[("up", "other")],
        "bytes_down": b[("down", "same")] + b[("down", "other")],
        "bytes_up_wan": b[("up", "other")],
        "bytes_down_wan": b[("down", "other")],
        "progress": list(progress) if (progress := sw.progress() if sw else None) else None,
        "error": (sw.error if sw else None) or (f.error if f else None)
        or (k.error if k else None) or ((u := node.unproducible()) and u.reason),
        # The trainer peers with every member (its table); a node with the peers its lease listed.
        "peers": max(0, len(node.tracker.table) - 1) if node.tracker is not None else
        len(node.membership.state.peers) if node.membership else 0,
        "current": k.report() if k else None,
    }


def node_info(node: Node) -> dict:
    """The ``/v1/node`` body."""
    m, u, s = node.membership, node.unproducible(), node.settings
    return {
        "node_id": node.node_id, "role": s.role, "region": s.region,
        "address": node.address, "tracker": s.tracker or node.url, "pid": os.getpid(),
        "epoch": m.state.epoch if m else None, "lease_expires_in": m.lease_left() if m else None,
        "tracker_reachable": bool(m and m.state.tracker_reachable),
        "peers": [{**p, "key": p["key"].hex()} if isinstance(p.get("key"), bytes) else p
                  for p in (m.state.peers if m else [])],
        "key_id": node.key.id if node.key else None,
        "versions": versions_held(node), "held_at": node.swarm.held_at() if node.swarm else {},
        "error": (node.swarm.error if node.swarm else None) or (u and u.reason),
        "unproducible": u._asdict() if u else None,
        "current": node.keeper.info() if node.keeper else None,
    }
