"""Making and applying patches, tensor by tensor.

:class:`PatchEncoder` is streaming: ``add`` takes one tensor pair, extracts its
changes and returns the chunks that became full, so a caller can ship chunks
while later tensors are still being compared; ``finish`` flushes the rest and
returns the manifest. Large tensors are split by element range across chunks;
chunk sizes track the target through a running estimate of the compression
ratio (zstd's output size is only known after compressing).

Applying is three pure steps a driver can put around its own storage:
``check_base`` (fingerprints of every tensor the patch touches),
``apply_segments`` (scatter into writable arrays the caller prepared with the
base bits: overwrite for absolute values, integer add on the order key for
ulp), and ``check_result``. :func:`apply_patch` chains them in memory.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Executor, Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar, cast

import blake3
import numpy as np
import zstandard

from ..errors import BaseMismatchError, FormatError, InputError, IntegrityError
from .bits import RawTensor, dtype_info, uint_type, ulp2_context, ulp_apply, ulp_encode
from .chunk import (
    ABSOLUTE,
    DENSE,
    SPARSE,
    ULP,
    ULP2,
    Chunk,
    Ranked,
    Segment,
    code_segment,
    decode_chunk,
    encode_chunk,
    encode_file_chunk,
    encode_segment,
    is_ulp,
    join_ranks,
    rank_changes,
    ranked_part,
    ranking,
)
from .chunk import ranked as whole_ranks  # add_extract's argument is called `ranked`
from .extract import SHORT_FP, diff_bits, diff_fingerprint, diff_values, fingerprint, fp_equal, split_ranges
from .history import History
from .manifest import FULL, MAX_FILE, PATCH, REMOVE, ChunkEntry, FileEntry, Manifest, TensorEntry, check_file_name
from .workers import Workers, urgent

if TYPE_CHECKING:
    from .chunk import EncodedSegment, RankPart

T = TypeVar("T")

__all__ = [
    "PatchEncoder",
    "DEFAULT_CHUNK_SIZE",
    "auto_chunk_size",
    "one_chunk_size",
    "encode_patch",
    "check_base",
    "check_segments",
    "apply_segments",
    "check_result",
    "check_history",
    "apply_patch",
    "new_targets",
]

DEFAULT_CHUNK_SIZE = 2 << 20
MIN_CHUNK_SIZE = 4 << 10
DEFAULT_LEVEL = 3
AUTO_CHUNKS = 16  # chunks a patch is cut into by default, between the two sizes below
MIN_AUTO_CHUNK_SIZE = 256 << 10
LARGE_SWARM = 16  # rollouts beyond which patches are cut twice as fine (auto_chunk_size)
ONE_CHUNK_ROUND_TRIPS = 4  # a patch the trainer sends in this many round trips goes as one chunk...
ONE_CHUNK_BYTES = 1 << 20  # ...or, where its uplink or the round trip is unknown, one of this size
MAX_ONE_CHUNK = 16 << 20  # ...and never as one chunk larger than this (memory a stream holds)


def one_chunk_size(send_rate: float | None = None, round_trip: float | None = None) -> int:
    """The largest patch sent as one chunk: what the trainer's uplink (``send_rate``, bytes a second)
    sends in ``ONE_CHUNK_ROUND_TRIPS`` round trips between regions (``round_trip``, seconds), at most
    ``MAX_ONE_CHUNK``; ``ONE_CHUNK_BYTES`` where either is unknown (None; an unlimited uplink is 0 or
    None). In whole 4 KiB."""
    if send_rate and send_rate > 0 and round_trip is not None and round_trip >= 0:
        size = min(MAX_ONE_CHUNK, int(send_rate * round_trip * ONE_CHUNK_ROUND_TRIPS))
    else:
        size = ONE_CHUNK_BYTES
    return size // (4 << 10) * (4 << 10)


def auto_chunk_size(expected_bytes: int, rollouts: int | None = None, *, send_rate: float | None = None,
                    round_trip: float | None = None) -> int:
    """The chunk size for a patch of about ``expected_bytes``, in whole 4 KiB.

    A patch the trainer sends in a few round trips (``one_chunk_size``: 4 of them at its uplink
    ``send_rate``, 1 MiB where that or ``round_trip`` is unknown) goes as one chunk, the chunk size
    being that limit, so that a patch a little larger than the last stays whole. One chunk crosses
    to every region in stripes from its first block and is relayed block by block, so it reaches
    every node a few blocks after its last byte leaves the trainer; cut in two to eight, the chunks
    leave the trainer side by side, each at a fraction of its rate, and the later ones wait for
    relays still busy with the first (evidence: docs/history/DESIGN-NOTES.md#chunk-size-one-chunk).

    A larger patch is cut into a sixteenth of it, between 256 KiB and 2 MiB (``DEFAULT_CHUNK_SIZE``):
    enough chunks that relays pipeline them, few enough that requests cost little CPU (evidence:
    docs/history/DESIGN-NOTES.md#chunk-size-sixteenth). A swarm of more than
    ``LARGE_SWARM`` rollouts (``rollouts``, as the trainer's daemon counts them) gets a thirty-second,
    down to 128 KiB: the last chunk to leave the trainer still has a region of many nodes to spread
    through, a few relays deep, and each hop costs time in proportion to the chunk. There every rollout is a
    box of its own, so the cost per request is spread over as many CPUs."""
    one = one_chunk_size(send_rate, round_trip)
    if expected_bytes <= one:
        return max(one, MIN_AUTO_CHUNK_SIZE)
    chunks, least = AUTO_CHUNKS, MIN_AUTO_CHUNK_SIZE
    if rollouts is not None and rollouts > LARGE_SWARM and expected_bytes > MIN_AUTO_CHUNK_SIZE:
        chunks, least = 2 * AUTO_CHUNKS, MIN_AUTO_CHUNK_SIZE // 2
    size = min(DEFAULT_CHUNK_SIZE, max(least, int(expected_bytes) // chunks))
    return size // (4 << 10) * (4 << 10)


LAG = 2  # chunks an encoder with a pool keeps closing at once by default (PatchEncoder's lag)


class PatchEncoder:
    """Streams tensor pairs in, chunks out; ``finish`` gives the manifest."""

    def __init__(
        self,
        *,
        version: int,
        base_version: int | None,
        values: str = ULP,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        level: int = DEFAULT_LEVEL,
        meta: Mapping[str, str] | None = None,
        pool: Executor | None = None,
        history: History | None = None,
        lag: int = LAG,
    ):
        """``pool``: threads to encode segments on while the caller goes on (the order of the
        chunks does not depend on it). ``history``: for ulp2, the change history of the patches
        before this one, which every receiver holds (codec.history); the manifest names it.
        ``lag``: chunks closing at once on the pool (compressing, for whole tensors the bulk of the
        work); a chunk's cut depends on the compressed sizes of the chunks before it up to ``lag``
        back, so the same ``lag`` cuts the same chunks with a pool or without."""
        if values not in (ABSOLUTE, ULP, ULP2):
            raise InputError(f"value mode must be 'ulp2', 'ulp' or 'absolute', not {values!r}")
        if chunk_size < MIN_CHUNK_SIZE:
            raise InputError(f"chunk size must be at least {MIN_CHUNK_SIZE} bytes")
        if version < 0 or (base_version is not None and not 0 <= base_version < version):
            raise InputError(f"version {version} must be above its base version {base_version}")
        self.version, self.base_version, self.values = version, base_version, values
        self.chunk_size = chunk_size
        self.meta = dict(meta or {})
        if lag < 1:
            raise InputError("lag must be at least 1")
        self._level, self._lag = level, lag
        self._cctx = _compressor(level)
        self._tensors: dict[str, TensorEntry] = {}
        self._chunks: list[ChunkEntry] = []
        self._files: dict[str, FileEntry] = {}
        self._pool = pool
        # segments encoded as they arrive; a flush lays out and compresses
        self._pending: list[Future[EncodedSegment]] = []
        self._pending_est = 0.0  # estimated raw bytes pending
        # With a pool, chunks close on it too: up to `lag` of them in flight, settled in order. A chunk's
        # cut depends on the compressed sizes of the chunks before it only up to `lag` back, with a pool
        # or without, so the output depends neither on timing nor on the pool.
        self._inflight: deque[tuple[Future[Chunk], float]] = deque()
        self._coder: _ChunkCoder | None = None  # ulp2 with a pool: codes the current chunk's streams
        if history is not None and values != ULP2:
            raise InputError("a change history is for ulp2 patches only")
        self.history = history if history is not None and history.versions else None
        self._moved: dict[str, tuple[np.ndarray, np.ndarray]] | None = {}  # ulp2: what the next history holds
        self._reset: set[str] = set()
        self._ratio = 0.6  # compressed bytes / estimated raw bytes, recalibrated after every chunk
        self._finished = False

    def _fp(self, fp: bytes) -> bytes:
        """A fingerprint as the manifest carries it: a format 2 (ulp2) manifest, its first 8 bytes."""
        return fp[:SHORT_FP] if self.values == ULP2 else fp

    # ------------------------------------------------------------ input side

    def add(self, name: str, old: RawTensor | None, new: RawTensor | None) -> list[Chunk]:
        """Add one tensor: ``old`` None means new, ``new`` None means removed."""
        if self._finished:
            raise RuntimeError("PatchEncoder.add after finish")
        if name in self._tensors:
            raise InputError(f"tensor {name!r} added twice")
        if old is None and new is None:
            raise InputError(f"tensor {name!r}: neither side given")
        if new is None:
            old = cast(RawTensor, old)  # (not both None)
            self._tensors[name] = TensorEntry(name, REMOVE, None, None, self._fp(fingerprint(old.bits)), None)
            self._reset.add(name)
            return []
        if old is None or old.dtype != new.dtype or old.shape != new.shape:
            return self._add_full(name, old, new)
        idx = diff_bits(old.bits, new.bits)
        if idx.size == 0:
            return []
        return self.add_extract(name, old, new, idx, fingerprint(old.bits), fingerprint(new.bits))

    def add_extract(
        self,
        name: str,
        old: RawTensor,
        new: RawTensor,
        indices: np.ndarray,
        old_fp: bytes,
        new_fp: bytes,
        old_values: np.ndarray | None = None,
        new_values: np.ndarray | None = None,
        ranked: Ranked | None = None,
    ) -> list[Chunk]:
        """Add a same-shape tensor whose changed ``indices`` (and, optionally, the
        old and new bits there) were found elsewhere, e.g. on a GPU. ``ranked``: for ulp2,
        the changes' classes and ranks if the diff worked them out already (:func:`rank_changes`);
        otherwise they are, here. ``old.bits`` is the base, or the base with the new bits at
        ``indices`` when ``old_values`` gives the old ones."""
        if indices.size == 0:
            return []
        info = dtype_info(new.dtype)
        nv = new.bits[indices] if new_values is None else new_values
        ov = None
        if is_ulp(self.values) and info.is_float:
            ov = old.bits[indices] if old_values is None else old_values
            data, mode = ulp_encode(ov, nv), self.values
        else:
            data, mode = nv, ABSOLUTE
        self._tensors[name] = TensorEntry(name, PATCH, new.dtype, new.shape, self._fp(old_fp), self._fp(new_fp),
                                          int(indices.size))
        if mode != ULP2:
            return self._push(Segment(name, new.dtype, SPARSE, mode, 0, new.numel, data, indices))
        cast("dict[str, tuple[np.ndarray, np.ndarray]]", self._moved)[name] = (indices, data)  # (None once finished)
        # ulp2 codes positions by the base's exponent classes: the base's bits, and its bits at the changed
        # positions as given (a kept copy may already hold the new ones there).
        hist = self.history.get(name) if self.history is not None else None
        if ranked is None:  # the history's classes are taken in the same scan of the base
            ranked = whole_ranks(old.bits, new.dtype, indices, ov, None if hist is None else hist.positions)
        if hist is not None:
            hist = hist.with_classes(ranked.hist_cls)
        row = new.shape[-1] if len(new.shape) >= 2 else 0
        return self._push(Segment(name, new.dtype, SPARSE, mode, 0, new.numel, data, indices, old.bits, ranked, hist,
                                  row))

    def _add_full(self, name: str, old: RawTensor | None, new: RawTensor) -> list[Chunk]:
        self._reset.add(name)
        self._tensors[name] = TensorEntry(
            name,
            FULL,
            new.dtype,
            new.shape,
            self._fp(fingerprint(old.bits)) if old is not None else None,
            self._fp(fingerprint(new.bits)),
            new.numel,
            old.dtype if old is not None else None,
            old.shape if old is not None else None,
        )
        if new.numel == 0:
            return []
        return self._push(Segment(name, new.dtype, DENSE, ABSOLUTE, 0, new.numel, new.bits))

    def add_file(self, name: str, data: bytes | bytearray | memoryview) -> list[Chunk]:
        """Add one of the model's non-tensor files (``config.json``, the tokenizer): its chunks,
        each at most ``chunk_size`` bytes of it."""
        if self._finished:
            raise RuntimeError("PatchEncoder.add_file after finish")
        try:
            check_file_name(name)
        except FormatError as e:
            raise InputError(str(e)) from None
        if name in self._files:
            raise InputError(f"file {name!r} added twice")
        view = memoryview(data).cast("B")
        if len(view) > MAX_FILE:
            raise InputError(f"file {name!r}: {len(view)} bytes, more than {MAX_FILE} (is it weights?)")
        self._files[name] = FileEntry(name, len(view), blake3.blake3(view).digest())
        out = self._settle(0)  # the tensor chunks in flight go first, in the order they were cut
        for start in range(0, len(view), self.chunk_size):
            c = encode_file_chunk(name, start, view[start : start + self.chunk_size], self._cctx)
            self._chunks.append(ChunkEntry(c.hash, c.size, c.raw_size, (), c.file))
            out.append(c)
        return out

    # ------------------------------------------------------------ chunking

    @staticmethod
    def _raw_per_element(seg: Segment) -> float:
        w = seg.data.dtype.itemsize
        return w if seg.kind == DENSE else (2 + (1 if is_ulp(seg.values) else w))

    def _push(self, seg: Segment) -> list[Chunk]:
        out: list[Chunk] = []
        per = self._raw_per_element(seg)
        while True:
            room = self.chunk_size / self._ratio - self._pending_est
            if self._pending and room < self.chunk_size / self._ratio / 16:
                out += self._flush()
                continue
            fit = max(1, int(room / per))
            if fit >= seg.count:
                self._pending.append(self._encode(seg))
                self._pending_est += seg.count * per
                return out
            head, seg = _split(seg, fit)
            self._pending.append(self._encode(head))
            self._pending_est += head.count * per
            out += self._flush()

    def _encode(self, seg: Segment) -> Future[EncodedSegment]:
        if self._pool is None:
            return _done(encode_segment(seg))
        encoded = urgent(self._pool, encode_segment, seg)
        if seg.values != ULP2:
            return encoded
        if self._coder is None:
            self._coder = _ChunkCoder(self._pool)
        return self._coder.add(encoded)

    def _flush(self) -> list[Chunk]:
        """Close the pending segments into a chunk; returns the chunks settled meanwhile, in order."""
        pending, est = self._pending, self._pending_est
        self._pending, self._pending_est = [], 0.0
        self._coder = None  # the next chunk's streams start from fresh contexts
        if self._pool is None:
            self._inflight.append((_done(_close_chunk(pending, self._cctx)), est))
        else:
            self._inflight.append((_when_done(self._pool, pending, _close_chunk, pending, None, self._level), est))
        return self._settle(self._lag)  # with a pool or without, so that both cut the same chunks

    def _settle(self, keep: int) -> list[Chunk]:
        """Take closed chunks in order until at most ``keep`` are in flight: each recalibrates the
        compressed-to-estimated ratio the next cuts use, and joins the manifest's list."""
        out = []
        while len(self._inflight) > keep:
            fut, est = self._inflight.popleft()
            chunk = fut.result()
            if est > 0:
                self._ratio = 0.5 * self._ratio + 0.5 * (chunk.size / est)
            self._chunks.append(ChunkEntry(chunk.hash, chunk.size, chunk.raw_size, chunk.segments))
            out.append(chunk)
        return out

    def finish(self) -> tuple[Manifest, list[Chunk]]:
        """Flush what is pending; the manifest lists every chunk handed out."""
        if self._finished:
            raise RuntimeError("PatchEncoder.finish called twice")
        self._finished = True
        rest = self._flush() if self._pending else []
        rest += self._settle(0)
        manifest = Manifest(
            version=self.version,
            base_version=self.base_version,
            values=self.values,
            chunk_size=self.chunk_size,
            tensors=tuple(self._tensors[n] for n in sorted(self._tensors)),
            chunks=tuple(self._chunks),
            meta=self.meta,
            files=tuple(self._files[n] for n in sorted(self._files)),
            history=None if self.history is None else (self.history.versions, self.history.fingerprint()),
        )
        manifest.validate()  # with every chunk's segments: they add up to each tensor's changes
        if self.values == ULP2:  # which format 2 does not list (the chunks' headers do): as a reader has it
            manifest = replace(manifest, chunks=tuple(c if c.file is not None else replace(c, segments=None)
                                                      for c in manifest.chunks))
        return manifest, rest

    def next_history(self, pool: Executor | None = None) -> History:
        """After :meth:`finish`: the change history once this patch is applied, for the next ulp2
        patch of the chain (a patch without a base starts one afresh). ``pool``: as for
        ``History.after``. Called once: the encoder lets go of the changes' positions here (they
        may be views of a caller's page-locked buffer, which must be free for reuse as soon as the
        merge is done, not when whoever ran this drops the encoder)."""
        if not self._finished:
            raise RuntimeError("PatchEncoder.next_history before finish")
        if self._moved is None:
            raise RuntimeError("PatchEncoder.next_history called twice")
        moved, self._moved = self._moved, None
        start = History() if self.base_version is None or self.history is None else self.history
        return start.after(self.version, moved, self._reset, pool=pool)


DIFFS_AHEAD = 2  # tensors encode_patch has queued for diffing ahead of the one it cuts, per thread


def _compressor(level: int) -> zstandard.ZstdCompressor:
    return zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)


class _ChunkCoder:
    """Codes one chunk's ulp2 streams in order, each from the contexts the one before left, as
    soon as each segment is encoded: on the worker that encoded it, or the one that coded the
    segment before, going on down the line while the next is ready (never waiting, and never
    queued behind the diffs). A large chunk's coding is serial; done so, it runs beside the
    diffs rather than all on one thread when the chunk closes."""

    def __init__(self, pool: Executor):
        self._pool, self._state = pool, ulp2_context()
        # (encoded, coded), in chunk order
        self._line: deque[tuple[Future[EncodedSegment], Future[EncodedSegment]]] = deque()
        self._lock, self._running = threading.Lock(), False

    def add(self, encoded: Future[EncodedSegment]) -> Future[EncodedSegment]:
        coded: Future[EncodedSegment] = Future()
        with self._lock:
            self._line.append((encoded, coded))
        if encoded.done():  # here, on the caller's thread: leave the coding to the pool
            urgent(self._pool, self._drain)
        else:
            encoded.add_done_callback(lambda _: self._drain())
        return coded

    def _drain(self) -> None:
        with self._lock:
            if self._running:
                return
            self._running = True
        while True:
            with self._lock:
                if not self._line or not self._line[0][0].done():
                    self._running = False
                    return
                encoded, coded = self._line.popleft()
            try:
                coded.set_result(code_segment(encoded.result(), self._state))
            except BaseException as exc:  # noqa: BLE001 - handed on to whoever waits for the chunk
                coded.set_exception(exc)


def _when_done(pool: Executor, deps: list[Future[Any]], fn: Callable[..., T], *args: Any) -> Future[T]:
    """``fn(*args)`` as a job on ``pool`` queued once every future in ``deps`` is done (from their
    callbacks), so that no worker ever waits on a job queued behind it; it fails at once, with the
    first failure among ``deps``, if any failed."""
    out: Future[T] = Future()
    lock = threading.Lock()
    # The callbacks stay on ``deps`` after they ran: they reach the work only through ``job``, which
    # ``run`` empties, so that no cycle (future -> callback -> futures) keeps the segments, and the
    # buffers they view, alive until the garbage collector finds it.
    job: dict[str, Any] = {"deps": list(deps), "call": (fn, args), "left": len(deps)}

    def run() -> None:
        waited, (f, a) = job.pop("deps"), job.pop("call")
        try:
            for d in waited:
                d.result()
            out.set_result(f(*a))
        except BaseException as exc:  # noqa: BLE001 - handed on to whoever waits for ``out``
            out.set_exception(exc)

    def ready(_: Future[Any] | None) -> None:
        with lock:
            job["left"] -= 1
            if job["left"] > 0:
                return
        if any(d.exception() is not None for d in job["deps"]):
            run()
            return
        try:
            urgent(pool, run)
        except RuntimeError:  # the pool is shutting down: run it here
            run()

    if not deps:
        job["left"] = 1
        ready(None)
    for d in deps:
        d.add_done_callback(ready)
    return out


def _close_chunk(pending: list[Future[EncodedSegment]], cctx: zstandard.ZstdCompressor | None,
                 level: int = DEFAULT_LEVEL) -> Chunk:
    """A chunk from its segments as they are encoded (on a pool: with a compressor of its own)."""
    return encode_chunk([f.result() for f in pending], cctx if cctx is not None else _compressor(level))


def _done(value: T) -> Future[T]:
    done: Future[T] = Future()
    done.set_result(value)
    return done


def _split(seg: Segment, k: int) -> tuple[Segment, Segment]:
    """The first ``k`` elements of a segment, and the rest; ranges stay disjoint."""
    if seg.kind == DENSE:
        cut = seg.start + k
        return (
            Segment(seg.name, seg.dtype, DENSE, seg.values, seg.start, cut, seg.data[:k]),
            Segment(seg.name, seg.dtype, DENSE, seg.values, cut, seg.stop, seg.data[k:]),
        )
    indices = cast(np.ndarray, seg.indices)  # a sparse segment's
    cut = int(indices[k - 1]) + 1
    r = (None, None) if seg.ranked is None else seg.ranked.split(k)
    return (
        Segment(seg.name, seg.dtype, SPARSE, seg.values, seg.start, cut, seg.data[:k], indices[:k], seg.base, r[0],
                seg.history, seg.row),
        Segment(seg.name, seg.dtype, SPARSE, seg.values, cut, seg.stop, seg.data[k:], indices[k:], seg.base, r[1],
                seg.history, seg.row),
    )


def _same_layout(a: RawTensor | None, b: RawTensor | None) -> bool:
    return a is not None and b is not None and a.dtype == b.dtype and a.shape == b.shape


def _diff_whole(old: np.ndarray, new: np.ndarray, rank_dtype: str | None, hist_pos: np.ndarray | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[bytes | None, bytes], RankPart | None,
                           np.ndarray | None]:
    """A worker's job: diff and fingerprint a whole tensor, and for ulp2 (``rank_dtype``) rank the
    changes within their classes in the same pass, block by block while each is in cache (and class
    the change history's entries, ``hist_pos``, there too)."""
    classes = ranking(old, rank_dtype, hist_pos) if rank_dtype else None
    idx, ov, nv, fo, fn = diff_fingerprint(old, new, classes=classes)
    return idx, ov, nv, (fo, fn), ranked_part(classes), None if classes is None else classes.hist_cls


def _diff_part(old: np.ndarray, new: np.ndarray, lo: int, hi: int, rank_dtype: str | None,
               hist_pos: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, RankPart | None, np.ndarray | None]:
    """The same for the part ``[lo, hi)`` of a large tensor (no fingerprints: they need the whole;
    ``hist_pos`` from ``lo``)."""
    classes = ranking(old, rank_dtype, hist_pos) if rank_dtype else None
    idx, ov, nv = diff_values(old, new, lo, hi, classes=classes)
    return idx, ov, nv, ranked_part(classes), None if classes is None else classes.hist_cls


def _fingerprints(pool: Executor, old: RawTensor, new: RawTensor) -> tuple[bytes, bytes]:
    fo, fn = pool.submit(fingerprint, old.bits), pool.submit(fingerprint, new.bits)
    return fo.result(), fn.result()


def encode_patch(
    old: Mapping[str, RawTensor],
    new: Mapping[str, RawTensor],
    *,
    version: int,
    base_version: int | None,
    values: str = ULP,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    threads: int = 2,
    on_tensor: Callable[[str, int], None] | None = None,
    meta: Mapping[str, str] | None = None,
    files: Mapping[str, bytes] | None = None,
    history: History | None = None,
) -> tuple[Manifest, list[Chunk]]:
    """Diff two snapshots into a patch; chunks come back in manifest order.

    A pipeline: ``threads`` workers compare tensors (large ones in parts),
    fingerprint the changed ones (for ulp2 they also rank the changes within
    their classes) and encode the segments the calling thread cuts from them
    in name order, so the output does not depend on timing.
    ``on_tensor(name, changed)`` reports progress. ``files``: non-tensor files to carry
    (an anchor's config and tokenizer). ``history``: for ulp2, the change history to code against
    (:class:`PatchEncoder`).
    """
    meta = {**(meta or {}), "elements_total": str(sum(t.numel for t in new.values()))}
    names = sorted(set(old) | set(new))
    chunks: list[Chunk] = []
    with Workers(max(1, threads), "sparrowd-diff") as pool:
        enc = PatchEncoder(version=version, base_version=base_version, values=values, chunk_size=chunk_size,
                           meta=meta, pool=pool, history=history)

        def submit(name: str) -> tuple[str, list[Future[Any]] | None]:
            o, n = old.get(name), new.get(name)
            if not _same_layout(o, n):
                return name, None
            o, n = cast(RawTensor, o), cast(RawTensor, n)  # (both there)
            rank = n.dtype if values == ULP2 and dtype_info(n.dtype).is_float else None
            hist = history.get(name) if rank and history is not None else None
            ranges = split_ranges(n.numel)
            if len(ranges) == 1:  # one job diffs and fingerprints in a single read of both sides
                return name, [pool.submit(_diff_whole, o.bits, n.bits, rank, None if hist is None else hist.positions)]
            return name, [pool.submit(_diff_part, o.bits, n.bits, lo, hi, rank,
                                      None if hist is None else hist.within(lo, hi).positions - lo)
                          for lo, hi in ranges]

        # Diffs are queued only a few tensors ahead of the one being cut: enough that no worker idles,
        # few enough that the diffs' outputs waiting to be cut stay few. The segments' encoding and the
        # chunks' closing go ahead of them (urgent), so a chunk's chain keeps up with the diffs.
        ahead = deque(submit(name) for name in names[:DIFFS_AHEAD * max(1, threads)])
        later = iter(names[len(ahead):])
        while ahead:
            name, parts = ahead.popleft()
            following = next(later, None)
            if following is not None:
                ahead.append(submit(following))
            o, n = old.get(name), new.get(name)
            if parts is None:
                chunks += enc.add(name, o, n)
                changed = n.numel if n is not None else 0
                if on_tensor:
                    on_tensor(name, changed)
                continue
            o, n = cast(RawTensor, o), cast(RawTensor, n)  # parts: both there, of the same layout
            res = [p.result() for p in parts]
            if len(res) == 1:
                (idx, ov, nv, fps, part, hist_cls), = res
                ranked = join_ranks([part], idx, hist_cls=hist_cls) if part is not None else None
            else:
                idx, ov, nv = (np.concatenate([r[i] for r in res]) for i in range(3))
                fps = _fingerprints(pool, o, n) if idx.size else None
                ranked = None
                if any(r[3] is not None for r in res):
                    # a part without changes was not scanned: its census is needed all the same (and
                    # its history's classes, which are then read from the base as segments are encoded)
                    ranks = [r[3] if r[3] is not None else rank_changes(o.bits, n.dtype, r[0], start=lo, stop=hi)
                             for r, (lo, hi) in zip(res, split_ranges(n.numel))]
                    hist_cls = [r[4] for r in res]
                    ranked = join_ranks(ranks, idx, hist_cls=None if any(h is None for h in hist_cls)
                                        else np.concatenate(hist_cls))
            changed = int(idx.size)
            if changed:
                chunks += enc.add_extract(name, o, n, idx, *cast("tuple[bytes, bytes]", fps), ov, nv, ranked)
            if on_tensor:
                on_tensor(name, changed)
        for name, data in sorted((files or {}).items()):
            chunks += enc.add_file(name, data)
        manifest, rest = enc.finish()  # the last chunks close on the pool too
    return manifest, chunks + rest


# ---------------------------------------------------------------- applying


def check_base(manifest: Manifest, base: Mapping[str, RawTensor]) -> None:
    """Every tensor the patch reads or replaces must be in the base with its fingerprint."""
    for t in manifest.tensors:
        if t.base_fp is None:
            if t.name in base and t.op == FULL:
                raise BaseMismatchError(f"tensor {t.name!r}: the patch adds it but the base already has it")
            continue
        b = base.get(t.name)
        if b is None:
            raise BaseMismatchError(f"tensor {t.name!r}: missing from the base")
        if t.op == PATCH and (b.dtype != t.dtype or b.shape != t.shape):
            raise BaseMismatchError(
                f"tensor {t.name!r}: base is {b.dtype}{list(b.shape)}, patch expects {t.dtype}"
                f"{list(cast('tuple[int, ...]', t.shape))}"
            )
        if not fp_equal(fingerprint(b.bits), t.base_fp):
            raise BaseMismatchError(f"tensor {t.name!r}: base fingerprint differs (wrong base version?)")


def new_targets(manifest: Manifest, base: Mapping[str, RawTensor]) -> dict[str, np.ndarray]:
    """Writable result arrays in memory: a copy of the base for patched tensors."""
    out = {}
    for t in manifest.tensors:
        if t.op == PATCH:
            out[t.name] = np.array(base[t.name].bits, copy=True)
        elif t.op == FULL:
            out[t.name] = np.zeros(t.numel, dtype=uint_type(dtype_info(cast(str, t.dtype)).itemsize))
    return out


def check_segments(manifest: Manifest, entry: ChunkEntry, segments: list[Segment]) -> None:
    """A decoded chunk must carry exactly what the manifest says it does, or (format 2, whose
    manifest does not list a chunk's segments) only segments that fit the manifest's tensors."""
    got = tuple((s.name, s.start, s.stop, s.count) for s in segments)
    if entry.segments is not None and got != entry.segments:
        raise IntegrityError(f"chunk {entry.hash.hex()[:16]}: segments differ from the manifest")
    for s in segments:
        try:
            t = manifest.tensor(s.name)
        except KeyError:
            t = None
        if t is None or t.op == REMOVE or s.stop > t.numel:
            raise FormatError(f"chunk segment {s.name!r}: no tensor of the manifest has the range "
                              f"[{s.start}, {s.stop})")
        if s.dtype != t.dtype:
            raise FormatError(f"chunk segment {s.name!r}: dtype {s.dtype} but the manifest says {t.dtype}")
        if (t.op == PATCH) != (s.kind == SPARSE) or (is_ulp(s.values) and manifest.values != s.values):
            raise FormatError(f"chunk segment {s.name!r}: {s.kind}/{s.values} does not fit "
                              f"a {t.op} of a {manifest.values} patch")


def apply_segments(
    manifest: Manifest, entry: ChunkEntry, segments: list[Segment], targets: Mapping[str, np.ndarray]
) -> None:
    """Scatter one decoded chunk into ``targets`` after checking it against the manifest."""
    check_segments(manifest, entry, segments)
    for s in segments:
        out = targets[s.name]
        if s.kind == DENSE:
            out[s.start : s.stop] = s.data
        elif is_ulp(s.values):
            out[s.indices] = ulp_apply(out[s.indices], s.data)
        else:
            out[s.indices] = s.data


def check_result(manifest: Manifest, targets: Mapping[str, np.ndarray]) -> None:
    for t in manifest.tensors:
        if t.op != REMOVE and not fp_equal(fingerprint(targets[t.name]), t.result_fp):
            raise IntegrityError(f"tensor {t.name!r}: result fingerprint differs after applying")


def check_history(manifest: Manifest, history: History | None) -> History | None:
    """The history to decode ``manifest``'s chunks with: the one it names, which ``history`` must be
    (BaseMismatchError otherwise, before anything is decoded), or None when it names none."""
    if manifest.history is None:
        return None
    versions, fp = manifest.history
    if history is None or history.fingerprint() != fp:
        have = "none" if history is None or not history.versions else f"that of {list(history.versions)}"
        raise BaseMismatchError(f"version {manifest.version} is coded against the change history of versions "
                                f"{list(versions)}; the history here is {have} (apply the chain in order, or "
                                "start again from an anchor)")
    return history


def apply_patch(
    manifest: Manifest, chunks: Iterable[bytes], base: Mapping[str, RawTensor], history: History | None = None
) -> dict[str, RawTensor | None]:
    """Apply in memory. Returns every touched tensor's result (None when removed).

    ``chunks`` yields the chunk bytes in manifest order; each is hash-checked. ``history``: the
    change history an ulp2 patch names, if it names one (codec.history).
    """
    check_base(manifest, base)
    history = check_history(manifest, history)
    targets = new_targets(manifest, base)
    bases = {name: t.bits for name, t in base.items()}  # what ulp2 segments are coded against
    it = iter(chunks)
    for entry in manifest.chunks:
        data = next(it, None)
        if data is None:
            raise FormatError(f"patch has {len(manifest.chunks)} chunks, fewer were given")
        apply_segments(manifest, entry, decode_chunk(data, expect_hash=entry.hash, base=bases, history=history),
                       targets)
    check_result(manifest, targets)
    return {
        t.name: None if t.op == REMOVE
        else RawTensor(cast(str, t.dtype), cast("tuple[int, ...]", t.shape), targets[t.name])
        for t in manifest.tensors
    }
