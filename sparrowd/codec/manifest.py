"""The manifest: what a patch changes and which chunks carry it.

A manifest names the version it produces and the version it applies to, the
value mode, one entry per touched tensor (dtype, shape, operation, fingerprint
of the base and of the result, elements changed) and the chunk list (BLAKE3
hash, size, and the segments each chunk covers). It is deterministic msgpack:
maps are built in a fixed key order and tensors are sorted by name, so the same
patch always gives the same bytes, which is what the trainer signs.

Operations on a tensor:

* ``patch``: same dtype and shape; sparse segments change some elements;
* ``full``: the tensor is (re)written whole by dense segments: it is new, or
  its dtype or shape changed (``base_dtype``/``base_shape`` say what it was);
* ``remove``: the tensor is dropped.

A manifest may also carry the model's non-tensor files (``files``: name, size,
BLAKE3 of the content), each in *file chunks* whose entries name the file and
the byte range they hold instead of segments. Anchors carry them, so a box
with nothing gets a whole model folder through the swarm.

A format 2 manifest (an ``ulp2`` patch) is that msgpack in one zstd frame, and
its tensor chunks do not list their segments (each chunk's header does, and
the chunk's hash in the signed manifest vouches for it): on a 1% patch of a
small model the plain manifest cost a third of a bit per changed element.
Format 1 manifests keep their plain bytes, which older readers expect.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import zstandard

from ..errors import FormatError
from ..schema import Bytes, Int, List, NonNegInt, Opt, Str, fields, pack, unpack
from .bits import dtype_info
from .chunk import ABSOLUTE, ULP, ULP2
from .extract import SHORT_FP

__all__ = ["TensorEntry", "ChunkEntry", "FileEntry", "Manifest", "check_file_name", "MAX_FILE",
            "PATCH", "FULL", "REMOVE", "FORMAT_NAME", "FORMAT_VERSION"]

FORMAT_NAME = "sparrowd-patch"
FORMAT_VERSION = 2  # the newest this reads; a manifest is written as 1 unless its values are ulp2
PATCH, FULL, REMOVE = "patch", "full", "remove"
MAX_MANIFEST = 64 << 20
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
MAX_FILE = 256 << 20  # one non-tensor file (a large tokenizer.json is tens of MiB)
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
RESERVED_FILES = ("model.safetensors.index.json", "sparrowd.json")


def check_file_name(name: str) -> str:
    """A file a manifest may carry: a plain name in the model folder's top level, not a weight file
    and not one the folder's writer makes itself."""
    if not isinstance(name, str) or not _FILE_NAME.fullmatch(name) or ".." in name:
        raise FormatError(f"file name {name!r}: a plain name of letters, digits, '.', '_', '-' is required")
    if name.endswith((".safetensors", ".bin", ".pt", ".pth")) or name in RESERVED_FILES:
        raise FormatError(f"file name {name!r}: weights and {', '.join(RESERVED_FILES)} are not carried as files")
    return name


@dataclass(frozen=True)
class TensorEntry:
    name: str
    op: str
    dtype: str | None  # result dtype (None for remove)
    shape: tuple[int, ...] | None
    base_fp: bytes | None  # fingerprint of the base tensor (None when new)
    result_fp: bytes | None  # fingerprint of the result (None for remove)
    changed: int = 0  # elements written by this patch
    base_dtype: str | None = None
    base_shape: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape is not None else 0

    @property
    def known_dtype(self) -> str:
        """The result dtype, for an entry that has one (every op but remove)."""
        if self.dtype is None:
            raise ValueError(f"tensor {self.name!r} ({self.op}) has no result dtype")
        return self.dtype

    @property
    def known_shape(self) -> tuple[int, ...]:
        """The result shape, for an entry that has one (every op but remove)."""
        if self.shape is None:
            raise ValueError(f"tensor {self.name!r} ({self.op}) has no result shape")
        return self.shape

    def to_wire(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "op": self.op,
            "dtype": self.dtype,
            "shape": list(self.shape) if self.shape is not None else None,
            "base_fp": self.base_fp,
            "result_fp": self.result_fp,
            "changed": self.changed,
            "base_dtype": self.base_dtype,
            "base_shape": list(self.base_shape) if self.base_shape is not None else None,
        }


