"""Chunks spread through a swarm of real daemons: three regions, several versions, deaths, restarts."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import threading
import time

import blake3
import msgpack
import pytest
from aiohttp import web

from sparrowd.codec.patchfile import parse_patch
from sparrowd.swarm.policy import MIN_RATE, UPLOAD_SLOTS
from sparrowd.swarm.serving import stream_timeout
from tests import members
from tests.daemon.harness import free_port, get, status, wait_for
from tests.daemon.patches import check_store, held, manifests, publish, write_chain
from tests.helpers import sparrowd
from tests.members import new_key

pytestmark = pytest.mark.slow

REGIONS = ("eu", "us", "ap")


def metric(daemon, token, name: str) -> float:
    text = get(f"{daemon.url}/metrics", token)[1].decode()
    return sum(float(m) for m in re.findall(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M))


def test_three_versions_reach_six_nodes_in_three_regions_and_a_late_joiner_catches_up(cluster, tmp_path):
    paths = write_chain(tmp_path / "patches", 3, mib=8, chunk_kib=8)
    ms = manifests(paths)
    trainer = cluster.trainer()
    rollouts = [cluster.rollout(f"{r}{i}", r) for r in REGIONS for i in (1, 2)]
    wait_for(lambda: len(cluster.nodes()) == 7, 15, "seven nodes")
    for p in paths:
        publish(cluster, p)
    names = {d.name for d in rollouts}
    wait_for(lambda: all(held(cluster).get(n) == [1, 2, 3] for n in names), 60, "every node to hold 1..3",
             detail=lambda: (held(cluster), {d.name: [line for line in d.log().splitlines()
                                                      if " WARNING " in line or " ERROR " in line][-3:]
                                             for d in [trainer, *rollouts]},
                             {n["node_id"]: n.get("in_flight")
                              for n in status(cluster.tracker, cluster.token)["nodes"]}))
    for d in rollouts:
        for m in ms.values():
            check_store(d, m)
    total = sum(m.patch_bytes for m in ms.values())
    up = metric(trainer, cluster.token, 'sparrowd_bytes_total{direction="up",region_class="same"}') + metric(
        trainer, cluster.token, 'sparrowd_bytes_total{direction="up",region_class="other"}')
    assert total <= up <= 1.5 * total, (up, total)  # super-seeding: each chunk leaves the trainer about once
    snap = status(cluster.tracker, cluster.token)
    assert snap["latest_version"] == 3
    assert all("bytes_up_wan" in n and "bytes_down_wan" in n for n in snap["nodes"])

    late = cluster.rollout("late", "us")
    wait_for(lambda: held(cluster).get("late") == [1, 2, 3], 30, "the late joiner to catch up")
    for m in ms.values():
        check_store(late, m)

    # Publishing again is harmless; a version that does not follow the chain is refused.
    r = sparrowd("publish", paths[2], "--daemon", cluster.tracker, "--token-file", cluster.token_file)
    assert r.returncode == 0 and "was already published" in r.stdout


def test_a_node_killed_mid_transfer_does_not_stop_the_others_and_resumes_without_refetching(cluster, tmp_path):
    paths = write_chain(tmp_path / "patches", 1, mib=32, chunk_kib=8)
    (m,) = manifests(paths).values()
    # A slow trainer uplink keeps the version in flight long enough to kill a node inside it.
    cluster.trainer(extra=("--upload-rate", "48K"))
    rollouts = [cluster.rollout(f"{r}1", r, extra=("--upload-rate", "96K")) for r in REGIONS]
    victim = cluster.rollout("victim", "eu", extra=("--upload-rate", "96K"))
    wait_for(lambda: len(cluster.nodes()) == 5, 15, "five nodes")
    publish(cluster, paths[0])

    def victim_chunks() -> int:
        d = victim.data_dir / "versions" / "1" / "chunks"
        return len(list(d.glob("*.chunk"))) if d.exists() else 0

    wait_for(lambda: victim_chunks() >= 3, 30, "the victim to hold a few chunks")
    victim.kill()
    kept = victim_chunks()
    assert kept < len(m.chunks)
    names = {d.name for d in rollouts}
    wait_for(lambda: all(held(cluster).get(n) == [1] for n in names), 90, "the others to complete")
    for d in rollouts:
        check_store(d, m)

    again = cluster.rollout("victim", "eu")  # same data dir
    wait_for(lambda: held(cluster).get("victim") == [1], 30, "the victim to complete after its restart")
    check_store(again, m)
    sizes = {i: e.size for i, e in enumerate(m.chunks)}
    fetched = metric(again, cluster.token, 'sparrowd_bytes_total{direction="down",region_class="same"}') + metric(
        again, cluster.token, 'sparrowd_bytes_total{direction="down",region_class="other"}')
    # It fetched at most what it lacked (endgame duplicates aside), never what it had verified.
    missing = sum(sorted(sizes.values())[: len(m.chunks) - kept]) if kept else m.patch_bytes
    assert fetched <= m.patch_bytes - sum(sorted(sizes.values())[:kept]) + 2 * max(sizes.values()), (fetched, missing)
    assert "chunk store loaded" in again.log()


@contextlib.contextmanager
def hostile_peer(cluster, patch, serve_chunk, node_id="mallory", forged=(), connections=None, region="eu",
                 claims=True, push=None, first_reply_after=0.0):
    """A node with the swarm token, in ``region``: it joins and renews like a daemon, relays the
    trainer's real signed statements, claims every chunk (``claims``; or none), and answers chunk
    requests with ``serve_chunk(request, index, true_bytes)`` (an aiohttp handler body); ``forged``
    adds versions of its own making (exchange entries); ``push``, an aiohttp handler, takes the
    chunks pushed to it. Yields the indices asked of it. ``connections``, a list, gets ``(kind,
    client port)`` for every connection opened to it (kind: connect) and every request on one
    (exchange, ping, chunk, push). ``first_reply_after``: seconds the first exchange is held before
    its reply (then ``("answered", port)``)."""
    port = free_port()
    mp = {"Content-Type": "application/msgpack"}
    view = parse_patch(patch.read_bytes())
    key = new_key()
    code, body = get(f"{cluster.tracker}/v1/tracker/join", cluster.token, method="POST", headers=mp,
                     data=msgpack.packb(members.join(key, node_id, region=region, address=f"127.0.0.1:{port}")))
    assert code == 200
    lease = msgpack.unpackb(body)
    proof = members.peer(key, node_id, "trainer", lease)
    code, body = get(f"{cluster.tracker}/v1/swarm/exchange", None, method="POST", headers={**mp, **proof},
                     data=msgpack.packb({"node_id": node_id, "region": region, "after": -1, "wait": 0,
                                         "versions": []}))
    statements = msgpack.unpackb(body)["versions"][0]["statements"]
    everything = bytes([0xFF if claims else 0]) * ((len(view.manifest.chunks) + 7) // 8)
    asked = []

    def seen(kind, request):
        if connections is not None:
            connections.append((kind, request.transport.get_extra_info("peername")[1]))

    async def ping(request):
        seen("ping", request)
        return web.Response(status=204)

    answered = []

    async def exchange(request):
        seen("exchange", request)
        if not answered:
            await asyncio.sleep(first_reply_after)
            answered.append(True)
            seen("answered", request)
        reply = {"gen": 1, "choked": False, "versions": [
            {"version": view.manifest.version, "statements": statements, "have": everything, "fetching": b""},
            *forged]}
        return web.Response(body=msgpack.packb(reply), content_type="application/msgpack")

    async def chunk(request):
        seen("chunk", request)
        i = int(request.match_info["index"])
        asked.append(i)
        return await serve_chunk(request, i, bytes(view.chunks[i]))

    async def pushed(request):
        seen("push", request)
        return await push(request)

    app = web.Application()
    app.add_routes([web.post("/v1/swarm/exchange", exchange), web.get("/v1/swarm/chunk/{version}/{index}", chunk),
                    web.get("/v1/swarm/ping", ping)])
    if push is not None:
        app.add_routes([web.post("/v1/swarm/chunk/{version}/{index}", pushed)])
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    loop.run_until_complete(runner.setup())

    listener = socket.socket()
    listener.bind(("127.0.0.1", port))
    listener.listen(64)
    listener.setblocking(False)

    async def accept():  # aiohttp's server on the connections accepted here, each told of as it is made
        while True:
            sock, (_, client_port) = await loop.sock_accept(listener)
            if connections is not None:
                connections.append(("connect", client_port))
            await loop.connect_accepted_socket(runner.server, sock)

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    acceptor = asyncio.run_coroutine_threadsafe(accept(), loop)
    stop = threading.Event()

    def renew():
        while not stop.wait(0.5):
            try:
                get(f"{cluster.tracker}/v1/tracker/renew", cluster.token, method="POST", headers=mp,
                    data=msgpack.packb(members.renew(key, node_id, lease["epoch"])))
            except OSError:
                pass  # a renewal that timed out (a busy trainer) goes again at the next tick

    threading.Thread(target=renew, daemon=True).start()
    try:
        yield asked
    finally:
        stop.set()
        acceptor.cancel()
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        listener.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def test_a_node_opens_a_spare_connection_to_each_peer_and_keeps_it_for_its_requests(cluster, tmp_path):
    """A peer's long poll holds the connection a node has to it, and a chunk request or push on a new
    one pays TCP's handshake, a round trip across regions, before its first byte. So a node opens a
    spare connection to each peer it takes, bare (no request on it until one needs it), and keeps
    idle connections for an hour (an RL step between two versions is often minutes): the spare
    carries its later requests to that peer."""
    paths = write_chain(tmp_path / "patches", 1, mib=8, chunk_kib=8)
    (m,) = manifests(paths).values()
    cluster.trainer()
    publish(cluster, paths[0])
    seen: list[tuple[str, int]] = []

    async def serve(request, i, data):
        return web.Response(body=data)

    with hostile_peer(cluster, paths[0], serve, connections=seen, first_reply_after=1.0):
        honest = cluster.rollout("honest", "eu", extra=("--push", "off"))
        wait_for(lambda: held(cluster).get("honest") == [1], 30, "the node to complete the version")
        check_store(honest, m)
        # While its first exchange here was held (it knew of no chunk here yet, so asked for none),
        # the node opened a second connection: the spare, on which no request came (not even a
        # ping) until one needed it. (On a busy machine the node may hold the version before the
        # held reply goes: it learns of this peer late and has most chunks from the trainer.)
        wait_for(lambda: any(e[0] == "answered" for e in seen), 10, "the held exchange to be answered")
        answered = seen.index(next(e for e in seen if e[0] == "answered"))
        opened = [port for kind, port in seen[:answered] if kind == "connect"]
        spare = [p for p in opened if not any(k != "connect" and q == p for k, q in seen[:answered])]
        assert spare, seen[:answered + 3]
        wait_for(lambda: any(k in ("exchange", "chunk") and q in spare for k, q in seen[answered:]), 10,
                 f"a request on the spare connection: {seen[:answered + 8]}")


def _flipped(view, i, data):
    data = bytearray(data)
    data[len(data) // 2] ^= 0x01
    return bytes(data)


@pytest.mark.parametrize("lie", [
    _flipped,
    lambda view, i, data: bytes(view.chunks[(i + 1) % len(view.chunks)]),  # another chunk's real bytes
    lambda view, i, data: data + b"\0" * 4096,  # longer than signed
    lambda view, i, data: data[: len(data) // 2],  # cut short
], ids=["flipped-bytes", "another-chunk", "too-long", "truncated"])
def test_a_peer_serving_corrupt_chunks_is_banned_and_the_chunk_fetched_elsewhere(cluster, tmp_path, lie):
    paths = write_chain(tmp_path / "patches", 1, mib=8, chunk_kib=8)
    (m,) = manifests(paths).values()
    view = parse_patch(paths[0].read_bytes())
    cluster.trainer()
    publish(cluster, paths[0])

    async def flipped(request, i, data):
        return web.Response(body=lie(view, i, data))

    with hostile_peer(cluster, paths[0], flipped) as asked:
        honest = cluster.rollout("honest", "eu")
        wait_for(lambda: held(cluster).get("honest") == [1], 20, "the honest node to complete")
        check_store(honest, m)
        assert asked, "the honest node never asked the hostile peer (the test tested nothing)"
        assert "peer banned for the session peer=mallory" in honest.log()
        n_asked = len(asked)
        time.sleep(1.0)
        assert len(asked) == n_asked  # banned: asked nothing more


def test_a_peer_announcing_a_version_the_trainer_never_signed_is_banned(cluster, tmp_path):
    """A token holder without the trainer's key signs its own announcement of version 99: the
    honest node refuses the statement, bans the peer, stores nothing of it, and still completes
    the real version from the trainer."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from sparrowd.swarm.signing import ANNOUNCE, Signer
    from sparrowd.swarm.versions import ChunkRef, announce_body

    paths = write_chain(tmp_path / "patches", 1, mib=8, chunk_kib=8)
    (m,) = manifests(paths).values()
    cluster.trainer()
    publish(cluster, paths[0])
    fake = b"not a real chunk"
    forged = Signer(Ed25519PrivateKey.generate()).sign(ANNOUNCE, 99, announce_body(
        0, [ChunkRef(blake3.blake3(fake).digest(), len(fake))]))
    entry = {"version": 99, "statements": [forged.to_bytes()], "have": b"\x80", "fetching": b""}

    async def serve(request, i, data):
        return web.Response(body=fake)

    with hostile_peer(cluster, paths[0], serve, forged=[entry]):
        honest = cluster.rollout("honest", "eu")
        wait_for(lambda: held(cluster).get("honest") == [1], 20, "the honest node to complete")
        check_store(honest, m)
        wait_for(lambda: "peer banned for the session peer=mallory" in honest.log(), 10, "the ban")
        assert "bad signature" in honest.log()
        assert not (honest.data_dir / "versions" / "99").exists()


