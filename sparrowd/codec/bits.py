"""Raw bit patterns: the dtypes sparrowd knows and the integer transforms on them.

No float arithmetic ever touches a value. A tensor of a dtype whose item size is
``w`` bytes is handled as a flat array of ``w``-byte unsigned integers (its bit
patterns), so NaN payloads, -0.0, subnormals and infinities pass unchanged.

Transforms, all vectorised, all exact and invertible:

* ``order_key`` maps a sign-magnitude float's bits to an unsigned key that sorts
  like the float (``-NaN < -inf < ... < -0.0 < +0.0 < ... < +inf < +NaN``); it
  is a bijection on all ``2**(8w)`` patterns.
* the *ulp distance* from old to new is ``key(new) - key(old)`` modulo
  ``2**(8w)``, read as a signed integer and zigzag-coded, so 1-ulp moves become
  1 and 2 and any move at all (sign crossings, ±0, inf) is representable.
* ``rotl1`` moves a float's sign bit to the bottom so that the exponent fills
  the top byte, which makes byte planes of absolute values compress better.
* byte planes turn ``n`` integers of ``w`` bytes into ``w`` runs of ``n`` bytes
  (all low bytes, then the next bytes...), the layout that zstd's entropy coder
  does well with.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np

from ..errors import FormatError

if TYPE_CHECKING:
    from typing import TypeAlias

    # What the codec reads bytes from (np.frombuffer's own list, less what it never gets).
    Buffer: TypeAlias = bytes | bytearray | memoryview | np.ndarray

try:
    from . import _native as _native  # (re-exported: chunk and history read bits._native)
except ImportError:  # no compiler at install time: the numpy paths give the same bytes
    _native = None  # type: ignore[assignment]


def native_source_stale() -> bool:
    """Whether the C extension was built from another ``_native.c`` than the one beside it (a
    checkout whose rebuild failed keeps its old module: the build is optional, so pip says
    nothing). False where the source is not shipped or the module carries no digest."""
    src = Path(__file__).with_name("_native.c")
    built = getattr(_native, "SOURCE", "")
    if _native is None or not built or not src.is_file():
        return False
    return hashlib.blake2b(src.read_bytes(), digest_size=8).hexdigest() != built


if native_source_stale():
    warnings.warn("sparrowd's C extension was built from another version of sparrowd/codec/_native.c: "
                  "rebuild it (pip install -e .) and read the compiler's errors", RuntimeWarning, stacklevel=1)

__all__ = [
    "DType",
    "RawTensor",
    "DTYPES",
    "dtype_info",
    "uint_type",
    "sint_type",
    "order_key",
    "order_unkey",
    "ulp_encode",
    "ulp_apply",
    "ulp_add",
    "ascending",
    "ulp_streams",
    "ulp_codes",
    "zigzag",
    "unzigzag",
    "rotl1",
    "rotr1",
    "to_planes",
    "from_planes",
    "rice_k",
    "rice_encode",
    "rice_index",
    "rice_decode",
    "rice_positions",
    "exponent_field",
    "CENSUS",
    "class_scan",
    "ulp2_context",
    "ulp2_history",
    "ulp2_rows_pack",
    "ulp2_rows_unpack",
    "ulp2_pack",
    "ulp2_unpack",
    "MAX_ULP2_K",
    "class_ranks",
    "class_positions",
    "class_lo",
    "ClassRanks",
    "NCLASS",
]


@dataclass(frozen=True)
class DType:
    """A safetensors dtype as sparrowd sees it: a width and whether ulp applies."""

    name: str  # the safetensors spelling, e.g. "BF16"
    itemsize: int  # bytes per element
    is_float: bool  # sign-magnitude float: the ulp value mode applies
    numpy: str | None  # numpy's name for it, when numpy has one


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("BOOL", 1, False, "bool"),
        DType("U8", 1, False, "uint8"),
        DType("I8", 1, False, "int8"),
        DType("F8_E4M3", 1, True, None),
        DType("F8_E5M2", 1, True, None),
        DType("U16", 2, False, "uint16"),
        DType("I16", 2, False, "int16"),
        DType("F16", 2, True, "float16"),
        DType("BF16", 2, True, None),
        DType("U32", 4, False, "uint32"),
        DType("I32", 4, False, "int32"),
        DType("F32", 4, True, "float32"),
        DType("U64", 8, False, "uint64"),
        DType("I64", 8, False, "int64"),
        DType("F64", 8, True, "float64"),
    )
}

_UINT = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
_SINT = {1: np.dtype("<i1"), 2: np.dtype("<i2"), 4: np.dtype("<i4"), 8: np.dtype("<i8")}


def dtype_info(name: str) -> DType:
    try:
        return DTYPES[name]
    except KeyError:
        raise FormatError(f"unsupported dtype {name!r}") from None


def uint_type(itemsize: int) -> np.dtype:
    return cast(np.dtype, _UINT[itemsize])


def sint_type(itemsize: int) -> np.dtype:
    return cast(np.dtype, _SINT[itemsize])


def _sign_shift(a: np.ndarray) -> int:
    return a.dtype.itemsize * 8 - 1


def order_key(bits: np.ndarray) -> np.ndarray:
    """Monotone unsigned key of sign-magnitude float bit patterns (a bijection)."""
    t = bits.dtype.type
    sign = bits >> t(_sign_shift(bits))
    # sign 1 -> flip every bit; sign 0 -> flip only the sign bit.
    mask = (sign * t(np.iinfo(bits.dtype).max)) | t(1 << _sign_shift(bits))
    return cast(np.ndarray, bits ^ mask)


def order_unkey(key: np.ndarray) -> np.ndarray:
    """Inverse of :func:`order_key`."""
    t = key.dtype.type
    top = key >> t(_sign_shift(key))  # 1 for non-negative floats
    mask = ((t(1) - top) * t(np.iinfo(key.dtype).max)) | t(1 << _sign_shift(key))
    return cast(np.ndarray, key ^ mask)


def zigzag(d: np.ndarray) -> np.ndarray:
    """Signed -> unsigned, small magnitudes to small codes: 0,-1,1,-2 -> 0,1,2,3."""
    u = uint_type(d.dtype.itemsize)
    return cast(np.ndarray, ((d << d.dtype.type(1)) ^ (d >> d.dtype.type(_sign_shift(d)))).view(u))


def unzigzag(z: np.ndarray) -> np.ndarray:
    t = z.dtype.type
    return cast(np.ndarray, ((z >> t(1)) ^ (t(0) - (z & t(1)))).view(sint_type(z.dtype.itemsize)))


def ulp_encode(old: np.ndarray, new: np.ndarray, *, native: bool = True) -> np.ndarray:
    """Zigzag-coded ulp distances from ``old`` to ``new`` bit patterns (same width)."""
    if native and _native is not None and old.size:
        out = np.empty(old.size, old.dtype)
        _native.ulp_encode(np.ascontiguousarray(old), np.ascontiguousarray(new, old.dtype), old.dtype.itemsize, out)
        return out
    with np.errstate(over="ignore"):
        d = (order_key(new) - order_key(old)).view(sint_type(old.dtype.itemsize))
    return zigzag(d)


ESCAPE = 255  # a ulp magnitude byte at this value means "see the escape stream"


def ulp_streams(z: np.ndarray, *, native: bool = True) -> list[np.ndarray]:
    """The ``sign``, ``mag`` and ``esc`` streams of zigzag ulp codes (docs/FORMAT.md).

    With ``zm = z - 1`` (codes are never 0: every element changed), ``sign``
    packs the bits ``zm & 1`` MSB-first, ``mag`` holds ``min(zm >> 1, 255)``
    per element, and ``esc`` the byte planes of ``(zm >> 1) - 255`` where ``mag`` is 255.
    """
    w = z.dtype.itemsize
    if native and _native is not None:
        signs, narrow, esc = _native.ulp_streams(np.ascontiguousarray(z), w)
        return [np.frombuffer(signs, np.uint8), np.frombuffer(narrow, np.uint8),
                to_planes(np.frombuffer(esc, uint_type(w)))]
    t = z.dtype.type
    with np.errstate(over="ignore"):
        zm = z - t(1)  # zigzag z = 2|d| - (d < 0): zm = 2(|d| - 1) + up
    mag = zm >> t(1)
    narrow = np.minimum(mag, ESCAPE).astype(np.uint8)
    esc = mag[mag >= ESCAPE] - t(ESCAPE)
    return [np.packbits((zm & t(1)).astype(np.uint8)), narrow, to_planes(esc)]


def ulp_apply(old: np.ndarray, z: np.ndarray) -> np.ndarray:
    """New bit patterns from ``old`` and zigzag-coded ulp distances ``z``."""
    return ulp_add(old, unzigzag(z))


def ascending(a: np.ndarray) -> bool:
    """Whether ``a`` rises strictly (sorted, no repeats): one compare of neighbours, with no
    temporary wider than a bool (``np.diff`` makes one of the positions' own width)."""
    return bool(np.all(a[1:] > a[:-1]))


def ulp_add(old: np.ndarray, d: np.ndarray) -> np.ndarray:
    """New bit patterns from ``old`` and signed ulp distances ``d`` (same width)."""
    with np.errstate(over="ignore"):
        return order_unkey(order_key(old) + d.view(old.dtype))


def rotl1(bits: np.ndarray) -> np.ndarray:
    t = bits.dtype.type
    return cast(np.ndarray, (bits << t(1)) | (bits >> t(_sign_shift(bits))))


def rotr1(bits: np.ndarray) -> np.ndarray:
    t = bits.dtype.type
    return cast(np.ndarray, (bits >> t(1)) | (bits << t(_sign_shift(bits))))


def to_planes(a: np.ndarray, planes: int | None = None) -> np.ndarray:
    """Byte planes of unsigned integers: ``planes`` runs of ``len(a)`` bytes, low first.

    Planes above ``planes`` must be zero in every element (the caller chose
    ``planes`` from the maximum); they are dropped.
    """
    w = a.dtype.itemsize
    p = w if planes is None else planes
    b = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).view(np.uint8)
    return np.ascontiguousarray(b.reshape(-1, w)[:, :p].T)


