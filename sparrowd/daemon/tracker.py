"""The tracker service: the lease table behind checked messages.

Each method takes a decoded message (a dict from msgpack), checks it against
its schema, calls the pure :class:`LeaseTable` with the current time and
returns the reply as a dict. The HTTP handlers and the trainer's own
membership (which talks to its tracker in-process) both go through here, so
the same checks guard both paths.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

from ..errors import FormatError
from ..schema import Bool, Int, List, Map, NonNegInt, Opt, Str, fields
from ..swarm.leases import MAX_VERSIONS_REPORTED, LeaseGone, LeaseTable, Node, renew_interval
from .logs import event

__all__ = ["TrackerService", "JOIN", "RENEW", "LEAVE"]

log = logging.getLogger("sparrowd.tracker")

JOIN = {"node_id": Str, "role": Str, "region": Str, "address": Str}
RENEW = {
    "node_id": Str,
    "epoch": NonNegInt,
    "versions": Opt(List),
    "engine_version": Opt(Int),
    "bytes_up": Opt(NonNegInt),
    "bytes_down": Opt(NonNegInt),
    "bytes_up_wan": Opt(NonNegInt),
    "bytes_down_wan": Opt(NonNegInt),
    "progress": Opt(List),
    "error": Opt(Str),
    "peers": Opt(NonNegInt),
    "current": Opt(Map),
    "want_peers": Opt(Bool),  # false: leave the peer list out of the reply (absent: put it in)
}
FOLDER_STATES = ("empty", "building", "updating", "ready", "error")
LEAVE = {"node_id": Str, "epoch": NonNegInt}


def _peer(n: Node) -> dict:
    return {"node_id": n.node_id, "role": n.role, "region": n.region, "address": n.address}


class TrackerService:
    def __init__(
        self,
        table: LeaseTable,
        *,
        tracker_id: str,
        peer_limit: int,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
        trainer_key: bytes = b"",
    ):
        self.table, self.tracker_id, self.peer_limit = table, tracker_id, peer_limit
        self.trainer_key = trainer_key
        self.clock = clock
        self.rng = rng or random.Random()
        self.on_change: Callable[[], None] | None = None  # the table changed: waiters look again
        self._wires: dict[tuple[str, int], dict] = {}

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _wire(self, n: Node) -> dict:
        """A peer's entry in peer lists; it does not change within a lease (epoch), so it is built once."""
        key = (n.node_id, n.epoch)
        w = self._wires.get(key)
        if w is None:
            if len(self._wires) > 4 * len(self.table) + 1024:
                self._wires.clear()  # entries of leases long gone
            w = self._wires[key] = _peer(n)
        return w

    def _lease_reply(self, node: Node, now: float, *, peers: bool = True) -> dict:
        reply = {
            "node_id": node.node_id,
            "epoch": node.epoch,
            "lease_ttl": self.table.ttl,
            "renew_interval": renew_interval(self.table.ttl),
            "expires_in": node.expires_at - now,
            "tracker_id": self.tracker_id,
            "trainer_key": self.trainer_key,
            "latest_version": self.table.latest_version,
        }
        if peers:  # most of a reply's bytes and of a renewal's work in a large swarm
            listed = self.table.peers(node.node_id, node.region, now, limit=self.peer_limit, rng=self.rng)
            reply["peers"] = [self._wire(p) for p in listed]
        return reply

    def join(self, msg) -> dict:
        m = fields(msg, JOIN, what="join")
        now = self.clock()
        node = self.table.join(m["node_id"], m["role"], m["region"], m["address"], now)
        event(log, logging.INFO, "node joined", node_id=node.node_id, role=node.role, region=node.region,
              address=node.address, epoch=node.epoch)
        self._changed()
        return self._lease_reply(node, now)

    def renew(self, msg) -> dict:
        m = fields(msg, RENEW, what="renew")
        versions = m["versions"]
        if versions is not None and (
            len(versions) > MAX_VERSIONS_REPORTED
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in versions)
        ):
            raise FormatError(f"renew: field 'versions' must be at most {MAX_VERSIONS_REPORTED} integers >= 0")
        progress = m["progress"]
        if progress is not None and not (len(progress) == 3 and all(NonNegInt(x) for x in progress)):
            raise FormatError("renew: field 'progress' must be [version, chunks held, chunks known]")
        current = m.get("current")
        if current is not None:
            fields(current, {"state": Str, "version": Opt(NonNegInt)}, what="renew field 'current'")
            if current["state"] not in FOLDER_STATES:
                raise FormatError(f"renew: field 'current' state must be one of {', '.join(FOLDER_STATES)}")
            current = {"state": current["state"], "version": current["version"]}
        try:
            node = self.table.renew(
                m["node_id"], m["epoch"], self.clock(), versions=versions, engine_version=m["engine_version"],
                bytes_up=m["bytes_up"], bytes_down=m["bytes_down"], bytes_up_wan=m["bytes_up_wan"],
                bytes_down_wan=m["bytes_down_wan"], progress=progress, error=m["error"],
                peers=m.get("peers"), current=current,
            )
        except LeaseGone as e:
            event(log, logging.INFO, "renewal refused", node_id=m["node_id"], epoch=m["epoch"], reason=str(e))
            raise
        self._changed()
        return self._lease_reply(node, self.clock(), peers=m.get("want_peers") is not False)

    def leave(self, msg) -> dict:
        m = fields(msg, LEAVE, what="leave")
        node = self.table.leave(m["node_id"], m["epoch"], self.clock())
        event(log, logging.INFO, "node left", node_id=node.node_id, region=node.region, epoch=node.epoch)
        self._changed()
        return {}

    def sweep(self) -> list[Node]:
        gone = self.table.expire(self.clock())
        for n in gone:
            event(log, logging.WARNING, "lease expired", node_id=n.node_id, region=n.region, epoch=n.epoch)
        if gone:
            self._changed()
        return gone

    def status(self) -> dict:
        return self.table.snapshot(self.clock(), tracker={"node_id": self.tracker_id})
