"""``DATA/current`` as a daemon keeps it: the symlink swung to a new folder when one is built or
adopted, the in-place update of the folder it points at, and the recovery after a start.

Imports ``codec``, ``errors`` and the package's other modules.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import blake3

from ..codec import Manifest
from ..codec.extract import fingerprint, fp_equal
from ..errors import FormatError, IntegrityError, SparrowError
from .build import adopt_folder, build_folder
from .journal import FolderDamaged, _replay, update_folder
from .ondisk import SHARD_BYTES, Progress, ReadChunk, _fsync_dir, _locked, _places, read_marker
from .shards import _leases_possible, _Shards


class CurrentFolder:
    """``DATA/current`` and its journal. One updater at a time: the daemon's driver, which runs
    these calls in a worker thread one after the other."""

    def __init__(self, data_dir: Path, *, shard_bytes: int = SHARD_BYTES):
        self.data_dir = Path(data_dir)
        self.link = self.data_dir / "current"
        self.folders = self.data_dir / "folders"
        self.journal = self.data_dir / "current.journal"
        self.shard_bytes = shard_bytes
        self.guard = _leases_possible()

    @property
    def folder(self) -> Path | None:
        """The folder ``current`` points at (None when there is none yet)."""
        try:
            target = os.readlink(self.link)
        except OSError:
            return None
        p = (self.data_dir / target).resolve() if not os.path.isabs(target) else Path(target)
        return p if p.is_dir() else None

    def version(self) -> int | None:
        folder = self.folder
        m = read_marker(folder) if folder is not None else None
        return m["version"] if m else None

    def recover(self, *, verify: bool = True) -> int | None:
        """After a start: finish a committed update (replay the journal), drop half-built folders
        and copies, and check every tensor against the fingerprints (``verify``). Returns the
        version the folder holds; a folder that fails its check is removed (None)."""
        self.folders.mkdir(parents=True, exist_ok=True)
        for p in self.folders.iterdir():
            if p.name.startswith("."):
                shutil.rmtree(p, ignore_errors=True)
        self.journal.with_name(f".{self.journal.name}.tmp").unlink(missing_ok=True)
        folder = self.folder
        if folder is None:
            self.journal.unlink(missing_ok=True)
            return None
        for p in folder.glob(".*.cow"):
            p.unlink()
        try:
            if self.journal.exists():
                _replay(folder, self.journal, guard=self.guard)
            if verify:
                self._verify(folder)
        except (IntegrityError, FormatError, OSError, ValueError, KeyError) as e:
            self._discard(folder)
            raise IntegrityError(f"{folder}: {e}; the folder is rebuilt from an anchor") from None
        return self.version()

    def _discard(self, folder: Path) -> None:
        self.journal.unlink(missing_ok=True)
        self.link.unlink(missing_ok=True)
        shutil.rmtree(folder, ignore_errors=True)

    @staticmethod
    def _verify(folder: Path) -> None:
        m = read_marker(folder)
        if m is None:
            raise IntegrityError("no sparrowd.json: not a whole version")
        places = _places(folder)
        if set(places) != set(m["tensors"]):
            raise IntegrityError("its tensors are not those sparrowd.json lists")
        shards = _Shards(folder, places, guard=False, writable=False)
        try:
            for name, fp in m["tensors"].items():
                if not fp_equal(fingerprint(shards.view(name)), bytes.fromhex(fp)):
                    raise IntegrityError(f"tensor {name!r} differs from its fingerprint (version {m['version']})")
        finally:
            shards.close()
        for name, h in m["files"].items():
            if blake3.blake3((folder / name).read_bytes()).hexdigest() != h:
                raise IntegrityError(f"file {name!r} differs from its hash")

    def build(self, anchor: Manifest, read: ReadChunk, progress: Progress | None = None) -> int:
        """Rebuild from an anchor beside the current folder, then swing ``current`` to it."""
        self._make(lambda tmp: build_folder(tmp, anchor, read, shard_bytes=self.shard_bytes, progress=progress))
        return anchor.version

    def adopt(self, source: Path, choose: Callable[[dict[str, bytes]], int]) -> tuple[int, str]:
        """Take a local model folder (Hugging Face layout, safetensors shards) or one safetensors
        file as the current folder, then swing ``current`` to it. ``choose`` names the version its
        tensors' fingerprints are (``base_of``) or raises; nothing is swung then. The weights are
        cloned where the filesystem can (a reflink: no bytes copied), else linked, and each linked
        shard is copied when it is first written (``_Shards``): the source is never written.
        Returns the version and how the weights came ("reflink" or "link")."""
        got: dict = {}

        def make(tmp: Path) -> None:
            got["version"], got["how"] = adopt_folder(tmp, Path(source), choose)

        self._make(make)
        return got["version"], got["how"]

    def _make(self, fill: Callable[[Path], None]) -> None:
        """A new version folder filled by ``fill`` beside the current one, then ``current`` swung to it."""
        self.folders.mkdir(parents=True, exist_ok=True)
        n = max((int(p.name) for p in self.folders.iterdir() if p.name.isdigit()), default=0) + 1
        tmp = self.folders / f".{n}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            fill(tmp)
            os.replace(tmp, self.folders / str(n))
            _fsync_dir(self.folders)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        old = self.folder
        # An engine loading from the old folder finishes first: its later opens would land in the new one.
        with _locked(old, shared=False, wait=True) if old is not None else nullcontext():
            link_tmp = self.data_dir / ".current.tmp"
            link_tmp.unlink(missing_ok=True)
            os.symlink(f"folders/{n}", link_tmp)
            os.replace(link_tmp, self.link)
            _fsync_dir(self.data_dir)
            self.journal.unlink(missing_ok=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def apply(self, patch: Manifest, read: ReadChunk, progress: Progress | None = None,
              decoded: Path | None = None) -> int:
        """Move the folder one version, in place (module docstring). FolderBusy while an engine is
        loading from it; LayoutChange for a patch that adds, removes or reshapes tensors.
        ``decoded``: also write the patch in the decoded layout there (before the folder moves)."""
        folder = self.folder
        if folder is None:
            raise SparrowError("no current folder to update")
        with _locked(folder, shared=False, wait=False):
            try:
                return update_folder(folder, patch, read, self.journal, guard=self.guard, progress=progress,
                                     decoded=decoded)
            except FolderDamaged as e:  # written, yet not the manifest's bits: start again from an anchor
                self._discard(folder)
                raise IntegrityError(f"{e}; the folder is removed and rebuilt from an anchor") from None
