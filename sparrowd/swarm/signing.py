"""The trainer's signature on everything that defines a version.

Only the trainer holds the Ed25519 private key (``trainer.key`` in its data
dir, mode 0600, made on first start). Nodes receive the public key when they
join and pin it (``trainer.pub`` in their data dir): a tracker that later
presents another key is refused. A chunk is stored or served only if its
hash appears in a signed chunk announcement or a signed manifest, so holding
the swarm token is not enough to inject a version.

A signed statement is a msgpack map ``{kind, version, body, sig}``; the
signature covers a domain tag, the kind, the version and the body, so a
signature can never be replayed as another kind or for another version.
Kinds: ``announce`` (body: chunks added to a version while it is still being
extracted) and ``manifest`` (body: the codec's manifest bytes; the version is
complete when it arrives) for a patch; ``anchor-announce`` and
``anchor-manifest`` the same for an anchor, the full snapshot of a version
(so an anchor's chunk can never pass for a patch's, nor the reverse).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ..checkpoint import atomic_file
from ..errors import FormatError, IntegrityError
from ..schema import Bytes, NonNegInt, Str, fields, pack, unpack
from .identity import load_or_create_private_key

__all__ = ["Signer", "Verifier", "Signed", "ANNOUNCE", "MANIFEST", "ANCHOR_ANNOUNCE", "ANCHOR_MANIFEST",
           "announce_kind", "manifest_kind", "load_or_create_key", "pin_public_key"]

ANNOUNCE, MANIFEST = "announce", "manifest"
ANCHOR_ANNOUNCE, ANCHOR_MANIFEST = "anchor-announce", "anchor-manifest"
_KINDS = (ANNOUNCE, MANIFEST, ANCHOR_ANNOUNCE, ANCHOR_MANIFEST)
_DOMAIN = b"sparrowd-signed-v1\x00"
MAX_SIGNED = 64 << 20
_SIGNED = {"kind": Str, "version": NonNegInt, "body": Bytes, "sig": Bytes}


def announce_kind(anchor: bool) -> str:
    return ANCHOR_ANNOUNCE if anchor else ANNOUNCE


def manifest_kind(anchor: bool) -> str:
    return ANCHOR_MANIFEST if anchor else MANIFEST


def _message(kind: str, version: int, body: bytes) -> bytes:
    return _DOMAIN + pack([kind, version]) + body


@dataclass(frozen=True)
class Signed:
    kind: str
    version: int
    body: bytes
    sig: bytes

    @property
    def anchor(self) -> bool:
        return self.kind in (ANCHOR_ANNOUNCE, ANCHOR_MANIFEST)

    @property
    def is_manifest(self) -> bool:
        return self.kind in (MANIFEST, ANCHOR_MANIFEST)

    def to_bytes(self) -> bytes:
        return pack({"kind": self.kind, "version": self.version, "body": self.body, "sig": self.sig})

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, *, what: str = "signed statement") -> "Signed":
        m = fields(unpack(data, what=what, max_len=MAX_SIGNED), _SIGNED, what=what)
        if m["kind"] not in _KINDS:
            raise FormatError(f"{what}: unknown kind {m['kind']!r}")
        if len(m["sig"]) != 64:
            raise FormatError(f"{what}: signature must be 64 bytes")
        return cls(m["kind"], m["version"], m["body"], m["sig"])


class Signer:
    def __init__(self, key: Ed25519PrivateKey):
        self._key = key
        self.public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    def sign(self, kind: str, version: int, body: bytes) -> Signed:
        if kind not in _KINDS:
            raise ValueError(f"unknown kind {kind!r}")
        return Signed(kind, version, body, self._key.sign(_message(kind, version, body)))

    def sign_bytes(self, message: bytes) -> bytes:
        """A raw signature, for messages that carry their own domain tag (credentials)."""
        return self._key.sign(message)


class Verifier:
    def __init__(self, public: bytes):
        if len(public) != 32:
            raise FormatError("an Ed25519 public key is 32 bytes")
        self.public = bytes(public)
        self._key = Ed25519PublicKey.from_public_bytes(self.public)

    def verify(self, s: Signed) -> Signed:
        try:
            self._key.verify(s.sig, _message(s.kind, s.version, s.body))
        except InvalidSignature:
            raise IntegrityError(f"{s.kind} for version {s.version}: bad signature (not from the trainer)") from None
        return s


def load_or_create_key(path: Path) -> Signer:
    """The trainer's key: read it, or make one (0600) on first start."""
    return Signer(load_or_create_private_key(path, "trainer key"))


def pin_public_key(path: Path, offered: bytes) -> Verifier:
    """Trust on first use: keep the first trainer key seen; refuse any other later."""
    path = Path(path)
    if path.exists():
        pinned = bytes.fromhex(path.read_text().strip())
        if pinned != offered:
            raise IntegrityError(
                f"the tracker offers trainer key {offered.hex()[:16]}..., but {path} pins {pinned.hex()[:16]}...; "
                f"delete {path} only if the trainer's key was replaced on purpose")
        return Verifier(pinned)
    v = Verifier(offered)
    with atomic_file(path) as tmp:
        tmp.write_text(offered.hex() + "\n")
    return v
