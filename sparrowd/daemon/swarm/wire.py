"""What goes over the wire between peers: headers, message schemas, size limits, and the chunk
streams' pieces (from a file, or from a fetch in progress, ``Partial``). No state of its own.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web

from ...errors import SparrowError
from ...schema import Bool, Bytes, Int, List, NonNegInt, Opt, Str
from ...swarm.push import RATE_HEADER, stripe_blocks
from ...swarm.versions import VersionState
from ..cutthrough import Partial

__all__ = ["MSGPACK", "MAX_CHUNK", "MAX_EXCHANGE", "MAX_EXCHANGE_REQUEST", "MAX_VERSIONS_SHOWN", "UNKNOWN_HAVE_BYTES",
           "REGION_HEADER", "ROOT_HEADER", "STATEMENT_HEADER", "STATEMENT_HEADER_MAX", "ALSO_HEADER",
           "ALSO_HEADER_MAX", "PIECE", "NotYet", "_EXCHANGE_REQ", "_VERSION_REQ", "_VERSION_REP",
           "_new_connections", "_Served", "_send_time", "_declared_rate", "_bounded", "_statement_header", "_body",
           "_Cut", "_pieces", "_stripe_pieces"]

MSGPACK = "application/msgpack"
MAX_CHUNK = 64 << 20
MAX_EXCHANGE = 16 << 20  # an exchange reply (its statements); a request carries have-maps only:
MAX_EXCHANGE_REQUEST = 1 << 20
MAX_VERSIONS_SHOWN = 256  # versions one exchange request may describe (a node retains a few)
UNKNOWN_HAVE_BYTES = 1024  # of a have-map for a version this node does not know yet
REGION_HEADER = "X-Sparrowd-Region"
ROOT_HEADER = "X-Sparrowd-Root"  # on a chunk's stream: the region it entered the swarm in (swarm.push.region_tree)
# On a push: the trainer's signed statement announcing the chunk (base64), so that a node that has not
# heard of the version yet can check its blocks at once; left off above STATEMENT_HEADER_MAX characters.
STATEMENT_HEADER, STATEMENT_HEADER_MAX = "X-Sparrowd-Statement", 6144
# On a push: the other peers the pusher sends the same chunk to, comma-separated; the receiver does
# not push it to them (siblings fed by the same sender). Ignored past ALSO_HEADER_MAX characters.
ALSO_HEADER, ALSO_HEADER_MAX = "X-Sparrowd-Also", 2048
PIECE = 256 << 10


class NotYet(SparrowError):
    """A peer answered an exchange 503: it does not know this node yet (it joined a moment ago and
    the peer asks the tracker about it) or it is stopping. Alive, so not stalled: in a swarm just
    formed every node meets these, and its neighbours still count on it to cross."""


_EXCHANGE_REQ = {"node_id": Str, "region": Str, "after": Int, "wait": Opt(Int), "versions": List,
                 "joined_after": Opt(Int),  # to the trainer: the latest join it told of (TrackerService.joined_since)
                 "delay_us": Opt(NonNegInt)}  # to the trainer: its one-way delay between regions (Swarm.wan_delay)
_VERSION_REQ = {"version": NonNegInt, "anchor": Opt(Bool), "statements": NonNegInt, "have": Bytes, "fetching": Bytes}
_VERSION_REP = {"version": NonNegInt, "anchor": Opt(Bool), "statements": List, "have": Bytes, "fetching": Bytes,
                "pushing": Opt(Bytes)}


def _new_connections() -> aiohttp.TraceConfig:
    """Marks a request that opened a connection of its own (``trace_request_ctx``'s ``new``): its
    time counts TCP's handshake, a round trip, before the request's own."""
    trace = aiohttp.TraceConfig()

    async def opened(session, ctx, params) -> None:
        if isinstance(ctx.trace_request_ctx, dict):
            ctx.trace_request_ctx["new"] = True

    trace.on_connection_create_end.append(opened)
    return trace


@dataclass(frozen=True)
class _Served:
    """The start of a chunk stream's pieces (``Swarm._receive``): it is served, at the rate its sender
    declared (None: not said)."""

    rate: float | None


def _send_time(vs: VersionState, index: int | None = None) -> float | None:
    """The trainer's signed time to send chunk ``index`` (``tree_timing``'s ``send``), or the longest of
    the version's chunks; None where no announcement timed one."""
    trees = vs.trees.values() if index is None else [vs.trees.get(index)]
    return max((t[0] for t in trees if t is not None), default=None)


def _declared_rate(headers) -> float | None:
    """A stream's ``RATE_HEADER``: bytes a second, positive and finite, else None."""
    try:
        rate = float(headers.get(RATE_HEADER, ""))
    except ValueError:
        return None
    return rate if math.isfinite(rate) and rate > 0 else None


def _bounded(bitmap: bytes, vs: VersionState | None) -> bytes:
    """A peer's have-map cut to the chunks this node knows of that version (its chunk count, once the
    manifest gives it; else the chunks announced, with room for a few more): a have-map never costs
    more than the version it describes, whatever its sender claims."""
    if vs is None:
        return bitmap[:UNKNOWN_HAVE_BYTES]
    n = vs.total if vs.total is not None else len(vs.chunks) + 64
    return bitmap[:(n + 7) // 8]


def _statement_header(vs: VersionState, index: int) -> dict[str, str]:
    """A push's ``STATEMENT_HEADER``: the statement announcing chunk ``index``, if it fits."""
    st = vs.announced.get(index)
    raw = base64.b64encode(st.to_bytes()).decode() if st is not None else ""
    return {STATEMENT_HEADER: raw} if raw and len(raw) <= STATEMENT_HEADER_MAX else {}


async def _body(request: web.Request):
    """A push's body in pieces, as ``_receive`` reads them (an async generator, which it closes)."""
    yield _Served(_declared_rate(request.headers))
    async for piece in request.content.iter_chunked(PIECE):
        yield piece


class _Cut(Exception):
    """The fetch a cut-through stream was fed by failed."""


async def _pieces(source: Path | Partial, first: int = PIECE, most: int = PIECE):
    """A chunk's bytes in pieces of at most ``most`` (the first of at most ``first``): from its file,
    or from a fetch in progress as its blocks check out (``_Cut`` if that fetch fails first)."""
    if isinstance(source, Path):
        with open(source, "rb") as f:
            piece = f.read(first)
            while piece:
                yield piece
                piece = f.read(most)
        return
    mv, sent = memoryview(source.buf), 0
    while sent < source.size:
        await source.wait(sent)
        if source.failed:
            raise _Cut()
        end = min(source.ready, first) if sent == 0 else source.ready
        for o in range(sent, end, most):
            yield mv[o : min(o + most, end)]
        sent = end


async def _stripe_pieces(source: Path | Partial, s: int, n: int, block: int, size: int):
    """Stripe ``s`` of ``n`` of a chunk of ``size`` bytes hashed in ``block``-byte blocks, a block a
    piece, in order: from its file, or as each block checks out in a fetch in progress (``_Cut`` if
    that fetch fails first)."""
    blocks = -(-size // block)
    if isinstance(source, Path):
        with open(source, "rb") as f:
            for b in stripe_blocks(s, n, blocks):
                f.seek(b * block)
                yield f.read(min(block, size - b * block))
        return
    mv = memoryview(source.buf)
    for b in stripe_blocks(s, n, blocks):
        await source.wait_block(b)
        if source.failed:
            raise _Cut()
        yield mv[b * block : min((b + 1) * block, size)]
