"""Updating a folder in place through the redo journal: a patch decoded against the folder's bits
into the journal, which commits the version; the journal replayed into the shards; a crash
after the commit replayed at the next start (package docstring: steps 1 to 3).

Imports ``checkpoint``, ``codec``, ``decoded``, ``errors``, ``schema`` and the package's ``ondisk`` and
``shards``.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3
import numpy as np

from ..checkpoint import atomic_file
from ..codec import FULL, PATCH, Manifest, check_history, decode_chunk
from ..codec.bits import ulp_apply
from ..codec.chunk import DENSE, decode_file_chunk, is_ulp
from ..codec.extract import fingerprint, fp_equal
from ..codec.history import History
from ..codec.patch import check_segments
from ..codec.workers import cpu_threads
from ..decoded import decoded_from, write_decoded
from ..errors import BaseMismatchError, IntegrityError, SparrowError
from ..schema import pack, unpack
from .ondisk import (
    HistoryMissing,
    LayoutChange,
    Progress,
    ReadChunk,
    _drop_histories,
    _fsync_dir,
    _Place,
    _places,
    _write_history,
    _write_marker,
    read_history,
    read_marker,
)
from .shards import _Shards

_JOURNAL_MAGIC, _JOURNAL_END = b"SPJ1", b"END!"


class _Journal:
    """Records of (tensor, positions, new bits); the file counts only once its trailer (BLAKE3 of
    everything before it) is written and it is renamed to its final name."""

    def __init__(self, path: Path, header: dict):
        self.path = path
        self._tmp = path.with_name(f".{path.name}.tmp")
        self._f = open(self._tmp, "wb")
        self._h = blake3.blake3()
        head = pack(header)
        self._put(_JOURNAL_MAGIC + struct.pack("<I", len(head)) + head)

    def _put(self, data) -> None:
        self._f.write(data)
        self._h.update(data)

    def add(self, kind: str, name: str, start: int, stop: int, indices: np.ndarray | None, values) -> None:
        values = np.ascontiguousarray(values).data.cast("B") if kind != "file" else memoryview(values)
        idx = np.ascontiguousarray(indices, dtype="<i8").data.cast("B") if indices is not None else b""
        head = pack({"kind": kind, "name": name, "start": start, "stop": stop,
                     "indices": len(idx), "values": len(values)})
        self._put(struct.pack("<I", len(head)) + head)
        self._put(idx)
        self._put(values)

    def commit(self) -> None:
        self._f.write(_JOURNAL_END + self._h.digest())
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self._tmp, self.path)
        _fsync_dir(self.path.parent)

    def abandon(self) -> None:
        self._f.close()
        self._tmp.unlink(missing_ok=True)


def _read_journal(path: Path) -> tuple[dict, Iterator[tuple[str, str, int, int, np.ndarray | None, bytes]]]:
    """The journal's header and its records (after checking the trailer)."""
    data: bytes | mmap.mmap = b""
    if path.stat().st_size:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
    if len(data) < 44 or data[:4] != _JOURNAL_MAGIC or data[-36:-32] != _JOURNAL_END \
            or blake3.blake3(memoryview(data)[:-36]).digest() != data[-32:]:
        raise IntegrityError(f"{path}: not a whole journal")
    (hl,) = struct.unpack_from("<I", data, 4)
    header = unpack(data[8:8 + hl], what="journal header")

    def records():
        pos, end = 8 + hl, len(data) - 36
        while pos < end:
            (rl,) = struct.unpack_from("<I", data, pos)
            r = unpack(data[pos + 4:pos + 4 + rl], what="journal record")
            pos += 4 + rl
            idx = np.frombuffer(data, "<i8", r["indices"] // 8, pos) if r["indices"] else None
            pos += r["indices"]
            yield r["kind"], r["name"], r["start"], r["stop"], idx, memoryview(data)[pos:pos + r["values"]]
            pos += r["values"]

    return header, records()


def _journal_patch(journal: _Journal, folder: Path, places: dict[str, _Place], patch: Manifest, read: ReadChunk,
                   progress: Progress | None, decoded: Path | None = None,
                   history: History | None = None) -> dict[str, list]:
    """Decode the patch against the folder's bits (and ``history``, the change history it names):
    each changed element's new bits, journaled. ``decoded``: also write the patch there in the
    decoded layout (sparrowd.decoded), for engines that cannot decode it themselves (an ulp2 patch
    is coded against the base this folder holds). Returns an ulp2 patch's decoded segments by
    tensor (what the next history is made of)."""
    reader = _Shards(folder, places, guard=False, writable=False)  # reads only
    parts: dict[str, list] = {}
    keep = decoded is not None or patch.values == "ulp2"
    try:
        for i, entry in enumerate(patch.chunks):
            data = read(i)
            if entry.file is not None:
                (name, start, stop), body = decode_file_chunk(data, expect_hash=entry.hash)
                journal.add("file", name, start, stop, None, body)
            else:
                segments = decode_chunk(data, expect_hash=entry.hash, base=reader.view, history=history)
                check_segments(patch, entry, segments)
                if keep:
                    for s in segments:
                        parts.setdefault(s.name, []).append(s)
                for s in segments:
                    if s.kind == DENSE:
                        journal.add("dense", s.name, s.start, s.stop, None, s.data)
                    elif is_ulp(s.values):
                        journal.add("sparse", s.name, s.start, s.stop, s.indices,
                                    ulp_apply(reader.view(s.name)[s.indices], s.data))
                    else:
                        journal.add("sparse", s.name, s.start, s.stop, s.indices, s.data)
            if progress is not None:
                progress(i + 1, len(patch.chunks))
        if decoded is not None:
            with atomic_file(decoded) as tmp:
                write_decoded(decoded_from(patch, parts), tmp)
    finally:
        reader.close()
    return parts


def _replay(folder: Path, journal: Path, *, guard: bool) -> int:
    """Write the journal's records into the folder, check the touched tensors, move the marker.
    Returns the version reached."""
    header, records = _read_journal(journal)
    marker = read_marker(folder)
    if marker is None or marker["version"] not in (header["base"], header["version"]):
        raise IntegrityError(f"{journal}: takes version {header['base']} to {header['version']}, "
                             f"but the folder is at {marker and marker['version']}")
    places = _places(folder)
    shards = _Shards(folder, places, guard=guard)
    files: dict[str, bytearray] = {}
    try:
        for kind, name, start, stop, idx, values in records:
            if kind == "file":
                buf = files.setdefault(name, bytearray())
                buf[start:stop] = values
                continue
            view = shards.view(name)
            vals = np.frombuffer(values, dtype=view.dtype)
            if idx is None:
                view[start:stop] = vals
            else:
                view[idx] = vals
        fps = {n: bytes.fromhex(h) for n, h in marker["tensors"].items()}
        for name, fp in header["tensors"].items():
            if not fp_equal(fingerprint(shards.view(name)), fp):
                raise IntegrityError(f"version {header['version']}: tensor {name!r} differs from the manifest's "
                                     f"fingerprint after the update")
            fps[name] = fp
        shards.commit()
        for name, buf in files.items():
            if blake3.blake3(buf).digest().hex() != header["files"].get(name):
                raise IntegrityError(f"version {header['version']}: file {name!r} differs from its hash")
            with atomic_file(folder / name) as tmp, open(tmp, "wb") as f:
                f.write(buf)
                f.flush()
                os.fsync(f.fileno())
        names = dict(marker["files"])
        names.update({n: header["files"][n] for n in files})
        _write_marker(folder, header["version"], fps, names)
    finally:
        shards.close()
    journal.unlink()
    _fsync_dir(journal.parent)
    return header["version"]


class FolderDamaged(IntegrityError):
    """An update was written but the result is not the manifest's."""


def update_folder(folder: Path, patch: Manifest, read: ReadChunk, journal_path: Path, *, guard: bool = False,
                  progress: Progress | None = None, decoded: Path | None = None) -> int:
    """Journal ``patch`` against the folder's bits, then replay the journal into it (module
    docstring). The folder must hold the patch's base; LayoutChange for a patch that adds,
    removes or reshapes tensors (only an anchor moves such a folder on)."""
    marker = read_marker(folder)
    if marker is None:
        raise SparrowError(f"{folder}: no sparrowd.json, not a whole version")
    if patch.base_version != marker["version"]:
        raise SparrowError(f"version {patch.version} applies to {patch.base_version}, the folder holds "
                           f"{marker['version']}")
    places = _places(folder)
    for t in patch.tensors:
        p = places.get(t.name)
        if t.op not in (PATCH, FULL) or p is None or p.dtype != t.dtype or p.numel != t.numel:
            raise LayoutChange(f"version {patch.version} changes tensor {t.name!r}'s layout")
        have = marker["tensors"].get(t.name)
        if t.op == PATCH and (have is None or not fp_equal(bytes.fromhex(have), t.base_fp)):
            raise IntegrityError(f"version {patch.version}: tensor {t.name!r} of the folder is not its base")
    history = read_history(folder, marker["version"])
    if patch.history is not None:
        try:
            check_history(patch, history)
        except BaseMismatchError as e:
            raise HistoryMissing(str(e)) from None
    journal = _Journal(journal_path, {
        "version": patch.version, "base": patch.base_version,
        "tensors": {t.name: t.result_fp for t in patch.tensors},
        "files": {f.name: f.hash.hex() for f in patch.files}})
    try:
        parts = _journal_patch(journal, folder, places, patch, read, progress, decoded,
                               history if patch.history is not None else None)
        # The history after this version goes down first: a folder at a version always has its own.
        # Its tensors merge side by side (an 8B model's history is some 200M entries).
        with ThreadPoolExecutor(cpu_threads(), thread_name_prefix="sparrowd-history") as pool:
            after = (history or History()).after_patch(patch, parts, pool=pool)
        _write_history(folder, patch.version, after)
        journal.commit()
    except BaseException:
        journal.abandon()
        raise
    try:
        version = _replay(folder, journal_path, guard=guard)
    except IntegrityError as e:
        raise FolderDamaged(str(e)) from None
    _drop_histories(folder, version)
    return version
