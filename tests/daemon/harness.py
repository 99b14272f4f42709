"""Real daemons as separate processes on loopback, started and stopped by pid."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import secrets
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import msgpack

from sparrowd.localswarm import free_port, wait_for  # noqa: F401  (the tests import them from here)
from tests import members


def make_token(path: Path) -> Path:
    path.write_text(secrets.token_hex(24) + "\n")
    path.chmod(0o600)
    return path



def get(url: str, token: str | None, *, method: str = "GET", data: bytes | None = None,
        headers: dict | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
    h = dict(headers or {})
    if token is not None:
        h["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, method=method, data=data, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class Daemon:
    """One ``sparrowd run`` process; its log goes to ``<data_dir>.log``."""

    def __init__(self, root: Path, name: str, role: str, region: str, token_file: Path, *,
                 tracker: str | None = None, port: int = 0, ttl: float | None = None, env: dict | None = None,
                 extra: tuple[str, ...] = (), open_files: int | None = None):
        """``open_files``: the process's limit on open files, soft and hard (as a box's ulimit sets it)."""
        self.open_files = open_files
        self.name, self.role, self.region = name, role, region
        self.data_dir = root / name
        self.log_path = root / f"{name}.log"
        self.token_file = token_file
        self.args = ["--role", role, "--region", region, "--listen", f"127.0.0.1:{port}", "--data-dir",
                     str(self.data_dir), "--token-file", str(token_file), "--node-id", name, *extra]
        if role == "rollout" and "--current" not in extra:
            # Most tests are about the swarm and engines, on a node that holds the base model (as with
            # --current off); the current-folder tests turn it on, as a rollout's default has it.
            self.args += ["--current", "off"]
        if tracker:
            self.args += ["--tracker", tracker]
        if ttl:
            self.args += ["--lease-ttl", str(ttl)]
        if level := os.environ.get("SPARROWD_TEST_LOG_LEVEL"):  # e.g. debug, to see every chunk move
            self.args += ["--log-level", level]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARROWD_", "NOTIFY_SOCKET"))}
        self.env.update(env or {})
        self.proc: subprocess.Popen | None = None

    def start(self, wait: bool = True) -> "Daemon":
        self._log = open(self.log_path, "ab")
        limit = self.open_files

        def limits() -> None:
            if limit is not None:
                import resource
                resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

        self.proc = subprocess.Popen([sys.executable, "-m", "sparrowd.cli.main", "run", *self.args],
                                     stdout=self._log, stderr=self._log, env=self.env, preexec_fn=limits)
        if wait:
            wait_for(lambda: self.runtime() is not None or self.proc.poll() is not None, 20, f"{self.name} to start")
            assert self.proc.poll() is None, f"{self.name} exited: {self.log()}"
        return self

    def runtime(self) -> dict | None:
        try:
            info = json.loads((self.data_dir / "daemon.json").read_text())
        except (OSError, ValueError):
            return None
        return info if info.get("pid") == self.proc.pid else None

    @property
    def url(self) -> str:
        return self.runtime()["url"]

    def node(self, token: str) -> dict:
        status, body = get(f"{self.url}/v1/node", token)
        assert status == 200, body
        return json.loads(body)

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def wait(self, timeout: float = 15) -> int:
        rc = self.proc.wait(timeout)
        self._log.close()
        return rc

    def stop(self) -> int:
        if self.proc and self.proc.poll() is None:
            self.signal(signal.SIGTERM)
        return self.wait()

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def _wan_address(region: int, kind: int, j: int) -> str:
    """The WAN emulator's loopback block: region ``region``'s node ``j``, itself (kind 0) or its
    proxy (kind 1) (``sparrowd.bench.wan``)."""
    return f"127.{10 + region}.{kind}.{j + 1}"


@contextlib.contextmanager
def behind_wan(cluster, tmp_path: Path, layout: dict[str, tuple[int, int]], *, rtt: float = 0.0,
               cut_file: Path | None = None):
    """A trainer and rollouts, each behind the WAN emulator's proxy (``sparrowd.bench.wan``, as
    ``bench swarm`` runs it): ``layout`` maps each name ("trainer" among them) to (region, index);
    regions are named ``region<r>``. Yields the rollout daemons by name; the emulator is killed
    after. ``cut_file`` lists the regions whose traffic it drops."""
    port = free_port()
    ports = {name: port if name == "trainer" else free_port() for name in layout}
    proxies = [{"listen": [_wan_address(r, 1, j), ports[n]], "target": [_wan_address(r, 0, j), ports[n]], "region": r}
               for n, (r, j) in layout.items()]
    config = {"proxies": proxies, "rtt": rtt, "link_rate": 0}
    if cut_file is not None:
        config["cut_file"] = str(cut_file)
    (tmp_path / "wan.json").write_text(json.dumps(config))
    wan = subprocess.Popen([sys.executable, "-m", "sparrowd.bench.wan", str(tmp_path / "wan.json")],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert wan.stdout.readline().strip() == b"ready"
        r0, j0 = layout["trainer"]
        here, there = _wan_address(r0, 0, j0), _wan_address(r0, 1, j0)
        cluster.trainer(region=f"region{r0}", extra=("--listen", f"{here}:{port}", "--advertise", f"{there}:{port}"))
        cluster.tracker = f"http://{there}:{port}"  # the nodes reach the tracker through its proxy
        nodes = {n: cluster.rollout(n, f"region{r}", extra=("--listen", f"{_wan_address(r, 0, j)}:{ports[n]}",
                                                             "--advertise", f"{_wan_address(r, 1, j)}:{ports[n]}"))
                 for n, (r, j) in layout.items() if n != "trainer"}
        cluster.tracker = f"http://{here}:{port}"  # the test's own calls go direct
        yield nodes
    finally:
        wan.kill()
        wan.wait()


def status(tracker_url: str, token: str) -> dict:
    code, body = get(f"{tracker_url}/v1/tracker/status", token)
    assert code == 200, body
    return json.loads(body)


def node_row(tracker_url: str, token: str, node_id: str) -> dict:
    """The tracker's status row for ``node_id``; empty while the node is not in the swarm (not yet
    joined, or between a stop and a restart), so a wait on a field reads it as not there yet."""
    return next((n for n in status(tracker_url, token)["nodes"] if n["node_id"] == node_id), {})


def node_ids(tracker_url: str, token: str) -> set[str]:
    return {n["node_id"] for n in status(tracker_url, token)["nodes"]}


MP = {"Content-Type": "application/msgpack"}


class Member:
    """A member speaking the protocol by hand: joined with the swarm token, its lease kept."""

    def __init__(self, cluster, node_id: str, region: str):
        self.cluster, self.id, self.region, self.key = cluster, node_id, region, members.new_key()
        code, body = get(f"{cluster.tracker}/v1/tracker/join", cluster.token, method="POST", headers=MP,
                         data=msgpack.packb(members.join(self.key, node_id, region=region)))
        assert code == 200, body
        self.lease = msgpack.unpackb(body)
        self.epoch = self.lease["epoch"]

    def renew(self) -> None:
        code, body = get(f"{self.cluster.tracker}/v1/tracker/renew", self.cluster.token, method="POST", headers=MP,
                         data=msgpack.packb(members.renew(self.key, self.id, self.epoch)))
        if code == 410:  # the lease ran out meanwhile: join again, as a daemon does
            code, body = get(f"{self.cluster.tracker}/v1/tracker/join", self.cluster.token, method="POST",
                             headers=MP, data=msgpack.packb(members.join(self.key, self.id, region=self.region)))
        if code == 200:
            self.lease = msgpack.unpackb(body)
            self.epoch = self.lease["epoch"]

    def headers(self, to: str) -> dict:
        return members.peer(self.key, self.id, to, self.lease)

    def known_to(self, relay) -> bool:
        """An exchange answered at once: the relay holds this member's tracker entry (503 until then)."""
        data = msgpack.packb({"node_id": self.id, "region": self.region, "after": -1, "wait": 0, "versions": []})
        return get(f"{relay.url}/v1/swarm/exchange", None, method="POST", data=data,
                   headers={**MP, **self.headers(relay.name)})[0] == 200

    def exchange(self, peer, versions: list[dict], *, after: int = -1, wait: int = 0) -> tuple[int, dict | bytes]:
        """One exchange with ``peer``: its status and, on 200, its decoded reply."""
        data = msgpack.packb({"node_id": self.id, "region": self.region, "after": after, "wait": wait,
                              "versions": versions})
        code, body = get(f"{peer.url}/v1/swarm/exchange", None, method="POST", data=data,
                         headers={**MP, **self.headers(peer.name)}, timeout=wait + 10)
        return code, msgpack.unpackb(body) if code == 200 else body

    def ask(self, relay, key: str, index: int) -> http.client.HTTPResponse:
        """A chunk request, its answer's status and headers read (the body is left to stream)."""
        u = urlparse(relay.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        conn.request("GET", f"/v1/swarm/chunk/{key}/{index}", headers=self.headers(relay.name))
        return conn.getresponse()
