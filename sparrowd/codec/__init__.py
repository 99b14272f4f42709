"""The patch codec: pure functions from weight snapshots to chunks and back (no I/O)."""

from .bits import DTYPES, RawTensor, dtype_info
from .chunk import ABSOLUTE, ULP, ULP2, Chunk, Segment, chunk_hash, decode_chunk
from .extract import diff_bits, fingerprint
from .history import History
from .manifest import FULL, PATCH, REMOVE, ChunkEntry, Manifest, TensorEntry
from .patch import (
    DEFAULT_CHUNK_SIZE,
    PatchEncoder,
    apply_patch,
    apply_segments,
    check_base,
    check_history,
    check_result,
    encode_patch,
    new_targets,
)
from .patchfile import PatchView, parse_patch, patch_parts

__all__ = [
    "ABSOLUTE",
    "ULP",
    "ULP2",
    "FULL",
    "PATCH",
    "REMOVE",
    "DEFAULT_CHUNK_SIZE",
    "DTYPES",
    "RawTensor",
    "dtype_info",
    "Chunk",
    "ChunkEntry",
    "Segment",
    "Manifest",
    "TensorEntry",
    "PatchEncoder",
    "PatchView",
    "apply_patch",
    "apply_segments",
    "check_base",
    "check_history",
    "History",
    "check_result",
    "chunk_hash",
    "decode_chunk",
    "diff_bits",
    "encode_patch",
    "fingerprint",
    "new_targets",
    "parse_patch",
    "patch_parts",
]
