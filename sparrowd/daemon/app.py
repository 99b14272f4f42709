"""The daemon: one per node. HTTP on aiohttp; the trainer's also hosts the tracker.

Lifecycle: lock the data dir, read the token, open the lease database (trainer),
bind the listener, write ``daemon.json`` (how local commands find the daemon),
tell systemd READY=1, then keep the lease until SIGTERM/SIGINT or a local
``sparrowd leave``; on the way out leave the swarm, flush and close the lease
database, remove ``daemon.json`` and exit 0.

Every HTTP route needs the swarm token (``Authorization: Bearer TOKEN``,
compared in constant time) or a join credential the trainer signed and did not
revoke (``swarm.identity``); swarm routes need a member's ticket and proof
instead (``Swarm.admit``), checked from the headers before a byte of the body
is read. Anything else gets 401 and a log line, and learns nothing about the
swarm, not even which paths exist. Connections that do not authenticate are
shed (``connections``). SIGHUP re-reads the token file (rotation without a
restart).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import os
import signal
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from .. import __version__
from ..checkpoint import atomic_file
from ..client import read_tokens
from ..codec.chunk import ULP2
from ..codec.manifest import MAX_MANIFEST
from ..errors import FormatError, InputError, IntegrityError, SparrowError
from ..schema import pack, unpack
from ..swarm.chain import Key, Unproducible, unproducible
from ..swarm.identity import (
    CREDENTIAL_PREFIX,
    Credential,
    CredentialBook,
    Identities,
    NodeKey,
    Refused,
    SessionUnknown,
    default_node_id,
    parse_duration,
)
from ..swarm.leases import MAX_VERSIONS_REPORTED, LeaseGone, LeaseTable, check_name
from ..swarm.signing import Verifier, load_or_create_key, pin_public_key
from ..swarm.waits import arrival
from . import sdnotify
from .bodies import read_limited
from .connections import GuardedRunner
from .engine import EngineServer
from .folder import FolderKeeper, decoded_path
from .follow import VllmFollower
from .leasedb import SqliteLeaseStore
from .logs import Throttle, event
from .membership import (
    MAX_TRACKER_MESSAGE,
    MSGPACK,
    SERVER_KEEPALIVE,
    HttpTrackerClient,
    LocalTrackerClient,
    Membership,
    Unauthorized,
    bearer,
    outgoing,
)
from .metrics import CONTENT_TYPE, DaemonMetrics
from .settings import Settings
from .store import ChunkStore
from .swarm import MAX_CHUNK, NODE_HEADER, Swarm
from .tracker import TrackerService

__all__ = ["Daemon", "run_daemon", "RUNTIME_FILE", "read_runtime"]

log = logging.getLogger("sparrowd.daemon")

RUNTIME_FILE = "daemon.json"
EXIT_REFUSED = 78  # the tracker refused this node for good (revoked, expired, a wrong token): systemd does not restart
MAX_BODY = 1 << 20
SHUTDOWN_GRACE = 3.0  # seconds in-flight requests get to finish when the daemon stops
MAX_WAIT = 60.0  # the longest one /v1/tracker/wait long poll holds; clients poll again
WAIT_COALESCE = 0.05  # seconds a woken long poll waits for more renewals before it looks again
MAX_INFLIGHT_PER_PEER = 32  # a node needs one long poll, a few have-pushes and up to 8 chunk requests
MAX_INFLIGHT_PER_ADDRESS = 1024  # many daemons may share an address (NAT, a proxy, one box)
SWEEP_EVERY = 1.0
_UNAUTHORIZED_LOG_EVERY = 10.0


def read_runtime(data_dir: Path) -> dict | None:
    """What a running daemon wrote about itself, or None when none runs there."""
    try:
        info = json.loads((Path(data_dir) / RUNTIME_FILE).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def engine_socket_path(s: Settings, env=os.environ) -> Path:
    """The engine socket: as set; else in systemd's RuntimeDirectory (/run/sparrowd); else DATA/engine.sock."""
    if s.engine_socket:
        return Path(s.engine_socket)
    if env.get("RUNTIME_DIRECTORY"):
        return Path(env["RUNTIME_DIRECTORY"].split(":")[0]) / "engine.sock"
    return s.data_dir / "engine.sock"


def _route(request: web.Request) -> str:
    """The route's template for metrics labels (never the raw path: that is the client's choice,
    and every distinct label is memory kept for the process's life)."""
    route = request.match_info.route
    return route.resource.canonical if route.resource is not None else "other"


def _wildcard(host: str) -> bool:
    return host in ("0.0.0.0", "::", "")


