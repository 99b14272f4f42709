"""Finding changed elements, and fingerprints of tensors.

With the optional C extension (``_native``, built at install time where a
compiler exists) one pass over each side does it all: compare (AVX2 where the
CPU has it), gather the changed positions with their old and new bits, and,
block by block while the block is in cache, feed both fingerprints and
(for the Publisher) write the new bits into the kept copy. Without it,
``diff_values`` walks the old and new bit patterns of a tensor in blocks of a
few hundred kilobytes (so the mask stays in cache). Each block is compared as
64-bit words (four bf16 elements per comparison), and only the few words that
differ are resolved to element positions with a second, tiny comparison. The
blocks of a large tensor are spread over a thread pool when one is given:
numpy releases the GIL in these kernels, so two cores nearly halve the time.

Fingerprints (XXH3-128 of the tensor's bytes: python-xxhash here, the
extension's vendored copy of the same library inside the fused pass) catch a
wrong base or a bad apply; they are not for security: chunks are named by
BLAKE3 and manifests are signed elsewhere.
"""

from __future__ import annotations

from typing import cast

import numpy as np
import xxhash

from .bits import NCLASS, ClassRanks

try:
    from . import _native
except ImportError:  # no compiler at install time: the numpy path gives the same result
    _native = None  # type: ignore[assignment]

__all__ = ["diff_bits", "diff_values", "diff_fingerprint", "split_ranges", "fingerprint", "fp_equal",
           "SHORT_FP", "BLOCK_WORDS", "PART_ELEMENTS"]

BLOCK_WORDS = 1 << 18  # 2 MiB of each side per block
PART_ELEMENTS = 1 << 24  # a unit of work for a thread pool


def fingerprint(bits: np.ndarray) -> bytes:
    """Fingerprint of a tensor's bytes (16 bytes, xxh3-128)."""
    if bits.size == 0:
        return xxhash.xxh3_128(b"").digest()
    return xxhash.xxh3_128(np.ascontiguousarray(bits).data.cast("B")).digest()


SHORT_FP = 8  # format 2 manifests carry each fingerprint's first 8 bytes


def fp_equal(computed: bytes | None, stored: bytes | None) -> bool:
    """Whether a fingerprint matches one a manifest or a marker stores, which may be its first
    :data:`SHORT_FP` bytes (format 2) rather than all 16."""
    if computed is None or stored is None:
        return computed is stored
    n = min(len(computed), len(stored))
    return n >= SHORT_FP and computed[:n] == stored[:n]


