"""Prometheus metrics at ``/metrics``, read from the daemon's state at scrape time.

A collector rather than gauges updated in place: the numbers come straight
from the lease table and the membership state when Prometheus asks, so they
cannot drift from what ``sparrowd status`` shows. What it reads of the node is
the ``Node`` protocol (``app.Daemon`` is one).

Imports ``prometheus_client`` and the pure core (``swarm.waits``) only.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from sparrowd.swarm.waits import arrival

__all__ = ["DaemonMetrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
REGION_CLASSES = ("same", "other")


class Node(Protocol):
    """What the collector reads of its node; None where the node runs without that part."""

    node_id: str

    # Read-only (properties), so a node's own attributes, of narrower types, match.
    @property
    def settings(self) -> object: ...  # .role, .region

    @property
    def membership(self) -> object | None: ...

    @property
    def swarm(self) -> object | None: ...

    @property
    def tracker(self) -> object | None: ...

    def versions_held(self) -> list[int]: ...


class DaemonMetrics:
    """The collector; ``requests``, ``unauthorized`` and ``bytes`` are counted by the gate and the swarm."""

    def __init__(self, daemon: Node):
        self.daemon = daemon
        self.requests: Counter[tuple[str, int]] = Counter()
        self.unauthorized = 0
        self.bytes: Counter[tuple[str, str]] = Counter()  # (direction, region class) -> bytes; the swarm fills it
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self):
        d = self.daemon
        info = GaugeMetricFamily("sparrowd_info", "This daemon", labels=["node_id", "role", "region"])
        info.add_metric([d.node_id, d.settings.role, d.settings.region], 1)
        yield info

        m = d.membership
        left = m.lease_left() if m else None
        g = GaugeMetricFamily("sparrowd_lease_expires_in_seconds", "Time left on this node's lease (0 if none)")
        g.add_metric([], left or 0.0)
        yield g
        g = GaugeMetricFamily("sparrowd_tracker_reachable", "1 if the last tracker call succeeded")
        g.add_metric([], 1.0 if m and m.state.tracker_reachable else 0.0)
        yield g

        peers = GaugeMetricFamily("sparrowd_peers", "Peers in the last list from the tracker", labels=["region_class"])
        regions = Counter(
            "same" if p.get("region") == d.settings.region else "other" for p in (m.state.peers if m else [])
        )
        for rc in REGION_CLASSES:
            peers.add_metric([rc], regions[rc])
        yield peers

        b = CounterMetricFamily("sparrowd_bytes", "Bytes moved by the swarm", labels=["direction", "region_class"])
        for direction in ("up", "down"):
            for rc in REGION_CLASSES:
                b.add_metric([direction, rc], self.bytes[(direction, rc)])
        yield b

        if d.swarm is not None:
            refused = CounterMetricFamily(
                "sparrowd_peer_refused", "Peer requests refused at this node's door, before any body was read: "
                "no-ticket (no member's ticket), bad-ticket (not this swarm's, or another node's), expired (a "
                "ticket past its lease or credential), revoked (its credential was), lease-ended (at the "
                "trainer: no lease at that epoch), impostor (no valid proof with the ticket's key), unknown "
                "(this node holds no lease yet), budget-choked / budget-banned (a peer whose exchanges cost this node "
                "past its budget of CPU and bytes, swarm.budget)", labels=["reason"])
            for reason in ("no-ticket", "bad-ticket", "expired", "revoked", "lease-ended", "impostor", "unknown",
                           "budget-choked", "budget-banned"):
                refused.add_metric([reason], d.swarm.refused[reason])
            yield refused
            lies = CounterMetricFamily("sparrowd_peer_false_haves", "Chunks peers advertised and then did not serve")
            lies.add_metric([], d.swarm.lies)
            yield lies
            relayed = CounterMetricFamily("sparrowd_cut_through_bytes", "Bytes of chunks this node served while "
                                          "it was still fetching them (cut-through: each block as it checked out)")
            relayed.add_metric([], d.swarm.cut_through_bytes)
            yield relayed
            turns = CounterMetricFamily("sparrowd_relay_turns_waited", "Requests for a chunk still arriving here that "
                                        "waited for a stream to end: it was streamed to as many peers as this node's "
                                        "upload limit carries at the rate the chunk comes in")
            turns.add_metric([], d.swarm.turns_waited)
            yield turns
            if (delay := d.swarm.delay()) is not None:
                wd = GaugeMetricFamily("sparrowd_wan_delay_seconds", "The one-way delay between regions: on a "
                                       "rollout, as it measured it (half the median shortest exchange round trip "
                                       "to another region's peers); on the trainer, the median of the rollouts' "
                                       "figures, which times the chunks' region trees")
                wd.add_metric([], delay)
                yield wd
            pushes = CounterMetricFamily("sparrowd_pushes", "Chunks pushed (sent unasked): sent and taken, refused "
                                         "or failed (this node pushing); received or declined (pushed to it)",
                                         labels=["outcome"])
            for outcome in ("taken", "refused", "failed", "received", "declined"):
                pushes.add_metric([outcome], d.swarm.pushes[outcome])
            yield pushes
            stripes = CounterMetricFamily("sparrowd_stripes", "Stripes of chunks that crossed in stripes (each "
                                          "region's receiver hands its own on to every other): pushed and taken "
                                          "(sent), and received whole (received)", labels=["direction"])
            for direction in ("sent", "received"):
                stripes.add_metric([direction], d.swarm.stripes[direction])
            yield stripes
            bans = CounterMetricFamily("sparrowd_peers_banned", "Peers banned for the session",
                                       labels=["reason"])
            for reason in ("bad-chunk", "false-have", "budget"):
                bans.add_metric([reason], d.swarm.bans[reason])
            yield bans

        v = GaugeMetricFamily("sparrowd_versions_held", "Versions this node holds complete")
        v.add_metric([], len(d.versions_held()))
        yield v

        if d.tracker is not None:
            snap = d.tracker.status()
            states = Counter(n["state"] for n in snap["nodes"])
            leases = GaugeMetricFamily("sparrowd_tracker_leases", "Live leases by state", labels=["state"])
            for state in ("joining", "up", "stale"):
                leases.add_metric([state], states[state])
            yield leases
            by_region = GaugeMetricFamily("sparrowd_tracker_nodes", "Live nodes by region and role",
                                          labels=["region", "role"])
            for (region, role), count in sorted(Counter((n["region"], n["role"]) for n in snap["nodes"]).items()):
                by_region.add_metric([region, role], count)
            yield by_region
            tr = CounterMetricFamily("sparrowd_tracker_refused", "Tracker messages refused (joins under another "
                                     "node's key, forged or replayed renewals, credentials used out of bounds)",
                                     labels=["op", "reason"])
            for (op, reason), count in sorted(d.tracker.refused.items()):
                tr.add_metric([op, reason], count)
            yield tr
            lv = GaugeMetricFamily("sparrowd_latest_version", "Latest version known to the tracker (-1 if none)")
            lv.add_metric([], -1 if snap["latest_version"] is None else snap["latest_version"])
            yield lv
            latest = snap["latest_version"]
            # The same population as ``sparrowd wait``: live nodes other than the trainer.
            holding = GaugeMetricFamily("sparrowd_tracker_nodes_holding_latest",
                                        "Live rollout nodes that hold the latest version (reported as it completes)")
            holding.add_metric([], 0 if latest is None else len(arrival(snap["nodes"], latest).reached))
            yield holding
            applied = GaugeMetricFamily("sparrowd_tracker_engines_on_latest",
                                        "Live rollout nodes whose engine has applied the latest version")
            applied.add_metric([], 0 if latest is None else len(arrival(snap["nodes"], latest, applied=True).reached))
            yield applied

        req = CounterMetricFamily("sparrowd_http_requests", "HTTP requests served", labels=["endpoint", "status"])
        for (endpoint, status), count in sorted(self.requests.items()):
            req.add_metric([endpoint, str(status)], count)
        yield req
        un = CounterMetricFamily("sparrowd_unauthorized_requests", "Requests refused for a missing or wrong token")
        un.add_metric([], self.unauthorized)
        yield un
