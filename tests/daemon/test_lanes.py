"""A relay's two upload lanes, on a real daemon: its neighbours do not hold up other regions' crossers."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from sparrowd.bench.swarm import _write_patch
from sparrowd.swarm.policy import QUEUE_ADMIT, RELAY_CONCURRENT
from tests.daemon.harness import Member, wait_for
from tests.daemon.patches import held, publish

pytestmark = pytest.mark.slow

def test_a_relays_neighbours_do_not_hold_up_the_crossers_of_other_regions(cluster, tmp_path):
    # A relay in "us" holds a 4 MiB chunk and uploads at 256 KiB/s: every upload it starts lasts the
    # whole test. Its own region fills its same-region slots and queue; a member from "eu" is still
    # served at once, in the other lane (its first piece comes after those already paced).
    path = tmp_path / "v1.sprw"
    _write_patch(path, 1, 4 << 20, 4 << 20, np.random.default_rng(0))
    cluster.trainer(region="eu", ttl=10.0)
    relay = cluster.rollout("r0", "us", ttl=10.0, extra=("--upload-rate", "256K"))
    wait_for(lambda: len(cluster.nodes()) == 2, 15, "two nodes")
    publish(cluster, path)
    wait_for(lambda: held(cluster).get("r0") == [1], 30, "r0 to hold version 1")

    near = [Member(cluster, f"near{i}", "us") for i in range(RELAY_CONCURRENT + QUEUE_ADMIT + 1)]
    far = [Member(cluster, f"far{i}", "eu") for i in range(RELAY_CONCURRENT + QUEUE_ADMIT + 1)]
    stop = threading.Event()

    def keep_leases():
        while not stop.wait(2.0):
            for m in near + far:
                try:
                    m.renew()
                except OSError:
                    return  # the trainer stopped at the end of the test while a renewal was on its way

    threading.Thread(target=keep_leases, daemon=True).start()
    try:
        for m in near + far:
            wait_for(lambda m=m: m.known_to(relay), 15, f"r0 to know {m.id}")
        # Its own region: two served, one waiting; the next is told "choked" at once.
        near_answers = []
        for m in near[:RELAY_CONCURRENT]:
            r = m.ask(relay, "1", 0)
            assert r.status == 200
            near_answers.append(r)
        def wait_in_line(m):
            try:
                near_answers.append(m.ask(relay, "1", 0))
            except OSError:
                pass  # the relay stopped at the end of the test while this one still waited

        waiting = [threading.Thread(target=wait_in_line, args=(m,), daemon=True)
                   for m in near[RELAY_CONCURRENT:RELAY_CONCURRENT + QUEUE_ADMIT]]
        for t in waiting:
            t.start()
        time.sleep(0.5)  # queued in the relay (its answer waits for a slot)
        assert len(near_answers) == RELAY_CONCURRENT
        r = near[-1].ask(relay, "1", 0)
        assert r.status == 503 and b"choked" in r.read()
        # Another region: served now, its first bytes flowing while the neighbours' uploads go on.
        t0 = time.monotonic()
        crossing = far[0].ask(relay, "1", 0)
        assert crossing.status == 200
        assert len(crossing.read(4096)) == 4096
        assert time.monotonic() - t0 < 8.0
        assert len(near_answers) == RELAY_CONCURRENT  # the neighbours still wait behind their lane
    finally:
        stop.set()
