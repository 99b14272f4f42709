"""Bounded staleness (`Publisher(max_lag=k)`): publishing version v returns only once every live
engine holds at least v - k; an engine held back makes it fail after its timeout, naming the engine
and how far behind it is. Real daemons, engines attached through their sockets, a trained model."""

from __future__ import annotations

import threading
import time

import pytest

from sparrowd import Publisher, StaleEnginesError
from tests.daemon.harness import wait_for
from tests.models import bf16_model, served_bits, train, trained_setup

pytestmark = pytest.mark.slow


def test_publish_waits_for_engines_within_max_lag_and_names_the_one_behind(cluster):
    from sparrowd.integrations.engine import EngineClient, sync
    from sparrowd.integrations.torch import PatchApplier

    cluster.trainer()
    fast, slow = cluster.rollout("r1", "us"), cluster.rollout("r2", "eu")
    wait_for(lambda: len(cluster.nodes()) == 3, 15, "three nodes")
    model, opt = trained_setup(11)
    pub = Publisher(daemon=cluster.tracker, token_file=cluster.token_file, max_lag=1, lag_timeout=4)
    pub.start(model, version=0)
    engines = {}
    for name, node in (("r1", fast), ("r2", slow)):
        client = EngineClient(node.data_dir / "engine.sock", token_file=cluster.token_file, engine="e", version=0)
        engines[name] = (client, PatchApplier(bf16_model(served_bits(model)), version=0))
    stop = threading.Event()

    def follow() -> None:  # r1's engine applies every version as it comes; r2's is held back
        client, applier = engines["r1"]
        while not stop.is_set():
            sync(client, applier, wait=1)

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    try:
        train(model, opt)
        pub.publish(model, version=1)  # within the bound: engines at 0 = 1 - 1
        train(model, opt)
        t0 = time.monotonic()
        with pytest.raises(StaleEnginesError) as e:
            pub.publish(model, version=2)  # r2's engine is still at 0: 2 behind
        assert 4 <= time.monotonic() - t0 < 10
        assert e.value.lagging == {"r2": 2} and "r2 at 0 (2 behind)" in str(e.value), str(e.value)
        # Caught up, the next version goes through without waiting out the timeout.
        client, applier = engines["r2"]
        assert sync(client, applier, target=2, wait=30, exact=True) == 2
        train(model, opt)
        t0 = time.monotonic()
        stats = pub.publish(model, version=3)
        assert time.monotonic() - t0 < 4 and stats.lag_wait_seconds < 4
    finally:
        stop.set()
        t.join(10)
        for client, _ in engines.values():
            client.close()
        pub.close()
