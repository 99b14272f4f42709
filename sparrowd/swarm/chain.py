"""The chain of versions: which objects a node needs, and which it may drop.

The swarm moves two kinds of object, each named by a ``Key``:

* a *patch* ``(v, False)`` turns its base version (in its manifest) into
  version ``v``; the trainer publishes one per step, each on the last;
* an *anchor* ``(v, True)`` is a full snapshot of version ``v``, chunked and
  signed like a patch (a manifest whose tensors are all written whole); the
  trainer publishes one every few versions, and version 0's is the base model.

A node's *position* is the newest version it can produce: the base model
(version 0) at first, then wherever the anchors and patches it completed
take it; the node keeps it on disk, since retention drops the patches that
got it there.
It fetches the patches that lead from its position to the newest version;
when that chain is broken (it joined late, or fell behind what the swarm
retains) it fetches the newest anchor from which an unbroken chain of
patches leads to the newest version, and those patches, never a guess. (With
no such anchor it still holds the chain the swarm has, to relay it; its
engine cannot use it, and the patches' base fingerprints say so.)
Retention keeps the last ``retain`` patches and never drops the newest
anchor or a patch after it, so a late node can always catch up.

Pure: keys and manifests' bases in, decisions out.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import NamedTuple

__all__ = ["Key", "Obj", "advance", "wanted", "retained", "engine_plan", "producible", "Unproducible",
           "unproducible"]


class Key(NamedTuple):
    version: int
    anchor: bool = False

    def __str__(self) -> str:
        return f"anchor {self.version}" if self.anchor else f"version {self.version}"

    @property
    def tag(self) -> str:
        """The key in a URL: ``12`` for version 12's patch, ``a12`` for its anchor."""
        return f"a{self.version}" if self.anchor else str(self.version)

    @classmethod
    def parse(cls, tag: str) -> "Key":
        digits = tag[1:] if tag.startswith("a") else tag
        if not (digits.isascii() and digits.isdigit()) or len(digits) > 18:
            raise ValueError(f"{tag!r} is not a version (12) or an anchor (a12)")
        return cls(int(digits), tag.startswith("a"))


class Obj(NamedTuple):
    """What a node knows of an object: the base its manifest names (None for an anchor, or
    while the manifest is not in yet), and whether the node holds all of it."""

    base: int | None
    complete: bool


def _follow(start: int, patches: Mapping[int, int | None]) -> int:
    """The version reached from ``start`` through patches whose manifest names their base."""
    by_base = {b: v for v, b in patches.items() if b is not None}
    cur = start
    while cur in by_base and by_base[cur] > cur:
        cur = by_base[cur]
    return cur


def advance(at: int, held: Mapping[Key, Obj]) -> int:
    """Where a node at version ``at`` stands with the complete objects it holds: at the newest
    whole anchor if that is further, then through every held patch whose base it has reached.
    A patch held without its base reached moves nothing (it may have come before its anchor)."""
    done = {k: o for k, o in held.items() if o.complete}
    patches = {k.version: o.base for k, o in done.items() if not k.anchor}
    return _follow(max([at] + [k.version for k in done if k.anchor]), patches)


def wanted(at: int, known: Mapping[Key, Obj], *, chain_known: bool = True) -> set[Key]:
    """The objects a node at version ``at`` should fetch (held ones included; the caller skips
    what is complete). ``known``: every object the node has a signed statement for.
    ``chain_known``: the node has heard the trainer's own list, so a patch it does not know of
    is gone rather than not heard of yet; until then it never turns to an anchor."""
    patches = {k.version: o.base for k, o in known.items() if not k.anchor}
    with_manifest = [v for v, b in patches.items() if b is not None]
    anchors = sorted((k.version for k in known if k.anchor), reverse=True)
    newest = max(with_manifest + anchors, default=at)
    end = _follow(at, patches)
    start, anchor = at, False
    if end < newest and chain_known:
        # Broken chain: the newest anchor from which the patches lead all the way.
        for a in anchors:
            if a > at and _follow(a, patches) >= newest:
                start, end, anchor = a, _follow(a, patches), True
                break
        else:
            # No anchor bridges the gap: hold the chain the swarm still has, from its oldest base,
            # to relay it (the engine cannot apply it without an anchor: its base check refuses).
            starts = sorted(b for b in patches.values() if b is not None and b > at and _follow(b, patches) >= newest)
            if starts:
                start, end = starts[0], _follow(starts[0], patches)
    out: set[Key] = {Key(start, True)} if anchor else set()
    cur = start
    by_base = {b: v for v, b in patches.items() if b is not None}
    while cur < end:
        cur = by_base[cur]
        out.add(Key(cur))
    # Patches still streaming (manifest not in) build on the newest published version.
    out.update(Key(v) for v, b in patches.items() if b is None and v > newest)
    return out


def listed_whole(at: int, listed: Iterable[Key], manifested: Collection[Key]) -> bool:
    """Whether the trainer's listing (``listed``: every object it retains) told a node at ``at``
    the whole chain ahead: every object newer than ``at`` came with its manifest, save those newer
    than every manifest (still being published). A reply carries the statements a page at a time,
    newest first, so a cut page shows the newest anchor and the patches after it but not the older
    patches that lead from ``at``; taken for the whole chain, that gap would send the node for the
    anchor (a whole model) for want of a page. ``manifested``: the objects whose manifest it holds."""
    ahead = [k for k in listed if k.version > at]
    newest = max((k.version for k in ahead if k in manifested), default=at)
    return all(k in manifested or k.version > newest for k in ahead)


