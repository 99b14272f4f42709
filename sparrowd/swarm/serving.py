"""What a node decides about a peer: whom it serves, in which lane, what it shows and owes it.

Pure functions of small views, taking ``now`` where time matters; the
daemon's driver (``sparrowd.daemon.swarm``) and the simulator (``sparrowd
bench sim``) both call them, with the tuning of ``swarm.policy``.

* A relay serves whoever asks while fewer than ``QUEUE_ADMIT`` requests wait
  in the request's lane (``relay_admits``): every member is authenticated and
  works for the same run, so tit-for-tat buys nothing, and a node that has
  just received a rare chunk must hand it on to whoever lacks it. Its
  uploads to its own region and to other regions are separate lanes
  (``lane``), each with its own slots and queue: uploads across regions are
  held by the WAN limit and those inside by what it leaves of the uplink, so
  a chunk sent to a neighbour does not hold up the crossers of other regions.
* The trainer has one lane and keeps its choker (``Slots``): once more peers
  are live than it has upload slots, it serves the peers it unchokes, or
  gives a slot left free since the last decision to the first that asks,
  keeping free slots for its own region's peers that want a chunk while
  first copies start there (``Choker.near_room``).
* The trainer shows each peer what super-seeding offers it (``trainer_shows``),
  and serves it the chunks super-seeding gave it even where its choker would
  refuse it now (``owed``): a peer given a first copy before the choker
  started was otherwise refused it, never choked either, and the chunk
  reached nobody until its assignment lapsed.

Nothing here sleeps, awaits or touches a socket.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Set
from dataclasses import dataclass

from .choker import Choker
from .policy import MIN_RATE, QUEUE_ADMIT, STORE_PAUSE_MAX, STREAM_GRACE, UPLOAD_SLOTS
from .superseed import SuperSeed, far_first_copies, first_copies_near

__all__ = ["Slots", "crossers", "lane", "may_fetch", "owed", "quick", "relay_admits", "store_pause",
           "stream_timeout", "trainer_chokes", "trainer_shows", "trusted"]


def lane(trainer: bool, here: str, there: str) -> bool:
    """A node's upload lane for a peer of region ``there``: True for another region than ``here``, on a
    relay; the trainer has one lane (False)."""
    return not trainer and there != here


def relay_admits(waiting: int) -> bool:
    """Whether a relay serves a request now, with ``waiting`` requests already queued in its lane (else
    503, "choked")."""
    return waiting < QUEUE_ADMIT


@dataclass
class Slots:
    """The trainer's upload slots as they stand: its choker, the peers it unchokes (``admit`` adds to
    them), and the peers it heard from lately: how many (``live``), how many of its own region
    (``near``), how many regions they are in, and how many of its region's lack a chunk it holds
    (``near_wanting``). ``is_near`` says whether a peer is of the trainer's region."""

    choker: Choker
    unchoked: set[str]
    is_near: Callable[[str], bool]
    live: int
    near: int
    regions: int
    near_wanting: int

    @property
    def choking(self) -> bool:
        """Whether the choker decides at all: only once more peers are live than it has slots."""
        return self.live > self.choker.slots

    def near_room(self, far: bool) -> tuple[int, int]:
        """The trainer's own region's peers it may serve now, and, facing a peer of another region
        (``far``), the free slots it keeps for those of them that want a chunk (``Choker.near_room``)."""
        unchoked = sum(1 for p in self.unchoked if self.is_near(p))
        return self.choker.near_room(self.unchoked, unchoked, self.near_wanting, far=far)

    def admits(self, peer: str, far: bool) -> bool:
        """Whether the trainer serves ``peer`` now: no choking yet, or the choker unchokes it or gives it
        a free slot (which it then holds: ``Choker.admit``)."""
        if not self.choking:
            return True
        return self.choker.admit(self.unchoked, peer, reserved=self.near_room(far)[1])


def owed(ss: SuperSeed | None, peer: str, have: Set[int]) -> frozenset[int]:
    """The chunks super-seeding gave ``peer`` that its have-map (``have``) does not show yet: the
    trainer shows and serves them to it whatever its choker says."""
    return ss.given_to(peer) - have if ss is not None else frozenset()


