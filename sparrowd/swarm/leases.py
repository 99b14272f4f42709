"""The tracker's lease table: who is in the swarm, as a pure state machine.

A node joins and gets a lease: a time-to-live and an epoch. It renews well
before the lease runs out (about every third of the TTL), reporting what it
holds; it leaves when it shuts down; a lease that is not renewed expires and
the node drops out of every peer list. Epochs come from one counter that only
grows, persisted with the table, so every join, including a re-join after
expiry or after a restart of the node, starts a new life with a new epoch,
and a message from an old life (a renew or leave with an old epoch) is
refused with :class:`LeaseGone`.

Everything here takes ``now`` (wall-clock seconds, because leases outlive a
tracker restart) and returns decisions; nothing sleeps, awaits or touches a
socket. Persistence goes through an injected :class:`LeaseStore`, called
synchronously after each change (the daemon passes a SQLite one, tests pass
nothing or a SQLite one in a temporary folder).

On restore after a tracker restart every lease is extended to at least one
TTL from the restart: nodes could not renew while the tracker was down, and
dropping them for that would force every node to re-join after any restart
longer than a TTL. A node that died meanwhile is dropped one TTL later.
"""

from __future__ import annotations

import bisect
import hashlib
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from ..errors import InputError, SparrowError

__all__ = [
    "ROLES",
    "Node",
    "LeaseGone",
    "LeaseStore",
    "LeaseTable",
    "renew_interval",
    "SNAPSHOT_SCHEMA",
    "DEFAULT_TTL",
    "DEFAULT_PEER_LIMIT",
    "GATEWAYS",
    "head_score",
    "heads_tag",
    "MAX_VERSIONS_REPORTED",
    "check_name",
]

ROLES = ("trainer", "rollout", "relay")
DEFAULT_TTL = 15.0
DEFAULT_PEER_LIMIT = 32
GATEWAYS = 8  # nodes of a large region that share its cross-region fetches (LeaseTable.gateways)
MAX_VERSIONS_REPORTED = 1024
SNAPSHOT_SCHEMA = 1

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def check_name(kind: str, value: str) -> str:
    """Node ids and regions: 1-64 of letters, digits, ``.``, ``_``, ``-``."""
    if not isinstance(value, str) or not _NAME.match(value):
        raise InputError(f"{kind} {value!r} must be 1-64 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit")
    return value


def renew_interval(ttl: float) -> float:
    """Nodes renew about three times per TTL, so one lost renewal costs nothing."""
    return ttl / 3.0


class LeaseGone(SparrowError):
    """A renew or leave for a lease that expired, ended, or belongs to an older epoch."""


@dataclass(frozen=True, slots=True)
class Node:
    node_id: str
    role: str
    region: str
    address: str
    epoch: int
    joined_at: float
    renewed_at: float
    expires_at: float
    versions: tuple[int, ...] = ()
    engine_version: int | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    rate_up: float = 0.0
    rate_down: float = 0.0
    bytes_up_wan: int = 0
    bytes_down_wan: int = 0
    progress: tuple[int, int, int] | None = None  # version in flight: (version, chunks held, chunks known)
    current: dict[str, Any] | None = None  # its current-version folder: {"state", "version"} (None: kept off)
    error: str | None = None  # what keeps the node from working, as it reported it (a full disk, say)
    peers: int = 0  # peers in its swarm, as it reported


class LeaseStore(Protocol):
    def save(self, node: Node) -> None: ...  # a join: written now
    def save_later(self, node: Node) -> None: ...  # a renewal: the store may batch it
    def delete(self, node_id: str) -> None: ...
    def save_meta(self, key: str, value: int) -> None: ...
    def load(self) -> tuple[list[Node], dict[str, int]]: ...


@dataclass
class _Meta:
    next_epoch: int = 1
    latest_version: int | None = None


