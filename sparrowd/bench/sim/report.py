"""Runs for ``sparrowd bench sim``: the rows of a run, the printed lines, the JSON and the SVG plot.
"""

from __future__ import annotations

import math
import time

from ...sizes import format_bytes, format_rate
from ...swarm.push import DEFAULT_PUSH
from .. import ratio_text
from .core import Sim
from .model import MB, Config

__all__ = ["simulate", "run"]


def simulate(cfg: Config, progress=None) -> list[dict]:
    return Sim(cfg).run(progress=progress)


def _svg(points: dict[str, list[tuple[int, float]]], path: str) -> None:
    """A small line plot (log N against time to all over the bound), with no plotting library."""
    from pathlib import Path

    from ...checkpoint import atomic_file

    w, h, m = 560, 320, 50
    xs = [x for pts in points.values() for x, _ in pts]
    ys = [y for pts in points.values() for _, y in pts] + [1.0, 1.25]
    lx0, lx1 = math.log10(min(xs)), math.log10(max(xs)) + 1e-9
    y1 = max(ys) * 1.1

    def px(x):
        return m + (math.log10(x) - lx0) / (lx1 - lx0) * (w - 2 * m)

    def py(y):
        return h - m - y / y1 * (h - 2 * m)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
           f'font-size="12"><rect width="{w}" height="{h}" fill="white"/>',
           f'<line x1="{m}" y1="{h - m}" x2="{w - m}" y2="{h - m}" stroke="black"/>',
           f'<line x1="{m}" y1="{m}" x2="{m}" y2="{h - m}" stroke="black"/>',
           f'<line x1="{m}" y1="{py(1.25):.1f}" x2="{w - m}" y2="{py(1.25):.1f}" stroke="gray" '
           f'stroke-dasharray="4 3"/><text x="{w - m - 70}" y="{py(1.25) - 4:.1f}" fill="gray">target 1.25x</text>']
    for x in sorted(set(xs)):
        out.append(f'<text x="{px(x):.1f}" y="{h - m + 16}" text-anchor="middle">{x}</text>')
    for i in range(0, int(y1 * 2) + 1):
        y = i / 2
        out.append(f'<text x="{m - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
    out.append(f'<text x="{w / 2}" y="{h - 10}" text-anchor="middle">rollout nodes (log scale)</text>')
    out.append(f'<text x="14" y="{h / 2}" transform="rotate(-90 14 {h / 2})" text-anchor="middle">'
               'time to all / bound</text>')
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    for (name, pts), col in zip(points.items(), colours):
        pts = sorted(pts)
        path_d = " ".join(f"{'M' if i == 0 else 'L'}{px(x):.1f},{py(y):.1f}" for i, (x, y) in enumerate(pts))
        out.append(f'<path d="{path_d}" fill="none" stroke="{col}" stroke-width="2"/>')
        for x, y in pts:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{col}"/>')
        out.append(f'<text x="{m + 10}" y="{m + 14 + 16 * list(points).index(name)}" fill="{col}">{name}</text>')
    out.append("</svg>")
    with atomic_file(Path(path)) as tmp:
        tmp.write_text("\n".join(out) + "\n")


def run(*, nodes: list[int], regions: int, patch_mib: list[float], versions: int, chunk: int | None,
        trainer_rate: float, node_rate: float, wan_rate: float, link_rate: float, rtt: float, churn: float,
        seed: int, json_path: str | None = None, plot: str | None = None, cut_through: bool = True,
        trace_path: str | None = None, push: tuple[int, int] = DEFAULT_PUSH, burst: float = 0.0) -> int:
    from .. import relaying, write_json, write_lines

    results, traces = [], []
    print(f"sparrowd bench sim: {regions} regions, trainer uplink {format_rate(trainer_rate)}, nodes "
          f"{format_rate(node_rate)} ({format_rate(wan_rate)} to other regions), links "
          f"{format_rate(link_rate)}, RTT {rtt * 1000:.0f} ms, relays {relaying(cut_through, push, burst)}"
          + (f", {churn:.0%} of the nodes leave mid-version" if churn else ""))
    for p in patch_mib:
        for n in nodes:
            cfg = Config(nodes=n, regions=regions, patch=int(p * MB), chunk=chunk, versions=versions,
                         trainer_rate=trainer_rate, node_rate=node_rate, wan_rate=wan_rate, link_rate=link_rate,
                         rtt=rtt, churn=churn, seed=seed, cut_through=cut_through, trace=trace_path is not None,
                         push=push, burst=burst)
            t = time.monotonic()
            sim = Sim(cfg)

            def row(r, n=n, p=p, cfg=cfg) -> None:
                r.update(patch_mib=p, rollouts=n, regions=regions)
                results.append(r)
                star = n * cfg.patch / cfg.trainer_rate + rtt
                print(f"   {n:>6} nodes, {format_bytes(cfg.patch):>9} in {r['chunks']:>3} chunks, version "
                      f"{r['version']}: all in {r['seconds']:7.2f} s ({r['time_over_bound']:.2f}x the bound of "
                      f"{cfg.bound:.2f} s{'' if r['all_done'] else ', NOT ALL'}; star {star / r['seconds']:.0f}x "
                      f"slower); trainer {r['trainer_upload_over_patch']:.2f}x the patch; cross-region "
                      f"{ratio_text(r['cross_region_over_r_minus_1'])} (R-1) x patch"
                      + (f"; {r['left']} left mid-version" if r["left"] else ""), flush=True)

            def tick(version: int, simulated: float, holding: int, live: int, n=n, cfg=cfg) -> None:
                print(f"   {n:>6} nodes, version {version}: {holding} of {live} hold it {simulated:.2f} s in (the "
                      f"bound {cfg.bound:.2f} s; {time.monotonic() - t:.0f} s of simulating so far)", flush=True)

            sim.run(progress=row, tick=tick)
            wall = time.monotonic() - t
            if sim.trace is not None:
                traces += [{"patch_mib": p, "rollouts": n, **e} for e in sim.trace]
            print(f"          (simulated in {wall:.1f} s)", flush=True)
    if plot:
        series: dict[str, list[tuple[int, float]]] = {}
        for r in results:
            if r["version"] == versions:
                series.setdefault(f"{r['patch_mib']:g} MiB", []).append((r["rollouts"], r["time_over_bound"]))
        _svg(series, plot)
        print(f"   plot written to {plot}")
    if json_path:
        write_json(json_path, {"runs": results})
    if trace_path:
        write_lines(trace_path, traces)
        print(f"   {len(traces)} request events written to {trace_path}")
    return 0
