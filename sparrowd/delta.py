"""Patch files on disk: the operations behind ``sparrowd delta``.

Thin I/O around the pure codec: open checkpoints (mmapped), run the codec,
and write results atomically. Every function raises :class:`SparrowError`
subclasses with one-line messages; none leaves a partial output behind.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
from collections.abc import Callable, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .checkpoint import (
    INDEX_NAME,
    Checkpoint,
    TensorSpec,
    atomic_dir,
    atomic_file,
    check_output,
    open_checkpoint,
    open_input,
    writable_views,
    write_safetensors,
)
from .codec import (
    FULL,
    PATCH,
    REMOVE,
    Manifest,
    PatchView,
    apply_segments,
    check_base,
    check_history,
    check_result,
    decode_chunk,
    encode_patch,
    parse_patch,
    patch_parts,
)
from .codec.chunk import ULP, ULP2
from .decoded import DECODED_FORMAT, decode_patch, write_decoded
from .errors import FormatError, InputError

__all__ = ["diff_files", "apply_file", "open_patch", "inspect_patch", "export_patch", "PatchStats", "DECODED_FORMAT"]



@contextmanager
def open_patch(path: str | os.PathLike):
    """Parse a ``.sprw`` file through a read-only mmap; yields a PatchView."""
    p = Path(path)
    with open_input(p, kind="patch file") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise FormatError(f"{p}: empty file, not a sparrowd patch")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = None
    try:
        view = parse_patch(mm, what=str(p))
        yield view
    finally:
        if view is not None:
            for c in view.chunks:
                c.release()
        del view
        try:
            mm.close()
        except BufferError:
            pass


def diff_files(
    old: str | os.PathLike | None,
    new: str | os.PathLike,
    out: str | os.PathLike,
    *,
    values: str = ULP,
    version: int = 1,
    base_version: int | None = None,
    chunk_size: int | None = None,
    progress: Callable[[str, int], None] | None = None,
    files: Mapping[str, bytes] | None = None,
) -> Manifest:
    """Diff two checkpoints into a ``.sprw`` file; returns its manifest. ``old=None`` writes an
    anchor: every tensor of ``new`` whole, applying to nothing. ``files``: non-tensor files the
    patch carries (an anchor's config and tokenizer: ``current.model_files``)."""
    if old is None:
        base_version = None
    elif version < 1:  # version 0 is where a chain starts: nothing comes before it to patch
        raise InputError(f"version {version}: a patch on a base makes version 1 or more (0 has no base)")
    elif base_version is None:
        base_version = version - 1
    check_output(out)  # before the diff, not after it
    with ExitStack() as stack:
        a = stack.enter_context(open_checkpoint(old)) if old is not None else {}
        b = stack.enter_context(open_checkpoint(new))
        kw: dict[str, Any] = {} if chunk_size is None else {"chunk_size": chunk_size}
        manifest, chunks = encode_patch(
            a, b, version=version, base_version=base_version, values=values, on_tensor=progress,
            meta={"producer": "sparrowd delta diff"}, files=files, **kw
        )
    out = Path(out)
    with atomic_file(out) as tmp, open(tmp, "wb") as f:
        for part in patch_parts(manifest, (c.data for c in chunks)):
            f.write(part)
        f.flush()
        os.fsync(f.fileno())
    return manifest


def _apply_chunks(view: PatchView, targets: dict[str, np.ndarray]) -> None:
    m = view.manifest
    for entry, data in zip(m.chunks, view.chunks):
        # An ulp2 chunk is decoded against the base bits of its own ranges, which no other chunk
        # writes: the targets, part-applied, still hold them.
        apply_segments(m, entry, decode_chunk(data, expect_hash=entry.hash, base=targets), targets)
    check_result(m, targets)


def _layout(base: Checkpoint, m: Manifest) -> dict[str, list[TensorSpec]]:
    """Output files and their tensors: the base's sharding, removed dropped, new added last."""
    by = {t.name: t for t in m.tensors}
    files: dict[str, list[TensorSpec]] = {}
    for shard in base.shards:
        specs = files.setdefault(shard.path.name, [])
        for name in shard.names:
            t = by.get(name)
            if t is None:
                b = base[name]
                specs.append(TensorSpec(name, b.dtype, b.shape, b.bits))
            elif t.op == PATCH:
                specs.append(TensorSpec(name, t.known_dtype, t.known_shape, base[name].bits))
            elif t.op == FULL:
                specs.append(TensorSpec(name, t.known_dtype, t.known_shape, None))
    last = base.shards[-1].path.name
    for t in m.tensors:
        if t.op == FULL and t.name not in base:
            files[last].append(TensorSpec(t.name, t.known_dtype, t.known_shape, None))
    return files


def apply_file(
    base_path: str | os.PathLike, patch_path: str | os.PathLike, out: str | os.PathLike, *, force: bool = False
) -> Manifest:
    """Apply a ``.sprw`` to a checkpoint, writing a new checkpoint atomically.

    The result keeps the base's layout (a folder stays a folder with the same
    shards and its other files); touched tensors are scattered straight into
    the mmapped output; every fingerprint is checked before the rename.
    """
    out = Path(out)
    with open_patch(patch_path) as view, open_checkpoint(base_path) as base:
        m = view.manifest
        check_base(m, base)
        check_history(m, None)  # a checkpoint keeps no change history: only a chain's folders do
        files = _layout(base, m)
        if not base.is_folder:
            with atomic_file(out) as tmp:
                write_safetensors(tmp, files[base.path.name], base.shards[0].metadata)
                with writable_views(tmp) as views:
                    _apply_chunks(view, views)
            return m
        with atomic_dir(out, force=force) as tmp:
            for f in base.path.iterdir():
                if f.is_file() and not f.name.endswith(".safetensors") and f.name != INDEX_NAME:
                    shutil.copy2(f, tmp / f.name)
            meta = {s.path.name: s.metadata for s in base.shards}
            for fname, specs in files.items():
                write_safetensors(tmp / fname, specs, meta[fname])
            with ExitStack() as stack:
                shard_views: dict[str, np.ndarray] = {}
                for fname in files:
                    shard_views.update(stack.enter_context(writable_views(tmp / fname)))
                _apply_chunks(view, shard_views)
            index = {"metadata": {"total_size": sum(s.nbytes for specs in files.values() for s in specs)},
                     "weight_map": {s.name: fname for fname, specs in files.items() for s in specs}}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return m


@dataclass(frozen=True)
class PatchStats:
    version: int
    base_version: int | None
    values: str
    tensors_changed: int
    tensors_added: int
    tensors_removed: int
    elements_changed: int
    elements_total: int
    patch_bytes: int
    chunks: int
    chunk_bytes_min: int
    chunk_bytes_max: int
    history: list[int] | None = None  # ulp2: the versions of the change history it is coded against

    @property
    def density(self) -> float:
        return self.elements_changed / self.elements_total if self.elements_total else 0.0

    @property
    def bits_per_element(self) -> float:
        return 8 * self.patch_bytes / self.elements_changed if self.elements_changed else 0.0

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["density"] = self.density
        d["bits_per_changed_element"] = self.bits_per_element
        return d


def inspect_patch(path: str | os.PathLike, *, verify: bool = True) -> PatchStats:
    with open_patch(path) as view:
        if verify:
            view.verify_chunks()
        m = view.manifest
        sizes = [c.size for c in m.chunks]
        return PatchStats(
            version=m.version,
            base_version=m.base_version,
            values=m.values,
            tensors_changed=sum(t.op == PATCH for t in m.tensors),
            tensors_added=sum(t.op == FULL for t in m.tensors),
            tensors_removed=sum(t.op == REMOVE for t in m.tensors),
            elements_changed=m.elements_changed,
            elements_total=m.elements_total,
            patch_bytes=m.patch_bytes,
            chunks=len(sizes),
            chunk_bytes_min=min(sizes, default=0),
            chunk_bytes_max=max(sizes, default=0),
            history=list(m.history[0]) if m.history is not None else None,
        )


def export_patch(path: str | os.PathLike, out: str | os.PathLike, base: str | os.PathLike | None = None) -> Manifest:
    """Write the decoded patch in the safetensors layout (see docs/FORMAT.md and
    :mod:`sparrowd.decoded`): ``<name>.indices`` and ``<name>.values`` per patched tensor,
    ``<name>.full`` per tensor written whole, and a table of every touched tensor. ``base``: the
    base checkpoint, which an ulp2 patch is decoded against."""
    check_output(out)
    with open_patch(path) as view, ExitStack() as stack:
        m = view.manifest
        if m.values == ULP2 and base is None:
            raise InputError(f"{path} is an ulp2 patch: its positions are coded against the base; give --base")
        bits = None
        if base is not None:
            ck = stack.enter_context(open_checkpoint(base))
            check_base(m, ck)
            check_history(m, None)
            bits = {name: t.bits for name, t in ck.items()}
        d = decode_patch(m, view.chunks, bits)
    with atomic_file(Path(out)) as tmp:
        write_decoded(d, tmp)
    return m
