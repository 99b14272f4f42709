"""Push between real daemons: relays send what they can serve unasked, and a node takes a pushed chunk
only when it can check it, bit for bit."""

from __future__ import annotations

import asyncio
import json
import re
import time

import blake3
import numpy as np
import pytest
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from sparrowd.bench.swarm import _write_patch
from sparrowd.codec.patchfile import parse_patch
from tests.daemon.harness import Member, get, wait_for
from tests.daemon.patches import check_store, held, manifests, publish, write_chain
from tests.daemon.test_swarm import hostile_peer, metric

pytestmark = pytest.mark.slow


def pushes(d, token, outcome: str) -> float:
    return metric(d, token, f'sparrowd_pushes_total{{outcome="{outcome}"}}')


def one_chunk_to_all(cluster, tmp_path, seed: int, regions: tuple[str, ...], *, trainer_extra=(), extra=(),
                     chunks: int = 1):
    """A one-chunk version (or of ``chunks`` chunks of 256 KiB) from a trainer capped at 512 KiB/s to
    rollouts in ``regions``, published once every node knows every other (a renewal with the full
    list) and checked on every node, bit for bit. Returns the rollouts and the trainer's upload over
    the patch."""
    path = tmp_path / "v1.sprw"
    _write_patch(path, 1, chunks * (256 << 10) - 4096, 256 << 10, np.random.default_rng(seed))
    m = parse_patch(path.read_bytes()).manifest
    assert len(m.chunks) == chunks
    trainer = cluster.trainer(extra=("--upload-rate", "512K", *trainer_extra))
    rollouts = [cluster.rollout(f"r{i}", region, extra=extra) for i, region in enumerate(regions)]
    wait_for(lambda: len(cluster.nodes()) == len(regions) + 1, 15, f"{len(regions) + 1} nodes")
    time.sleep(2.5)
    before = time.time()
    publish(cluster, path)
    wait_for(lambda: all(held(cluster).get(d.name) == [1] for d in rollouts), 60, "every node to hold version 1",
             detail=lambda: held(cluster))
    for d in rollouts:
        check_store(d, m)
        assert "peer banned" not in d.log()
        assert before < d.node(cluster.token)["held_at"]["1"] < time.time()  # when it came to hold it
    up = sum(metric(trainer, cluster.token, f'sparrowd_bytes_total{{direction="up",region_class="{rc}"}}')
             for rc in ("same", "other"))
    return rollouts, up / m.patch_bytes


@pytest.mark.parametrize("push", ["2,2", "off"])
def test_a_one_chunk_patch_is_pushed_on_by_the_relays(cluster, tmp_path, push):
    rollouts, up = one_chunk_to_all(cluster, tmp_path, 2, ("eu", "eu", "us", "us", "ap"), extra=("--push", push))
    assert up < 1.9, up  # the trainer sent about one copy
    received = sum(pushes(d, cluster.token, "received") for d in rollouts)
    taken = sum(pushes(d, cluster.token, "taken") for d in rollouts)
    if push == "off":
        assert received == taken == 0
    else:
        outcomes = {o: sum(pushes(d, cluster.token, o) for d in rollouts)
                    for o in ("taken", "refused", "failed", "received", "declined")}
        assert received >= 1 and taken == received, outcomes


def test_heads_push_across_to_the_heads_of_regions_they_do_not_peer_with(cluster, tmp_path):
    """Peer lists of the trainer alone (--peer-limit 1), four regions of one node: every node is its
    region's head, learns every region's heads from the tracker, and pushes across to those it has no
    exchanges with; they admit it (the tracker named it to them as a head).

    With no rollout on any peer list, a rollout can have the chunk only from the trainer or from a
    push; the trainer's super-seeding hands out one copy, so the others come by pushes to contacts.
    (With two-entry lists a node sometimes pulled from its one rollout peer first, and then the only
    push was to a peer: flaky.)"""
    rollouts, up = one_chunk_to_all(cluster, tmp_path, 3, ("eu", "us", "ap", "sa"),
                                    trainer_extra=("--peer-limit", "1"), extra=("--log-level", "debug"))
    logs = "".join(d.log() for d in rollouts)
    taken = [ln for ln in logs.splitlines() if "pushed a chunk" in ln and "outcome=taken" in ln]
    assert taken and all("contact=True" in ln for ln in taken), taken
    # Every stream carried the region the chunk entered the swarm in (X-Sparrowd-Root), so every push
    # followed the chunk's region tree from it.
    roots = {ln.split("root=")[1].split()[0] for ln in taken}
    assert len(roots) == 1 and roots <= {"eu", "us", "ap", "sa"}, taken
    assert up < 1.9, up