def _route_to(url: str) -> str:
    """The local address the kernel would use to reach the tracker (no packet is sent)."""
    u = urlsplit(url)
    family = socket.AF_INET6 if ":" in (u.hostname or "") else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((u.hostname, u.port or 80))
        return s.getsockname()[0]


class Daemon:
    def __init__(self, settings: Settings, *, env=os.environ):
        self.settings = settings
        self.env = env
        self.data_dir = settings.data_dir
        self.node_id = ""
        self.address = ""
        self.url = ""
        self.tracker: TrackerService | None = None
        self.membership: Membership | None = None
        self.follower: VllmFollower | None = None
        self.keeper: FolderKeeper | None = None
        self.swarm: Swarm | None = None
        self.token = ""
        self.source_address: str | None = None
        # Outgoing connections, one pool for the tracker client and the swarm: the trainer's swarm
        # address is its tracker's, and a node's first exchange with it then goes over the connection
        # its join opened, not a new one (at 300 ms round trips a node of a swarm just formed heard of
        # the others a round trip later for that handshake, and its stripes went on that much later).
        self.connector: aiohttp.TCPConnector | None = None
        self.metrics = DaemonMetrics(self)
        self.stopping = asyncio.Event()
        self.exit_code = 0
        self._store: SqliteLeaseStore | None = None
        self._runner: GuardedRunner | None = None
        self._metrics_runner: web.AppRunner | None = None
        self._client = None
        self._tasks: list[asyncio.Task] = []
        self._lock_fd: int | None = None
        self._wrote_runtime = False
        self.auth_digests: list[bytes] = []  # SHA-256 of "Bearer <token>" per accepted token
        self.key: NodeKey | None = None
        self._credentials_seen: dict[str, Credential | None] = {}  # credential text -> claims (None: bad)
        self._credential_refused: Refused | None = None  # why ``credential`` refused the last one it checked
        self.engines: EngineServer | None = None
        self._unauthorized_log = Throttle(_UNAUTHORIZED_LOG_EVERY)  # a warning per address, not per request
        self._flood_log = Throttle(_UNAUTHORIZED_LOG_EVERY)
        self._inflight: collections.Counter = collections.Counter()
        self._tracker_event = asyncio.Event()  # set (and replaced) whenever the lease table changes

    # ------------------------------------------------------------ state other parts read

    def versions_held(self) -> list[int]:
        return self.swarm.held() if self.swarm else []

    def unproducible(self, target: int | None = None) -> Unproducible | None:
        """Why a version this rollout holds whole (``target``, else the newest) cannot be made here:
        an ``ulp2`` patch whose base no folder of this node holds or can reach. Never silent: renewals,
        ``/v1/node`` and the engine socket say it (``swarm.chain.unproducible``)."""
        sw = self.swarm
        if sw is None or self.settings.role != "rollout" or (self.keeper is not None and self.keeper.base_pending()):
            return None
        held = {k: vs.obj for k, vs in sw.versions.items()}
        based = {k.version for k, vs in sw.versions.items()
                 if not k.anchor and vs.manifest is not None and vs.manifest.values == ULP2}
        decoded = {v for v in based if decoded_path(self.data_dir, v).exists()}
        folder = self.keeper.version if self.keeper is not None else None
        return unproducible(held, based, decoded, folder, keeps_folder=self.keeper is not None, target=target)

    def count_bytes(self, direction: str, n: int, wan: bool) -> None:
        self.metrics.bytes[(direction, "other" if wan else "same")] += n

    def _joined(self) -> None:
        """A node joined the trainer's swarm: its long polls answer with the news, and its own row
        counts the new peer at once."""
        self.swarm.wake()
        self.report_changed()

    def report_changed(self) -> None:
        """What renewals report changed; the tracker hears it at once rather than at the next renewal."""
        if self.membership is not None:
            self.membership.nudge()

    def report(self) -> dict:
        b = self.metrics.bytes
        return {
            "versions": self.versions_held()[-MAX_VERSIONS_REPORTED:],
            "engine_version": self.engines.floor() if self.engines else None,
            "bytes_up": b[("up", "same")] + b[("up", "other")],
            "bytes_down": b[("down", "same")] + b[("down", "other")],
            "bytes_up_wan": b[("up", "other")],
            "bytes_down_wan": b[("down", "other")],
            "progress": list(progress) if (progress := self.swarm.progress() if self.swarm else None) else None,
            "error": (self.swarm.error if self.swarm else None) or (self.follower.error if self.follower else None)
            or (self.keeper.error if self.keeper else None) or ((u := self.unproducible()) and u.reason),
            # The trainer peers with every member (its table); a node with the peers its lease listed.
            "peers": max(0, len(self.tracker.table) - 1) if self.tracker is not None else
            len(self.membership.state.peers) if self.membership else 0,
            "current": self.keeper.report() if self.keeper else None,
        }

    def _on_lease(self, reply: dict) -> None:
        """First lease: pin the trainer's key and start the swarm (nodes other than the trainer)."""
        if self.swarm is None or self.swarm.verifier is not None:
            return
        key = reply.get("trainer_key")
        if not isinstance(key, bytes) or len(key) != 32:
            raise IntegrityError("the tracker sent no trainer key")
        self.swarm.set_verifier(pin_public_key(self.data_dir / "trainer.pub", key))
        self.swarm.start()

    # ------------------------------------------------------------ start and stop

    def _prepare_data_dir(self) -> None:
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(self.data_dir / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise InputError(f"data dir {self.data_dir}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            other = read_runtime(self.data_dir) or {}
            raise InputError(
                f"data dir {self.data_dir} is in use by another sparrowd (pid {other.get('pid', '?')})"
            ) from None
        self._lock_fd = fd
        try:
            self.key = NodeKey.load_or_create(self.data_dir / "node.key")
        except OSError as e:
            raise InputError(f"node key in {self.data_dir}: {e.strerror}") from None
        id_file = self.data_dir / "node_id"
        if self.settings.node_id:
            self.node_id = self.settings.node_id
        elif id_file.exists():
            self.node_id = check_name("node id in " + str(id_file), id_file.read_text().strip())
        else:
            self.node_id = default_node_id(self.settings.role, self.key.public)
        if not id_file.exists() or id_file.read_text().strip() != self.node_id:
            with atomic_file(id_file) as tmp:
                Path(tmp).write_text(self.node_id + "\n")

    async def start(self) -> None:
        s = self.settings
        self._prepare_data_dir()
        self.load_tokens()

        signer = load_or_create_key(self.data_dir / "trainer.key") if s.is_tracker else None
        self.swarm = Swarm(self, ChunkStore(self.data_dir), signer=signer, retain=s.retain,
                           upload_rate=s.upload_rate, download_rate=s.download_rate,
                           wan_upload_rate=s.wan_upload_rate, rate_burst=s.rate_burst)
        if s.is_tracker:
            self.swarm.load()
            self._store = SqliteLeaseStore(self.data_dir / "tracker.db")
            table = LeaseTable(s.lease_ttl, now=time.time(), store=self._store)
            self.tracker = TrackerService(table, tracker_id=self.node_id, peer_limit=s.peer_limit,
                                          trainer_key=signer.public, identities=Identities(self._store),
                                          credentials=CredentialBook(self._store), sign=signer.sign_bytes)
            self.tracker.on_change = self._tracker_touched
            self.tracker.on_join = self._joined
            latest = self.swarm.latest()
            if latest is not None:
                table.set_latest_version(latest)
            restored = table.live(time.time())
            if restored:
                event(log, logging.INFO, "tracker restored its lease table", nodes=len(restored))
        else:
            pinned = self.data_dir / "trainer.pub"
            if pinned.exists():  # chunks verified in an earlier run are served before the first lease
                self.swarm.set_verifier(Verifier(bytes.fromhex(pinned.read_text().strip())))

        app = web.Application(middlewares=[self._auth_middleware], client_max_size=MAX_BODY)
        app.add_routes([
            web.get("/metrics", self._metrics),
            web.get("/v1/node", self._node_info),
            web.post("/v1/node/leave", self._node_leave),
            web.post("/v1/swarm/exchange", self.swarm.handle_exchange),
            web.get("/v1/swarm/chunk/{key}/{index}", self.swarm.handle_chunk),
            web.post("/v1/swarm/chunk/{key}/{index}", self.swarm.handle_push),
            web.get("/v1/swarm/ping", self.swarm.handle_ping),
        ])
        if self.tracker is not None:
            app.add_routes([
                web.post("/v1/tracker/join", self._tracker_call("join")),
                web.post("/v1/tracker/renew", self._tracker_call("renew")),
                web.post("/v1/tracker/leave", self._tracker_call("leave")),
                web.get("/v1/tracker/status", self._tracker_status),
                web.get("/v1/tracker/wait", self._tracker_wait),
                web.post("/v1/publish/{key}/chunk/{index}", self._publish_chunk),
                web.post("/v1/publish/manifest", self._publish_manifest),
                web.get("/v1/publish/state", self._publish_state),
                web.get("/v1/tracker/credentials", self._credential_list),
                web.post("/v1/tracker/credentials", self._credential_create),
                web.post("/v1/tracker/credentials/{id}/revoke", self._credential_revoke),
            ])
        # Long polls are answered at once when stopping; what still runs after SHUTDOWN_GRACE
        # (a chunk upload to a slow peer) is cut, so a stop never waits on the network for long.
        self._runner = GuardedRunner(app, access_log=None, handle_signals=False, shutdown_timeout=SHUTDOWN_GRACE,
                                     keepalive_timeout=SERVER_KEEPALIVE)
        await self._runner.setup()
        host, port = s.listen
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        try:
            await site.start()
        except OSError as e:
            raise InputError(f"cannot listen on {host}:{port}: {os.strerror(e.errno) if e.errno else e}") from None
        bound_port = self._runner.addresses[0][1]
        metrics_url = await self._start_metrics_listener() if s.metrics_listen else None

        if s.advertise:
            adv_host, adv_port = s.advertise
        else:
            adv_host = host if not _wildcard(host) else (
                _route_to(s.tracker) if s.tracker else socket.gethostbyname(socket.gethostname()))
            adv_port = bound_port
        self.address = f"[{adv_host}]:{adv_port}" if ":" in adv_host else f"{adv_host}:{adv_port}"
        self.source_address = None if _wildcard(host) else host
        local_host = "127.0.0.1" if _wildcard(host) else host
        self.url = f"http://[{local_host}]:{bound_port}" if ":" in local_host else f"http://{local_host}:{bound_port}"

        me = {"node_id": self.node_id, "role": s.role, "region": s.region, "address": self.address}
        if self.tracker is not None:
            self._client = LocalTrackerClient(self.tracker)
        else:
            self._client = HttpTrackerClient(s.tracker, self.token, timeout=min(5.0, s.lease_ttl / 3),
                                             connector=self.outgoing())
        self.membership = Membership(self._client, me, self.key, report=self.report, on_fatal=self._fatal,
                                     on_lease=self._on_lease)
        if self.swarm.verifier is not None:
            self.swarm.start()
        if s.engine_socket != "off":
            self.engines = EngineServer(self, engine_socket_path(s, self.env))
            try:
                await self.engines.start()
            except SparrowError as e:
                raise InputError(str(e)) from None
        self._tasks.append(asyncio.create_task(self.membership.run(), name="membership"))
        if s.keeps_current:
            self.keeper = FolderKeeper(self)
            self._tasks.append(asyncio.create_task(self.keeper.run(), name="current-folder"))
        if s.follow_vllm:
            self.follower = VllmFollower(self, s.follow_vllm, every=s.follow_every)
            self._tasks.append(asyncio.create_task(self.follower.run(), name="follow-vllm"))
        if self.tracker is not None:
            self._tasks.append(asyncio.create_task(self._sweeper(), name="sweeper"))
        interval = sdnotify.watchdog_interval(self.env)
        if interval:
            self._tasks.append(asyncio.create_task(self._watchdog(interval), name="watchdog"))

        with atomic_file(self.data_dir / RUNTIME_FILE) as tmp:
            Path(tmp).write_text(json.dumps({
                "pid": os.getpid(), "node_id": self.node_id, "role": s.role, "region": s.region,
                "url": self.url, "address": self.address, "tracker": s.tracker or self.url,
                "token_file": str(s.token_file), "version": __version__, "started_at": time.time(),
                "metrics_url": metrics_url,
            }, indent=1) + "\n")
        self._wrote_runtime = True
        sdnotify.notify(f"READY=1\nSTATUS=listening on {host}:{bound_port} as {self.node_id}", self.env)
        event(log, logging.INFO, "daemon started", node_id=self.node_id, role=s.role, region=s.region,
              listen=f"{host}:{bound_port}", advertise=self.address, tracker=s.tracker or "self")

    async def _start_metrics_listener(self) -> str:
        """``/metrics`` alone on its own address, with no token: a scraper holds no join secret. Its
        address is the operator's choice (loopback, or a monitoring network); nothing else is served there."""
        app = web.Application(client_max_size=1024)
        app.add_routes([web.get("/metrics", self._metrics)])
        self._metrics_runner = GuardedRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await self._metrics_runner.setup()
        host, port = self.settings.metrics_listen
        try:
            await web.TCPSite(self._metrics_runner, host, port, reuse_address=True).start()
        except OSError as e:
            raise InputError(f"cannot listen for metrics on {host}:{port}: "
                             f"{os.strerror(e.errno) if e.errno else e}") from None
        bound = self._metrics_runner.addresses[0][1]
        return f"http://[{host}]:{bound}/metrics" if ":" in host else f"http://{host}:{bound}/metrics"

    def load_tokens(self) -> None:
        """(Re-)read the token file: the first line is presented, every line accepted."""
        s = self.settings
        tokens, too_open = read_tokens(s.token_file)
        if too_open:
            event(log, logging.WARNING, "token file is readable by group or others; chmod 600 it", path=s.token_file)
        # Credentials are checked by signature, not by digest: a credential file admits this node only.
        shared = [t for t in tokens if not t.startswith(CREDENTIAL_PREFIX)]
        self.auth_digests = [hashlib.sha256(bearer(t).encode()).digest() for t in shared]
        self.token = tokens[0]
        if isinstance(self._client, HttpTrackerClient):
            self._client.set_token(self.token)

    def reload(self) -> None:
        """SIGHUP: re-read the token file; a bad file keeps the tokens in use (and says so)."""
        try:
            self.load_tokens()
        except SparrowError as e:
            event(log, logging.ERROR, "reload failed; keeping the tokens in use", reason=str(e))
            return
        event(log, logging.INFO, "token file reloaded", tokens=len(self.auth_digests) + (
            1 if self.token.startswith(CREDENTIAL_PREFIX) else 0))

    def token_ok(self, header: str) -> bool:
        """Whether an Authorization header carries one of the shared tokens this node accepts."""
        given = hashlib.sha256(header.encode()).digest()
        ok = False
        for d in self.auth_digests:  # every one compared: the time taken says nothing about which matched
            ok |= hmac.compare_digest(given, d)
        return ok

    def _own_token(self, request: web.Request, header: str) -> bool:
        """The credential this node presents, from this machine: a local command (``sparrowd leave``)
        on a box whose token file holds a credential rather than the shared token."""
        if not self.token.startswith(CREDENTIAL_PREFIX) or not _loopback(request):
            return False
        return hmac.compare_digest(hashlib.sha256(header.encode()).digest(),
                                   hashlib.sha256(bearer(self.token).encode()).digest())

    def local_token_ok(self, token: str) -> bool:
        """The engine socket: a shared token, or the credential this node itself presents."""
        own = hmac.compare_digest(hashlib.sha256(token.encode()).digest(),
                                  hashlib.sha256(self.token.encode()).digest())
        return self.token_ok(bearer(token)) or own

    def credential(self, header: str) -> Credential | None:
        """The claims of a valid, unrevoked, unexpired credential in an Authorization header, else None."""
        self._credential_refused = None
        text = header[7:] if header.startswith("Bearer ") else ""
        if not text.startswith(CREDENTIAL_PREFIX):
            return None
        trainer = (self.swarm.signer.public if self.swarm and self.swarm.signer else
                   self.swarm.verifier.public if self.swarm and self.swarm.verifier else None)
        if trainer is None:  # no trainer key pinned yet: nothing can be checked
            return None
        if text not in self._credentials_seen:
            if len(self._credentials_seen) > 4096:
                self._credentials_seen.clear()
            try:
                self._credentials_seen[text] = Credential.parse(text, trainer)
            except (FormatError, Refused):
                self._credentials_seen[text] = None
        c = self._credentials_seen[text]
        if c is None:
            return None
        now = time.time()
        revoked = (self.tracker.credentials if self.tracker is not None else
                   self.membership.state.revoked if self.membership is not None else ())
        try:
            c.check(now, revoked)
        except Refused as e:
            self._credential_refused = e
            return None
        return c

    def member(self, node_id: str) -> dict | None:
        """A member's tracker entry (with its key): the trainer reads its table, a node what it heard."""
        if self.tracker is not None:
            n = self.tracker.table.get(node_id, time.time())
            return self.tracker.entry(n) if n is not None else None
        return self.membership.member(node_id) if self.membership is not None else None

    def _fatal(self, e: Exception) -> None:
        event(log, logging.ERROR, "stopping", reason=str(e))
        self.exit_code = EXIT_REFUSED if isinstance(e, Unauthorized) else 1
        self.stopping.set()

    def outgoing(self) -> aiohttp.TCPConnector:
        """The daemon's pool of outgoing connections (``connector``), made on first use."""
        if self.connector is None:
            self.connector = outgoing(self.source_address)
        return self.connector

    async def stop(self) -> None:
        sdnotify.notify("STOPPING=1", self.env)
        if self.membership is not None and self.exit_code == 0:
            await self.membership.leave()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.engines is not None:
            await self.engines.stop()
        if self.swarm is not None:
            await self.swarm.stop()
        if self._client is not None:
            await self._client.close()
        if self.connector is not None:
            await self.connector.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
        if self._store is not None:
            self._store.close()
        if self._wrote_runtime:
            (self.data_dir / RUNTIME_FILE).unlink(missing_ok=True)  # before the lock goes: it is ours
        if self._lock_fd is not None:
            os.close(self._lock_fd)
        if self._wrote_runtime:  # started fully; a failed start just reports its error
            event(log, logging.INFO, "daemon stopped", node_id=self.node_id, exit_code=self.exit_code)

    async def _sweeper(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_EVERY)
            for node in self.tracker.sweep():
                self.swarm.forget(node.node_id)
            if self._store is not None:
                self._store.flush()  # the second's renewals, in one transaction

    async def _watchdog(self, interval: float) -> None:
        while True:
            sdnotify.notify("WATCHDOG=1", self.env)
            await asyncio.sleep(interval)

    # ------------------------------------------------------------ HTTP

    @web.middleware
    async def _auth_middleware(self, request: web.Request, handler):
        header = request.headers.get("Authorization", "")
        request["credential"] = None
        if request.path.startswith("/v1/swarm/"):
            # Between peers, a member proves who it is with its lease's ticket and its key, never with
            # a join secret; checked from the headers, before any of the body is read.
            admitted = self.swarm.admit(request)
            if isinstance(admitted, web.Response):
                if admitted.status == 401:
                    self.metrics.unauthorized += 1
                return admitted
            request["peer"] = admitted
        elif self.token_ok(header) or self._own_token(request, header):
            pass  # an operator (or a member, with the shared token)
        elif header.startswith("Bearer " + CREDENTIAL_PREFIX) and \
                (credential := self.credential(header)) is not None:
            request["credential"] = credential
        elif header.startswith("Bearer " + CREDENTIAL_PREFIX) and self._credential_refused is not None:
            # This swarm's credential, revoked or expired: its holder is told so, and stops.
            e, self._credential_refused = self._credential_refused, None
            self.metrics.unauthorized += 1
            return web.json_response({"error": str(e), "reason": e.reason}, status=401)
        else:
            self.metrics.unauthorized += 1
            peer = request.remote or "?"
            if self._unauthorized_log.due(peer, time.monotonic()):
                event(log, logging.WARNING, "refused a request without the swarm token", remote=peer,
                      method=request.method, path=request.path[:100])
            return web.json_response({"error": "unauthorized"}, status=401)
        self._runner.authorise(request)
        # Requests in flight per peer (its address and node id) and per address: a flood from one
        # peer gets 429s and leaves the others their share of the event loop.
        addr = request.remote or "?"
        peer = (addr, request.headers.get(NODE_HEADER, "")[:64])
        if self._inflight[peer] >= MAX_INFLIGHT_PER_PEER or self._inflight[addr] >= MAX_INFLIGHT_PER_ADDRESS:
            self.metrics.requests[(_route(request), 429)] += 1
            if self._flood_log.due(addr, time.monotonic()):
                event(log, logging.WARNING, "refused requests over the in-flight limit", remote=addr,
                      node=peer[1] or "?", path=request.path[:100])
            return web.json_response({"error": "too many requests in flight from this peer"}, status=429)
        self._inflight[peer] += 1
        self._inflight[addr] += 1
        try:
            response = await handler(request)
        except web.HTTPException as e:
            self.metrics.requests[(_route(request), e.status)] += 1
            raise
        except RecursionError:  # a body nested deeper than any message of the protocol
            response = web.json_response({"error": "message nested too deeply"}, status=400)
        finally:
            for k in (peer, addr):
                self._inflight[k] -= 1
                if not self._inflight[k]:
                    del self._inflight[k]
        self.metrics.requests[(_route(request), response.status)] += 1
        return response

    def _tracker_call(self, name: str):
        method = getattr(self.tracker, name)

        async def handler(request: web.Request) -> web.Response:
            if request.content_type != MSGPACK:
                return web.json_response({"error": f"body must be {MSGPACK}"}, status=415)
            if (request.content_length or 0) > MAX_TRACKER_MESSAGE:
                return _too_large(request.content_length)
            body = await read_limited(request.content, MAX_TRACKER_MESSAGE)
            if body is None:  # no or a false Content-Length
                return _too_large(MAX_TRACKER_MESSAGE + 1)
            try:
                reply = method(unpack(body, what=name, max_len=MAX_TRACKER_MESSAGE),
                               credential=request["credential"])
            except Refused as e:
                return web.json_response({"error": str(e), "reason": e.reason}, status=403)
            except LeaseGone as e:
                return web.json_response({"error": str(e)}, status=410)
            except SessionUnknown as e:
                return web.json_response({"error": str(e), "boot": e.boot.hex() if e.boot else None}, status=409)
            except (FormatError, InputError) as e:
                return web.json_response({"error": str(e)}, status=400)
            return web.Response(body=pack(reply), content_type=MSGPACK)

        return handler

    @staticmethod
    def _local_only(request: web.Request) -> web.Response | None:
        """Publishing and credentials need the shared token (not a join credential) and a connection
        from this machine: a stolen token is not enough."""
        if request.get("credential") is not None:
            event(log, logging.WARNING, "refused an operator request made with a join credential",
                  remote=request.remote or "?", credential=request["credential"].id, path=request.path[:100])
            return web.json_response({"error": "a join credential cannot publish or manage credentials"},
                                     status=403)
        if _loopback(request):
            return None
        event(log, logging.WARNING, "refused a publish from another machine", remote=request.remote or "?")
        return web.json_response({"error": "publishing is only accepted from the trainer's own machine"}, status=403)

    async def _publish_chunk(self, request: web.Request) -> web.Response:
        if (refused := self._local_only(request)) is not None:
            return refused
        try:
            key, index = Key.parse(request.match_info["key"]), int(request.match_info["index"])
        except ValueError:
            return web.json_response({"error": "key must be a version (12) or an anchor (a12), index an integer"},
                                     status=400)
        if (request.content_length or 0) > MAX_CHUNK:
            return web.json_response({"error": f"a chunk is at most {MAX_CHUNK} bytes"}, status=413)
        data = await read_limited(request.content, MAX_CHUNK)
        if data is None or index < 0:
            return web.json_response({"error": "bad chunk"}, status=400)
        try:
            return web.json_response(await self.swarm.publish_chunk(key, index, data))
        except SparrowError as e:
            return web.json_response({"error": str(e)}, status=409 if isinstance(e, IntegrityError) else 400)

    async def _publish_manifest(self, request: web.Request) -> web.Response:
        if (refused := self._local_only(request)) is not None:
            return refused
        data = await read_limited(request.content, MAX_MANIFEST)
        if data is None:
            return web.json_response({"error": "manifest too large"}, status=413)
        try:
            return web.json_response(await self.swarm.publish_manifest(data))
        except SparrowError as e:
            return web.json_response({"error": str(e)}, status=400)

    async def _publish_state(self, request: web.Request) -> web.Response:
        if (refused := self._local_only(request)) is not None:
            return refused
        return web.json_response(self.swarm.published())

    def _tracker_touched(self) -> None:
        self._tracker_event.set()
        self._tracker_event = asyncio.Event()

    async def _tracker_wait(self, request: web.Request) -> web.Response:
        """Long poll: until version V is held by (or, ``applied=1``, applied on) every live node that
        counts (``swarm.waits``), or ``timeout`` seconds (at most MAX_WAIT); the answer says which."""
        q = request.query
        try:
            version = int(q["version"])
            timeout = float(q.get("timeout", "30"))
            fraction = float(q["fraction"]) if "fraction" in q else None
            if not math.isfinite(timeout) or (fraction is not None and not math.isfinite(fraction)):
                raise ValueError  # NaN and infinity are no durations
            timeout = min(timeout, MAX_WAIT)
            names = [n for n in q["nodes"].split(",") if n] if q.get("nodes") else None
            flags = {k: q.get(k, "0") in ("1", "true") for k in ("applied", "engines")}
            if version < 0 or timeout < 0 or (fraction is not None and not 0 < fraction <= 1) or (
                    names is not None and (len(names) > 10_000 or any(len(n) > 64 for n in names))):
                raise ValueError
        except (KeyError, ValueError):
            return web.json_response({"error": "give version=N, and optionally timeout=SECONDS, applied=1, "
                                               "engines=1, nodes=ID,ID, fraction=F (0 < F <= 1)"}, status=400)
        deadline = time.monotonic() + timeout
        while True:
            changed = self._tracker_event
            a = arrival(self.tracker.status()["nodes"], version, names=names, fraction=fraction, **flags)
            left = deadline - time.monotonic()
            if a.done or left <= 0 or self.stopping.is_set():
                return web.json_response(a.to_json())
            try:  # a renewal wakes it; a lease going stale is seen within a second
                async with asyncio.timeout(min(left, 1.0)):
                    await changed.wait()
                # Coalesce: a large swarm renews thousands of times a second, and each look
                # builds the whole snapshot.
                await asyncio.sleep(min(WAIT_COALESCE, max(0.0, deadline - time.monotonic())))
            except TimeoutError:
                pass

    async def _credential_create(self, request: web.Request) -> web.Response:
        if (refused := self._local_only(request)) is not None:
            return refused
        try:
            body = json.loads(await read_limited(request.content, MAX_BODY) or b"null")
            if not isinstance(body, dict):
                raise ValueError
            expires = body.get("expires")
            lifetime = None if expires in (None, "never") else parse_duration(str(expires))
            record, text = self.tracker.issue(role=str(body.get("role") or "rollout"), region=body.get("region"),
                                              node=body.get("node"), lifetime=lifetime)
        except (ValueError, TypeError, RecursionError):
            return web.json_response({"error": "give a JSON map: role, region, node, expires (30d, 12h, never)"},
                                     status=400)
        except InputError as e:
            return web.json_response({"error": str(e)}, status=400)
        return web.json_response({**record, "credential": text})

    async def _credential_list(self, request: web.Request) -> web.Response:
        if (refused := self._local_only(request)) is not None:
            return refused
        return web.json_response({"credentials": self.tracker.credential_list()})

    async def _credential_revoke(self, request: web.Request) -> web.Response:
        if (refused := self._local_only(request)) is not None:
            return refused
        try:
            record, node = self.tracker.revoke(request.match_info["id"][:64])
        except Refused as e:
            return web.json_response({"error": str(e)}, status=404)
        if node is not None:
            self.swarm.forget(node.node_id)
        return web.json_response({**record, "node_id": node.node_id if node else None})

    async def _tracker_status(self, request: web.Request) -> web.Response:
        return web.json_response(self.tracker.status())

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _node_info(self, request: web.Request) -> web.Response:
        m, u = self.membership, self.unproducible()
        return web.json_response({
            "node_id": self.node_id, "role": self.settings.role, "region": self.settings.region,
            "address": self.address, "tracker": self.settings.tracker or self.url, "pid": os.getpid(),
            "epoch": m.state.epoch if m else None, "lease_expires_in": m.lease_left() if m else None,
            "tracker_reachable": bool(m and m.state.tracker_reachable),
            "peers": [{**p, "key": p["key"].hex()} if isinstance(p.get("key"), bytes) else p
                      for p in (m.state.peers if m else [])],
            "key_id": self.key.id if self.key else None,
            "versions": self.versions_held(), "held_at": self.swarm.held_at() if self.swarm else {},
            "error": (self.swarm.error if self.swarm else None) or (u and u.reason),
            "unproducible": u._asdict() if u else None,
            "current": self.keeper.info() if self.keeper else None,
        })

    async def _node_leave(self, request: web.Request) -> web.Response:
        if (refused := self._local_only(request)) is not None:  # a member cannot stop another
            return refused
        event(log, logging.INFO, "asked to leave the swarm", remote=request.remote or "?")
        asyncio.get_running_loop().call_soon(self.stopping.set)
        return web.json_response({"leaving": True}, status=202)


def _loopback(request: web.Request) -> bool:
    try:
        return ipaddress.ip_address((request.remote or "").split("%")[0]).is_loopback
    except ValueError:
        return False


def _too_large(size: int) -> web.Response:
    return web.json_response({"error": f"message of {size} bytes exceeds the limit of {MAX_TRACKER_MESSAGE}"},
                             status=413)


async def _serve(settings: Settings) -> int:
    daemon = Daemon(settings)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.stopping.set)
    loop.add_signal_handler(signal.SIGHUP, daemon.reload)
    try:
        await daemon.start()
    except BaseException:
        await daemon.stop()
        raise
    await daemon.stopping.wait()
    event(log, logging.INFO, "shutting down", node_id=daemon.node_id)
    await daemon.stop()
    return daemon.exit_code


OPEN_FILES = 65536  # the soft limit on open files a daemon lifts itself to, as the systemd unit sets it


def _lift_open_files() -> None:
    """Lift the soft limit on open files to ``OPEN_FILES`` where the hard limit allows: a node holds two
    connections to each peer (its long poll and a spare), and the trainer is every rollout's peer, so a
    daemon started from a shell with the usual 1,024 runs out at a few hundred rollouts."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on this platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def run_daemon(settings: Settings) -> int:
    """Run until told to stop; the exit status (0 after a clean shutdown)."""
    _lift_open_files()
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a core dependency on Linux
        return asyncio.run(_serve(settings))
    return uvloop.run(_serve(settings))
