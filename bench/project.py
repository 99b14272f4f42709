"""The RL step at the SparrowRL paper's model sizes, projected from sparrowd's figures (docs/PERFORMANCE.md,
"Projected to the paper's sizes"). It sets the paper's sizes beside its claims and sizes nothing, so it is
not installed::

    python bench/project.py [--wan-gbps 1] [--nodes-per-region 2] [--on-policy] [--json FILE] ...

A model, not a measurement: step time per strategy for Qwen3-4B, 8B and 14B at
about 1% density, computed from link rates, a generation and a training time
per step (parameters), and the figures sparrowd measures on this machine
(``bench codec``, ``bench apply``, ``bench swarm``; their README values are
the defaults). Pure code: ``project`` returns the rows, ``run`` prints them.

One step, one-step off-policy (the transfer of version v overlaps generation
on v-1, as in ``bench rl``)::

    step = publish + max(generate + train, transfer + apply)

and on-policy ``step = generate + train + publish + transfer + apply``, where
per strategy:

* ``full``: the whole bf16 checkpoint (2 bytes a parameter) crosses the WAN
  once per remote region (a relay tree inside each region, the best case
  for broadcast), then once over the region's LAN; the engines load it at
  ``load_gbps``;
* ``star``: the sparse patch (density x parameters x bits per changed element)
  goes from the trainer to every remote node over its WAN uplink;
* ``swarm``: the patch over the trainer's uplink once, times the measured
  swarm time over its bound, plus one RTT;
* ``ideal``: the whole checkpoint over a datacenter's RDMA fabric.

Patches also cost the trainer's diff+encode and the rollout's decode (both
rated in bytes of the dense model per second, as ``bench codec`` and ``bench
publish`` rate them) and the engine's scatter.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, dataclass, field, fields
from typing import TypedDict

from sparrowd.bench import write_json
from sparrowd.cli.bench import json_file
from sparrowd.errors import InputError, SparrowError
from sparrowd.sizes import format_bytes

__all__ = ["Assumptions", "MODELS", "PAPER", "project", "run", "main"]

MODELS = {"Qwen3-4B": 4.02e9, "Qwen3-8B": 8.19e9, "Qwen3-14B": 14.77e9}  # parameters


class _Paper(TypedDict):
    speedup_vs_full: tuple[float, float]  # throughput over full broadcast, lowest and highest
    gap_to_ideal: float
    tokens_per_dollar: tuple[float, float]


PAPER: _Paper = {"speedup_vs_full": (2.4, 9.5), "gap_to_ideal": 0.0891, "tokens_per_dollar": (1.21, 1.59)}


@dataclass
class Assumptions:
    wan_gbps: float = 1.0  # between regions, per link
    lan_gbps: float = 10.0  # inside a region
    rdma_gbps: float = 400.0  # the ideal single datacenter
    rtt: float = 0.08
    remote_regions: int = 3  # rollout regions other than the trainer's
    nodes_per_region: int = 2
    density: float = 0.01
    generate_seconds: float = 60.0  # per step: a parameter
    train_seconds: float = 30.0  # per step: a parameter
    on_policy: bool = False
    # sparrowd's own figures (README): the trainer's and the engine's on an H200 box (bench/gpu.sh),
    # the codec's and the swarm's on the 2-CPU machine
    bits_per_changed: float = 10.46  # bench codec, ulp, real AdamW deltas
    encode_gbps: float = 4.29 / 0.34 * 8  # bench publish --device cuda: 4 GiB a step in 0.34 s at worst -> Gbit/s
    decode_gbps: float = 17.2 / 4.5 * 8  # the daemon's decode of an 8.6B model's 1% patch for its engine: 4.5 s
    apply_elements_per_s: float = 85.3e6 / 1.0  # bench apply --engine torch --device cuda: 85.3M in 1.0 s at worst
    swarm_over_bound: float = 1.3  # bench swarm: time to all / (patch over the trainer's uplink + RTT)
    load_gbps: float = 17.2 / 2.37 * 8  # the same engine reloading all 17.2 GB from the page cache: 2.37 s


@dataclass
class Row:
    model: str
    params: float
    patch_bytes: float
    step: dict = field(default_factory=dict)  # strategy -> seconds per step
    transfer: dict = field(default_factory=dict)  # strategy -> transfer + apply seconds

    @property
    def speedup_vs_full(self) -> float:
        return self.step["full"] / self.step["swarm"]

    @property
    def gap_to_ideal(self) -> float:
        return self.step["swarm"] / self.step["ideal"] - 1


def _secs(nbytes: float, gbps: float) -> float:
    return nbytes * 8 / (gbps * 1e9)


def project(a: Assumptions, models: dict[str, float] = MODELS) -> list[Row]:
    rows = []
    for name, params in models.items():
        dense = 2 * params
        changed = a.density * params
        patch = changed * a.bits_per_changed / 8
        remote = a.remote_regions * a.nodes_per_region
        codec = _secs(dense, a.encode_gbps)  # the trainer's diff+encode reads the dense weights
        engine = _secs(dense, a.decode_gbps) + changed / a.apply_elements_per_s  # decode: GB/s of the dense model
        transfer = {
            "full": a.remote_regions * _secs(dense, a.wan_gbps) + _secs(dense, a.lan_gbps) + _secs(dense, a.load_gbps),
            "star": remote * _secs(patch, a.wan_gbps) + a.rtt + engine,
            "swarm": a.swarm_over_bound * (_secs(patch, a.wan_gbps) + a.rtt) + engine,
            "ideal": _secs(dense, a.rdma_gbps) + _secs(dense, a.load_gbps),
        }
        publish = {"full": 0.0, "star": codec, "swarm": codec, "ideal": 0.0}
        work = a.generate_seconds + a.train_seconds
        step = {k: publish[k] + (work + t if a.on_policy else max(work, t)) for k, t in transfer.items()}
        rows.append(Row(name, params, patch, step, transfer))
    return rows


def run(a: Assumptions | None = None, *, json_path: str | None = None) -> int:
    a = a or Assumptions()
    rows = project(a)
    print(f"bench/project.py: {a.remote_regions} rollout regions x {a.nodes_per_region} nodes, WAN "
          f"{a.wan_gbps:g} Gbit/s, LAN {a.lan_gbps:g} Gbit/s, ideal RDMA {a.rdma_gbps:g} Gbit/s, RTT "
          f"{a.rtt * 1000:.0f} ms; {100 * a.density:g}% of elements change per step; generation "
          f"{a.generate_seconds:g} s + training {a.train_seconds:g} s per step (assumed); "
          f"{'on-policy' if a.on_policy else 'one-step off-policy'}")
    print(f"   sparrowd's figures: {a.bits_per_changed} bits per changed element, diff+encode "
          f"{a.encode_gbps / 8:.1f} GB/s, decode {a.decode_gbps / 8:.1f} GB/s, scatter "
          f"{a.apply_elements_per_s / 1e6:.0f}M elements/s, swarm {a.swarm_over_bound}x its bound")
    print(f"\n   {'model':<10}{'patch':>10}  {'transfer s: full':>16}{'star':>8}{'swarm':>8}{'ideal':>8}"
          f"   {'step s: full':>12}{'star':>8}{'swarm':>8}{'ideal':>8}   swarm/full  gap to ideal")
    for r in rows:
        t, s = r.transfer, r.step
        print(f"   {r.model:<10}{format_bytes(r.patch_bytes):>10}  {t['full']:16.1f}{t['star']:8.1f}{t['swarm']:8.2f}"
              f"{t['ideal']:8.2f}   {s['full']:12.1f}{s['star']:8.1f}{s['swarm']:8.1f}{s['ideal']:8.1f}"
              f"   {r.speedup_vs_full:9.2f}x  {100 * r.gap_to_ideal:10.1f}%")
    lo, hi = PAPER["speedup_vs_full"]
    print(f"\n   SparrowRL reports {lo}-{hi}x the throughput of full broadcast and {100 * PAPER['gap_to_ideal']:.2f}% "
          f"from an ideal single datacenter (Qwen3 4B-14B, up to four regions).")
    if json_path:
        write_json(json_path, {"assumptions": asdict(a), "paper": PAPER,
                               "rows": [{**asdict(r), "speedup_vs_full": r.speedup_vs_full,
                                         "gap_to_ideal": r.gap_to_ideal} for r in rows]})
    return 0


def main(argv: list[str] | None = None) -> int:
    d = Assumptions()
    p = argparse.ArgumentParser(
        prog="bench/project.py",
        description="Compute step time per strategy (full broadcast, star, swarm, ideal) for Qwen3-4B, 8B and "
                    "14B from link rates, generation and training time per step, and sparrowd's measured figures "
                    "(bits per changed element, codec and apply throughput, swarm time over its bound), beside "
                    "the paper's numbers. A model, not a measurement: its assumptions are printed.")
    for name, help in (("wan_gbps", "between regions, Gbit/s"), ("lan_gbps", "inside a region, Gbit/s"),
                       ("rdma_gbps", "the ideal datacenter's fabric, Gbit/s"),
                       ("generate_seconds", "generation per step, s"), ("train_seconds", "training per step, s"),
                       ("density", "share of elements changed per step"),
                       ("bits_per_changed", "bits per changed element (bench codec)"),
                       ("swarm_over_bound", "swarm time to all over its bound (bench swarm)")):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(d, name),
                       help=f"{help} (default {getattr(d, name):g})")
    for name, help in (("remote_regions", "rollout regions other than the trainer's"),
                       ("nodes_per_region", "rollout nodes per region")):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name),
                       help=f"{help} (default {getattr(d, name)})")
    p.add_argument("--on-policy", action="store_true", help="no overlap of transfer and generation")
    p.add_argument("--json", metavar="FILE", type=json_file, help="also write the table as JSON")
    args = p.parse_args(argv)
    kw = {f.name: getattr(args, f.name) for f in fields(Assumptions) if hasattr(args, f.name)}
    try:
        bad = [k for k, v in kw.items() if not isinstance(v, bool) and not (math.isfinite(v) and v > 0)]
        if bad or not kw["density"] <= 1:
            raise InputError(f"--{(bad or ['density'])[0].replace('_', '-')} must be positive (density at most 1)")
        return run(Assumptions(**kw), json_path=args.json)
    except SparrowError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
