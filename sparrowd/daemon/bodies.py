"""Reading HTTP bodies with a size limit, whole.

``StreamReader.read(n)`` returns whatever is buffered, up to ``n`` bytes, not
``n`` bytes: a large body arrives in pieces. :func:`read_limited` collects
pieces until the end of the body and stops as soon as the limit is passed, so
a peer cannot make the daemon buffer more than ``limit + 1`` bytes.
"""

from __future__ import annotations

from aiohttp import StreamReader

__all__ = ["read_limited"]

_PIECE = 1 << 20


async def read_limited(stream: StreamReader, limit: int) -> bytes | None:
    """The whole body, or None if it is longer than ``limit`` bytes."""
    buf = bytearray()
    while True:
        piece = await stream.read(min(_PIECE, limit + 1 - len(buf)))
        if not piece:
            return bytes(buf)
        buf += piece
        if len(buf) > limit:
            return None
