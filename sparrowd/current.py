"""The current-version folder: the newest version a node can produce, as a model folder.

A rollout node keeps ``DATA/current`` so that ``vllm serve DATA/current`` (or
``LLM(...)``) starts on the latest policy, and ``sparrowd checkout`` writes the
same kind of folder for any version it can produce::

    DATA/current -> folders/<n>            a symlink, replaced atomically when the folder is rebuilt
    DATA/folders/<n>/
        model.safetensors                  (or model-0000k-of-0000N.safetensors + the index)
        config.json, tokenizer.json, ...   the anchor's files
        sparrowd.json                      version and fingerprints: the commit record
        .sparrowd.lock                     flock: shared while an engine loads, exclusive while updating
    DATA/current.journal                   the redo journal of the update in progress

*Building* (from an anchor: a box with nothing, or one that fell behind the
swarm's retention) writes a new folder beside the old one, checks every
tensor's fingerprint against the anchor's manifest, and only then swings the
symlink. *Updating* (one patch) is in place and costs O(changed elements):

1. the new bit patterns of every changed element (ulp distances resolved
   against the folder's current bits) are written to the redo journal, which
   is fsynced and renamed into place; from here the version is committed;
2. the journal is replayed into the shards through writable mappings and the
   touched tensors' fingerprints are checked against the manifest;
3. ``sparrowd.json`` is replaced (the folder's version moves) and the
   journal removed.

A crash before step 1 ends leaves the folder untouched; a crash after it is
repaired at the next start by replaying the journal, which writes absolute
values and so can be replayed any number of times. The folder is therefore
always exactly one version, whatever the kill point.

Engines that have the folder open are not disturbed. An engine with the
sparrowd vLLM plugin holds the lock shared while it loads, and an update
waits for it. For every other reader, each shard is first leased
(``F_SETLEASE``, ``F_WRLCK``): the kernel grants it only while no other process
has the file open or mapped, and holds back anyone who opens it until the
update is whole. A shard that is in use is copied, updated and renamed over
instead, so the reader keeps the bytes it mapped.

Disk: one model's bytes plus the journal (the changed elements: 8 + the
element width bytes each). At ~1% uniform density nearly every 4 KiB page
holds a change, so the page cache writes most of each shard back although the
process writes only the changed elements.
"""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import shutil
import signal
import struct
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import blake3
import numpy as np

from .checkpoint import INDEX_NAME, TensorSpec, _read_shard, atomic_file, write_safetensors
from .codec import FULL, PATCH, Manifest, check_history, decode_chunk, dtype_info
from .codec.bits import uint_type, ulp_apply
from .codec.chunk import DENSE, decode_file_chunk, is_ulp
from .codec.extract import fingerprint, fp_equal
from .codec.history import History, TensorHistory
from .codec.manifest import MAX_FILE, check_file_name
from .codec.patch import check_segments
from .codec.workers import cpu_threads
from .decoded import decoded_from, write_decoded
from .errors import BaseMismatchError, FormatError, IntegrityError, SparrowError
from .schema import pack, unpack

__all__ = ["CurrentFolder", "FolderBusy", "LayoutChange", "HistoryMissing", "read_history", "model_files", "base_of",
           "adopt_folder",
           "read_marker", "reading", "build_folder", "update_folder", "MARKER", "LOCK"]

MARKER = "sparrowd.json"
LOCK = ".sparrowd.lock"
FOLDER_FORMAT = "sparrowd-current/1"
SHARD_BYTES = 4 << 30  # tensors per shard file, as Hugging Face's writers split them
_JOURNAL_MAGIC, _JOURNAL_END = b"SPJ1", b"END!"
_F_SETLEASE = getattr(fcntl, "F_SETLEASE", 1024)

ReadChunk = Callable[[int], bytes]  # chunk index -> the chunk's bytes (hash-checked by the reader here)
Progress = Callable[[int, int], None]  # (done, total) chunks


class FolderBusy(SparrowError):
    """An engine is loading from the folder; the update waits."""


class LayoutChange(SparrowError):
    """The patch adds, removes or reshapes tensors: the folder is rebuilt from an anchor instead."""