@pytest.mark.parametrize("trickle", [False, True], ids=["silent", "a-byte-a-second"])
def test_a_peer_that_stalls_mid_chunk_loses_its_requests_to_others(cluster, tmp_path, trickle):
    paths = write_chain(tmp_path / "patches", 1, mib=8, chunk_kib=8)
    (m,) = manifests(paths).values()
    cluster.trainer()
    publish(cluster, paths[0])

    async def stall(request, i, data):  # headers and a few bytes, then nothing or a byte a second
        resp = web.StreamResponse(headers={"Content-Length": str(len(data))})
        await resp.prepare(request)
        await resp.write(data[:10])
        for b in data[10:] if trickle else ():
            await asyncio.sleep(1.0)
            await resp.write(bytes([b]))
        await asyncio.sleep(3600)
        return resp

    with hostile_peer(cluster, paths[0], stall) as asked:
        t0 = time.monotonic()
        honest = cluster.rollout("honest", "eu")
        wait_for(lambda: held(cluster).get("honest") == [1], 40, "the honest node to complete")
        took = time.monotonic() - t0
        check_store(honest, m)
        assert asked, "the honest node never asked the stalling peer (the test tested nothing)"
        # Its requests timed out (5 s plus the chunk size at 128 KiB/s; the peer then cools down)
        # or lost the endgame to the trainer, whichever came first.
        assert took < 5.0 + 8 / 128 + 10, took
        assert len(asked) <= 2 * 2 + 2, asked  # one round of its slots, a retry or two at most


