"""The engine's side of the engine socket: ``EngineClient`` and ``sync``.

    client = EngineClient("/var/lib/sparrowd/engine.sock", token_file="swarm.token", version=0)
    applier = PatchApplier(model, version=0)
    version = sync(client, applier)          # every ready version applied, in order

Synchronous on purpose: it runs inside an inference engine's worker between
steps, not on an event loop. A fetch receives a sealed memfd (SCM_RIGHTS)
holding the decoded patch, maps it read-only and applies straight from the
mapping; the descriptor is closed when the apply is done.
"""

from __future__ import annotations

import math
import os
import socket
import time
from pathlib import Path

from ..client import read_token
from ..decoded import Decoded, read_decoded
from ..enginewire import frame, length, parse, state_fingerprint
from ..errors import BaseMismatchError, InputError, SparrowError, VersionUnavailableError

__all__ = ["EngineClient", "sync", "MAX_READY_WAIT"]


class EngineClient:
    def __init__(self, path: str | os.PathLike, *, token: str | None = None,
                 token_file: str | os.PathLike | None = None,
                 engine: str = "engine", rank: int = 0, version: int = 0, timeout: float = 60.0,
                 model: str | os.PathLike | None = None):
        """``model``: the local folder the engine loaded its weights from, if it did: a daemon whose
        current folder is empty starts it from there (``sparrowd run --base``)."""
        if token is None:
            token_file = token_file or os.environ.get("SPARROWD_TOKEN_FILE")
            if not token_file:
                raise InputError("EngineClient needs the swarm token: token_file=... or $SPARROWD_TOKEN_FILE")
            token, _ = read_token(Path(token_file))
        self.path = str(path)
        self.version = version
        self.broken = False  # the connection failed; a new client must say hello again
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(self.path)
        except OSError as e:
            self._sock.close()
            raise SparrowError(f"engine socket {self.path}: cannot connect ({e.strerror or e})") from None
        hello = {"op": "hello", "engine": engine, "rank": rank, "version": version, "token": token}
        if model is not None and os.path.isdir(model):
            hello["model"] = os.path.abspath(model)
        reply = self._call(hello)
        self.node = reply.get("node")

    # ------------------------------------------------------------ calls

    def ready(self, wait: float = 0.0, until: int | None = None) -> tuple[int | None, list[int]]:
        """``(anchor, patches)``: what to load next, waiting up to ``wait`` s (at most 30) for
        something, or, given ``until``, for a chain that reaches that version."""
        msg = {"op": "ready", "wait": math.ceil(wait)}
        if until is not None:
            msg["until"] = until
        r = self._call(msg, timeout=wait + 30)
        patches = r.get("patches")
        if not isinstance(patches, list) or not all(isinstance(v, int) for v in patches):
            raise SparrowError(f"engine socket {self.path}: malformed ready reply")
        anchor = r.get("anchor")
        return (anchor if isinstance(anchor, int) else None), patches

    def fetch(self, version: int, *, anchor: bool = False) -> Decoded:
        """The decoded patch (or anchor), mapped from the daemon's memfd."""
        reply, fd = self._call({"op": "fetch", "version": version, "anchor": anchor}, want_fd=True)
        if fd is None:
            raise SparrowError(f"engine socket {self.path}: the reply to fetch carried no descriptor")
        try:
            d = read_decoded(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        if d.version != version:
            raise SparrowError(f"engine socket {self.path}: asked for {version}, got {d.version}")
        return d

    def applied(self, d: Decoded) -> None:
        self._call({"op": "applied", "version": d.version, "anchor": d.base_version is None,
                    "fingerprint": state_fingerprint(d.tensors)})
        self.version = d.version

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ framing

    def _call(self, msg: dict, *, timeout: float | None = None, want_fd: bool = False):
        if timeout is not None:
            self._sock.settimeout(timeout)
        try:
            self._sock.sendall(frame(msg))
            head, fds = self._recv_with_fds(4)
            body = self._exactly(length(head))
        except OSError as e:  # timeouts included
            self.broken = True
            raise SparrowError(f"engine socket {self.path}: {e.strerror or type(e).__name__}") from None
        reply = parse(body, request=False)
        if reply["op"] == "error":
            for fd in fds:
                os.close(fd)
            err = str(reply.get("error", "refused"))
            if isinstance(reply.get("anchor"), int) or "applies to" in err:
                raise BaseMismatchError(f"sparrowd: {err}")
            raise SparrowError(f"sparrowd: {err}")
        if want_fd:
            for fd in fds[1:]:
                os.close(fd)
            return reply, (fds[0] if fds else None)
        for fd in fds:
            os.close(fd)
        return reply

    def _recv_with_fds(self, n: int) -> tuple[bytes, list[int]]:
        data, fds, _, _ = socket.recv_fds(self._sock, n, 4)
        if not data:
            raise ConnectionResetError("the daemon closed the engine socket")
        return data + self._exactly(n - len(data)), list(fds)

    def _exactly(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            part = self._sock.recv(n - len(buf))
            if not part:
                raise ConnectionResetError("the daemon closed the engine socket")
            buf += part
        return bytes(buf)


MAX_READY_WAIT = 30.0  # the daemon answers a ready request within this


def sync(client: EngineClient, applier, target: int | None = None, *, wait: float = 0.0,
         exact: bool = False) -> int:
    """Apply the versions ready at the daemon, in order, up to ``target`` (all when None), as
    one transaction; returns the version the engine now holds.

    Waits up to ``wait`` seconds for a chain that reaches ``target``. Without ``exact`` it then
    applies what is ready, however far that gets; with ``exact`` a target not reached is a
    ``VersionUnavailableError`` and nothing is applied. When the engine's chain is broken (it
    is behind everything the swarm retains) the daemon names an anchor, loaded first in the
    same transaction. Everything is fetched and checked before the first write; any error
    puts every write back (the engine keeps the version it had, bit for bit) and is raised.
    The daemon is told what was applied once all of it was written, and a failure to tell it
    (the daemon died) undoes the writes as well: the engine is never ahead of what it reports.
    A daemon that heard part of it learns the engine's version again at the next hello."""
    start = applier.version
    if target is not None and target <= start:
        return start
    deadline = time.monotonic() + wait
    while True:
        left = max(0.0, deadline - time.monotonic())
        anchor, patches = client.ready(min(left, MAX_READY_WAIT), until=target)
        past = anchor is not None and target is not None and anchor > target
        if past:  # only an anchor newer than the target mends the chain: the target cannot be had
            anchor, patches = None, []
        patches = [v for v in patches if target is None or v <= target]
        end = patches[-1] if patches else (anchor if anchor is not None else start)
        if past or target is None or end >= target or time.monotonic() >= deadline:
            break
    if exact and target is not None and end < target:
        raise VersionUnavailableError(
            f"version {target} is not ready at the daemon after {wait:g} s (it can give up to {end}); "
            f"the engine stays on version {start}")
    todo = ([client.fetch(anchor, anchor=True)] if anchor is not None else []) + [client.fetch(v) for v in patches]
    if not todo:
        return start
    with applier.transaction():  # acknowledged inside it: a daemon gone mid-way undoes the writes too
        for d in todo:
            applier.apply_decoded(d)
        for d in todo:
            client.applied(d)
    return applier.version
