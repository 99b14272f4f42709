"""``sparrowd bench sim``: the swarm's own decision code at any scale, on a virtual clock.

A discrete-event simulation that drives the real pure state machines, the
same objects the daemon's drivers call: the lease table (joins, the peer
lists it samples), the picker (rarest first, the region's rendezvous
designation, stalled crossers, the endgame), the choker (upload slots,
free-slot admission), super-seeding and ``count_on``. What stands in for the
daemon's asyncio drivers is written here, step for step beside
``daemon/swarm/``: a node re-plans when something it can see changed and
every 0.25 s, asks the chosen peer for a chunk, and is refused when choked
or over its per-peer cap; a server sends at most two chunks at once
(``RELAY_CONCURRENT``) in each of its lanes (a relay's uploads to its own
region and to other regions are separate lanes, as in the daemon) and queues
the rest; a node that stores a chunk tells
its peers (a have message, one one-way delay later); the trainer shows each
peer its super-seed offer (first copies in its own region where
``first_copies_near`` says so), unchokes its own region's peers first, and
decides again as each version begins.

The link model is fluid. Every upload shares its node's uplink with the
node's other uploads, an upload to another region is further held to the
node's WAN limit and to its share of the ordered pair of regions' link,
and what those leave of the uplink goes to the node's uploads inside its
region. Rates are re-shared every step (``Config.step``, 1-5 ms). A request reaches its
server one one-way delay after it is sent, and a chunk is stored one
one-way delay after its server sent the last byte. Nothing here costs CPU
time, so at 16 nodes the simulation shows what the protocol does where the
real benchmark (``sparrowd bench swarm``) shares two cores among 16 daemons.

Relays serve cut-through (``cut_through``, as the daemon's ``Partial``): a
node serves a chunk it is fetching as well as one it holds, from the first
of its requests for it (its partial), a whole block (``block_for``) at a time as
the blocks arrive. A stream served so never gets ahead of the whole blocks
its feeding request has delivered, and its last block waits until that
request's last byte has arrived (the chunk is then held whole, and what is
left is sent at the stream's share); chains of such streams are followed hop
by hop. The feed is counted as its server sends it, not one one-way delay
later: each hop's last block is delayed right, the blocks before it slightly
early. A stream held back by its feed leaves the rest of its share of a
cross-region upload unused, but what it leaves of the uplink goes to the
node's uploads inside its region. If the feeding request ends without the
chunk (refused, failed, cancelled, timed out, or its server left), its
streams are cut and their requesters, hearing one one-way delay later, pick
again without holding it against the peer; if the node gets the chunk whole
by another request, its streams go on from that copy.

While a chunk is still arriving, a relay streams it to no more peers at
once, pushed or asked for, than its uplink carries at the rate the chunk
comes in (``fanout``; ``swarm.push.relay_fanout`` of the uplink and the
rate the stream's server declared, ``stream_rate``, as on the daemons); a
request beyond waits outside the lanes (``Node.held``, the daemon's
``Partial.turn``) until a stream of it ends or it is whole.

A node serves a partial, and shows its peers it is fetching the chunk, only
once a block of it has checked out (``relay_after_block``): a partial that
has had data is fed, hop by hop, from a whole copy. Without that rule the
picker, which takes a neighbour fetching a chunk over a crossing, leads a
region's nodes to fetch it from each other with none fetching it from
outside: served from their start, partials end up fed by each other in a
circle (A streams from B, B from A) and wait until the daemon's request
timeout (``timed_out``), then form again; refused until a block has come,
the requests go round and round.

What it leaves out: TCP's own dynamics (slow start, loss), the exchange
long poll's own delays beyond one one-way delay, statements and have-maps
as bytes, and the trainer's CPU. A node sees at once what its peers fetch
(where the daemon's refused 404 drops a chunk from the peer's set until its
next exchange reply). Offers from the trainer are computed when a
node plans, as if its long poll had just answered.

``trace`` (``bench sim --trace FILE``) keeps every chunk request's events,
times counted from the version's start: ``asked`` when its node sends it
(``pushed`` when its server sent it unasked, below),
``refused``, ``failed`` or ``cut`` when its node hears so, ``stored`` or
``wasted`` (a copy the node already had) when its last byte arrives; a request
with no later event was cancelled (an endgame loser, a stream from a partial
past its timeout, or its version ended).
Where a version's time goes (which hop waited on what) is read from it.

Push (``push``, ``bench sim --push LOCAL,CROSS``, default 2,2 as the
daemons; ``off`` for pull alone): a relay that can serve a chunk (its first
block checked out, or whole) also sends it unasked to the peers
``swarm.push.push_targets`` names, from what the relay knows: up to LOCAL of
its region that neither hold nor fetch it, and the crosser of up to CROSS
other regions where it knows nobody with the chunk: the head that region
designates (``LeaseTable.heads``), from any head, or from a node that knows
every head of that region; or, where the relay knows the region the chunk
entered the swarm in (from the trainer, or from the stream it got it by, as
the daemons' ``X-Sparrowd-Root``), the regions the chunk's region tree gives
it (``swarm.push.region_tree``), timed as the trainer signs it: the chunk over
the trainer's uplink, and the one-way delay between regions (which the
daemons measure and the simulator knows) plus a block's time
(``Config(timed_tree=False)``: breadth first). The pushed node takes the
stream as if it had asked for it (its picker then leaves the chunk alone: the daemon's exchange
reply tells it of the push as the push starts). A push to a node already
fetching the chunk is not sent (a daemon declines it at once), unless the
node's one request for it has had no byte back: then the push takes the
request's place, as on the daemons (``unstarted``), so that requests do not
queue behind a busy first holder (evidence:
docs/history/DESIGN-NOTES.md#sim-unstarted).

Churn: ``churn`` of the rollout nodes leave (``sparrowd leave``) at
``churn_at`` of the bound into the last version; their peers' requests to
them fail (the peer cools down, as the daemon does). The trainer, which
hosts the tracker, hears of each leave at once; the other peers at their
next renewal (within a third of the lease TTL).

The package: ``model`` (the configuration, nodes and requests), ``parts``
(``SimParts``: the state the parts share, and what one calls of another,
declared for the type checker), ``core`` (``Sim``: events, membership, churn,
the run), ``serve`` (the server side), ``fetch`` (the fetching side), ``push``
(pushes and stripes), ``links`` (the fluid link model) and ``report``
(``simulate`` and the command's output). It imports the pure packages
(``sparrowd.swarm``, ``sparrowd.codec``) and nothing of ``sparrowd.daemon``:
the decisions it shares with the daemons are ``swarm.serving``'s,
``swarm.picker``'s, ``swarm.push``'s and ``swarm.superseed``'s, with the
tuning of ``swarm.policy``.
"""

from __future__ import annotations

from .core import Sim
from .model import MB, Config, Known, Node, Req
from .report import run, simulate

__all__ = ["MB", "Config", "Known", "Node", "Req", "Sim", "run", "simulate"]