def test_retention_and_the_trainer_upload_limit(cluster, tmp_path):
    paths = write_chain(tmp_path / "patches", 3, mib=8, chunk_kib=8)
    ms = manifests(paths)
    rate = 32 << 10
    trainer = cluster.trainer(extra=("--retain", "2", "--upload-rate", "32K"))
    for p in paths:  # published before any node exists: the timing below is the transfer alone
        publish(cluster, p)
    t0 = time.monotonic()
    nodes = [cluster.rollout(f"n{i}", "eu", extra=("--retain", "2")) for i in range(2)]
    wait_for(lambda: all(held(cluster).get(d.name) == [2, 3] for d in nodes), 60, "both nodes to hold 2 and 3")
    elapsed = time.monotonic() - t0
    # The retained versions left the trainer no faster than its limit (after a 16 KiB burst);
    # unlimited, this takes about a second on loopback, start-up included.
    sent = ms[2].patch_bytes + ms[3].patch_bytes
    assert elapsed >= (sent - (16 << 10)) / rate * 0.9, elapsed
    # Only the newest two versions are kept, on disk too, by the trainer and the nodes.
    assert held(cluster)["trainer"] == [2, 3]
    for d in [trainer, *nodes]:
        kept = sorted(int(p.name) for p in (d.data_dir / "versions").iterdir())
        assert kept == [2, 3], (d.name, kept)
    for d in nodes:
        check_store(d, ms[3])