def from_planes(buf: Buffer, n: int, itemsize: int, planes: int | None = None) -> np.ndarray:
    """Inverse of :func:`to_planes`: ``n`` unsigned integers of ``itemsize`` bytes."""
    p = itemsize if planes is None else planes
    src = np.frombuffer(buf, dtype=np.uint8)
    if src.size != n * p:
        raise FormatError(f"byte planes hold {src.size} bytes, expected {n * p}")
    if p == itemsize:
        out = np.ascontiguousarray(src.reshape(p, n).T)
    else:
        out = np.zeros((n, itemsize), dtype=np.uint8)
        out[:, :p] = src.reshape(p, n).T
    return out.reshape(-1).view(uint_type(itemsize))


@dataclass(frozen=True, eq=False)
class RawTensor:
    """A tensor as the codec sees it: dtype name, shape, and flat bit patterns.

    ``bits`` is a 1-D array of unsigned integers of the dtype's width (often a
    read-only view into a memory-mapped file); nothing here copies it.
    """

    dtype: str
    shape: tuple[int, ...]
    bits: np.ndarray

    def __post_init__(self) -> None:
        info = dtype_info(self.dtype)
        if self.bits.ndim != 1 or self.bits.dtype != uint_type(info.itemsize):
            raise ValueError(f"RawTensor bits must be 1-D {uint_type(info.itemsize)}, "
                             f"got {self.bits.dtype}{self.bits.shape}")
        n = 1
        for d in self.shape:
            n *= d
        if self.bits.size != n:
            raise ValueError(f"RawTensor: {self.bits.size} elements for shape {self.shape}")

    @property
    def numel(self) -> int:
        return int(self.bits.size)

    @property
    def nbytes(self) -> int:
        return int(self.bits.nbytes)


