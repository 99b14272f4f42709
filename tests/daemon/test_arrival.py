"""Waiting for a version across real daemons: the tracker's long poll answers as soon as the nodes
report holding (or applying) it, not a renewal interval later."""

from __future__ import annotations

import threading
import time

import pytest

from sparrowd import Publisher
from sparrowd.errors import SparrowError
from sparrowd.integrations.engine import EngineClient, sync
from sparrowd.integrations.torch import PatchApplier
from tests.daemon.harness import get, wait_for
from tests.helpers import sparrowd
from tests.models import bf16_model, served_bits, train, trained_setup

pytestmark = pytest.mark.slow


def test_wait_returns_within_a_second_of_the_last_node_holding_the_version(cluster):
    cluster.trainer(ttl=6.0)  # renewals every 2 s: a view fed by renewals alone would lag by up to that
    nodes = [cluster.rollout(f"r{i}", "us" if i < 2 else "eu", ttl=6.0) for i in range(3)]
    wait_for(lambda: len(cluster.nodes()) == 4, 15, "four nodes")
    model, opt = trained_setup(2)
    pub = Publisher(daemon=cluster.tracker, token_file=cluster.token_file)
    pub.start(model, version=0, anchor=False)
    bits0 = served_bits(model)
    for v in (1, 2):
        train(model, opt)
        held: dict[str, float] = {}

        def watch(n, v=v, held=held):
            while n.name not in held:
                if v in n.node(cluster.token)["versions"]:
                    held[n.name] = time.monotonic()
                time.sleep(0.01)

        watchers = [threading.Thread(target=watch, args=(n,), daemon=True) for n in nodes]
        pub.publish(model, version=v)
        for t in watchers:
            t.start()
        answer = pub.wait(timeout=30)
        returned = time.monotonic()
        for t in watchers:
            t.join(10)
        assert answer["done"] and sorted(answer["reached"]) == ["r0", "r1", "r2"]
        last = max(held.values())
        assert returned - last < 1.0, f"the tracker heard of version {v} {returned - last:.2f} s late"
        # The trainer's Prometheus metrics are read from the same table: as fresh as the wait.
        code, metrics = get(f"{cluster.tracker}/metrics", cluster.token)
        assert code == 200 and b"sparrowd_tracker_nodes_holding_latest 3.0" in metrics

    # The command line: done at once; a version nobody has times out with the missing nodes, one line.
    r = sparrowd("wait", "2", "--tracker", cluster.tracker, "--token-file", cluster.token_file, timeout=30)
    assert r.returncode == 0 and "held by 3 nodes" in r.stdout
    r = sparrowd("wait", "9", "--tracker", cluster.tracker, "--token-file", cluster.token_file, "--timeout", "1",
                 timeout=30)
    assert r.returncode != 0 and "r0, r1, r2" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert sparrowd("wait", "2", "--tracker", cluster.tracker, "--token-file", cluster.token_file, "--fraction",
                    "0.5", "--nodes", "r0,nobody", timeout=30).returncode == 0

    # Applied: only engines count; one attaches to r0 at version 0 and applies 1 and 2.
    client = EngineClient(nodes[0].data_dir / "engine.sock", token_file=cluster.token_file, engine="e", version=0)
    applier = PatchApplier(bf16_model(bits0), version=0)
    wait_for(lambda: pub.status()["nodes"] and any(n.get("engine_version") == 0 for n in pub.status()["nodes"]), 10,
             "the tracker to see the engine")
    with pytest.raises(SparrowError, match="not applied on r0"):
        pub.wait(2, applied=True, timeout=1)
    sync(client, applier, wait=10)
    applied = time.monotonic()  # (timed from the apply, not through it: under a loaded CI two applies took 2 s)
    assert pub.wait(2, applied=True, timeout=10)["reached"] == ["r0"]
    assert time.monotonic() - applied < 1.0, "the tracker heard of the apply over a second late"
    with pytest.raises(SparrowError, match="r1"):
        pub.wait(2, applied=True, nodes=["r0", "r1"], timeout=1)  # r1 has no engine
    client.close()
    pub.close()
