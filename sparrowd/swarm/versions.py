"""What a node knows about each object (a version's patch, or its anchor): its signed
chunk list and the chunks it holds.

A version's chunks are numbered in the order the trainer produced them. The
trainer signs announcements of chunks as they are encoded (``first`` index
and ``[hash, size]`` pairs, and for each chunk the hashes of its ``block``-byte
blocks, which let a node check and relay a chunk block by block while it is
still arriving: cut-through), then the manifest, whose chunk list must agree
with everything announced; the version is complete once the manifest is in
and every chunk is held. A chunk index is known only through a signed
statement, so nothing else can be stored or served. Pure: statements in,
indices and decisions out; the chunk store does the I/O.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

import blake3
import numpy as np

from ..codec.manifest import FULL, Manifest
from ..errors import FormatError, IntegrityError
from ..schema import Bytes, List, NonNegInt, Opt, fields, pack, unpack
from .chain import Key, Obj
from .signing import Signed, Verifier

__all__ = ["ChunkRef", "VersionState", "announce_body", "block_hashes", "check_kind", "to_bitmap", "from_bitmap",
           "MAX_CHUNKS_PER_VERSION", "BLOCK", "BLOCK_HASH", "block_for", "StatementPage", "PAGE_STATEMENTS",
           "PAGE_BYTES"]

MAX_CHUNKS_PER_VERSION = 1 << 20
BLOCK = 64 << 10  # the grain of cut-through relaying: a node checks and hands on blocks of this size...
RELAY_BLOCK_MIN, BLOCKS_PER_CHUNK = 4 << 10, 64  # ...or smaller ones, for small chunks (``block_for``)
BLOCK_HASH = 16  # bytes of BLAKE3 per block (the chunk's own hash, 32 bytes, is checked too before storing)
MIN_BLOCK, MAX_BLOCK = 4 << 10, 64 << 20
PAGE_STATEMENTS, PAGE_BYTES = 1024, 8 << 20  # what one exchange reply carries of the signed statements at most
_ANNOUNCE = {"first": NonNegInt, "chunks": List, "block": Opt(NonNegInt), "blocks": Opt(List),
             "tree": Opt(List)}  # [send, hop] in microseconds: the timing of the chunks' region trees


@dataclass(frozen=True)
class ChunkRef:
    hash: bytes
    size: int


def block_for(chunk: int) -> int:
    """The block size the trainer hashes a version's chunks in, from the size of its chunks: about a
    64th of a chunk, a power of two from 4 KiB (``RELAY_BLOCK_MIN``) to 64 KiB (``BLOCK``). A relay
    hands a chunk on once its first block has checked out, so every hop down a chain of relays costs
    a block's time, and a chunk crossing in stripes ends with its last block sent on to every other
    region (``swarm.push.stripe_plan``); smaller blocks shorten both (evidence:
    docs/history/DESIGN-NOTES.md#block-size). The hashes add 16 bytes a block to the signed statements:
    0.4% of a small patch's bytes, 0.05% of 2 MiB chunks'."""
    b = BLOCK
    while b > RELAY_BLOCK_MIN and b * BLOCKS_PER_CHUNK > chunk:
        b //= 2
    return b


def block_hashes(data: bytes | bytearray | memoryview, block: int = BLOCK) -> bytes:
    """The BLAKE3 (``BLOCK_HASH`` bytes) of each ``block``-byte block of a chunk, concatenated."""
    mv = memoryview(data)
    return b"".join(blake3.blake3(mv[o : o + block]).digest(length=BLOCK_HASH) for o in range(0, len(mv), block))


def announce_body(first: int, chunks: list[ChunkRef], blocks: list[bytes] | None = None, block: int = BLOCK,
                  tree: tuple[float, float] | None = None) -> bytes:
    """An announcement of chunks ``first``.., with their blocks' hashes (``block_hashes``) when given,
    and the timing of their region trees, ``tree`` = (send, hop) in seconds (``swarm.push.region_tree``),
    when the trainer knows it: signed with the chunks, every node plans the same tree."""
    body = {"first": first, "chunks": [[c.hash, c.size] for c in chunks]}
    if blocks is not None:
        body["block"], body["blocks"] = block, list(blocks)
    if tree is not None:
        body["tree"] = [round(t * 1e6) for t in tree]
    return pack(body)


MAX_TREE_US = 60_000_000  # a tree's send or hop above a minute is not a timing


def _parse_announce(body: bytes) -> tuple[int, list[ChunkRef], int | None, list[bytes] | None,
                                          tuple[float, float] | None]:
    m = fields(unpack(body, what="chunk announcement", max_len=64 << 20), _ANNOUNCE, what="chunk announcement")
    out = []
    for item in m["chunks"]:
        if not (isinstance(item, list) and len(item) == 2 and Bytes(item[0]) and len(item[0]) == 32
                and NonNegInt(item[1])):
            raise FormatError("chunk announcement: each chunk must be [32-byte hash, size]")
        out.append(ChunkRef(item[0], item[1]))
    if m["first"] + len(out) > MAX_CHUNKS_PER_VERSION:
        raise FormatError(f"chunk announcement: more than {MAX_CHUNKS_PER_VERSION} chunks")
    block, blocks = m["block"], m["blocks"]
    if (block is None) != (blocks is None):
        raise FormatError("chunk announcement: block and blocks go together")
    if blocks is not None:
        if not MIN_BLOCK <= block <= MAX_BLOCK:
            raise FormatError(f"chunk announcement: block size {block} outside {MIN_BLOCK}..{MAX_BLOCK}")
        if len(blocks) != len(out) or not all(
                Bytes(b) and len(b) == BLOCK_HASH * -(-c.size // block) for b, c in zip(blocks, out)):
            raise FormatError(f"chunk announcement: blocks must give {BLOCK_HASH} bytes per block of each chunk")
    tree = m["tree"]
    if tree is not None:
        if not (len(tree) == 2 and all(NonNegInt(t) and 0 < t <= MAX_TREE_US for t in tree)):
            raise FormatError("chunk announcement: tree must be [send, hop], microseconds, 1 to 60,000,000")
        tree = (tree[0] / 1e6, tree[1] / 1e6)
    return m["first"], out, block, blocks, tree


class StatementPage:
    """What one exchange reply carries of the signed statements a peer lacks: at most ``count``
    statements and ``size`` bytes in all, over every version (but always the first, so a reply
    moves a peer on). A peer that joins a swarm whose newest anchor has 70,000 chunks (a 70B model
    in 2 MiB chunks: 50 MB of statements) gets them over several replies, each answered at once
    (the exchange's request says how many it holds), rather than in one reply over the 16 MiB an
    exchange may hold; and none stalls the receiver's event loop long on checking signatures
    (about 0.1 ms each). Pure."""

    def __init__(self, count: int = PAGE_STATEMENTS, size: int = PAGE_BYTES):
        self.count, self.size = count, size
        self.taken = 0

    def take(self, statements: list[Signed], known: int) -> list[bytes]:
        """The serialized statements after the first ``known`` that still fit."""
        out = []
        for s in itertools.islice(statements, known, known + max(self.count, 0)):  # none past the count
            b = s.to_bytes()
            if self.taken and len(b) > self.size:
                break
            out.append(b)
            self.count -= 1
            self.size -= len(b)
            self.taken += 1
        return out


@dataclass
class VersionState:
    version: int
    anchor: bool = False
    chunks: dict[int, ChunkRef] = field(default_factory=dict)
    statements: list[Signed] = field(default_factory=list)
    manifest: Manifest | None = None
    have: set[int] = field(default_factory=set)
    block: int | None = None  # the block size its announcements hash (None: announced without blocks)
    blocks: dict[int, bytes] = field(default_factory=dict)  # chunk -> its blocks' hashes (``block_hashes``)
    roots: dict[int, str] = field(default_factory=dict)  # chunk -> the region it entered the swarm in (push tree)
    first_hand: set[int] = field(default_factory=set)  # chunks this node took from the trainer (stripe_targets)
    handed_on: dict[int, set[tuple[int, int]]] = field(default_factory=dict)  # chunk -> the stripes (s, n) it hands on
    trees: dict[int, tuple[float, float]] = field(default_factory=dict)  # chunk -> its tree's (send, hop), signed
    announced: dict[int, Signed] = field(default_factory=dict, repr=False)  # chunk -> the statement announcing it
    held_at: float | None = None  # when this node came to hold it whole, wall clock (None: before this run)
    _by_hash: dict[bytes, int] = field(default_factory=dict, repr=False)
    _sigs: set[bytes] = field(default_factory=set, repr=False)  # the statements' signatures, to drop repeats

    @property
    def key(self) -> Key:
        return Key(self.version, self.anchor)

    @property
    def obj(self) -> Obj:
        return Obj(self.base_version, self.complete)

    @property
    def total(self) -> int | None:
        """Number of chunks, once the manifest is in."""
        return len(self.manifest.chunks) if self.manifest is not None else None

    @property
    def complete(self) -> bool:
        return self.manifest is not None and len(self.have) == self.total

    @property
    def base_version(self) -> int | None:
        return self.manifest.base_version if self.manifest is not None else None

    def missing(self) -> list[int]:
        return sorted(i for i in self.chunks if i not in self.have)

    def index_of(self, h: bytes) -> int | None:
        return self._by_hash.get(h)

    def add(self, s: Signed, verifier: Verifier) -> list[int]:
        """Take a signed statement; returns the chunk indices it made known (empty if nothing new)."""
        if s.version != self.version or s.anchor != self.anchor:
            raise FormatError(f"statement for {Key(s.version, s.anchor)} given to {self.key}")
        if s.sig in self._sigs:  # a set: an anchor of 70,000 chunks takes as many statements
            return []
        verifier.verify(s)
        if not s.is_manifest:
            first, refs, block, blocks, tree = _parse_announce(s.body)
            if blocks is not None:
                if self.block is not None and block != self.block:
                    raise FormatError(f"version {self.version}: announced with blocks of {self.block} and {block}")
                for i, b in enumerate(blocks, start=first):
                    if self.blocks.get(i, b) != b:
                        raise IntegrityError(f"version {self.version}: chunk {i} announced twice with different "
                                             "block hashes")
            new = self._merge(dict(enumerate(refs, start=first)))
            for i in range(first, first + len(refs)):
                self.announced.setdefault(i, s)
                if tree is not None:
                    self.trees.setdefault(i, tree)
            if blocks is not None:
                self.block = block
                self.blocks.update(enumerate(blocks, start=first))
        else:
            m = Manifest.from_bytes(s.body)
            if m.version != self.version:
                raise IntegrityError(f"manifest says version {m.version}, signed as {self.version}")
            check_kind(m, self.anchor)
            listed = {i: ChunkRef(c.hash, c.size) for i, c in enumerate(m.chunks)}
            extra = [i for i in self.chunks if i not in listed]
            if extra:
                raise IntegrityError(f"version {self.version}: chunk {extra[0]} was announced "
                                     "but is not in the manifest")
            new = self._merge(listed)
            self.manifest = m
        self.statements.append(s)
        self._sigs.add(s.sig)
        return new

    def _merge(self, refs: dict[int, ChunkRef]) -> list[int]:
        for i, r in refs.items():
            known = self.chunks.get(i)
            if known is not None and known != r:
                raise IntegrityError(f"version {self.version}: chunk {i} announced twice with different hashes")
        new = [i for i in refs if i not in self.chunks]
        self.chunks.update(refs)
        for i in new:
            self._by_hash.setdefault(refs[i].hash, i)
        return new


def check_kind(m: Manifest, anchor: bool) -> None:
    """An anchor's manifest applies to nothing and writes every tensor whole; a patch's names
    the version it applies to."""
    if anchor and (m.base_version is not None or any(t.op != FULL for t in m.tensors)):
        raise FormatError(f"anchor {m.version}: an anchor applies to nothing and writes every tensor whole")
    if not anchor and m.base_version is None:
        raise FormatError(f"version {m.version}: a patch must name its base version (a full snapshot is an anchor)")


def to_bitmap(indices: Iterable[int], n: int) -> bytes:
    """A have-map: bit i (big-endian within bytes) set when chunk i is held."""
    return _to_bitmap_cached(frozenset(indices), n) if n <= _CACHED_CHUNKS else _to_bitmap(indices, n)


def from_bitmap(data: bytes, limit: int = MAX_CHUNKS_PER_VERSION) -> frozenset[int]:
    """The chunk indices a have-map sets."""
    if len(data) * 8 > limit + 7:
        raise FormatError(f"have-map of {len(data)} bytes exceeds {limit} chunks")
    data = bytes(data)
    return _from_bitmap_cached(data) if len(data) * 8 <= _CACHED_CHUNKS else _from_bitmap(data)


def _to_bitmap(indices: Iterable[int], n: int) -> bytes:
    bits = np.zeros(n, dtype=bool)
    idx = np.fromiter((i for i in indices if 0 <= i < n), dtype=np.int64)
    bits[idx] = True
    return np.packbits(bits).tobytes()


def _from_bitmap(data: bytes) -> frozenset[int]:
    return frozenset(np.flatnonzero(np.unpackbits(np.frombuffer(data, dtype=np.uint8))).tolist())


# Every exchange carries a have-map per retained version, mostly the same ones again (a node's
# have-maps change when it stores a chunk, and it sends them to every peer): numpy's fixed cost per
# call was a tenth of a daemon's CPU while a small version moved (docs/PERFORMANCE.md). Maps of up to
# 256 chunks are cached (a few MB at most); larger ones are converted each time.
_CACHED_CHUNKS = 256
_to_bitmap_cached = functools.lru_cache(maxsize=1024)(_to_bitmap)
_from_bitmap_cached = functools.lru_cache(maxsize=1024)(_from_bitmap)
