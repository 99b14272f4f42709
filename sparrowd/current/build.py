"""Making a whole version folder: built from an anchor (every tensor checked against its
fingerprint), or adopted from a local model folder (weights reflinked or linked, never written)
once the patches held tell which version it is (``base_of``).

Imports ``checkpoint``, ``codec``, ``errors`` and the package's ``ondisk`` and ``shards``.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import blake3

from ..checkpoint import INDEX_NAME, write_safetensors
from ..codec import Manifest, decode_chunk
from ..codec.chunk import decode_file_chunk
from ..codec.extract import fingerprint, fp_equal
from ..codec.history import History
from ..codec.patch import check_segments
from ..errors import BaseMismatchError, FormatError, IntegrityError, SparrowError
from .ondisk import (
    LOCK,
    SHARD_BYTES,
    Progress,
    ReadChunk,
    _layout,
    _places,
    _weight_files,
    _write_history,
    _write_marker,
    model_files,
)
from .shards import _Shards


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
    fps: dict[str, bytes] = {}
    for t in anchor.tensors:
        assert t.result_fp is not None  # an anchor holds no removes, and the manifest checks the others have one
        fps[t.name] = t.result_fp
    _write_marker(dest, anchor.version, fps, {f.name: f.hash.hex() for f in anchor.files})


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
