"""The change history an ``ulp2`` patch may be coded against (docs/FORMAT.md, "History").

Under AdamW an element that moved in the last steps is likely to move again, and in the same
direction: momentum carries it. On MiniLM, 20% of one step's changes also changed in the step
before and their sign repeated 98% of the time. A receiver that applied the last patches knows
which elements they changed and how, so an ``ulp2`` segment may code, for each element of that
*history*, whether it changed again (context: its class and which of those patches moved it) and
its direction (context: the direction it last moved in); only the other changes are coded by rank.

A :class:`History` holds, per tensor, the elements the last :data:`DEPTH` patches changed: their
sorted flat positions and a state byte each (bit 0: it last moved down; the bits above: the mask
of those patches that moved it, bit ``a`` for the patch ``a`` back from the latest). It is pure
data: the encoder builds the next one from what it encoded, a decoder from what it decoded
(:meth:`History.after`), and both name it by :meth:`fingerprint`, which the manifest records, so a
decoder with any other history refuses before decoding anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np
import xxhash

if TYPE_CHECKING:
    from .bits import RawTensor
    from .chunk import Segment
    from .manifest import Manifest

__all__ = ["DEPTH", "MASKS", "History", "TensorHistory", "directions", "changes_between"]

DEPTH = 3  # patches a history spans (the C extension's HDEPTH): on MiniLM's entropy bound at the 4th
# step, 2 patches gain 0.51 bits over none and 3 patches 0.65
DOWN = 1  # state bit 0: the element last moved down; the bits above: which of the last patches moved it
MOVED = 2  # the state's bit for "the latest patch moved it" (bit 0 of the mask, state >> 1)
MASKS = (1 << DEPTH) - 1  # nonzero masks a history element may have (the C extension's HMASKS): on the
# 27.4M decoder's 4th step, "changed again" given (class, mask) takes 0.09 bits per changed element
# less than given (class, how long ago it last moved)


@dataclass(frozen=True, eq=False)
class TensorHistory:
    positions: np.ndarray  # int64, ascending
    state: np.ndarray  # uint8: DOWN | MOVED * mask
    cls: np.ndarray | None = None  # an encoder's: each entry's class in the base, where the diff took them

    def within(self, start: int, stop: int) -> TensorHistory:
        lo, hi = np.searchsorted(self.positions, [start, stop])
        return TensorHistory(self.positions[lo:hi], self.state[lo:hi], None if self.cls is None else self.cls[lo:hi])

    def with_classes(self, cls: np.ndarray | None) -> TensorHistory:
        """The same entries with their classes in the base (as the diff's class scan took them)."""
        if cls is None:
            return self
        if cls.shape != self.positions.shape:
            raise ValueError(f"history classes: {cls.size} for {self.positions.size} entries")
        return TensorHistory(self.positions, self.state, cls)


_EMPTY = TensorHistory(np.empty(0, np.int64), np.empty(0, np.uint8))


def _aged(old: TensorHistory, idx: np.ndarray, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One tensor's entries after a patch that changed ``idx`` (sorted) by ``codes``: one merge pass
    in the C extension (which ulp2 needs anyway), else numpy."""
    from .bits import _native

    if _native is not None:
        room = old.positions.size + idx.size
        pos, state = np.empty(room, np.int64), np.empty(room, np.uint8)
        n = _native.history_after(np.ascontiguousarray(old.positions, np.int64),
                                  np.ascontiguousarray(old.state, np.uint8), idx, codes, codes.dtype.itemsize,
                                  pos, state)
        pos.resize(n, refcheck=False)  # realloc: the room left over goes back, and nothing is copied
        state.resize(n, refcheck=False)
        return pos, state
    u8 = np.uint8
    aged = old.state & u8(MASKS & ~1)  # each entry's mask (state >> 1) shifted up a patch: 0, it leaves
    at = np.searchsorted(old.positions, idx)
    again = at < old.positions.size
    again[again] = old.positions[at[again]] == idx[again]
    mask = np.ones(idx.size, u8)
    mask[again] |= aged[at[again]]
    keep = aged != 0
    keep[at[again]] = False  # moved again: its new entry stands for it
    pos = np.concatenate([idx, old.positions[keep]])
    state = np.concatenate([mask << u8(1) | directions(codes), aged[keep] << u8(1) | (old.state[keep] & u8(DOWN))])
    order = np.argsort(pos, kind="stable")
    return pos[order], state[order]


def directions(codes: np.ndarray) -> np.ndarray:
    """Whether each zigzag ulp code moved its element down (uint8 0 or 1)."""
    return cast(np.ndarray, (((codes.astype(np.uint64) - np.uint64(1)) & np.uint64(1)) == 0).astype(np.uint8))


def changes_between(old: Mapping[str, RawTensor], new: Mapping[str, RawTensor]
                    ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """What :meth:`History.after` takes, from two snapshots (``name -> RawTensor``): each float
    tensor's changed positions and zigzag ulp codes (a diff; encoders and decoders have them at hand)."""
    from .bits import dtype_info, ulp_encode

    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name, n in new.items():
        o = old.get(name)
        if o is not None and o.shape == n.shape and o.dtype == n.dtype and dtype_info(n.dtype).is_float:
            idx = np.flatnonzero(o.bits != n.bits)
            if idx.size:
                out[name] = (idx, ulp_encode(o.bits[idx], n.bits[idx]))
    return out


@dataclass(frozen=True, eq=False)
class History:
    """What the last patches changed, per tensor; ``versions``: the versions they produced, newest
    first (empty: no history)."""

    versions: tuple[int, ...] = ()
    tensors: dict[str, TensorHistory] = field(default_factory=dict)

    def get(self, name: str) -> TensorHistory | None:
        return self.tensors.get(name)

    def fingerprint(self) -> bytes:
        """8 bytes naming this history's content: XXH3-64 over, per tensor in name order, the name,
        the count, the positions (int64 little-endian) and the states."""
        h = xxhash.xxh3_64()
        for name in sorted(self.tensors):
            t = self.tensors[name]
            h.update(name.encode() + b"\0" + int(t.positions.size).to_bytes(8, "little"))
            h.update(np.ascontiguousarray(t.positions, "<i8").data.cast("B"))
            h.update(np.ascontiguousarray(t.state, np.uint8).data.cast("B"))
        return h.digest()

    def after(self, version: int, changes: Mapping[str, tuple[np.ndarray, np.ndarray]],
              reset: Iterable[str] = (), *, pool: Executor | None = None) -> History:
        """The history once the patch producing ``version`` is applied: ``changes`` maps a tensor to
        its changed positions (sorted) and their zigzag ulp codes; tensors in ``reset`` (written whole,
        or removed) start over. Tensors the patch did not touch age. ``pool``: threads to merge the
        tensors on, side by side (the C merge releases the GIL); never the pool this runs on."""
        gone = set(reset)

        def merged(name: str) -> tuple[np.ndarray, np.ndarray]:
            old = self.tensors.get(name, _EMPTY)
            idx, codes = changes.get(name, (_EMPTY.positions, np.empty(0, np.uint16)))
            return _aged(old, np.ascontiguousarray(idx, np.int64), np.ascontiguousarray(codes))

        names = sorted((set(self.tensors) | set(changes)) - gone)
        out: dict[str, TensorHistory] = {}
        for name, (pos, state) in zip(names, map(merged, names) if pool is None else pool.map(merged, names)):
            if pos.size:
                out[name] = TensorHistory(pos, state)
        return History((version, *self.versions)[:DEPTH], out) if out else History()

    def after_patch(self, manifest: Manifest, parts: Mapping[str, list[Segment]], *,
                    pool: Executor | None = None) -> History:
        """The history once ``manifest``'s patch is applied, from its decoded segments (``name ->
        [Segment]``, as a decoder has them). Only ulp2 patches carry one on: after any other, and
        after a patch without a base (an anchor), the next starts afresh. ``pool``: as for
        :meth:`after`."""
        if manifest.values != "ulp2" or manifest.base_version is None:
            return History()
        changes: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        reset: list[str] = []
        for t in manifest.tensors:
            segs = sorted(parts.get(t.name, []), key=lambda s: s.start)
            if t.op != "patch" or (segs and segs[0].values != "ulp2"):
                reset.append(t.name)  # written whole, removed, or not float: nothing to go on
            elif segs:
                changes[t.name] = (np.concatenate([s.indices for s in segs]), np.concatenate([s.data for s in segs]))
        start = self if manifest.history is not None else History()
        return start.after(manifest.version, changes, reset, pool=pool)