def test_chunks_move_before_the_manifest_exists(cluster, tmp_path):
    """Streaming announce: chunks published one by one reach nodes while later ones are still to
    come; the version completes when the signed manifest follows."""
    paths = write_chain(tmp_path / "patches", 1, mib=8, chunk_kib=8)
    view = parse_patch(paths[0].read_bytes())
    cluster.trainer()
    node = cluster.rollout("early", "us")
    wait_for(lambda: len(cluster.nodes()) == 2, 15, "two nodes")
    half = len(view.chunks) // 2
    for i in range(half):
        code, body = get(f"{cluster.tracker}/v1/publish/1/chunk/{i}", cluster.token, method="POST",
                         data=bytes(view.chunks[i]))
        assert code == 200, body
    stored = node.data_dir / "versions" / "1" / "chunks"
    wait_for(lambda: stored.exists() and len(list(stored.glob("*.chunk"))) == half, 15,
             "the node to hold the chunks published so far")
    assert held(cluster).get("early") == []  # not complete: no manifest yet
    for i in range(half, len(view.chunks)):
        assert get(f"{cluster.tracker}/v1/publish/1/chunk/{i}", cluster.token, method="POST",
                   data=bytes(view.chunks[i]))[0] == 200
    code, body = get(f"{cluster.tracker}/v1/publish/manifest", cluster.token, method="POST", data=view.manifest_bytes)
    assert code == 200, body
    wait_for(lambda: held(cluster).get("early") == [1], 20, "the node to complete version 1")
    check_store(node, view.manifest)


def test_a_streams_timeout_covers_the_trainers_share_of_a_slow_uplink():
    """A chunk's stream may take 5 s plus its size at ``MIN_RATE``; where the trainer's uplink is so
    slow that its upload slots' share of it takes longer (``UPLOAD_SLOTS`` times the chunk's signed
    send time), that long, so requests to a slow trainer are not given up while they come."""
    size = 340 << 10
    assert stream_timeout(size, None) == 5.0 + size / MIN_RATE
    assert stream_timeout(size, 0.1) == 5.0 + size / MIN_RATE  # a fast uplink: as before
    slow = size / (200 << 10)  # the chunk's time at 200 KiB/s
    assert stream_timeout(size, slow) == pytest.approx(5.0 + UPLOAD_SLOTS * slow)
    assert stream_timeout(size, slow) > 2 * (5.0 + size / MIN_RATE) - 5.0
