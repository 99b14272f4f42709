"""Plain-text rendering of the status snapshot (``sparrowd status``)."""

from __future__ import annotations

from sparrowd.sizes import format_bytes

COLUMNS = ("NODE", "ROLE", "REGION", "ADDRESS", "STATE", "LEASE", "VERSIONS", "ENGINE", "CURRENT", "DOWN/s", "UP/s")


def _versions(vs: list[int]) -> str:
    if not vs:
        return "-"
    return str(vs[0]) if len(vs) == 1 else f"{vs[0]}..{vs[-1]} ({len(vs)})"


def _rate(r: float) -> str:
    return "-" if not r else format_bytes(r).replace(" ", "")


def current_cell(node: dict) -> str:
    """The node's current-version folder: ``7 ready``, ``building``, ``-`` when it keeps none."""
    c = node.get("current")
    if not c:
        return "-"
    return c["state"] if c.get("version") is None or c["state"] == "building" else f"{c['version']} {c['state']}"


def render_status(snap: dict) -> str:
    latest = snap.get("latest_version")
    nodes = snap.get("nodes", [])
    regions = sorted({n.get("region", "?") for n in nodes})
    head = (f"swarm: {len(nodes)} node{'s' if len(nodes) != 1 else ''} in {len(regions)} "
            f"region{'s' if len(regions) != 1 else ''}, latest version {'-' if latest is None else latest}, "
            f"lease TTL {snap.get('lease_ttl', 0):g} s")
    rows = []
    for n in nodes:
        engine = n.get("engine_version")
        lag = "" if engine is None or latest is None or engine >= latest else f" (-{latest - engine})"
        rows.append((
            n.get("node_id", "?"), n.get("role", "?"), n.get("region", "?"), n.get("address", "?"),
            n.get("state", "?"), f"{n.get('lease_expires_in', 0):.1f}s", _versions(n.get("versions") or []),
            ("-" if engine is None else str(engine)) + lag, current_cell(n),
            _rate(n.get("rate_down", 0)), _rate(n.get("rate_up", 0)),
        ))
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(COLUMNS)]
    lines = [head, "", "  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    if not rows:
        lines.append("(no live nodes)")
    errors = [(n.get("node_id", "?"), n["error"]) for n in nodes if n.get("error")]
    if errors:
        lines += [""] + [f"{node}: {error}" for node, error in errors]
    return "\n".join(lines)