def test_a_push_is_taken_only_when_it_can_be_checked_and_a_bad_one_bans_its_sender(cluster, tmp_path):
    path = tmp_path / "v1.sprw"
    _write_patch(path, 1, 8 * (64 << 10) - 4096, 64 << 10, np.random.default_rng(3))
    view = parse_patch(path.read_bytes())
    m = view.manifest
    n = len(m.chunks)
    assert n >= 4
    # The trainer sends slowly (32 KiB/s): super-seeding offers the node two chunks at a time, so the
    # others are wanted and not being fetched while the member pushes.
    cluster.trainer(extra=("--upload-rate", "32K"))
    r0 = cluster.rollout("r0", "eu", extra=("--push", "off"))
    mallory = Member(cluster, "m1", "eu")
    wait_for(lambda: len(cluster.nodes()) == 3, 15, "three nodes")

    def push(index: int, data: bytes) -> tuple[int, dict]:
        mallory.renew()  # its lease kept, as a daemon's (leases last 2 s here: a loaded run outlived it)
        code, body = get(f"{r0.url}/v1/swarm/chunk/1/{index}", None, method="POST", data=bytes(data),
                         headers={**mallory.headers(r0.name), "Content-Type": "application/octet-stream"},
                         timeout=30)
        return code, json.loads(body or b"{}")

    # Before the version exists, a push cannot be checked: declined. (503 while r0 asks the tracker
    # about a member it has not heard of; then "not a peer" until its peer list names it.)
    wait_for(lambda: push(0, view.chunks[0])[1].get("error") == "no signed block hashes for that chunk here yet",
             20, "r0 to take the member as a peer", detail=lambda: push(0, view.chunks[0]))
    publish(cluster, path)

    def first_taken() -> tuple[int] | None:
        for i in range(n):
            code, body = push(i, view.chunks[i])
            if code == 200 and body.get("stored"):
                return (i,)
        return None

    (good,) = wait_for(first_taken, 20, "a pushed chunk to be taken")
    assert pushes(r0, cluster.token, "received") == 1
    assert push(good, view.chunks[good]) == (409, {"error": "held"})
    # A chunk of the right length with one bad byte in its first block: checked as it arrives, the
    # sender banned for the session, nothing stored.
    for i in range(n):
        bad = bytearray(view.chunks[i])
        bad[100] ^= 0xFF
        code, body = push(i, bad)
        if code == 200:
            assert body == {"stored": False}
            break
        assert body.get("error") in ("held", "being fetched"), body
    else:
        pytest.fail("no chunk left to push a bad copy of")
    assert metric(r0, cluster.token, 'sparrowd_peers_banned_total{reason="bad-chunk"}') == 1
    assert "peer banned" in r0.log()
    assert push(0, view.chunks[0])[0] in (403, 409)  # banned: no longer a peer of r0
    wait_for(lambda: held(cluster).get("r0") == [1], 60, "r0 to hold version 1 (from the trainer)",
             detail=lambda: held(cluster))
    check_store(r0, m)


def test_a_push_takes_the_place_of_a_request_that_has_had_no_byte_back(cluster, tmp_path):
    # A peer that claims every chunk and holds the requests it gets without answering: the node's
    # request to it for a chunk has had no byte back when another member pushes that chunk, so the
    # push is taken (the request is dropped) instead of declined as "being fetched".
    paths = write_chain(tmp_path / "patches", 1, mib=8, chunk_kib=8)
    (m,) = manifests(paths).values()
    view = parse_patch(paths[0].read_bytes())
    cluster.trainer(extra=("--upload-rate", "64K"))
    publish(cluster, paths[0])
    pusher = Member(cluster, "p1", "eu")

    async def silent(request, i, data):
        await asyncio.sleep(60)
        return web.Response(body=data)

    with hostile_peer(cluster, paths[0], silent) as asked:
        honest = cluster.rollout("honest", "eu", extra=("--push", "off"))
        wait_for(lambda: asked, 20, "the node to ask the silent peer for a chunk")
        i = asked[0]
        # The pusher's lease kept (leases last 2 s here; a loaded run outlived it), and listed as a peer.
        wait_for(lambda: pusher.renew() or any(p["node_id"] == "p1" for p in honest.node(cluster.token)["peers"]),
                 20, "the node to list the pusher as a peer")
        code, body = get(f"{honest.url}/v1/swarm/chunk/1/{i}", None, method="POST", data=bytes(view.chunks[i]),
                         headers={**pusher.headers("honest"), "Content-Type": "application/octet-stream"}, timeout=30)
        assert (code, json.loads(body)) == (200, {"stored": True})
        assert pushes(honest, cluster.token, "received") == 1
        pusher.renew()
        wait_for(lambda: held(cluster).get("honest") == [1], 60, "the node to complete the version",
                 detail=lambda: held(cluster))
        check_store(honest, m)


