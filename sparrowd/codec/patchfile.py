"""The ``.sprw`` patch file: a manifest and its chunks in one file.

Byte layout (all integers little-endian; see docs/FORMAT.md)::

    0   4   magic b"SPRW"
    4   4   u32 file format version (1)
    8   8   u64 manifest length M
    16  32  BLAKE3 of the manifest bytes
    48  M   manifest (msgpack)
    48+M    chunks, back to back, in manifest order; sizes from the manifest

The file ends exactly after the last chunk. Parsing works on any buffer (bytes
or an mmap) and returns zero-copy views of the chunks.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import blake3

from ..errors import FormatError, IntegrityError
from .manifest import Manifest

if TYPE_CHECKING:
    from mmap import mmap

__all__ = ["PatchView", "parse_patch", "patch_header", "FILE_MAGIC", "HEADER_SIZE"]

FILE_MAGIC = b"SPRW"
FILE_VERSION = 1
_HEAD = struct.Struct("<4sIQ32s")
HEADER_SIZE = _HEAD.size


def patch_header(manifest_bytes: bytes) -> bytes:
    return _HEAD.pack(FILE_MAGIC, FILE_VERSION, len(manifest_bytes), blake3.blake3(manifest_bytes).digest())


def patch_parts(manifest: Manifest, chunks: Iterable[bytes]) -> Iterable[bytes]:
    """The pieces of a patch file in order, for a writer that streams them."""
    mb = manifest.to_bytes()
    yield patch_header(mb)
    yield mb
    yield from chunks


@dataclass(frozen=True)
class PatchView:
    manifest: Manifest
    manifest_bytes: bytes
    chunks: tuple[memoryview, ...]  # in manifest order, not yet hash-checked

    def verify_chunks(self) -> None:
        from .chunk import chunk_hash

        for i, (entry, data) in enumerate(zip(self.manifest.chunks, self.chunks)):
            if chunk_hash(data) != entry.hash:
                raise IntegrityError(f"chunk {i} ({entry.hash.hex()[:16]}): hash mismatch, the patch is corrupt")


def parse_patch(buf: bytes | bytearray | memoryview | mmap, *, what: str = "patch") -> PatchView:
    mv = memoryview(buf).cast("B")
    if len(mv) < HEADER_SIZE:
        raise FormatError(f"{what}: too short to be a sparrowd patch ({len(mv)} bytes)")
    magic, ver, mlen, mhash = _HEAD.unpack_from(mv, 0)
    if magic != FILE_MAGIC:
        raise FormatError(f"{what}: not a sparrowd patch (bad magic)")
    if ver != FILE_VERSION:
        raise FormatError(f"{what}: patch file version {ver} is not supported (this reads {FILE_VERSION})")
    if HEADER_SIZE + mlen > len(mv):
        raise FormatError(f"{what}: truncated inside the manifest")
    mb = bytes(mv[HEADER_SIZE : HEADER_SIZE + mlen])
    if blake3.blake3(mb).digest() != mhash:
        raise IntegrityError(f"{what}: manifest hash mismatch, the patch is corrupt")
    manifest = Manifest.from_bytes(mb)
    pos = HEADER_SIZE + mlen
    chunks = []
    for entry in manifest.chunks:
        if pos + entry.size > len(mv):
            raise FormatError(f"{what}: truncated ({len(mv)} bytes, the manifest needs more)")
        chunks.append(mv[pos : pos + entry.size])
        pos += entry.size
    if pos != len(mv):
        raise FormatError(f"{what}: {len(mv) - pos} unexpected bytes after the last chunk")
    return PatchView(manifest, mb, tuple(chunks))
