"""The client side of a daemon: what a trainer, an engine or a command needs to talk to one.

Here live the swarm token file's reading (``read_tokens``, ``read_token``) and
the JSON calls to a daemon with that token (``http_call`` and the calls built
on it: publishing a patch file, the chain's end, the tracker's status and its
wait). The daemon imports the token reading from here too: one rule for both
sides.

Synchronous (urllib): the callers are a command line and a training loop,
not an event loop. Every failure becomes one SparrowError line naming the
URL: refused token, the daemon's own error text, or unreachable.

Imports only ``sparrowd.errors`` and the standard library at module level
(``delta`` and ``swarm.chain`` inside ``publish_file``), never
``sparrowd.daemon``: the SDK (``sparrowd.publisher``,
``sparrowd.integrations``) stands on it alone.
"""

from __future__ import annotations

import json
import os
import stat
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from .errors import InputError, SparrowError

__all__ = ["check_url", "http_call", "publish_file", "tracker_status", "published_state", "check_start",
           "wait_arrival", "read_tokens", "read_token", "MIN_TOKEN_LEN", "MAX_TOKENS"]

MIN_TOKEN_LEN = 16
MAX_TOKENS = 4


def read_tokens(path: Path) -> tuple[list[str], bool]:
    """The tokens in a token file, one per line, and whether the file is readable by group or others.

    The first line is what this node presents; every line is accepted from others. Two lines are
    how a shared token is rotated without downtime (docs/OPERATIONS.md). A line may also hold a
    join credential (``spw1...``) instead of the shared token."""
    try:
        st = os.stat(path)
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f.read(1 << 16).splitlines() if line.strip()]
    except OSError as e:
        raise InputError(f"token file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise InputError(f"token file {path}: not text") from None
    if not lines or len(lines) > MAX_TOKENS or any(len(t) < MIN_TOKEN_LEN or any(c.isspace() for c in t)
                                                  for t in lines):
        raise InputError(f"token file {path}: one to {MAX_TOKENS} lines, each one word of at least "
                         f"{MIN_TOKEN_LEN} characters (a swarm token or a join credential)")
    return lines, bool(st.st_mode & (stat.S_IRWXG | stat.S_IRWXO))


def read_token(path: Path) -> tuple[str, bool]:
    """The token this node presents (the file's first line), and whether the file is too open."""
    tokens, too_open = read_tokens(path)
    return tokens[0], too_open


def check_url(url: str, flag: str | None = None) -> str:
    """``url`` if it can be called: http or https, a host, a numeric port, no spaces or control
    characters; else one InputError naming ``flag`` (the option that gave it) and the URL."""
    try:
        u = urlsplit(url)
        ok = (u.scheme in ("http", "https") and bool(u.hostname) and (u.port or 0) >= 0
              and not any(c.isspace() or not c.isprintable() for c in url))
    except (ValueError, TypeError):  # a port that is not a number, or out of range
        ok = False
    if not ok:
        raise InputError(f"{flag + ' ' if flag else ''}{url!r}: give a URL like http://HOST:PORT")
    return url


def http_call(url: str, token: str | None, *, method: str = "GET", timeout: float = 5.0, data=None,
              body: dict | None = None) -> dict:
    """One JSON call to a daemon, with the swarm token (or, without one, to another JSON service
    such as vLLM's RL routes, ``body`` sent as JSON); errors become one-line SparrowErrors."""
    check_url(url)
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    if body is not None:
        data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
    req = urllib.request.Request(url, method=method, headers=headers,
                                 data=(b"" if data is None else data) if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read(16 << 20)
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise SparrowError(f"{url}: the daemon refused the swarm token") from None
        try:
            err = json.loads(e.read(4096))
            reason = err.get("error") or err["detail"]
            reason = reason.get("message", reason) if isinstance(reason, dict) else reason
        except (ValueError, KeyError, TypeError, AttributeError, OSError):
            reason = f"HTTP {e.code}"
        raise SparrowError(f"{url}: {reason}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise SparrowError(f"{url}: unreachable ({getattr(reason, 'strerror', None) or reason})") from None
    try:
        return json.loads(raw)
    except ValueError:
        raise SparrowError(f"{url}: the reply is not JSON") from None


def publish_file(path, daemon: str, token: str, *, timeout: float = 60.0):
    """Hand a patch file to the trainer's daemon: its chunks (checked against the manifest first),
    then its manifest. Returns (manifest, bytes the daemon newly took, whether the version is new)."""
    from .delta import open_patch
    from .swarm.chain import Key

    base = daemon.rstrip("/")
    with open_patch(path) as view:
        view.verify_chunks()
        m = view.manifest
        key = Key(m.version, m.base_version is None)
        sent = 0
        for i, data in enumerate(view.chunks):
            r = http_call(f"{base}/v1/publish/{key.tag}/chunk/{i}", token, method="POST", data=bytes(data),
                          timeout=timeout)
            sent += len(data) if r.get("new") else 0
        r = http_call(f"{base}/v1/publish/manifest", token, method="POST", data=view.manifest_bytes, timeout=timeout)
    return m, sent, bool(r.get("new"))


def tracker_status(tracker: str, token: str, *, timeout: float = 5.0) -> dict:
    """The tracker's status snapshot (docs/STATUS.md)."""
    snap = http_call(f"{tracker.rstrip('/')}/v1/tracker/status", token, timeout=timeout)
    if not isinstance(snap, dict) or not isinstance(snap.get("nodes"), list):
        raise SparrowError(f"{tracker}: the reply is not a status snapshot")
    return snap


def published_state(daemon: str, token: str, *, timeout: float = 5.0) -> dict:
    """Where the trainer's daemon's chain ends: ``latest`` version, its ``manifest`` BLAKE3, the
    newest ``anchor`` (each None while nothing is published)."""
    url = f"{daemon.rstrip('/')}/v1/publish/state"
    state = http_call(url, token, timeout=timeout)
    if not isinstance(state, dict) or not {"latest", "manifest", "anchor"} <= set(state):
        raise SparrowError(f"{url}: the reply does not say where the chain ends")
    return state


def check_start(state: dict, version: int) -> None:
    """A trainer starts at ``version``: the daemon must have nothing, or end its chain there."""
    latest = state["latest"]
    if latest is not None and latest != version:
        raise SparrowError(f"the trainer's daemon has published up to version {latest}: start from the weights of "
                           f"version {latest}, or give the daemon a fresh data dir")


def wait_arrival(tracker: str, token: str, version: int, *, applied: bool = False, engines: bool = False,
                 nodes: list[str] | None = None, fraction: float | None = None, timeout: float = 60.0) -> dict:
    """Block until version ``version`` is held by (``applied``: applied on) every live node that
    counts (``sparrowd.swarm.waits``), through the tracker's long poll; returns its answer
    (``reached``, ``missing``, ``needed``). SparrowError naming the missing nodes after ``timeout``."""
    from urllib.parse import urlencode

    deadline = time.monotonic() + timeout
    while True:
        left = max(0.0, deadline - time.monotonic())
        q = {"version": version, "timeout": f"{min(left, 30.0):.3f}", "applied": int(applied), "engines": int(engines)}
        if nodes is not None:
            q["nodes"] = ",".join(nodes)
        if fraction is not None:
            q["fraction"] = fraction
        a = http_call(f"{tracker.rstrip('/')}/v1/tracker/wait?{urlencode(q)}", token, timeout=min(left, 30.0) + 10)
        if not isinstance(a, dict) or "done" not in a:
            raise SparrowError(f"{tracker}: the reply to a wait is not an answer")
        if a["done"]:
            return a
        if time.monotonic() >= deadline:
            what = "applied on" if applied else "held by"
            raise SparrowError(f"version {version}: not {what} {', '.join(a['missing']) or 'any node'} after "
                               f"{timeout:g} s ({len(a['reached'])} of the {a['needed']} needed have it)")
