"""The engine socket on real daemons: a bf16 engine model follows the trainer's steps through
``EngineClient`` + ``PatchApplier``, bit for bit, and catches up from an anchor when behind."""

from __future__ import annotations

import fcntl
import os
import socket
import time

import pytest

from sparrowd import Publisher
from sparrowd.daemon.engine import HELLO_TIMEOUT, MAX_CONNECTIONS, MAX_UNGREETED
from sparrowd.errors import BaseMismatchError, SparrowError
from sparrowd.integrations.engine import EngineClient, sync
from sparrowd.integrations.torch import PatchApplier
from tests.daemon.harness import Daemon, status, wait_for
from tests.helpers import sparrowd
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


def until_closed(s: socket.socket) -> bytes:
    """What the daemon sends before it closes ``s`` (a timeout if it does not, within s's own)."""
    data = b""
    while part := s.recv(4096):
        data += part
    return data


def test_silent_connections_never_keep_an_engine_out_and_are_closed_after_the_hello_timeout(cluster):
    trainer = cluster.trainer()
    sock = str(trainer.data_dir / "engine.sock")
    t0 = time.monotonic()
    silent = []
    for _ in range(MAX_UNGREETED + 1):  # far more than MAX_CONNECTIONS, and one more than the daemon holds
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(sock)  # blocking: waits while the listen backlog is full
        s.settimeout(HELLO_TIMEOUT + 10)
        silent.append(s)
    silent[0].settimeout(2)
    assert until_closed(silent[0]) == b""  # the oldest closed at once to make room

    client = EngineClient(sock, token_file=cluster.token_file, engine="real", version=0, timeout=HELLO_TIMEOUT)
    assert client.ready(0) == (None, [])
    assert until_closed(silent[1]) == b""  # the engine's connection took the oldest one's place
    silent[-1].setblocking(False)
    with pytest.raises(BlockingIOError):  # attached while the others are still open
        silent[-1].recv(1)
    silent[-1].settimeout(HELLO_TIMEOUT + 10)

    for s in silent[2:]:
        assert b"no hello within" in until_closed(s)
    assert HELLO_TIMEOUT <= time.monotonic() - t0 < HELLO_TIMEOUT + 5
    assert client.ready(0) == (None, [])  # an engine that said hello is not timed out
    client.close()
    for s in silent:
        s.close()


def test_at_most_max_connections_engines_attach_at_once(cluster):
    trainer = cluster.trainer()
    sock = trainer.data_dir / "engine.sock"
    clients = [EngineClient(sock, token_file=cluster.token_file, engine="e", rank=r) for r in range(MAX_CONNECTIONS)]
    with pytest.raises(SparrowError, match=f"more than {MAX_CONNECTIONS} engine connections"):
        EngineClient(sock, token_file=cluster.token_file, engine="e", rank=MAX_CONNECTIONS)
    clients.pop().close()
    wait_for(lambda: _attaches(sock, cluster.token_file), 5, "a freed place to be taken")
    for c in clients:
        c.close()


def _attaches(sock, token_file) -> bool:
    try:
        EngineClient(sock, token_file=token_file, engine="late").close()
        return True
    except SparrowError:
        return False


@pytest.mark.parametrize("kind", ["file", "symlink", "folder"])
def test_an_engine_socket_path_that_is_not_a_socket_is_refused_and_left_alone(cluster, tmp_path, kind):
    path = tmp_path / "engine.sock"
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    if kind == "file":
        path.write_text("keep me\n")
    elif kind == "symlink":
        path.symlink_to(target)
    else:
        path.mkdir()
    r = sparrowd("run", "--role", "trainer", "--region", "eu", "--listen", "127.0.0.1:0", "--data-dir",
                 tmp_path / "data", "--token-file", cluster.token_file, "--engine-socket", path, timeout=60)
    errors = [line for line in r.stderr.splitlines() if "error" in line.lower()]
    assert r.returncode != 0 and errors == [f"sparrowd: error: engine socket {path} exists and is not a socket; "
                                            "remove it or choose another path"], r.stderr
    assert "Traceback" not in r.stderr
    if kind == "file":
        assert path.read_text() == "keep me\n"
    elif kind == "symlink":
        assert path.is_symlink() and path.read_text() == "keep me\n"
    else:
        assert path.is_dir()
    assert target.read_text() == "keep me\n"


def test_a_socket_left_by_a_dead_daemon_is_replaced(cluster, tmp_path):
    path = tmp_path / "engine.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))  # a socket file nobody listens on
    d = Daemon(tmp_path, "trainer", "trainer", "eu", cluster.token_file, port=cluster.port,
               extra=("--engine-socket", str(path)))
    cluster.daemons.append(d.start())
    EngineClient(path, token_file=cluster.token_file).close()
    assert d.stop() == 0
