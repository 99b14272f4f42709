"""The engine socket on real daemons: a bf16 engine model follows the trainer's steps through
``EngineClient`` + ``PatchApplier``, bit for bit, and catches up from an anchor when behind."""

from __future__ import annotations

import fcntl
import os

import pytest

from sparrowd import Publisher
from sparrowd.errors import BaseMismatchError, SparrowError
from sparrowd.integrations.engine import EngineClient, sync
from sparrowd.integrations.torch import PatchApplier
from tests.daemon.harness import status, wait_for
from tests.models import assert_serves, bf16_model, served_bits, train, trained_setup

pytestmark = pytest.mark.slow


def node_status(cluster, name: str) -> dict:
    return next((n for n in status(cluster.tracker, cluster.token)["nodes"] if n["node_id"] == name), {})


def test_an_engine_follows_every_step_through_the_socket(cluster):
    model, opt = trained_setup(0)
    _, node = cluster.pair()
    engine = bf16_model(served_bits(model))
    sock = node.data_dir / "engine.sock"
    assert oct(os.stat(sock).st_mode & 0o777) == "0o660"

    with pytest.raises(SparrowError, match="wrong swarm token"):
        EngineClient(sock, token="not-the-token")
    client = EngineClient(sock, token_file=cluster.token_file, engine="vllm-0", version=0)
    applier = PatchApplier(engine, version=0)
    assert sync(client, applier) == 0  # nothing published yet

    pub = Publisher(daemon=cluster.tracker, token_file=cluster.token_file)
    pub.start(model, version=0)
    for step in (1, 2, 3):
        train(model, opt)
        pub.publish(model, version=step)
    # Long-poll until version 3 is ready, then apply 1, 2 and 3 in order.
    while applier.version < 3:
        sync(client, applier, wait=10)
    assert_serves(engine, served_bits(model))
    wait_for(lambda: node_status(cluster, "r1").get("engine_version") == 3, 15, "the tracker to see engine 3")

    # The descriptor handed out is a sealed memfd: the engine cannot change what others map.
    train(model, opt)
    pub.publish(model, version=4)
    wait_for(lambda: client.ready(5)[1] == [4], 30, "version 4 to be ready")
    reply, fd = client._call({"op": "fetch", "version": 4, "anchor": False}, want_fd=True)
    try:
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_WRITE
        assert reply["base_version"] == 3 and reply["bytes"] == os.fstat(fd).st_size
        with pytest.raises(PermissionError):
            os.write(fd, b"x")
    finally:
        os.close(fd)
    # A target stops the engine where it is told to.
    assert sync(client, applier, target=3) == 3
    assert sync(client, applier, target=4) == 4
    assert_serves(engine, served_bits(model))
    client.close()
    pub.close()


def test_an_engine_behind_the_retained_chain_loads_the_anchor_its_node_fetches_for_it(cluster):
    """The node follows the chain from the start and needs no anchor; an engine that attaches
    at version 0 after patch 1 is gone makes the node fetch anchor 6, loads it in place, then
    applies patch 7. Asking for a patch on the wrong base is refused with the anchor to load."""
    model, opt = trained_setup(1)
    base = served_bits(model)
    _, node = cluster.pair("eu", extra=("--retain", "2"))
    pub = Publisher(daemon=cluster.tracker, token_file=cluster.token_file, anchor_every=3)
    pub.start(model, version=0)
    for v in range(1, 8):
        train(model, opt)
        pub.publish(model, version=v)
    wait_for(lambda: 7 in node_status(cluster, "r1").get("versions", []), 30, "the node to hold 7")
    assert list((node.data_dir / "anchors").iterdir()) == []

    engine = bf16_model(base)
    client = EngineClient(node.data_dir / "engine.sock", token_file=cluster.token_file, version=0)
    with pytest.raises(BaseMismatchError, match="applies to 6, but the engine holds 0"):
        client.fetch(7)
    applier = PatchApplier(engine, version=0)
    while applier.version < 7:
        sync(client, applier, wait=10)
    assert (node.data_dir / "anchors" / "6").exists()
    assert_serves(engine, served_bits(model))
    client.close()
    pub.close()
