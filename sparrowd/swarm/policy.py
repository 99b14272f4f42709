"""The swarm's tuning: every constant that shapes what a node decides about its peers lives here.

Whom a node serves and how many at once, what the trainer gives out, when a
request is given up, how long a crosser is waited for, how far a chunk is
pushed: the daemon's driver (``sparrowd.daemon.swarm``), the pure decisions
(``swarm.serving``, ``picker``, ``push``, ``superseed``) and the simulator
(``sparrowd bench sim``) all read them from this module, so a change here
changes the daemons and the simulation alike. The experiments that chose
them are in docs/PERFORMANCE.md.

A leaf: it imports nothing.
"""

from __future__ import annotations

# ---------------------------------------------------------------- serving (uploads)

UPLOAD_SLOTS = 8  # peers the trainer unchokes at once (one of them the optimistic unchoke)
OPTIMISTIC_EVERY = 5.0  # seconds between moves of the trainer's optimistic unchoke
CHOKE_EVERY = 1.0  # seconds between the trainer's choke decisions (sooner when a version begins)
UPLOADS_PER_PEER = 8  # requests of one peer served or queued at once (429 beyond)
QUEUE_ADMIT = 1  # a relay refuses requests (503, "choked") while this many wait in their lane
SEED_CONCURRENT, RELAY_CONCURRENT = 2, 2  # uploads a lane sends at once (trainer, relay); more wait their turn
SEED_PER_PEER = 2  # chunks the trainer's super-seeding assigns a peer at a time...
SEED_SINGLE_FROM = 3  # ...but one, once this many peers take its first copies
LIVE_WITHIN = 30.0  # seconds since a peer was last heard from that it counts as live (the trainer's counts)
LIVE_EVERY = 1.0  # seconds between two counts of the live peers (sooner when a version or a region begins)
ROW_EVERY = 1.0  # seconds between the trainer's early renewals that report its uploads

# ---------------------------------------------------------------- fetching

PLAN_EVERY = 0.25  # seconds between a node's scheduling passes with nothing new
MIN_RATE = 128 << 10  # a chunk's stream times out after STREAM_GRACE s plus its size at this rate...
STREAM_GRACE = 5.0  # ...(``serving.stream_timeout``)
STORE_PAUSE_MAX = 10.0  # the longest fetching waits after a chunk could not be stored
ENDGAME_AFTER = 2.0  # seconds a chunk's request is out before the endgame asks a second peer too
CROSS_GRACE = 3.0  # seconds a region's designated crosser has to start a chunk's crossing...
CROSS_RATE = 256 << 10  # ...and then to move it at this rate, the slowest cross-region rate it is waited for
SLOW_CHUNKS = 2  # the waits cover this many times a chunk's sending at the trainer's uplink, where that is longer
STRIPE_WAIT = 1.0  # seconds a chunk arriving in stripes waits for its next stripe before it is asked for whole,
# beyond the round trip between regions (its stripes come from all of them)

# ---------------------------------------------------------------- exchanges and contact

EXCHANGE_WAIT = 5.0  # seconds a long poll is held when nothing changes
QUICK_REPLIES, QUICK_PACE = 5, 0.25  # early exchange replies in a row with nothing new: then poll that peer
# at most every QUICK_PACE seconds
DISCOVERY_EVERY = 1.0  # seconds between early renewals for a peer list that knows a new asker
NOT_YET_RETRY = 0.1  # seconds before asking again a peer that does not know this node yet (503)

# ---------------------------------------------------------------- push

DEFAULT_PUSH = (2, 2)  # (local, cross) pushes a relay sends of each chunk (``--push``)
CROSSINGS = 2  # crossings a head takes in a timed region tree: one as the chunk arrives, one once whole
PUSHES_TAKEN = 4  # pushed chunks a node receives at once (each buffers a chunk; more are declined)
STRIPED_TAKEN = 16  # chunks a node receives in stripes at once, apart (a patch's chunks cross side by side)
PUSH_CLAIM = 1.0  # seconds a peer's word that it is pushing a chunk here keeps this node from asking for it,
# beyond the round trip to that peer
PUSH_STATEMENT_WAIT = 0.5  # seconds a push may wait for the chunk's signed statement to arrive here
PUSH_TRIES = 4  # a push the receiver refuses as from a node it does not know yet goes again this often in all

# ---------------------------------------------------------------- super-seeding

CROSS_BUDGET = 0.1  # what first copies given into other regions may add to the x patch that crosses
