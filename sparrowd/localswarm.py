"""A swarm of real daemons on this machine's loopback, for the demo and the benchmarks.

Each daemon is its own ``sparrowd run`` process with its own data dir under
``root``; the trainer listens on a free port and hosts the tracker, rollout
daemons join it. Leaving the ``with`` block stops every process (SIGTERM, then
SIGKILL) and, unless ``keep``, removes ``root``.
"""

from __future__ import annotations

import itertools
import json
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .checkpoint import atomic_file

__all__ = ["LocalSwarm", "LocalDaemon", "free_port", "wait_for"]


def _ephemeral_low() -> int | None:
    """The first port of the kernel's ephemeral range (Linux), or None where it cannot tell."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


_PICKS = itertools.count(random.randrange(1 << 16))  # this process's picks, in turn: never the same twice


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, from the 10,000 below the kernel's ephemeral range where it can tell:
    a port the kernel picks (a bind to port 0) comes from that range, and an outgoing connection made
    before the caller binds it can take it as its own local port (the daemons keep many, an hour: a
    `vllm serve` lost the port it was given so). Else the kernel's pick."""
    lo = _ephemeral_low()
    if lo is not None and lo > 11024:
        for _ in range(256):
            port = lo - 10000 + next(_PICKS) % 10000
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for(pred, timeout: float, what: str, every: float = 0.05, detail=None):
    """Poll ``pred`` until it is truthy and return that; after ``timeout`` s a TimeoutError naming
    ``what`` (and what ``detail()`` reports seeing, if given)."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            seen = f"; seen: {detail()}" if detail is not None else ""
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}{seen}")
        time.sleep(every)


@dataclass
class LocalDaemon:
    name: str
    region: str
    role: str
    data_dir: Path
    proc: subprocess.Popen
    args: list[str] = field(default_factory=list)

    @property
    def engine_socket(self) -> Path:
        return self.data_dir / "engine.sock"


@dataclass
class LocalSwarm:
    prefix: str = "sparrowd-"
    keep: bool = False
    log_level: str = "warning"
    root: Path = field(init=False)
    token_file: Path = field(init=False)
    url: str = field(init=False)
    daemons: list[LocalDaemon] = field(default_factory=list, init=False)

    def __enter__(self) -> "LocalSwarm":
        self.root = Path(tempfile.mkdtemp(prefix=self.prefix))
        self.token_file = self.root / "swarm.token"
        with atomic_file(self.token_file, private=True) as tmp:
            tmp.write_text(secrets.token_hex(24) + "\n")
        self.url = f"http://127.0.0.1:{free_port()}"
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        if not self.keep:
            shutil.rmtree(self.root, ignore_errors=True)

    def _start(self, name: str, role: str, region: str, extra: tuple[str, ...]) -> LocalDaemon:
        data = self.root / name
        listen = self.url.removeprefix("http://") if role == "trainer" else "127.0.0.1:0"
        args = [sys.executable, "-m", "sparrowd.cli.main", "run", "--role", role, "--region", region, "--listen",
                listen, "--data-dir", str(data), "--token-file", str(self.token_file), "--node-id", name,
                "--log-level", self.log_level, *extra]
        if role != "trainer":
            args += ["--tracker", self.url]
        d = LocalDaemon(name, region, role, data, self._spawn(name, args), args)
        self.daemons.append(d)
        self._wait_started(d)
        return d

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "ab")
        try:
            return subprocess.Popen(args, stdout=log, stderr=log, start_new_session=True)
        finally:
            log.close()

    def _wait_started(self, d: LocalDaemon) -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                if json.loads((d.data_dir / "daemon.json").read_text()).get("pid") == d.proc.pid:
                    return
            except (OSError, ValueError):
                pass
            if d.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"daemon {d.name} did not start; see {self.root / (d.name + '.log')}")
            time.sleep(0.05)

    def kill(self, d: LocalDaemon) -> None:
        """SIGKILL: no goodbye, as when a rented box vanishes."""
        d.proc.kill()
        d.proc.wait()

    def restart(self, d: LocalDaemon) -> None:
        """The same daemon again, on the same data dir."""
        if d.proc.poll() is None:
            self.kill(d)
        d.proc = self._spawn(d.name, d.args)
        self._wait_started(d)

    def trainer(self, *extra: str, region: str = "eu") -> LocalDaemon:
        return self._start("trainer", "trainer", region, extra)

    def rollout(self, name: str, region: str, *extra: str) -> LocalDaemon:
        """A rollout daemon; it keeps no current folder unless ``extra`` asks (``--current on``):
        its engine, if any, loaded the base itself, as in the demo and the benchmarks."""
        if "--current" not in extra:
            extra = (*extra, "--current", "off")
        return self._start(name, "rollout", region, extra)

    def status(self) -> dict:
        token = self.token_file.read_text().strip()
        req = urllib.request.Request(f"{self.url}/v1/tracker/status", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())

    def wait_joined(self, n: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while len(self.status()["nodes"]) < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(self.status()['nodes'])} of {n} daemons joined in {timeout:.0f} s")
            time.sleep(0.1)

    def stop(self) -> None:
        for d in self.daemons:
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGTERM)
        for d in self.daemons:
            try:
                d.proc.wait(10)
            except subprocess.TimeoutExpired:
                d.proc.kill()
                d.proc.wait()
        self.daemons.clear()
