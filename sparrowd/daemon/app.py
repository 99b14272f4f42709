"""The daemon: one per node. HTTP on aiohttp; the trainer's also hosts the tracker.

Lifecycle: lock the data dir, read the token, open the lease database (trainer),
bind the listener, write ``daemon.json`` (how local commands find the daemon),
tell systemd READY=1, then keep the lease until SIGTERM/SIGINT or a local
``sparrowd leave``; on the way out leave the swarm, flush and close the lease
database, remove ``daemon.json`` and exit 0.

This module is the wiring: it builds the node's parts in order and hands each
what it uses (the swarm driver, the engine socket ``engine``, the current
folder ``folder``, the vLLM follower ``follow``, the tracker and membership),
and starts and stops them. Who may ask what is ``auth`` (tokens, credentials,
the gate in front of every route); the routes are ``routes``; what the node
says about itself (renewal reports, ``/v1/node``) is ``nodeview``.
Connections that do not authenticate are shed (``connections``). SIGHUP
re-reads the token file (rotation without a restart).

Imports every other module of ``daemon/`` it wires, and the pure core; no
module of ``daemon/`` imports this one.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
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
from ..errors import InputError, IntegrityError, SparrowError
from ..swarm.chain import Unproducible
from ..swarm.identity import CredentialBook, Identities, NodeKey, default_node_id
from ..swarm.leases import LeaseTable, check_name
from ..swarm.signing import Verifier, load_or_create_key, pin_public_key
from . import sdnotify
from .auth import Credentials, Gate, Tokens
from .connections import GuardedRunner
from .engine import EngineServer
from .folder import FolderKeeper
from .follow import VllmFollower
from .leasedb import SqliteLeaseStore
from .logs import event
from .membership import SERVER_KEEPALIVE, HttpTrackerClient, LocalTrackerClient, Membership, Unauthorized, outgoing
from .metrics import DaemonMetrics
from .nodeview import node_info, renewal_report, unproducible, versions_held
from .routes import Routes, TrackerChanges
from .settings import Settings
from .store import ChunkStore
from .swarm import Swarm
from .tracker import TrackerService

__all__ = ["Daemon", "run_daemon", "RUNTIME_FILE", "read_runtime"]

log = logging.getLogger("sparrowd.daemon")

RUNTIME_FILE = "daemon.json"
EXIT_REFUSED = 78  # the tracker refused this node for good (revoked, expired, a wrong token): systemd does not restart
SHUTDOWN_GRACE = 3.0  # seconds in-flight requests get to finish when the daemon stops
SWEEP_EVERY = 1.0


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
    """One node: builds its parts in ``start`` and hands each what it uses; the swarm driver and the
    metrics read the node's state from here (``report_changed``, ``count_bytes``, ``member``,
    ``outgoing``, ``membership``, ``tracker``)."""

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
        self.source_address: str | None = None
        # Outgoing connections, one pool for the tracker client and the swarm: the trainer's swarm
        # address is its tracker's, so a node's first exchange with it goes over the connection its
        # join opened and pays no second handshake.
        self.connector: aiohttp.TCPConnector | None = None
        self.metrics = DaemonMetrics(self)
        self.tokens = Tokens(settings.token_file)
        self.stopping = asyncio.Event()
        self.exit_code = 0
        self._store: SqliteLeaseStore | None = None
        self._runner: GuardedRunner | None = None
        self._metrics_runner: web.AppRunner | None = None
        self._client: LocalTrackerClient | HttpTrackerClient | None = None
        self._tasks: list[asyncio.Task] = []
        self._lock_fd: int | None = None
        self._wrote_runtime = False
        self.key: NodeKey | None = None
        self.engines: EngineServer | None = None
        self._tracker_changes = TrackerChanges()

    # ------------------------------------------------------------ state other parts read

    @property
    def token(self) -> str:
        """What this node presents (the first line of its token file)."""
        return self.tokens.token

    def versions_held(self) -> list[int]:
        return versions_held(self)

    def unproducible(self, target: int | None = None) -> Unproducible | None:
        """Why a version this rollout holds whole cannot be made here (``nodeview.unproducible``)."""
        return unproducible(self.swarm, self.keeper, self.data_dir, rollout=self.settings.role == "rollout",
                            target=target)

    def count_bytes(self, direction: str, n: int, wan: bool) -> None:
        self.metrics.bytes[(direction, "other" if wan else "same")] += n

    def _joined(self) -> None:
        """A node joined the trainer's swarm: its long polls answer with the news, and its own row
        counts the new peer at once."""
        assert self.swarm is not None  # the tracker, which calls this, is made after the swarm
        self.swarm.wake()
        self.report_changed()

    def report_changed(self) -> None:
        """What renewals report changed; the tracker hears it at once rather than at the next renewal."""
        if self.membership is not None:
            self.membership.nudge()

    def report(self) -> dict:
        return renewal_report(self)

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
            assert signer is not None  # loaded above for the trainer
            self.swarm.load()
            self._store = SqliteLeaseStore(self.data_dir / "tracker.db")
            table = LeaseTable(s.lease_ttl, now=time.time(), store=self._store)
            self.tracker = TrackerService(table, tracker_id=self.node_id, peer_limit=s.peer_limit,
                                          trainer_key=signer.public, identities=Identities(self._store),
                                          credentials=CredentialBook(self._store), sign=signer.sign_bytes)
            self.tracker.on_change = self._tracker_changes.touch
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

        routes = Routes(self.swarm, self.metrics, tracker=self.tracker, changes=self._tracker_changes,
                        node_info=lambda: node_info(self), stopping=self.stopping)
        credentials = Credentials(self._trainer_key, self._revoked)
        gate = Gate(self.tokens, credentials, self.swarm.admit, self.metrics)
        app = routes.app(gate)
        # Long polls are answered at once when stopping; what still runs after SHUTDOWN_GRACE
        # (a chunk upload to a slow peer) is cut, so a stop never waits on the network for long.
        self._runner = GuardedRunner(app, access_log=None, handle_signals=False, shutdown_timeout=SHUTDOWN_GRACE,
                                     keepalive_timeout=SERVER_KEEPALIVE)
        gate.authorise = self._runner.authorise
        await self._runner.setup()
        host, port = s.listen
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        try:
            await site.start()
        except OSError as e:
            raise InputError(f"cannot listen on {host}:{port}: {os.strerror(e.errno) if e.errno else e}") from None
        bound_port = self._runner.addresses[0][1]
        metrics_url = await self._start_metrics_listener(routes) if s.metrics_listen else None

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
            assert s.tracker is not None  # settings require --tracker of every node but the trainer
            self._client = HttpTrackerClient(s.tracker, self.token, timeout=min(5.0, s.lease_ttl / 3),
                                             connector=self.outgoing())
        assert self.key is not None  # _prepare_data_dir loaded it
        self.membership = Membership(self._client, me, self.key, report=self.report, on_fatal=self._fatal,
                                     on_lease=self._on_lease)
        if self.swarm.verifier is not None:
            self.swarm.start()
        if s.keeps_current:
            self.keeper = FolderKeeper(self.swarm, self.data_dir, base=s.base, base_version=s.base_version,
                                       on_change=self.report_changed)
        if s.engine_socket != "off":
            self.engines = EngineServer(engine_socket_path(s, self.env), self.swarm, data_dir=self.data_dir,
                                        node_id=self.node_id, token_ok=self.tokens.local_ok, keeper=self.keeper,
                                        unproducible=self.unproducible, on_change=self.report_changed)
            try:
                await self.engines.start()
            except SparrowError as e:
                raise InputError(str(e)) from None
        self._tasks.append(asyncio.create_task(self.membership.run(), name="membership"))
        if self.keeper is not None:
            self._tasks.append(asyncio.create_task(self.keeper.run(), name="current-folder"))
        if s.follow_vllm:
            assert self.engines is not None  # settings refuse --follow-vllm with --engine-socket off
            self.follower = VllmFollower(s.follow_vllm, self.engines, self.swarm, token_file=s.token_file,
                                         every=s.follow_every)
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

    async def _start_metrics_listener(self, routes: Routes) -> str:
        """``/metrics`` alone on its own address, with no token: a scraper holds no join secret. Its
        address is the operator's choice (loopback, or a monitoring network); nothing else is served there."""
        self._metrics_runner = GuardedRunner(routes.metrics_app(), access_log=None, handle_signals=False,
                                             shutdown_timeout=1.0)
        await self._metrics_runner.setup()
        assert self.settings.metrics_listen is not None  # called only when it is set
        host, port = self.settings.metrics_listen
        try:
            await web.TCPSite(self._metrics_runner, host, port, reuse_address=True).start()
        except OSError as e:
            raise InputError(f"cannot listen for metrics on {host}:{port}: "
                             f"{os.strerror(e.errno) if e.errno else e}") from None
        bound = self._metrics_runner.addresses[0][1]
        return f"http://[{host}]:{bound}/metrics" if ":" in host else f"http://{host}:{bound}/metrics"

    def load_tokens(self) -> None:
        """(Re-)read the token file (``auth.Tokens``); the tracker client presents the new first line."""
        self.tokens.load()
        if isinstance(self._client, HttpTrackerClient):
            self._client.set_token(self.token)

    def reload(self) -> None:
        """SIGHUP: re-read the token file; a bad file keeps the tokens in use (and says so)."""
        try:
            self.load_tokens()
        except SparrowError as e:
            event(log, logging.ERROR, "reload failed; keeping the tokens in use", reason=str(e))
            return
        event(log, logging.INFO, "token file reloaded", tokens=self.tokens.accepted())

    def _trainer_key(self) -> bytes | None:
        """The trainer's public key: the trainer's own, else the one pinned at the first lease."""
        sw = self.swarm
        return (sw.signer.public if sw and sw.signer else sw.verifier.public if sw and sw.verifier else None)

    def _revoked(self):
        """The credentials revoked: the tracker's book on the trainer, else what the tracker last said."""
        return (self.tracker.credentials if self.tracker is not None else
                self.membership.state.revoked if self.membership is not None else ())

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
        assert self.tracker is not None and self.swarm is not None  # started only on the trainer, after both
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