def test_a_push_carries_the_chunks_signed_statement_so_a_node_that_has_not_heard_of_the_version_checks_it(
        cluster, tmp_path):
    """A push names the trainer's statement announcing its chunk (``X-Sparrowd-Statement``): a node that
    has not heard of the version yet takes it and checks the blocks at once, where it waited for the
    trainer's announcement (a swarm just formed hears of its first version a long poll's round trip
    late). The trainer's signature vouches for it, not the pusher's: one it did not sign, or one for
    another version, is refused; without one the push cannot be checked and is declined."""
    import base64

    from sparrowd.swarm.signing import ANNOUNCE, Signer, load_or_create_key
    from sparrowd.swarm.versions import ChunkRef, announce_body, block_hashes

    trainer = cluster.trainer()
    r0 = cluster.rollout("r0", "eu", extra=("--push", "off"))
    mallory = Member(cluster, "m1", "eu")
    wait_for(lambda: mallory.known_to(r0), 20, "r0 to know the member")
    data = np.random.default_rng(5).integers(0, 256, 64 << 10, dtype=np.uint8).tobytes()
    block = 16 << 10
    ref = ChunkRef(blake3.blake3(data).digest(), len(data))

    def statement(signer, version: int) -> str:
        st = signer.sign(ANNOUNCE, version, announce_body(0, [ref], [block_hashes(data, block)], block))
        return base64.b64encode(st.to_bytes()).decode()

    real = load_or_create_key(trainer.data_dir / "trainer.key")

    def push(headers: dict) -> tuple[int, dict]:
        code, body = get(f"{r0.url}/v1/swarm/chunk/5/0", None, method="POST", data=data, timeout=30,
                         headers={**mallory.headers("r0"), "Content-Type": "application/octet-stream", **headers})
        return code, json.loads(body or b"{}")

    wait_for(lambda: push({})[1].get("error") == "no signed block hashes for that chunk here yet", 20,
             "r0 to take the member as a peer", detail=lambda: push({}))
    code, body = push({"X-Sparrowd-Statement": statement(real, 6)})  # signed, but for another version
    assert code == 400 and "not an announcement of version 5" in body["error"], body
    assert push({"X-Sparrowd-Statement": "not base64!"})[0] == 400
    # Taken and checked against the statement's block hashes: without it, declined (above).
    assert push({"X-Sparrowd-Statement": statement(real, 5)}) == (200, {"stored": True})
    assert pushes(r0, cluster.token, "received") == 1
    code, reply = mallory.exchange(r0, [])
    (v5,) = [e for e in reply["versions"] if e["version"] == 5]
    assert v5["have"] == b"\x80"  # it holds chunk 0, checked against the trainer's block hashes
    # A statement the trainer did not sign: refused, and its pusher banned, as for a forged statement
    # in an exchange reply.
    code, body = get(f"{r0.url}/v1/swarm/chunk/7/0", None, method="POST", data=data, timeout=30,
                     headers={**mallory.headers("r0"), "Content-Type": "application/octet-stream",
                              "X-Sparrowd-Statement": statement(Signer(Ed25519PrivateKey.generate()), 7)})
    assert code == 400 and "bad signature" in json.loads(body)["error"], body
    assert metric(r0, cluster.token, 'sparrowd_peers_banned_total{reason="bad-chunk"}') == 1
    assert push({})[0] in (403, 409)  # no longer a peer of r0


