"""Cut-through relaying: a chunk being fetched, served on block by block as its blocks arrive.

Store-and-forward costs a whole chunk's time at every hop, which is most of
the time to all for a patch of a few chunks. The trainer's announcements
carry a hash per block of each chunk (``swarm.versions.block_hashes``), so a
node checks each block as it arrives and may hand it on at once: a chunk
moves down a chain of nodes a block behind the first. A ``Partial`` is one
fetch's buffer: ``feed`` appends what the network delivered and checks
every block it completes (``IntegrityError`` names the first bad one), and
``ready`` is how much has checked out. The node's first fetch of a chunk
registers its ``Partial``, served (and shown to peers) once its first block
has checked out (``Swarm._fetching`` says why); streams served from it wait in
``wait`` for more, and end when it fails (the requester goes back to its
picker) or is whole. While it arrives it is streamed to no more peers at once
than the node's uplink carries at the rate it comes in (``rate``, as its
sender declared it; ``swarm.push.relay_fanout``): ``streams`` counts them,
``room`` says how many more may start, and a request beyond them waits its
``turn``. A chunk announced without block hashes is buffered the same way
and checked whole, and never served before it is stored.

A chunk that crosses in stripes (``swarm.push.stripe_plan``) arrives as
several streams at once, each a stripe of its blocks: one ``Partial``
(``striped``) takes them all (``feed_stripe``), each block checked as it
completes, and ``ready`` is the prefix of blocks checked so far, so that
streams of the whole chunk are served from it as from any fetch; a stripe
is served on block by block (``has_block``, ``wait_block``). Between its
streams it waits for the next (``feeders``, ``fed_at``): the node's
scheduler gives it up, and asks for the chunk whole, once none has come
for a while.

A stripe is named by its pusher (``s/n``: blocks ``s``, ``s + n``, ...),
and nothing but the trainer's block hashes is taken on trust: stripes of
different counts may overlap, so a stream collects a block apart until
it is whole and checked, and a block already checked by another stream
is checked again (a bad copy still bans its sender) but not written. A
member that names a false count so only sends blocks (checked) that the
other stripes also bring; when the count was taken from the first stripe
that came, such a member had the real stripes declined, and the chunk
waited ``STRIPE_WAIT`` to be asked for whole.
"""

from __future__ import annotations

import asyncio
import time

import blake3
import numpy as np

from ..errors import IntegrityError
from ..swarm.push import relay_fanout, stripe_size
from ..swarm.versions import BLOCK_HASH

__all__ = ["Partial"]