class HistoryMissing(SparrowError):
    """The patch is coded against a change history this folder does not keep (it was made by an
    older sparrowd, or its file was lost): the folder is rebuilt from the newest anchor, and the
    patches after it rebuild the history."""


# ---------------------------------------------------------------- what anchors carry


def model_files(folder: str | os.PathLike) -> dict[str, bytes]:
    """A model folder's non-tensor files, the ones anchors carry: every regular file at its top
    level except weights, the shard index and hidden files (config.json, generation_config.json,
    the tokenizer and its chat template, ...)."""
    out = {}
    for p in sorted(Path(folder).iterdir()):
        if not p.is_file() or p.name.startswith("."):
            continue
        try:
            check_file_name(p.name)
        except FormatError:
            continue  # weights, the index, names that do not travel
        if p.stat().st_size > MAX_FILE:
            raise FormatError(f"{p}: {p.stat().st_size} bytes, more than a carried file may have ({MAX_FILE})")
        out[p.name] = p.read_bytes()
    return out


# ---------------------------------------------------------------- the folder's own files


def read_marker(folder: Path) -> dict | None:
    """``sparrowd.json``: the version the folder holds and every tensor's fingerprint (None: no
    whole version there)."""
    try:
        m = json.loads((Path(folder) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict) or m.get("format") != FOLDER_FORMAT or not isinstance(m.get("version"), int):
        return None
    return m


HISTORY_FORMAT = "sparrowd-history/1"


def _history_file(folder: Path, version: int) -> Path:
    """Where a version folder keeps the change history after ``version`` (ulp2 chains decode
    against it, codec.history): hidden, so it is no model file."""
    return Path(folder) / f".sparrowd.history.{version}"


def read_history(folder: Path, version: int) -> History | None:
    """The change history the folder keeps for ``version``; None when it keeps none."""
    path = _history_file(folder, version)
    if not path.exists():
        return None
    shard, arrays = _read_shard(path)
    meta = shard.metadata
    try:
        if meta.get("format") != HISTORY_FORMAT or int(meta["version"]) != version:
            raise ValueError
        versions = tuple(int(v) for v in json.loads(meta["versions"]))
        names = {n.rsplit(".", 1)[0] for n in arrays}
        tensors = {n: TensorHistory(arrays[f"{n}.positions"].bits.view(np.int64).copy(),
                                    arrays[f"{n}.state"].bits.view(np.uint8).copy()) for n in names}
    except (KeyError, ValueError, TypeError):
        raise FormatError(f"{path}: not a {HISTORY_FORMAT} file") from None
    finally:
        arrays = None  # the copies stay; the mapping goes
        if shard.mm is not None:
            try:
                shard.mm.close()
            except BufferError:
                pass
    return History(versions, tensors)


def _write_history(folder: Path, version: int, history: History) -> None:
    specs = []
    for name in sorted(history.tensors):
        t = history.tensors[name]
        specs += [TensorSpec(f"{name}.positions", "I64", (t.positions.size,), t.positions),
                  TensorSpec(f"{name}.state", "U8", (t.state.size,), t.state)]
    with atomic_file(_history_file(folder, version)) as tmp:
        write_safetensors(tmp, specs, {"format": HISTORY_FORMAT, "version": str(version),
                                       "versions": json.dumps(list(history.versions))})


def _drop_histories(folder: Path, keep: int) -> None:
    for p in Path(folder).glob(".sparrowd.history.*"):
        if p.name != _history_file(folder, keep).name:
            p.unlink(missing_ok=True)


def _write_marker(folder: Path, version: int, fps: dict[str, bytes], files: dict[str, str]) -> None:
    body = {"format": FOLDER_FORMAT, "version": version,
            "tensors": {n: fps[n].hex() for n in sorted(fps)}, "files": dict(sorted(files.items()))}
    with atomic_file(folder / MARKER) as tmp, open(tmp, "w") as f:
        json.dump(body, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(folder)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def _locked(folder: Path, shared: bool, wait: bool) -> Iterator[None]:
    # Readers open it read-only (an engine may run as another user, with only read access).
    flags = os.O_RDONLY if shared else os.O_RDWR | os.O_CREAT
    fd = os.open(Path(folder) / LOCK, flags | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise FolderBusy(f"{folder}: an engine is loading from it") from None
        yield
    finally:
        os.close(fd)


@contextmanager
def reading(folder: str | os.PathLike) -> Iterator[int | None]:
    """Hold off updates while reading a whole folder (an engine loading it); yields its version
    (None when it is not a sparrowd folder, which nothing updates)."""
    folder = Path(folder)
    if not (folder / MARKER).exists():
        yield None
        return
    with ExitStack() as stack:
        try:
            stack.enter_context(_locked(folder, shared=True, wait=True))
        except OSError:  # no lock file (a folder sparrowd checkout wrote: nothing updates it)
            pass
        m = read_marker(folder)
        yield m["version"] if m else None


@dataclass(frozen=True)
class _Place:
    file: str
    offset: int  # of the tensor's first byte in its file
    dtype: str
    numel: int


def _layout(tensors, shard_bytes: int) -> list[tuple[str, list[TensorSpec]]]:
    """Tensors (sorted by name) into shard files of at most ``shard_bytes`` each (a larger tensor
    gets a file of its own), named as Hugging Face names them."""
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    for t in tensors:
        spec = TensorSpec(t.name, t.dtype, tuple(t.shape))
        if groups[-1] and size + spec.nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += spec.nbytes
    if len(groups) == 1:
        return [("model.safetensors", groups[0])]
    n = len(groups)
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]


def _weight_files(folder: Path) -> list[str]:
    """A model folder's weight files: those its shard index names, else ``model.safetensors``."""
    index = folder / INDEX_NAME
    return sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else \
        ["model.safetensors"]


def _places(folder: Path) -> dict[str, _Place]:
    """Where each tensor's bytes are, from the shards' headers."""
    files = _weight_files(folder)
    out = {}
    for name in files:
        with open(folder / name, "rb") as f:
            (hlen,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(hlen))
        header.pop("__metadata__", None)
        for t, spec in header.items():
            info = dtype_info(spec["dtype"])
            b, e = spec["data_offsets"]
            out[t] = _Place(name, 8 + hlen + b, spec["dtype"], (e - b) // info.itemsize)
    return out


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


# ---------------------------------------------------------------- the journal


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
        values = memoryview(np.ascontiguousarray(values)).cast("B") if kind != "file" else memoryview(values)
        idx = memoryview(np.ascontiguousarray(indices, dtype="<i8")).cast("B") if indices is not None else b""
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
    data = b""
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


# ---------------------------------------------------------------- building and updating


def build_folder(dest: Path, anchor: Manifest, read: ReadChunk, *, shard_bytes: int = SHARD_BYTES,
                 progress: Progress | None = None) -> None:
    """Write ``anchor`` (a whole snapshot) as a model folder at ``dest`` (new or empty; the caller
    renames it into place) and check every tensor against the manifest."""
    dest.mkdir(parents=True, exist_ok=True)
    shards = _layout(anchor.tensors, shard_bytes)
    for file, specs in shards:
        write_safetensors(dest / file, specs, {"format": "pt"})
    if len(shards) > 1:
        weight_map = {s.name: file for file, specs in shards for s in specs}
        total = sum(s.nbytes for _, specs in shards for s in specs)
        (dest / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                  indent=1) + "\n")
    files = {f.name: bytearray(f.size) for f in anchor.files}
    tensors = _Shards(dest, _places(dest), guard=False)
    try:
        for i, entry in enumerate(anchor.chunks):
            data = read(i)
            if entry.file is not None:
                (name, start, stop), body = decode_file_chunk(data, expect_hash=entry.hash)
                if (name, start, stop) != entry.file:
                    raise IntegrityError(f"chunk {i}: file range differs from the manifest")
                files[name][start:stop] = body
            else:
                segments = decode_chunk(data, expect_hash=entry.hash)
                check_segments(anchor, entry, segments)
                for s in segments:
                    tensors.view(s.name)[s.start:s.stop] = s.data
            if progress is not None:
                progress(i + 1, len(anchor.chunks))
        for t in anchor.tensors:
            if t.numel and not fp_equal(fingerprint(tensors.view(t.name)), t.result_fp):
                raise IntegrityError(f"anchor {anchor.version}: tensor {t.name!r} differs from its fingerprint")
        tensors.commit()
    finally:
        tensors.close()
    for f in anchor.files:
        if blake3.blake3(files[f.name]).digest() != f.hash:
            raise IntegrityError(f"anchor {anchor.version}: file {f.name!r} differs from its hash")
        with open(dest / f.name, "wb") as out:
            out.write(files[f.name])
            out.flush()
            os.fsync(out.fileno())
    (dest / LOCK).touch(mode=0o644)
    _write_history(dest, anchor.version, History())  # the chain after an anchor starts its history afresh
    _write_marker(dest, anchor.version, {t.name: t.result_fp for t in anchor.tensors},
                  {f.name: f.hash.hex() for f in anchor.files})


def adopt_folder(dest: Path, source: Path, choose: Callable[[dict[str, bytes]], int]) -> tuple[int, str]:
    """``dest`` (new) made a version folder of ``source``: a model folder or one safetensors file
    (``CurrentFolder.adopt``)."""
    dest.mkdir(parents=True)
    if source.is_file():
        weights = {"model.safetensors": source}
    else:
        weights = {name: source / name for name in _weight_files(source)}
        if (source / INDEX_NAME).exists():
            shutil.copyfile(source / INDEX_NAME, dest / INDEX_NAME)
    how = "reflink"
    for name, path in weights.items():
        if not path.is_file():
            raise FormatError(f"{source}: no weight file {name}")
        if not _clone(path, dest / name):
            os.symlink(path.resolve(), dest / name)
            how = "link"
    files = model_files(source) if source.is_dir() else {}
    for name, data in files.items():
        (dest / name).write_bytes(data)
    places = _places(dest)
    shards = _Shards(dest, places, guard=False, writable=False)
    try:
        fps = {name: fingerprint(shards.view(name)) for name in places}
    finally:
        shards.close()
    version = choose(fps)
    (dest / LOCK).touch(mode=0o644)
    _write_history(dest, version, History())  # the chain after a base starts its history afresh
    _write_marker(dest, version, fps, {name: blake3.blake3(data).hexdigest() for name, data in files.items()})
    return version, how


_FICLONE = 0x40049409  # ioctl: make ``dest`` share ``src``'s extents (btrfs, XFS, bcachefs, ...)


def _clone(src: Path, dest: Path) -> bool:
    """A reflink of ``src`` at ``dest``, where the filesystem has them; False (nothing left) elsewhere."""
    try:
        with open(src, "rb") as s, open(dest, "wb") as d:
            fcntl.ioctl(d.fileno(), _FICLONE, s.fileno())
        return True
    except OSError:
        dest.unlink(missing_ok=True)
        return False


def base_of(fps: dict[str, bytes], patches: list[Manifest], version: int | None = None) -> int:
    """The version a folder whose tensors have the fingerprints ``fps`` holds, told by the base
    fingerprints of the patches that apply to it: the oldest base whose every fingerprint matches
    (``version``: that one only). BaseMismatchError naming the first tensor that differs from the
    base tried first otherwise; SparrowError when no patch names a base to compare with."""
    bases: dict[int, Manifest] = {}
    for m in sorted(patches, key=lambda m: m.version):
        if m.base_version is not None and (version is None or m.base_version == version):
            bases.setdefault(m.base_version, m)
    if not bases:
        raise SparrowError("no patch held yet names " + (f"base {version}" if version is not None else "a base"))
    first: str | None = None
    for b in sorted(bases):
        m = bases[b]
        bad = next((t.name for t in m.tensors if t.base_fp is not None
                    and not (t.name in fps and fp_equal(fps[t.name], t.base_fp))), None)
        if bad is None:
            return b
        if first is None:
            missing = bad not in fps
            first = (f"tensor {bad!r} " + ("is missing" if missing else "differs") +
                     f" from version {b}'s, which version {m.version} applies to")
    raise BaseMismatchError(f"not a base of this swarm's patches: {first}")


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


# ---------------------------------------------------------------- the folder a daemon keeps


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
