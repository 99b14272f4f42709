"""Cut-through between real daemons: a chunk is relayed while it is still arriving, bit for bit."""

from __future__ import annotations

import time

import numpy as np
import pytest

from sparrowd.bench.swarm import _write_patch
from sparrowd.codec.patchfile import parse_patch
from tests.daemon.harness import wait_for
from tests.daemon.patches import check_store, held, publish
from tests.daemon.test_swarm import metric

pytestmark = pytest.mark.slow

CHUNK = 1 << 20


@pytest.mark.parametrize("cut", ["on", "off"])
def test_a_chunk_moves_on_from_a_node_still_fetching_it(cluster, tmp_path, cut):
    # One 1 MiB chunk; the trainer sends at 512 KiB/s and super-seeds it to one node first. The others
    # see that node fetching it and, cut-through, take it from there block by block as it arrives,
    # rather than waiting the two seconds for it to land.
    path = tmp_path / "v1.sprw"
    _write_patch(path, 1, CHUNK - 4096, CHUNK, np.random.default_rng(0))
    m = parse_patch(path.read_bytes()).manifest
    assert len(m.chunks) == 1
    trainer = cluster.trainer(extra=("--upload-rate", "512K"))
    rollouts = [cluster.rollout(f"r{i}", "eu", extra=("--cut-through", cut, "--upload-rate", "1M"))
                for i in range(3)]
    wait_for(lambda: len(cluster.nodes()) == 4, 15, "four nodes")
    t0 = time.monotonic()
    publish(cluster, path)
    wait_for(lambda: all(held(cluster).get(d.name) == [1] for d in rollouts), 60, "every node to hold version 1",
             detail=lambda: held(cluster))
    elapsed = time.monotonic() - t0
    for d in rollouts:
        check_store(d, m)
    relayed = sum(metric(d, cluster.token, "sparrowd_cut_through_bytes_total") for d in rollouts)
    up = sum(metric(trainer, cluster.token, f'sparrowd_bytes_total{{direction="up",region_class="{rc}"}}')
             for rc in ("same", "other"))
    assert up < 1.9 * m.patch_bytes, up  # the trainer sent about one copy: the rest came from the rollouts
    if cut == "on":
        assert relayed >= m.patch_bytes, relayed
    else:
        assert relayed == 0, relayed
    print(f"cut-through {cut}: all three nodes in {elapsed:.1f} s")


@pytest.mark.parametrize("limited", [True, False])
def test_a_relay_streams_a_chunk_still_arriving_to_no_more_peers_than_its_uplink_carries(cluster, tmp_path,
                                                                                         limited):
    # One 1 MiB chunk from a trainer sending at 256 KiB/s, which its stream declares. The node it goes to
    # first shows the others it is fetching it, and both ask it at once. With an upload limit of that same
    # rate, it streams the chunk to one of them at a time while it arrives (relay_fanout), and the other
    # waits its turn; with no upload limit it serves both at once.
    path = tmp_path / "v1.sprw"
    _write_patch(path, 1, CHUNK - 4096, CHUNK, np.random.default_rng(2))
    m = parse_patch(path.read_bytes()).manifest
    cluster.trainer(extra=("--upload-rate", "256K"))
    extra = ("--push", "off", *(("--upload-rate", "256K") if limited else ()))
    rollouts = [cluster.rollout(f"r{i}", "eu", extra=extra) for i in range(3)]
    wait_for(lambda: len(cluster.nodes()) == 4, 15, "four nodes")
    publish(cluster, path)
    wait_for(lambda: all(held(cluster).get(d.name) == [1] for d in rollouts), 60, "every node to hold version 1",
             detail=lambda: held(cluster))
    for d in rollouts:
        check_store(d, m)
    waited = sum(metric(d, cluster.token, "sparrowd_relay_turns_waited_total") for d in rollouts)
    relayed = sum(metric(d, cluster.token, "sparrowd_cut_through_bytes_total") for d in rollouts)
    assert relayed >= m.patch_bytes, relayed  # the others took it from a node still fetching it
    assert (waited >= 1) if limited else (waited == 0), waited


def test_a_relay_that_dies_mid_chunk_cuts_its_streams_and_the_others_fetch_it_elsewhere(cluster, tmp_path):
    path = tmp_path / "v1.sprw"
    _write_patch(path, 1, CHUNK - 4096, CHUNK, np.random.default_rng(1))
    m = parse_patch(path.read_bytes()).manifest
    cluster.trainer(extra=("--upload-rate", "256K"))  # four seconds for the one chunk
    rollouts = [cluster.rollout(f"r{i}", "eu") for i in range(3)]
    wait_for(lambda: len(cluster.nodes()) == 4, 15, "four nodes")
    publish(cluster, path)
    # Kill the first node seen passing the chunk on while it is still arriving.
    relay = wait_for(lambda: next((d for d in rollouts
                                   if metric(d, cluster.token, "sparrowd_cut_through_bytes_total") > 0), None),
                     30, "a node to relay the chunk cut-through")
    assert held(cluster).get(relay.name) != [1]  # it was still fetching it
    relay.kill()
    rest = [d for d in rollouts if d is not relay]
    wait_for(lambda: all(held(cluster).get(d.name) == [1] for d in rest), 60, "the others to hold version 1",
             detail=lambda: held(cluster))
    for d in rest:
        check_store(d, m)
        assert "peer banned" not in d.log()  # a cut stream is not held against anyone