@dataclass(frozen=True)
class ChunkEntry:
    hash: bytes
    size: int
    raw_size: int
    # (tensor name, start, stop, count); None where the manifest does not list them (format 2: the
    # chunk's own header does, and the chunk's hash vouches for it)
    segments: tuple[tuple[str, int, int, int], ...] | None
    file: tuple[str, int, int] | None = None  # a file chunk: (file name, start, stop)

    def to_wire(self, listed: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"hash": self.hash, "size": self.size, "raw_size": self.raw_size}
        if listed or self.file is not None:
            out["segments"] = [list(s) for s in self.segments or ()]
        if self.file is not None:
            out["file"] = list(self.file)
        return out


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    hash: bytes  # BLAKE3-256 of the content

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "hash": self.hash}


@dataclass(frozen=True)
class Manifest:
    version: int
    base_version: int | None
    values: str
    chunk_size: int
    tensors: tuple[TensorEntry, ...]
    chunks: tuple[ChunkEntry, ...]
    meta: dict[str, Any] = field(default_factory=dict)  # free-form str -> str, e.g. the producer
    files: tuple[FileEntry, ...] = ()  # non-tensor files (anchors), sorted by name
    # format 2: the change history the ulp2 segments are coded against, as (the versions its patches
    # produced, newest first; its 8-byte fingerprint), or None (codec.history)
    history: tuple[tuple[int, ...], bytes] | None = None

    def tensor(self, name: str) -> TensorEntry:
        return self._by_name()[name]

    def _by_name(self) -> dict[str, TensorEntry]:
        cache = self.__dict__.get("_names")
        if cache is None:
            cache = {t.name: t for t in self.tensors}
            object.__setattr__(self, "_names", cache)
        return cache

    @property
    def elements_changed(self) -> int:
        return sum(t.changed for t in self.tensors)

    @property
    def elements_total(self) -> int:
        """Elements of the whole result model when the writer recorded it, else of the touched tensors."""
        total = self.meta.get("elements_total", "")
        if total.isdigit():
            return int(total)
        return sum(t.numel for t in self.tensors if t.op != REMOVE)

    @property
    def patch_bytes(self) -> int:
        return sum(c.size for c in self.chunks)

    def to_bytes(self) -> bytes:
        out = {
            "format": FORMAT_NAME,
            "format_version": 2 if self.values == ULP2 else 1,
            "version": self.version,
            "base_version": self.base_version,
            "values": self.values,
            "chunk_size": self.chunk_size,
            "tensors": [t.to_wire() for t in self.tensors],
            "chunks": [c.to_wire(listed=self.values != ULP2) for c in self.chunks],
            "meta": dict(sorted(self.meta.items())),
        }
        if self.files:  # absent rather than empty: a manifest without files has the bytes it always had
            out["files"] = [f.to_wire() for f in self.files]
        if self.history is not None:
            out["history"] = {"versions": list(self.history[0]), "fp": self.history[1]}
        raw = pack(out)
        return zstandard.ZstdCompressor(level=9).compress(raw) if self.values == ULP2 else raw

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> "Manifest":
        if bytes(data[:4]) == ZSTD_MAGIC:  # format 2 (a msgpack map never starts with this byte)
            try:
                size = zstandard.frame_content_size(data)
                if not 0 <= size <= MAX_MANIFEST:
                    raise FormatError("manifest: compressed without a content size, or too large")
                data = zstandard.ZstdDecompressor().decompress(data, max_output_size=MAX_MANIFEST)
            except zstandard.ZstdError as e:
                raise FormatError(f"manifest: cannot decompress ({e})") from None
            if not data or data[0] < 0x80:
                raise FormatError("manifest: a compressed manifest holds no msgpack map")
        m = fields(
            unpack(data, what="manifest", max_len=MAX_MANIFEST),
            {
                "format": Str,
                "format_version": Int,
                "version": NonNegInt,
                "base_version": Opt(NonNegInt),
                "values": Str,
                "chunk_size": NonNegInt,
                "tensors": List,
                "chunks": List,
            },
            what="manifest",
        )
        if m["format"] != FORMAT_NAME:
            raise FormatError(f"manifest: not a sparrowd patch manifest ({m['format']!r})")
        if m["format_version"] not in (1, FORMAT_VERSION):
            raise FormatError(f"manifest: format version {m['format_version']} is not supported "
                              f"(this reads 1 to {FORMAT_VERSION})")
        if m["values"] not in (ABSOLUTE, ULP, ULP2) or (m["values"] == ULP2) != (m["format_version"] == 2):
            raise FormatError(f"manifest: value mode {m['values']!r} in format {m['format_version']}")
        meta = m.get("meta") or {}
        if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise FormatError("manifest: meta must map strings to strings")
        tensors = tuple(_tensor_from_wire(t) for t in m["tensors"])
        chunks = tuple(_chunk_from_wire(c, m["values"] == ULP2) for c in m["chunks"])
        files = m.get("files") or []
        if not isinstance(files, list):
            raise FormatError("manifest: files must be a list")
        man = cls(m["version"], m["base_version"], m["values"], m["chunk_size"], tensors, chunks, meta,
                  tuple(_file_from_wire(f) for f in files), _history_from_wire(m.get("history"), m["values"]))
        man.validate()
        return man

    def validate(self) -> None:
        """Cross-field checks: names unique and sorted, segments inside their tensors."""
        names = [t.name for t in self.tensors]
        if names != sorted(set(names)):
            raise FormatError("manifest: tensor names must be unique and sorted")
        by = self._by_name()
        written: dict[str, int] = {}
        files = {f.name: f for f in self.files}
        if [f.name for f in self.files] != sorted(files):
            raise FormatError("manifest: file names must be unique and sorted")
        filled = dict.fromkeys(files, 0)
        for c in self.chunks:
            if c.file is not None:
                name, start, stop = c.file
                if c.segments or name not in files or start != filled[name] or not start < stop <= files[name].size:
                    raise FormatError(f"manifest: file chunk {c.hash.hex()[:16]} does not continue file {name!r}")
                filled[name] = stop
            if c.segments is None:
                continue
            for name, start, stop, count in c.segments:
                t = by.get(name)
                if t is None or t.op == REMOVE:
                    raise FormatError(f"manifest: chunk {c.hash.hex()[:16]} covers unknown tensor {name!r}")
                if not (0 <= start <= stop <= t.numel) or count > stop - start:
                    raise FormatError(f"manifest: segment [{start}, {stop}) x{count} does not fit tensor {name!r}")
                written[name] = written.get(name, 0) + count
        listed = all(c.segments is not None for c in self.chunks)
        for t in self.tensors:
            if listed and written.get(t.name, 0) != t.changed:
                raise FormatError(f"manifest: tensor {t.name!r} claims {t.changed} changes, "
                                  f"chunks carry {written.get(t.name, 0)}")
            if t.op == FULL and t.changed != t.numel:
                raise FormatError(f"manifest: full tensor {t.name!r} must be written whole")
        for f in self.files:
            if filled[f.name] != f.size:
                raise FormatError(f"manifest: file {f.name!r} has {f.size} bytes, its chunks carry {filled[f.name]}")


