"""What ``sparrowd top`` shows, computed from status snapshots: pure, no terminal.

``TopView`` keeps the last snapshot (and shows it, with a notice, while the
tracker is unreachable), the sort and region filter the keys choose, and the
cross-region bytes since the latest version appeared. ``header`` and
``table`` turn it into lines and cells; the cells carry a style name
(``stale``, ``lagging``, ``error``, ``trainer``) that the front ends colour.
Both front ends (the live Textual app and ``--once``) use it, so what is
tested here is what is drawn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sparrowd.sizes import format_bytes

from .status import current_cell

SORTS = ("lag", "region", "rate")
COLUMNS = ("NODE", "ROLE", "REGION", "STATE", "HELD", "ENGINE", "CURRENT", "IN FLIGHT", "DOWN", "UP", "P", "TTL")
BAR = 4
_SHORT = {"trainer": "train", "rollout": "roll", "joining": "join"}


def rate(r: float | None) -> str:
    """Bytes per second in the IEC units every figure of the screen uses, in at most 5 characters
    (the B/s is the column's): 512Ki, 2.9Mi, 42Mi."""
    if not r:
        return "-"
    for unit in ("", "Ki", "Mi", "Gi", "Ti"):
        if r < 1000 or unit == "Ti":
            return f"{r:.1f}{unit}" if r < 10 and unit else f"{r:.0f}{unit}"
        r /= 1024
    raise AssertionError("unreachable")


def _held(vs: list[int]) -> str:
    if not vs:
        return "-"
    return str(vs[-1]) if len(vs) == 1 else f"{vs[0]}-{vs[-1]}"


def _bar(held: int, known: int) -> str:
    if known <= 0:
        return "-"
    frac = min(1.0, held / known)
    full = int(frac * BAR)
    return "█" * full + "░" * (BAR - full) + f"{int(frac * 100):3d}%"


def lag(node: dict, latest: int | None) -> int | None:
    engine = node.get("engine_version")
    if engine is None or latest is None:
        return None
    return max(0, latest - engine)


@dataclass
class Row:
    node_id: str
    cells: tuple[str, ...]
    style: str  # "", "trainer", "lagging", "stale", "error"


@dataclass
class TopView:
    tracker: str
    sort: str = "lag"
    region: str | None = None  # filter; None shows every region
    snapshot: dict | None = None
    unreachable: str | None = None  # why the last refresh failed, while it does
    unreachable_since: float | None = None
    _wan_base: dict = field(default_factory=dict)  # latest version -> cross-region bytes when it appeared

    # ------------------------------------------------------------ input

    def update(self, snapshot: dict) -> None:
        self.snapshot, self.unreachable, self.unreachable_since = snapshot, None, None
        latest = snapshot.get("latest_version")
        if latest is not None and latest not in self._wan_base:
            self._wan_base = {latest: self._wan_total(snapshot)}

    def failed(self, reason: str, now: float) -> None:
        self.unreachable = reason
        if self.unreachable_since is None:
            self.unreachable_since = now

    def next_sort(self) -> None:
        self.sort = SORTS[(SORTS.index(self.sort) + 1) % len(SORTS)]

    def next_region(self) -> None:
        regions = self.regions()
        if not regions:
            self.region = None
        elif self.region not in regions:
            self.region = regions[0]
        else:
            i = regions.index(self.region) + 1
            self.region = regions[i] if i < len(regions) else None

    # ------------------------------------------------------------ output

    def regions(self) -> list[str]:
        return sorted({n.get("region", "?") for n in (self.snapshot or {}).get("nodes", [])})

    @staticmethod
    def _wan_total(snap: dict) -> int:
        return sum(n.get("bytes_down_wan", 0) or 0 for n in snap.get("nodes", []))

    def header(self, now: float) -> list[str]:
        snap = self.snapshot or {}
        nodes = snap.get("nodes", [])
        latest = snap.get("latest_version")
        states = {s: sum(1 for n in nodes if n.get("state") == s) for s in ("up", "joining", "stale")}
        per_region = ", ".join(f"{r} {sum(1 for n in nodes if n.get('region') == r)}" for r in self.regions())
        down = sum(n.get("rate_down", 0) or 0 for n in nodes)
        trainer: dict[str, Any] = next((n for n in nodes if n.get("role") == "trainer"), {})
        wan = self._wan_total(snap) - self._wan_base.get(latest, self._wan_total(snap))
        lines = [
            f"sparrowd top  {self.tracker}  latest {'-' if latest is None else latest}  "
            f"nodes {states['up']} up, {states['joining']} joining, {states['stale']} stale",
            f"regions {len(self.regions())}: {per_region or '-'}",
            f"swarm down {rate(down)}B/s  trainer up {rate(trainer.get('rate_up'))}B/s "
            f"({format_bytes(trainer.get('bytes_up', 0) or 0)})  cross-region since "
            f"{'-' if latest is None else latest}: {format_bytes(wan)}",
            f"sort {self.sort}  region {self.region or 'all'}   [s] sort  [r] region  [q] quit",
        ]
        if self.unreachable is not None:
            ago = now - (self.unreachable_since or now)
            lines.insert(0, f"! tracker unreachable for {ago:.0f} s ({self.unreachable}); showing the last snapshot")
        if not self.snapshot:
            lines.append("waiting for the first snapshot...")
        return lines

    def rows(self) -> list[Row]:
        snap = self.snapshot or {}
        latest = snap.get("latest_version")
        nodes = [n for n in snap.get("nodes", []) if self.region is None or n.get("region") == self.region]
        if self.sort == "lag":
            nodes.sort(key=lambda n: (-(lag(n, latest) or 0), n.get("region", ""), n.get("node_id", "")))
        elif self.sort == "region":
            nodes.sort(key=lambda n: (n.get("region", ""), n.get("node_id", "")))
        else:
            nodes.sort(key=lambda n: (-((n.get("rate_down") or 0) + (n.get("rate_up") or 0)), n.get("node_id", "")))
        out = []
        for n in nodes:
            behind = lag(n, latest)
            engine = "-" if n.get("engine_version") is None else str(n["engine_version"])
            if behind:
                engine += f" -{behind}"
            fl = n.get("in_flight")
            flight = f"{fl['version']} {_bar(fl['chunks_held'], fl['chunks_known'])}" if fl else "-"
            style = ("error" if n.get("error") else "stale" if n.get("state") == "stale" else
                     "lagging" if behind else "trainer" if n.get("role") == "trainer" else "")
            role, state = n.get("role", "?"), n.get("state", "?")
            out.append(Row(n.get("node_id", "?"), (
                n.get("node_id", "?"), _SHORT.get(role, role), n.get("region", "?"), _SHORT.get(state, state),
                _held(n.get("versions") or []), engine, current_cell(n),
                flight, rate(n.get("rate_down")), rate(n.get("rate_up")),
                str(n.get("peers", "-")), f"{n.get('lease_expires_in', 0):.0f}s"), style))
        return out

    def errors(self) -> list[str]:
        return [f"{n.get('node_id', '?')}: {n['error']}" for n in (self.snapshot or {}).get("nodes", [])
                if n.get("error")]


def fit(rows: list[tuple[str, ...]], width: int) -> tuple[list[int], list[tuple[str, ...]]]:
    """Column widths that fit ``width`` (NODE, then REGION, then IN FLIGHT shrink first, with an ellipsis)."""
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(COLUMNS)]
    over = sum(widths) + len(widths) - 1 - width
    for col, floor in ((0, 12), (2, 6), (7, 8), (0, 6)):
        if over <= 0:
            break
        cut = min(over, widths[col] - floor)
        if cut > 0:
            widths[col] -= cut
            over -= cut
    out = []
    for r in rows:
        out.append(tuple(v if len(v) <= w else v[: w - 1] + "…" for v, w in zip(r, widths)))
    return widths, out
