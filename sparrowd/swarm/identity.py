"""Who a member is: node keys, signed tracker messages, join credentials, peer proofs.

Every daemon holds an Ed25519 key of its own (``node.key`` in its data dir, 0600,
made on first start). Its default node id is derived from the public key
(:func:`default_node_id`), and the tracker binds a node id to the first key that
joins under it, for good: no other key can join, renew or leave under that id.

**Tracker messages** (join, renew, leave) travel sealed: a msgpack map
``{msg: bytes, sig: bytes}`` where ``msg`` is the message itself (msgpack) and
``sig`` the node key's signature over a domain tag, the operation and ``msg``.
A join carries the public key (``key``); renewals and leaves are checked
against the key bound to the lease. Every message carries ``ts``, the sender's
clock: it must lie within :data:`MAX_SKEW` of the tracker's and be later than
the last one accepted under that id, so a message seen on the wire cannot be
played again.

**Credentials** let the trainer admit one box at a time instead of handing out
the shared swarm token: ``spw1.<claims>.<signature>``, the claims (id, role,
region, node id, expiry) signed by the trainer's key, so any member that pinned
that key can check one. The first node key that joins with a credential owns it;
a credential can be revoked, and members learn the revoked ids from the tracker.

**Tickets** are the tracker's word on a lease, carried by the node itself: the
trainer's key signs (node id, role, region, node key, epoch, credential id,
expiry), and every lease reply carries a fresh one. A ticket lasts one lease
TTL and never past its credential's expiry, so a peer checks membership from a
request's headers alone, with no call to the tracker and before reading a byte
of its body.

**Peer proofs** bind a request to the key its ticket names: a header
``ms.signature`` over (from, to, ms, epoch), made for one receiver (a member that
receives a proof cannot pass it on to a third), for one lease, and good for
:data:`PROOF_TTL`. Peers never send a join secret to each other: the shared
token and credentials go to the tracker only.

**Sessions** make renewals cheap for the tracker: checking an Ed25519
signature costs about 190 µs here, a renewal comes every TTL/3 from every
node, and that halved what one tracker holds. A join (signed, as above)
carries a fresh X25519 key of the node (``kx``); the tracker answers with one
of its own, and both derive a 32-byte session secret (HKDF-SHA256 of the
X25519 secret, bound to the node id and the lease's epoch). Renewals are then
sealed ``{msg, mac}``: an HMAC-SHA256 under that secret (about 2 µs), with the
same clock and replay rules. The tracker keeps sessions in memory only; a
renewal under a session it does not know (it restarted) is answered with
:class:`SessionUnknown`, and the node sends that renewal again signed, with a
new ``kx``, which sets up a new session without ending the lease. Leaves stay
signed.

The rules are pure: they take ``now`` and return decisions or raise
:class:`Refused`. Only :meth:`NodeKey.load_or_create` touches a file.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..checkpoint import atomic_file
from ..errors import FormatError, SparrowError
from ..schema import Bytes, NonNegInt, Num, Opt, Str, fields, pack, unpack

__all__ = [
    "NodeKey",
    "Refused",
    "Credential",
    "Identities",
    "IdentityStore",
    "Binding",
    "CredentialBook",
    "CREDENTIAL_PREFIX",
    "is_credential_id",
    "MAX_SKEW",
    "PROOF_TTL",
    "key_id",
    "default_node_id",
    "load_or_create_private_key",
    "seal",
    "open_sealed",
    "SessionKey",
    "SessionUnknown",
    "seal_session",
    "open_session_sealed",
    "make_proof",
    "check_proof",
    "Ticket",
    "TICKET_HEADER",
    "PROOF_HEADER",
    "NODE_HEADER",
    "peer_headers",
    "parse_duration",
]

MAX_SKEW = 300.0  # seconds a message's clock may differ from the tracker's (the usual Kerberos window)
PROOF_TTL = 60.0  # seconds a peer proof is good for; a node makes a new one every PROOF_TTL / 2
CREDENTIAL_PREFIX = "spw1."
MAX_CREDENTIAL = 2048
_CREDENTIAL_ID_BYTES = 5  # a credential's id: this many random bytes, in lowercase hex
_TRACKER_DOMAIN = b"sparrowd-tracker-v1\x00"
_CREDENTIAL_DOMAIN = b"sparrowd-credential-v1\x00"
_PROOF_DOMAIN = b"sparrowd-peer-v1\x00"
_SESSION_DOMAIN = b"sparrowd-session-v1\x00"
_TICKET_DOMAIN = b"sparrowd-ticket-v1\x00"
TICKET_HEADER, PROOF_HEADER, NODE_HEADER = "X-Sparrowd-Ticket", "X-Sparrowd-Proof", "X-Sparrowd-Node"
MAX_TICKET = 1024  # characters of a ticket header; a longer one is refused unread


class Refused(SparrowError):
    """A message or credential that is well-formed but not allowed: logged, counted, answered 403.
    ``reason`` is a short metric label (impostor, replay, bad-signature, credential, ...)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


