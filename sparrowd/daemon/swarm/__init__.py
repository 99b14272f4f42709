"""The swarm driver: have-map exchange, chunk requests and uploads over HTTP.

Thin asyncio around the pure parts (``Picker``, ``Choker``, ``SuperSeed``,
``VersionState``, ``TokenBucket``, ``Rate``) and the decisions of
``swarm.serving`` with the tuning of ``swarm.policy``:

* Each node keeps one long-polling *exchange* with each peer in its tracker
  peer list: the request carries its own have-maps and what it is fetching,
  the reply (when something changed, or after a few seconds) carries the
  peer's signed statements it lacks, the peer's have-maps, and whether the
  peer chokes it. Have messages therefore arrive within one round trip: storing a
  chunk answers the long polls waiting on this node (and a quick exchange tells the trainer).
* What a node fetches is what ``chain.wanted`` says: the patches from its
  position to the newest version, or, when that chain is broken (a late
  node), the newest anchor and the patches after it.
* A scheduler asks the picker for requests whenever something changed and
  fetches chunks (``GET /v1/swarm/chunk/KEY/I``, KEY ``12`` for version 12's
  patch, ``a12`` for its anchor), oldest first. Each
  chunk is checked against its signed BLAKE3 hash before it is stored or
  served; a peer that sends a bad chunk is banned for the session.
* Cut-through (``cutthrough.Partial``): each block of a chunk is checked
  against the block hashes the trainer's announcement signed as it arrives,
  and a relay serves the chunks it is fetching as well as those it holds,
  block by block, so a chunk moves down a chain of nodes a block behind the
  first instead of a chunk behind at each hop. While a chunk arrives, a relay
  streams it to no more peers at once than its upload limit carries at the
  rate it comes in (every stream declares its rate, ``RATE_HEADER``;
  ``swarm.push.relay_fanout``); the rest wait until it is whole. Exchange replies say
  ``cut_through``, and a node's ``fetching`` map is then a source for its
  peers' pickers; starting a fetch wakes the peers' long polls so they learn
  it at once. A stream whose feeding fetch fails is cut, and the requester
  goes back to its picker, without holding it against that peer.
* Push (``swarm.push``): a relay sends what it can serve unasked, to its
  neighbours and across along the chunk's region tree; where regions are
  small the chunk crosses in stripes instead (``stripe_plan``: the first
  holder sends each region's receiver one stripe of its blocks, each
  receiver hands its stripe to every other), taken into one ``Partial``.
* The serving side answers exchanges and chunk requests. A relay serves
  whoever asks while fewer than ``QUEUE_ADMIT`` requests wait in the request's
  lane (503 "choked" beyond; uploads to its own region and to other regions
  are separate lanes, each with ``RELAY_CONCURRENT`` slots); the trainer serves the peers its choker unchokes and
  shows each only what super-seeding offers it. Unlimited uploads are aiohttp FileResponses: sendfile on asyncio's
  loop; uvloop does not implement loop.sendfile, so there aiohttp reads and
  writes in pieces: one copy through user space per chunk served.
* The trainer publishes through ``/v1/publish/...``: each chunk is signed
  into an announcement as it arrives, so chunks move before the manifest.
* Peers are members the tracker vouches for: a request names its node
  (``X-Sparrowd-Node``), carries its lease's ticket (``X-Sparrowd-Ticket``,
  signed by the trainer) and a proof made with the ticket's key for this
  receiver and that lease (``X-Sparrowd-Proof``, ``swarm.identity``). ``admit``
  checks them from the headers alone, before any body is read; the region a
  peer is treated as in is the ticket's, not what it says. No join secret is
  ever sent to a peer. A peer that advertises a chunk it then does not serve is
  banned for the session.

The package, by job (each module says what it holds):

* ``context``: what the swarm takes of its host, the daemon (``SwarmHost``).
* ``wire``: headers, message schemas, size limits, a chunk stream's pieces.
* ``state``: the per-peer tables (``PeerState``, ``Remote``).
* ``peers``: the peers fetched from: their long polls, contacts, bans.
* ``serve``: admission, the exchange and chunk handlers.
* ``uplink``: upload lanes, their slots and queues, pacing.
* ``seed``: the trainer's part, ``Seed`` (constructed on the trainer only: ``Swarm.seed``, None on a
  relay): publishing, its choke loop, super-seeding, the live peers it counts.
* ``fetch``: the scheduler and its chunk requests.
* ``receive``: a chunk's stream coming in, asked for or pushed.
* ``push``: what a relay sends unasked.
* ``parts``: ``Parts``, the node's own tables and what reads them (position, wanted, retention),
  which every job's part but ``seed`` subclasses; it declares what one part calls of another, so
  mypy checks them.
* ``node``: ``Swarm``, which wires them: made of the parts, with its lifecycle.

What it may import: the pure packages (``sparrowd.swarm``, ``sparrowd.codec``,
``sparrowd.schema``), and of ``sparrowd.daemon`` only ``bodies``,
``cutthrough``, ``logs`` and ``store``. The daemon (``app``) hands ``Swarm``
itself as its ``SwarmHost`` (``context``): the swarm reads nothing of it beyond that, and nothing
here imports ``app``.
"""

from __future__ import annotations

from ...swarm.identity import NODE_HEADER
from ...swarm.policy import (
    MIN_RATE,
    QUEUE_ADMIT,
    RELAY_CONCURRENT,
    SEED_PER_PEER,
    SEED_SINGLE_FROM,
    STORE_PAUSE_MAX,
    UPLOAD_SLOTS,
)
from ...swarm.serving import store_pause, stream_timeout
from .node import Swarm
from .state import PeerState, Remote, _superseed
from .wire import MAX_CHUNK, MSGPACK, PIECE, REGION_HEADER

__all__ = ["Swarm", "MSGPACK", "MAX_CHUNK", "NODE_HEADER", "REGION_HEADER", "PIECE", "PeerState", "Remote",
           "MIN_RATE", "QUEUE_ADMIT", "RELAY_CONCURRENT", "SEED_PER_PEER", "SEED_SINGLE_FROM", "STORE_PAUSE_MAX",
           "UPLOAD_SLOTS", "_superseed", "store_pause", "stream_timeout"]
