"""``sparrowd bench tracker``: how large a swarm one tracker holds.

Two measurements, one run:

1. **The table, in process, on one core.** ``TrackerService`` over the
   ``LeaseTable`` with its SQLite store (what the trainer's daemon runs), for
   each swarm size: joins per second, then renewals per second carrying what a
   rollout reports (versions held, byte counters, its folder), each answered
   with a peer list. Beside it, the same table without a store (the baseline:
   what the disk costs), and Python's memory and the database's bytes per
   lease. As in a large swarm, one renewal in six asks for the peer list.
2. **Over HTTP, a real trainer daemon.** The daemon runs as its own process on
   loopback; this process joins ``nodes`` fake nodes and renews them from
   ``concurrency`` connections for ``seconds``. The daemon's CPU time comes
   from ``/proc``, so requests per second of daemon CPU is its capacity on one
   core whether or not this client kept it busy (both share the machine).

From the HTTP figure: the largest swarm one tracker holds at the default TTL,
with renewals (every TTL/3) taking at most half a core.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

from . import write_json

__all__ = ["TrackerConfig", "run"]

REFRESH_EVERY = 6  # Membership.PEER_REFRESH over the default renewal interval


@dataclass(frozen=True)
class TrackerConfig:
    sizes: tuple[int, ...] = (1_000, 10_000)
    renewals: int = 20_000  # renewals timed per size, in process
    nodes: int = 10_000  # fake nodes over HTTP
    concurrency: int = 64
    seconds: float = 10.0
    headroom: float = 0.5  # the share of one core renewals may take at the largest swarm


def _report(i: int, version: int, k: int = 0) -> dict:
    """What a rollout's k-th renewal carries. In a swarm this large its peer list is full, so it asks
    for a fresh one every PEER_REFRESH seconds: one renewal in six at the default TTL."""
    return {"versions": [version - 2, version - 1, version], "engine_version": version, "bytes_up": 1_000_000 * i,
            "bytes_down": 2_000_000 * i, "bytes_up_wan": 10_000 * i, "bytes_down_wan": 20_000 * i, "peers": 24,
            "current": {"state": "ready", "version": version}, "want_peers": k % REFRESH_EVERY == 0}


def _table(n: int, store: bool, folder: Path):
    from ..daemon.leasedb import SqliteLeaseStore
    from ..daemon.tracker import TrackerService
    from ..swarm.leases import DEFAULT_PEER_LIMIT, DEFAULT_TTL, LeaseTable

    now = time.time()
    db = folder / f"leases-{n}-{int(store)}-{time.monotonic_ns()}.db"
    kept = SqliteLeaseStore(db) if store else None
    table = LeaseTable(DEFAULT_TTL, now=now, store=kept)
    return db, kept, TrackerService(table, tracker_id="bench", peer_limit=DEFAULT_PEER_LIMIT, clock=lambda: now,
                                    rng=random.Random(0))


class _Nodes:
    """The fake nodes' keys and sealed messages (each node signs its own: that is the nodes' work,
    not the tracker's, so the in-process figures seal before they time). As real daemons do, each
    join carries an exchange key and the renewals after it are sealed with the session's HMAC;
    ``signed=True`` renews with an Ed25519 signature instead (the comparison)."""

    def __init__(self, n: int):
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        from ..swarm.identity import NodeKey, SessionKey

        self.keys = [NodeKey(Ed25519PrivateKey.generate()) for _ in range(n)]
        self.kx = [SessionKey() for _ in range(n)]
        self.secrets: dict[int, bytes] = {}
        self._ts = time.time()

    def ts(self) -> float:
        self._ts = max(time.time(), self._ts + 1e-6)
        return self._ts

    def join(self, i: int, prefix: str = "10") -> dict:
        from ..swarm.identity import seal

        k = self.keys[i]
        return seal(k, "join", {"node_id": f"node-{i:05d}", "role": "rollout", "region": f"region-{i % 8}",
                                "address": f"{prefix}.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}:7070",
                                "key": k.public, "ts": self.ts(), "kx": self.kx[i].public})

    def joined(self, i: int, reply: dict) -> int:
        """The session the join's reply set up; returns the lease's epoch."""
        self.secrets[i] = self.kx[i].secret(reply["kx"], f"node-{i:05d}", reply["epoch"])
        return reply["epoch"]

    def renew(self, i: int, epoch: int, version: int, k: int = 0, *, signed: bool = False) -> dict:
        from ..swarm.identity import seal, seal_session

        msg = {"node_id": f"node-{i:05d}", "epoch": epoch, "ts": self.ts(), **_report(i, version, k)}
        return seal(self.keys[i], "renew", msg) if signed else seal_session(self.secrets[i], "renew", msg)


def _join_all(svc, nodes: _Nodes, n: int) -> list[int]:
    return [nodes.joined(i, svc.join(nodes.join(i))) for i in range(n)]


def _in_process(n: int, renewals: int, store: bool, folder: Path, *, signed: bool = False) -> dict:
    db, kept, svc = _table(n, store, folder)
    nodes = _Nodes(n)
    joins = [nodes.join(i) for i in range(n)]
    t0 = time.perf_counter()
    replies = [svc.join(m) for m in joins]
    t_join = time.perf_counter() - t0
    epochs = [nodes.joined(i, r) for i, r in enumerate(replies)]
    msgs = [nodes.renew(k % n, epochs[k % n], 10 + k // n, k // n + k % n, signed=signed) for k in range(renewals)]
    t0 = time.perf_counter()
    for k, m in enumerate(msgs):
        svc.renew(m)
        if kept is not None and k % 2000 == 1999:
            kept.flush()  # what the daemon does every second
    t_renew = time.perf_counter() - t0
    if kept is not None:
        kept.close()
    # Memory, traced apart (tracing slows every allocation): a table of n leases, each renewed once.
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    _, _, svc2 = _table(n, False, folder)
    for i, epoch in enumerate(_join_all(svc2, nodes, n)):
        svc2.renew(nodes.renew(i, epoch, 10))
    python_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return {"nodes": n, "store": store, "signed": signed, "joins_per_s": n / t_join,
            "renewals_per_s": renewals / t_renew,
            "python_bytes_per_lease": python_bytes / n,
            "db_bytes_per_lease": (db.stat().st_size + _size(db.with_name(db.name + "-wal"))) / n if store else 0}


def _size(p: Path) -> int:
    return p.stat().st_size if p.exists() else 0


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _http_load(url: str, token: str, pid: int, cfg: TrackerConfig) -> dict:
    from ..daemon.membership import HttpTrackerClient

    client = HttpTrackerClient(url, token, timeout=30, connections=cfg.concurrency)
    epochs: dict[int, int] = {}
    nodes = _Nodes(cfg.nodes)

    async def joiner(w: int) -> None:
        for i in range(w, cfg.nodes, cfg.concurrency):
            epochs[i] = nodes.joined(i, await client.join(nodes.join(i, prefix="127")))

    cpu0, t0 = _cpu_seconds(pid), time.perf_counter()
    await asyncio.gather(*(joiner(w) for w in range(cfg.concurrency)))
    join_wall, join_cpu = time.perf_counter() - t0, _cpu_seconds(pid) - cpu0
    latencies: list[float] = []
    stop_at = time.perf_counter() + cfg.seconds

    async def renewer(w: int) -> None:
        k = w
        while time.perf_counter() < stop_at:
            i = k % cfg.nodes
            s = time.perf_counter()
            await client.renew(nodes.renew(i, epochs[i], 10, k // cfg.nodes + i))
            latencies.append(time.perf_counter() - s)
            k += cfg.concurrency

    cpu0, t0 = _cpu_seconds(pid), time.perf_counter()
    await asyncio.gather(*(renewer(w) for w in range(cfg.concurrency)))
    wall, cpu = time.perf_counter() - t0, _cpu_seconds(pid) - cpu0
    await client.close()
    latencies.sort()
    return {"nodes": cfg.nodes, "joins": cfg.nodes, "joins_per_s": cfg.nodes / join_wall,
            "joins_per_cpu_s": cfg.nodes / join_cpu, "renewals": len(latencies),
            "renewals_per_s": len(latencies) / wall, "renewals_per_cpu_s": len(latencies) / cpu,
            "daemon_cpu_share": cpu / wall, "p50_ms": 1e3 * latencies[len(latencies) // 2],
            "p99_ms": 1e3 * latencies[int(len(latencies) * 0.99)],
            "daemon_rss_bytes": _rss(pid)}


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def run(cfg: TrackerConfig, json_path: str | None = None) -> int:
    from ..localswarm import LocalSwarm
    from ..swarm.leases import DEFAULT_TTL, renew_interval

    print("sparrowd bench tracker")
    print(f"machine: {os.cpu_count()} CPUs, python {sys.version.split()[0]}")
    print("\n1. the lease table in process, one core (TrackerService, 8 regions, a list of 32 peers in one renewal "
          "in six; joins signed, renewals sealed with the session's HMAC)\n")
    print(f"   {'nodes':>7} {'store':>8} {'joins/s':>9} {'renewals/s':>11} {'python B/lease':>15} "
          f"{'db B/lease':>11}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="sparrowd-bench-tracker-") as tmp:
        for n in cfg.sizes:
            for store, signed in ((False, False), (True, False), (True, True)):
                r = _in_process(n, cfg.renewals, store, Path(tmp), signed=signed)
                rows.append(r)
                print(f"   {n:>7,} {'sqlite' if store else 'none':>8} {r['joins_per_s']:>9,.0f} "
                      f"{r['renewals_per_s']:>11,.0f} {r['python_bytes_per_lease']:>15,.0f} "
                      f"{r['db_bytes_per_lease']:>11,.0f}{'   renewals signed (comparison)' if signed else ''}")

    print(f"\n2. over HTTP: a trainer daemon on loopback, {cfg.nodes:,} fake nodes, {cfg.concurrency} connections, "
          f"renewing for {cfg.seconds:g} s\n")
    with LocalSwarm(prefix="sparrowd-bench-tracker-") as sw:
        # Leases that outlast the join phase (10,000 joins over HTTP take longer than a default TTL
        # on a small box): the renewals then measured are of live leases. Capacity is figured at the
        # default TTL's interval below.
        d = sw.trainer("--lease-ttl", "600")
        token = sw.token_file.read_text().strip()
        http = asyncio.run(_http_load(sw.url, token, d.proc.pid, cfg))
    print(f"   joins:    {http['joins_per_s']:,.0f}/s wall, {http['joins_per_cpu_s']:,.0f} per second of daemon CPU")
    print(f"   renewals: {http['renewals_per_s']:,.0f}/s wall, {http['renewals_per_cpu_s']:,.0f} per second of daemon "
          f"CPU (the daemon used {http['daemon_cpu_share']:.0%} of a core); latency p50 {http['p50_ms']:.1f} ms, "
          f"p99 {http['p99_ms']:.1f} ms")
    print(f"   daemon memory with {cfg.nodes:,} leases: {http['daemon_rss_bytes'] / 2**20:,.0f} MiB RSS")

    interval = renew_interval(DEFAULT_TTL)
    capacity = int(http["renewals_per_cpu_s"] * cfg.headroom * interval)
    sqlite_rows = [r for r in rows if r["store"] and not r["signed"]]
    per_lease = max(r["python_bytes_per_lease"] + r["db_bytes_per_lease"] for r in sqlite_rows)
    print(f"\n3. one tracker at the default TTL ({DEFAULT_TTL:g} s, renewals every {interval:g} s), renewals taking "
          f"at most {cfg.headroom:.0%} of a core:")
    print(f"   about {capacity:,} nodes; the table's memory for them about {capacity * per_lease / 2**20:,.0f} MiB")
    print(f"   (on a whole core: about {int(http['renewals_per_cpu_s'] * interval):,} nodes)")
    target = 10_000
    verdict = "PASS" if capacity >= target else "MISS"
    print(f"\n   target: one tracker holds {target:,} nodes at the default TTL: {capacity:,}  {verdict}")
    if json_path:
        write_json(json_path, {"config": cfg.__dict__, "in_process": rows, "http": http,
                               "renew_interval": interval, "capacity_nodes": capacity,
                               "target": {"nodes": target, "pass": capacity >= target}})
    return 0