# ------------------------------------------------------------------ keys


def key_id(public: bytes) -> str:
    """A public key's short name: 16 base32 characters of its SHA-256 (80 bits)."""
    return base64.b32encode(hashlib.sha256(public).digest()[:10]).decode().lower()


def default_node_id(role: str, public: bytes) -> str:
    """The node id a daemon takes when none is set: its role and its key's id."""
    return f"{role}-{key_id(public)}"


def load_or_create_private_key(path: Path, what: str) -> Ed25519PrivateKey:
    """An Ed25519 key from a PEM file, or a new one written there (0600 from creation on)."""
    path = Path(path)
    if path.exists():
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (ValueError, TypeError, OSError) as e:
            raise SparrowError(f"{what} {path}: cannot be read ({e})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise SparrowError(f"{what} {path}: not an Ed25519 key")
        return key
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    with atomic_file(path, private=True) as tmp, open(tmp, "wb") as f:
        f.write(pem)
        f.flush()
        os.fsync(f.fileno())
    return key


def _public(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _verify(public: bytes, sig: bytes, message: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(sig, message)
    except (InvalidSignature, ValueError):
        return False
    return True


class NodeKey:
    """This daemon's own key (``node.key``)."""

    def __init__(self, key: Ed25519PrivateKey):
        self._key = key
        self.public = _public(key)
        self.id = key_id(self.public)

    @classmethod
    def load_or_create(cls, path: Path) -> "NodeKey":
        return cls(load_or_create_private_key(path, "node key"))

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)


# ------------------------------------------------------------------ tracker messages


def seal(key: NodeKey, op: str, msg: dict[str, Any]) -> dict[str, Any]:
    """A tracker message, signed: what the node sends (the tracker opens it with :func:`open_sealed`)."""
    body = pack(msg)
    return {"msg": body, "sig": key.sign(_TRACKER_DOMAIN + op.encode() + b"\x00" + body)}


def open_sealed(sealed: Any, op: str, *, max_len: int) -> tuple[dict[str, Any], bytes, bytes]:
    """The message inside a sealed one, its bytes and signature; the signature is checked by the
    caller, who knows which key must have made it (:meth:`Identities.check_signature`)."""
    return _open(sealed, op, max_len, "sig", 64)


def _open(sealed: Any, op: str, max_len: int, seal_field: str, size: int) -> tuple[dict[str, Any], bytes, bytes]:
    env = fields(sealed, {"msg": Bytes, seal_field: Bytes}, what=op)
    if len(env[seal_field]) != size:
        raise FormatError(f"{op}: {'signature' if seal_field == 'sig' else seal_field} must be {size} bytes")
    msg = unpack(env["msg"], what=op, max_len=max_len)
    if not isinstance(msg, dict):
        raise FormatError(f"{op}: the message must be a map")
    return msg, env["msg"], env[seal_field]


class SessionUnknown(SparrowError):
    """A renewal sealed under a session the tracker does not hold (it restarted, or the lease's
    epoch moved), or a signed one that does not name this tracker's ``boot``: the node renews
    again, signed, with a new exchange key and the ``boot`` given here."""

    def __init__(self, message: str, boot: bytes | None = None):
        super().__init__(message)
        self.boot = boot


class _Revoked(Protocol):
    """The revoked credential ids, as a check asks them (``id in revoked``): a set, a CredentialBook."""

    def __contains__(self, credential_id: str, /) -> bool: ...


class SessionKey:
    """One side's X25519 key for a session: ``public`` goes to the other side, :meth:`secret` derives
    the shared secret from the other side's public key."""

    def __init__(self) -> None:
        self._key = X25519PrivateKey.generate()
        self.public = self._key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    def secret(self, other: bytes, node_id: str, epoch: int) -> bytes:
        if not isinstance(other, bytes) or len(other) != 32:
            raise FormatError("a session key exchange must carry 32 bytes")
        shared = self._key.exchange(X25519PublicKey.from_public_bytes(other))
        info = _SESSION_DOMAIN + node_id.encode() + b"\x00" + str(int(epoch)).encode()
        return HKDF(hashes.SHA256(), 32, salt=None, info=info).derive(shared)


def _mac(secret: bytes, op: str, body: bytes) -> bytes:
    return hmac.new(secret, _TRACKER_DOMAIN + op.encode() + b"\x00" + body, hashlib.sha256).digest()


def seal_session(secret: bytes, op: str, msg: dict[str, Any]) -> dict[str, Any]:
    """A tracker message sealed with the session secret (:func:`open_session_sealed` opens it)."""
    body = pack(msg)
    return {"msg": body, "mac": _mac(secret, op, body)}


def open_session_sealed(sealed: Any, op: str, *, max_len: int) -> tuple[dict[str, Any], bytes, bytes]:
    """The message inside a session-sealed one, its bytes and MAC (checked by
    :meth:`Identities.check_mac`)."""
    return _open(sealed, op, max_len, "mac", 32)


def _signed_by(public: bytes, op: str, body: bytes, sig: bytes) -> bool:
    return _verify(public, sig, _TRACKER_DOMAIN + op.encode() + b"\x00" + body)


# ------------------------------------------------------------------ credentials


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


_CLAIMS = {"id": Str, "role": Str, "region": Opt(Str), "node": Opt(Str), "iat": Num, "exp": Opt(Num)}


@dataclass(frozen=True)
class Credential:
    """A join credential's claims. ``region``/``node``: None means any; ``expires``: None, never."""

    id: str
    role: str
    region: str | None
    node: str | None
    issued: float
    expires: float | None

    @classmethod
    def issue(cls, sign: Callable[[bytes], bytes], *, role: str, region: str | None, node: str | None, now: float,
              lifetime: float | None) -> tuple["Credential", str]:
        """A new credential and its text; ``sign`` is the trainer's signing function."""
        c = cls(secrets.token_hex(_CREDENTIAL_ID_BYTES), role, region, node, now,
                None if lifetime is None else now + lifetime)
        claims = pack({"id": c.id, "role": c.role, "region": c.region, "node": c.node, "iat": c.issued,
                       "exp": c.expires})
        return c, CREDENTIAL_PREFIX + _b64(claims) + "." + _b64(sign(_CREDENTIAL_DOMAIN + claims))

    @classmethod
    def parse(cls, text: str, trainer_key: bytes) -> "Credential":
        """The claims of a credential the trainer signed; FormatError or Refused otherwise."""
        if len(text) > MAX_CREDENTIAL or not text.startswith(CREDENTIAL_PREFIX) or text.count(".") != 2:
            raise FormatError("not a sparrowd credential (spw1.CLAIMS.SIGNATURE)")
        try:
            claims, sig = (_unb64(p) for p in text[len(CREDENTIAL_PREFIX):].split("."))
        except ValueError:
            raise FormatError("credential: not base64url") from None
        if len(sig) != 64 or not _verify(trainer_key, sig, _CREDENTIAL_DOMAIN + claims):
            raise Refused("bad-credential", "credential: not signed by this swarm's trainer")
        c = fields(unpack(claims, what="credential", max_len=MAX_CREDENTIAL), _CLAIMS, what="credential")
        return cls(c["id"], c["role"], c["region"], c["node"], float(c["iat"]),
                   None if c["exp"] is None else float(c["exp"]))

    def check(self, now: float, revoked: _Revoked) -> None:
        if self.id in revoked:
            raise Refused("revoked", f"credential {self.id} was revoked")
        if self.expires is not None and now >= self.expires:
            raise Refused("expired", f"credential {self.id} expired")

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "role": self.role, "region": self.region, "node": self.node,
                "issued": self.issued, "expires": self.expires}


def is_credential_id(text: str) -> bool:
    """Whether ``text`` has the form of the ids :meth:`Credential.issue` makes."""
    return len(text) == 2 * _CREDENTIAL_ID_BYTES and all(c in "0123456789abcdef" for c in text)


def parse_duration(text: str) -> float:
    """``30d``, ``12h``, ``45m``, ``90s``, ``2w`` or a number of seconds; ValueError for anything else."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
    t = text.strip().lower()
    scale = units.get(t[-1:], None)
    value = float(t[:-1] if scale else t)
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(text)
    return value * (scale or 1)


# ------------------------------------------------------------------ bindings


@dataclass(frozen=True, slots=True)
class Binding:
    """A node id's key, for good; the credential it joined with; the last message time accepted."""

    node_id: str
    key: bytes
    credential: str | None
    last_ts: float


class IdentityStore(Protocol):
    def save_binding(self, b: Binding) -> None: ...
    def load_bindings(self) -> list[Binding]: ...
    def forget_binding(self, node_id: str) -> None: ...
    def save_credential(self, record: dict[str, Any]) -> None: ...
    def load_credentials(self) -> list[dict[str, Any]]: ...


class CredentialBook:
    """The credentials the trainer issued (claims only: the text is never kept) and which are revoked."""

    def __init__(self, store: IdentityStore | None = None):
        self._store = store
        self._records: dict[str, dict[str, Any]] = {}
        if store is not None:
            for r in store.load_credentials():
                self._records[r["id"]] = r

    def add(self, c: Credential) -> dict[str, Any]:
        r = {**c.to_json(), "revoked_at": None}
        self._save(r)
        return r

    def revoke(self, credential_id: str, now: float) -> dict[str, Any]:
        r = self._records.get(credential_id)
        if r is None:
            raise Refused("unknown", f"no credential {credential_id!r} was issued by this trainer")
        if r["revoked_at"] is None:
            r = {**r, "revoked_at": now}
            self._save(r)
        return r

    def revoked(self, now: float) -> list[str]:
        """Revoked ids still worth telling members about (not yet expired anyway)."""
        return sorted(i for i, r in self._records.items()
                      if r["revoked_at"] is not None and (r["expires"] is None or r["expires"] > now))

    def expires(self, credential_id: str) -> float | None:
        """When an issued credential expires (None: never, or not issued here)."""
        r = self._records.get(credential_id)
        return r["expires"] if r is not None else None

    def __contains__(self, credential_id: str) -> bool:
        """Whether the credential is revoked (``Credential.check`` asks ``id in revoked``)."""
        r = self._records.get(credential_id)
        return r is not None and r["revoked_at"] is not None

    def records(self) -> list[dict[str, Any]]:
        return sorted(self._records.values(), key=lambda r: (r["issued"], r["id"]))

    def _save(self, r: dict[str, Any]) -> None:
        self._records[r["id"]] = r
        if self._store is not None:
            self._store.save_credential(r)


class Identities:
    """The tracker's bindings: node id -> key (first come, for good), credential -> key."""

    def __init__(self, store: IdentityStore | None = None):
        self._store = store
        self._by_id: dict[str, Binding] = {}
        self._by_credential: dict[str, str] = {}  # credential id -> node id
        self._last: dict[str, float] = {}  # last ts accepted per node id (renewals: not persisted)
        self._sessions: dict[str, tuple[int, bytes]] = {}  # node id -> (epoch, secret): in memory only
        if store is not None:
            for b in store.load_bindings():
                self._put(b)

    def _put(self, b: Binding) -> None:
        self._by_id[b.node_id] = b
        if b.credential:
            self._by_credential[b.credential] = b.node_id
        self._last[b.node_id] = max(self._last.get(b.node_id, 0.0), b.last_ts)

    def get(self, node_id: str) -> Binding | None:
        return self._by_id.get(node_id)

    def node_of(self, credential_id: str) -> str | None:
        return self._by_credential.get(credential_id)

    def check_join(self, node_id: str, role: str, region: str, key: bytes, ts: float, now: float,
                   credential: Credential | None) -> Binding:
        """Whether ``key`` may join as ``node_id`` now; the binding to keep (:meth:`bind`) or Refused."""
        self._check_time(node_id, ts, now)
        b = self._by_id.get(node_id)
        if b is not None and b.key != key:
            raise Refused("impostor", f"node id {node_id!r} belongs to another key ({key_id(b.key)}); "
                                      f"this join came with key {key_id(key)}")
        if credential is not None:
            if credential.role != role:
                raise Refused("role", f"credential {credential.id} is for role {credential.role}, not {role}")
            if credential.region is not None and credential.region != region:
                raise Refused("region", f"credential {credential.id} is for region {credential.region}, "
                                        f"not {region}")
            if credential.node is not None and credential.node != node_id:
                raise Refused("credential", f"credential {credential.id} is for node {credential.node}, "
                                            f"not {node_id}")
            owner = self._by_credential.get(credential.id)
            if owner is not None and owner != node_id:
                raise Refused("credential", f"credential {credential.id} is already in use by node {owner}")
            if b is not None and b.credential not in (None, credential.id):
                raise Refused("credential", f"node {node_id} joined with credential {b.credential}, "
                                            f"not {credential.id}")
        cred = credential.id if credential is not None else (b.credential if b is not None else None)
        return Binding(node_id, key, cred, ts)

    def bind(self, b: Binding) -> None:
        self._put(b)
        if self._store is not None:
            self._store.save_binding(b)

    def check_signature(self, node_id: str, key: bytes, op: str, body: bytes, sig: bytes, ts: float,
                        now: float) -> None:
        """A renewal or leave: signed by the lease's key, and not one seen before."""
        if not _signed_by(key, op, body, sig):
            raise Refused("bad-signature", f"{op} for node {node_id!r} is not signed by its key")
        self._check_time(node_id, ts, now)
        self._last[node_id] = ts

    def start_session(self, node_id: str, epoch: int, theirs: bytes) -> bytes:
        """A session for the node's lease from its exchange key (``kx``, carried by a signed join or
        renewal); returns the tracker's exchange key for the reply."""
        mine = SessionKey()
        self._sessions[node_id] = (int(epoch), mine.secret(theirs, node_id, epoch))
        return mine.public

    def check_mac(self, node_id: str, epoch: int, op: str, body: bytes, mac: bytes, ts: float, now: float) -> None:
        """A renewal sealed with the lease's session secret, and not one seen before."""
        s = self._sessions.get(node_id)
        if s is None or s[0] != epoch:
            raise SessionUnknown(f"no session for node {node_id!r} at epoch {epoch}: renew signed, with a new kx")
        if not hmac.compare_digest(mac, _mac(s[1], op, body)):
            raise Refused("bad-signature", f"{op} for node {node_id!r} is not sealed with its session secret")
        self._check_time(node_id, ts, now)
        self._last[node_id] = ts

    def end_session(self, node_id: str) -> None:
        self._sessions.pop(node_id, None)

    def check_join_signature(self, key: bytes, body: bytes, sig: bytes) -> None:
        if len(key) != 32 or not _signed_by(key, "join", body, sig):
            raise Refused("bad-signature", "join is not signed by the key it carries")

    def _check_time(self, node_id: str, ts: float, now: float) -> None:
        if abs(ts - now) > MAX_SKEW:
            raise Refused("clock", f"message time is {ts - now:+.0f} s off the tracker's clock "
                                   f"(at most {MAX_SKEW:.0f} s allowed): check NTP on the node")
        if ts <= self._last.get(node_id, float("-inf")):
            raise Refused("replay", f"a message for node {node_id!r} that is not newer than the last one "
                                    "(a replay, or the node's clock went back)")

    def forget(self, node_id: str) -> None:
        """An operator released the id (a box rebuilt with a new key)."""
        b = self._by_id.pop(node_id, None)
        self._last.pop(node_id, None)
        self._sessions.pop(node_id, None)
        if b is not None and b.credential:
            self._by_credential.pop(b.credential, None)
        if self._store is not None:
            self._store.forget_binding(node_id)

    def __len__(self) -> int:
        return len(self._by_id)


# ------------------------------------------------------------------ peer proofs


def make_proof(key: NodeKey, sender: str, receiver: str, now: float, epoch: int) -> str:
    """``ms.signature`` (``ms``: the time in milliseconds): the sender's key vouches that it is
    ``sender`` in its lease ``epoch``, to ``receiver`` only."""
    ts = str(int(now * 1000))
    sig = key.sign(_PROOF_DOMAIN + pack([sender, receiver, ts, int(epoch)]))
    return f"{ts}.{_b64(sig)}"


def check_proof(proof: str, public: bytes, sender: str, receiver: str, now: float, epoch: int) -> bool:
    """Whether ``proof`` is ``sender``'s, for lease ``epoch``, made for ``receiver``, within PROOF_TTL of ``now``."""
    ts, _, sig = proof.partition(".")
    try:
        t = int(ts) / 1000
        raw = _unb64(sig)
    except ValueError:
        return False
    if not abs(now - t) <= PROOF_TTL or len(raw) != 64:
        return False
    return _verify(public, raw, _PROOF_DOMAIN + pack([sender, receiver, ts, int(epoch)]))


def peer_headers(key: NodeKey, sender: str, receiver: str, ticket: str, epoch: int, now: float) -> dict[str, str]:
    """What a member's request to a peer carries to be admitted: its node id, its lease's ticket and a
    proof for ``receiver`` (and no join secret)."""
    return {NODE_HEADER: sender, TICKET_HEADER: ticket, PROOF_HEADER: make_proof(key, sender, receiver, now, epoch)}


# ------------------------------------------------------------------ tickets


_TICKET = {"node": Str, "role": Str, "region": Str, "key": Bytes, "epoch": NonNegInt, "cred": Opt(Str),
           "exp": Num}


@dataclass(frozen=True, slots=True)
class Ticket:
    """The tracker's word on a live lease, signed by the trainer's key (see the module's docstring)."""

    node_id: str
    role: str
    region: str
    key: bytes
    epoch: int
    credential: str | None
    expires: float

    def text(self, sign: Callable[[bytes], bytes]) -> str:
        """The header value: base64url(claims) "." base64url(signature); ``sign`` is the trainer's."""
        claims = pack({"node": self.node_id, "role": self.role, "region": self.region, "key": self.key,
                       "epoch": self.epoch, "cred": self.credential, "exp": self.expires})
        return _b64(claims) + "." + _b64(sign(_TICKET_DOMAIN + claims))

    @classmethod
    def parse(cls, text: str, trainer_key: bytes) -> "Ticket":
        """The claims of a ticket this swarm's trainer signed; FormatError or Refused otherwise."""
        if len(text) > MAX_TICKET or text.count(".") != 1:
            raise FormatError("not a sparrowd ticket (CLAIMS.SIGNATURE)")
        try:
            claims, sig = (_unb64(p) for p in text.split("."))
        except ValueError:
            raise FormatError("ticket: not base64url") from None
        if len(sig) != 64 or not _verify(trainer_key, sig, _TICKET_DOMAIN + claims):
            raise Refused("bad-ticket", "ticket: not signed by this swarm's trainer")
        c = fields(unpack(claims, what="ticket", max_len=MAX_TICKET), _TICKET, what="ticket")
        if len(c["key"]) != 32 or c["exp"] != c["exp"]:
            raise FormatError("ticket: bad key or expiry")
        return cls(c["node"], c["role"], c["region"], c["key"], c["epoch"], c["cred"], float(c["exp"]))

    def check(self, now: float, revoked: _Revoked) -> None:
        """Refused once the ticket has expired or its credential is revoked."""
        if now >= self.expires:
            raise Refused("expired", f"the ticket of node {self.node_id!r} expired (its lease was not renewed, "
                                     "or its credential expired)")
        if self.credential is not None and self.credential in revoked:
            raise Refused("revoked", f"node {self.node_id!r} joined with credential {self.credential}, "
                                     "which was revoked")
