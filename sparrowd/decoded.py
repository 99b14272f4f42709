"""A patch decoded for applying: per tensor, flat positions and values, ready to scatter.

The in-memory form (``Decoded``) is what appliers consume; its file form is
the safetensors layout of docs/FORMAT.md ("Decoded layout"), which
``sparrowd delta export`` writes and the daemon puts in shared memory for
its engine (a memfd passed over the engine socket). Reading it back maps the
file and returns views: nothing is copied.

A tensor the patch changes in places (op ``patch``) has ``indices`` (I64,
sorted flat positions) and ``values``: the new bit patterns, or for ulp
values the signed ulp distance from the old ones. A tensor written whole
(op ``full``) has only ``values``, every element in order.
"""

from __future__ import annotations

import json
import os
from collections import deque
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .checkpoint import TensorSpec, _read_shard, write_safetensors
from .codec import FULL, PATCH, REMOVE, Manifest, TensorEntry, check_history, decode_chunk, dtype_info
from .codec.bits import ascending, sint_type, unzigzag
from .codec.chunk import ULP, is_ulp
from .codec.patch import check_segments
from .errors import FormatError

__all__ = ["Write", "Decoded", "decode_patch", "decoded_from", "write_decoded", "read_decoded", "DECODED_FORMAT"]

DECODED_FORMAT = "sparrowd-decoded/1"


@dataclass(frozen=True)
class Write:
    name: str
    indices: np.ndarray | None  # int64 flat positions; None: every element, in order
    values: np.ndarray  # unsigned bit patterns, or (ulp) signed distances of the same width
    ulp: bool


@dataclass
class Decoded:
    version: int
    base_version: int | None
    values: str
    tensors: tuple[TensorEntry, ...]
    writes: list[Write]
    keep: object = None  # what the arrays view (an mmap), kept open as long as they are
    ascending: bool = False  # every write's positions were checked to rise strictly, inside its tensor

    @property
    def elements(self) -> int:
        return sum(int(w.values.size) for w in self.writes)


DECODE_AHEAD = 16  # chunks decode_patch has in flight on a pool (each a few MiB decoded)


def decode_patch(manifest: Manifest, chunks, base=None, history=None, *, pool: Executor | None = None) -> Decoded:
    """Decode every chunk (hash- and manifest-checked) into one write per touched tensor.
    ``base``: ``name -> flat bits`` of the base version, which ulp2 patches are coded against, and
    ``history``: the change history one names, if it names one (codec.history). ``pool``: threads
    to decode chunks on, up to ``DECODE_AHEAD`` taken from ``chunks`` ahead (chunks decode on their
    own; the decompression and the C decoders release the GIL)."""
    history = check_history(manifest, history)
    parts: dict[str, list] = {}
    it = iter(chunks)

    def decode(entry, data):
        return entry, decode_chunk(data, expect_hash=entry.hash, base=base, history=history)

    def taken(entry, segments) -> None:
        check_segments(manifest, entry, segments)
        for s in segments:
            parts.setdefault(s.name, []).append(s)

    ahead: deque[Future] = deque()
    try:
        for entry in manifest.chunks:
            data = next(it, None)
            if data is None:
                raise FormatError(f"patch has {len(manifest.chunks)} chunks, fewer were given")
            if pool is None:
                taken(*decode(entry, data))
                continue
            ahead.append(pool.submit(decode, entry, data))
            while len(ahead) > DECODE_AHEAD:
                taken(*ahead.popleft().result())
        while ahead:
            taken(*ahead.popleft().result())
    finally:
        for f in ahead:
            f.cancel()
    return decoded_from(manifest, parts)


def decoded_from(manifest: Manifest, parts: dict[str, list]) -> Decoded:
    """One write per touched tensor from its decoded segments (``name -> [Segment]``, any order)."""
    writes = []
    for t in manifest.tensors:
        if t.op == REMOVE:
            continue
        segs = sorted(parts.get(t.name, []), key=lambda s: s.start)
        w = dtype_info(t.known_dtype).itemsize
        ulp = bool(segs) and is_ulp(segs[0].values)
        if t.op == FULL:
            values = np.concatenate([s.data for s in segs]) if segs else np.empty(0, f"<u{w}")
            writes.append(Write(t.name, None, values, False))
            continue
        vals = [unzigzag(s.data) if is_ulp(s.values) else s.data for s in segs]
        indices = np.concatenate([s.indices for s in segs]) if segs else np.empty(0, np.int64)
        values = np.concatenate(vals) if vals else np.empty(0, sint_type(w) if ulp else f"<u{w}")
        writes.append(Write(t.name, indices, values, ulp))
    return Decoded(manifest.version, manifest.base_version, manifest.values, manifest.tensors, writes)


