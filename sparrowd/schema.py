"""Schema checks for msgpack maps that come from files or the network.

Nothing read from outside is trusted: every map is checked field by field
before any value is used, and a failure is one :class:`FormatError` naming the
field. Unknown fields are ignored so that newer writers stay readable.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack

from .errors import FormatError

__all__ = ["unpack", "pack", "fields", "Int", "NonNegInt", "Str", "Bytes", "List", "Map", "Num", "Opt"]


def pack(obj: Any) -> bytes:
    """Deterministic msgpack: the caller builds maps in a fixed key order."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data, *, what: str, max_len: int = 64 << 20) -> Any:
    """Decode msgpack with strict limits; any failure is a FormatError."""
    if len(data) > max_len:
        raise FormatError(f"{what}: {len(data)} bytes exceeds the limit of {max_len}")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=max_len,
            max_bin_len=max_len,
            max_array_len=1 << 24,
            max_map_len=1 << 20,
            max_ext_len=0,
        )
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, TypeError) as e:
        raise FormatError(f"{what}: not valid msgpack ({e})") from None


class _Check:
    name = "value"

    def __call__(self, v: Any) -> bool:  # pragma: no cover - interface
        raise NotImplementedError


class _Int(_Check):
    name = "an integer"

    def __init__(self, lo: int | None = None, hi: int | None = None):
        self.lo, self.hi = lo, hi
        if lo is not None:
            self.name = f"an integer >= {lo}"

    def __call__(self, v):
        return (
            isinstance(v, int)
            and not isinstance(v, bool)
            and (self.lo is None or v >= self.lo)
            and (self.hi is None or v <= self.hi)
        )


class _Type(_Check):
    def __init__(self, t, name):
        self.t, self.name = t, name

    def __call__(self, v):
        return isinstance(v, self.t)


class _Num(_Check):
    name = "a finite number"

    def __call__(self, v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class _Opt(_Check):
    def __init__(self, inner: _Check):
        self.inner, self.name = inner, f"{inner.name} or nil"

    def __call__(self, v):
        return v is None or self.inner(v)


Int = _Int()
NonNegInt = _Int(0)
Str = _Type(str, "a string")
Bytes = _Type(bytes, "bytes")
List = _Type(list, "a list")
Bool = _Type(bool, "a boolean")
Map = _Type(dict, "a map")
Num = _Num()


def Opt(inner: _Check) -> _Check:
    return _Opt(inner)


def fields(obj: Any, spec: dict[str, _Check], *, what: str) -> dict:
    """Check that ``obj`` is a map holding every field of ``spec`` with the right type."""
    if not isinstance(obj, dict):
        raise FormatError(f"{what}: expected a map, got {type(obj).__name__}")
    for key, check in spec.items():
        if key not in obj:
            if isinstance(check, _Opt):
                obj[key] = None
                continue
            raise FormatError(f"{what}: missing field {key!r}")
        if not check(obj[key]):
            raise FormatError(f"{what}: field {key!r} must be {check.name}")
    return obj
