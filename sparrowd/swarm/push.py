"""Whom a relay sends a chunk to unasked (push): a pure function of what it knows of its peers.

A pulled chunk costs each hop one and a half round trips before its blocks
move (the holder's have message, the request, the first block back), which
for a patch of one or a few chunks is most of the time to all (evidence:
docs/history/DESIGN-NOTES.md#push-unasked). So a relay that can serve a chunk
(its first block checked out, or whole) also sends it, unasked, to

* up to ``local`` peers of its own region that neither hold nor fetch it,
  ranked by a rendezvous hash of (version, chunk, pusher > peer), so that
  two relays of a region push to different neighbours; and
* up to ``cross`` other regions where it knows nobody who holds or fetches
  it: to the node that region's own designation names for the chunk (the
  rendezvous winner among its crossers, as ``Picker`` computes it there),
  so that the pushed copy is the region's one crossing, not an extra one.

Pushing across needs every node the other region designates among, or the
pusher names a node its region did not and the chunk crosses twice (evidence:
docs/history/DESIGN-NOTES.md#push-across-designation). ``heads`` holds only
the regions a node knows whole (the tracker tells each node how many rollouts
each region has): in a swarm that fits a peer list, all of them; in larger
ones, the pushes stay local.

Pushes take only upload slots that requests leave idle (``idle``): a view of
what peers hold is a fraction of a round trip old, so a push queued with the
requests is often declined and holds up the requests behind it, while an idle
uplink loses nothing to a declined push. Pushes continue however many peers a
relay knows to hold the chunk, since a tree across regions needs pushes more
than one level deep (evidence: docs/history/DESIGN-NOTES.md#push-idle-slots).
The receiver declines a push of a chunk it holds, fetches, or cannot check
(no signed block hashes yet) before reading a byte, and a push starts with a
single block, so a declined one costs the pusher's rate limits little.
``sent`` counts the pushes this node already sent for the chunk, per kind,
so that calling again once the chunk is whole only tops them up.

While a chunk is still arriving, a relay streams it on (pushed and asked
for alike) to no more peers at once than its uplink carries at the rate the
chunk comes in (``relay_fanout``; the sender declares its stream's rate,
``RATE_HEADER``): served to more, every stream runs slower than the chunk
arrives, and the heads that cross next are fed slower again (evidence:
docs/history/DESIGN-NOTES.md#push-relay-fanout). The rest wait until the
chunk is whole, then go at full rate. ``most`` is how many more streams the
chunk may have now; pushes across go first, as a crossing seeds a whole
region.

Where a node knows the region a chunk entered the swarm in (its root), the
crossings follow the chunk's region tree (``region_tree``) instead of each
relay's own ranking: each head of a region in the tree takes one region not
yet in it, breadth first from the root, so that every crossing runs at a
head's whole WAN rate and the tree is as shallow as the heads allow, rather
than a holder splitting its WAN share between regions and chains forming
several crossings deep (evidence: docs/history/DESIGN-NOTES.md#push-region-tree).

A head that holds a chunk whole has its WAN limit free again: where the
chunk is sent in less time than two crossings' delay, a second crossing
from it lands sooner than a crossing from deeper in the tree. Given the
chunk's send time and a crossing's hop, which the trainer signs into the
chunk's announcement so that every node plans alike, the tree is planned
earliest first: each head crosses from its region's first block and once
more when whole (evidence: docs/history/DESIGN-NOTES.md#push-timed-tree).
A head's second crossing waits until it holds the chunk (``whole``).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

from .picker import _score, designated
from .policy import CROSSINGS, DEFAULT_PUSH, PUSHES_TAKEN, STRIPED_TAKEN

__all__ = ["CROSSINGS", "DEFAULT_PUSH", "NO_HASHES", "RATE_HEADER", "STRIPE_HEADER", "Arriving", "PushPeer",
           "StripePlan", "declines", "parse_push", "parse_stripe", "push_heads", "push_targets", "region_tree",
           "relay_fanout", "stream_rate", "stripe_blocks", "stripe_plan", "stripe_size", "stripe_targets",
           "stripes_handed_on", "tree_timing", "unstarted"]

RATE_HEADER = "X-Sparrowd-Rate"  # a chunk stream's rate as its sender paces it, bytes a second (relay_fanout)
STRIPE_HEADER = "X-Sparrowd-Stripe"  # a push that carries one stripe of a chunk: "s/n" (stripe_plan)
NO_HASHES = "no signed block hashes for that chunk here yet"  # a push declined until its announcement is here


@dataclass(frozen=True)
class PushPeer:
    node_id: str
    region: str
    has: bool  # holds or fetches the chunk, or was pushed it, as far as this node knows (or is not to be pushed to)


def region_tree(tag: int | str, index: int, root: str, heads: Mapping[str, Sequence[str]], *,
                send: float | None = None, hop: float | None = None) -> dict[str, tuple[str, ...]]:
    """Chunk ``index``'s tree across regions, for a chunk that entered the swarm in region ``root``
    (its first holder fetched it from the trainer there): head -> the regions it pushes the chunk to,
    in order. Every node computes the same tree from the same heads and timings.

    Without timings, breadth first: the root region's heads (ranked for this chunk) each take one of
    the other regions (in an order ranked for this chunk), then those regions' heads each take one
    of the rest, and so on: every crossing runs at a head's whole WAN rate, and the tree is as shallow
    as the heads allow (one level at 100 nodes in 8 regions, three at 16).

    With ``send`` (the seconds a head takes to send the chunk, at the rate it arrives) and ``hop``
    (a crossing's latency: the one-way delay across regions and a block's time), earliest first: a
    head may cross while the chunk arrives (cut-through, from the moment its region has it) and
    again once it holds it whole (``send`` later; a relay pushes at those two moments, so at most
    ``CROSSINGS`` times), and each region in turn
    goes to the crossing that starts first (ties in breadth-first order). A region three crossings
    deep is reached at three hops; a root head's second crossing at one send and one hop, sooner
    where a chunk is sent in less than two hops (one 256 KiB chunk at 4 MiB/s, 62 ms, against
    40 ms one-way delays). Where sending takes longer it is the breadth-first tree."""
    return _tree(tag, index, root, heads, send, hop)[0]


def _tree(tag: int | str, index: int, root: str, heads: Mapping[str, Sequence[str]], send: float | None,
          hop: float | None) -> tuple[dict[str, tuple[str, ...]], float]:
    """``region_tree``, and when its last crossing starts (in the tree's timing: hops without it)."""
    others = sorted((r for r in heads if r != root), key=lambda r: _score(tag, index, f"r{r}"))
    tree: dict[str, list[str]] = {}
    slots: list[tuple[float, int, int, str]] = []  # (when it may start, breadth-first order, crossing, head)
    order = itertools.count()
    timed = send is not None and hop is not None
    most = CROSSINGS if timed else 1

    def reach(region: str, at: float) -> None:
        for h in sorted(heads.get(region, ()), key=lambda h: _score(tag, index, h), reverse=True):
            heapq.heappush(slots, (at, next(order), 0, h))

    reach(root, 0.0)
    last = 0.0
    for r in others:
        if not slots:
            break
        at, _, k, h = heapq.heappop(slots)
        tree.setdefault(h, []).append(r)
        last = max(last, at)
        if k + 1 < most:
            heapq.heappush(slots, (at + (send or 0.0), next(order), k + 1, h))  # timed: send is given
        reach(r, at + hop if timed and hop is not None else at + 1.0)
    return {h: tuple(rs) for h, rs in tree.items()}, last


def tree_timing(size: int, block: int, rate: float | None, delay: float | None) -> tuple[float, float] | None:
    """A chunk's region tree timing, ``(send, hop)`` for ``region_tree``, as the trainer signs it into
    the chunk's announcement: the chunk of ``size`` bytes at the trainer's upload limit ``rate``, and
    a crossing's ``delay`` (one way, between regions) plus a ``block``'s time at that rate. None, and
    the tree is breadth first, where either is unknown."""
    if not rate or rate <= 0 or delay is None:
        return None
    return size / rate, delay + block / rate


def push_targets(tag: int | str, index: int, me: str, region: str, peers: Iterable[PushPeer],
                 heads: Mapping[str, Sequence[str]], *, local: int, cross: int,
                 sent: tuple[int, int] = (0, 0), idle: tuple[int, int] = (8, 8),
                 tree: Mapping[str, Sequence[str]] | None = None, most: int | None = None,
                 whole: bool = True) -> tuple[list[str], list[str]]:
    """The peers to push chunk ``index`` of version ``tag`` to now: (same region, other regions).
    ``peers`` are the rollout peers this node knows (not the trainer); ``heads`` each other region's
    crossers, for the regions this node knows whole (``push_heads``); ``idle`` the upload slots free
    in the (own region, other regions) lanes, nobody waiting: pushes only take what requests leave;
    ``most`` the streams the chunk may have more of now (``relay_fanout``), those across first;
    ``whole`` whether this node holds the chunk whole (else it relays it as it arrives): a head's
    crossings in the tree after its first wait until then."""
    peers = list(peers)
    most = local + cross if most is None else most
    far: list[str] = []
    room = min(cross - sent[1], idle[1], most)
    has = {p.node_id: p.has for p in peers}
    busy = {p.region for p in peers if p.has}
    order = sorted(heads, key=lambda r: _score(tag, index, f"{me}>r{r}")) if room > 0 else []
    if tree is not None and room > 0:  # the chunk's tree: this node's crossings, the first while it arrives
        order = [r for r in tree.get(me, ())[:None if whole else 1] if r in heads]
    for r in order:
        if len(far) >= room:
            break
        if r == region or r in busy:
            continue  # a peer there has it or is getting it: the region spreads it from there
        d = designated(tag, index, heads[r])
        if d is not None and d in has and not has[d]:
            far.append(d)
    duty = set(tree or ())  # heads with a crossing in the chunk's tree: pushed to first in their region
    free_local = sorted((p.node_id for p in peers if p.region == region and not p.has),
                        key=lambda n: (n not in duty, _score(tag, index, f"{me}>{n}")))
    near = free_local[:max(0, min(local - sent[0], idle[0], most - len(far)))]
    return near, far


def relay_fanout(uplink: float | None, arriving: float | None) -> int | None:
    """The most streams a relay serves at once from a chunk still arriving to it, pushed and asked
    for alike: as many as its uplink (bytes a second) carries at the rate the chunk arrives at, at
    least one; None (no limit) where either rate is unknown (a node with no upload limit set, or a
    sender that paces nothing)."""
    if not uplink or not arriving or uplink <= 0 or arriving <= 0:
        return None
    return max(1, int(uplink / arriving + 1e-9))


def stream_rate(uplink: float | None, wan_uplink: float | None, streams: int, wan_streams: int, *, wan: bool,
                arriving: float | None = None) -> float | None:
    """The rate a stream a node serves goes at, as far as its own limits pace it (what it declares,
    ``RATE_HEADER``): its share of the upload limit among the ``streams`` it serves now, this one
    counted; across regions (``wan``) no more than its share of the WAN limit among the
    ``wan_streams``; and no faster than the chunk arrives (``arriving``) while it still does. None
    where nothing limits it."""
    rates = []
    if uplink:
        rates.append(uplink / max(1, streams))
    if wan and wan_uplink:
        rates.append(wan_uplink / max(1, wan_streams))
    if arriving:
        rates.append(arriving)
    return min(rates) if rates else None


def push_heads(region: str, me: str, peers: Iterable[str], heads: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """The other regions' heads this node pushes across to (``heads``: region -> its heads, as the
    tracker names them, ``LeaseTable.all_heads``): all of them if ``me`` is a head of its region (every
    node knows every head, so a head's push is admitted), else those of the regions whose every head
    is among this node's rollout peers (``peers``, node ids; in a small swarm, every region)."""
    if me in heads.get(region, ()):
        return {r: sorted(hs) for r, hs in heads.items() if r != region and hs}
    known = set(peers)
    return {r: sorted(hs) for r, hs in heads.items() if r != region and hs and known.issuperset(hs)}


def parse_push(text: str) -> tuple[int, int]:
    """``LOCAL,CROSS`` (``--push 2,2``; ``off`` for 0,0) -> (local, cross), each 0 to 8."""
    if text.strip().lower() in ("off", "0", "none"):
        return 0, 0
    parts = text.split(",")
    try:
        local, cross = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"push takes LOCAL,CROSS (two counts, as in 2,2) or off, not {text!r}") from None
    if not (0 <= local <= 8 and 0 <= cross <= 8):
        raise ValueError(f"push counts must be 0 to 8, not {text!r}")
    return local, cross


class StripePlan(NamedTuple):
    """How one chunk crosses in stripes (``stripe_plan``): ``n`` stripes, one for each region but the
    root; ``stripe`` region -> its stripe; ``receiver`` region -> the head that takes it there and
    hands its stripe on to every other receiver."""

    n: int
    stripe: dict[str, int]
    receiver: dict[str, str]


def stripe_plan(tag: int | str, index: int, root: str, heads: Mapping[str, Sequence[str]], blocks: int, *,
                send: float | None = None, hop: float | None = None) -> StripePlan | None:
    """Chunk ``index``'s crossings in stripes, where they beat its region tree: where the root region
    has fewer heads than there are other regions, a chunk relayed whole crosses from region to
    region, each crossing a chunk's time or a hop behind the last (evidence:
    docs/history/DESIGN-NOTES.md#push-stripes).

    In stripes every region is two crossings from the root whatever their number, the scatter and
    gather the fluid bound assumes: the chunk's ``blocks`` are dealt into ``n`` stripes (stripe ``s``:
    blocks ``s``, ``s + n``, ...; ``stripe_blocks``), one for each other region; the node that took
    the chunk from the trainer sends each region's receiver (the head its designation names, as
    ``push_targets`` does) that region's stripe as its blocks arrive; and each receiver hands its
    stripe on, block by block as they check out, to every other region's receiver. Every region
    takes the chunk in once, the first holder sends one chunk across and each receiver ``(n-1)/n``
    of one, and no block waits for a whole chunk anywhere. The rest of a region takes the chunk from
    its receiver, as from any relay. The first holder alone sends the stripes: the root's other heads
    take the chunk a local hop later, behind the first holder's streams to the other regions.

    Its price is the tail: the receiver of the chunk's last block sends ``n - 1`` copies of it once it
    has it. So for a patch's first chunk, with the tree's timing (``send``, ``hop``: ``region_tree``),
    stripes are chosen only where the tree's last crossing starts later than a hop and those copies
    take (``n - 2`` blocks' time; the hop holds one). A later chunk is one of several
    crossing at once, where the tree's timing assumes idle heads: its crossings go in stripes
    wherever the tree is deeper than one crossing, which spreads every chunk's crossings evenly over
    every region's receiver. Without timings, stripes wherever the tree is
    deeper than one crossing.

    None where the tree does as well, where there are fewer than two other regions, or fewer blocks
    than stripes. Every node computes the same plan from the same heads and signed timings."""
    others = sorted((r for r in heads if r != root and heads[r]), key=lambda r: _score(tag, index, f"r{r}"))
    n = len(others)
    if n < 2 or len(heads.get(root, ())) >= n or blocks < n:
        return None
    if index == 0 and send is not None and hop is not None and \
            _tree(tag, index, root, heads, send, hop)[1] <= hop + (n - 2) * send / blocks:
        return None
    return StripePlan(n, {r: s for s, r in enumerate(others)}, {r: _head(tag, index, heads[r]) for r in others})


def _head(tag: int | str, index: int, nodes: Sequence[str]) -> str:
    """The node of a region with heads that receives a chunk's stripes (``designated``)."""
    head = designated(tag, index, nodes)
    assert head is not None  # a region in a plan has heads
    return head


def stripe_targets(plan: StripePlan, me: str, region: str, first: bool) -> list[tuple[str, int]]:
    """The stripes node ``me`` of ``region`` pushes under ``plan``, as ``(receiver, stripe)``: the first
    holder's (``first``: it took the chunk from the trainer) every stripe to its region's receiver; a
    receiver's own stripe to every other receiver; nothing for any other node."""
    if region in plan.stripe:
        if plan.receiver[region] != me:
            return []
        s = plan.stripe[region]
        return [(h, s) for r, h in plan.receiver.items() if r != region]
    return [(plan.receiver[r], s) for r, s in plan.stripe.items()] if first else []


def stripes_handed_on(from_root: Sequence[tuple[int, int]] | Mapping[tuple[int, int], object],
                      dealt: tuple[int, int] | None) -> list[tuple[int, int]]:
    """Of the stripes ``(s, n)`` nodes of a chunk's root region pushed a receiver (in the order they
    came), those it hands on to every other region's receiver: the first, the first holder's as that
    one dealt them (in a swarm just formed, its plan and the receiver's can differ), and the one the
    receiver's own plan deals it (``dealt``), if that came too. A member there that pushes stripes of
    its own choosing ahead of the first holder's keeps nothing from the other regions (handing on only
    the first, they waited out ``STRIPE_WAIT``), and however many it pushes, no more than two go on.
    Honest, only the first holder sends stripes from the root region: one."""
    out = list(itertools.islice(from_root, 1))
    if dealt is not None and dealt in from_root and dealt not in out:
        out.append(dealt)
    return out


def stripe_blocks(stripe: int, n: int, blocks: int) -> range:
    """The blocks of stripe ``stripe`` of ``n`` in a chunk of ``blocks``, in the order a stream sends them."""
    return range(stripe, blocks, n)


def stripe_size(size: int, block: int, stripe: int, n: int) -> int:
    """The bytes of stripe ``stripe`` of ``n`` of a chunk of ``size`` bytes hashed in ``block``-byte
    blocks: its whole blocks, less what the chunk's short last block lacks if it is one of them."""
    blocks = -(-size // block)
    rng = stripe_blocks(stripe, n, blocks)
    return len(rng) * block - (blocks * block - size if rng and rng[-1] == blocks - 1 else 0)


def parse_stripe(text: str | None, blocks: int) -> tuple[int, int] | None:
    """A push's ``STRIPE_HEADER`` (``s/n``) for a chunk of ``blocks`` -> ``(s, n)``; None for a push
    of the whole chunk (no header); ValueError for one that names no stripe of it."""
    if text is None:
        return None
    s, sep, n = text.partition("/")
    if not (sep and s.isascii() and s.isdigit() and n.isascii() and n.isdigit() and len(s) + len(n) <= 8):
        raise ValueError(f"a stripe is s/n, not {text!r}")
    if not 0 <= int(s) < int(n) <= blocks:
        raise ValueError(f"no stripe {text} of a chunk of {blocks} blocks")
    return int(s), int(n)


_Request = TypeVar("_Request")


def unstarted(asked: Mapping[str, _Request], got: bool, rollout: Callable[[str], bool],
              taking: Container[_Request]) -> _Request | None:
    """The request out for a chunk that a push of it takes the place of, if any: the one request out
    (``asked``: peer -> request), if no byte of it has arrived (``got`` false; one whose response has
    not begun is the most unstarted of all) and it went to a rollout (``rollout``), the pusher itself
    included, not to the trainer, whose super-seeding counts it as a first copy taken; never a push
    being taken (``taking``). Evidence: docs/history/DESIGN-NOTES.md#replace-unstarted-requests."""
    if len(asked) != 1 or got:
        return None
    ((peer, request),) = asked.items()
    if not rollout(peer) or request in taking:
        return None
    return request


@dataclass(frozen=True)
class Arriving:
    """What a relay knows when a push of one of its chunks arrives (``declines``): of the chunk, and of its
    own load."""

    blocks: int | None  # the blocks the trainer's signed hashes check the chunk in; None: no hashes here yet
    held: bool = False  # stored here whole
    wanted: bool = True  # of a version this node fetches
    asked: bool = False  # a request for it is out
    asked_whole: bool = False  # its stripes stopped short, and it is asked for whole (``picker.stripes_stopped``)
    stripes: Callable[[tuple[int, int]], bool] | None = None  # arriving in stripes: whether stripe (s, n) is
    # held here or being taken
    paused_until: float = 0.0  # the store pushes back (a chunk could not be stored) until then
    taking: int = 0  # whole pushes being taken now
    striping: int = 0  # chunks arriving in stripes now, none of them whole yet


def declines(chunk: Arriving, now: float, stripe: str | None = None, *, replacing: bool = False,
             trainer: bool = False, peer: bool = True) -> str | None:
    """Why a push of ``chunk`` is not taken, or None to take it. ``stripe`` is the push's ``STRIPE_HEADER``
    (None: the chunk whole); ``replacing``: the push is to take the place of the request out for the
    chunk (``unstarted``); ``trainer``: this node is the trainer, which takes no pushes; ``peer``: the
    pusher is a rollout peer of this node, the only kind a push is taken from.

    A push is taken only of a chunk this node wants, neither holds nor asks for, and can check block by
    block against the trainer's signed hashes. A stripe joins the other stripes of its chunk arriving
    here unless it is held or coming already, whoever pushes it: a request to the same pusher, just
    replaced by another's stripe, is in flight until its cancellation has run, and declining the first
    holder's stripe for it loses that stripe to every region. Once a chunk's stripes stopped short and it is asked for
    whole, no stripe takes that request's place: it would stop short again, and the region would wait
    out ``STRIPE_WAIT`` twice. A push is declined as busy while the store pushes back, past
    ``PUSHES_TAKEN`` whole pushes, or past ``STRIPED_TAKEN`` chunks in stripes (each buffers a chunk)."""
    if trainer:
        return "the trainer takes no pushes"
    if not peer:
        return "not a peer of this node"
    if chunk.blocks is None:
        return NO_HASHES
    if chunk.held:
        return "held"
    joining = stripe is not None and chunk.stripes is not None
    if stripe is not None:
        try:
            pushed = parse_stripe(stripe, chunk.blocks)
        except ValueError as e:
            return str(e)
        if chunk.asked_whole and chunk.asked:
            return "asked for whole"
        if chunk.stripes is not None and pushed is not None and chunk.stripes(pushed):
            return "stripe held"
    if not joining and chunk.asked and not replacing:
        return "being fetched"
    if not chunk.wanted:
        return "not wanted"
    if now < chunk.paused_until:
        return "busy"
    if stripe is None and chunk.taking >= PUSHES_TAKEN:
        return "busy"
    if stripe is not None and not joining and chunk.striping >= STRIPED_TAKEN:
        return "busy"
    return None