def _table(d: Decoded) -> str:
    by = {w.name: w for w in d.writes}
    return json.dumps({t.name: {
        "op": t.op, "dtype": t.dtype, "shape": list(t.shape) if t.shape is not None else None,
        "values": "ulp" if t.name in by and by[t.name].ulp else "absolute", "changed": t.changed,
        "base_fp": t.base_fp.hex() if t.base_fp else None, "result_fp": t.result_fp.hex() if t.result_fp else None,
        "base_dtype": t.base_dtype, "base_shape": list(t.base_shape) if t.base_shape is not None else None,
    } for t in d.tensors}, sort_keys=True)


def write_decoded(d: Decoded, path: str | os.PathLike) -> None:
    """The safetensors layout at ``path`` (a file, or ``/proc/self/fd/N`` of a memfd)."""
    by = {t.name: t for t in d.tensors}
    specs = []
    for w in d.writes:
        t = by[w.name]
        if w.indices is None:
            specs.append(TensorSpec(f"{w.name}.full", t.known_dtype, t.known_shape, w.values))
            continue
        specs.append(TensorSpec(f"{w.name}.indices", "I64", (w.indices.size,), w.indices))
        width = dtype_info(t.known_dtype).itemsize
        vdt = {1: "I8", 2: "I16", 4: "I32", 8: "I64"}[width] if w.ulp else t.known_dtype
        specs.append(TensorSpec(f"{w.name}.values", vdt, (w.values.size,), w.values))
    meta = {"format": DECODED_FORMAT, "version": str(d.version),
            "base_version": "" if d.base_version is None else str(d.base_version), "values": d.values,
            "tensors": _table(d)}
    write_safetensors(Path(path), specs, meta)


def _entry(name: str, e) -> TensorEntry:
    try:
        shape = tuple(int(x) for x in e["shape"]) if e["shape"] is not None else None
        base_shape = tuple(int(x) for x in e["base_shape"]) if e.get("base_shape") is not None else None
        return TensorEntry(name, str(e["op"]), e["dtype"], shape,
                           bytes.fromhex(e["base_fp"]) if e["base_fp"] else None,
                           bytes.fromhex(e["result_fp"]) if e["result_fp"] else None,
                           int(e["changed"]), e.get("base_dtype"), base_shape)
    except (KeyError, TypeError, ValueError):
        raise FormatError(f"decoded patch: tensor {name!r} has a malformed entry") from None


def read_decoded(path: str | os.PathLike) -> Decoded:
    """Map a decoded patch (a file, or ``/proc/self/fd/N``); the writes view the mapping."""
    shard, arrays = _read_shard(Path(path))
    what = f"decoded patch {path}"
    meta = shard.metadata
    if meta.get("format") != DECODED_FORMAT:
        raise FormatError(f"{what}: not a {DECODED_FORMAT} file")
    try:
        version = int(meta["version"])
        base_version = int(meta["base_version"]) if meta["base_version"] else None
        table = json.loads(meta["tensors"])
    except (KeyError, ValueError):
        raise FormatError(f"{what}: malformed metadata") from None
    if not isinstance(table, dict):
        raise FormatError(f"{what}: malformed tensor table")
    tensors = tuple(_entry(n, table[n]) for n in sorted(table))
    writes = []
    for t in tensors:
        if t.op == REMOVE:
            continue
        if t.op == FULL:
            a = arrays.get(f"{t.name}.full")
            if a is None or a.bits.size != t.numel:
                raise FormatError(f"{what}: tensor {t.name!r} is not there whole")
            writes.append(Write(t.name, None, a.bits, False))
            continue
        if t.op != PATCH:
            raise FormatError(f"{what}: tensor {t.name!r}: unknown op {t.op!r}")
        idx, val = arrays.get(f"{t.name}.indices"), arrays.get(f"{t.name}.values")
        if idx is None or val is None or idx.bits.size != t.changed or val.bits.size != t.changed:
            raise FormatError(f"{what}: tensor {t.name!r}: indices and values do not match its {t.changed} changes")
        indices = idx.bits.view(np.int64)
        if indices.size and (indices[0] < 0 or indices[-1] >= t.numel or not ascending(indices)):
            raise FormatError(f"{what}: tensor {t.name!r}: positions must be sorted, distinct and inside it")
        ulp = table[t.name].get("values") == ULP
        writes.append(Write(t.name, indices, val.bits.view(sint_type(val.bits.itemsize)) if ulp else val.bits, ulp))
    return Decoded(version, base_version, meta.get("values", ""), tensors, writes, keep=shard.mm, ascending=True)