class LeaseTable:
    """Leases by node id. ``ttl`` in seconds; ``store`` persists every change."""

    def __init__(self, ttl: float = DEFAULT_TTL, *, now: float, store: LeaseStore | None = None):
        if not ttl > 0:
            raise InputError(f"lease TTL must be positive, not {ttl}")
        self.ttl = float(ttl)
        self._store = store
        self._nodes: dict[str, Node] = {}
        self._all = _Index()  # node ids, all and by region: peers() samples them
        self._regions: dict[str, _Index] = {}
        self._trainers = _Index()  # every peer list names them
        self._ranked: dict[str, list[tuple[bytes, str]]] = {}  # rollouts by region, by gateway score
        self._meta = _Meta()
        if store is not None:
            nodes, meta = store.load()
            self._meta.next_epoch = max(int(meta.get("next_epoch", 1)), 1 + max((n.epoch for n in nodes), default=0))
            self._meta.latest_version = meta.get("latest_version")
            for n in nodes:  # grace after a restart: see the module docstring
                self._index(replace(n, expires_at=max(n.expires_at, now + self.ttl)))
                store.save_later(self._nodes[n.node_id])

    # ------------------------------------------------------------ changes

    def join(self, node_id: str, role: str, region: str, address: str, now: float) -> Node:
        """A new lease with a new epoch; replaces any lease the node held before."""
        check_name("node id", node_id)
        check_name("region", region)
        if role not in ROLES:
            raise InputError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
        if not isinstance(address, str) or not 0 < len(address) <= 300:
            raise InputError("address must be a non-empty string of at most 300 characters")
        epoch = self._meta.next_epoch
        self._meta.next_epoch += 1
        self._save_meta("next_epoch", self._meta.next_epoch)
        node = Node(node_id, role, region, address, epoch, now, now, now + self.ttl)
        self._put(node)
        return node

    def renew(
        self,
        node_id: str,
        epoch: int,
        now: float,
        *,
        versions: list[int] | tuple[int, ...] | None = None,
        engine_version: int | None = None,
        bytes_up: int | None = None,
        bytes_down: int | None = None,
        bytes_up_wan: int | None = None,
        bytes_down_wan: int | None = None,
        progress: tuple[int, int, int] | None = None,
        error: str | None = None,
        peers: int | None = None,
        current: dict[str, Any] | None = None,
    ) -> Node:
        """Extend a live lease and record what the node reports; LeaseGone if it is not live."""
        node = self._live(node_id, epoch, now)
        dt = now - node.renewed_at
        changes: dict[str, Any] = {"renewed_at": now, "expires_at": now + self.ttl}
        if versions is not None:
            if len(versions) > MAX_VERSIONS_REPORTED:
                raise InputError(f"at most {MAX_VERSIONS_REPORTED} versions may be reported")
            changes["versions"] = tuple(sorted(set(int(v) for v in versions)))
        # What the node reports now: an engine that detached reads None again.
        changes["engine_version"] = int(engine_version) if engine_version is not None else None
        if bytes_up_wan is not None:
            changes["bytes_up_wan"] = int(bytes_up_wan)
        if bytes_down_wan is not None:
            changes["bytes_down_wan"] = int(bytes_down_wan)
        changes["progress"] = tuple(progress) if progress is not None else None
        changes["error"] = error[:300] if error else None
        changes["current"] = dict(current) if current is not None else None
        if peers is not None:
            changes["peers"] = int(peers)
        for key, value in (("up", bytes_up), ("down", bytes_down)):
            if value is None:
                continue
            before = getattr(node, f"bytes_{key}")
            changes[f"bytes_{key}"] = int(value)
            # Counters restart at 0 when the node's daemon restarts: then all of `value` is new.
            moved = int(value) - before if value >= before else int(value)
            changes[f"rate_{key}"] = moved / dt if dt > 0 else getattr(node, f"rate_{key}")
        node = replace(node, **changes)
        self._index(node)
        if self._store is not None:
            self._store.save_later(node)
        return node

    def leave(self, node_id: str, epoch: int, now: float) -> Node:
        """End a live lease now."""
        node = self._live(node_id, epoch, now)
        self._drop(node_id)
        return node

    def expire(self, now: float) -> list[Node]:
        """Drop every lease that ran out; returns the nodes dropped."""
        gone = [n for n in self._nodes.values() if n.expires_at <= now]
        for n in gone:
            self._drop(n.node_id)
        return gone

    def set_latest_version(self, version: int) -> None:
        if self._meta.latest_version is None or version > self._meta.latest_version:
            self._meta.latest_version = version
            self._save_meta("latest_version", version)

    # ------------------------------------------------------------ queries

    def __len__(self) -> int:
        """Leases held, expired ones not yet swept included."""
        return len(self._nodes)

    def get(self, node_id: str, now: float) -> Node | None:
        n = self._nodes.get(node_id)
        return n if n is not None and n.expires_at > now else None

    def rollouts(self, now: float) -> int:
        """Live leases other than the trainer's (rollouts, and relays, which a patch spreads through
        alike): the swarm's size, as the Publisher sizes chunks by it (``auto_chunk_size``)."""
        return sum(1 for n in self._nodes.values() if n.expires_at > now and n.role != "trainer")

    def live(self, now: float) -> list[Node]:
        return sorted((n for n in self._nodes.values() if n.expires_at > now), key=lambda n: (n.region, n.node_id))

    def peers(
        self, node_id: str, region: str, now: float, *, limit: int = DEFAULT_PEER_LIMIT,
        rng: random.Random | None = None
    ) -> list[Node]:
        """Live nodes other than ``node_id``, at most ``limit``: the trainer, then its region, then the
        others, with a quarter of the list kept for other regions.

        The trainer is on every list: it is where every chunk starts, and its super-seeding
        hands first copies to peers of every region. A quarter goes to other regions even when the
        node's region alone could fill the list, so that every region's nodes know holders
        outside it: with lists filled region-first, a region of more than ``limit`` nodes knew
        nobody outside it, and only the trainer's region ever received anything (found by
        ``sparrowd bench sim`` at 1,000 nodes in 8 regions).

        Each group is a uniform random sample (``rng``), so that nodes asking at the same time do
        not all pick the same few peers. It costs O(limit), not O(nodes): every renewal asks.
        """
        rng = rng or random.Random()
        limit = max(0, limit)

        def live(i: str) -> Node | None:
            n = self._nodes.get(i)
            return n if n is not None and i != node_id and n.expires_at > now else None

        def live_rollout(i: str) -> Node | None:
            return n if (n := live(i)) is not None and n.role != "trainer" else None

        trainers = [n for i in self._trainers.items if (n := live(i)) is not None][:limit]
        k = limit - len(trainers)
        region_ix = self._regions.get(region, _Index())
        far = min(k // 4, len(self._all.items) - len(region_ix.items))
        gateways = [n for n in self.gateways(region, now) if n.node_id != node_id][:k - far]
        named = {n.node_id for n in gateways}
        same = gateways + _sample(region_ix.items, k - far - len(gateways),
                                  lambda i: live_rollout(i) if i not in named else None, rng)
        other = _sample(self._all.items, k - len(same),
                        lambda i: n if (n := live_rollout(i)) is not None and n.region != region else None, rng)
        return trainers + same + other

    def heads(self, region: str, now: float) -> list[Node]:
        """The region's heads: its ``GATEWAYS`` live rollout nodes with the highest score (a hash of
        region and node id; all of them in a region of no more), the same for every asker. Other
        regions push chunks to them (``swarm.push``): every reply that carries a peer list names each
        region's heads (``all_heads``), so that a pusher designates among the nodes the region itself
        designates among (its gateways), and a head admits a push from another region's head."""
        out = []
        for _, i in reversed(self._ranked.get(region, ())):
            n = self._nodes.get(i)
            if n is not None and n.expires_at > now:
                out.append(n)
                if len(out) == GATEWAYS:
                    break
        return out

    def all_heads(self, now: float) -> dict[str, list[Node]]:
        """Every region's heads: O(regions x GATEWAYS)."""
        return {r: hs for r in self._ranked if (hs := self.heads(r, now))}

    def gateways(self, region: str, now: float) -> list[Node]:
        """The region's gateways when it has more than ``GATEWAYS`` rollout nodes, else none: its
        heads, named to every node of the region. They head every peer list of the region and share
        its cross-region fetches (``Picker``'s rendezvous designation among them), so that nodes that
        each see only a sample of a large region still agree on who brings each chunk in, and so that
        a chunk another region pushes across lands on the node the region designates for it; each
        node counting only the peers it knows, several nodes of a region would each fetch every chunk
        across (evidence: docs/history/DESIGN-NOTES.md#gateways)."""
        ranked = self._ranked.get(region)
        if ranked is None or len(ranked) <= GATEWAYS:
            return []
        return self.heads(region, now)

    @property
    def latest_version(self) -> int | None:
        return self._meta.latest_version

    def snapshot(self, now: float, *, tracker: dict[str, Any] | None = None) -> dict[str, Any]:
        """The status snapshot (``sparrowd status --json``, ``sparrowd top``); see docs/STATUS.md."""
        nodes = self.live(now)
        held = [v for n in nodes for v in n.versions]
        candidates = [v for v in [self._meta.latest_version, max(held, default=None)] if v is not None]
        return {
            "schema": SNAPSHOT_SCHEMA,
            "generated_at": now,
            "lease_ttl": self.ttl,
            "latest_version": max(candidates, default=None),
            "tracker": dict(tracker or {}),
            "nodes": [_node_view(n, now, self.ttl) for n in nodes],
        }

    # ------------------------------------------------------------ internals

    def _live(self, node_id: str, epoch: int, now: float) -> Node:
        node = self._nodes.get(node_id)
        if node is None:
            raise LeaseGone(f"node {node_id!r} holds no lease")
        if node.epoch != epoch:
            raise LeaseGone(f"node {node_id!r}: epoch {epoch} is stale (the lease now has epoch {node.epoch})")
        if node.expires_at <= now:
            self._drop(node_id)
            raise LeaseGone(f"node {node_id!r}: lease expired")
        return node

    def _index(self, node: Node) -> None:
        old = self._nodes.get(node.node_id)
        self._nodes[node.node_id] = node
        if old is not None and (old.region, old.role) == (node.region, node.role):
            return  # a renewal: the indexes hold it already
        if old is not None:
            self._regions[old.region].remove(node.node_id)
            self._unrank(old)
        self._all.add(node.node_id)
        self._regions.setdefault(node.region, _Index()).add(node.node_id)
        if node.role == "trainer":
            self._trainers.add(node.node_id)
        else:
            self._trainers.remove(node.node_id)
            bisect.insort(self._ranked.setdefault(node.region, []), (_gateway_score(node), node.node_id))

    def _unrank(self, node: Node) -> None:
        ranked = self._ranked.get(node.region, [])
        i = bisect.bisect_left(ranked, (_gateway_score(node), node.node_id))
        if i < len(ranked) and ranked[i][1] == node.node_id:
            del ranked[i]

    def _put(self, node: Node) -> None:
        self._index(node)
        if self._store is not None:
            self._store.save(node)

    def _drop(self, node_id: str) -> None:
        node = self._nodes.pop(node_id, None)
        if node is not None:
            self._all.remove(node_id)
            self._trainers.remove(node_id)
            self._unrank(node)
            self._regions[node.region].remove(node_id)
            if not self._regions[node.region].items:
                del self._regions[node.region]
        if self._store is not None:
            self._store.delete(node_id)

    def _save_meta(self, key: str, value: int) -> None:
        if self._store is not None:
            self._store.save_meta(key, value)


class _Index:
    """A set of node ids with O(1) add, remove and access by position (for sampling)."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self._pos: dict[str, int] = {}

    def add(self, x: str) -> None:
        if x not in self._pos:
            self._pos[x] = len(self.items)
            self.items.append(x)

    def remove(self, x: str) -> None:
        i = self._pos.pop(x, None)
        if i is None:
            return
        last = self.items.pop()
        if i < len(self.items):
            self.items[i], self._pos[last] = last, i


def heads_tag(heads: dict[str, list[Node]]) -> bytes:
    """A short digest of every region's heads: a renewal echoes the one it holds, and the reply
    leaves the heads out while it still holds (they change only when a head comes or goes)."""
    text = ";".join(f"{r}:{','.join(n.node_id for n in hs)}" for r, hs in sorted(heads.items()))
    return hashlib.blake2b(text.encode(), digest_size=8).digest()


def head_score(region: str, node_id: str) -> bytes:
    """A rollout's rank among its region's nodes for heads and gateways (the highest first)."""
    return hashlib.blake2b(f"{region}/{node_id}".encode(), digest_size=8).digest()


def _gateway_score(node: Node) -> bytes:
    return head_score(node.region, node.node_id)


def _sample(items: list[str], k: int, pick: Callable[[str], Node | None], rng: random.Random) -> list[Node]:
    """Up to ``k`` of ``items`` for which ``pick`` gives a node, uniformly at random, in random order:
    draws of a quarter more than ``k`` (O(k)) while most qualify, a pass over all when few do (a
    node's region is in the global list too, but it only asks that list when its region has fewer
    than ``k`` others)."""
    if k <= 0 or not items:
        return []
    if len(items) > 4 * k:  # draws with replacement (cheap), repeats dropped: a few at these sizes
        out = [n for i in dict.fromkeys(rng.choices(items, k=k + k // 4 + 4)) if (n := pick(i)) is not None]
        if len(out) >= k:
            return out[:k]
    pool = [n for i in items if (n := pick(i)) is not None]
    rng.shuffle(pool)
    return pool[:k]


def node_state(n: Node, now: float, ttl: float) -> str:
    """``joining`` until the first renewal, ``stale`` once a renewal is overdue, else ``up``."""
    if now - n.renewed_at > 1.5 * renew_interval(ttl):
        return "stale"
    if n.renewed_at == n.joined_at:
        return "joining"
    return "up"


def _node_view(n: Node, now: float, ttl: float) -> dict[str, Any]:
    return {
        "node_id": n.node_id,
        "role": n.role,
        "region": n.region,
        "address": n.address,
        "state": node_state(n, now, ttl),
        "epoch": n.epoch,
        "joined_at": n.joined_at,
        "lease_expires_in": round(max(0.0, n.expires_at - now), 3),
        "versions": list(n.versions),
        "engine_version": n.engine_version,
        "bytes_up": n.bytes_up,
        "bytes_down": n.bytes_down,
        "rate_up": round(n.rate_up, 1),
        "rate_down": round(n.rate_down, 1),
        "bytes_up_wan": n.bytes_up_wan,
        "bytes_down_wan": n.bytes_down_wan,
        "in_flight": None if n.progress is None else dict(zip(("version", "chunks_held", "chunks_known"), n.progress)),
        "current": n.current,
        "error": n.error,
        "peers": n.peers,
    }