class Partial:
    def __init__(self, size: int, block: int | None = None, hashes: bytes | None = None, *, what: str = "chunk"):
        self.size, self.block, self.hashes, self.what = size, block, hashes, what
        self.buf = bytearray(size)
        self.got = 0  # bytes received
        self.ready = 0  # bytes checked against their block hashes: what may be served on
        self.failed = False
        self.rate: float | None = None  # bytes a second, as the sender declared it paces the stream
        self.streams = 0  # streams served from it now, or about to be
        self.striped = False  # a chunk arriving in stripes (``stripe``)
        self.checked: np.ndarray | None = None  # ...each block checked, by index
        self.stripe_got: dict[tuple[int, int], int] = {}  # ...bytes received of each stripe (s, n)
        self._staged: dict[tuple[int, int], bytearray] = {}  # ...a stripe's block not yet whole
        self.feeders = 0  # ...streams feeding it now
        self.storing = False  # ...one of them is storing it whole
        self.fed_at = 0.0  # ...when a stripe last brought bytes (time.monotonic)
        self.own: dict[tuple[int, int], None] = {}  # ...the stripes its receiver took from the root region, in order
        self._moved = asyncio.Event()

    def stripe(self) -> None:
        """Take the chunk in stripes (``feed_stripe``) rather than as one stream."""
        self.striped = True
        self.checked = np.zeros(self.blocks, bool)

    @property
    def blocks(self) -> int:
        return -(-self.size // self.block) if self.block else 0

    @property
    def _block(self) -> int:
        """The block size, where the chunk has blocks (as every caller of this knows it does)."""
        assert self.block is not None, f"{self.what} has no block size"
        return self.block

    @property
    def _hashes(self) -> bytes:
        """The block hashes, where the chunk has them (as every caller of this knows it does)."""
        assert self.hashes is not None, f"{self.what} has no block hashes"
        return self.hashes

    @property
    def _checked(self) -> np.ndarray:
        """Each block checked, by index, of a chunk taken in stripes (``stripe``)."""
        assert self.checked is not None, f"{self.what} is not taken in stripes"
        return self.checked

    def stripe_size(self, stripe: tuple[int, int]) -> int:
        return stripe_size(self.size, self._block, *stripe)

    def has_block(self, b: int) -> bool:
        """Whether block ``b`` has checked out (and may be served on)."""
        if self.checked is not None:
            return bool(self.checked[b])
        return min((b + 1) * self._block, self.size) <= self.ready

    async def wait_block(self, b: int) -> None:
        """Return once block ``b`` has checked out, or the fetch failed."""
        while not self.has_block(b) and not self.failed:
            await self._moved.wait()

    @property
    def servable(self) -> bool:
        """Whether it may be served on (and shown to peers as being fetched): a block of it has
        checked out and its fetch has not failed. Served from the request on, partials could be
        fed by each other in a circle, none of them by a whole copy."""
        return self.ready > 0 and not self.failed

    @property
    def whole(self) -> bool:
        return self.ready == self.size and not self.failed

    def feed(self, piece) -> None:
        """Append received bytes; check every block they complete (a chunk without block hashes is
        checked whole when it is stored, not here)."""
        n = len(piece)
        if self.got + n > self.size:
            raise IntegrityError(f"{self.what} is longer than signed")
        self.buf[self.got : self.got + n] = piece
        self.got += n
        if self.hashes is None:
            return
        block = self._block
        end = self.got if self.got == self.size else self.got - self.got % block
        if end <= self.ready:
            return
        mv = memoryview(self.buf)
        try:
            for o in range(self.ready, end, block):
                b, stop = o // block, min(o + block, self.size)
                if blake3.blake3(mv[o:stop]).digest(length=BLOCK_HASH) != \
                        self.hashes[b * BLOCK_HASH : (b + 1) * BLOCK_HASH]:
                    raise IntegrityError(f"{self.what}: block {b} does not match its signed hash")
                self.ready = stop
        finally:
            self._pulse()

    def feed_stripe(self, stripe: tuple[int, int], piece) -> None:
        """Place received bytes of stripe ``stripe`` (``(s, n)``); check every block they complete.
        The checked prefix (``ready``) grows as the stripes fill in the blocks before it."""
        if self.whole:
            return  # taken whole by another request meanwhile
        s, n = stripe
        at, m = self.stripe_got.get(stripe, 0), len(piece)
        if at + m > self.stripe_size(stripe):
            raise IntegrityError(f"{self.what}: stripe {s} of {n} is longer than signed")
        src, done = memoryview(piece), 0
        staged = self._staged.setdefault(stripe, bytearray())
        block, hashes, checked = self._block, self._hashes, self._checked
        try:
            while done < m:
                j, off = divmod(at + done, block)
                b = s + j * n
                start = b * block
                length = min(block, self.size - start)
                take = min(m - done, length - off)
                whole: memoryview | bytearray
                if off == 0 and take == length:
                    whole = src[done : done + take]  # the block in one piece
                else:
                    staged += src[done : done + take]
                    if len(staged) < length:
                        done += take
                        continue
                    whole = staged
                if blake3.blake3(whole).digest(length=BLOCK_HASH) != \
                        hashes[b * BLOCK_HASH : (b + 1) * BLOCK_HASH]:
                    raise IntegrityError(f"{self.what}: block {b} does not match its signed hash")
                if not checked[b]:  # (checked already: another stripe brought it)
                    self.buf[start : start + length] = whole
                    checked[b] = True
                staged.clear()
                done += take  # (a bad block's bytes are not counted in: the stripe is not whole)
        finally:
            self.fed_at = time.monotonic()
            self.stripe_got[stripe] = at + done
            self.got += done
            missing = np.flatnonzero(~checked)
            self.ready = self.size if not len(missing) else int(missing[0]) * block
            self._pulse()

    def stripe_whole(self, stripe: tuple[int, int]) -> bool:
        return self.stripe_got.get(stripe, 0) == self.stripe_size(stripe)

    def holds_stripe(self, stripe: tuple[int, int]) -> bool:
        """Whether stripe ``stripe`` is being taken here already, or every block of it has checked out."""
        s, n = stripe
        return stripe in self.stripe_got or bool(self._checked[s::n].all())

    def drop_stripe(self, stripe: tuple[int, int]) -> None:
        """A stripe's stream ended short: forget it, so that another pusher's copy may be taken."""
        self.stripe_got.pop(stripe, None)
        self._staged.pop(stripe, None)

    def fill(self, data) -> None:
        """The chunk arrived whole by another request (checked there): serve the rest from it."""
        self.buf[:] = data
        self.got = self.ready = self.size
        if self.checked is not None:
            self.checked[:] = True
        self._pulse()

    def abort(self) -> None:
        self.failed = True
        self._pulse()

    def room(self, uplink: float | None) -> int | None:
        """How many more streams may start from it now, for a node whose upload limit is ``uplink``:
        as many as that carries at the rate it arrives (``relay_fanout``), less those served or about
        to be; None for no limit (either rate unknown, or it is whole)."""
        most = relay_fanout(uplink, self.rate)
        return None if most is None or self.whole else most - self.streams

    async def turn(self, uplink: float | None) -> None:
        """Return once another stream may start from it (``room``), or its fetch failed."""
        while (room := self.room(uplink)) is not None and room <= 0 and not self.failed:
            await self._moved.wait()

    def leave(self) -> None:
        """A stream served from it ended: one waiting may go."""
        self.streams -= 1
        self._pulse()

    async def wait(self, past: int) -> None:
        """Return once more than ``past`` bytes are ready, or the fetch failed."""
        while self.ready <= past and not self.failed:
            await self._moved.wait()

    def _pulse(self) -> None:
        self._moved.set()
        self._moved = asyncio.Event()