# ---------------------------------------------------------------- Rice coding
# Gaps between changed positions are close to geometric, for which a Rice code (quotient in
# unary, k low bits verbatim) is within a few hundredths of a bit of the entropy. Both streams are
# built and read with packbits/unpackbits: the unary stream has a 1 closing each quotient's run
# of 0s, so the positions of the 1s give every quotient at once.

MAX_RICE_K = 40


def _rice_candidates(n: int, total: int) -> range:
    """The Rice parameters worth costing for ``n`` gaps summing to ``total``.

    The optimum for a geometric source is near ``log2(mean * ln 2)``; the three
    candidates around it are costed exactly and the cheapest wins. The mean
    comes from exact integers so that every path picks the same ``k``.
    """
    mean = total / n
    k0 = int(math.log2(mean * 0.6931)) if mean >= 2 else 0
    return range(min(MAX_RICE_K, max(0, k0 - 1)), min(MAX_RICE_K, k0 + 1) + 1)


def ulp_codes(signs_buf: Buffer, narrow_buf: Buffer, esc_buf: Buffer, n: int, itemsize: int, *,
              native: bool = True) -> np.ndarray:
    """The zigzag ulp codes of ``n`` elements from their ``sign``, ``mag`` and ``esc`` streams, the
    inverse of :func:`ulp_streams`; FormatError when the streams do not fit ``n``. The C extension
    does it in one pass; without it (or ``native=False``) numpy."""
    signs = np.frombuffer(signs_buf, dtype=np.uint8)
    narrow = np.frombuffer(narrow_buf, dtype=np.uint8)
    if narrow.size != n or signs.size != (n + 7) // 8:
        raise FormatError(f"ulp codes do not match {n} elements")
    if native and _native is not None:
        out = np.empty(n, uint_type(itemsize))
        try:
            _native.ulp_codes(signs, narrow, esc_buf, itemsize, out)
        except ValueError as e:
            raise FormatError(f"byte planes: {e}") from None
        return out
    esc_mask = narrow == ESCAPE
    esc = from_planes(esc_buf, int(np.count_nonzero(esc_mask)), itemsize)
    mag = narrow.astype(uint_type(itemsize))
    t = mag.dtype.type
    with np.errstate(over="ignore"):
        mag[esc_mask] = esc + t(ESCAPE)
        return cast(np.ndarray, (mag << t(1)) + np.unpackbits(signs, count=n).astype(mag.dtype) + t(1))


def rice_k(g: np.ndarray) -> int:
    """The Rice parameter that makes ``g`` (unsigned) shortest."""
    if g.size == 0:
        return 0
    best_k, best = 0, None
    for k in _rice_candidates(g.size, int(g.sum(dtype=np.uint64))):
        bits = g.size * (k + 1) + int((g >> np.uint64(k)).sum())
        if best is None or bits < best:
            best_k, best = k, bits
    return best_k