_SHAPE_ERR = "shape must be a list of non-negative integers"


def _history_from_wire(h: Any, values: str) -> tuple[tuple[int, ...], bytes] | None:
    if h is None:
        return None
    h = fields(h, {"versions": List, "fp": Bytes}, what="manifest history")
    versions = h["versions"]
    if values != ULP2 or not 1 <= len(versions) <= 8 or not all(NonNegInt(v) for v in versions) \
            or len(h["fp"]) != SHORT_FP:
        raise FormatError(f"manifest: a history is 1 to 8 versions and an {SHORT_FP}-byte fingerprint, "
                          "in an ulp2 manifest only")
    return tuple(versions), bytes(h["fp"])


def _shape(v: Any, what: str) -> tuple[int, ...] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise FormatError(f"{what}: {_SHAPE_ERR}")
    return tuple(v)


def _tensor_from_wire(t: Any) -> TensorEntry:
    fields(
        t,
        {
            "name": Str,
            "op": Str,
            "dtype": Opt(Str),
            "shape": Opt(List),
            "base_fp": Opt(Bytes),
            "result_fp": Opt(Bytes),
            "changed": NonNegInt,
            "base_dtype": Opt(Str),
            "base_shape": Opt(List),
        },
        what="manifest tensor",
    )
    what = f"manifest tensor {t['name']!r}"
    op = t["op"]
    if op not in (PATCH, FULL, REMOVE):
        raise FormatError(f"{what}: unknown op {op!r}")
    if op != REMOVE:
        if t["dtype"] is None or t["shape"] is None or t["result_fp"] is None:
            raise FormatError(f"{what}: needs dtype, shape and result fingerprint")
        dtype_info(t["dtype"])
    if op in (PATCH, REMOVE) and t["base_fp"] is None:
        raise FormatError(f"{what}: needs a base fingerprint")
    if any(fp is not None and len(fp) not in (SHORT_FP, 16) for fp in (t["base_fp"], t["result_fp"])):
        raise FormatError(f"{what}: a fingerprint is 16 bytes, or its first {SHORT_FP} in format 2")
    return TensorEntry(
        name=t["name"],
        op=op,
        dtype=t["dtype"],
        shape=_shape(t["shape"], what),
        base_fp=t["base_fp"],
        result_fp=t["result_fp"],
        changed=t["changed"],
        base_dtype=t["base_dtype"],
        base_shape=_shape(t["base_shape"], what),
    )


