"""The driver that keeps ``DATA/current`` on the newest version this node can produce.

Thin asyncio around :mod:`sparrowd.current` (the folder's file work, run in a
worker thread) and ``chain.engine_plan`` (pure: what to load next from the
complete objects). The folder plans like an engine: from its own version, or
from nothing (-1) on a box that has no folder yet, which makes the swarm fetch
the newest anchor and the patches after it. Its version counts in the node's
floor, so retention keeps what it still needs, and the objects it is reading
are pinned meanwhile.

States (``status`` and ``top``): ``empty`` (no version yet), ``building``
(from an anchor, with progress), ``updating`` (a patch, in place),
``ready`` (a whole version engines can load), ``error`` (retried with
back-off; the last whole version stays in place).

``FolderKeeper`` gets the swarm driver, the data dir, the base settings and a
callback (``app`` wires them), never the daemon. Imports the pure core,
``current`` and the daemon's ``logs``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path

from ..codec.chunk import ULP2
from ..current import CurrentFolder, FolderBusy, HistoryMissing, LayoutChange, base_of
from ..errors import SparrowError
from ..swarm.chain import Key, engine_plan
from .logs import event

__all__ = ["FolderKeeper", "decoded_path", "drop_decoded"]

log = logging.getLogger("sparrowd.current")

BUSY_RETRY = 0.5  # an engine is loading from the folder
MAX_BACKOFF = 30.0


def decoded_path(data_dir, version: int):
    """Where the folder leaves a version it decoded for the engines (ulp2 patches)."""
    return data_dir / "decoded" / f"{version}.safetensors"


def drop_decoded(data_dir, keep: set[int]) -> None:
    """Decoded versions whose patch the node no longer holds go."""
    d = data_dir / "decoded"
    if not d.is_dir():
        return
    for p in d.iterdir():
        v = p.name.split(".")[0]
        if not (v.isdigit() and int(v) in keep and p.suffix == ".safetensors"):
            p.unlink(missing_ok=True)


class FolderKeeper:
    """Keeps ``data_dir/current`` on the newest version ``swarm`` holds whole; ``on_change`` tells the
    node that what renewals report changed (the folder's state and version)."""

    def __init__(self, swarm, data_dir: Path, *, base: Path | None = None, base_version: int | None = None,
                 on_change: Callable[[], None] = lambda: None):
        self.swarm = swarm
        self.data_dir = data_dir
        self.base_version = base_version
        self._on_change = on_change
        self.folder = CurrentFolder(data_dir)
        self.state = "empty"
        self.version: int | None = None
        self.progress: tuple[int, int] | None = None  # chunks (done, total) of what is being written
        self.error: str | None = None
        self.updates = 0
        self.last_update_seconds: float | None = None
        self._failures = 0
        self._need_anchor = False  # a patch changed the layout: only an anchor can move the folder on
        self._rebuild = False  # the folder lacks a patch's change history: rebuilt from the newest anchor
        # A local model folder holding a version the patches build on (--base, or the folder an engine
        # loaded): an empty current folder starts from it (``_adopt``).
        self.base: Path | None = base
        self._base_refused: tuple[Path, int] | None = None  # (source, patches held) a mismatch was found with
        # Until the folder is checked, plan from the version its commit record names.
        self.version = self.folder.version()
        self.swarm.current_floor = -1 if self.version is None else self.version

    def report(self) -> dict:
        return {"state": self.state, "version": self.version}

    def info(self) -> dict:
        """What ``/v1/node`` shows."""
        return {"state": self.state, "version": self.version, "path": str(self.folder.link),
                "progress": list(self.progress) if self.progress else None, "error": self.error,
                "updates": self.updates, "last_update_seconds": self.last_update_seconds}

    def _set(self, state: str, version: int | None = None) -> None:
        if version is not None or state == "empty":
            self.version = version
        self.state = state
        floor = -1 if self.version is None or self._need_anchor else self.version
        moved = floor > (self.swarm.current_floor if self.swarm.current_floor is not None else -1)
        self.swarm.current_floor = floor
        if moved:
            # What only the folder still held back goes now, not at the next version: a late box
            # that took older objects' statements while its folder was empty kept them until then.
            self.swarm.retire()
        self._on_change()

    async def run(self) -> None:
        # Leases (module sparrowd.current) signal a holder whose lease is broken with SIGIO, which
        # would end the process; the daemon has nothing to do on it (it releases when whole).
        signal.signal(signal.SIGIO, signal.SIG_IGN)
        self.folder.guard = True
        try:
            version = await asyncio.to_thread(self.folder.recover)
        except SparrowError as e:
            event(log, logging.ERROR, "current folder failed its check", reason=str(e))
            version = None
        self._set("ready" if version is not None else "empty", version)
        if version is not None:
            event(log, logging.INFO, "current folder checked", version=version, path=str(self.folder.link))
        while True:
            gen = self.swarm.gen
            wait = await self._step()
            await self.swarm.changed(gen, wait)

    def base_pending(self) -> bool:
        """A local base is set and not yet adopted nor refused: the versions it leads to are coming."""
        return self.version is None and self.base is not None and self._base_refused is None

    def offer_base(self, source: Path, by: str) -> None:
        """A local model folder an engine loaded (``by``): the base to start from, when none is set."""
        if self.base is None and source.is_dir():
            self.base = source
            event(log, logging.INFO, "base offered", path=str(source), by=by)
            self.swarm.wake()

    async def _adopt(self) -> bool:
        """Start the empty current folder from the local base, once the patches held tell which version
        it is (their base fingerprints, or ``--base-version``); a folder that is no base of theirs is
        refused with one line naming the first tensor that differs. True when adopted."""
        assert self.base is not None  # (adopted only where a base is set)
        patches = [vs.manifest for k, vs in self.swarm.versions.items() if not k.anchor and vs.manifest is not None]
        tried = (self.base, len(patches))
        if not patches or self._base_refused == tried:
            return False
        want = self.base_version
        self._set("building")
        try:
            version, how = await asyncio.to_thread(self.folder.adopt, self.base,
                                                   lambda fps: base_of(fps, patches, want))
        except (SparrowError, OSError) as e:
            self._base_refused = tried
            self.error = f"--base {self.base}: {e}"
            event(log, logging.ERROR, "base refused", path=str(self.base), reason=str(e))
            self._set("empty")
            return False
        self.error = None
        self._set("ready", version)
        event(log, logging.INFO, "base adopted", path=str(self.base), version=version, weights=how)
        return True

    def _reader(self, key: Key):
        store = self.swarm.store
        return lambda i: store.chunk_path(key, i).read_bytes()

    def _progress(self, done: int, total: int) -> None:
        self.progress = (done, total)

    async def _step(self) -> float:
        held = {k: vs.obj for k, vs in self.swarm.versions.items()}
        drop_decoded(self.data_dir, {k.version for k in held if not k.anchor})
        at = -1 if self.version is None else self.version
        anchor, patches = engine_plan(-1 if self._need_anchor else at, held)
        if self.version is None and self.base is not None and anchor is None and await self._adopt():
            return 0.0
        if self._need_anchor and (anchor is None or (anchor <= at and not self._rebuild)):
            return 5.0
        if anchor is None and not patches:
            return 5.0
        keys = ([Key(anchor, True)] if anchor is not None else []) + [Key(v) for v in patches]
        self.swarm.pinned.update(keys)
        try:
            for key in keys:
                vs = self.swarm.versions[key]
                t0 = time.perf_counter()
                self._set("building" if key.anchor else "updating")
                self.progress = (0, vs.total)
                if key.anchor:
                    v = await asyncio.to_thread(self.folder.build, vs.manifest, self._reader(key), self._progress)
                else:
                    # An ulp2 patch is coded against the base only this folder holds: engines get it decoded
                    # here, written before the folder moves past its base.
                    decoded = decoded_path(self.data_dir, key.version) if vs.manifest.values == ULP2 else None
                    if decoded is not None:
                        decoded.parent.mkdir(exist_ok=True)
                    v = await asyncio.to_thread(self.folder.apply, vs.manifest, self._reader(key), self._progress,
                                                decoded)
                    if decoded is not None:
                        await self.swarm.notify()
                self.progress = None
                self._need_anchor = self._rebuild = False
                self.updates += 1
                self.last_update_seconds = round(time.perf_counter() - t0, 3)
                self._set("ready", v)
                event(log, logging.INFO, "current folder moved", object=str(key), version=v,
                      seconds=self.last_update_seconds)
            self._failures, self.error = 0, None
            return 0.0
        except FolderBusy:
            self._set("ready" if self.version is not None else "empty")
            return BUSY_RETRY
        except (SparrowError, OSError) as e:
            self._failures += 1
            self._need_anchor = isinstance(e, (LayoutChange, HistoryMissing))
            self._rebuild = isinstance(e, HistoryMissing)
            reason = f"{e}; rebuilding from the newest anchor" if self._rebuild else \
                f"{e}; waiting for an anchor" if self._need_anchor else str(e)
            if reason != self.error:
                event(log, logging.ERROR, "cannot move the current folder", reason=reason)
            self.error = f"current folder: {reason}"
            self.progress = None
            # A folder that failed its check after an update was removed: it is rebuilt from an anchor.
            self.version = await asyncio.to_thread(self.folder.version)
            self._set("error" if self.version is None else "ready", self.version)
            return 0.0 if self._need_anchor else min(MAX_BACKOFF, 2.0 ** self._failures)
        finally:
            self.swarm.pinned.difference_update(keys)