def rice_index(indices: np.ndarray, start: int, *, native: bool = True) -> tuple[int, np.ndarray, np.ndarray]:
    """Rice parameter and the ``unary`` and ``rem`` streams of sorted positions from ``start``.

    The gaps are ``p[i] - p[i-1] - 1`` with ``p[-1] = start - 1``. The C
    extension does it in two passes over the positions; without it (or with
    ``native=False``) numpy gives the same bytes.
    """
    n = int(indices.size)
    if n == 0:
        return 0, np.empty(0, np.uint8), np.empty(0, np.uint8)
    if native and _native is not None:
        ks = _rice_candidates(n, int(indices[-1]) - start + 1 - n)
        k, unary, rem = _native.rice_index(np.ascontiguousarray(indices, np.int64), start, ks.start, ks.stop - 1)
        return k, np.frombuffer(unary, np.uint8), np.frombuffer(rem, np.uint8)
    gaps = (np.diff(indices, prepend=np.int64(start - 1)) - 1).astype(np.uint64)
    k = rice_k(gaps)
    return (k, *rice_encode(gaps, k))


_BE = {1: ">u1", 2: ">u2", 3: ">u4", 4: ">u4", 5: ">u8", 6: ">u8", 7: ">u8", 8: ">u8"}


def _pack_fields(r: np.ndarray, k: int) -> np.ndarray:
    """Pack ``k``-bit unsigned fields MSB-first into bytes."""
    n = r.size
    if k <= 8:
        # Eight k-bit fields make one k*8-bit big-endian number: k whole bytes.
        m = (n + 7) // 8
        grp = np.zeros(m * 8, dtype=np.uint64)
        grp[:n] = r
        grp2 = grp.reshape(m, 8)
        word = np.zeros(m, dtype=np.uint64)
        for j in range(8):
            word |= grp2[:, j] << np.uint64(k * (7 - j))
        out = word.astype(">u8").view(np.uint8).reshape(m, 8)[:, 8 - k :].reshape(-1)
        return out[: (n * k + 7) // 8].copy()
    nb = (k + 7) // 8
    be = r.astype(_BE[nb])
    w = be.dtype.itemsize
    bits = np.unpackbits(be.view(np.uint8).reshape(-1, w), axis=1)[:, w * 8 - k :]
    return np.packbits(bits.reshape(-1))


def _unpack_fields(buf: np.ndarray, n: int, k: int) -> np.ndarray:
    if k <= 8:
        m = (n + 7) // 8
        b = np.zeros((m, 8), dtype=np.uint8)
        b[:, 8 - k :] = np.concatenate([buf, np.zeros(m * k - buf.size, np.uint8)]).reshape(m, k)
        word = b.reshape(-1).view(">u8").astype(np.uint64)
        mask = np.uint64((1 << k) - 1)
        out = np.empty((m, 8), dtype=np.uint64)
        for j in range(8):
            out[:, j] = (word >> np.uint64(k * (7 - j))) & mask
        return out.reshape(-1)[:n]
    bits = np.unpackbits(buf)[: n * k].reshape(n, k).astype(np.uint64)
    return bits @ (np.uint64(1) << np.arange(k - 1, -1, -1, dtype=np.uint64))


def rice_encode(g: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Unary quotients and k-bit remainders of ``g`` (uint64), each bit-packed MSB-first."""
    g = g.astype(np.uint64, copy=False)
    if g.size == 0:
        return np.empty(0, np.uint8), np.empty(0, np.uint8)
    ends = np.cumsum((g >> np.uint64(k)) + np.uint64(1)) - np.uint64(1)
    unary = np.zeros(int(ends[-1]) + 1, dtype=np.uint8)
    unary[ends] = 1
    rem = _pack_fields(g & np.uint64((1 << k) - 1), k) if k else np.empty(0, np.uint8)
    return np.packbits(unary), rem


def rice_decode(unary_buf: Buffer, rem_buf: Buffer, n: int, k: int) -> np.ndarray:
    """Inverse of :func:`rice_encode`; raises FormatError on malformed streams."""
    if not 0 <= k <= MAX_RICE_K:
        raise FormatError(f"Rice parameter {k} out of range")
    ubits = np.unpackbits(np.frombuffer(unary_buf, dtype=np.uint8))
    ends = np.flatnonzero(ubits)
    if ends.size != n or (n and ends[-1] < ubits.size - 8):
        raise FormatError(f"Rice stream holds {ends.size} values, expected {n}")
    rem = np.frombuffer(rem_buf, dtype=np.uint8)
    if rem.size != (n * k + 7) // 8:
        raise FormatError(f"Rice remainders hold {rem.size} bytes, expected {(n * k + 7) // 8}")
    g = (np.diff(ends, prepend=-1) - 1).astype(np.uint64) << np.uint64(k)
    if k and n:
        g |= _unpack_fields(rem, n, k)
    return g


def rice_positions(unary_buf: Buffer, rem_buf: Buffer, n: int, k: int, start: int, stop: int, *,
                   native: bool = True) -> np.ndarray:
    """A sparse segment's positions from its Rice streams (:func:`rice_index`'s inverse): the gaps
    decoded and summed from ``start``, all inside ``[start, stop)``; FormatError otherwise. The C
    extension does it in one pass with no temporaries; without it (or ``native=False``) numpy."""
    if not 0 <= k <= MAX_RICE_K:
        raise FormatError(f"Rice parameter {k} out of range")
    if not (native and _native is not None):
        g = rice_decode(unary_buf, rem_buf, n, k)
        if n and int(g.max()) >= stop - start:
            raise FormatError("index gap outside its range")
        indices = np.cumsum(g.astype(np.int64) + 1) + (start - 1)
        if n and int(indices[-1]) >= stop:
            raise FormatError("index beyond its range")
        return indices
    rem = np.frombuffer(rem_buf, dtype=np.uint8)
    if rem.size != (n * k + 7) // 8:
        raise FormatError(f"Rice remainders hold {rem.size} bytes, expected {(n * k + 7) // 8}")
    out = np.empty(n, np.int64)
    status, ones = _native.rice_positions(unary_buf, rem, n, k, start, stop, out)
    if status == 1:
        raise FormatError(f"Rice stream holds {ones} values, expected {n}")
    if status:
        raise FormatError("index gap outside its range" if status == 2 else "index beyond its range")
    return out


# ---------------------------------------------------------------- ulp2: positions by exponent class

_EXPONENT = {"BF16": (7, 0xFF), "F16": (10, 0x1F), "F32": (23, 0xFF), "F64": (52, 0x7FF),
             "F8_E4M3": (3, 0xF), "F8_E5M2": (2, 0x1F)}


def exponent_field(dtype: str) -> tuple[int, int]:
    """``(shift, mask)`` of a float dtype's exponent field, ``(bits >> shift) & mask``; an element's
    ulp2 class is that of its base bit pattern less the segment's ``class_lo``, clamped to 16."""
    try:
        return _EXPONENT[dtype]
    except KeyError:
        raise FormatError(f"dtype {dtype} has no exponent classes (ulp2 is for float dtypes)") from None


NCLASS = 16  # ulp2 classes: the exponent relative to the segment's ``lo``, clamped to [0, 15]


LO_SAMPLE_RUNS, LO_SAMPLE_RUN = 16, 4096  # class_lo's sample: runs of contiguous elements, spread evenly


def class_lo(base: np.ndarray, start: int, stop: int, shift: int, mask: int, *, native: bool = True) -> int:
    """The ``lo`` of the classes of ``base[start:stop)`` (the encoder takes a whole tensor): 12 below the
    commonest exponent, so that the 16 classes span the exponents where nearly every element and every
    change lies (one class for everything below, one above). The commonest exponent of a sample: 16
    runs of 4096 contiguous elements spread evenly over the range (a strided sample of as many
    elements touched a cache line each, and cost a fifth of an encode of 512 MiB)."""
    n = stop - start
    if n <= 0:
        return 0
    if n <= LO_SAMPLE_RUNS * LO_SAMPLE_RUN:
        at, run = np.array([start], np.int64), n
    else:
        at, run = start + np.linspace(0, n - LO_SAMPLE_RUN, LO_SAMPLE_RUNS).astype(np.int64), LO_SAMPLE_RUN
    if native and _native is not None:
        return max(0, _native.exponent_mode(np.ascontiguousarray(base), base.dtype.itemsize, shift, mask, at, run) - 12)
    sample = np.concatenate([base[a:a + run] for a in at.tolist()])
    exps = (sample >> base.dtype.type(shift)) & base.dtype.type(mask)
    if exps.dtype.itemsize > 4:  # bincount takes it as intp: 64-bit patterns would not cast safely
        exps = exps.astype(np.int64)
    return max(0, int(np.bincount(exps).argmax()) - 12)


def _classes(base: np.ndarray, lo_i: int, hi_i: int, shift: int, mask: int, lo: int) -> np.ndarray:
    t = base.dtype.type
    e = ((base[lo_i:hi_i] >> t(shift)) & t(mask)).astype(np.int64) - lo
    return cast(np.ndarray, np.clip(e, 0, NCLASS - 1).astype(np.uint8))


CENSUS = 1 << 16  # elements between the rows of a class census (a multiple of the scans' 256-element blocks)


def class_scan(base: np.ndarray, start: int, stop: int, indices: np.ndarray, shift: int, mask: int, lo: int,
               old: np.ndarray | None = None, *, every: int = CENSUS, native: bool = True, widest: int = -1,
               hasher: object | None = None, hist_pos: np.ndarray | None = None, hist_cls: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One pass over ``base[start:stop)`` (flat bits). For sorted positions ``indices`` (all in the
    range): each one's class and its rank among the elements of that class in ``[start, p)``; and the
    class *census*, ``(rows, 16)`` int64 counts over ``[start, start + r * every)`` in row ``r`` for
    every ``r * every < stop - start``, over all of ``[start, stop)`` in the last row. ``old``: the
    base's bits at ``indices``, for a ``base`` that already holds the new bits there (the Publisher's
    kept copies, which its diff brings up to date as it compares). ``widest`` caps the C scan's
    vectors (2: AVX-512, 1: AVX2, 0: none; -1: the widest the CPU runs, ``_native.CLASS_SIMD``).
    ``hasher`` (``_native.hasher()``; the C scan only) is fed ``base[start:stop)`` in the same pass.
    ``hist_pos`` (sorted positions in the range) and ``hist_cls`` (uint8, as long): each position's
    class in the base (``old`` at a changed one), filled in as the scan passes it (an ulp2 change
    history's classes, :func:`ulp2_history`'s ``hcls``)."""
    n = int(indices.size)
    if (hist_pos is None) != (hist_cls is None):
        raise ValueError("class_scan: hist_pos and hist_cls go together")
    rows = (stop - start + every - 1) // every + 1 if stop > start else 1
    cls, rank = np.empty(n, np.uint8), np.empty(n, np.int64)
    census = np.zeros((rows, NCLASS), np.int64)
    if native and _native is not None:
        _native.class_ranks(np.ascontiguousarray(base), base.dtype.itemsize, shift, mask, lo, start, stop,
                            np.ascontiguousarray(indices, np.int64), cls, rank, census, every,
                            None if old is None else np.ascontiguousarray(old, base.dtype), widest, hasher,
                            None if hist_pos is None else np.ascontiguousarray(hist_pos, np.int64), hist_cls)
        return cls, rank, census
    if hasher is not None:
        raise ValueError("class_scan: a hasher needs the C scan")
    c = _classes(base, start, stop, shift, mask, lo)
    local = np.asarray(indices, np.int64) - start
    if old is not None:
        c[local] = _classes(np.asarray(old, base.dtype), 0, n, shift, mask, lo)
    if hist_pos is not None and hist_cls is not None:  # the old side's classes, as the C scan takes them
        hist_cls[:] = c[np.asarray(hist_pos, np.int64) - start]
    order = np.argsort(c, kind="stable")  # a radix sort for 8-bit keys
    inverse = np.empty(c.size, np.int64)
    inverse[order] = np.arange(c.size)
    first = np.concatenate([[0], np.cumsum(np.bincount(c, minlength=NCLASS))])
    cls[:] = c[local]
    rank[:] = inverse[local] - first[cls]
    per = np.bincount(np.arange(c.size) // every * NCLASS + c, minlength=(rows - 1) * NCLASS)
    census[1:] = np.cumsum(per.reshape(rows - 1, NCLASS), axis=0)
    return cls, rank, census


@dataclass
class ClassRanks:
    """:func:`class_scan` asked of a diff (``classes`` of :func:`~.extract.diff_fingerprint` and
    :func:`~.extract.diff_values`), which then scans the old side's classes block by block in its
    own pass, while each block is in cache, rather than in a second pass over memory. ``shift``,
    ``mask``, ``lo``, ``every``: as for :func:`class_scan`; ``widest``: its ``widest``. The diff
    fills in ``cls``, ``rank`` and ``census`` as :func:`class_scan` gives them for the diffed range
    and its changed positions (ranked among the old bits, before any ``update_old``), or leaves them
    None when nothing in the range changed (then nothing was scanned). ``hist_pos``: an ulp2 change
    history's positions in the range (sorted, from the range's start), whose classes in the old side
    the scan takes as it goes, into ``hist_cls`` (an ulp2 segment's history contexts need them: read
    afterwards, at a few percent of elements, they would cost a second pass over memory)."""

    shift: int
    mask: int
    lo: int
    every: int = CENSUS
    widest: int = -1
    hist_pos: np.ndarray | None = None
    cls: np.ndarray | None = None
    rank: np.ndarray | None = None
    census: np.ndarray | None = None
    hist_cls: np.ndarray | None = None

    def scan(self, base: np.ndarray, start: int, stop: int, indices: np.ndarray, *, native: bool = True) -> None:
        """Fill in the results with :func:`class_scan` (the diff's way without the C extension)."""
        if indices.size:
            self.cls, self.rank, self.census = class_scan(base, start, stop, indices, self.shift, self.mask, self.lo,
                                                          every=self.every, native=native, widest=self.widest)
            if self.hist_pos is not None:
                at = base[start + self.hist_pos]
                self.hist_cls = _classes(at, 0, at.size, self.shift, self.mask, self.lo)


def class_ranks(base: np.ndarray, start: int, indices: np.ndarray, shift: int, mask: int, lo: int,
                old: np.ndarray | None = None, *, native: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """:func:`class_scan` up to the last of ``indices``, without the census."""
    stop = int(indices[-1]) + 1 if indices.size else start
    cls, rank, _ = class_scan(base, start, stop, indices, shift, mask, lo, old, native=native)
    return cls, rank


def class_positions(base: np.ndarray, start: int, stop: int, shift: int, mask: int, lo: int, counts: np.ndarray,
                    ranks: np.ndarray, skip: np.ndarray | None = None, *,
                    native: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of :func:`class_ranks` over ``[start, stop)``: ``ranks`` holds each class's
    ascending ranks, class after class (``counts``: how many per class, 16 of them), counting no
    element at ``skip`` (sorted positions in the range: an ulp2 segment's history). Returns the
    positions in ascending order and, for each, the index of its rank in ``ranks``. FormatError when
    a rank is beyond the elements of its class (a corrupt chunk, or the wrong base)."""
    n = int(ranks.size)
    counts = np.ascontiguousarray(counts, np.int64)
    ranks = np.ascontiguousarray(ranks, np.int64)
    skip = np.ascontiguousarray(skip if skip is not None else np.empty(0, np.int64), np.int64)
    if counts.size != NCLASS or int(counts.sum()) != n or np.any(counts < 0):
        raise FormatError("ulp2 segment: class counts do not add up")
    if native and _native is not None:
        pos, perm = np.empty(n, np.int64), np.empty(n, np.int64)
        try:
            found = _native.class_positions(np.ascontiguousarray(base), base.dtype.itemsize, shift, mask, lo, start,
                                            stop, counts, ranks, pos, perm, skip)
        except ValueError as e:
            raise FormatError(f"ulp2 segment: {e}") from None
    else:
        c = _classes(base, start, stop, shift, mask, lo)
        if skip.size and (skip[0] < start or skip[-1] >= stop or not ascending(skip)):
            raise FormatError("ulp2 segment: skipped positions must be sorted, unique, in range")
        c[skip - start] = NCLASS  # in no class: sorted after all of them
        order = np.argsort(c, kind="stable")
        first = np.concatenate([[0], np.cumsum(np.bincount(c, minlength=NCLASS))])
        per_class = np.repeat(np.arange(NCLASS), counts)
        within = first[per_class + 1] - first[per_class]
        if np.any(ranks >= within) or np.any(ranks < 0):
            raise FormatError("ulp2 segment: a position rank lies beyond its class (wrong base, or corrupt)")
        pos = order[first[per_class] + ranks] + start
        perm = np.argsort(pos, kind="stable")
        pos = pos[perm]
        found = n
    if found != n:
        raise FormatError("ulp2 segment: a position rank lies beyond its class (wrong base, or corrupt)")
    return pos, perm


MAX_ULP2_K = 40  # the largest gap parameter a class may have


def class_sort(cls: np.ndarray, rank: np.ndarray, codes: np.ndarray, offset: np.ndarray | None = None, *,
               native: bool = True) -> tuple[np.ndarray, list[list[int]], np.ndarray]:
    """What :func:`ulp2_pack` takes, from a segment's changes in position order: their classes,
    their ranks (less ``offset[class]`` when given: each class's count before the segment) and
    their codes. Returns the ranks class by class (ascending within each), the table
    ``[[class, count, k], ...]`` with each class's Rice parameter (:func:`rice_k`) and the codes in
    the same order as the ranks. ValueError when a class's ranks do not ascend."""
    n = int(cls.size)
    off = np.zeros(NCLASS, np.int64) if offset is None else np.ascontiguousarray(offset, np.int64)
    if native and _native is not None:
        ranks, out, table = np.empty(n, np.int64), np.empty_like(codes), np.empty((NCLASS, 3), np.int64)
        m = _native.class_sort(np.ascontiguousarray(cls, np.uint8), np.ascontiguousarray(rank, np.int64),
                               np.ascontiguousarray(codes), codes.dtype.itemsize, off, ranks, out, table)
        return ranks, table[:m].tolist(), out
    order = np.argsort(cls, kind="stable")  # class by class; positions (and ranks) ascend within each
    ranks = (rank - off[cls])[order]
    counts = np.bincount(cls, minlength=NCLASS)
    rows: list[list[int]] = []
    f = 0
    for c in np.flatnonzero(counts).tolist():
        n = int(counts[c])
        gaps = np.diff(ranks[f:f + n], prepend=-1) - 1
        if np.any(gaps < 0):
            raise ValueError("class_sort: ranks must ascend within each class")
        rows.append([c, n, min(rice_k(gaps.astype(np.uint64)), MAX_ULP2_K)])
        f += n
    return ranks, rows, codes[order]


def _needs_native(what: str) -> None:
    if _native is None:
        raise FormatError(f"{what}: ulp2 needs sparrowd's C extension (built at install time with a C compiler; "
                          "reinstall with one, or use --values ulp)")


def ulp2_history(base: np.ndarray, dtype: str, lo: int, idx: np.ndarray, cls: np.ndarray, rank: np.ndarray,
                 codes: np.ndarray, old: np.ndarray | None, hpos: np.ndarray, hstate: np.ndarray,
                 hcls: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """An ulp2 segment's changes (``idx`` sorted; ``cls``, ``rank``, ``codes``: their classes, class
    ranks and zigzag ulp codes; ``old``: the base's bits at them where ``base`` holds the new ones)
    against its history (``hpos``, ``hstate``; ``hcls``: the entries' classes if the diff took them,
    else they are read from ``base`` here), in one merge. Returns, per history entry, its context,
    direction and whether it changed again (as the decoder has them, uint8 each); the codes of the
    changes that are history entries (position order); and the other changes' ranks (less the history
    entries of their class before them), classes and codes."""
    _needs_native("encoding")
    if hcls is None:
        hcls = history_classes(base, dtype, lo, hpos, idx, old)
    m, n = hpos.size, idx.size
    hctx, hdir, again = np.empty(m, np.uint8), np.empty(m, np.uint8), np.empty(m, np.uint8)
    codes = np.ascontiguousarray(codes)
    again_codes, rank_out = np.empty(min(m, n), codes.dtype), np.empty(n, np.int64)
    cls_out, codes_out = np.empty(n, np.uint8), np.empty(n, codes.dtype)
    na, nk = _native.ulp2_history(
        np.ascontiguousarray(idx, np.int64), np.ascontiguousarray(cls, np.uint8), np.ascontiguousarray(rank, np.int64),
        codes, codes.dtype.itemsize, np.ascontiguousarray(hpos, np.int64), np.ascontiguousarray(hstate, np.uint8),
        np.ascontiguousarray(hcls, np.uint8), hctx, hdir, again, again_codes, rank_out, cls_out, codes_out)
    return hctx, hdir, again, again_codes[:na], rank_out[:nk], cls_out[:nk], codes_out[:nk]


def history_classes(base: np.ndarray, dtype: str, lo: int, hpos: np.ndarray, idx: np.ndarray,
                    old: np.ndarray | None) -> np.ndarray:
    """The classes of a change history's entries ``hpos`` in the base (uint8): read from ``base``, or,
    where ``base`` already holds the new bits at the changes ``idx`` (``old``: the old bits there),
    from ``old`` at the entries that changed."""
    if hpos.size and (hpos[0] < 0 or hpos[-1] >= base.size):
        raise ValueError("ulp2 history: positions outside the base")
    shift, mask = exponent_field(dtype)
    bits = base[hpos]
    if old is not None and idx.size:
        at = np.minimum(np.searchsorted(idx, hpos), idx.size - 1)
        moved = idx[at] == hpos
        bits[moved] = old[at[moved]]
    return _classes(bits, 0, bits.size, shift, mask, lo)


def ulp2_rows_pack(flags: np.ndarray, ctx: np.ndarray) -> bytes:
    """The rows stream of an ulp2 segment in row mode: per row it touches, whether the row has changes
    (``flags``), modelled in the row's context ``ctx`` (1: the row holds a history element)."""
    _needs_native("encoding")
    return _native.ulp2_rows_pack(np.ascontiguousarray(flags, np.uint8), np.ascontiguousarray(ctx, np.uint8))


def ulp2_rows_unpack(data: Buffer, ctx: np.ndarray) -> np.ndarray:
    """The inverse of :func:`ulp2_rows_pack`: the rows' flags (bool); FormatError on a bad stream."""
    _needs_native("decoding")
    flags = np.empty(ctx.size, np.uint8)
    try:
        _native.ulp2_rows_unpack(data, np.ascontiguousarray(ctx, np.uint8), flags)
    except ValueError as e:
        raise FormatError(str(e)) from None
    return flags.view(bool)


def ulp2_context() -> bytearray:
    """The adaptive contexts a chunk's first ulp2 segment starts from; :func:`ulp2_pack` and
    :func:`ulp2_unpack` move them on in place, so each later segment of the chunk starts where the
    one before left them (docs/FORMAT.md, "What is coded")."""
    _needs_native("coding")
    return _native.ulp2_context()


def ulp2_pack(ranks: np.ndarray, table: list[list[int]], codes: np.ndarray, hctx: np.ndarray, hdir: np.ndarray,
              again: np.ndarray, again_codes: np.ndarray, state: bytearray | None = None) -> bytes:
    """The coded stream of an ulp2 segment (docs/FORMAT.md): ``table`` is ``[[class, count, k], ...]``
    for the classes with changes outside the history (the stream carries it), ``ranks`` those
    changes' ascending ranks class after class, ``codes`` their zigzag ulp codes in the same order;
    ``hctx`` and ``hdir`` the history's elements (context and last direction, uint8, empty without
    a history), ``again`` 1 for those that changed again, ``again_codes`` their codes. ``state``:
    the chunk's contexts (:func:`ulp2_context`), moved on in place; fresh ones without it."""
    _needs_native("encoding")
    u8 = np.uint8
    args = (np.ascontiguousarray(ranks, np.int64), np.asarray(table, np.int64).reshape(-1),
            np.ascontiguousarray(codes), codes.dtype.itemsize, np.ascontiguousarray(hctx, u8),
            np.ascontiguousarray(hdir, u8), np.ascontiguousarray(again, u8),
            np.ascontiguousarray(again_codes, codes.dtype))
    return _native.ulp2_pack(*args) if state is None else _native.ulp2_pack(*args, state)


def ulp2_unpack(data: Buffer, span: int, n: int, itemsize: int, hctx: np.ndarray, hdir: np.ndarray,
                state: bytearray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The inverse of :func:`ulp2_pack` for a segment of ``n`` changes: the count of each of the 16
    classes, the ranks (each below ``span``) and codes of the changes outside the history, and
    which history elements changed again (uint8) and their codes; FormatError on a malformed
    stream. ``state``: as for :func:`ulp2_pack` (moved on only when the stream decodes)."""
    _needs_native("decoding")
    u = uint_type(itemsize)
    counts, ranks, codes = np.empty(NCLASS, np.int64), np.empty(n, np.int64), np.empty(n, u)
    again, again_codes = np.empty(hctx.size, np.uint8), np.empty(n, u)
    args = (data, span, itemsize, np.ascontiguousarray(hctx, np.uint8), np.ascontiguousarray(hdir, np.uint8),
            ranks, codes, counts, again, again_codes)
    try:
        na = _native.ulp2_unpack(*args) if state is None else _native.ulp2_unpack(*args, state)
    except ValueError as e:
        raise FormatError(str(e)) from None
    return counts, ranks[:n - na], codes[:n - na], again, again_codes[:na]
