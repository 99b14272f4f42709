"""The soak: many daemons, many versions, nodes killed and restarted at random. Its figures are in
docs/RELIABILITY.md ("Soak"); it reproduces them and sizes nothing, so it is not installed::

    python bench/soak.py [--nodes 32] [--regions 3] [--versions 50] [--patch-kib 256] [--kill-every 5] [--json FILE]

A trainer and ``nodes - 1`` rollout daemons (separate processes) on loopback,
spread over ``regions``; ``versions`` versions published one after another
(each a fresh ``patch_kib`` KiB patch in ``chunk_kib`` KiB chunks). Every
``kill_every`` versions a random rollout node is killed with SIGKILL and
restarted on its data dir a few seconds later. It reports, per version, the
time from publish to every live node holding it (as the tracker sees it;
renewals come every half second), p50 and p99; the resident memory and open
files of the daemons at the start, the middle and the end; and checks that
every node alive at the end holds every retained version, bit-exact.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import blake3
import numpy as np

from sparrowd.bench import write_json
from sparrowd.cli.bench import json_file
from sparrowd.cli.checks import at_least
from sparrowd.client import http_call
from sparrowd.codec.bits import RawTensor
from sparrowd.codec.manifest import Manifest
from sparrowd.codec.patch import encode_patch
from sparrowd.errors import SparrowError
from sparrowd.localswarm import LocalDaemon, LocalSwarm

TTL = "1.5"  # short leases: the tracker hears of each new version within half a second


def _proc_figures(pid: int) -> tuple[int, int] | None:
    """Resident memory (bytes) and open descriptors of a process."""
    try:
        rss = next(int(line.split()[1]) * 1024 for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                   if line.startswith("VmRSS:"))
        fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
    except (OSError, StopIteration):
        return None
    return rss, fds


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def run(*, nodes: int = 32, regions: int = 3, versions: int = 50, patch_kib: int = 256, chunk_kib: int = 32,
        kill_every: int = 5, retain: int = 8, seed: int = 0, json_path: str | None = None) -> int:
    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    names = [f"r{i}" for i in range(regions)]
    rows: list[dict[str, Any]] = []
    samples: list[dict[str, Any]] = []
    manifests: dict[int, Manifest] = {}
    killed = restarted = 0
    t_all = time.monotonic()
    print(f"bench/soak.py: {nodes} daemons in {regions} regions on loopback, {versions} versions of "
          f"{patch_kib} KiB in {chunk_kib} KiB chunks, a node killed and restarted every {kill_every} versions; "
          f"starting the daemons...", flush=True)
    with LocalSwarm(prefix="sparrowd-soak-") as swarm:
        trainer = swarm.trainer("--lease-ttl", TTL, "--retain", str(retain), region=names[0])
        rollouts = [swarm.rollout(f"n{i:02d}", names[i % regions], "--retain", str(retain))
                    for i in range(nodes - 1)]
        swarm.wait_joined(nodes, timeout=120)
        token = swarm.token_file.read_text().strip()
        print(f"   all {nodes} joined after {time.monotonic() - t_all:.0f} s; publishing", flush=True)

        def sample(tag: str) -> None:
            figs = [f for d in [trainer, *rollouts] if d.proc.poll() is None and (f := _proc_figures(d.proc.pid))]
            samples.append({"at": tag, "rss_median": statistics.median(f[0] for f in figs),
                            "rss_max": max(f[0] for f in figs), "fds_median": statistics.median(f[1] for f in figs),
                            "fds_max": max(f[1] for f in figs)})

        sample("start")
        down: list[tuple[float, LocalDaemon]] = []  # (restart at, daemon)
        for v in range(1, versions + 1):
            size = patch_kib << 10
            data = np_rng.integers(0, 256, size, dtype=np.uint8)
            m, chunks = encode_patch({}, {f"soak.v{v}": RawTensor("U8", (size,), data)}, version=v,
                                     base_version=v - 1, chunk_size=chunk_kib << 10)
            manifests[v] = m
            t0 = time.monotonic()
            for i, c in enumerate(chunks):
                http_call(f"{swarm.url}/v1/publish/{v}/chunk/{i}", token, method="POST", data=c.data, timeout=30)
            http_call(f"{swarm.url}/v1/publish/manifest", token, method="POST", data=m.to_bytes(), timeout=30)
            if v % kill_every == 0:
                victim = rng.choice([d for d in rollouts if d.proc.poll() is None])
                swarm.kill(victim)
                killed += 1
                down.append((time.monotonic() + rng.uniform(2.0, 6.0), victim))
            deadline = t0 + 120
            while True:
                now = time.monotonic()
                for when, d in [x for x in down if x[0] <= now]:
                    swarm.restart(d)
                    restarted += 1
                    down.remove((when, d))
                live = {d.name for d in rollouts if d.proc.poll() is None and all(d is not x[1] for x in down)}
                snap = swarm.status()
                have = {n["node_id"] for n in snap["nodes"] if v in (n.get("versions") or [])}
                if live <= have:
                    rows.append({"version": v, "seconds_to_all": time.monotonic() - t0, "nodes": len(live)})
                    break
                if now > deadline:
                    raise RuntimeError(f"version {v} did not reach {sorted(live - have)} in 120 s; "
                                       f"logs in {swarm.root}")
                time.sleep(0.1)
            if v == versions // 2:
                sample("middle")
            if v % 10 == 0:
                recent = [r["seconds_to_all"] for r in rows[-10:]]
                print(f"   versions {v - 9}-{v}: to all nodes p50 {_pct(recent, 0.5):.2f} s, max {max(recent):.2f} s; "
                      f"{killed} killed, {restarted} restarted so far", flush=True)
        for _, d in down:
            swarm.restart(d)
            restarted += 1
        # Every node alive now ends with every retained version, bit-exact.
        kept = list(range(max(1, versions - retain + 1), versions + 1))
        deadline = time.monotonic() + 120
        while True:
            snap = swarm.status()
            done = [n for n in snap["nodes"] if n["role"] != "trainer" and set(kept) <= set(n.get("versions") or [])]
            if len(done) == nodes - 1:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(done)} of {nodes - 1} nodes hold versions {kept[0]}-{kept[-1]}")
            time.sleep(0.2)
        sample("end")
        bad = 0
        for d in rollouts:
            for v in kept:
                for i, entry in enumerate(manifests[v].chunks):
                    stored = (d.data_dir / "versions" / str(v) / "chunks" / f"{i}.chunk").read_bytes()
                    bad += blake3.blake3(stored).digest() != entry.hash
        if bad:
            raise RuntimeError(f"{bad} stored chunks do not match their manifests")
    times = [r["seconds_to_all"] for r in rows]
    print(f"\n   time to all live nodes per version: p50 {_pct(times, 0.5):.2f} s, p99 {_pct(times, 0.99):.2f} s, "
          f"max {max(times):.2f} s (status resolution about 0.5 s)")
    print(f"   {killed} nodes killed with SIGKILL and restarted; at the end all {nodes - 1} rollout nodes hold "
          f"versions {kept[0]}-{kept[-1]}, every chunk hash-checked")
    for s in samples:
        print(f"   {s['at']:>6}: RSS median {s['rss_median'] / (1 << 20):.0f} MiB, max {s['rss_max'] / (1 << 20):.0f} "
              f"MiB; open files median {s['fds_median']:.0f}, max {s['fds_max']}")
    print(f"   {time.monotonic() - t_all:.0f} s in all")
    if json_path:
        write_json(json_path, {"versions": rows, "samples": samples, "killed": killed})
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/soak.py",
                                description="Start a trainer and rollout daemons on loopback, publish versions one "
                                            "after another while killing (SIGKILL) and restarting a random node every "
                                            "few versions; report p50/p99 time to all nodes per version, memory and "
                                            "open files of the daemons, and check every node ends bit-exact with "
                                            "every retained version.")
    p.add_argument("--nodes", type=int, default=32, help="daemons, the trainer included (default 32)")
    p.add_argument("--regions", type=int, default=3, help="regions (default 3)")
    p.add_argument("--versions", type=int, default=50, help="versions to publish (default 50)")
    p.add_argument("--patch-kib", type=int, default=256, help="patch size per version in KiB (default 256)")
    p.add_argument("--kill-every", type=int, default=5, help="versions between kills (default 5)")
    p.add_argument("--json", metavar="FILE", type=json_file, help="also write the figures as JSON")
    args = p.parse_args(argv)
    try:
        at_least("--nodes", args.nodes, 2)  # the trainer and a rollout
        for flag, value in (("--regions", args.regions), ("--versions", args.versions),
                            ("--patch-kib", args.patch_kib), ("--kill-every", args.kill_every)):
            at_least(flag, value)
        return run(nodes=args.nodes, regions=args.regions, versions=args.versions, patch_kib=args.patch_kib,
                   kill_every=args.kill_every, json_path=args.json)
    except SparrowError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
