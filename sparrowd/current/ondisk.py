"""The current folder's files on disk (the layout the package docstring draws): the commit record
``sparrowd.json``, the change history kept beside it, the lock engines hold while they load, and
where each tensor's bytes lie in the shards. The errors an update raises live here too.

Imports ``checkpoint``, ``codec`` and ``errors``; nothing else of the package.
"""

from __future__ import annotations

import fcntl
import json
import os
import struct
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..checkpoint import INDEX_NAME, TensorSpec, _read_shard, atomic_file, write_safetensors
from ..codec import dtype_info
from ..codec.history import History, TensorHistory
from ..codec.manifest import MAX_FILE, check_file_name
from ..errors import FormatError, SparrowError

MARKER = "sparrowd.json"
LOCK = ".sparrowd.lock"
FOLDER_FORMAT = "sparrowd-current/1"
SHARD_BYTES = 4 << 30  # tensors per shard file, as Hugging Face's writers split them

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
        del arrays  # the copies stay; the mapping goes
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
