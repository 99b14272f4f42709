"""The upload lanes: which lane a peer's uploads take (``serving.lane``), whether it is served now
(``serving.relay_admits``, or the trainer's slots), the lanes' slots and queues, and the pacing of a
stream's pieces by the upload limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

from ...swarm import serving
from ...swarm.policy import QUEUE_ADMIT
from ...swarm.push import RATE_HEADER, stream_rate
from ..cutthrough import Partial
from .parts import Parts
from .state import Remote
from .wire import PIECE, _pieces, _stripe_pieces

__all__ = ["Uplink"]

class Uplink(Parts):
    """``Swarm``'s upload lanes: admission by lane, slots and queues, pacing."""

    def _may_download(self, remote: Remote) -> bool:
        """Whether this node serves ``remote`` now: a relay while few requests wait in its lane
        (``serving.relay_admits``), the trainer as its slots admit (``Seed.admits``)."""
        if self.seed is not None:
            return self.seed.admits(remote)
        which = self._lane(remote)
        if serving.relay_admits(self._waiting[which]):
            return True
        self._told_choked[which] = True  # woken when the lane has room again
        return False

    def _lane(self, remote: Remote) -> bool:
        """This node's upload lane for ``remote`` (``serving.lane``)."""
        return serving.lane(self.signer is not None, self.host.settings.region, remote.region)

    @contextlib.asynccontextmanager
    async def _upload_slot(self, lane: bool) -> AsyncIterator[None]:
        """One of the lane's upload slots, waited for in its queue (what ``_may_download`` counts)."""
        self._waiting[lane] += 1
        waiting = True
        try:
            async with self._uploads[lane]:
                self._waiting[lane] -= 1
                waiting = False
                self._busy[lane] += 1
                try:
                    if self.signer is None and self._waiting[lane] == QUEUE_ADMIT - 1 and self._told_choked[lane]:
                        self._told_choked[lane] = False
                        await self.notify()  # the lane has room again: peers told "choked" learn it now
                    yield
                finally:
                    self._busy[lane] -= 1
        finally:
            if waiting:
                self._waiting[lane] -= 1

    async def _paced(self, source: Path | Partial, wan: bool, block: int = PIECE,
                     stripe: tuple[int, int] | None = None, size: int = 0) -> AsyncIterator[bytes | memoryview]:
        """A chunk's pieces (``_pieces``), held to the upload limits; counted as relayed cut-through
        when they come from a chunk still arriving.

        Under a limit the pieces are ``block`` bytes (the version's hashing block): a relay hands a
        chunk on from its first block checked out, and a bucket that let one 256 KiB piece go only
        once it had the tokens for all of it held every block of that piece back: at 1 MiB/s the
        trainer's first holder saw its first block of a one-chunk version 0.15 s after the version's
        manifest, and every paced hop after it waited so again (``bench swarm --log-level debug``
        at 16 nodes; the simulator sends fluidly). ``stripe``: only that stripe's blocks, of a chunk
        of ``size`` bytes hashed in ``block``-byte blocks."""
        relayed = isinstance(source, Partial)
        paced = bool(self.up.rate or (wan and self.wan_up.rate))
        pieces = _pieces(source, block, block if paced else PIECE) if stripe is None \
            else _stripe_pieces(source, *stripe, block, size)
        async for piece in pieces:
            if relayed:
                self.cut_through_bytes += len(piece)  # counted as it goes: a chunk still arriving
            now = time.monotonic()
            delay = max(self.up.take(now, len(piece)), self.wan_up.take(now, len(piece)) if wan else 0)
            if delay:
                await asyncio.sleep(delay)
            yield piece

    def _rate_header(self, wan: bool, source: Path | Partial) -> dict[str, str]:
        """``RATE_HEADER`` for a stream this node starts now (in its upload slot): its share of the
        limits, no faster than the chunk arrives if it still does (``swarm.push.stream_rate``); none
        where nothing limits it."""
        arriving = source.rate if isinstance(source, Partial) and not source.whole else None
        rate = stream_rate(self.up.rate, self.wan_up.rate, self._busy[False] + self._busy[True], self._busy[True],
                           wan=wan, arriving=arriving)
        return {RATE_HEADER: str(round(rate))} if rate else {}
