"""The daemon's HTTP routes other than the swarm's own: the tracker (the trainer's), publishing and
join credentials (the trainer's, from its own machine only), ``/v1/node``, ``/metrics`` and a local
``leave``. ``Routes.app`` builds the application; the gate in front of it is ``auth.Gate``.

Imports the pure core, the daemon's ``auth``, ``bodies``, ``logs``, ``membership`` (message limits),
``metrics``, ``swarm`` (the chunk limit) and ``tracker``; the parts it serves are passed in.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable

from aiohttp import web

from ..codec.manifest import MAX_MANIFEST
from ..errors import FormatError, InputError, IntegrityError, SparrowError
from ..schema import pack, unpack
from ..swarm.chain import Key
from ..swarm.identity import Refused, SessionUnknown, parse_duration
from ..swarm.leases import LeaseGone
from ..swarm.waits import arrival
from .auth import Gate, loopback
from .bodies import read_limited
from .logs import event
from .membership import MAX_TRACKER_MESSAGE, MSGPACK
from .metrics import CONTENT_TYPE
from .swarm import MAX_CHUNK
from .tracker import TrackerService

__all__ = ["Routes", "TrackerChanges", "local_only", "MAX_BODY", "MAX_WAIT"]

log = logging.getLogger("sparrowd.daemon")

MAX_BODY = 1 << 20
MAX_WAIT = 60.0  # the longest one /v1/tracker/wait long poll holds; clients poll again
WAIT_COALESCE = 0.05  # seconds a woken long poll waits for more renewals before it looks again


class TrackerChanges:
    """Set (and replaced) whenever the lease table changes: what ``/v1/tracker/wait`` waits on."""

    def __init__(self):
        self.event = asyncio.Event()

    def touch(self) -> None:
        self.event.set()
        self.event = asyncio.Event()


def local_only(request: web.Request) -> web.Response | None:
    """Publishing and credentials need the shared token (not a join credential) and a connection
    from this machine: a stolen token is not enough. The refusal to send, or None."""
    if request.get("credential") is not None:
        event(log, logging.WARNING, "refused an operator request made with a join credential",
              remote=request.remote or "?", credential=request["credential"].id, path=request.path[:100])
        return web.json_response({"error": "a join credential cannot publish or manage credentials"},
                                 status=403)
    if loopback(request):
        return None
    event(log, logging.WARNING, "refused a publish from another machine", remote=request.remote or "?")
    return web.json_response({"error": "publishing is only accepted from the trainer's own machine"}, status=403)


def _too_large(size: int) -> web.Response:
    return web.json_response({"error": f"message of {size} bytes exceeds the limit of {MAX_TRACKER_MESSAGE}"},
                             status=413)


class Routes:
    """The handlers, over what they serve: ``swarm``, the ``tracker`` (None but on the trainer) and its
    ``changes``, ``metrics``, ``node_info()`` (the ``/v1/node`` body) and ``stopping`` (set to leave)."""

    def __init__(self, swarm, metrics, *, tracker: TrackerService | None, changes: TrackerChanges,
                 node_info: Callable[[], dict], stopping: asyncio.Event):
        self.swarm = swarm
        self.metrics = metrics
        self.tracker = tracker
        self.changes = changes
        self.node_info = node_info
        self.stopping = stopping

    def app(self, gate: Gate) -> web.Application:
        app = web.Application(middlewares=[gate.middleware], client_max_size=MAX_BODY)
        app.add_routes([
            web.get("/metrics", self.metrics_page),
            web.get("/v1/node", self._node),
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
        return app

    def metrics_app(self) -> web.Application:
        """``/metrics`` alone, with no token: for a listener of its own (``--metrics-listen``)."""
        app = web.Application(client_max_size=1024)
        app.add_routes([web.get("/metrics", self.metrics_page)])
        return app

    # ------------------------------------------------------------ the tracker

    @property
    def _served_tracker(self) -> TrackerService:
        assert self.tracker is not None  # the tracker's routes are added only where there is one
        return self.tracker

    def _tracker_call(self, name: str):
        method = getattr(self.tracker, name)

        async def handler(request: web.Request) -> web.Response:
            if request.content_type != MSGPACK:
                return web.json_response({"error": f"body must be {MSGPACK}"}, status=415)
            if (length := request.content_length or 0) > MAX_TRACKER_MESSAGE:
                return _too_large(length)
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

    async def _tracker_status(self, request: web.Request) -> web.Response:
        return web.json_response(self._served_tracker.status())

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
            changed = self.changes.event
            a = arrival(self._served_tracker.status()["nodes"], version, names=names, fraction=fraction, **flags)
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

    # ------------------------------------------------------------ publishing (the trainer's machine)

    async def _publish_chunk(self, request: web.Request) -> web.Response:
        if (refused := local_only(request)) is not None:
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
        if (refused := local_only(request)) is not None:
            return refused
        data = await read_limited(request.content, MAX_MANIFEST)
        if data is None:
            return web.json_response({"error": "manifest too large"}, status=413)
        try:
            return web.json_response(await self.swarm.publish_manifest(data))
        except SparrowError as e:
            return web.json_response({"error": str(e)}, status=400)

    async def _publish_state(self, request: web.Request) -> web.Response:
        if (refused := local_only(request)) is not None:
            return refused
        return web.json_response(self.swarm.published())

    # ------------------------------------------------------------ join credentials (the trainer's machine)

    async def _credential_create(self, request: web.Request) -> web.Response:
        if (refused := local_only(request)) is not None:
            return refused
        try:
            body = json.loads(await read_limited(request.content, MAX_BODY) or b"null")
            if not isinstance(body, dict):
                raise ValueError
            expires = body.get("expires")
            lifetime = None if expires in (None, "never") else parse_duration(str(expires))
            record, text = self._served_tracker.issue(role=str(body.get("role") or "rollout"),
                                                      region=body.get("region"), node=body.get("node"),
                                                      lifetime=lifetime)
        except (ValueError, TypeError, RecursionError):
            return web.json_response({"error": "give a JSON map: role, region, node, expires (30d, 12h, never)"},
                                     status=400)
        except InputError as e:
            return web.json_response({"error": str(e)}, status=400)
        return web.json_response({**record, "credential": text})

    async def _credential_list(self, request: web.Request) -> web.Response:
        if (refused := local_only(request)) is not None:
            return refused
        return web.json_response({"credentials": self._served_tracker.credential_list()})

    async def _credential_revoke(self, request: web.Request) -> web.Response:
        if (refused := local_only(request)) is not None:
            return refused
        try:
            record, node = self._served_tracker.revoke(request.match_info["id"][:64])
        except Refused as e:
            return web.json_response({"error": str(e)}, status=404)
        if node is not None:
            self.swarm.forget(node.node_id)
        return web.json_response({**record, "node_id": node.node_id if node else None})

    # ------------------------------------------------------------ this node

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _node(self, request: web.Request) -> web.Response:
        return web.json_response(self.node_info())

    async def _node_leave(self, request: web.Request) -> web.Response:
        if (refused := local_only(request)) is not None:  # a member cannot stop another
            return refused
        event(log, logging.INFO, "asked to leave the swarm", remote=request.remote or "?")
        asyncio.get_running_loop().call_soon(self.stopping.set)
        return web.json_response({"leaving": True}, status=202)
