"""The swarm driver: have-map exchange, chunk requests and uploads over HTTP.

Thin asyncio around the pure parts (``Picker``, ``Choker``, ``SuperSeed``,
``VersionState``, ``TokenBucket``, ``Rate``):

* Each node keeps one long-polling *exchange* with each peer in its tracker
  peer list: the request carries its own have-maps and what it is fetching,
  the reply (when something changed, or after a few seconds) carries the
  peer's signed statements it lacks, the peer's have-maps, and whether the
  peer chokes it. Have messages therefore arrive within one round trip.
* A scheduler asks the picker for requests whenever something changed and
  fetches chunks (``GET /v1/swarm/chunk/V/I``), oldest version first. Each
  chunk is checked against its signed BLAKE3 hash before it is stored or
  served; a peer that sends a bad chunk is banned for the session.
* The serving side answers exchanges and chunk requests, unchoking the peers
  the choker picks; the trainer shows each peer only what super-seeding
  offers it. Unlimited uploads are aiohttp FileResponses: sendfile on asyncio's
  loop; uvloop does not implement loop.sendfile, so there aiohttp reads and
  writes in pieces: one copy through user space per chunk served.
* The trainer publishes through ``/v1/publish/...``: each chunk is signed
  into an announcement as it arrives, so chunks move before the manifest.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import aiohttp
import blake3
from aiohttp import web

from ..codec.manifest import Manifest
from ..errors import FormatError, IntegrityError, SparrowError
from ..schema import Bytes, Int, List, NonNegInt, Opt, Str, fields, pack, unpack
from ..swarm.bucket import TokenBucket
from ..swarm.choker import Choker, ChokerPeer
from ..swarm.picker import PeerView, Picker, slots_for_rate
from ..swarm.rate import Rate
from ..swarm.signing import ANNOUNCE, MANIFEST, Signed, Signer, Verifier
from ..swarm.superseed import SuperSeed
from ..swarm.versions import ChunkRef, VersionState, announce_body, from_bitmap, to_bitmap
from .bodies import read_limited
from .logs import event
from .membership import outgoing
from .store import ChunkStore

__all__ = ["Swarm", "MSGPACK", "MAX_CHUNK", "NODE_HEADER", "REGION_HEADER"]

log = logging.getLogger("sparrowd.swarm")

MSGPACK = "application/msgpack"
MAX_CHUNK = 64 << 20
MAX_EXCHANGE = 16 << 20
NODE_HEADER, REGION_HEADER = "X-Sparrowd-Node", "X-Sparrowd-Region"
EXCHANGE_WAIT = 5.0
PIECE = 256 << 10
MIN_RATE = 128 << 10  # a chunk request times out after 5 s plus its size at this rate
UPLOADS_PER_PEER = 8
UPLOAD_SLOTS = 8  # peers unchoked at once (one of them the optimistic unchoke)
SEED_CONCURRENT, RELAY_CONCURRENT = 2, 2  # uploads served at once; more requests wait their turn
SEED_PER_PEER = 2  # chunks the trainer assigns a peer at a time (3 measured no faster, and more duplicates)
CROSS_RATE = 256 << 10  # the slowest cross-region rate a designated crosser is waited for

_EXCHANGE_REQ = {"node_id": Str, "region": Str, "after": Int, "wait": Opt(Int), "versions": List}
_VERSION_REQ = {"version": NonNegInt, "statements": NonNegInt, "have": Bytes, "fetching": Bytes}
_VERSION_REP = {"version": NonNegInt, "statements": List, "have": Bytes, "fetching": Bytes}


@dataclass
class PeerState:
    node_id: str
    address: str
    region: str
    role: str
    have: dict[int, set[int]] = field(default_factory=dict)
    fetching: dict[int, set[int]] = field(default_factory=dict)
    choking: bool = False
    inflight: int = 0
    rate: Rate = field(default_factory=Rate)
    task: asyncio.Task | None = None
    gen: int = -1
    pushing: bool = False
    push_again: bool = False
    strikes: int = 0  # requests that timed out or failed in a row
    cooldown_until: float = 0.0  # no requests to it before then (a stalled or failing peer)


@dataclass
class Remote:
    """A peer as seen from the serving side."""

    node_id: str
    region: str
    have: dict[int, set[int]] = field(default_factory=dict)
    last_seen: float = 0.0
    rate_to: Rate = field(default_factory=Rate)
    uploads: int = 0


class Swarm:
    def __init__(self, daemon, store: ChunkStore, *, signer: Signer | None, retain: int,
                 upload_rate: int | None, download_rate: int | None, wan_upload_rate: int | None):
        self.daemon = daemon
        self.store = store
        self.signer = signer
        self.verifier: Verifier | None = Verifier(signer.public) if signer else None
        self.retain = retain
        self.versions: dict[int, VersionState] = {}
        self.peers: dict[str, PeerState] = {}
        self.remotes: dict[str, Remote] = {}
        self.banned: set[str] = set()
        self.gen = 0
        self._changed = asyncio.Event()
        self._waiters = asyncio.Condition()
        self.inflight: dict[tuple[int, int], dict[str, asyncio.Task]] = {}
        self.available_since: dict[tuple[int, int], float] = {}
        self.picker = Picker(daemon.node_id, daemon.settings.region)
        self.choker = Choker(slots=UPLOAD_SLOTS, optimistic_interval=5.0)
        self.unchoked: set[str] = set()
        self.superseed: dict[int, SuperSeed] = {}
        self.up = TokenBucket(upload_rate)
        self.down = TokenBucket(download_rate)
        self.wan_up = TokenBucket(wan_upload_rate)
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        # A node's uplink finishes a few chunks at a time rather than many at once: a finished chunk
        # can be relayed, a half-sent one cannot.
        self._uploads = asyncio.Semaphore(SEED_CONCURRENT if signer else RELAY_CONCURRENT)
        self.error: str | None = None

    # ------------------------------------------------------------ lifecycle

    def load(self) -> None:
        self.versions = self.store.load(self.verifier)
        for vs in self.versions.values():
            if self.signer and vs.total is not None:
                self.superseed[vs.version] = SuperSeed(vs.total, per_peer=SEED_PER_PEER)
        if self.versions:
            event(log, logging.INFO, "chunk store loaded", versions=len(self.versions),
                  chunks=sum(len(v.have) for v in self.versions.values()))

    def set_verifier(self, verifier: Verifier) -> None:
        if self.verifier is None:
            self.verifier = verifier
            self.load()

    def start(self) -> None:
        self._session = aiohttp.ClientSession(connector=outgoing(self.daemon.source_address), headers={
            "Authorization": f"Bearer {self.daemon.token}", NODE_HEADER: self.daemon.node_id,
            REGION_HEADER: self.daemon.settings.region})
        self._tasks.append(asyncio.create_task(self._choke_loop(), name="choker"))
        if self.signer is None:
            self._tasks.append(asyncio.create_task(self._peer_manager(), name="peers"))
            self._tasks.append(asyncio.create_task(self._scheduler(), name="scheduler"))

    async def stop(self) -> None:
        tasks = self._tasks + [p.task for p in self.peers.values() if p.task]
        tasks += [t for ts in self.inflight.values() for t in ts.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def _touch(self) -> None:
        self.gen += 1
        self._changed.set()

    async def _notify(self) -> None:
        self._touch()
        async with self._waiters:
            self._waiters.notify_all()

    # ------------------------------------------------------------ what the node reports

    def held(self) -> list[int]:
        return sorted(v for v, vs in self.versions.items() if vs.complete)

    def progress(self) -> tuple[int, int, int] | None:
        pending = [vs for vs in self.versions.values() if not vs.complete]
        if not pending:
            return None
        vs = min(pending, key=lambda x: x.version)
        return vs.version, len(vs.have), vs.total if vs.total is not None else len(vs.chunks)

    def _fetching(self, version: int) -> set[int]:
        """Chunks of ``version`` this node has requests out for: what it is "about to" have."""
        return {i for (v, i) in self.inflight if v == version}

    def latest(self) -> int | None:
        return max(self.held(), default=None)

    # ------------------------------------------------------------ statements

    def _version(self, v: int) -> VersionState:
        vs = self.versions.get(v)
        if vs is None:
            vs = self.versions[v] = VersionState(v)
        return vs

    def _take_statement(self, vs: VersionState, s: Signed) -> list[int]:
        before = len(vs.statements)
        new = vs.add(s, self.verifier)
        if len(vs.statements) == before:
            return new  # seen before
        self.store.add_statement(vs, s)
        if s.kind == MANIFEST:
            event(log, logging.INFO, "manifest received", version=vs.version, chunks=vs.total,
                  base_version=vs.base_version)
        return new

    def _retire(self) -> None:
        complete = sorted(v for v, vs in self.versions.items() if vs.complete)
        for v in complete[: max(0, len(complete) - self.retain)]:
            self.store.drop(v)
            del self.versions[v]
            self.superseed.pop(v, None)
            event(log, logging.INFO, "version dropped (retention)", version=v, retain=self.retain)

    # ------------------------------------------------------------ publishing (trainer)

    async def publish_chunk(self, version: int, index: int, data: bytes) -> dict:
        vs = self._version(version)
        ref = ChunkRef(blake3.blake3(data).digest(), len(data))
        known = vs.chunks.get(index)
        if vs.manifest is not None and known is None:
            raise FormatError(f"version {version} is complete; it has no chunk {index}")
        if known is not None:
            if known != ref:
                raise IntegrityError(f"version {version}: chunk {index} was published with another hash")
            return {"index": index, "new": False}
        s = self.signer.sign(ANNOUNCE, version, announce_body(index, [ref]))
        self._take_statement(vs, s)
        await asyncio.to_thread(self.store.put_chunk, vs, index, data)
        vs.have.add(index)
        self.superseed.setdefault(version, SuperSeed(0, per_peer=SEED_PER_PEER)).grow(len(vs.chunks))
        await self._notify()
        return {"index": index, "new": True}

    async def publish_manifest(self, data: bytes) -> dict:
        m = Manifest.from_bytes(data)
        vs = self._version(m.version)
        if vs.manifest is not None:
            if vs.manifest.to_bytes() == m.to_bytes():
                return {"version": m.version, "chunks": vs.total, "new": False}
            raise FormatError(f"version {m.version} was published with another manifest")
        missing = [i for i in range(len(m.chunks)) if i not in vs.have]
        if missing:
            raise FormatError(f"version {m.version}: {len(missing)} chunks not published yet (first {missing[0]})")
        latest = max((v for v, x in self.versions.items() if x.complete), default=None)
        if latest is not None and m.version <= latest:
            raise FormatError(f"version {m.version} is not newer than the latest published, {latest}")
        if m.base_version is not None and latest is not None and m.base_version != latest:
            raise FormatError(f"version {m.version} applies to {m.base_version}, but the latest published is {latest}")
        self._take_statement(vs, self.signer.sign(MANIFEST, m.version, m.to_bytes()))
        self.superseed.setdefault(m.version, SuperSeed(0, per_peer=SEED_PER_PEER)).grow(len(vs.chunks))
        if self.daemon.tracker is not None:
            self.daemon.tracker.table.set_latest_version(m.version)
        event(log, logging.INFO, "version published", version=m.version, chunks=len(m.chunks),
              bytes=m.patch_bytes, base_version=m.base_version)
        self._retire()
        await self._notify()
        return {"version": m.version, "chunks": len(m.chunks), "new": True}

    # ------------------------------------------------------------ serving side

    def forget(self, node_id: str) -> None:
        """A node's lease ended: what super-seeding gave it goes to others, its view is dropped."""
        for ss in self.superseed.values():
            ss.forget(node_id)
        self.remotes.pop(node_id, None)

    def _remote(self, request: web.Request) -> Remote:
        node = request.headers.get(NODE_HEADER, "")[:64] or f"anon@{request.remote}"
        region = request.headers.get(REGION_HEADER, "")[:64] or "?"
        r = self.remotes.get(node)
        if r is None:
            r = self.remotes[node] = Remote(node, region)
        r.last_seen = time.monotonic()
        return r

    def _shown(self, remote: Remote, vs: VersionState) -> set[int]:
        """What this node shows a peer of a version: all it holds, or the super-seed's offer."""
        if self.signer is None:
            return vs.have
        if self._choking_active() and remote.node_id not in self.unchoked:
            return set()  # no assignments to a peer that cannot fetch them now
        ss = self.superseed.get(vs.version)
        if ss is None:
            return set()
        ss.grow(len(vs.chunks))
        held_by: dict[int, int] = {}
        for r in self.remotes.values():
            for c in r.have.get(vs.version, ()):
                held_by[c] = held_by.get(c, 0) + 1
        return ss.offer(time.monotonic(), remote.node_id, remote.have.get(vs.version, set()), held_by) & vs.have

    async def handle_exchange(self, request: web.Request) -> web.Response:
        body = await read_limited(request.content, MAX_EXCHANGE)
        if body is None:
            return web.json_response({"error": "exchange message too large"}, status=413)
        try:
            m = fields(unpack(body, what="exchange", max_len=MAX_EXCHANGE), _EXCHANGE_REQ, what="exchange")
            theirs = {}
            for e in m["versions"][:4096]:
                e = fields(e, _VERSION_REQ, what="exchange version")
                theirs[e["version"]] = (e["statements"], from_bitmap(e["have"]))
        except (FormatError, SparrowError) as e:
            return web.json_response({"error": str(e)}, status=400)
        remote = self._remote(request)
        new_have = {v: h for v, (_, h) in theirs.items()}
        if new_have != remote.have:
            remote.have = new_have
            if self.signer is not None:
                await self._notify()  # wake this peer's long poll: it may be offered more now
        wait = min(float(m["wait"] or 0), 15.0)
        if m["after"] >= self.gen and wait > 0:
            async with self._waiters:
                try:
                    await asyncio.wait_for(self._waiters.wait_for(lambda: self.gen > m["after"]), wait)
                except asyncio.TimeoutError:
                    pass
        out = []
        for v in sorted(self.versions):
            vs = self.versions[v]
            known = theirs.get(v, (0, None))[0]
            n = len(vs.chunks)
            fetching = self._fetching(v)
            out.append({"version": v, "statements": [s.to_bytes() for s in vs.statements[known:]],
                        "have": to_bitmap(self._shown(remote, vs), n), "fetching": to_bitmap(fetching, n)})
        reply = {"gen": self.gen, "versions": out, "choked": remote.node_id not in self.unchoked and
                 self._choking_active()}
        return web.Response(body=pack(reply), content_type=MSGPACK)

    def _choking_active(self) -> bool:
        return len([r for r in self.remotes.values() if time.monotonic() - r.last_seen < 30]) > self.choker.slots

    async def handle_chunk(self, request: web.Request) -> web.StreamResponse:
        remote = self._remote(request)
        try:
            v, i = int(request.match_info["version"]), int(request.match_info["index"])
        except ValueError:
            return web.json_response({"error": "version and index must be integers"}, status=400)
        vs = self.versions.get(v)
        if vs is None or i not in vs.have:
            return web.json_response({"error": "not held"}, status=404)
        if self._choking_active() and remote.node_id not in self.unchoked:
            return web.json_response({"error": "choked"}, status=503)
        if remote.uploads >= UPLOADS_PER_PEER:
            return web.json_response({"error": "too many requests in flight"}, status=429)
        if v in self.superseed:
            self.superseed[v].claim(i)
        path = self.store.chunk_path(v, i)
        size = vs.chunks[i].size
        wan = remote.region != self.daemon.settings.region
        remote.uploads += 1
        try:
            async with self._uploads:
                resp, sent = await self._send(request, path, size, wan)
        finally:
            remote.uploads -= 1
        if not sent:
            return resp
        remote.rate_to.add(time.monotonic(), size)
        self.daemon.count_bytes("up", size, wan)
        return resp

    async def _send(self, request: web.Request, path, size: int, wan: bool) -> tuple[web.StreamResponse, bool]:
        """The chunk's bytes, paced by the rate limits; False when the peer hung up (an endgame
        loser cancelled: not an error)."""
        if not (self.up.rate or (wan and self.wan_up.rate)):
            resp = web.FileResponse(path, headers={"Content-Type": "application/octet-stream"})
            try:
                await resp.prepare(request)  # sendfile where the event loop supports it
            except ConnectionError:
                return resp, False
            return resp, True
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)})
        try:
            await resp.prepare(request)
            with open(path, "rb") as f:
                while piece := f.read(PIECE):
                    now = time.monotonic()
                    delay = max(self.up.take(now, len(piece)), self.wan_up.take(now, len(piece)) if wan else 0)
                    if delay:
                        await asyncio.sleep(delay)
                    await resp.write(piece)
            await resp.write_eof()
        except ConnectionError:
            return resp, False
        return resp, True

    async def _choke_loop(self) -> None:
        while True:
            now = time.monotonic()
            peers = []
            for r in self.remotes.values():
                if now - r.last_seen > 30:
                    continue
                wants = any(vs.have - r.have.get(v, set()) for v, vs in self.versions.items())
                p = self.peers.get(r.node_id)
                peers.append(ChokerPeer(r.node_id, wants, rate_from=p.rate.rate(now) if p else 0.0,
                                        rate_to=r.rate_to.rate(now)))
            seed = all(vs.complete for vs in self.versions.values())
            unchoked = self.choker.decide(now, peers, seed=seed)
            if unchoked != self.unchoked:
                for pid in self.unchoked - unchoked:  # what a choked peer was given, and not asked for, goes
                    for ss in self.superseed.values():
                        ss.forget(pid, unclaimed_only=True)
                self.unchoked = unchoked
                await self._notify()  # peers waiting in an exchange learn their new choke state now
            await asyncio.sleep(1.0)

    # ------------------------------------------------------------ fetching side

    async def _peer_manager(self) -> None:
        while True:
            listed = {p["node_id"]: p for p in self.daemon.membership.state.peers}
            for pid, p in listed.items():
                if pid in self.banned or pid in self.peers:
                    continue
                ps = self.peers[pid] = PeerState(pid, p["address"], p["region"], p["role"])
                ps.task = asyncio.create_task(self._peer_loop(ps), name=f"peer-{pid}")
            for pid in [pid for pid in self.peers if pid not in listed or pid in self.banned]:
                ps = self.peers.pop(pid)
                if ps.task:
                    ps.task.cancel()
                self._changed.set()
            await asyncio.sleep(0.5)

    def _my_versions(self) -> list[dict]:
        out = []
        for v, vs in sorted(self.versions.items()):
            n = len(vs.chunks)
            fetching = self._fetching(v)
            out.append({"version": v, "statements": len(vs.statements), "have": to_bitmap(vs.have, n),
                        "fetching": to_bitmap(fetching, n)})
        return out

    async def _exchange(self, ps: PeerState, wait: float) -> None:
        msg = {"node_id": self.daemon.node_id, "region": self.daemon.settings.region, "after": ps.gen,
               "wait": int(wait), "versions": self._my_versions()}
        async with self._session.post(f"http://{ps.address}/v1/swarm/exchange", data=pack(msg),
                                      headers={"Content-Type": MSGPACK},
                                      timeout=aiohttp.ClientTimeout(total=wait + 10)) as r:
            body = await read_limited(r.content, MAX_EXCHANGE)
            if body is None:
                raise FormatError(f"exchange reply from {ps.node_id}: over {MAX_EXCHANGE} bytes")
            if r.status != 200:
                raise SparrowError(f"exchange with {ps.node_id}: HTTP {r.status}")
        self._ingest(ps, unpack(body, what=f"exchange reply from {ps.node_id}", max_len=MAX_EXCHANGE))

    async def _peer_loop(self, ps: PeerState) -> None:
        """The long poll: returns when the peer changed (or after a few seconds), then asks again."""
        backoff = 0.5
        while True:
            try:
                await self._exchange(ps, EXCHANGE_WAIT)
                backoff = 0.5
            except asyncio.CancelledError:
                raise
            except IntegrityError as e:
                self._ban(ps, str(e))
                return
            except (SparrowError, aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                event(log, logging.DEBUG, "exchange failed", peer=ps.node_id, reason=str(e) or type(e).__name__)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def _tell_peers(self) -> None:
        """Have messages: after a new chunk, a quick exchange with every peer carries the new
        have-map (the peer's long polls wake on it; the trainer re-offers at once)."""
        for ps in list(self.peers.values()):
            if ps.pushing:
                ps.push_again = True
                continue
            ps.pushing = True
            asyncio.create_task(self._push(ps), name=f"have-{ps.node_id}")

    async def _push(self, ps: PeerState) -> None:
        try:
            while True:
                ps.push_again = False
                try:
                    await self._exchange(ps, 0)
                except IntegrityError as e:
                    self._ban(ps, str(e))
                    return
                except (SparrowError, aiohttp.ClientError, asyncio.TimeoutError, OSError):
                    return
                if not ps.push_again:
                    return
        finally:
            ps.pushing = False

    def _ingest(self, ps: PeerState, reply) -> None:
        if not isinstance(reply, dict) or not isinstance(reply.get("versions"), list):
            raise FormatError(f"exchange reply from {ps.node_id}: not a map with versions")
        ps.gen = int(reply.get("gen", -1)) if isinstance(reply.get("gen"), int) else -1
        ps.choking = bool(reply.get("choked"))
        held = self.held()
        oldest_kept = held[-self.retain] if len(held) >= self.retain else None
        now = time.monotonic()
        seen_versions = set()
        for e in reply["versions"][:4096]:
            e = fields(e, _VERSION_REP, what="exchange reply version")
            v = e["version"]
            seen_versions.add(v)
            if oldest_kept is not None and v < oldest_kept and v not in self.versions:
                continue  # older than what this node retains
            vs = self.versions.get(v) or VersionState(v)
            for raw in e["statements"][:1 << 16]:
                if not isinstance(raw, bytes):
                    raise FormatError("statement must be bytes")
                if self._take_statement(vs, Signed.from_bytes(raw)):
                    self._touch()
            if not vs.statements:
                continue  # nothing signed yet: not a version this node knows
            self.versions.setdefault(v, vs)
            have = {i for i in from_bitmap(e["have"]) if i in vs.chunks}
            ps.have[v] = have
            ps.fetching[v] = {i for i in from_bitmap(e["fetching"]) if i in vs.chunks}
            for i in have:
                self.available_since.setdefault((v, i), now)
        for v in list(ps.have):
            if v not in seen_versions:
                del ps.have[v]
        self._changed.set()

    def _ban(self, ps: PeerState, reason: str) -> None:
        if ps.node_id in self.banned:
            return
        self.banned.add(ps.node_id)
        event(log, logging.WARNING, "peer banned for the session", peer=ps.node_id, reason=reason)
        if ps.task and ps.task is not asyncio.current_task():
            ps.task.cancel()
        self.peers.pop(ps.node_id, None)
        self._changed.set()

    async def _scheduler(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._changed.wait(), 0.25)
            except asyncio.TimeoutError:
                pass
            self._changed.clear()
            self._schedule()

    def _schedule(self) -> None:
        now = time.monotonic()
        my_region = self.daemon.settings.region
        region_nodes = [self.daemon.node_id] + [p.node_id for p in self.peers.values()
                                                 if p.region == my_region and p.role != "trainer"]
        for v in sorted(self.versions):
            vs = self.versions[v]
            if vs.complete:
                continue
            missing = vs.missing()
            if not missing:
                continue
            chunk_size = max((c.size for c in vs.chunks.values()), default=1)
            # Give the region's designated crosser time to move a chunk before anyone else crosses for it.
            self.picker.cross_wait = 3.0 + chunk_size / CROSS_RATE
            views = [PeerView(p.node_id, p.region, p.have.get(v, set()), is_trainer=p.role == "trainer",
                              choking=p.choking or now < p.cooldown_until, inflight=p.inflight, fetching=p.fetching.get(v, set()),
                              slots=slots_for_rate(p.rate.rate(now), chunk_size), rate=p.rate.rate(now))
                     for p in self.peers.values()]
            inflight = {i: set(self.inflight.get((v, i), {})) for i in missing}
            since = {i: self.available_since.get((v, i), now) for i in missing}
            for req in self.picker.pick(now, version=v, missing=missing, inflight=inflight, peers=views,
                                        region_nodes=region_nodes, available_since=since):
                ps = self.peers.get(req.peer_id)
                if ps is None:
                    continue
                ps.inflight += 1
                task = asyncio.create_task(self._fetch(ps, vs, req.index), name=f"fetch-{v}-{req.index}")
                self.inflight.setdefault((v, req.index), {})[ps.node_id] = task

    async def _fetch(self, ps: PeerState, vs: VersionState, index: int) -> None:
        key = (vs.version, index)
        ref = vs.chunks[index]
        wan = ps.region != self.daemon.settings.region
        try:
            timeout = aiohttp.ClientTimeout(total=5.0 + ref.size / MIN_RATE)
            async with self._session.get(f"http://{ps.address}/v1/swarm/chunk/{vs.version}/{index}",
                                         timeout=timeout) as r:
                if r.status == 503:
                    ps.choking = True
                    return
                if r.status != 200:
                    return
                parts, got = [], 0
                async for piece in r.content.iter_chunked(PIECE):
                    got += len(piece)
                    if got > ref.size:
                        raise IntegrityError(f"chunk {index} of version {vs.version} is longer than signed")
                    parts.append(piece)
                    ps.rate.add(time.monotonic(), len(piece))
                    delay = self.down.take(time.monotonic(), len(piece))
                    if delay:
                        await asyncio.sleep(delay)
            data = b"".join(parts)
            self.daemon.count_bytes("down", len(data), wan)
            if index in vs.have:
                return
            try:
                await asyncio.to_thread(self.store.put_chunk, vs, index, data)
            except OSError as e:  # a full or failing disk: say so, keep serving what is stored
                self.error = f"storing chunks in {self.store.root}: {e.strerror or e}"
                event(log, logging.ERROR, "cannot store a chunk", version=vs.version, index=index, reason=self.error)
                return
            vs.have.add(index)
            ps.strikes = 0
            self.error = None
            event(log, logging.DEBUG, "chunk stored", version=vs.version, index=index, peer=ps.node_id,
                  bytes=len(data), wan=wan)
            for pid, t in self.inflight.get(key, {}).items():  # endgame: cancel the losers
                if pid != ps.node_id:
                    t.cancel()
            if vs.complete:
                event(log, logging.INFO, "version complete", version=vs.version, chunks=vs.total)
                self._retire()
            await self._notify()
            self._tell_peers()
        except IntegrityError as e:
            self._ban(ps, str(e))
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
            # The request ends and the chunk goes back to the picker; the peer sits out a while
            # (longer each time in a row), so a stalled peer does not get the chunk again.
            ps.strikes += 1
            ps.cooldown_until = time.monotonic() + min(60.0, 2.0 ** ps.strikes)
            event(log, logging.INFO, "chunk request failed; peer cools down", peer=ps.node_id, version=vs.version,
                  index=index, reason=type(e).__name__, seconds=min(60.0, 2.0 ** ps.strikes))
        finally:
            ps.inflight -= 1
            tasks = self.inflight.get(key)
            if tasks is not None:
                tasks.pop(ps.node_id, None)
                if not tasks:
                    del self.inflight[key]
            self._changed.set()
