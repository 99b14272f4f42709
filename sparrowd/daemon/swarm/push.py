"""Pushing: a relay sends what it can serve unasked, to its neighbours and across along the chunk's
region tree or in stripes (``swarm.push``), through its upload lanes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path

import aiohttp

from ...swarm.chain import Key
from ...swarm.policy import NOT_YET_RETRY, PUSH_TRIES, RELAY_CONCURRENT
from ...swarm.push import (
    STRIPE_HEADER,
    PushPeer,
    push_heads,
    push_targets,
    region_tree,
    stripe_plan,
    stripe_size,
    stripe_targets,
    stripes_handed_on,
)
from ...swarm.serving import stream_timeout
from ...swarm.versions import BLOCK_HASH, VersionState
from ..cutthrough import Partial
from ..logs import event
from .parts import Parts
from .state import PeerState
from .wire import ALSO_HEADER, ALSO_HEADER_MAX, PIECE, ROOT_HEADER, _Cut, _send_time, _statement_header

__all__ = ["Pushing"]

log = logging.getLogger("sparrowd.swarm")


class Pushing(Parts):
    """``Swarm``'s pushes: what a relay sends unasked, whole or in stripes."""

    def _push_out(self, vs: VersionState, index: int) -> None:
        """Send a chunk this node can serve now (a block of it checked out, or whole) unasked to the
        peers ``swarm.push.push_targets`` names, through the upload lanes; a relay's only."""
        local, cross = self.host.settings.push
        if self.signer is not None or not (local or cross) or self._closing:
            return
        k = vs.key
        done = self.pushed.setdefault(k, {}).setdefault(index, {})
        now = time.monotonic()
        rollouts = [p for p in self.peers.values() if p.role != "trainer"]
        m = self.host.membership
        named = {r: [e["node_id"] for e in es] for r, es in (m.state.heads if m is not None else {}).items()}
        heads = push_heads(self.host.settings.region, self.host.node_id, (p.node_id for p in rollouts), named)
        # Other regions' heads this node does not peer with (it is a head): pushed to without a view of
        # what they hold, so a push there may be declined at its first block.
        rollouts += [c for hs in heads.values() for h in hs if h not in self.peers and (c := self._peer(h)) is not None]
        # Not pushed to: the peers this node receives the chunk from, and those its pusher feeds too
        # (their exchanges may not have told yet that they fetch it; pushed to, nodes fed by the same
        # head push to each other and to their own feeder, leaving their region's crossing head to
        # ask; evidence: docs/history/DESIGN-NOTES.md#push-not-to-feeders).
        feeding = self.inflight.get((k, index), {}).keys() | self.fed_along.get(k, {}).get(index, frozenset())
        views = [PushPeer(p.node_id, p.region, p.node_id in done or p.node_id in self.banned or p.node_id in feeding
                          or now < p.cooldown_until or index in p.have.get(k, ()) or index in p.fetching.get(k, ()))
                 for p in rollouts]
        idle_near, idle_far = (max(0, RELAY_CONCURRENT - self._busy[lane] - self._waiting[lane] - self._spawned[lane])
                               for lane in (False, True))
        idle = (idle_near, idle_far)
        tree = None
        part = None if index in vs.have else self.partials.get((k, index))  # still arriving
        if (root := vs.roots.get(index)) in named:  # timed as the trainer signed it: the same tree everywhere
            send, hop = vs.trees.get(index, (None, None))
            plan = stripe_plan(k.tag, index, root, named, len(vs.blocks.get(index) or b"") // BLOCK_HASH,
                               send=send, hop=hop)
            if plan is not None:  # across in stripes, not in the tree
                self._stripe_out(vs, index, plan, part)
                tree = {}
            else:
                tree = region_tree(k.tag, index, root, named, send=send, hop=hop)
        near, far = push_targets(k.tag, index, self.host.node_id, self.host.settings.region, views, heads,
                                 local=local, cross=cross, sent=(len(done) - sum(done.values()), sum(done.values())),
                                 idle=idle, tree=tree, most=None if part is None else part.room(self.up.rate),
                                 whole=index in vs.have)
        for pid in near + far:
            if (ps := self._peer(pid)) is None:
                continue  # (not met: every target is a peer, or a head's contact)
            done[pid] = pid in far
            self.pushing_to.add((pid, k, index))
            self._spawned[done[pid]] += 1  # its slot, kept from the next decision until the task takes it
            if part is not None:
                part.streams += 1  # its stream, counted from now
            task = asyncio.create_task(self._push_to(ps, vs, index, part), name=f"push-{k.tag}-{index}")
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _stripe_out(self, vs: VersionState, index: int, plan, part: Partial | None) -> None:
        """Push the stripes of chunk ``index`` this node sends under ``plan`` (``stripe_targets``): the
        first holder's as the chunk arrives, a receiver's own once a block of it has (each stream sends
        its blocks as they check out here). Stripes take no upload slot: all of a chunk's together
        are one chunk's bytes across, and in the lane's two slots most would wait for the first to
        end, a chunk behind."""
        if index not in vs.have and (part is None or part.failed):
            return
        region = self.host.settings.region
        took = part is not None and part.striped and bool(part.own)  # a stripe from the root region
        if index in vs.handed_on or took or (region in plan.stripe and plan.receiver[region] == self.host.node_id):
            # A receiver hands on the stripe the first holder sent it, as that one dealt them (in a swarm
            # just formed, a node that did not know every region's heads yet dealt 6 stripes where the
            # first holder dealt 7, and its stripe fitted nobody's: every region waited out
            # ``STRIPE_WAIT``), and the one its own plan deals it if that came too (``stripes_handed_on``),
            # each once a block of it is here. One that fetches the chunk whole, having asked before its
            # stripe came, hands its own on from that fetch as the blocks arrive (held back until the
            # fetch was whole, the other receivers waited for it and fetched the chunk across again).
            mine = set(vs.handed_on.get(index, ()))
            if part is not None and part.striped:
                dealt = (plan.stripe[region], plan.n) if region in plan.stripe else None
                mine |= {st for st in stripes_handed_on(part.own, dealt)
                         if part.has_block(st[0])}  # (not begun here yet: handed on once it has)
            elif not mine and (index in vs.have or (part is not None and part.servable)):
                mine = {(plan.stripe[region], plan.n)}
            if not mine:
                return
            vs.handed_on[index] = mine
            for st in sorted(mine):
                for r, h in plan.receiver.items():
                    if r != region:
                        self._stripe_to(vs, index, h, st)
            return
        first = index in vs.first_hand
        for pid, s in stripe_targets(plan, self.host.node_id, region, first):
            # The first holder hands a stripe its receiver declines (a node of a swarm just formed that
            # does not know every region's heads yet, one fetching the chunk whole from elsewhere) to
            # the other receivers itself: lost, every region waited out ``STRIPE_WAIT`` for it.
            self._stripe_to(vs, index, pid, (s, plan.n),
                            [h for h in plan.receiver.values() if h != pid] if first else ())

    def _stripe_to(self, vs: VersionState, index: int, pid: str, stripe: tuple[int, int], fallback=()) -> None:
        """Push stripe ``stripe`` of chunk ``index`` to ``pid`` (once); if it declines, to ``fallback``."""
        sent = self.striped_to.setdefault(vs.key, {}).setdefault(index, set())
        if (pid, stripe) in sent or pid in self.banned or (ps := self._peer(pid)) is None or \
                index in ps.have.get(vs.key, ()):
            return
        sent.add((pid, stripe))
        task = asyncio.create_task(self._push_to(ps, vs, index, stripe=stripe, fallback=fallback),
                                   name=f"stripe-{vs.key.tag}-{index}-{stripe[0]}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _push_to(self, ps: PeerState, vs: VersionState, index: int, counted: Partial | None = None,
                       stripe: tuple[int, int] | None = None, fallback=()) -> None:
        """One push: the chunk's stream, from its file or from the fetch in progress, paced and in its
        lane like an upload asked for. The receiver refuses (409) what it holds, fetches or cannot
        check; a stream from a partial that fails is cut short, and the receiver drops it.
        ``counted``: the partial whose ``streams`` count this push, released when it ends. ``stripe``:
        only that stripe of the chunk (``_stripe_out``), in no upload slot; refused, it goes to the
        receivers in ``fallback``."""
        key = (vs.key, index)
        wan = ps.region != self.host.settings.region
        size = vs.chunks[index].size
        outcome, why = "failed", None
        if stripe is None:
            self._spawned[wan] -= 1
        try:
            async with self._upload_slot(wan) if stripe is None else contextlib.nullcontext():
                if index in vs.have:
                    source: Path | Partial = self.store.chunk_path(vs.key, index)
                elif (part := self.partials.get(key)) is not None and (part.servable or
                                                                       (stripe and part.striped and not part.failed)):
                    source = part
                else:
                    return  # its fetch failed while this push waited for a slot
                if stripe is not None:
                    assert vs.block is not None  # a chunk pushed in stripes is hashed in blocks
                    size = stripe_size(size, vs.block, *stripe)
                event(log, logging.DEBUG, "pushing a chunk", peer=ps.node_id, object=str(vs.key), index=index,
                      whole=index in vs.have, stripe=stripe and f"{stripe[0]}/{stripe[1]}")
                assert self._session is not None  # made by start
                for attempt in range(PUSH_TRIES):
                    async with self._session.post(
                            f"http://{ps.address}/v1/swarm/chunk/{vs.key.tag}/{index}",
                            # a first piece of one block: what a push declined at once has cost the limits
                            data=self._paced(source, wan, vs.block or PIECE, stripe, vs.chunks[index].size),
                            headers={"Content-Type": "application/octet-stream", **self._proof_for(ps),
                                     **({ROOT_HEADER: root} if (root := vs.roots.get(index)) else {}),
                                     **({STRIPE_HEADER: f"{stripe[0]}/{stripe[1]}"} if stripe else {}),
                                     **_statement_header(vs, index), **self._rate_header(wan, source),
                                     **self._also_header(vs.key, index, ps.node_id)},
                            timeout=aiohttp.ClientTimeout(total=stream_timeout(size, _send_time(vs, index)))) as r:
                        body = await r.read()
                        outcome = "taken" if r.status == 200 else "refused"
                        if r.status == 409:
                            with contextlib.suppress(ValueError, TypeError, AttributeError):
                                why = json.loads(body).get("error")
                    # 503: the receiver does not know this node yet (one of them joined a moment ago;
                    # it asks the tracker, a round trip). A swarm's first version, published as it
                    # formed, meets this, and a stripe lost so costs every region ``STRIPE_WAIT``: so
                    # retry after ``NOT_YET_RETRY`` (evidence: docs/history/DESIGN-NOTES.md#push-retry-not-yet).
                    if r.status != 503 or attempt == PUSH_TRIES - 1 or self._closing:
                        break
                    await asyncio.sleep(NOT_YET_RETRY)
        except (_Cut, aiohttp.ClientError, asyncio.TimeoutError, OSError):
            pass
        finally:
            self.pushing_to.discard((ps.node_id, vs.key, index))
            if counted is not None:
                counted.leave()
        self.pushes[outcome] += 1
        event(log, logging.DEBUG, "pushed a chunk", peer=ps.node_id, object=str(vs.key), index=index, outcome=outcome,
              contact=ps.node_id not in self.peers,  # contact: a head of another region this node does not peer with
              root=vs.roots.get(index))
        if outcome == "taken":
            self.host.count_bytes("up", size, wan)
            if stripe is not None:
                self.stripes["sent"] += 1
        elif outcome == "refused" and stripe is not None and why != "being fetched" and not self._closing:
            for pid in fallback:  # (one fetching the chunk whole hands its stripe on from that)
                self._stripe_to(vs, index, pid, stripe)

    def _also_header(self, key: Key, index: int, to: str) -> dict[str, str]:
        """A push's ``ALSO_HEADER``: the other peers this node pushes the chunk to now, if it fits."""
        also = ",".join(sorted(p for (p, o, i) in self.pushing_to if o == key and i == index and p != to))
        return {ALSO_HEADER: also} if also and len(also) <= ALSO_HEADER_MAX else {}

    def _take_root(self, vs: VersionState, index: int, root: str | None) -> None:
        """Where chunk ``index`` entered the swarm (a stream's ``ROOT_HEADER``, or this node's region for
        a chunk from the trainer), kept when it names a region whose heads this node knows: its pushes
        then follow the chunk's region tree. A stream that names none, or a false one, leaves the
        greedy choice (a false root can only make a chunk cross later, by pull)."""
        m = self.host.membership
        if root and index not in vs.roots and m is not None and root in m.state.heads:
            vs.roots[index] = root
