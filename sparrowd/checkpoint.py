"""Reading and writing safetensors checkpoints, zero-copy where it can be.

A checkpoint is a single ``.safetensors`` file or a Hugging Face model folder
(shards named in ``model.safetensors.index.json``, or a lone
``model.safetensors``, or any ``*.safetensors`` files). Tensors are read as
:class:`RawTensor` views straight into a read-only ``mmap`` of each file:
nothing is copied and any dtype, bf16 included, works without torch.

Writes never leave a half-written file behind: data goes to a temporary file
in the destination directory, is flushed and fsynced, then renamed over the
target; a folder is assembled in a temporary sibling folder and renamed into
place. Touched tensors are written by scattering straight into the mmapped
output file, so applying a patch needs no copy of the model in memory.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import secrets
import shutil
import struct
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .codec.bits import RawTensor, dtype_info, uint_type
from .errors import FormatError, InputError, OutputPathError

__all__ = [
    "Checkpoint",
    "open_checkpoint",
    "TensorSpec",
    "write_safetensors",
    "open_input",
    "writable_views",
    "atomic_file",
    "atomic_dir",
    "check_output",
    "INDEX_NAME",
]

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER = 100 << 20


@dataclass
class _Shard:
    path: Path
    mm: mmap.mmap | None
    metadata: dict[str, str]
    names: list[str]


class Checkpoint(Mapping[str, RawTensor]):
    """A read-only mapping of tensor name to :class:`RawTensor` (mmapped views)."""

    def __init__(self, path: Path, shards: list[_Shard], tensors: dict[str, RawTensor], is_folder: bool):
        self.path, self.shards, self._tensors, self.is_folder = path, shards, tensors, is_folder

    def __getitem__(self, name: str) -> RawTensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._tensors.values())

    def close(self) -> None:
        self._tensors = {}
        for s in self.shards:
            if s.mm is not None:
                try:
                    s.mm.close()
                except BufferError:
                    pass  # a view is still alive; the map goes with it

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_input(path: Path, mode: str = "rb", *, kind: str = "file"):
    """Open a file a user named, turning the usual mistakes into one-line errors."""
    try:
        return open(path, mode)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, not a {kind}") from None


def _read_shard(path: Path, writable: bool = False) -> tuple[_Shard, dict[str, RawTensor]]:
    what = str(path)
    with open_input(path, "r+b" if writable else "rb", kind="safetensors file") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise FormatError(f"{what}: not a safetensors file (too short)")
        (hlen,) = struct.unpack("<Q", f.read(8))
        if hlen > MAX_HEADER or 8 + hlen > size:
            raise FormatError(f"{what}: not a safetensors file (bad header length)")
        try:
            header = json.loads(f.read(hlen))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise FormatError(f"{what}: not a safetensors file (header is not JSON)") from None
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        mm = mmap.mmap(f.fileno(), 0, access=access) if size > 8 + hlen else None
    if not isinstance(header, dict):
        raise FormatError(f"{what}: not a safetensors file (header is not a map)")
    meta = header.pop("__metadata__", None) or {}
    base = 8 + hlen
    tensors: dict[str, RawTensor] = {}
    for name, spec in header.items():
        try:
            dt, shape, (b, e) = spec["dtype"], tuple(spec["shape"]), spec["data_offsets"]
            info = dtype_info(dt)
            numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
            if not all(isinstance(x, int) and x >= 0 for x in (*shape, b, e)):
                raise ValueError
        except FormatError as err:
            raise FormatError(f"{what}: tensor {name!r}: {err}") from None
        except (KeyError, TypeError, ValueError):
            raise FormatError(f"{what}: tensor {name!r} has a malformed header entry") from None
        if e - b != numel * info.itemsize or base + e > size or b > e:
            raise FormatError(f"{what}: tensor {name!r} data offsets do not match its shape or the file")
        if numel:
            assert mm is not None  # (its bytes lie past the header, checked above: the file has data)
            bits = np.frombuffer(mm, dtype=uint_type(info.itemsize), count=numel, offset=base + b)
        else:
            bits = np.empty(0, dtype=uint_type(info.itemsize))
        tensors[name] = RawTensor(dt, shape, bits)
    return _Shard(path, mm, {str(k): str(v) for k, v in meta.items()}, list(header)), tensors


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open a safetensors file or a Hugging Face model folder, read-only, mmapped."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{p}: no such file or directory")
    if p.is_file():
        shard, tensors = _read_shard(p)
        return Checkpoint(p, [shard], tensors, is_folder=False)
    index = p / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = list(dict.fromkeys(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise FormatError(f"{index}: not a safetensors index (no weight_map)") from None
    else:
        files = sorted(f.name for f in p.glob("*.safetensors"))
        weight_map = None
    if not files:
        raise InputError(f"{p}: no *.safetensors files in this folder")
    shards, tensors = [], {}
    for fname in files:
        if "/" in fname or fname.startswith("."):
            raise FormatError(f"{index}: shard name {fname!r} escapes the folder")
        shard, ts = _read_shard(p / fname)
        dup = tensors.keys() & ts.keys()
        if dup:
            raise FormatError(f"{p}: tensor {sorted(dup)[0]!r} is in more than one shard")
        shards.append(shard)
        tensors.update(ts)
    if weight_map is not None:
        missing = set(weight_map) - tensors.keys()
        if missing:
            raise FormatError(f"{index}: names {sorted(missing)[0]!r} but no shard holds it")
    return Checkpoint(p, shards, tensors, is_folder=True)


# ---------------------------------------------------------------- writing


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to write; its bytes come from ``source`` (any buffer) or are zeros."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    source: Any = None  # (a buffer, or None)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * dtype_info(self.dtype).itemsize


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def check_output(path: str | os.PathLike, *, folder: bool = False) -> None:
    """Refuse, naming ``path`` (never a temporary), an output that cannot be put in place: a file
    that is an existing folder (``folder``: a folder may replace one), or a folder that is not there."""
    path = Path(path)
    if not folder and path.is_dir():
        raise OutputPathError(f"{path}: is a folder")
    if not path.parent.is_dir():
        what = "is not a folder" if path.parent.exists() else "does not exist"
        raise OutputPathError(f"{path}: its folder {path.parent} {what}")


@contextmanager
def atomic_file(path: Path, *, private: bool = False, mode: int | None = None) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it over ``path`` on success.

    Each call gets a fresh name (so two writers of one path never share a temporary), created with
    ``O_EXCL``. The temporary has its final mode from its creation on, before any byte is written:
    ``mode`` exactly, 0600 when ``private`` (for secrets), else 0666 less the umask. A mode is never
    changed after the file is written."""
    path = Path(path)
    check_output(path)
    if private:
        mode = 0o600
    fd, tmp_path = _create_temporary(path, 0o666 if mode is None else mode)
    try:
        try:
            if mode is not None:
                os.fchmod(fd, mode)  # the umask may have narrowed it; the file is still empty
        finally:
            os.close(fd)
        yield tmp_path
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def _create_temporary(path: Path, mode: int) -> tuple[int, Path]:
    """A new empty file ``.<name>.<random>.tmp`` beside ``path``, created ``O_EXCL`` with ``mode``
    (less the umask): its descriptor and path."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, flags, mode), tmp
        except FileExistsError:
            continue
        except OSError as e:  # name the file asked for, not the temporary
            raise OSError(e.errno, e.strerror, str(path)) from None
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(path))


@contextmanager
def atomic_dir(path: Path, *, force: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside ``path``; move it to ``path`` on success."""
    path = Path(path)
    check_output(path, folder=True)
    if path.exists() and not force:
        raise InputError(f"{path}: already exists (use --force to replace it)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    os.chmod(tmp, 0o777 & ~_umask())
    try:
        yield tmp
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
            os.replace(path, old / path.name)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_safetensors(path: Path, tensors: list[TensorSpec], metadata: Mapping[str, str] | None = None) -> None:
    """Write a safetensors file at ``path`` and fsync it (wrap in :func:`atomic_file`).

    Tensors without a source are left as zeros (the file is pre-sized with
    ``truncate``, so they cost no writes); fill them later through
    :func:`writable_views`.
    """
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    off = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-(8 + len(hb)) % 8)  # data starts 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.truncate(8 + len(hb) + off)
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for t in tensors:
            if t.source is not None and t.nbytes:
                mv = memoryview(t.source).cast("B")
                if len(mv) != t.nbytes:
                    raise ValueError(f"tensor {t.name}: {len(mv)} bytes given for {t.nbytes}")
                f.write(mv)
            elif t.nbytes:
                f.seek(t.nbytes, os.SEEK_CUR)
        f.flush()
        os.fsync(f.fileno())


@contextmanager
def writable_views(path: Path) -> Iterator[dict[str, np.ndarray]]:
    """Writable flat bit views of every tensor of a safetensors file, via mmap.

    Changes are flushed and fsynced when the block ends without error.
    """
    shard, tensors = _read_shard(Path(path), writable=True)
    views = {n: t.bits for n, t in tensors.items()}
    del tensors
    try:
        yield views
        if shard.mm is not None:
            shard.mm.flush()
    finally:
        views.clear()
        if shard.mm is not None:
            try:
                shard.mm.close()
            except BufferError:
                pass