def _diff_words(ow: np.ndarray, nw: np.ndarray, lo: int, hi: int, per_word: int, lane: np.dtype
                ) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Changed positions in words ``[lo, hi)``, with their old and new bits (gathered while hot)."""
    idx: list[np.ndarray] = []
    olds: list[np.ndarray] = []
    news: list[np.ndarray] = []
    mask = np.empty(min(BLOCK_WORDS, hi - lo), dtype=bool)
    for s in range(lo, hi, BLOCK_WORDS):
        e = min(s + BLOCK_WORDS, hi)
        cand = np.flatnonzero(np.not_equal(ow[s:e], nw[s:e], out=mask[: e - s]))
        if cand.size:
            cand += s
            oc, nc = ow[cand], nw[cand]
            if per_word == 1:
                idx.append(cand)
                olds.append(oc.view(lane))
                news.append(nc.view(lane))
            else:
                ol, nl = oc.view(lane), nc.view(lane)
                lanes = np.flatnonzero(ol != nl)
                idx.append(cand[lanes // per_word] * per_word + lanes % per_word)
                olds.append(ol[lanes])
                news.append(nl[lanes])
    return idx, olds, news


def _diff_native(
    old: np.ndarray, new: np.ndarray, hash_old: bool = False, hash_new: bool = False, update: bool = False,
    classes: ClassRanks | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, bytes | None, bytes | None]:
    """One fused pass: compare, gather, and for each block while it is in cache
    the fingerprints asked for (the old side's before any update), with
    ``classes`` ulp2's class scan of the old side, and, with ``update``, the new
    bits written into ``old``. Outputs start with room for 1/32 of the input (3%
    density) and double when the scan runs out."""
    isz, n = old.dtype.itemsize, old.size
    cap = min(n + 32, max(1 << 15, n // 32))
    outs = [np.empty(cap, np.int64), np.empty(cap, old.dtype), np.empty(cap, old.dtype)]
    if classes is not None:
        outs += [np.empty(cap, np.uint8), np.empty(cap, np.int64)]  # each change's class and rank
        census = np.zeros(((n + classes.every - 1) // classes.every + 1, NCLASS), np.int64)
        state = np.zeros(2 + NCLASS, np.int64)  # where the class scan got to, whether it began, its counts
        hist = () if classes.hist_pos is None else (np.ascontiguousarray(classes.hist_pos, np.int64),
                                                    np.empty(classes.hist_pos.size, np.uint8))
    ho = _native.hasher() if hash_old else None
    hn = _native.hasher() if hash_new else None
    count = pos = 0
    while True:
        rank = None if classes is None else (classes.shift, classes.mask, classes.lo, outs[3][count:],
                                             outs[4][count:], census, classes.every, state, classes.widest, *hist)
        got, pos = _native.diff_into(old, new, isz, pos, n, outs[0][count:], outs[1][count:], outs[2][count:], False,
                                     update, ho, hn, rank)
        count += got
        if pos == n:
            break
        cap *= 2
        outs = [np.concatenate([x[:count], np.empty(cap - count, x.dtype)]) for x in outs]
    fo = _native.digest(ho) if ho is not None else None  # (a hasher exactly where one was asked for)
    fn = _native.digest(hn) if hn is not None else None
    if classes is not None and state[1]:
        census[-1] = state[2:]
        classes.cls, classes.rank, classes.census = outs[3][:count], outs[4][:count], census
        if hist:
            classes.hist_cls = hist[1]
    return outs[0][:count], outs[1][:count], outs[2][:count], fo, fn


def diff_fingerprint(
    old: np.ndarray, new: np.ndarray, *, hash_old: bool = True, update_old: bool = False,
    classes: ClassRanks | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, bytes | None, bytes]:
    """:func:`diff_values` over whole arrays, plus both fingerprints, reading each array once.
    ``hash_old=False`` skips the old side's fingerprint (the caller kept it) and returns None for it.
    ``update_old=True`` also brings ``old`` (writable) up to ``new`` where they differ: the caller's
    kept copy, updated in the same pass; the returned old values put it back. ``classes``: ulp2's
    class scan of ``old`` (before any update), done in the same pass (:class:`~.bits.ClassRanks`)."""
    if old.dtype != new.dtype or old.shape != new.shape or old.ndim != 1:
        raise ValueError("diff needs two 1-D arrays of the same unsigned dtype and length")
    if update_old and not (old.flags.writeable and old.flags.c_contiguous):
        raise ValueError("update_old needs a writable contiguous old array")
    if _native is None or old.size == 0:
        fo = fingerprint(old) if hash_old else None
        idx, ov, nv = diff_values(old, new, classes=classes)
        if update_old:
            old[idx] = nv
        return idx, ov, nv, fo, fingerprint(new)
    idx, ov, nv, fo, fn = _diff_native(np.ascontiguousarray(old), np.ascontiguousarray(new), hash_old, True,
                                       update_old, classes)
    return idx, ov, nv, fo, cast(bytes, fn)  # hash_new=True: never None


def diff_values(
    old: np.ndarray, new: np.ndarray, lo: int = 0, hi: int | None = None, *, native: bool = True,
    classes: ClassRanks | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Changed positions in ``[lo, hi)`` and the old and new bits there.

    ``old`` and ``new`` are 1-D arrays of the same unsigned dtype and length;
    ``lo`` and ``hi`` (elements) let a caller split a large tensor into parts
    for a thread pool (:func:`split_ranges`). Returns sorted int64 indices and
    two arrays of bit patterns, gathered while each block is still in cache.
    ``native=False`` forces the numpy path (tests compare the two). ``classes``:
    as for :func:`diff_fingerprint`, over ``[lo, hi)`` (a class scan from ``lo``).
    """
    if old.dtype != new.dtype or old.shape != new.shape or old.ndim != 1:
        raise ValueError("diff needs two 1-D arrays of the same unsigned dtype and length")
    hi = old.size if hi is None else hi
    whole_old, whole_new = old, new
    old, new = np.ascontiguousarray(old[lo:hi]), np.ascontiguousarray(new[lo:hi])
    if native and _native is not None and old.size:
        idx, ov, nv, _, _ = _diff_native(old, new, classes=classes)
        if lo:
            idx += lo
        return idx, ov, nv
    if classes is not None:  # the numpy diff, then the class scan
        idx, ov, nv = diff_values(whole_old, whole_new, lo, hi, native=False)
        classes.scan(whole_old, lo, hi, idx, native=native)
        return idx, ov, nv
    per_word = 8 // old.dtype.itemsize
    done = (old.size // per_word) * per_word
    idxs: list[np.ndarray] = []
    olds: list[np.ndarray] = []
    news: list[np.ndarray] = []
    if done:
        idxs, olds, news = _diff_words(
            old[:done].view(np.uint64), new[:done].view(np.uint64), 0, done // per_word, per_word, old.dtype
        )
    if done < old.size:
        tail = np.flatnonzero(old[done:] != new[done:]) + done
        idxs.append(tail)
        olds.append(old[tail])
        news.append(new[tail])
    if not idxs:
        empty = np.empty(0, old.dtype)
        return np.empty(0, np.int64), empty, empty
    out = np.concatenate(idxs).astype(np.int64, copy=False)
    if lo:
        out += lo
    return out, np.concatenate(olds), np.concatenate(news)


def diff_bits(old: np.ndarray, new: np.ndarray, lo: int = 0, hi: int | None = None) -> np.ndarray:
    """Sorted flat int64 indices in ``[lo, hi)`` where ``old`` and ``new`` differ."""
    return diff_values(old, new, lo, hi)[0]


def split_ranges(n: int, part: int = PART_ELEMENTS) -> list[tuple[int, int]]:
    """Element ranges of at most ``part`` elements (a multiple of 8) covering ``[0, n)``."""
    return [(s, min(s + part, n)) for s in range(0, n, part)] or [(0, 0)]
