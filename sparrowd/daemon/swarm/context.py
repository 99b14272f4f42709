"""What the swarm driver needs of its host, the daemon (``SwarmHost``), and nothing more: its node id
and key, the few settings it reads, the membership (the lease, the peer list, the heads), the tracker
where this node hosts one, the byte counters, the prompt report, the outgoing connections, and a
member's entry. The daemon (``app.Daemon``) matches it as it is; a test hands a ``SimpleNamespace``.

Every member is read-only here (a property), so the host's own attributes, of narrower types, match.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import aiohttp

from ...swarm.identity import CredentialBook, NodeKey
from ...swarm.leases import LeaseTable

__all__ = ["SwarmSettings", "LeaseView", "Members", "TrackerView", "SwarmHost"]


class SwarmSettings(Protocol):
    """The settings the swarm reads (``daemon.settings.Settings``)."""

    @property
    def region(self) -> str: ...

    @property
    def super_seed(self) -> bool: ...  # the trainer hands distinct chunks to distinct peers first

    @property
    def cut_through(self) -> bool: ...  # a relay serves the chunks it is fetching

    @property
    def push(self) -> tuple[int, int]: ...  # a relay pushes a chunk to (local, cross) peers

    @property
    def keeps_current(self) -> bool: ...  # the node keeps a current folder: it starts from an anchor


class LeaseView(Protocol):
    """What the swarm reads of this node's lease (``membership.LeaseState``)."""

    @property
    def epoch(self) -> int | None: ...

    @property
    def ticket(self) -> str | None: ...

    @property
    def peers(self) -> list[dict]: ...

    @property
    def gateways(self) -> list[str]: ...

    @property
    def heads(self) -> dict[str, list[dict]]: ...

    @property
    def revoked(self) -> frozenset[str]: ...


class Members(Protocol):
    """The membership, as the swarm uses it (``membership.Membership``): the lease and the peer list,
    and the tracker asked about a stranger or for a fresh list."""

    @property
    def state(self) -> LeaseView: ...

    @property
    def peers_changed(self) -> asyncio.Event: ...  # set when a renewal lists other peers

    def learn(self, entries: list) -> None: ...  # members the trainer told of (its exchange replies)

    def head(self, node_id: str) -> dict | None: ...  # a head's entry, of any region

    def ask(self, node_id: str) -> None: ...  # ask the tracker about a stranger

    def want_peers(self) -> None: ...  # the next renewal asks for a fresh peer list


class TrackerView(Protocol):
    """The tracker this node hosts (the trainer's), as the swarm uses it (``tracker.TrackerService``)."""

    @property
    def table(self) -> LeaseTable: ...

    @property
    def credentials(self) -> CredentialBook: ...

    def clock(self) -> float: ...

    def joined_since(self, epoch: int, now: float) -> tuple[int, list[dict]]: ...


class SwarmHost(Protocol):
    """What ``Swarm`` takes of the daemon. ``membership`` and ``tracker`` are read when used: the
    daemon makes them after the swarm (None until then, and ``tracker`` off the trainer)."""

    @property
    def node_id(self) -> str: ...

    @property
    def key(self) -> NodeKey | None: ...

    @property
    def settings(self) -> SwarmSettings: ...

    @property
    def membership(self) -> Members | None: ...

    @property
    def tracker(self) -> TrackerView | None: ...

    def count_bytes(self, direction: str, n: int, wan: bool) -> None: ...  # ("up" | "down", bytes, across)

    def report_changed(self) -> None: ...  # renew soon: what the tracker is told changed

    def outgoing(self) -> aiohttp.TCPConnector: ...  # the daemon's pool of outgoing connections

    def member(self, node_id: str) -> dict | None: ...  # a member's tracker entry, if known
