"""``sparrowd bench swarm``: a trainer and N rollout daemons on loopback, against star distribution.

Every daemon is a separate ``sparrowd run`` process on loopback, each region
in its own 127.(10+r).0.0/16 block. The WAN between regions is emulated by
``sparrowd.bench.wan``: TCP proxies that add ``--rtt`` between regions and
shape each ordered pair of regions to ``--link-rate`` (the kernel here has no
netem; tbf and htb shape bandwidth, not delay). Uplinks are the daemons' own
limits: the trainer's (``--trainer-rate``), every rollout node's
(``--node-rate``) and its uploads to other regions (``--wan-rate``), each
letting ``--rate-burst`` seconds of its rate go at once (the daemons' 0.1 by
default; 0 holds them to their steady rates, as ``bench sim``'s links).

For each version it reports the time from ``publish`` until every node holds
the version, beside the lower bound (patch size over the trainer's uplink,
plus one round trip where there are regions to cross);
the bytes the trainer uploaded over the patch size; the bytes that
crossed regions over (R - 1) x patch size, R the regions that hold a
rollout; and, in ``--json``, the requests each daemon served, by endpoint. In the same run, star distribution
is measured: N clients, spread over the regions like the nodes, pull every
chunk straight from the trainer's daemon through the same emulated WAN, as a
broadcast without relaying would.

The patch is a dense one (a new, incompressible tensor), so its size is
exactly what the flags ask for and the codec plays no part in the timing.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from ..checkpoint import atomic_file
from ..client import publish_file
from ..codec.bits import RawTensor
from ..codec.patch import auto_chunk_size, encode_patch
from ..codec.patchfile import parse_patch, patch_parts
from ..localswarm import free_port
from ..sizes import format_bytes, format_rate, parse_size
from ..swarm.bucket import DEFAULT_BURST
from ..swarm.push import DEFAULT_PUSH
from . import cross_region_over, ratio_text, relaying, write_json

MB = 1 << 20


def _addr(region: int, kind: int, j: int) -> str:
    """127.(10+region).kind.(j+1): kind 0 a daemon, 1 its WAN proxy, 2 a star client."""
    return f"127.{10 + region}.{kind}.{j + 1}"


def _get(url: str, token: str, timeout: float = 5.0) -> bytes:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def _status(tracker: str, token: str) -> dict:
    return json.loads(_get(f"{tracker}/v1/tracker/status", token))


def metric(url: str, token: str, name: str) -> float:
    text = _get(f"{url}/metrics", token).decode()
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M))


def requests_served(urls: list[str], token: str) -> dict[str, float]:
    """HTTP requests the daemons at ``urls`` have served so far, by endpoint (summed over them)."""
    out: dict[str, float] = {}
    for u in urls:
        text = _get(f"{u}/metrics", token).decode()
        for endpoint, v in re.findall(r'^sparrowd_http_requests_total{endpoint="([^"]*)",[^}]*} ([0-9.e+]+)$', text,
                                      re.M):
            out[endpoint] = out.get(endpoint, 0.0) + float(v)
    return out


def _write_patch(path: Path, version: int, size: int, chunk: int, rng) -> int:
    data = rng.integers(0, 256, size, dtype=np.uint8)
    new = {f"bench.v{version}": RawTensor("U8", (size,), data)}
    m, chunks = encode_patch({}, new, version=version, base_version=version - 1 if version > 1 else 0,
                             chunk_size=chunk)
    with open(path, "wb") as f:
        for part in patch_parts(m, [c.data for c in chunks]):
            f.write(part)
    return m.patch_bytes


def _cpu_seconds(procs: list[subprocess.Popen]) -> float:
    """User + system CPU time the processes have used so far (Linux /proc)."""
    total = 0
    for p in procs:
        try:
            fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


class _Procs:
    def __init__(self, root: Path):
        self.root = root
        self.procs: list[subprocess.Popen] = []

    def start(self, *args: str, name: str) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "wb")
        p = subprocess.Popen([sys.executable, "-m", "sparrowd.cli.main", *args], stdout=log, stderr=log)
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def _wait(pred, timeout: float, what: str, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


async def _star(trainer: str, token: str, version: int, manifest, clients: int, regions: int) -> float:
    """N clients, spread over the regions, each pull every chunk of ``version`` from the trainer.
    Each joins the swarm with a key of its own first, as any member must, proves it on every
    request, and renews its lease while it pulls (a star outlasts a lease: unrenewed, every client
    was refused as no member once its lease ran out, and the run never ended); the clock starts
    once all have joined."""
    import aiohttp
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from ..daemon.membership import HttpTrackerClient
    from ..daemon.swarm import REGION_HEADER
    from ..schema import pack
    from ..swarm.identity import NodeKey, peer_headers, seal
    from ..swarm.versions import to_bitmap

    n = len(manifest.chunks)
    tracker = HttpTrackerClient(trainer, token)
    keys = [NodeKey(Ed25519PrivateKey.generate()) for _ in range(clients)]
    trainer_id: str | None = None
    epochs: list[int] = []
    tickets: list[str] = []
    every = 1.0

    async def renew() -> None:
        while True:
            await asyncio.sleep(every)
            for k, key in enumerate(keys):
                reply = await tracker.renew(seal(key, "renew", {"node_id": f"star-{k}", "epoch": epochs[k],
                                                                "ts": time.time()}))
                tickets[k] = reply["ticket"]

    async def client(k: int, session) -> None:
        hdr = {REGION_HEADER: "star"}
        have: set[int] = set()
        assert trainer_id is not None  # every client joined, and learnt it, before the clients start
        while len(have) < n:
            hdr.update(peer_headers(keys[k], f"star-{k}", trainer_id, tickets[k], epochs[k], time.time()))
            msg = {"node_id": f"star-{k}", "region": "star", "after": -1, "wait": 0,
                   "versions": [{"version": version, "statements": 0, "have": to_bitmap(have, n),
                                 "fetching": b""}]}
            async with session.post(f"{trainer}/v1/swarm/exchange", data=pack(msg),
                                    headers={**hdr, "Content-Type": "application/msgpack"}) as r:
                await r.read()
            for i in range(n):
                if i in have:
                    continue
                async with session.get(f"{trainer}/v1/swarm/chunk/{version}/{i}", headers=hdr) as r:
                    if r.status == 200:
                        await r.read()
                        have.add(i)
                    else:
                        await r.read()
                        await asyncio.sleep(0.2)
                        break

    sessions = []
    renewing = None
    try:
        for k, key in enumerate(keys):
            reply = await tracker.join(seal(key, "join", {
                "node_id": f"star-{k}", "role": "rollout", "region": "star", "address": f"{_addr(k % regions, 2, k)}:9",
                "key": key.public, "ts": time.time()}))
            trainer_id = next(p["node_id"] for p in reply["peers"] if p["role"] == "trainer")
            epochs.append(int(reply["epoch"]))
            tickets.append(reply["ticket"])
            every = float(reply["renew_interval"])
        renewing = asyncio.create_task(renew())
        sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(_addr(k % regions, 2, k), 0)))
                    for k in range(clients)]
        t0 = time.monotonic()
        pulls = asyncio.gather(*(client(k, sessions[k]) for k in range(clients)))
        waiting: list[asyncio.Future[Any]] = [pulls, renewing]
        done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if pulls not in done:  # a renewal failed: every client would be refused from then on
            pulls.cancel()
            renewing.result()  # raises why
        pulls.result()
        return time.monotonic() - t0
    finally:
        if renewing is not None:
            renewing.cancel()
        for s in sessions:
            await s.close()
        await tracker.close()


def scaled(factor: float, rates: dict[str, int], seconds: tuple[float, ...]) -> tuple[dict[str, int], tuple]:
    """The same swarm ``factor`` times slower: every rate divided by it (0, no limit, stays 0), every
    time (round trip, bursts, waits) multiplied. Each version's bound grows by ``factor`` while the
    daemons' own cost per hop (their CPU time, on a box they share) does not, so comparing a run
    with its scaled twin tells what the box costs from what the design does; the patch's cut is
    the same (the trainer's uplink times the round trip is unchanged)."""
    if factor == 1:
        return rates, seconds
    return ({k: max(1, round(v / factor)) if v else 0 for k, v in rates.items()},
            tuple(t * factor for t in seconds))


def run(*, nodes: int = 16, regions: int = 4, patch_mib: float = 64, versions: int = 2, chunk: str = "auto",
        trainer_rate: str = "4M", node_rate: str = "8M", wan_rate: str = "4M", rtt: float = 0.08,
        link_rate: str = "32M", star: bool = True, cut_through: bool = True, push: tuple[int, int] = DEFAULT_PUSH,
        json_path: str | None = None, keep: bool = False, log_level: str = "warning", interval: float = 0.0,
        settle: float = 0.0, rate_burst: float = DEFAULT_BURST, lease_ttl: float | None = None,
        time_scale: float = 1.0) -> int:
    """``rate_burst``: the daemons' ``--rate-burst`` (0: uplinks that never burst, as ``bench sim``'s
    fluid links); ``lease_ttl``: their lease TTL (default: theirs), for tests of a run that outlasts one.
    ``time_scale``: the same swarm that many times slower (``scaled``)."""
    rates = {k: parse_size(v) for k, v in (("trainer", trainer_rate), ("node", node_rate), ("wan", wan_rate),
                                           ("link", link_rate))}
    rates, (rtt, rate_burst, settle, interval) = scaled(time_scale, rates, (rtt, rate_burst, settle, interval))
    limits = ["--rate-burst", str(rate_burst)] + (["--lease-ttl", str(lease_ttl)] if lease_ttl else [])
    root = Path(tempfile.mkdtemp(prefix="sparrowd-bench-swarm-"))
    procs = _Procs(root)
    token_file = root / "swarm.token"
    with atomic_file(token_file, private=True) as tmp:
        tmp.write_text(secrets.token_hex(24) + "\n")
    token = token_file.read_text().strip()
    t_host, t_proxy = _addr(0, 0, 100), _addr(0, 1, 100)
    port = free_port(t_host)
    direct = f"http://{t_host}:{port}"  # the bench's own calls; nodes go through the WAN proxy
    tracker = f"http://{t_proxy}:{port}"
    region_names = [f"region{i}" for i in range(regions)]
    rng = np.random.default_rng(0)
    print(f"sparrowd bench swarm: {nodes} rollout daemons in {regions} regions + a trainer, on loopback, "
          f"{os.cpu_count()} CPUs")
    print(f"   emulated links: trainer uplink {format_rate(rates['trainer'])}, node uplinks "
          f"{format_rate(rates['node'])}, cross-region uploads {format_rate(rates['wan'])} per node; "
          f"between regions {rtt * 1000:.0f} ms RTT and {format_rate(rates['link'])} per direction; relays "
          + relaying(cut_through, push, rate_burst) + ("" if rate_burst else "; limits never burst")
          + (f"; time scaled {time_scale:g}x (rates / {time_scale:g}, times x {time_scale:g})"
             if time_scale != 1 else ""))
    patches = []
    for v in range(1, versions + 1):
        p = root / f"v{v}.sprw"
        size = int(patch_mib * MB)
        auto = auto_chunk_size(size, nodes, send_rate=rates["trainer"], round_trip=rtt if regions > 1 else None)
        _write_patch(p, v, size, auto if chunk == "auto" else parse_size(chunk), rng)
        patches.append(p)
    results: list[dict[str, Any]] = []
    try:
        proxies = [{"listen": [t_proxy, port], "target": [t_host, port], "region": 0}]
        listen = []
        for i in range(nodes):
            r, j = i % regions, i // regions
            host = _addr(r, 0, j)
            node_port = free_port(host)
            listen.append((host, node_port))
            proxies.append({"listen": [_addr(r, 1, j), node_port], "target": [host, node_port], "region": r})
        (root / "wan.json").write_text(json.dumps({"proxies": proxies, "rtt": rtt, "link_rate": rates["link"]}))
        wan_proc = subprocess.Popen([sys.executable, "-m", "sparrowd.bench.wan", str(root / "wan.json")],
                                    stdout=subprocess.PIPE, stderr=open(root / "wan.log", "wb"))
        procs.procs.append(wan_proc)
        assert wan_proc.stdout is not None  # (stdout=PIPE)
        if wan_proc.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"the WAN emulator did not start; see {root / 'wan.log'}")
        procs.start("run", "--role", "trainer", "--region", region_names[0], "--listen", f"{t_host}:{port}",
                    "--advertise", f"{t_proxy}:{port}", "--data-dir", str(root / "trainer"), "--token-file",
                    str(token_file), "--node-id", "trainer", "--upload-rate", str(rates["trainer"]),
                    "--wan-upload-rate", str(rates["wan"]), "--log-level", log_level, *limits, name="trainer")
        _wait(lambda: (root / "trainer" / "daemon.json").exists(), 30, "the trainer")
        for i, (host, node_port) in enumerate(listen):
            r, j = i % regions, i // regions
            procs.start("run", "--role", "rollout", "--region", region_names[r], "--listen", f"{host}:{node_port}",
                        "--advertise", f"{_addr(r, 1, j)}:{node_port}", "--data-dir", str(root / f"n{i}"),
                        "--token-file", str(token_file), "--node-id", f"n{i}", "--tracker", tracker,
                        "--upload-rate", str(rates["node"]), "--wan-upload-rate", str(rates["wan"]),
                        "--current", "off",
                        "--cut-through", "on" if cut_through else "off", "--push", ",".join(map(str, push)),
                        "--log-level", log_level, *limits,
                        name=f"n{i}")
        _wait(lambda: len(_status(direct, token)["nodes"]) == nodes + 1, 60, "every node to join")
        time.sleep(settle)  # a swarm that has just formed is still opening its connections
        node_urls = [json.loads((root / f"n{i}" / "daemon.json").read_text())["url"] for i in range(nodes)]
        up_before, wan_before = 0.0, 0.0
        everyone = [direct] + node_urls
        served_before = requests_served(everyone, token)

        def _trainer_up() -> float:
            return metric(direct, token, 'sparrowd_bytes_total{direction="up",region_class="same"}') + metric(
                direct, token, 'sparrowd_bytes_total{direction="up",region_class="other"}')
        for n, p in enumerate(patches):
            if n and interval > 0:
                time.sleep(interval)  # an RL step's length between publishes: connections idle meanwhile
            view = parse_patch(p.read_bytes())
            m = view.manifest
            # Published from this process (as `sparrowd publish` does it): a command's own start-up,
            # a few tenths of a second on this machine, is not the swarm's time.
            t0, wall0, cpu0 = time.monotonic(), time.time(), _cpu_seconds(procs.procs)
            publish_file(p, direct, token)
            trainer_done = None
            held_at: dict[str, float] = {}

            def everyone_holds() -> bool:
                nonlocal trainer_done
                if trainer_done is None and _trainer_up() - up_before >= m.patch_bytes:
                    trainer_done = time.monotonic() - t0
                # Asked of the nodes themselves, each saying when it came to hold the version (the
                # tracker hears of versions only at renewals; polling alone would add up to a poll's
                # period, a third of a one-chunk version's bound).
                for u in node_urls:
                    if u not in held_at:
                        info = json.loads(_get(f"{u}/v1/node", token))
                        if m.version in info["versions"]:  # when it said so, or failing that, now
                            held_at[u] = info.get("held_at", {}).get(str(m.version)) or time.time()
                return len(held_at) == len(node_urls)

            _wait(everyone_holds, 600, f"every node to hold version {m.version}", every=0.05)
            elapsed = max(held_at.values()) - wall0
            busy = (_cpu_seconds(procs.procs) - cpu0) / (elapsed * (os.cpu_count() or 1))
            time.sleep(0.5)  # endgame losers end
            up = _trainer_up()
            wan = sum(metric(u, token, 'sparrowd_bytes_total{direction="down",region_class="other"}')
                      for u in node_urls)
            bound = m.patch_bytes / rates["trainer"] + (rtt if regions > 1 else 0.0)
            row: dict[str, Any] = {"version": m.version, "patch_bytes": m.patch_bytes, "chunks": len(m.chunks),
                   "seconds": elapsed, "trainer_sent_one_copy_seconds": trainer_done, "lower_bound_seconds": bound,
                   "time_over_bound": elapsed / bound,
                   "trainer_upload_over_patch": (up - up_before) / m.patch_bytes,
                   "cross_region_over_r_minus_1": cross_region_over(wan - wan_before, regions, nodes, m.patch_bytes),
                   "cpu_busy_fraction": busy}
            served = requests_served(everyone, token)
            row["requests_per_node"] = {k: (v - served_before.get(k, 0.0)) / len(everyone)
                                        for k, v in sorted(served.items()) if v > served_before.get(k, 0.0)}
            up_before, wan_before, served_before = up, wan, served
            results.append(row)
            print(f"   version {m.version}: {format_bytes(m.patch_bytes)} in {len(m.chunks)} chunks, all nodes in "
                  f"{elapsed:.1f} s (bound {bound:.1f} s, {row['time_over_bound']:.2f}x; the trainer had sent one copy "
                  f"after {trainer_done if trainer_done is not None else float('nan'):.1f} s); trainer uploaded "
                  f"{row['trainer_upload_over_patch']:.2f}x the patch; cross-region "
                  f"{ratio_text(row['cross_region_over_r_minus_1'])} (R-1) x patch; daemons and WAN emulator used "
                  f"{100 * busy:.0f}% of the {os.cpu_count()} CPUs", flush=True)
        star_row = None
        if star:
            last = parse_patch(patches[-1].read_bytes()).manifest
            print(f"   star: {nodes} clients each pulling version {last.version} from the trainer, about "
                  f"{nodes * last.patch_bytes / rates['trainer']:.0f} s at its uplink (--no-star skips this)...",
                  flush=True)
            t_star = asyncio.run(_star(tracker, token, last.version, last, nodes, regions))
            star_row = {"seconds": t_star, "over_swarm": t_star / results[-1]["seconds"]}
            print(f"   star (every node pulls every chunk from the trainer): {t_star:.1f} s, "
                  f"{star_row['over_swarm']:.1f}x the swarm's time", flush=True)
    finally:
        procs.stop()
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"   daemons' folders and logs kept in {root}")
    worst = {k: max(r[k] for r in results) for k in ("time_over_bound", "trainer_upload_over_patch")}
    # Swarm v2's targets (issue 19), for every patch size from one chunk up; the first wave's were
    # 1.5, 1.3 and 1.3 at 64 MiB.
    targets = [("time to all / lower bound", worst["time_over_bound"], 1.25, True),
               ("trainer upload / patch", worst["trainer_upload_over_patch"], 1.1, True)]
    if min(regions, nodes) > 1:
        targets.append(("cross-region bytes / ((R-1) x patch)",
                        max(r["cross_region_over_r_minus_1"] for r in results), 1.1, True))
    if star_row:
        targets.append(("star time / swarm time", star_row["over_swarm"], 4.0, False))
    print("\n   targets (worst version)")
    for name, value, limit, at_most in targets:
        ok = value <= limit if at_most else value >= limit
        print(f"   {name:<40} {value:6.2f}  {'<=' if at_most else '>='} {limit:<4} {'PASS' if ok else 'MISS'}")
    if json_path:
        write_json(json_path, {"versions": results, "star": star_row, "nodes": nodes,
                               "regions": regions, "rates": rates, "rtt": rtt, "push": list(push),
                               "interval": interval, "settle": settle, "rate_burst": rate_burst,
                               "time_scale": time_scale})
    return 0
