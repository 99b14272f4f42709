"""Follow mode: the daemon keeps its co-located ``vllm serve`` on the newest version by itself.

    sparrowd run --role rollout ... --follow-vllm http://127.0.0.1:8000 [--follow-every SECONDS]

The server runs with ``--weight-transfer-config '{"backend": "sparrowd"}'``
and vLLM's RL routes (``VLLM_SERVER_DEV_MODE=1``). The driver attaches the
server's workers to this node's engine socket (``/init_weight_transfer_engine``),
then, whenever ``sparrowd.swarm.follow.decide`` says so, makes sure the
versions are decoded (before any pause) and moves the server:
``/pause?mode=keep``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update`` with the version's number as ``weight_version``, a
prefix cache reset, and ``/resume`` (always, once paused). In-flight requests
are kept across the pause and continue on the new weights.

vLLM's RL routes have no authentication, so the settings refuse a server
address that is not loopback unless the operator allows it. A server that is
down or restarts is attached again when it answers; a failed update leaves
the server on its last version and is retried with back-off.

``VllmFollower`` gets the engine socket's server and the swarm driver (``app``
wires them), never the daemon. Imports the pure core (``swarm.follow``) and
the daemon's ``engine`` and ``logs``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import aiohttp

from ..errors import SparrowError
from ..swarm.chain import Key
from ..swarm.follow import decide
from .engine import EngineServer
from .logs import event

__all__ = ["VllmFollower"]

log = logging.getLogger("sparrowd.follow")

UPDATE_TIMEOUT = 30.0  # the server's wait for a version; ours are decoded before we ask
CALL_TIMEOUT = 120.0


class FollowError(SparrowError):
    """The vLLM server refused or failed a call."""


class VllmFollower:
    """Moves the vLLM server at ``url`` onto what ``engines`` (this node's engine socket) has ready;
    its workers attach with the token in ``token_file``."""

    def __init__(self, url: str, engines: EngineServer, swarm, *, token_file: Path, every: float = 0.0):
        self.engines = engines
        self.swarm = swarm
        self.token_file = token_file
        self.url = url.rstrip("/")
        self.every = every
        self.engine = f"follow:{self.url.split('://', 1)[-1]}"[:64]  # the id the server's workers attach as
        self.error: str | None = None
        self.updates = 0
        self.last_update: float | None = None
        self.last_pause: float | None = None  # seconds the server was paused for the last update
        self._failures = 0
        self._failed_at: float | None = None
        self._session: aiohttp.ClientSession | None = None

    # ------------------------------------------------------------ what the node knows of the server

    def server_version(self) -> int | None:
        """The version the server's workers hold (the oldest rank), or None when not attached."""
        engines = self.engines
        ranks = [e.version for (name, _), e in engines.engines.items() if name == self.engine] if engines else []
        return min(ranks) if ranks else None

    # ------------------------------------------------------------ the loop

    async def run(self) -> None:
        swarm = self.swarm
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT))
        try:
            while True:
                gen = swarm.gen
                wait = await self._step()
                await swarm.changed(gen, wait)
        finally:
            await self._session.close()

    async def _step(self) -> float:
        now = time.monotonic()
        try:
            server = self.server_version()
            if server is None:
                await self._attach()
                server = self.server_version()
                # Attached: the server answers now, so the back-off of the attempts made while it was
                # starting (or down) ends; the versions it lacks go to it at once.
                self._failures, self._failed_at, self.error = 0, None, None
            anchor, patches = self.engines.plan(server) if server is not None else (None, [])
            ready = patches[-1] if patches else anchor
            d = decide(now, server=server, ready=ready, every=self.every, last_update=self.last_update,
                       failures=self._failures, failed_at=self._failed_at)
            if d.target is None:
                return d.wait
            assert server is not None  # (decide sets a target only for an attached server)
            keys = ([Key(anchor, True)] if anchor is not None else []) + [Key(v) for v in patches if v <= d.target]
            for key in keys:  # decoded now, so that the pause covers the scatter only
                await self.engines.decode(key)
            await self._update(server, d.target)
        except (FollowError, aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            self._failed(str(e) or type(e).__name__)
            return 1.0
        return 0.0

    def _failed(self, reason: str) -> None:
        self._failures += 1
        self._failed_at = time.monotonic()
        text = f"follow-vllm {self.url}: {reason}"
        if text != self.error:
            event(log, logging.WARNING, "cannot move the vLLM server", url=self.url, reason=reason,
                  server_version=self.server_version())
        self.error = text

    # ------------------------------------------------------------ calls

    async def _attach(self) -> None:
        info = await self._call("GET", "weight_info")
        label = str(info.get("weight_version", ""))
        init: dict[str, Any] = {"socket": str(self.engines.path), "token_file": str(self.token_file),
                                "engine": self.engine}
        if label.isdigit():  # the server's label names a sparrowd version; else its workers keep theirs (0 at first)
            init["version"] = int(label)
        await self._call("POST", "init_weight_transfer_engine", {"init_info": init})
        deadline = time.monotonic() + 10
        while self.server_version() is None:
            if time.monotonic() > deadline:
                raise FollowError("the server's workers did not attach to the engine socket; is it running with "
                                  "--weight-transfer-config '{\"backend\": \"sparrowd\"}'?")
            await asyncio.sleep(0.05)
        if not label.isdigit():
            # A server started on a sparrowd model folder (DATA/current): its workers know the folder's
            # version; the server's own label says so too from now on.
            await self._call("POST", "update_weight_version", {"new_version": str(self.server_version())})
        event(log, logging.INFO, "following the vLLM server", url=self.url, version=self.server_version())

    async def _update(self, server: int, target: int) -> None:
        await self._call("POST", "start_weight_update")
        t0 = time.monotonic()
        await self._call("POST", "pause?mode=keep")
        try:
            await self._call("POST", "update_weights", {"update_info": {"version": target, "timeout": UPDATE_TIMEOUT}})
            await self._call("POST", "finish_weight_update", {"weight_version": str(target)})
            # Prefixes cached under the old weights are stale; refused (success false) while kept
            # requests still hold blocks, in which case theirs stay cached until they end.
            await self._call("POST", "reset_prefix_cache")
        finally:
            await self._call("POST", "resume")
        self.last_pause = time.monotonic() - t0
        self.last_update = time.monotonic()
        self.updates += 1
        self._failures, self._failed_at, self.error = 0, None, None
        event(log, logging.INFO, "moved the vLLM server", url=self.url, version=target, base=server,
              paused_seconds=round(self.last_pause, 3))

    async def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        assert self._session is not None, "the follower calls the server only while it runs"
        async with self._session.request(method, f"{self.url}/{path}", json=body) as r:
            text = await r.text()
            if r.status != 200:
                raise FollowError(f"{path.split('?')[0]}: HTTP {r.status}: {_reason(text)}")
        try:
            return json.loads(text) if text else {}
        except ValueError:
            return {}


def _reason(text: str) -> str:
    """vLLM's error message out of its JSON error body, on one line."""
    try:
        body = json.loads(text)
        err = body.get("error") or body.get("detail") or body
        msg = err.get("message", err) if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        msg = text
    return " ".join(str(msg).split())[:300]
