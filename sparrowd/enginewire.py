"""The engine socket's framing and messages, shared by the daemon and the engine's client.

A Unix stream socket; each message is a 4-byte big-endian length and a
msgpack map of at most ``MAX_FRAME`` bytes, with an ``op``. The reply to a
``fetch`` carries a file descriptor (SCM_RIGHTS) on its first byte: a sealed
memfd holding the decoded patch (``sparrowd.decoded``). See
docs/ENGINE_SOCKET.md.
"""

from __future__ import annotations

import struct

from .errors import FormatError
from .schema import Bool, Int, NonNegInt, Opt, Str, fields, pack, unpack

__all__ = ["MAX_FRAME", "frame", "parse", "REQUESTS", "state_fingerprint"]

MAX_FRAME = 1 << 20
_LEN = struct.Struct(">I")

REQUESTS = {
    "hello": {"op": Str, "engine": Str, "rank": NonNegInt, "version": NonNegInt, "token": Str, "model": Opt(Str)},
    "ready": {"op": Str, "wait": Opt(Int), "until": Opt(NonNegInt)},
    "fetch": {"op": Str, "version": NonNegInt, "anchor": Opt(Bool)},
    "applied": {"op": Str, "version": NonNegInt, "anchor": Opt(Bool), "fingerprint": Opt(Str)},
}


def frame(msg: dict) -> bytes:
    body = pack(msg)
    if len(body) > MAX_FRAME:
        raise FormatError(f"engine message of {len(body)} bytes is over {MAX_FRAME}")
    return _LEN.pack(len(body)) + body


def length(header: bytes) -> int:
    (n,) = _LEN.unpack(header)
    if n > MAX_FRAME:
        raise FormatError(f"engine message of {n} bytes is over {MAX_FRAME}")
    return n


def parse(body: bytes, *, request: bool) -> dict:
    m = unpack(body, what="engine message", max_len=MAX_FRAME)
    if not isinstance(m, dict) or not isinstance(m.get("op"), str):
        raise FormatError("engine message: not a map with an op")
    if request:
        spec = REQUESTS.get(m["op"])
        if spec is None:
            raise FormatError(f"engine message: unknown op {m['op']!r}")
        return fields(m, spec, what=f"engine {m['op']}")
    return m


def state_fingerprint(tensors) -> str:
    """What an engine acknowledges: BLAKE3 over the touched tensors' names and result
    fingerprints, in manifest order (the daemon computes the same from its manifest)."""
    import blake3

    h = blake3.blake3()
    for t in tensors:
        h.update(t.name.encode() + b"\0" + (t.result_fp or b""))
    return h.hexdigest()