def retained(complete: Iterable[tuple[Key, Obj]], retain: int, newest_anchor: int | None = None) -> set[Key]:
    """Of the complete objects, those kept: the last ``retain`` patches, the newest anchor, and
    every patch after that anchor (so a node that catches up from it finds the whole chain).
    ``newest_anchor``: the newest anchor the node knows of, held or not; an older anchor it holds
    is no longer the one late nodes start from, so it and the patches before the newer go."""
    complete = list(complete)
    patches = sorted(k.version for k, _ in complete if not k.anchor)
    anchors = [k.version for k, _ in complete if k.anchor]
    keep = {Key(v) for v in patches[-retain:]} if retain > 0 else set()
    if anchors or newest_anchor is not None:
        newest = max(anchors + ([newest_anchor] if newest_anchor is not None else []))
        if newest in anchors:
            keep.add(Key(newest, True))
        keep.update(Key(v) for v in patches if v > newest)
    return keep


def engine_plan(at: int, held: Mapping[Key, Obj]) -> tuple[int | None, list[int]]:
    """What an engine holding version ``at`` loads next from the node's complete objects:
    ``(anchor, patches)``. The patches that follow ``at`` when they lead to the newest version
    held (no anchor); otherwise the newest anchor from which held patches do, then those."""
    done = {k: o for k, o in held.items() if o.complete}
    patches = {k.version: o.base for k, o in done.items() if not k.anchor}
    newest = max((k.version for k in done), default=at)

    def chain(start: int) -> list[int]:
        by_base = {b: v for v, b in patches.items() if b is not None}
        out, cur = [], start
        while cur in by_base and by_base[cur] > cur:
            cur = by_base[cur]
            out.append(cur)
        return out

    direct = chain(at)
    if (direct[-1] if direct else at) >= newest:
        return None, direct
    for a in sorted((k.version for k in done if k.anchor and k.version > at), reverse=True):
        after = chain(a)
        if (after[-1] if after else a) >= newest:
            return a, after
    return None, direct


def producible(held: Mapping[Key, Obj]) -> dict[int, tuple[int, list[int]]]:
    """Every version the complete objects can make, from nothing: ``version -> (anchor, patches)``,
    the anchor to start from and the patches to apply after it (the newest anchor wins a tie, so
    the chain is the shortest). What ``sparrowd checkout`` can write."""
    done = {k: o for k, o in held.items() if o.complete}
    by_base = {o.base: k.version for k, o in done.items() if not k.anchor and o.base is not None}
    out: dict[int, tuple[int, list[int]]] = {}
    for a in sorted(k.version for k in done if k.anchor):
        out[a] = (a, [])
        cur, chain = a, []
        while cur in by_base and by_base[cur] > cur:
            cur = by_base[cur]
            chain.append(cur)
            out[cur] = (a, list(chain))
    return out


class Unproducible(NamedTuple):
    """A version this node holds whole but cannot produce, the base its held chain starts from, and
    why, in one line."""

    version: int
    base: int
    reason: str


def unproducible(held: Mapping[Key, Obj], based: set[int], decoded: set[int], folder: int | None, *,
                 keeps_folder: bool, target: int | None = None) -> Unproducible | None:
    """Why version ``target`` (default: the newest patch held whole) cannot be produced here, or None.

    ``based``: the patches coded against their base's bits (``ulp2``): only a folder that holds
    that base (the node's current folder) decodes them; ``decoded``: those it has decoded already;
    ``folder``: the version the current folder holds (None: empty). A base is within reach when
    the folder holds it or a later version, reaches it through held patches, or a held anchor does."""
    done = {k: o for k, o in held.items() if o.complete}
    patches = {k.version: o.base for k, o in done.items() if not k.anchor}
    if target is None:
        todo = [v for v in patches if v in based and v not in decoded and (folder is None or v > folder)]
        if not todo:
            return None
        target = max(todo)
    if target not in patches or target not in based or target in decoded or (folder is not None and target <= folder):
        return None
    base = patches[target]
    if base is None:
        return None
    reach = set(producible(done))
    if folder is not None:
        reach.add(folder)
        cur, by_base = folder, {b: v for v, b in patches.items() if b is not None}
        while cur in by_base and by_base[cur] > cur:
            cur = by_base[cur]
            reach.add(cur)
    if base in reach or (folder is not None and folder >= base):
        return None
    while base in patches and (prev := patches[base]) is not None and prev < base:
        base = prev  # the chain's start: what the node lacks is the base the held patches lead from
    if not keeps_folder:
        why = (f"v{target}: ulp2 needs base {base} in a current folder, which this node does not keep: "
               f"start it with --current on and --base, or publish an anchor")
    else:
        why = f"v{target}: ulp2 needs base {base}, which this node lacks: start it with --base or publish an anchor"
    return Unproducible(target, base, why)
