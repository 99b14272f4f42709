"""Human sizes of bytes and rates: ``4M`` is 4 MiB. K, M, G, T are powers of 1024 (``i``/``B`` allowed)."""

from __future__ import annotations

import re

__all__ = ["parse_size", "format_bytes", "format_rate"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_MULT = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``"2M"`` -> 2097152. Raises ValueError with a readable message."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (use a number with an optional K, M, G or T suffix)")
    return int(float(m.group(1)) * _MULT[m.group(2).lower()])


def format_rate(n: float | None) -> str:
    """Bytes per second as a limit reads: ``4.00 MiB/s``, or ``no limit`` for 0 or None."""
    return f"{format_bytes(n)}/s" if n else "no limit"


def format_bytes(n: float) -> str:
    """Bytes in IEC units, three significant digits: 512 B, 1.50 KiB, 495 KiB, 2.90 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{n:.0f} B"
            return f"{n:.2f} {unit}" if abs(n) < 10 else f"{n:.1f} {unit}" if abs(n) < 100 else f"{n:.0f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
