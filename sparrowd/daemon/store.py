"""Chunks and signed statements on disk, per object, surviving restarts.

Layout under the data dir (``anchors/<version>/`` the same for anchors)::

    versions/<version>/statements/<k>.sig    signed announcements and the manifest, in order
    versions/<version>/chunks/<index>.chunk  verified chunk bytes

Every file is written to a temporary name and renamed, and a chunk is
written only after its BLAKE3 hash matched a signed statement, so a file
that exists under its final name was verified. On start the store reads
every version back, re-checks each statement's signature and each chunk's
hash (a torn write from a crash or a flipped bit on disk is dropped and
fetched again), so a restarted node never fetches what it already holds.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import blake3

from ..checkpoint import atomic_file
from ..errors import IntegrityError, SparrowError
from ..swarm.chain import Key
from ..swarm.signing import Signed, Verifier
from ..swarm.versions import VersionState
from .logs import event

__all__ = ["ChunkStore"]

log = logging.getLogger("sparrowd.store")


def _write(path: Path, data) -> None:
    # A temporary name of its own per write: two fetches of one chunk (endgame) may store it at once,
    # and with a shared name one could rename the other's half-written file into place.
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


class ChunkStore:
    def __init__(self, root: Path, *, readonly: bool = False):
        """``readonly``: for reading another process's store (``sparrowd checkout``): nothing is
        created or dropped, and a chunk that fails its hash is merely not counted."""
        self.base = Path(root)
        self.root = self.base / "versions"
        self.readonly = readonly
        for anchor in (False, True):
            if not readonly:
                self._kind_dir(anchor).mkdir(parents=True, exist_ok=True)

    def _kind_dir(self, anchor: bool) -> Path:
        return self.base / ("anchors" if anchor else "versions")

    def _dir(self, key: Key) -> Path:
        return self._kind_dir(key.anchor) / str(key.version)

    def chunk_path(self, key: Key, index: int) -> Path:
        return self._dir(key) / "chunks" / f"{index}.chunk"

    def load(self, verifier: Verifier | None) -> dict[Key, VersionState]:
        out: dict[Key, VersionState] = {}
        for anchor in (False, True):
            if not self._kind_dir(anchor).is_dir():
                continue
            for d in sorted(self._kind_dir(anchor).iterdir(), key=lambda p: (len(p.name), p.name)):
                if d.name.isdigit():
                    vs = self._load_one(d, VersionState(int(d.name), anchor), verifier)
                    if vs is not None:
                        out[vs.key] = vs
        return out

    def _load_one(self, d: Path, vs: VersionState, verifier: Verifier | None) -> VersionState | None:
        sig_files = sorted((d / "statements").glob("*.sig"), key=lambda p: int(p.stem))
        if verifier is None and sig_files:
            event(log, logging.WARNING, "no trainer key pinned yet; kept on disk unread", object=str(vs.key))
            return None
        try:
            for f in sig_files:
                assert verifier is not None  # (statements without a verifier returned above)
                vs.add(Signed.from_bytes(f.read_bytes()), verifier)
        except (SparrowError, OSError) as e:
            event(log, logging.ERROR, "dropping a stored object that no longer verifies", object=str(vs.key),
                  reason=str(e))
            if not self.readonly:
                shutil.rmtree(d, ignore_errors=True)
            return None
        for i, ref in vs.chunks.items():
            p = self.chunk_path(vs.key, i)
            if not p.exists():
                continue
            if blake3.blake3(p.read_bytes()).digest() == ref.hash:
                vs.have.add(i)
            else:
                event(log, logging.WARNING, "stored chunk fails its hash; will fetch it again", object=str(vs.key),
                      index=i)
                if not self.readonly:
                    p.unlink(missing_ok=True)
        return vs

    def add_statement(self, vs: VersionState, s: Signed) -> None:
        d = self._dir(vs.key) / "statements"
        d.mkdir(parents=True, exist_ok=True)
        _write(d / f"{len(vs.statements) - 1}.sig", s.to_bytes())

    def put_chunk(self, vs: VersionState, index: int, data) -> None:
        """Store a chunk after checking it against its signed hash (IntegrityError if it differs).
        Runs in a worker thread, so it leaves ``vs.have`` to the caller, on the event loop."""
        ref = vs.chunks.get(index)
        if ref is None:
            raise IntegrityError(f"{vs.key}: chunk {index} is in no signed statement")
        if len(data) != ref.size or blake3.blake3(data).digest() != ref.hash:
            raise IntegrityError(f"{vs.key}: chunk {index} does not match its signed hash")
        d = self._dir(vs.key) / "chunks"
        d.mkdir(parents=True, exist_ok=True)
        _write(self.chunk_path(vs.key, index), data)

    def read_position(self, default: int) -> int:
        """The version this node can produce, as last recorded (``default`` when never)."""
        try:
            return int((self.base / "position").read_text().strip())
        except (OSError, ValueError):
            return default

    def write_position(self, version: int) -> None:
        _write(self.base / "position", f"{version}\n".encode())

    def drop(self, key: Key) -> None:
        shutil.rmtree(self._dir(key), ignore_errors=True)