def test_a_relay_pushes_a_chunk_neither_back_to_its_feeder_nor_to_the_peers_its_feeder_also_feeds(cluster, tmp_path):
    """A push names the other peers its sender feeds the same chunk (``X-Sparrowd-Also``). The node
    that takes it relays it on, cut-through, but not back to its sender, nor to those peers: their
    exchanges had not yet told that they fetch it, and two nodes fed by the same head pushed it to
    each other and to their head, leaving a third to ask (one chunk to 16 daemons in 4 regions:
    1.3-1.8x the bound in one version of six)."""
    import base64
    import http.client
    from urllib.parse import urlparse

    from sparrowd.swarm.signing import ANNOUNCE, load_or_create_key
    from sparrowd.swarm.versions import ChunkRef, announce_body, block_hashes

    trainer = cluster.trainer()
    # r0 would push to every peer of its region it sees without the chunk (3 local, none across).
    r0 = cluster.rollout("r0", "eu", extra=("--push", "3,0", "--log-level", "debug"))
    r1, r2 = (cluster.rollout(name, "eu", extra=("--push", "off")) for name in ("r1", "r2"))
    feeder = Member(cluster, "m1", "eu")
    wait_for(lambda: feeder.renew() or len(cluster.nodes()) == 5, 15, "five nodes")
    data = np.random.default_rng(6).integers(0, 256, 64 << 10, dtype=np.uint8).tobytes()
    block = 16 << 10
    ref = ChunkRef(blake3.blake3(data).digest(), len(data))
    st = load_or_create_key(trainer.data_dir / "trainer.key").sign(
        ANNOUNCE, 5, announce_body(0, [ref], [block_hashes(data, block)], block))

    def unchecked() -> str:  # a push r0 cannot check yet: declined, and why
        feeder.renew()  # its lease kept, as a daemon's
        code, reply = get(f"{r0.url}/v1/swarm/chunk/5/0", None, method="POST", data=data, timeout=30,
                          headers={**feeder.headers("r0"), "Content-Type": "application/octet-stream"})
        return json.loads(reply or b"{}").get("error", "")

    for _ in range(5):  # a renewal: r0 peers with r1 and r2 (the member's lease kept, as a daemon's)
        feeder.renew()
        time.sleep(0.5)
    wait_for(lambda: unchecked() == "no signed block hashes for that chunk here yet", 20,
             "r0 to take the member as a peer", detail=unchecked)

    def body():  # a first block, then the rest a while later: r0 relays the chunk while it arrives
        yield data[:block]
        time.sleep(2.0)
        yield data[block:]

    u = urlparse(r0.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("POST", "/v1/swarm/chunk/5/0", body=body(), encode_chunked=True, headers={
        **feeder.headers("r0"), "Content-Type": "application/octet-stream",
        "X-Sparrowd-Statement": base64.b64encode(st.to_bytes()).decode(), "X-Sparrowd-Also": "r1,elsewhere"})
    r = conn.getresponse()
    assert (r.status, json.loads(r.read())) == (200, {"stored": True})
    wait_for(lambda: "pushed a chunk peer=r2" in r0.log(), 20, "r0 to push the chunk on to r2",
             detail=lambda: r0.log()[-2000:])
    pushed_to = set(re.findall(r'pushing a chunk peer=(\S+) object="version 5"', r0.log()))
    assert pushed_to == {"r2"}, pushed_to  # not to m1 (its feeder), nor to r1 (fed by m1 too)
    feeder.renew()  # a fresh ticket: the last one may have outlived its lease by now
    code, reply = feeder.exchange(r2, [])
    assert code == 200, (code, reply)
    (v5,) = [e for e in reply["versions"] if e["version"] == 5]
    assert v5["have"] == b"\x80"  # r2 holds the chunk r0 relayed, checked against the trainer's hashes


def test_the_trainer_signs_each_chunks_tree_timing_from_the_delay_its_nodes_measured(cluster, tmp_path):
    """Rollouts time their exchanges (the shortest is a round trip) and tell the trainer their one-way
    delay between regions; the trainer signs into each chunk's announcement its region tree's timing:
    the chunk's time at its upload limit, and the nodes' median delay plus a block's time. Every node
    then plans the same tree."""
    from sparrowd.swarm.signing import Signed
    from sparrowd.swarm.versions import _parse_announce

    paths = write_chain(tmp_path / "patches", 2, mib=1, chunk_kib=64)
    trainer = cluster.trainer(extra=("--upload-rate", "4M"))
    rollouts = [cluster.rollout(f"r{i}", region) for i, region in enumerate(("eu", "us", "ap"))]
    wait_for(lambda: len(cluster.nodes()) == 4, 15, "four nodes")

    def delay(d) -> float | None:  # the gauge, None while it is not there
        text = get(f"{d.url}/metrics", cluster.token)[1].decode()
        found = re.findall(r"^sparrowd_wan_delay_seconds ([-0-9.e+]+)$", text, re.M)
        return float(found[0]) if found else None

    wait_for(lambda: all(delay(d) is not None for d in rollouts), 20, "every rollout to measure its delay")
    wait_for(lambda: delay(trainer) is not None, 20, "the trainer to hear the rollouts' delays")
    assert all(0 < delay(d) < 0.5 for d in [*rollouts, trainer])  # loopback: a millisecond or so, a busy box more
    publish(cluster, paths[0])
    member = Member(cluster, "m1", "eu")
    wait_for(lambda: member.known_to(trainer), 20, "the trainer to know the member")
    code, reply = member.exchange(trainer, [])
    assert code == 200
    (v1,) = [e for e in reply["versions"] if e["version"] == 1]
    trees = []
    for raw in v1["statements"]:
        st = Signed.from_bytes(raw)
        if not st.is_manifest:
            _, refs, block, _, tree = _parse_announce(st.body)
            assert tree is not None, "an announcement without its tree's timing"
            send, hop = tree
            assert abs(send - refs[0].size / (4 << 20)) < 2e-6  # the chunk at the trainer's 4 MiB/s
            assert block / (4 << 20) < hop < block / (4 << 20) + 0.5  # a block's time and the delay
            trees.append(tree)
    assert trees
    wait_for(lambda: all(held(cluster).get(d.name) == [1] for d in rollouts), 60, "every node to hold version 1")


def test_a_stream_cancelled_before_it_starts_is_no_longer_counted_in_flight():
    """A request or a taken push counts in ``inflight`` (the chunk is being fetched) and in its peer's
    requests until its task ends, however it ends: one cancelled before its first step (a request a
    push replaced the moment it was made, an endgame loser) runs none of its own code, and its entry
    once stayed, the chunk "being fetched" and the peer's slot taken for good."""
    from types import SimpleNamespace

    from sparrowd.daemon.swarm import PeerState, Swarm
    from sparrowd.swarm.chain import Key

    async def main():
        me = SimpleNamespace(inflight={}, asked_at={}, _changed=asyncio.Event())
        r1, mallory = PeerState("r1", "a:1", "us", "rollout"), PeerState("mallory", "a:2", "us", "rollout")
        key = (Key(6, False), 4)
        ran = []

        async def stream(tag):
            ran.append(tag)
            await asyncio.sleep(0.01)

        asked = asyncio.create_task(stream("asked"))
        Swarm._track(me, mallory, key, asked)
        pushed = asyncio.create_task(stream("pushed"))
        Swarm._track(me, r1, key, pushed)
        assert set(me.inflight[key]) == {"mallory", "r1"} and mallory.inflight == r1.inflight == 1
        asked.cancel()  # before its first step: its coroutine never runs
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert ran == ["pushed"] and set(me.inflight[key]) == {"r1"} and mallory.inflight == 0
        assert me._changed.is_set()  # the scheduler looks again
        await pushed
        await asyncio.sleep(0)
        assert key not in me.inflight and key not in me.asked_at and r1.inflight == 0
        # A push from the peer a request went to takes the request's place under the same name: the
        # request ending (cancelled) leaves the push's entry alone.
        asked = asyncio.create_task(stream("asked again"))
        Swarm._track(me, r1, key, asked)
        pushed = asyncio.create_task(stream("pushed again"))
        asked.cancel()
        Swarm._track(me, r1, key, pushed)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert me.inflight[key] == {"r1": pushed} and r1.inflight == 1
        await pushed
        await asyncio.sleep(0)
        assert key not in me.inflight and r1.inflight == 0

    asyncio.run(main())


def stripes(d, token, direction: str) -> float:
    return metric(d, token, f'sparrowd_stripes_total{{direction="{direction}"}}')


def test_a_patch_crosses_into_regions_of_one_node_in_stripes_each_handed_on_by_its_region(cluster, tmp_path):
    """Five regions of one rollout each: a chunk's region tree would be four crossings deep, so a
    patch's later chunks cross in stripes (``swarm.push.stripe_plan``): the first holder sends each
    region its stripe, each region hands its own on to the other four, and every node assembles the
    chunk from stripes of four senders, each block checked against the trainer's hashes, bit for bit."""
    rollouts, up = one_chunk_to_all(cluster, tmp_path, 11, ("eu", "us", "ap", "sa", "af"), chunks=2)
    sent = sum(stripes(d, cluster.token, "sent") for d in rollouts)
    received = sum(stripes(d, cluster.token, "received") for d in rollouts)
    # Chunk 1 at least: 4 stripes from its first holder, 4 x 3 handed on (a receiver already fetching
    # the chunk whole declines its own, and hands it on from that fetch).
    assert sent >= 8 and received >= 8, (sent, received)
    assert up < 1.9, up


def _signed_chunk(trainer, seed: int) -> tuple[bytes, str]:
    """A chunk of 4 blocks of 16 KiB (the last short), and the trainer's statement announcing it as
    chunk 0 of version 5 (base64, as a push carries it), which no one else has."""
    import base64

    from sparrowd.swarm.signing import ANNOUNCE, load_or_create_key
    from sparrowd.swarm.versions import ChunkRef, announce_body, block_hashes

    block = 16 << 10
    data = np.random.default_rng(seed).integers(0, 256, 4 * block - 100, dtype=np.uint8).tobytes()  # 4 blocks
    ref = ChunkRef(blake3.blake3(data).digest(), len(data))
    st = load_or_create_key(trainer.data_dir / "trainer.key").sign(
        ANNOUNCE, 5, announce_body(0, [ref], [block_hashes(data, block)], block))
    return data, base64.b64encode(st.to_bytes()).decode()


def _push_stripe(to, member, statement: str, label: str, body: bytes, root: str | None = None) -> tuple[int, dict]:
    """``member`` pushes ``body`` to relay ``to`` as stripe ``label`` ("s/n") of chunk 0 of version 5
    (``root``: the region it says the chunk entered the swarm in); (status, reply)."""
    member.renew()  # leases last 2 s here
    code, reply = get(f"{to.url}/v1/swarm/chunk/5/0", None, method="POST", data=body, timeout=30,
                      headers={**member.headers(to.name), "Content-Type": "application/octet-stream",
                               "X-Sparrowd-Statement": statement, "X-Sparrowd-Stripe": label,
                               **({"X-Sparrowd-Root": root} if root else {})})
    return code, json.loads(reply or b"{}")


def _stripe_rig(cluster, seed: int, near: int = 0):
    """A relay r0 (pushing nothing), ``near`` more like it in its region (r1, ...), and three members
    of other regions, each a peer of them; a chunk of 4 blocks of 16 KiB (the last short) signed by
    the trainer as chunk 0 of version 5, which no one else has. Returns r0 (or, with ``near``, the
    relays), the members, the chunk's bytes, and ``push(member, s, n, body, label=, to=r0)``, which
    pushes ``body`` to a relay as stripe ``s/n`` (or as ``label``) and returns (status, reply)."""
    trainer = cluster.trainer()
    extra = ("--push", "off", *(("--log-level", "debug") if near else ()))  # (debug: to read why r0 asked)
    relays = [cluster.rollout(f"r{i}", "eu", extra=extra) for i in range(1 + near)]
    r0 = relays[0]
    members = [Member(cluster, f"m{i}", region) for i, region in enumerate(("us", "ap", "sa"))]  # 3 stripes
    for mb in members:
        for r in relays:
            wait_for(lambda: mb.known_to(r), 20, f"{r.name} to know the member")
    data, statement = _signed_chunk(trainer, seed)

    def push(member, s: int, n: int, body: bytes, label: str | None = None, to=r0) -> tuple[int, dict]:
        return _push_stripe(to, member, statement, label or f"{s}/{n}", body)

    for r in relays:
        wait_for(lambda: "no stripe 3/3 of a chunk of 4 blocks" in push(members[0], 0, 3, b"", "3/3", r)[1].get(
                 "error", ""), 20, f"{r.name} to take the members as peers",
                 detail=lambda: push(members[0], 0, 3, b"", "3/3", r))
    return (relays if near else r0), members, data, push


def _stripe_of(data: bytes, s: int, n: int, block: int = 16 << 10) -> bytes:
    from sparrowd.swarm.push import stripe_blocks
    return b"".join(data[b * block : (b + 1) * block] for b in stripe_blocks(s, n, -(-len(data) // block)))


def _holds_chunk(r0, member) -> bool:
    code, reply = member.exchange(r0, [])
    (v5,) = [e for e in reply["versions"] if e["version"] == 5]
    return v5["have"] == b"\x80"  # it holds chunk 0, checked against the trainer's block hashes


def test_a_node_assembles_a_chunk_from_stripes_of_several_pushers_and_bans_one_whose_stripe_does_not_check(
        cluster, tmp_path):
    """Stripes of one chunk (``X-Sparrowd-Stripe: s/n``) from different members go into one buffer, in
    any order, each block checked as it completes; the stream that completes the chunk stores it. A
    stripe already taken is declined; one with a bad block bans its pusher and leaves the others'."""
    r0, members, data, push = _stripe_rig(cluster, 6)
    assert push(members[1], 1, 3, _stripe_of(data, 1, 3)) == (200, {"stored": False})  # in, the chunk not whole yet
    code, reply = push(members[2], 1, 3, _stripe_of(data, 1, 3))
    assert code == 409 and reply["error"] == "stripe held", reply
    bad = bytearray(_stripe_of(data, 0, 3))
    bad[(16 << 10) + 5] ^= 1  # block 3, the stripe's second
    assert push(members[0], 0, 3, bytes(bad)) == (200, {"stored": False})
    assert metric(r0, cluster.token, 'sparrowd_peers_banned_total{reason="bad-chunk"}') == 1
    assert push(members[2], 0, 3, _stripe_of(data, 0, 3)) == (200, {"stored": False})
    assert push(members[1], 2, 3, _stripe_of(data, 2, 3)) == (200, {"stored": True})  # the last stripe completes it
    assert stripes(r0, cluster.token, "received") == 3
    assert _holds_chunk(r0, members[1])


def test_a_stripe_count_is_the_pushers_word_and_a_false_one_holds_nothing_up(cluster, tmp_path):
    """A member that pushes the first stripe of a chunk under a false count (2 where the plan deals 3)
    has its blocks checked and kept, and the stripes of the real count are still taken beside it:
    the chunk completes from them at once, not after ``STRIPE_WAIT``. A stripe whose blocks all
    checked out already is declined, whatever its count."""
    r0, members, data, push = _stripe_rig(cluster, 7)
    assert push(members[0], 0, 2, _stripe_of(data, 0, 2)) == (200, {"stored": False})  # blocks 0 and 2
    code, reply = push(members[1], 0, 4, _stripe_of(data, 0, 4))  # block 0 alone: checked out already
    assert code == 409 and reply["error"] == "stripe held", reply
    t0 = time.monotonic()
    assert push(members[1], 1, 3, _stripe_of(data, 1, 3)) == (200, {"stored": False})  # block 1
    assert push(members[2], 0, 3, _stripe_of(data, 0, 3)) == (200, {"stored": True})  # blocks 0 (again) and 3
    assert time.monotonic() - t0 < 1.0 and _holds_chunk(r0, members[2])
    assert metric(r0, cluster.token, 'sparrowd_peers_banned_total{reason="bad-chunk"}') == 0


def test_a_chunk_arriving_in_stripes_is_fetched_whole_at_once_from_a_region_mate_that_holds_it(cluster, tmp_path):
    """In a swarm just formed, two members of a region can each be taken for its stripes' receiver by
    nodes that had not heard of the other yet. The one left with a stripe does not wait out
    ``STRIPE_WAIT`` for the rest once its region-mate holds the chunk whole: it asks that one for it."""
    (r0, r1), members, data, push = _stripe_rig(cluster, 8, near=1)
    assert push(members[1], 1, 3, _stripe_of(data, 1, 3)) == (200, {"stored": False})  # r0: one stripe in 3
    t0 = time.monotonic()
    for s, mb in enumerate(members):  # r1: all three
        assert push(mb, s, 3, _stripe_of(data, s, 3), to=r1)[1] == {"stored": s == 2}
    wait_for(lambda: _holds_chunk(r0, members[0]), 10, "r0 to hold the chunk")
    took = time.monotonic() - t0
    assert re.search(r'stripes stopped short; asking for the chunk whole .*why="a peer of this region holds it"',
                     r0.log()), r0.log()[-3000:]
    assert took < 1.0, took  # STRIPE_WAIT after r0's stripe, it would have asked anyway
    assert metric(r1, cluster.token, 'sparrowd_bytes_total{direction="up",region_class="same"}') >= len(data)


def test_a_receiver_hands_on_its_own_stripe_though_a_root_region_member_pushed_another_first(cluster, tmp_path):
    """A member of the chunk's root region that pushes a receiver a stripe of its own choosing, ahead
    of the first holder, does not keep the first holder's stripe from the other regions: the
    receiver hands on the first stripe the root region sent it and the one its own plan deals it
    (``swarm.push.stripes_handed_on``; the blocks are checked either way). Handing on only the
    first, the other regions waited out ``STRIPE_WAIT`` for theirs."""
    from sparrowd.swarm.push import stripe_plan

    path = tmp_path / "v1.sprw"
    _write_patch(path, 1, 64 << 10, 64 << 10, np.random.default_rng(12))
    trainer = cluster.trainer(region="eu")
    publish(cluster, path)  # (the far receivers below relay the trainer's statements of it)
    r0 = cluster.rollout("r0", "us")
    root = Member(cluster, "m0", "eu")  # the root region's only rollout: its head
    wait_for(lambda: root.known_to(r0), 20, "r0 to know the root region's member")
    data, statement = _signed_chunk(trainer, 13)
    got: dict[str, list[str]] = {"pa": [], "psa": []}

    def taker(name):
        async def push(request):
            got[name].append(request.headers.get("X-Sparrowd-Stripe", "whole"))
            await request.read()
            return web.json_response({"stored": False})
        return push

    polls: list = []
    with hostile_peer(cluster, path, None, node_id="pa", region="ap", claims=False, push=taker("pa"),
                      connections=polls), \
            hostile_peer(cluster, path, None, node_id="psa", region="sa", claims=False, push=taker("psa")):
        wait_for(lambda: ("exchange" in {k for k, _ in polls}) and root.known_to(r0), 20,
                 "r0 to take the far receivers as peers")
        plan = stripe_plan("5", 0, "eu", {"eu": ["m0"], "us": ["r0"], "ap": ["pa"], "sa": ["psa"]}, 4)
        assert plan is not None and plan.n == 3 and plan.receiver["us"] == "r0", plan
        real = plan.stripe["us"]
        false = (real + 1) % 3  # another region's stripe, pushed to r0 first
        assert _push_stripe(r0, root, statement, f"{false}/3", _stripe_of(data, false, 3), root="eu") == \
            (200, {"stored": False})
        assert _push_stripe(r0, root, statement, f"{real}/3", _stripe_of(data, real, 3), root="eu") == \
            (200, {"stored": False})
        wait_for(lambda: all(f"{real}/3" in g for g in got.values()), 10, "r0 to hand on the real stripe",
                 detail=lambda: got)
        assert all(f"{false}/3" in g for g in got.values()), got  # and the other, checked, as it came


def test_a_push_refused_by_a_node_that_does_not_know_the_pusher_yet_goes_again(cluster, tmp_path):
    # A node that joined a moment ago may be pushed to by a peer it has not heard of yet: it asks the
    # tracker and answers 503 meanwhile. The push goes again a tenth of a second later (lost, a
    # stripe cost every region ``STRIPE_WAIT``). Here the only node of region us answers the first
    # two pushes so, and takes the third.
    path = tmp_path / "v1.sprw"
    _write_patch(path, 1, (256 << 10) - 4096, 256 << 10, np.random.default_rng(4))
    m = parse_patch(path.read_bytes()).manifest
    cluster.trainer(region="eu")
    publish(cluster, path)
    answered: list[int] = []

    async def push(request):
        if len(answered) < 2:
            answered.append(503)
            return web.json_response({"error": "not a member this node knows yet"}, status=503)
        body = await request.read()
        answered.append(200 if len(body) == m.chunks[0].size else 400)
        return web.json_response({"stored": True}, status=answered[-1])

    with hostile_peer(cluster, path, None, node_id="newcomer", region="us", claims=False, push=push):
        relay = cluster.rollout("r0", "eu")
        wait_for(lambda: held(cluster).get("r0") == [1], 30, "the relay to hold version 1")
        wait_for(lambda: len(answered) >= 3, 10, "the push to go a third time", detail=lambda: answered)
        assert answered[:3] == [503, 503, 200], answered
        wait_for(lambda: pushes(relay, cluster.token, "taken") == 1, 5, "the push to count as taken")
        assert pushes(relay, cluster.token, "refused") == 0
