"""Writable bit views of a folder's shards, and the kernel leases that keep other readers whole
while a shard is written in place (package docstring: engines that have the folder open).

Imports ``codec`` and the package's ``ondisk``; nothing here knows versions or patches.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import shutil
import signal
from pathlib import Path

import numpy as np

from ..codec import dtype_info
from ..codec.bits import uint_type
from .ondisk import _fsync_dir, _Place

_F_SETLEASE = getattr(fcntl, "F_SETLEASE", 1024)


class _Shards:
    """Flat bit views of a folder's tensors, one mapping per shard file, opened lazily; writable
    unless ``writable`` is False.

    ``guard``: each shard is leased first; one that another process has open is copied and
    updated under a temporary name, renamed over the original by ``commit``. A shard that is a
    link to a file outside the folder (an adopted base, ``adopt``) is always so copied before
    its first write: the linked file is never written."""

    def __init__(self, folder: Path, places: dict[str, _Place], *, guard: bool, writable: bool = True):
        self.folder, self.places, self.guard, self.writable = folder, places, guard, writable
        self._open: dict[str, tuple[int, mmap.mmap, Path | None]] = {}  # file -> (fd, map, temporary copy)
        self.copied: list[str] = []

    def view(self, name: str) -> np.ndarray:
        p = self.places[name]
        if p.file not in self._open:
            self._open[p.file] = self._map(p.file)
        w = dtype_info(p.dtype).itemsize
        return np.frombuffer(self._open[p.file][1], dtype=uint_type(w), count=p.numel, offset=p.offset)

    def _map(self, file: str) -> tuple[int, mmap.mmap, Path | None]:
        path, tmp = self.folder / file, None
        if not self.writable:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            return fd, mmap.mmap(fd, 0, access=mmap.ACCESS_READ), None
        linked = path.is_symlink()
        fd = -1 if linked else os.open(path, os.O_RDWR | os.O_CLOEXEC)
        if linked or (self.guard and not _lease(fd)):
            if fd >= 0:
                os.close(fd)
            tmp = self.folder / f".{file}.{os.getpid()}.cow"
            shutil.copyfile(path, tmp)
            fd = os.open(tmp, os.O_RDWR | os.O_CLOEXEC)
            self.copied.append(file)
        return fd, mmap.mmap(fd, 0), tmp

    def commit(self) -> None:
        """Flush and fsync every mapping; move copies into place (the holders keep the old files)."""
        for file, (fd, mm, tmp) in self._open.items():
            mm.flush()
            os.fsync(fd)
            if tmp is not None:
                os.replace(tmp, self.folder / file)
        _fsync_dir(self.folder)

    def close(self) -> None:
        for fd, mm, tmp in self._open.values():
            try:
                mm.close()
            except BufferError:  # a view is still referenced; the mapping goes with it
                pass
            if self.guard and self.writable and tmp is None:
                _unlease(fd)
            os.close(fd)
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        self._open.clear()


def _leases_possible() -> bool:
    """A broken lease signals its holder with SIGIO, whose default is to end the process: leases are
    taken only where SIGIO is ignored or handled (the daemon ignores it)."""
    try:
        return signal.getsignal(signal.SIGIO) not in (signal.SIG_DFL, None)
    except ValueError:
        return False


def _lease(fd: int) -> bool:
    """Whether no other process has the file open or mapped (and none can open it until
    ``_unlease``); True as well where leases are not supported."""
    try:
        fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_WRLCK)
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EBUSY):
            return False
        return True  # a filesystem without leases: nothing to learn, update in place


def _unlease(fd: int) -> None:
    try:
        fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_UNLCK)
    except OSError:
        pass
