"""The tracker service: the lease table behind checked messages.

Each method takes a sealed message (``swarm.identity.seal``: the message and
the node key's signature), checks the signature, the message's time and its
schema, asks the pure :class:`Identities` whether that key may speak for that
node id, calls the pure :class:`LeaseTable` with the current time and returns
the reply as a dict. A message that is well-formed but not allowed raises
:class:`Refused`, is logged and counted (``refused``). The HTTP handlers and the trainer's own
membership (which talks to its tracker in-process) both go through here, so
the same checks guard both paths.
"""

from __future__ import annotations

import heapq
import logging
import random
import secrets
import time
from collections import Counter, deque
from collections.abc import Callable

from ..errors import FormatError, InputError
from ..schema import Bool, Bytes, Int, List, Map, NonNegInt, Num, Opt, Str, fields
from ..swarm.identity import (
    Credential,
    CredentialBook,
    Identities,
    Refused,
    SessionUnknown,
    Ticket,
    open_sealed,
    open_session_sealed,
)
from ..swarm.leases import (
    MAX_VERSIONS_REPORTED,
    LeaseGone,
    LeaseTable,
    Node,
    check_name,
    heads_tag,
    renew_interval,
)
from .logs import event

__all__ = ["TrackerService", "JOIN", "RENEW", "LEAVE", "MAX_MESSAGE"]

log = logging.getLogger("sparrowd.tracker")

