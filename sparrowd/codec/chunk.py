"""Segments and chunks: the unit that travels.

A *segment* is one tensor's changes inside the element range ``[start, stop)``
of its flat index space: either ``sparse`` (sorted changed positions and their
values) or ``dense`` (every element of the range: new, reshaped or retyped
tensors, and anchors). The ranges of one tensor's segments never overlap, so
segments apply in any order.

A *chunk* is one zstd frame holding whole segments. Decompressed it reads::

    b"SPC1" | u32 LE header length | msgpack header | blobs...

where the header is ``{"segments": [...]}``, each segment a map giving its
tensor, dtype, range, count, encodings and the byte length of each of its
blobs. Every blob belongs to a *stream* (``unary``, ``rem``, ``sign``, ``mag``,
``esc``, then byte planes ``p0``..``p7``), and the body is laid out stream by
stream (all segments' ``unary`` blobs, then all ``rem`` blobs, ...), so each
zstd block holds bytes of one kind and its entropy coder is not diluted by
the others. Blob contents (see :mod:`.bits`):

* sparse indices: gaps ``idx[i] - idx[i-1] - 1`` (the first from ``start``),
  Rice-coded with the parameter ``index_k``: a bit-packed unary stream of
  quotients, then a bit-packed stream of ``k``-bit remainders;
* absolute values: the new bit patterns, rotated left one bit for floats
  (sign to the bottom, exponent in the top byte), one blob per byte plane;
* ulp values: for a distance ``d != 0`` the bit-packed signs (1: up), then
  ``|d| - 1`` clipped to one byte plane, 255 meaning "escape"; the escapes
  (``|d| - 1 - 255``, in order) follow in full-width byte planes;
* dense values: like absolute values, for every element of the range.

An ``ulp2`` segment (format 2) codes the same ulp distances against the base
the receiver holds. Each changed position is coded as its rank among the
elements of the segment whose base bit pattern has the same exponent (its
*class*): elements of small magnitude change far more often under AdamW than
large ones, so per class the gaps are short and predictable. The header adds
``class_lo`` (where the 16 classes start); its one blob is the stream of an
adaptive binary range coder holding the class table (each class's count and
gap parameter), every class's gaps, then every change's ulp distance. Decoding
needs the base bits of the segment's range.

A *file chunk* carries a slice of one of the model's non-tensor files
(``config.json``, the tokenizer) instead: its header is ``{"segments": [],
"file": [name, start, stop]}`` and the body is those bytes as they are. It
decodes to no segments, so every tensor decoder passes over it.

A chunk is named by the BLAKE3 hash of its compressed bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

import blake3
import numpy as np
import zstandard

from ..errors import FormatError, IntegrityError
from ..schema import Int, List, NonNegInt, Str, fields, pack, unpack
from .bits import (
    CENSUS,
    NCLASS,
    ClassRanks,
    class_lo,
    class_positions,
    class_scan,
    class_sort,
    dtype_info,
    exponent_field,
    from_planes,
    rice_index,
    rice_positions,
    rotl1,
    rotr1,
    to_planes,
    uint_type,
    ulp2_context,
    ulp2_history,
    ulp2_pack,
    ulp2_rows_pack,
    ulp2_rows_unpack,
    ulp2_unpack,
    ulp_codes,
    ulp_streams,
)
from .history import DOWN, MASKS, TensorHistory

if TYPE_CHECKING:
    from typing import TypeAlias

    from .bits import DType
    from .history import History

    Bytes: TypeAlias = bytes | bytearray | memoryview

    # What rank_changes gives for a part of a tensor: (lo, cls, rank, census).
    RankPart: TypeAlias = tuple[int, np.ndarray, np.ndarray, np.ndarray]
    # What an ulp2 segment's coded stream codes (bits.ulp2_pack's arguments but the state).
    Coding: TypeAlias = tuple[np.ndarray, list[list[int]], np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]

__all__ = [
    "Segment",
    "Ranked",
    "rank_changes",
    "rank_and_fingerprint",
    "ranked",
    "ranking",
    "ranked_part",
    "join_ranks",
    "Chunk",
    "encode_chunk",
    "encode_segment",
    "code_segment",
    "EncodedSegment",
    "decode_chunk",
    "encode_file_chunk",
    "decode_file_chunk",
    "chunk_hash",
    "MAX_CHUNK_RAW",
    "ABSOLUTE",
    "ULP",
    "ULP2",
    "is_ulp",
    "SPARSE",
    "DENSE",
]

CHUNK_MAGIC = b"SPC1"
ABSOLUTE, ULP = "absolute", "ulp"
ULP2 = "ulp2"  # ulp distances, positions and values coded against the base's exponent classes (format 2)
SPARSE, DENSE = "sparse", "dense"
# Largest decompressed chunk accepted: far above any sane target, small enough
# that a hostile frame cannot make a reader allocate without bound.
MAX_CHUNK_RAW = 256 << 20


def chunk_hash(data: Bytes) -> bytes:
    return blake3.blake3(data).digest()


@dataclass(frozen=True, eq=False)
class Segment:
    """One tensor's changes in ``[start, stop)``.

    ``data`` holds unsigned integers of the dtype's width: for ``sparse`` +
    ``absolute`` and for ``dense`` the new bit patterns; for ``sparse`` +
    ``ulp`` the zigzag-coded ulp distances. ``indices`` (int64, absolute flat
    positions) exists for sparse segments only.
    """

    name: str
    dtype: str
    kind: str
    values: str
    start: int
    stop: int
    data: np.ndarray
    indices: np.ndarray | None = None
    base: np.ndarray | None = None  # ulp2, encoding: the base tensor's flat bits (its classes)
    ranked: Ranked | None = None  # ulp2, encoding: the changes' classes and ranks (rank_changes)
    history: TensorHistory | None = None  # ulp2, encoding: the tensor's change history (codec.history)
    row: int = 0  # ulp2, encoding: the tensor's row length (its last dimension; 0 for a vector), for row mode

    @property
    def count(self) -> int:
        return int(self.data.size)


@dataclass(frozen=True, eq=False)
class Ranked:
    """A tensor's changed positions ranked within their exponent classes by one scan of its base,
    done where the diff is (its worker threads), so that encoding a segment only offsets ranks.

    ``lo``: the tensor's class ``lo`` (bits.class_lo); ``cls`` and ``rank``: each of the segment's
    changes' class and its rank among its class's elements from element 0 of the tensor; ``census``:
    the class counts every ``CENSUS`` elements from 0 (bits.class_scan); ``indices`` and ``old``: all
    the tensor's changed positions and, where ``base`` already holds the new bits there, the base's
    bits at them (to count the stretch between a census row and a segment's start); ``hist_cls``:
    the classes of the tensor's change-history entries in the base, if the diff's scan took them."""

    lo: int
    cls: np.ndarray
    rank: np.ndarray
    census: np.ndarray
    indices: np.ndarray
    old: np.ndarray | None = None
    hist_cls: np.ndarray | None = None

    def split(self, k: int) -> tuple[Ranked, Ranked]:
        head = replace(self, cls=self.cls[:k], rank=self.rank[:k])
        return head, replace(self, cls=self.cls[k:], rank=self.rank[k:])

    def counts_before(self, base: np.ndarray, x: int, shift: int, mask: int) -> np.ndarray:
        """Each class's count of elements in ``[0, x)``."""
        row = x // CENSUS
        a = row * CENSUS
        counts: np.ndarray = self.census[row].copy()
        if a < x:
            i, j = np.searchsorted(self.indices, [a, x])
            old = None if self.old is None else self.old[i:j]
            counts += class_scan(base, a, x, self.indices[i:j], shift, mask, self.lo, old)[2][-1]
        return counts


def rank_changes(base: np.ndarray, dtype: str, indices: np.ndarray, old: np.ndarray | None = None,
                 start: int = 0, stop: int | None = None, *, hasher: object | None = None,
                 hist_pos: np.ndarray | None = None, hist_cls: np.ndarray | None = None) -> RankPart:
    """Scan ``base[start:stop)`` (a whole tensor, or a part starting at a multiple of ``CENSUS``) for
    the classes and ranks of its changed ``indices`` (all inside the part); :func:`join_ranks` puts
    a tensor's parts together. ``old``: as for :class:`Ranked`; ``hasher``, ``hist_pos`` and
    ``hist_cls``: as for ``class_scan``."""
    if start % CENSUS:
        raise ValueError("rank_changes: a part must start at a multiple of CENSUS")
    c = ranking(base, dtype)  # its lo is the same for every part of the tensor
    return (c.lo, *class_scan(base, start, base.size if stop is None else stop, indices, c.shift, c.mask, c.lo, old,
                              hasher=hasher, hist_pos=hist_pos, hist_cls=hist_cls))


def ranked(base: np.ndarray, dtype: str, indices: np.ndarray, old: np.ndarray | None = None,
           hist_pos: np.ndarray | None = None, *, hasher: object | None = None) -> Ranked:
    """The :class:`Ranked` of a whole tensor's changes (:func:`rank_changes`), with the classes of
    its change history's entries ``hist_pos`` (``Ranked.hist_cls``) taken in the same scan.
    ``hasher``: as for ``class_scan``."""
    hist_cls = None if hist_pos is None else np.empty(hist_pos.size, np.uint8)
    part = rank_changes(base, dtype, indices, old, hasher=hasher, hist_pos=hist_pos, hist_cls=hist_cls)
    return join_ranks([part], indices, old, hist_cls)


def rank_and_fingerprint(base: np.ndarray, dtype: str, indices: np.ndarray, old: np.ndarray | None = None,
                         hist_pos: np.ndarray | None = None) -> tuple[Ranked, bytes]:
    """:func:`ranked` and the tensor's fingerprint (``extract.fingerprint``), in one read of
    ``base`` where the C extension is there (each stretch hashed just after its class scan, from
    cache), else in two."""
    from . import bits
    from .extract import fingerprint

    native = bits._native
    h = native.hasher() if native is not None and base.size else None
    r = ranked(base, dtype, indices, old, hist_pos, hasher=h)
    return r, (fingerprint(base) if h is None else native.digest(h))


def ranking(base: np.ndarray, dtype: str, hist_pos: np.ndarray | None = None) -> ClassRanks:
    """The class scan of a tensor's base for a diff to do in its own pass (``classes`` of
    :func:`~.extract.diff_fingerprint`); :func:`ranked_part` then gives what :func:`rank_changes`
    gives. ``hist_pos``: the positions of the tensor's change history (from the diffed range's
    start), whose classes the scan takes too."""
    shift, mask = exponent_field(dtype)
    return ClassRanks(shift, mask, class_lo(base, 0, base.size, shift, mask),  # lo: from the whole tensor
                      hist_pos=hist_pos)


def ranked_part(classes: ClassRanks | None) -> RankPart | None:
    """A :func:`ranking` the diff filled in, as :func:`rank_changes` gives it (None if it had no changes)."""
    if classes is None or classes.cls is None:
        return None
    return classes.lo, classes.cls, cast(np.ndarray, classes.rank), cast(np.ndarray, classes.census)


def join_ranks(parts: list[RankPart], indices: np.ndarray, old: np.ndarray | None = None,
               hist_cls: np.ndarray | None = None) -> Ranked:
    """One :class:`Ranked` from the :func:`rank_changes` of a tensor's consecutive parts."""
    if len(parts) == 1:
        lo, cls, rank, census = parts[0]
        return Ranked(lo, cls, rank, census, indices, old, hist_cls)
    offset = np.zeros(NCLASS, np.int64)
    ranks, rows = [], []
    for lo, cls, rank, census in parts:
        ranks.append(rank + offset[cls])
        rows.append(census[:-1] + offset)
        offset = offset + census[-1]
    rows.append(offset[None])
    return Ranked(parts[0][0], np.concatenate([p[1] for p in parts]), np.concatenate(ranks), np.concatenate(rows),
                  indices, old, hist_cls)


def is_ulp(values: str) -> bool:
    """Values that are zigzag ulp distances once decoded (``ulp``, ``ulp2``)."""
    return values in (ULP, ULP2)


@dataclass(frozen=True, eq=False)
class Chunk:
    hash: bytes
    data: bytes
    raw_size: int
    segments: tuple[tuple[str, int, int, int], ...]  # (name, start, stop, count)
    file: tuple[str, int, int] | None = None  # a file chunk: (file name, start, stop)

    @property
    def size(self) -> int:
        return len(self.data)


# ---------------------------------------------------------------- encoding


STREAMS = ("unary", "rem", "sign", "mag", "esc", "p0", "p1", "p2", "p3", "p4", "p5", "p6", "p7", "coded", "rows")
_RANK = {name: i for i, name in enumerate(STREAMS)}


def segment_streams(kind: str, values: str, itemsize: int, rows: bool = False) -> tuple[str, ...]:
    """The streams a segment's blobs belong to, in the order of its ``blobs`` lengths (an ulp2
    segment has one, range-coded; in row mode, the rows stream before it)."""
    if values == ULP2:
        return ("rows", "coded") if rows else ("coded",)
    idx = ("unary", "rem") if kind == SPARSE else ()
    vals = ("sign", "mag", "esc") if values == ULP else tuple(f"p{i}" for i in range(itemsize))
    return idx + vals


def _encode_values(seg: Segment, info: DType) -> list[np.ndarray]:
    if seg.values == ULP:
        return ulp_streams(seg.data)
    bits = rotl1(seg.data) if info.is_float else seg.data
    return list(to_planes(bits))


def _history_context(hist: TensorHistory, bits: np.ndarray, dtype: str, lo: int) -> tuple[np.ndarray, np.ndarray]:
    """Per history element (``bits``: the base's bits there): its context, class * MASKS + mask - 1
    (the mask of the patches that moved it), and the direction it last moved in, 1 up or 2 down
    (docs/FORMAT.md, "History")."""
    shift, mask = exponent_field(dtype)
    exp = ((bits >> bits.dtype.type(shift)) & bits.dtype.type(mask)).astype(np.int64)
    cls = np.clip(exp - lo, 0, NCLASS - 1).astype(np.uint8)
    return cls * MASKS + (hist.state >> 1) - 1, 1 + (hist.state & DOWN)


# Row mode (docs/FORMAT.md, "Row mode"): a matrix whose changes sit in few of its rows (an embedding,
# whose rows of tokens absent from recent batches do not move) says first which rows changed, then
# codes its changes against those rows alone, laid end to end.
ROW_MODE_MIN_ROWS = 64  # rows a segment must touch to be worth a rows stream
ROW_MODE_GAIN = 0.97  # row mode is taken where its estimate is below this share of the plain one


def _row_spans(start: int, stop: int, length: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For the rows ``rows`` (sorted) of a segment ``[start, stop)``: where each one's part of the
    segment starts, its length, and where it starts in the rows laid end to end."""
    starts = np.maximum(start, rows * length)
    lens = np.minimum(stop, rows * length + length) - starts
    return starts, lens, np.cumsum(lens) - lens


def _compacted(bits: np.ndarray, starts: np.ndarray, lens: np.ndarray, offs: np.ndarray) -> np.ndarray:
    """The rows' elements laid end to end (a copy: the changed rows are a small part of the tensor)."""
    total = int(lens.sum())
    return bits[np.repeat(starts - offs, lens) + np.arange(total)]


def _row_contexts(start: int, stop: int, length: int, hist: TensorHistory | None) -> np.ndarray:
    """Per row the segment touches: 1 where it holds an element of the segment's history."""
    first = start // length
    ctx = np.zeros((stop - 1) // length - first + 1, np.uint8)
    if hist is not None and hist.positions.size:
        ctx[hist.positions // length - first] = 1
    return ctx


def _in_rows(hist: TensorHistory | None, length: int, rows: np.ndarray, starts: np.ndarray,
             offs: np.ndarray) -> TensorHistory | None:
    """The history entries in ``rows``, at their places in the rows laid end to end."""
    if hist is None or not hist.positions.size:
        return hist
    k = np.minimum(np.searchsorted(rows, hist.positions // length), rows.size - 1)
    keep = rows[k] == hist.positions // length
    pos = hist.positions[keep]
    return TensorHistory(offs[k[keep]] + (pos - starts[k[keep]]), hist.state[keep],
                         None if hist.cls is None else hist.cls[keep])


def _segment_old(seg: Segment) -> np.ndarray | None:
    """Where the segment's base already holds the new bits at its changes (a kept copy the diff
    brought up to date): the old bits there, which its ranks were taken with; else None."""
    r, indices = cast(Ranked, seg.ranked), cast(np.ndarray, seg.indices)
    if r.old is None or not indices.size:
        return None
    k = int(np.searchsorted(r.indices, indices[0]))  # the segment's changes: a run of the tensor's
    return r.old[k:k + indices.size]


def _bernoulli_bits(n: int, k: int) -> float:
    if n <= 0 or k <= 0 or k >= n:
        return 0.0
    p = k / n
    return cast(float, -n * (p * np.log2(p) + (1 - p) * np.log2(1 - p)))


def _row_mode(seg: Segment) -> tuple[Segment, bytes] | None:
    """For a segment whose changes sit in few of the rows it touches: the same changes as a segment of
    those rows laid end to end, and the rows stream that says which rows they are; else None."""
    length, start, stop = seg.row, seg.start, seg.stop
    if length <= 0 or not seg.count or (stop - 1) // length - start // length + 1 < ROW_MODE_MIN_ROWS:
        return None
    indices = cast(np.ndarray, seg.indices)  # an ulp2 segment is sparse
    rows = np.unique(indices // length)
    hist = seg.history.within(start, stop) if seg.history is not None else None
    ctx = _row_contexts(start, stop, length, hist)
    flags = np.zeros(ctx.size, np.uint8)
    flags[rows - start // length] = 1
    starts, lens, offs = _row_spans(start, stop, length, rows)
    total = int(lens.sum())
    # Estimates, positions only (what row mode changes): every element a Bernoulli trial at the
    # segment's density, against the rows' flags (given their context) and the rows' elements alone.
    rows_bits = sum(_bernoulli_bits(int((ctx == c).sum()), int(flags[ctx == c].sum())) for c in (0, 1))
    if rows_bits + _bernoulli_bits(total, seg.count) >= ROW_MODE_GAIN * _bernoulli_bits(stop - start, seg.count):
        return None
    r, old = cast(Ranked, seg.ranked), _segment_old(seg)
    base = _compacted(cast(np.ndarray, seg.base), starts, lens, offs)
    k = np.searchsorted(rows, indices // length)
    idx = offs[k] + (indices - starts[k])
    shift, mask = exponent_field(seg.dtype)
    ranked = Ranked(r.lo, *class_scan(base, 0, total, idx, shift, mask, r.lo, old), idx, old)
    inner = Segment(seg.name, seg.dtype, SPARSE, ULP2, 0, total, seg.data, idx, base, ranked,
                    _in_rows(hist, length, rows, starts, offs))
    return inner, ulp2_rows_pack(flags, ctx)


def _prepare_ulp2(seg: Segment) -> tuple[int, Coding, bytes | None]:
    """``class_lo`` of an ulp2 segment, what :func:`~.bits.ulp2_pack` codes, and in row mode the rows
    stream: the expensive part, done as segments arrive; the coding itself waits for the chunk (its
    contexts carry from one segment to the next)."""
    r = seg.ranked
    if seg.base is None or r is None:
        raise ValueError(f"ulp2 segment {seg.name}: the base and the changes' ranks are needed to encode")
    rowed = _row_mode(seg)
    if rowed is not None:
        inner, rows = rowed
        return (*_prepare_ulp2(inner)[:2], rows)
    shift, mask = exponent_field(seg.dtype)
    before = r.counts_before(seg.base, seg.start, shift, mask) if seg.start else None  # per class
    rank, cls, codes = r.rank, r.cls, seg.data
    hist = seg.history.within(seg.start, seg.stop) if seg.history is not None else None
    if hist is not None and hist.positions.size:
        # Changes of history elements are coded as such; the others' ranks count no history element.
        hctx, hdir, flags, again_codes, rank, cls, codes = ulp2_history(
            seg.base, seg.dtype, r.lo, cast(np.ndarray, seg.indices), cls, rank, codes, _segment_old(seg),
            hist.positions, hist.state, hist.cls)
    else:
        hctx = hdir = flags = np.empty(0, np.uint8)
        again_codes = codes[:0]
    rank, table, codes = class_sort(cls, rank, codes, before)
    return r.lo, (rank, table, codes, hctx, hdir, flags, again_codes), None


def _encode_segment(seg: Segment) -> tuple[dict[str, Any], list[np.ndarray], Coding | None]:
    info = dtype_info(seg.dtype)
    if seg.data.dtype != uint_type(info.itemsize):
        raise ValueError(f"segment {seg.name}: data must be {uint_type(info.itemsize)}")
    blobs: list[np.ndarray] = []
    k = 0
    lo: int | None = None
    coding: Coding | None = None
    rows: bytes | None = None
    if seg.values == ULP2:
        lo, coding, rows = _prepare_ulp2(seg)
        if rows is not None:  # the rows stream goes first; the coded stream joins it when the chunk closes
            blobs.append(np.frombuffer(rows, np.uint8))
    elif seg.kind == SPARSE:
        k, unary, rem = rice_index(cast(np.ndarray, seg.indices), seg.start)
        blobs += [unary, rem]
    elif seg.count != seg.stop - seg.start:
        raise ValueError(f"dense segment {seg.name}: {seg.count} values for range of {seg.stop - seg.start}")
    if seg.values != ULP2:
        blobs += _encode_values(seg, info)
    header: dict[str, Any] = {
        "name": seg.name,
        "dtype": seg.dtype,
        "kind": seg.kind,
        "values": seg.values,
        "start": seg.start,
        "stop": seg.stop,
        "count": seg.count,
        "index_k": k,
        "blobs": [int(b.nbytes) for b in blobs],
    }
    if lo is not None:
        header["class_lo"] = lo
    if rows is not None:
        header["rows"] = seg.row
    return header, blobs, coding


@dataclass(frozen=True, eq=False)
class EncodedSegment:
    """A segment with its header and blobs, ready to be laid out in a chunk; an ulp2 segment
    with what its coded stream codes instead (``coding``), coded when the chunk is laid out."""

    segment: Segment
    header: dict[str, Any]
    blobs: list[np.ndarray]
    coding: Coding | None = None


def encode_segment(seg: Segment) -> EncodedSegment:
    """The expensive part of making a chunk, done per segment (an encoder does it as segments
    arrive, so that closing a chunk only codes ulp2 streams, lays out and compresses)."""
    return EncodedSegment(seg, *_encode_segment(seg))


def code_segment(e: EncodedSegment, state: bytearray) -> EncodedSegment:
    """An ulp2 segment with its stream coded, from the chunk's contexts ``state`` as the segments
    before it in the chunk left them (moved on in place); any other segment as it is. A chunk's
    ulp2 segments must be coded in order, each exactly once."""
    if e.coding is None:
        return e
    blobs = [*e.blobs, np.frombuffer(ulp2_pack(*e.coding, state=state), np.uint8)]
    return EncodedSegment(e.segment, {**e.header, "blobs": [int(b.nbytes) for b in blobs]}, blobs)


def encode_chunk(segments: list[Segment | EncodedSegment], cctx: zstandard.ZstdCompressor) -> Chunk:
    """A chunk of ``segments``, in order; ulp2 streams not yet coded (:func:`code_segment`) are
    coded here, from fresh contexts (then all of the chunk's must be uncoded)."""
    encoded = [s if isinstance(s, EncodedSegment) else encode_segment(s) for s in segments]
    body: list[tuple[int, int, Any]] = []  # (stream rank, segment, blob: an array)
    headers: list[dict[str, Any]] = []
    state: bytearray | None = None
    for i, e in enumerate(encoded):
        if e.coding is not None:  # the chunk's ulp2 segments in order, each from the contexts the last left
            state = ulp2_context() if state is None else state
            e = code_segment(e, state)
        seg, header, blobs = e.segment, e.header, e.blobs
        headers.append(header)
        streams = segment_streams(seg.kind, seg.values, seg.data.dtype.itemsize, "rows" in header)
        body += [(_RANK[st], i, b) for st, b in zip(streams, blobs)]
    body.sort(key=lambda x: (x[0], x[1]))
    head = pack({"segments": headers})
    raw = b"".join([CHUNK_MAGIC, struct.pack("<I", len(head)), head, *(b for _, _, b in body)])
    data = cctx.compress(raw)
    return Chunk(
        hash=chunk_hash(data),
        data=data,
        raw_size=len(raw),
        segments=tuple((e.segment.name, e.segment.start, e.segment.stop, e.segment.count) for e in encoded),
    )


def encode_file_chunk(name: str, start: int, data: Bytes, cctx: zstandard.ZstdCompressor) -> Chunk:
    """Bytes ``[start, start + len(data))`` of the file ``name``, as one chunk."""
    span = (name, start, start + len(data))
    head = pack({"segments": [], "file": list(span)})
    raw = b"".join([CHUNK_MAGIC, struct.pack("<I", len(head)), head, data])
    out = cctx.compress(raw)
    return Chunk(hash=chunk_hash(out), data=out, raw_size=len(raw), segments=(), file=span)


# ---------------------------------------------------------------- decoding

_SEGMENT = {
    "name": Str,
    "dtype": Str,
    "kind": Str,
    "values": Str,
    "start": NonNegInt,
    "stop": NonNegInt,
    "count": NonNegInt,
    "index_k": Int,
    "blobs": List,
}


def _take(buf: memoryview, pos: int, n: int, what: str) -> tuple[memoryview, int]:
    if n < 0 or pos + n > len(buf):
        raise FormatError(f"chunk: {what} runs past the end of the chunk")
    return buf[pos : pos + n], pos + n


def _check_segment(h: dict[str, Any]) -> tuple[str, ...]:
    """Validate a segment header; returns the streams of its blobs."""
    fields(h, _SEGMENT, what="chunk segment")
    info = dtype_info(h["dtype"])
    kind, values, start, stop, n = h["kind"], h["values"], h["start"], h["stop"], h["count"]
    name = h["name"]
    if kind not in (SPARSE, DENSE) or values not in (ABSOLUTE, ULP, ULP2):
        raise FormatError(f"chunk segment {name!r}: unknown encoding {kind}/{values}")
    if is_ulp(values) and (kind != SPARSE or not info.is_float):
        raise FormatError(f"chunk segment {name!r}: ulp values need a sparse float segment")
    if stop < start or n > stop - start or (kind == DENSE and n != stop - start):
        raise FormatError(f"chunk segment {name!r}: count {n} does not fit range [{start}, {stop})")
    if values == ULP2:
        _, mask = exponent_field(h["dtype"])
        if not (NonNegInt(h.get("class_lo")) and h["class_lo"] <= mask):
            raise FormatError(f"chunk segment {name!r}: ulp2 needs class_lo, an exponent of its dtype")
    rows = "rows" in h
    if rows and (values != ULP2 or not NonNegInt(h["rows"]) or h["rows"] < 1 or n < 1):
        raise FormatError(f"chunk segment {name!r}: row mode is for ulp2 segments with changes, rows of 1 or more")
    streams = segment_streams(kind, values, info.itemsize, rows)
    lens = h["blobs"]
    if len(lens) != len(streams) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in lens):
        raise FormatError(f"chunk segment {name!r}: expected {len(streams)} blob lengths")
    return streams


def _decode_ulp2(h: dict[str, Any], blobs: list[memoryview], base: Callable[[str], np.ndarray | None] | None,
                 history: Callable[[str], TensorHistory | None] | None, state: bytearray) -> Segment:
    name, start, stop = h["name"], h["start"], h["stop"]
    w = dtype_info(h["dtype"]).itemsize
    bits = base(name) if base is not None else None
    if bits is None:
        raise FormatError(f"chunk segment {name!r}: ulp2 is coded against the base, which was not given")
    if bits.dtype.itemsize != w or stop > bits.size:
        raise FormatError(f"chunk segment {name!r}: the base tensor does not fit the segment")
    hist = history(name) if history is not None else None
    hist = hist.within(start, stop) if hist is not None else None
    if "rows" not in h:
        indices, data = _decode_ulp2_range(h, blobs[0], bits, start, stop, hist, state)
        return Segment(name, h["dtype"], SPARSE, ULP2, start, stop, data, indices)
    length = h["rows"]  # row mode: which rows changed, then the changes within them laid end to end
    rows = start // length + np.flatnonzero(ulp2_rows_unpack(blobs[0], _row_contexts(start, stop, length, hist)))
    if not rows.size:
        raise FormatError(f"chunk segment {name!r}: its rows stream names no row")
    starts, lens, offs = _row_spans(start, stop, length, rows)
    inner = _in_rows(hist, length, rows, starts, offs)
    indices, data = _decode_ulp2_range(h, blobs[1], _compacted(bits, starts, lens, offs), 0, int(lens.sum()), inner,
                                       state)
    k = np.searchsorted(offs, indices, side="right") - 1
    return Segment(name, h["dtype"], SPARSE, ULP2, start, stop, data, starts[k] + (indices - offs[k]))


def _decode_ulp2_range(h: dict[str, Any], blob: memoryview, bits: np.ndarray, start: int, stop: int,
                       hist: TensorHistory | None, state: bytearray) -> tuple[np.ndarray, np.ndarray]:
    """The changed positions in ``bits[start:stop)`` and their codes, from an ulp2 coded stream."""
    n = h["count"]
    shift, mask = exponent_field(h["dtype"])
    if hist is not None and hist.positions.size:
        hctx, hdir = _history_context(hist, bits[hist.positions], h["dtype"], h["class_lo"])
    else:
        hctx = hdir = np.empty(0, np.uint8)
    counts, ranks, grouped, again, again_codes = ulp2_unpack(blob, stop - start, n, bits.dtype.itemsize, hctx, hdir,
                                                             state)
    indices, perm = class_positions(bits, start, stop, shift, mask, h["class_lo"], counts, ranks,
                                    hist.positions if hist is not None else None)
    data = grouped[perm]
    if again_codes.size:  # the changes of history elements join the others in position order
        indices = np.concatenate([indices, cast(TensorHistory, hist).positions[again.astype(bool)]])
        data = np.concatenate([data, again_codes])
        order = np.argsort(indices, kind="stable")
        indices, data = indices[order], data[order]
    return indices, data


def _decode_segment(h: dict[str, Any], blobs: list[memoryview],
                    base: Callable[[str], np.ndarray | None] | None = None,
                    history: Callable[[str], TensorHistory | None] | None = None,
                    state: bytearray | None = None) -> Segment:
    info = dtype_info(h["dtype"])
    w = info.itemsize
    kind, values, start, stop, n = h["kind"], h["values"], h["start"], h["stop"], h["count"]
    name = h["name"]
    if values == ULP2:
        return _decode_ulp2(h, blobs, base, history, cast(bytearray, state))
    indices = None
    if kind == SPARSE:
        try:
            indices = rice_positions(blobs[0], blobs[1], n, h["index_k"], start, stop)
        except FormatError as e:
            raise FormatError(f"chunk segment {name!r}: {e}") from None
        blobs = blobs[2:]
    if values == ULP:
        try:
            data = ulp_codes(blobs[0], blobs[1], blobs[2], n, w)
        except FormatError as e:
            raise FormatError(f"chunk segment {name!r}: {e}") from None
    else:
        if any(len(b) != n for b in blobs):
            raise FormatError(f"chunk segment {name!r}: byte planes do not match {n} elements")
        data = from_planes(b"".join(blobs), n, w)
        if info.is_float:
            data = rotr1(data)
    return Segment(name, h["dtype"], kind, values, start, stop, data, indices)


def check_chunk_frame(data: Bytes) -> int:
    """The cheap part of decoding: a zstd frame declaring a sane content size (returned)."""
    try:
        size = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise FormatError(f"chunk: not a zstd frame ({e})") from None
    if size < 0 or size > MAX_CHUNK_RAW:
        raise FormatError("chunk: missing or oversized content size")
    return size


def _open_chunk(data: Bytes, expect_hash: bytes | None) -> tuple[dict[str, Any], memoryview, int]:
    """Hash check, decompression and header: (header, decompressed bytes, body offset)."""
    if expect_hash is not None and chunk_hash(data) != expect_hash:
        raise IntegrityError(f"chunk {expect_hash.hex()[:16]}: hash mismatch (corrupt or wrong chunk)")
    check_chunk_frame(data)
    try:
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=MAX_CHUNK_RAW)
    except zstandard.ZstdError as e:
        raise FormatError(f"chunk: cannot decompress ({e})") from None
    buf = memoryview(raw)
    if len(buf) < 8 or bytes(buf[:4]) != CHUNK_MAGIC:
        raise FormatError("chunk: bad magic")
    (hlen,) = struct.unpack_from("<I", buf, 4)
    head_bytes, pos = _take(buf, 8, hlen, "chunk header")
    head = fields(unpack(head_bytes, what="chunk header"), {"segments": List}, what="chunk header")
    return head, buf, pos


def _file_span(head: dict[str, Any]) -> tuple[str, int, int] | None:
    span = head.get("file")
    if span is None:
        return None
    if not (isinstance(span, list) and len(span) == 3 and isinstance(span[0], str)
            and all(NonNegInt(x) for x in span[1:]) and span[1] <= span[2]) or head["segments"]:
        raise FormatError("chunk header: a file chunk is [name, start, stop] with no segments")
    return span[0], span[1], span[2]


def decode_file_chunk(data: Bytes, *, expect_hash: bytes | None = None) -> tuple[tuple[str, int, int], memoryview]:
    """A file chunk's ``(name, start, stop)`` and bytes (FormatError for a tensor chunk)."""
    head, buf, pos = _open_chunk(data, expect_hash)
    span = _file_span(head)
    if span is None:
        raise FormatError("chunk: not a file chunk")
    body = buf[pos:]
    if len(body) != span[2] - span[1]:
        raise FormatError(f"file chunk {span[0]!r}: {len(body)} bytes for the range [{span[1]}, {span[2]})")
    return span, body


def decode_chunk(data: Bytes, *, expect_hash: bytes | None = None,
                 base: Mapping[str, np.ndarray] | Callable[[str], np.ndarray | None] | None = None,
                 history: History | Mapping[str, TensorHistory] | Callable[[str], TensorHistory | None] | None = None
                 ) -> list[Segment]:
    """Decode one chunk; checks its hash first when ``expect_hash`` is given. A file chunk
    decodes to no segments. ``base``: ``name -> flat bits`` of the base tensors (a mapping or a
    callable), needed by ulp2 segments only; ``history``: the change history (a
    :class:`~sparrowd.codec.history.History`) the patch was coded against, if it was."""
    if base is not None and not callable(base):
        base = base.get
    if history is not None and not callable(history):
        history = history.get
    head, buf, pos = _open_chunk(data, expect_hash)
    if _file_span(head) is not None:
        return []
    headers = head["segments"]
    order = []
    for i, h in enumerate(headers):
        for j, (st, ln) in enumerate(zip(_check_segment(h), h["blobs"])):
            order.append((_RANK[st], i, j, ln))
    order.sort()
    blobs: list[list[Any]] = [[None] * len(h["blobs"]) for h in headers]
    for _, i, j, ln in order:
        blobs[i][j], pos = _take(buf, pos, ln, f"blob {j} of segment {i}")
    if pos != len(buf):
        raise FormatError("chunk: trailing bytes after the last segment")
    # ulp2 segments decode in order, each from the contexts the one before left (as they were coded)
    state = ulp2_context() if any(h["values"] == ULP2 for h in headers) else None
    return [_decode_segment(h, b, base, history, state) for h, b in zip(headers, blobs)]