def may_fetch(admitted: bool, index: int, owed: Collection[int]) -> bool:
    """Whether a request for chunk ``index`` is served now (else 503, "choked"): the peer is admitted, or
    the chunk is one super-seeding gave it."""
    return admitted or index in owed


def trusted(shows: bool, anyone_shows: bool) -> bool:
    """Whether super-seeding gives a peer first copies: once any peer's have-map shows a chunk
    (``anyone_shows``), only to peers whose maps show one (``shows``), so a member that never fetches
    gets none to sit on."""
    return shows or not anyone_shows


def quick(first_size: int | None, chunks: int, rate: float | None, delay: float | None) -> bool:
    """Whether the trainer sends a version in less than a round trip between regions: ``chunks`` chunks
    of ``first_size`` bytes at its upload limit ``rate``, against twice the one-way ``delay``
    (``first_copies_near``'s ``quick``). No limit, no delay or no chunk: not quick."""
    if not rate or not delay or first_size is None:
        return False
    return first_size * chunks / rate < 2 * delay


def trainer_shows(held: set[int], slots: Slots, ss: SuperSeed | None, now: float, peer: str, have: Set[int],
                  held_by: Mapping[int, int], *, far: bool, announced: int, total: int | None, super_seed: bool,
                  trusted: bool, quick: bool) -> set[int]:
    """What the trainer shows ``peer`` (of another region than its own if ``far``; ``have``: the chunks
    its have-map shows) of a version it holds ``held`` of: what it owes a peer it does not admit now
    (no new assignments to a peer that cannot fetch them now), everything without super-seeding
    (peers that cannot reach each other), else super-seeding's offer. ``announced``: the chunks
    announced so far; ``total``: the manifest's count, None before it (then the chunks announced
    stand for the version: chunks go out as they are published); ``held_by``: how many peers show
    each chunk. While first copies stay in the trainer's region
    (``first_copies_near``), only its near peers take them, and they pace the offers."""
    if not slots.admits(peer, far):
        return set(owed(ss, peer, have) & held)
    if not super_seed:
        return held
    if ss is None:
        return set()
    ss.grow(announced)
    chunks = total if total is not None else announced
    servable = slots.near_room(far)[0] if slots.choking else slots.near
    home = first_copies_near(chunks, slots.regions, slots.near, servable, quick=quick)
    return ss.offer(now, peer, have, held_by, trusted=trusted, peers=slots.near if home else slots.live,
                    fresh=not far or not home, far=far,
                    far_most=far_first_copies(chunks, slots.regions, slots.near)) & held


def trainer_chokes(slots: Slots, peer: str, far: bool, *, wants: bool, owes: Callable[[], bool]) -> bool:
    """The ``choked`` flag of the trainer's exchange reply to ``peer``: for a peer that wants a chunk (or
    one given a chunk), whether it is neither admitted nor owed one; for the others, whether the
    choker decides and leaves it out."""
    if wants:
        return not slots.admits(peer, far) and not owes()
    return slots.choking and peer not in slots.unchoked


def crossers(me: str, gateways: list[str], usable: Callable[[str], bool], trusted: set[str]) -> list[str]:
    """The nodes that share a region's cross-region fetches, as node ``me`` sees them: in a region
    larger than a peer list shows, the gateways the tracker names (the same for every node of the
    region) that are ``me`` or ``usable`` peers; else ``me`` and the neighbours it counts on."""
    named = [g for g in gateways if g == me or usable(g)]
    return named or [me, *trusted]


def stream_timeout(size: int, send: float | None) -> float:
    """Seconds a chunk's stream of ``size`` bytes (asked for or pushed) may take before it is given up:
    ``STREAM_GRACE`` plus its size at ``MIN_RATE``, or, where that is longer, ``UPLOAD_SLOTS`` times
    ``send``, the chunk's time at the trainer's uplink (its signed tree timing): the trainer's slots
    share that uplink, so over slow links its streams to first holders run at a share of it."""
    slow = UPLOAD_SLOTS * send if send is not None and send > 0 else 0.0
    return STREAM_GRACE + max(size / MIN_RATE, slow)


def store_pause(failures: int) -> float:
    """Seconds fetching pauses after ``failures`` chunks in a row could not be stored: 1, 2, 4, 8, 10, 10..."""
    return min(STORE_PAUSE_MAX, 2.0 ** max(0, min(failures, 32) - 1))