MAX_MESSAGE = 256 << 10
MAX_ASK = 64  # node ids one renewal may ask the tracker about (strangers that contacted the node)
MAX_REVOKED_LISTED = 10_000
TICKET_LIFE = 30.0  # seconds a lease's ticket is good for at least (one TTL where that is longer): a
# renewal late under load, or a tracker restarting, does not cut a member off from its peers. A credential's
# expiry ends its tickets (they never outlive it), and its revocation reaches every peer with its next renewal.
JOIN_NEWS = 64  # joins the tracker remembers to tell the swarm of (TrackerService.joined_since)
JOIN = {"node_id": Str, "role": Str, "region": Str, "address": Str, "key": Bytes, "ts": Num, "kx": Opt(Bytes)}
RENEW = {
    "node_id": Str,
    "epoch": NonNegInt,
    "ts": Num,
    "kx": Opt(Bytes),  # a signed renewal may set up a new session (identity.SessionKey)
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
    "ask": Opt(List),  # node ids the reply should say are members or not (``members``)
    "heads_seen": Opt(Bytes),  # the tag of the heads the node holds: the reply leaves them out while it holds
    "boot": Opt(Bytes),  # a signed renewal names the tracker process it is for (``TrackerService.boot``)
}
FOLDER_STATES = ("empty", "building", "updating", "ready", "error")
LEAVE = {"node_id": Str, "epoch": NonNegInt, "ts": Num, "boot": Opt(Bytes)}


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
        identities: Identities | None = None,
        credentials: CredentialBook | None = None,
        sign: Callable[[bytes], bytes] | None = None,
    ):
        self.table, self.tracker_id, self.peer_limit = table, tracker_id, peer_limit
        self.trainer_key = trainer_key
        self.identities = identities if identities is not None else Identities()
        self.credentials = credentials if credentials is not None else CredentialBook()
        self._sign = sign
        self.clock = clock
        self.rng = rng or random.Random()
        self.on_change: Callable[[], None] | None = None  # the table changed: waiters look again
        self.on_join: Callable[[], None] | None = None  # a node joined (``joined_since``)
        self._joins: deque[Node] = deque(maxlen=JOIN_NEWS)  # the latest joins, oldest first
        self._wires: dict[tuple[str, int], dict] = {}
        self._tickets: dict[str, tuple[int, float, str]] = {}  # node id -> (epoch, expires, ticket text)
        self.refused: Counter = Counter()  # (operation, reason): messages refused, for metrics
        # This tracker process: signed renewals and leaves name it, so one captured before a restart
        # is refused after it (the last time accepted per node is kept in memory only).
        self.boot = secrets.token_bytes(8)
        self.started = clock()
        self._credential_ends: list[tuple[float, str, int]] = []  # (expiry, node id, epoch): a heap
        for n in table.live(clock()):  # leases restored from disk keep their credential's end
            self._watch_credential(n)

    def _refuse(self, op: str, e: Refused, node_id: str, **fields_) -> None:
        self.refused[(op, e.reason)] += 1
        event(log, logging.WARNING, f"{op} refused", node_id=node_id[:64], reason=e.reason, detail=str(e),
              **fields_)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def entry(self, n: Node) -> dict:
        """A peer's entry in peer lists; it does not change within a lease (epoch), so it is built once."""
        key = (n.node_id, n.epoch)
        w = self._wires.get(key)
        if w is None:
            if len(self._wires) > 4 * len(self.table) + 1024:
                self._wires.clear()  # entries of leases long gone
            b = self.identities.get(n.node_id)
            w = self._wires[key] = {"node_id": n.node_id, "role": n.role, "region": n.region,
                                    "address": n.address, "key": b.key if b is not None else b"",
                                    "credential": b.credential if b is not None else None}
        return w

    def _lease_reply(self, node: Node, now: float, *, peers: bool = True, heads_seen: bytes | None = None) -> dict:
        reply = {
            "node_id": node.node_id,
            "epoch": node.epoch,
            "lease_ttl": self.table.ttl,
            "renew_interval": renew_interval(self.table.ttl),
            "expires_in": node.expires_at - now,
            "tracker_id": self.tracker_id,
            "trainer_key": self.trainer_key,
            "latest_version": self.table.latest_version,
            "revoked": self.credentials.revoked(now)[:MAX_REVOKED_LISTED],
            "boot": self.boot,
        }
        if (ticket := self._ticket(node, now)) is not None:
            reply["ticket"] = ticket
        if peers:  # most of a reply's bytes and of a renewal's work in a large swarm
            listed = self.table.peers(node.node_id, node.region, now, limit=self.peer_limit, rng=self.rng)
            reply["peers"] = [self.entry(p) for p in listed]
            if gateways := self.table.gateways(node.region, now):
                reply["gateways"] = [g.node_id for g in gateways]
            heads = self.table.all_heads(now)  # where other regions push chunks to (swarm.push)
            reply["heads_tag"] = tag = heads_tag(heads)
            if tag != heads_seen:
                reply["heads"] = {r: [self.entry(n) for n in hs] for r, hs in heads.items()}
        return reply

    def _ticket(self, node: Node, now: float) -> str | None:
        """The lease's ticket (``identity.Ticket``): good for ``TICKET_LIFE`` or one TTL, whichever is longer,
        never past its credential's expiry. A renewal gets the ticket it had until that is half spent:
        signing costs some 50 µs, and a renewal under a session otherwise costs a few."""
        b = self.identities.get(node.node_id)
        if self._sign is None or b is None:
            return None
        life = max(self.table.ttl, TICKET_LIFE)
        cached = self._tickets.get(node.node_id)
        if cached is not None and cached[0] == node.epoch and cached[1] - now > life / 2:
            return cached[2]
        expires = now + life
        if b.credential is not None and (end := self.credentials.expires(b.credential)) is not None:
            expires = min(expires, end)
        text = Ticket(node.node_id, node.role, node.region, b.key, node.epoch, b.credential, expires).text(self._sign)
        if len(self._tickets) > 4 * len(self.table) + 1024:
            self._tickets.clear()  # tickets of leases long gone
        self._tickets[node.node_id] = (node.epoch, expires, text)
        return text

    def _watch_credential(self, node: Node) -> None:
        """Remember when the credential a lease joined with expires: ``sweep`` ends the lease then."""
        b = self.identities.get(node.node_id)
        if b is not None and b.credential is not None and (end := self.credentials.expires(b.credential)) is not None:
            heapq.heappush(self._credential_ends, (end, node.node_id, node.epoch))

    def _check_bearer(self, op: str, node_id: str, credential: Credential | None, now: float) -> None:
        """A lease is bound to the credential it joined with: a renewal or leave presenting a credential
        presents that one; the lease ends once that credential is revoked or has expired."""
        b = self.identities.get(node_id)
        bound = b.credential if b is not None else None
        try:
            if credential is not None and credential.id != bound:
                raise Refused("credential", f"node {node_id!r} joined with "
                                            f"{'credential ' + bound if bound else 'the swarm token'}, "
                                            f"not credential {credential.id}")
            if bound is not None:
                if bound in self.credentials:
                    raise Refused("revoked", f"credential {bound} was revoked")
                end = self.credentials.expires(bound)
                if end is not None and now >= end:
                    raise Refused("expired", f"credential {bound} expired")
        except Refused as e:
            self._refuse(op, e, node_id)
            if e.reason != "credential" and (n := self.table.get(node_id, now)) is not None:
                self.table.leave(n.node_id, n.epoch, now)
                self.identities.end_session(n.node_id)
                self._changed()
            raise

    def join(self, sealed, *, credential: Credential | None = None) -> dict:
        """``credential``: what the request authenticated with, if not the shared swarm token."""
        msg, body, sig = open_sealed(sealed, "join", max_len=MAX_MESSAGE)
        m = fields(msg, JOIN, what="join")
        now = self.clock()
        try:
            self.identities.check_join_signature(m["key"], body, sig)
            check_name("node id", m["node_id"])
            if m["role"] == "trainer" and m["node_id"] != self.tracker_id:
                raise Refused("role", "only the tracker's own daemon is the trainer")
            if credential is not None:
                credential.check(now, self.credentials)
            binding = self.identities.check_join(m["node_id"], m["role"], m["region"], m["key"], float(m["ts"]),
                                                 now, credential)
        except Refused as e:
            self._refuse("join", e, m["node_id"], region=m["region"], address=m["address"][:100])
            raise
        node = self.table.join(m["node_id"], m["role"], m["region"], m["address"], now)
        self.identities.bind(binding)
        self._watch_credential(node)
        event(log, logging.INFO, "node joined", node_id=node.node_id, role=node.role, region=node.region,
              address=node.address, epoch=node.epoch, credential=binding.credential)
        self._changed()
        self._joins.append(node)
        if self.on_join is not None and len(self.table) <= self.peer_limit + 1:
            self.on_join()  # the trainer's long polls answer now, with the news (joined_since)
        reply = self._lease_reply(node, now)
        self._session(reply, node, m["kx"])
        return reply

    def joined_since(self, epoch: int, now: float) -> tuple[int, list[dict]]:
        """News of joins for a swarm that fits a peer list: (the latest join's epoch, the entries of the
        live nodes that joined with a later epoch than ``epoch``). The trainer's exchange replies carry
        it, so that every node knows a newcomer within a round trip, not at its next renewal (a swarm
        just formed, or a box added mid-run, relayed poorly until then). Nothing in a larger swarm,
        where a newcomer is on few lists anyway and is learned when it first asks."""
        latest = self._joins[-1].epoch if self._joins else 0
        if len(self.table) > self.peer_limit + 1 or epoch >= latest:
            return latest, []
        return latest, [self.entry(n) for n in self._joins
                        if n.epoch > epoch and (cur := self.table.get(n.node_id, now)) is not None
                        and cur.epoch == n.epoch]

    def _session(self, reply: dict, node: Node, kx: bytes | None) -> None:
        """A signed join or renewal that carries an exchange key sets up the lease's session: its
        renewals are then sealed with an HMAC instead of a signature (``identity.SessionKey``)."""
        if kx is None:
            return
        try:
            reply["kx"] = self.identities.start_session(node.node_id, node.epoch, kx)
        except (FormatError, ValueError) as e:
            raise FormatError(f"kx: {e}") from None

    def _check(self, op: str, body: bytes, sig: bytes, m: dict, now: float) -> None:
        """A renewal or leave: from the key bound to the node id, newer than the last one."""
        b = self.identities.get(m["node_id"])
        if b is None:  # no key bound: no lease was ever granted under this id (or it was released)
            raise LeaseGone(f"node {m['node_id']!r} holds no lease")
        try:
            self.identities.check_signature(m["node_id"], b.key, op, body, sig, float(m["ts"]), now)
        except Refused as e:
            self._refuse(op, e, m["node_id"])
            raise

    def _check_boot(self, m: dict) -> None:
        """A signed renewal or leave names this tracker process (its ``boot``, from every lease reply);
        one that names none must be newer than the process's start. A message captured before a
        restart names the old boot, and is refused."""
        boot = m.get("boot")
        if boot != self.boot and (boot is not None or float(m["ts"]) <= self.started):
            raise SessionUnknown("a signed message must name this tracker's boot (it restarted): sign again "
                                 "with the boot given", boot=self.boot)

    def _check_mac(self, body: bytes, mac: bytes, m: dict, now: float) -> None:
        try:
            self.identities.check_mac(m["node_id"], m["epoch"], "renew", body, mac, float(m["ts"]), now)
        except Refused as e:
            self._refuse("renew", e, m["node_id"])
            raise

    def renew(self, sealed, *, credential: Credential | None = None) -> dict:
        """A renewal, sealed with the lease's session (an HMAC) or signed (the first after a join
        without ``kx``, or after :class:`SessionUnknown`)."""
        session = isinstance(sealed, dict) and "mac" in sealed
        if session:
            msg, body, mac = open_session_sealed(sealed, "renew", max_len=MAX_MESSAGE)
        else:
            msg, body, sig = open_sealed(sealed, "renew", max_len=MAX_MESSAGE)
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
        ask = m["ask"]
        if ask is not None and (len(ask) > MAX_ASK or not all(isinstance(i, str) and len(i) <= 64 for i in ask)):
            raise FormatError(f"renew: field 'ask' must be at most {MAX_ASK} node ids")
        now = self.clock()
        if session:
            self._check_mac(body, mac, m, now)
        else:
            self._check("renew", body, sig, m, now)
            self._check_boot(m)
        self._check_bearer("renew", m["node_id"], credential, now)
        try:
            node = self.table.renew(
                m["node_id"], m["epoch"], now, versions=versions, engine_version=m["engine_version"],
                bytes_up=m["bytes_up"], bytes_down=m["bytes_down"], bytes_up_wan=m["bytes_up_wan"],
                bytes_down_wan=m["bytes_down_wan"], progress=progress, error=m["error"],
                peers=m.get("peers"), current=current,
            )
        except LeaseGone as e:
            event(log, logging.INFO, "renewal refused", node_id=m["node_id"], epoch=m["epoch"], reason=str(e))
            raise
        self._changed()
        reply = self._lease_reply(node, now, peers=m.get("want_peers") is not False, heads_seen=m.get("heads_seen"))
        if not session:
            self._session(reply, node, m["kx"])
        if ask:
            reply["members"] = [self.entry(n) for i in ask[:MAX_ASK] if (n := self.table.get(i, now)) is not None]
        return reply

    def leave(self, sealed, *, credential: Credential | None = None) -> dict:
        msg, body, sig = open_sealed(sealed, "leave", max_len=MAX_MESSAGE)
        m = fields(msg, LEAVE, what="leave")
        now = self.clock()
        self._check("leave", body, sig, m, now)
        self._check_boot(m)
        self._check_bearer("leave", m["node_id"], credential, now)
        node = self.table.leave(m["node_id"], m["epoch"], now)
        self.identities.end_session(node.node_id)
        event(log, logging.INFO, "node left", node_id=node.node_id, region=node.region, epoch=node.epoch)
        self._changed()
        return {}

    # ------------------------------------------------------------ credentials (the operator, on the trainer)

    def issue(self, *, role: str = "rollout", region: str | None = None, node: str | None = None,
              lifetime: float | None = None) -> tuple[dict, str]:
        """A new join credential: its record and its text (shown once, never kept)."""
        if self._sign is None:
            raise InputError("only the trainer's daemon issues credentials")
        if role not in ("rollout", "relay"):
            raise InputError(f"a credential's role is rollout or relay, not {role!r}")
        if region is not None:
            check_name("region", region)
        if node is not None:
            check_name("node id", node)
        c, text = Credential.issue(self._sign, role=role, region=region, node=node, now=self.clock(),
                                   lifetime=lifetime)
        record = self.credentials.add(c)
        event(log, logging.INFO, "credential issued", id=c.id, role=role, region=region, node=node,
              expires=c.expires)
        return record, text

    def revoke(self, credential_id: str) -> tuple[dict, Node | None]:
        """Revoke a credential; the lease of the node that joined with it ends now (returned)."""
        now = self.clock()
        record = self.credentials.revoke(credential_id, now)
        node_id = self.identities.node_of(credential_id)
        node = self.table.get(node_id, now) if node_id is not None else None
        if node is not None:
            self.table.leave(node.node_id, node.epoch, now)
            self.identities.end_session(node.node_id)
        event(log, logging.WARNING, "credential revoked", id=credential_id, node_id=node_id,
              lease_ended=node is not None)
        self._changed()
        return record, node

    def credential_list(self) -> list[dict]:
        now = self.clock()
        out = []
        for r in self.credentials.records():
            node_id = self.identities.node_of(r["id"])
            live = self.table.get(node_id, now) if node_id is not None else None
            out.append({**r, "node_id": node_id, "live": live is not None,
                        "expired": r["expires"] is not None and r["expires"] <= now})
        return out

    def sweep(self) -> list[Node]:
        """Leases that ran out, and leases whose credential expired: ended now; returns their nodes."""
        now = self.clock()
        gone = self.table.expire(now)
        for n in gone:
            self.identities.end_session(n.node_id)
            event(log, logging.WARNING, "lease expired", node_id=n.node_id, region=n.region, epoch=n.epoch)
        while self._credential_ends and self._credential_ends[0][0] <= now:
            _, node_id, epoch = heapq.heappop(self._credential_ends)
            node = self.table.get(node_id, now)
            if node is not None and node.epoch == epoch:
                self.table.leave(node_id, epoch, now)
                self.identities.end_session(node_id)
                gone.append(node)
                b = self.identities.get(node_id)
                event(log, logging.WARNING, "lease ended: its credential expired", node_id=node_id,
                      credential=b.credential if b else None, epoch=epoch)
        if gone:
            self._changed()
        return gone

    def status(self) -> dict:
        return self.table.snapshot(self.clock(), tracker={"node_id": self.tracker_id})