def _file_from_wire(f: Any) -> FileEntry:
    fields(f, {"name": Str, "size": NonNegInt, "hash": Bytes}, what="manifest file")
    if len(f["hash"]) != 32 or f["size"] > MAX_FILE:
        raise FormatError(f"manifest file {f['name']!r}: needs a 32-byte hash and at most {MAX_FILE} bytes")
    return FileEntry(check_file_name(f["name"]), f["size"], f["hash"])


def _chunk_from_wire(c: Any, unlisted: bool) -> ChunkEntry:
    """A chunk entry; ``unlisted`` (format 2): a tensor chunk's segments are not listed."""
    fields(c, {"hash": Bytes, "size": NonNegInt, "raw_size": NonNegInt, "segments": Opt(List)},
           what="manifest chunk")
    if len(c["hash"]) != 32:
        raise FormatError("manifest chunk: hash must be 32 bytes")
    if (c.get("segments") is None) != (unlisted and c.get("file") is None):
        raise FormatError("manifest chunk: segments are listed in format 1 and for file chunks, and only there")
    segs = []
    for s in c.get("segments") or ():
        if (
            not isinstance(s, list)
            or len(s) != 4
            or not isinstance(s[0], str)
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in s[1:])
        ):
            raise FormatError("manifest chunk: segment must be [name, start, stop, count]")
        segs.append((s[0], s[1], s[2], s[3]))
    span = c.get("file")
    if span is not None and not (isinstance(span, list) and len(span) == 3 and isinstance(span[0], str)
                                 and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in span[1:])):
        raise FormatError("manifest chunk: file must be [name, start, stop]")
    return ChunkEntry(c["hash"], c["size"], c["raw_size"], tuple(segs) if c.get("segments") is not None else None,
                      tuple(span) if span is not None else None)
