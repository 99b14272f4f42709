"""The engine socket: the co-located inference engine's way to the patches this node holds.

A Unix stream socket (``--engine-socket``, default ``DATA/engine.sock``, mode
0660). The engine says hello (its id, rank, the version it holds and the
swarm token), long-polls for what is ready, fetches each version decoded and
acknowledges what it applied; see docs/ENGINE_SOCKET.md. What to hand out is
``chain.engine_plan`` (pure): the patches after the engine's version, in
order, or the anchor to load instead when that chain is broken.

Decoding happens here, ahead of the engine's request and off its critical
path: as soon as a version an engine will need is complete, a worker thread
decodes it into a memfd in the decoded safetensors layout
(``sparrowd.decoded``), seals it, and the fetch reply passes the descriptor
(SCM_RIGHTS): the engine maps the same pages, nothing is copied through the
socket. At most ``AHEAD`` objects per engine are kept decoded.

``EngineServer`` gets the swarm driver, the node's current folder and a few
callables (``app`` wires them), never the daemon. Imports the pure core,
``decoded``, ``enginewire`` and the daemon's ``folder`` and ``logs``.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import socket
import stat
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..codec.chunk import ULP2
from ..codec.workers import cpu_threads
from ..decoded import decode_patch, read_decoded, write_decoded
from ..enginewire import frame, length, parse, state_fingerprint
from ..errors import FormatError, InputError, SparrowError
from ..swarm.chain import Key, Obj, Unproducible, engine_plan
from .folder import FolderKeeper, decoded_path
from .logs import event

__all__ = ["EngineServer"]

log = logging.getLogger("sparrowd.engine")

AHEAD = 2  # objects decoded ahead per engine
MAX_CONNECTIONS = 16  # engines (ranks) attached on one box; more is a misbehaving client
HELLO_TIMEOUT = 5.0  # seconds a new connection has to say hello; then it is closed
MAX_UNGREETED = 64  # connections yet to say hello; one more closes the oldest of them
MAX_WAIT = 30.0
_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


@dataclass
class Engine:
    engine: str
    rank: int
    version: int
    since: float
    fingerprint: str | None = None


class EngineServer:
    """The engine socket at ``path``, serving what ``swarm`` holds. ``keeper`` is the node's current
    folder (None without ``--current``): it decodes ulp2 patches and takes the model folder an engine
    loaded as its base. ``token_ok`` checks a hello's token, ``unproducible(version)`` says why a
    version cannot be made here (None when it can), and ``on_change`` tells the node that what its
    renewals report changed (the engines' versions)."""

    def __init__(self, path: Path, swarm, *, data_dir: Path, node_id: str, token_ok: Callable[[str], bool],
                 keeper: FolderKeeper | None = None,
                 unproducible: Callable[[int], Unproducible | None] = lambda version: None,
                 on_change: Callable[[], None] = lambda: None):
        self.path = Path(path)
        self.swarm = swarm
        self.data_dir = data_dir
        self.node_id = node_id
        self.keeper = keeper
        self._token_ok = token_ok
        self._unproducible = unproducible
        self._on_change = on_change
        self.engines: dict[tuple[str, int], Engine] = {}
        self._decoded: dict[Key, asyncio.Task] = {}  # -> (memfd, size)
        # Chunks decode on threads of their own: a decode stands between a version's arrival and
        # the engine's update, and a large step's changes take seconds on one core.
        self._pool = ThreadPoolExecutor(cpu_threads(), thread_name_prefix="sparrowd-decode")
        self._sock: socket.socket | None = None
        self._tasks: set[asyncio.Task] = set()
        self._ungreeted: dict[socket.socket, asyncio.Task] = {}  # oldest first
        self._attached = 0  # connections past their hello

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._remove_stale()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(str(self.path))
        except OSError as e:
            s.close()
            raise SparrowError(f"engine socket {self.path}: {e.strerror or e} (give --engine-socket a shorter "
                               f"path, or 'off')") from None
        os.chmod(self.path, 0o660)
        s.listen(16)
        s.setblocking(False)
        self._sock = s
        self._spawn(self._accept_loop(), "engine-accept")
        self._spawn(self._watch(), "engine-prefetch")
        event(log, logging.INFO, "engine socket listening", path=str(self.path))

    def _remove_stale(self) -> None:
        """A socket file left by a daemon that died is removed; a live one, or anything at the path
        that is not a socket, is an error."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise InputError(f"engine socket {self.path} exists and is not a socket; remove it or choose "
                             "another path")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(self.path))
        except OSError:
            self.path.unlink(missing_ok=True)
            return
        finally:
            probe.close()
        raise SparrowError(f"engine socket {self.path}: another daemon is serving it")

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
            self.path.unlink(missing_ok=True)
        for key in list(self._decoded):
            self._forget(key)
        self._pool.shutdown(wait=False)  # a decode under way finishes on its own

    def _spawn(self, coro, name: str) -> asyncio.Task:
        t = asyncio.create_task(coro, name=name)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def _accept_loop(self) -> None:
        """Serve each connection. Until its hello it counts only among the ``MAX_UNGREETED`` newest,
        for ``HELLO_TIMEOUT`` at most: silent connections cannot keep an engine out."""
        loop = asyncio.get_running_loop()
        sock = self._sock
        assert sock is not None  # (start binds it before it starts this loop)
        while True:
            conn, _ = await loop.sock_accept(sock)
            conn.setblocking(False)
            if len(self._ungreeted) >= MAX_UNGREETED:
                self._ungreeted.pop(next(iter(self._ungreeted))).cancel()
            t = self._spawn(self._serve(conn), "engine-conn")

            def close(_: asyncio.Task, c: socket.socket = conn) -> None:
                c.close()  # closed even if cancelled before it ran

            t.add_done_callback(close)
            self._ungreeted[conn] = t
            await asyncio.sleep(0)  # it reads a hello already sent before the next accept may close it

    async def _watch(self) -> None:
        """Decode ahead as versions complete."""
        while True:
            gen = self.swarm.gen
            await self.swarm.changed(gen, 5.0)
            if self.engines:
                self._prefetch()

    # ------------------------------------------------------------ what the node reports

    def floor(self) -> int | None:
        return min((e.version for e in self.engines.values()), default=None)

    def _changed_engines(self) -> None:
        self.swarm.engine_floor = self.floor()
        self._on_change()
        self._prefetch()

    # ------------------------------------------------------------ one connection

    async def _recv(self, conn: socket.socket) -> dict | None:
        loop = asyncio.get_running_loop()
        head = await self._exactly(loop, conn, 4)
        if head is None:
            return None
        body = await self._exactly(loop, conn, length(head))
        if body is None:
            return None
        return parse(body, request=True)

    @staticmethod
    async def _exactly(loop, conn: socket.socket, n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            part = await loop.sock_recv(conn, n - len(buf))
            if not part:
                return None
            buf += part
        return bytes(buf)

    @staticmethod
    async def _send(conn: socket.socket, msg: dict, fd: int | None = None) -> None:
        data = frame(msg)
        if fd is not None:
            while True:  # the descriptor rides on the first bytes sent
                try:
                    sent = socket.send_fds(conn, [data], [fd])
                    break
                except BlockingIOError:
                    await asyncio.sleep(0.005)
            data = data[sent:]
        if data:
            await asyncio.get_running_loop().sock_sendall(conn, data)

    async def _serve(self, conn: socket.socket) -> None:
        me: Engine | None = None
        counted = False  # among the MAX_CONNECTIONS
        try:
            while True:
                try:
                    msg = await (self._recv(conn) if me is not None else self._first(conn))
                except (FormatError, SparrowError) as e:
                    await self._send(conn, {"op": "error", "error": str(e)})
                    return
                if msg is None:
                    return
                if me is None:
                    if self._attached >= MAX_CONNECTIONS:
                        await self._send(conn, {"op": "error",
                                                "error": f"more than {MAX_CONNECTIONS} engine connections"})
                        return
                    self._attached += 1
                    counted = True
                    me = await self._hello(conn, msg)
                    if me is None:
                        return
                    continue
                op = msg["op"]
                if op == "ready":
                    wait = min(float(msg["wait"] or 0), MAX_WAIT)
                    await self._send(conn, await self._ready(me, wait, msg.get("until")))
                elif op == "fetch":
                    await self._fetch(conn, me, Key(msg["version"], bool(msg.get("anchor"))))
                elif op == "applied":
                    await self._send(conn, self._applied(me, msg))
                else:
                    await self._send(conn, {"op": "error", "error": f"{op} is only allowed as the first message"})
        except (ConnectionError, OSError) as e:
            event(log, logging.DEBUG, "engine connection ended", reason=str(e))
        finally:
            conn.close()
            if counted:
                self._attached -= 1
            if me is not None and self.engines.get((me.engine, me.rank)) is me:
                del self.engines[(me.engine, me.rank)]
                event(log, logging.INFO, "engine detached", engine=me.engine, rank=me.rank, version=me.version)
                self._changed_engines()

    async def _first(self, conn: socket.socket) -> dict | None:
        """A new connection's first message, which must come within ``HELLO_TIMEOUT``."""
        try:
            return await asyncio.wait_for(self._recv(conn), HELLO_TIMEOUT)
        except TimeoutError:
            event(log, logging.DEBUG, "engine connection closed: no hello", seconds=HELLO_TIMEOUT)
            raise SparrowError(f"no hello within {HELLO_TIMEOUT:g} s") from None
        finally:
            self._ungreeted.pop(conn, None)

    async def _hello(self, conn: socket.socket, msg: dict) -> Engine | None:
        if msg["op"] != "hello":
            await self._send(conn, {"op": "error", "error": "say hello first"})
            return None
        if not self._token_ok(msg["token"]):
            event(log, logging.WARNING, "engine refused: wrong swarm token", engine=msg["engine"][:64])
            await self._send(conn, {"op": "error", "error": "wrong swarm token"})
            return None
        if msg.get("model") and self.keeper is not None:  # the folder it loaded: a base for an empty node
            self.keeper.offer_base(Path(msg["model"][:4096]), by=msg["engine"][:64])
        me = Engine(msg["engine"][:64], msg["rank"], msg["version"], time.monotonic())
        self.engines[(me.engine, me.rank)] = me
        event(log, logging.INFO, "engine attached", engine=me.engine, rank=me.rank, version=me.version)
        self._changed_engines()
        await self._send(conn, {"op": "welcome", "node": self.node_id, "position": self.swarm.position()})
        return me

    # ------------------------------------------------------------ requests

    def plan(self, version: int) -> tuple[int | None, list[int]]:
        return engine_plan(version, {k: self._usable(vs) for k, vs in self.swarm.versions.items()})

    def _usable(self, vs) -> Obj:
        """An ulp2 patch is coded against its base: it is there for engines once the node's current
        folder, which holds that base, has decoded it (sparrowd.daemon.folder)."""
        obj = vs.obj
        if obj.complete and vs.manifest.values == ULP2 and self.keeper is not None:
            return Obj(obj.base, decoded_path(self.data_dir, vs.version).exists())
        return obj

    async def _ready(self, me: Engine, wait: float, until: int | None = None) -> dict:
        """What the engine loads next; waits up to ``wait`` s for something, or, given ``until``,
        for a chain that reaches that version."""
        deadline = time.monotonic() + wait
        while True:
            gen = self.swarm.gen
            if until is not None and (u := self._unproducible(until)) is not None:
                return {"op": "error", "error": u.reason}  # held, and never to be made here: say so now
            anchor, patches = self.plan(me.version)
            left = deadline - time.monotonic()
            end = patches[-1] if patches else anchor
            if (end is not None and (until is None or end >= until)) or left <= 0:
                return {"op": "ready", "version": me.version, "patches": patches, "anchor": anchor}
            await self.swarm.changed(gen, left)

    async def _fetch(self, conn: socket.socket, me: Engine, key: Key) -> None:
        vs = self.swarm.versions.get(key)
        if vs is None or not vs.complete:
            await self._send(conn, {"op": "error", "error": f"{key} is not held whole here"})
            return
        anchor, patches = self.plan(me.version)
        # A patch on the engine's version, or later on the chain it was told to load (an engine
        # that applies several versions as one transaction acknowledges them at the end).
        if not key.anchor and vs.base_version != me.version and key.version not in patches:
            await self._send(conn, {"op": "error", "anchor": anchor,
                                    "error": f"version {key.version} applies to {vs.base_version}, but the engine "
                                             f"holds {me.version}" + (f"; load anchor {anchor}" if anchor is not None
                                                                      else "")})
            return
        try:
            fd, size = await self.decode(key)
            fd = os.dup(fd)  # ours for the send: prefetching may drop the cached one meanwhile
        except (SparrowError, OSError) as e:
            await self._send(conn, {"op": "error", "error": f"{key}: {e}"})
            return
        try:
            await self._send(conn, {"op": "decoded", "version": key.version, "anchor": key.anchor,
                                    "base_version": vs.base_version, "bytes": size}, fd=fd)
        finally:
            os.close(fd)

    def _applied(self, me: Engine, msg: dict) -> dict:
        v, key = msg["version"], Key(msg["version"], bool(msg.get("anchor")))
        vs = self.swarm.versions.get(key)
        if vs is None or vs.manifest is None:
            return {"op": "error", "error": f"{key} is not held here"}
        if not key.anchor and vs.base_version != me.version:
            return {"op": "error", "error": f"version {v} applies to {vs.base_version}, not to {me.version}"}
        if msg.get("fingerprint") is not None and msg["fingerprint"] != state_fingerprint(vs.manifest.tensors):
            event(log, logging.ERROR, "engine applied something else", engine=me.engine, object=str(key))
            return {"op": "error", "error": f"{key}: the fingerprint differs from the manifest's"}
        me.version, me.fingerprint = v, msg.get("fingerprint")
        event(log, logging.INFO, "engine applied", engine=me.engine, rank=me.rank, object=str(key))
        self._changed_engines()
        return {"op": "ok", "version": v}

    # ------------------------------------------------------------ decoding ahead

    def _prefetch(self) -> None:
        """Decode what attached engines will fetch next; free what none will."""
        need: set[Key] = set()
        for e in self.engines.values():
            anchor, patches = self.plan(e.version)
            keys = ([Key(anchor, True)] if anchor is not None else []) + [Key(v) for v in patches]
            need.update(keys[:AHEAD])
        for key in need - set(self._decoded):
            self._decoded[key] = self._spawn(asyncio.to_thread(self._decode_now, key), f"decode-{key.tag}")
        for key in set(self._decoded) - need:
            self._forget(key)

    def _forget(self, key: Key) -> None:
        """Close a decoded memfd (now, or when its decode ends); engines that got it keep their own."""
        def close(t: asyncio.Task) -> None:
            if not t.cancelled() and t.exception() is None:
                os.close(t.result()[0])

        t = self._decoded.pop(key)
        if t.done():
            close(t)
        else:
            t.add_done_callback(close)

    async def decode(self, key: Key) -> tuple[int, int]:
        t = self._decoded.get(key)
        if t is None or t.cancelled():
            t = self._decoded[key] = self._spawn(asyncio.to_thread(self._decode_now, key), f"decode-{key.tag}")
        try:
            return await asyncio.shield(t)
        except (OSError, SparrowError) as e:
            self._decoded.pop(key, None)
            raise SparrowError(f"cannot decode: {e}") from None

    def _decoded_by_folder(self, key: Key):
        path = decoded_path(self.data_dir, key.version)
        if self.keeper is None:
            raise SparrowError(f"{key} is an ulp2 patch, coded against its base: this node decodes those in its "
                               f"current folder, which it keeps only with --current on")
        try:
            return read_decoded(path)
        except FileNotFoundError:
            raise SparrowError(f"{key} is an ulp2 patch that this node's current folder has not decoded") from None

    def _decode_now(self, key: Key) -> tuple[int, int]:
        """In a worker thread: the object's chunks, decoded into a sealed memfd."""
        vs = self.swarm.versions[key]
        t0 = time.perf_counter()
        if vs.manifest.values == ULP2:
            d = self._decoded_by_folder(key)
        else:
            chunks = (self.swarm.store.chunk_path(key, i).read_bytes() for i in range(vs.total))
            d = decode_patch(vs.manifest, chunks, pool=self._pool)
        fd = os.memfd_create(f"sparrowd-{key.tag}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            write_decoded(d, f"/proc/self/fd/{fd}")
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            size = os.fstat(fd).st_size
        except BaseException:
            os.close(fd)
            raise
        event(log, logging.INFO, "decoded for the engine", object=str(key), bytes=size,
              seconds=round(time.perf_counter() - t0, 3))
        return fd, size
