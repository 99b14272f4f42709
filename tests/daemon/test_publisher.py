"""A real small model trained with AdamW, published every step through real daemons, rebuilt bit for bit."""

from __future__ import annotations

import json
import os

import msgpack
import numpy as np
import pytest
import torch

from sparrowd import Publisher
from sparrowd.codec.bits import RawTensor
from sparrowd.codec.manifest import Manifest
from sparrowd.codec.patch import LARGE_SWARM, apply_patch, auto_chunk_size
from sparrowd.errors import InputError, SparrowError
from sparrowd.swarm.signing import Signed
from tests import members
from tests.daemon.harness import get, status, wait_for
from tests.models import TinyLM, served_bits, train, trained_setup

pytestmark = pytest.mark.slow


def stored_patch(node, version: int, *, anchor: bool = False) -> tuple[Manifest, list[bytes]]:
    """The patch (or anchor) as the rollout node holds it: its signed manifest and its verified chunks."""
    d = node.data_dir / ("anchors" if anchor else "versions") / str(version)
    manifest = None
    for f in (d / "statements").glob("*.sig"):
        s = Signed.from_bytes(f.read_bytes())
        if s.is_manifest:
            assert s.anchor == anchor
            manifest = Manifest.from_bytes(s.body)
    assert manifest is not None
    return manifest, [(d / "chunks" / f"{i}.chunk").read_bytes() for i in range(len(manifest.chunks))]


@pytest.mark.parametrize("compare,threads", [("auto", None), ("torch", None), ("torch", 3)])
def test_each_adamw_step_reaches_a_rollout_node_bit_for_bit(cluster, compare, threads):
    """``auto`` compares with the fused C pass on the CPU; ``torch`` is the path GPU tensors take
    (torch compare, O(changed) to the host, fingerprints from the host mirror); ``threads``: the
    compare and segment threads (by default the CPU count, at most 8)."""
    model, opt = trained_setup(0)
    _, node = cluster.pair()

    with pytest.raises(InputError, match="threads must be at least 1"):
        Publisher(daemon=cluster.tracker, token_file=cluster.token_file, threads=0)
    pub = Publisher(daemon=cluster.tracker, token_file=cluster.token_file, compare=compare, threads=threads)
    assert pub.threads == (threads or max(2, min(8, os.cpu_count())))
    with pytest.raises(InputError, match="start"):
        pub.publish(model, version=1)
    base = served_bits(model)
    pub.start(model, version=0)
    expected = {}
    for step in range(1, 4):
        x = torch.randint(0, 256, (8, 16))
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), torch.roll(x, -1, 1).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        stats = pub.publish(model, version=step)
        expected[step] = served_bits(model)
        assert stats.version == step and stats.base_version == step - 1
        assert 0 < stats.elements_changed < stats.elements and stats.chunks >= 1
        assert stats.first_chunk_seconds is not None and stats.patch_bytes > 0
        # The next patch is cut for the size of this one, and for a swarm of one rollout.
        assert pub._patch_chunk_size() == auto_chunk_size(stats.patch_bytes, 1) == auto_chunk_size(stats.patch_bytes)
    with pytest.raises(InputError, match="does not follow"):
        pub.publish(model, version=3)

    wait_for(lambda: {n["node_id"]: n["versions"] for n in status(cluster.tracker, cluster.token)["nodes"]}
             .get("r1") == [1, 2, 3], 30, "the node to hold versions 1-3")
    # Apply what the node received, in order, to the base: every step's weights, bit for bit.
    state = dict(base)
    for step in range(1, 4):
        manifest, chunks = stored_patch(node, step)
        assert manifest.base_version == step - 1
        state.update(apply_patch(manifest, chunks, state))
        for k, t in expected[step].items():
            assert np.array_equal(state[k].bits, t.bits), (step, k)
    pub.close()


def held_by(cluster) -> dict[str, list[int]]:
    return {n["node_id"]: n["versions"] for n in status(cluster.tracker, cluster.token)["nodes"]}


def rebuild(node, start: dict[str, RawTensor], versions) -> dict[str, RawTensor]:
    state = dict(start)
    for v in versions:
        manifest, chunks = stored_patch(node, v)
        state.update(apply_patch(manifest, chunks, state))
    return state


def test_a_restarted_trainer_daemon_continues_the_chain(cluster):
    """The daemon going down is a clear error and publishes nothing; restarted, it reloads the
    chain from disk and the Publisher carries on at the next version, on the right base."""
    model, opt = trained_setup(1)
    trainer, node = cluster.pair()
    base = served_bits(model)
    pub = Publisher(daemon=cluster.tracker, token_file=cluster.token_file, timeout=5)
    pub.start(model, version=0)
    train(model, opt)
    pub.publish(model, version=1)
    trainer.stop()
    train(model, opt)
    with pytest.raises(SparrowError, match="unreachable"):
        pub.publish(model, version=2)
    assert pub.version == 1  # the next publish still diffs against version 1
    trainer.start()
    train(model, opt)
    stats = pub.publish(model, version=3)
    assert (stats.version, stats.base_version) == (3, 1)
    with pytest.raises(InputError, match="does not follow the last published version 3"):
        pub.publish(model, version=3)
    # A second trainer process starting at the wrong version is refused; at the right one it goes on.
    other = Publisher(daemon=cluster.tracker, token_file=cluster.token_file)
    with pytest.raises(SparrowError, match="published up to version 3"):
        other.start(model, version=0)
    other.close()
    wait_for(lambda: held_by(cluster).get("r1") == [1, 3], 30, "the node to hold versions 1 and 3")
    state = rebuild(node, base, [1, 3])
    for k, t in served_bits(model).items():
        assert np.array_equal(state[k].bits, t.bits), k
    pub.close()


class DropManifestReply:
    """A proxy to the daemon that forwards everything, but hangs up instead of returning the
    daemon's reply to the first manifest: the version is taken and the Publisher does not know."""

    def __init__(self, upstream: str):
        import http.server
        import threading
        import urllib.request

        outer = self
        self.dropped = 0
        self.armed = False  # set: the next manifest's reply is dropped
        self.fail_chunk = False  # set: the next chunk is refused (the daemon never sees it)

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if self.command == "POST" else None
                if outer.fail_chunk and "/chunk/" in self.path:
                    outer.fail_chunk = False
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                req = urllib.request.Request(upstream + self.path, data=body, method=self.command,
                                             headers={"Authorization": self.headers["Authorization"]})
                try:
                    with urllib.request.urlopen(req, timeout=10) as r:
                        code, data = r.status, r.read()
                except urllib.error.HTTPError as e:
                    code, data = e.code, e.read()
                if self.path == "/v1/publish/manifest" and outer.armed:
                    outer.armed = False
                    outer.dropped += 1
                    self.close_connection = True
                    return  # hang up: no reply
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def test_a_version_taken_whose_reply_was_lost_is_adopted_not_rebased(cluster):
    model, opt = trained_setup(2)
    _, node = cluster.pair()
    base = served_bits(model)
    proxy = DropManifestReply(cluster.tracker)
    pub = Publisher(daemon=proxy.url, token_file=cluster.token_file, timeout=5)
    pub.start(model, version=0)
    train(model, opt)
    proxy.armed = True
    with pytest.raises(SparrowError, match="without response"):
        pub.publish(model, version=1)
    assert proxy.dropped == 1 and pub.version == 0
    train(model, opt)
    stats = pub.publish(model, version=2)  # the daemon had taken 1: version 2 builds on it
    assert (stats.version, stats.base_version) == (2, 1) and pub.version == 2
    wait_for(lambda: held_by(cluster).get("r1") == [1, 2], 30, "the node to hold versions 1 and 2")
    state = rebuild(node, base, [1, 2])
    for k, t in served_bits(model).items():
        assert np.array_equal(state[k].bits, t.bits), k
    pub.close()
    proxy.close()


@pytest.mark.parametrize("background", [True, False], ids=["background-anchors", "anchors-in-line"])
def test_a_late_node_catches_up_from_the_newest_anchor(cluster, background):
    """Anchors every 3 versions, 2 patches retained: a node that joins after version 7 cannot
    chain from the base (patch 1 is long gone), so it takes anchor 6 and patch 7, and nothing
    else; a node that was there all along never fetches an anchor. Anchors go out in the
    background (the next publish waits for them) or within publish."""
    model, opt = trained_setup(3)
    trainer = cluster.trainer(extra=("--retain", "2"))
    early = cluster.rollout("early", "eu", extra=("--retain", "2"))
    wait_for(lambda: len(cluster.nodes()) == 2, 15, "two nodes")
    pub = Publisher(daemon=cluster.tracker, token_file=cluster.token_file, anchor_every=3,
                    background_anchors=background)
    assert pub.start(model, version=0).version == 0  # the base, as anchor 0
    for v in range(1, 8):
        train(model, opt)
        stats = pub.publish(model, version=v)
        assert stats.anchor_started == (v % 3 == 0), (v, stats)
        if background:
            assert stats.anchor_bytes == 0
            a = pub.wait_anchor()
            assert (a is not None) == (v % 3 == 0) and pub.wait_anchor() is None
            if a is not None:
                assert a.version == v and a.base_version is None and a.patch_bytes > 0 and pub.last_anchor is a
        else:
            assert (stats.anchor_bytes > 0) == (v % 3 == 0), (v, stats)
        wait_for(lambda: v in held_by(cluster).get("early", []), 30, f"the early node to hold {v}")
    assert sorted(p.name for p in (trainer.data_dir / "anchors").iterdir()) == ["6"]
    assert sorted(p.name for p in (trainer.data_dir / "versions").iterdir()) == ["6", "7"]
    assert list((early.data_dir / "anchors").iterdir()) == []

    late = cluster.rollout("late", "us", extra=("--retain", "2"))
    wait_for(lambda: held_by(cluster).get("late") == [6, 7], 60, "the late node to hold anchor 6 and patch 7")
    assert not (late.data_dir / "versions" / "6").exists()
    manifest, chunks = stored_patch(late, 6, anchor=True)
    assert manifest.base_version is None
    state = apply_patch(manifest, chunks, {})
    state.update(rebuild(late, state, [7]))
    want = served_bits(model)
    assert set(state) == set(want)
    for k, t in want.items():
        assert np.array_equal(state[k].bits, t.bits), k
    pub.close()


def _random_publisher(cluster, n: int, seed: int):
    """A Publisher started on ``n`` zero bf16 elements, and a step that publishes them all redrawn."""
    gen = torch.Generator().manual_seed(seed)
    sd = {"w": torch.zeros(n, dtype=torch.bfloat16)}
    pub = Publisher(daemon=cluster.tracker, token_file=cluster.token_file, anchor_every=0)
    pub.start(sd, version=0)

    def step(version: int):
        sd["w"] = torch.randn(n, generator=gen).to(torch.bfloat16)
        return pub.publish(sd, version=version)

    return pub, step


def test_a_swarm_of_more_than_16_rollouts_gets_its_patches_in_finer_chunks(cluster):
    """The Publisher asks the daemon where the chain ends before every version; the reply also says
    how many rollouts hold leases, and the patch is cut for a swarm of that size (``auto_chunk_size``)."""
    trainer = cluster.trainer(ttl=60)
    pub, step = _random_publisher(cluster, 1_000_000, 0)
    first = step(1)
    assert stored_patch(trainer, 1)[0].chunk_size == 1 << 20  # a small patch expected: one chunk
    assert first.patch_bytes > 1 << 20  # the next patch, expected as large, takes more than a chunk
    mp = {"Content-Type": "application/msgpack"}
    for i in range(LARGE_SWARM + 1):
        code, _ = get(f"{cluster.tracker}/v1/tracker/join", cluster.token, method="POST", headers=mp,
                      data=msgpack.packb(members.join(members.new_key(), f"r{i}", region=f"r{i % 8}")))
        assert code == 200
    code, body = get(f"{cluster.tracker}/v1/publish/state", cluster.token)
    assert code == 200 and json.loads(body)["rollouts"] == LARGE_SWARM + 1
    step(2)
    manifest, chunks = stored_patch(trainer, 2)
    assert manifest.chunk_size == auto_chunk_size(first.patch_bytes, LARGE_SWARM + 1) == 128 << 10
    assert len(chunks) > 8
    pub.close()


def test_a_patch_the_trainers_uplink_sends_in_four_round_trips_goes_as_one_chunk(cluster):
    """The daemon's reply also gives its upload limit and the round trip its rollouts measured: a
    patch the uplink sends in 4 round trips goes whole; on loopback a round trip is well under a
    millisecond, so the same patch that went whole before any rollout measured one is cut."""
    trainer = cluster.trainer(extra=("--upload-rate", "4M"))
    code, body = get(f"{cluster.tracker}/v1/publish/state", cluster.token)
    state = json.loads(body)
    assert code == 200 and state["uplink"] == 4 << 20 and state["round_trip"] is None  # no rollout yet
    pub, step = _random_publisher(cluster, 300_000, 1)
    first = step(1)
    assert 256 << 10 < first.patch_bytes < 1 << 20
    assert stored_patch(trainer, 1)[0].chunk_size == 1 << 20 and first.chunks == 1  # the round trip unknown
    for name, region in (("r1", "us"), ("r2", "ap")):
        cluster.rollout(name, region)
    wait_for(lambda: json.loads(get(f"{cluster.tracker}/v1/publish/state", cluster.token)[1])["round_trip"],
             20, "the rollouts to measure a round trip")
    rtt = json.loads(get(f"{cluster.tracker}/v1/publish/state", cluster.token)[1])["round_trip"]
    assert 0 < rtt < 0.016  # loopback: 4 round trips at 4 MiB/s are less than a 256 KiB chunk
    second = step(2)
    manifest, chunks = stored_patch(trainer, 2)
    assert manifest.chunk_size == 256 << 10 and second.chunks == len(chunks) >= 2
    pub.close()


def test_an_anchor_can_change_the_tensors_and_later_patches_build_on_it(cluster):
    cluster.trainer()
    model = TinyLM()
    pub = Publisher(daemon=cluster.tracker, token_file=cluster.token_file, anchor_every=0)
    pub.start(model, version=0, anchor=False)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["extra.weight"] = torch.ones(4, 4)
    with pytest.raises(InputError, match="need an anchor: publish_anchor"):
        pub.publish(sd, version=1)
    with pytest.raises(InputError, match="not what version 0 published"):
        pub.publish_anchor({**sd, "head.bias": sd["head.bias"] + 1}, version=0)
    stats = pub.publish_anchor(sd, version=1)
    assert stats.base_version is None and stats.tensors == len(sd)
    sd["extra.weight"][0, 0] = 2.0
    stats = pub.publish(sd, version=2)
    assert (stats.base_version, stats.tensors_changed, stats.elements_changed) == (1, 1, 1)
    code, body = get(f"{cluster.tracker}/v1/publish/state", cluster.token)
    assert code == 200 and (json.loads(body)["latest"], json.loads(body)["anchor"]) == (2, 1)
    pub.close()


def test_bf16_weights_updated_in_place_are_still_diffed_against_the_published_copy(cluster):
    """When the model already holds bf16, the Publisher must keep a copy, not a view the optimizer
    then overwrites (every later diff would come out empty)."""
    cluster.trainer()
    model = TinyLM().to(torch.bfloat16)
    pub = Publisher(daemon=cluster.tracker, token_file=cluster.token_file)
    pub.start(model, version=0)
    for step in (1, 2):
        with torch.no_grad():
            model.head.weight[step, :8] += 1.0
        stats = pub.publish(model, version=step)
        assert stats.tensors_changed == 1 and stats.elements_changed == 8, stats
    pub.close()


def test_publish_checkpoint_folders_as_a_chain(cluster, tmp_path):
    from sparrowd.checkpoint import open_checkpoint
    from tests.helpers import make_state, save_folder, sparrowd, step

    states = [make_state(0)]
    for s in (1, 2):
        states.append(step(states[-1], seed=s))
    folders = [save_folder(st, tmp_path / f"ckpt{i}") for i, st in enumerate(states)]
    trainer = cluster.trainer()
    node = cluster.rollout("r1", "eu")
    wait_for(lambda: len(cluster.nodes()) == 2, 15, "two nodes")
    common = ("--daemon", cluster.tracker, "--token-file", cluster.token_file, "--state-dir", tmp_path / "pubstate",
              "--anchor-every", "2")

    r = sparrowd("publish", "--checkpoint", folders[1], "--version", "1", *common)
    assert r.returncode == 1 and "record the base first with --init" in r.stderr
    r = sparrowd("publish", "--checkpoint", folders[0], "--version", "0", "--init", *common)
    assert r.returncode == 0 and r.stdout.startswith("anchor 0 published from"), r.stderr
    assert sorted(p.name for p in (trainer.data_dir / "anchors").iterdir()) == ["0"]
    for v in (1, 2):
        r = sparrowd("publish", "--checkpoint", folders[v], "--version", str(v), *common)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith(f"version {v} (base {v - 1}) published from")
    r = sparrowd("publish", "--checkpoint", folders[2], "--version", "2", *common)
    assert r.returncode == 1 and "does not follow the last published version 2" in r.stderr
    # Anchor 2 followed version 2 (every 2 versions); anchor 0 went with retention.
    assert sorted(p.name for p in (trainer.data_dir / "anchors").iterdir()) == ["2"]
    r = sparrowd("publish", "--checkpoint", folders[0], "--version", "0", "--init", *common)
    assert r.returncode == 1 and "published up to version 2" in r.stderr

    wait_for(lambda: {n["node_id"]: n["versions"] for n in status(cluster.tracker, cluster.token)["nodes"]}
             .get("r1") == [1, 2], 30, "the node to hold versions 1 and 2")
    with open_checkpoint(folders[0]) as base, open_checkpoint(folders[2]) as want:
        state = {k: RawTensor(t.dtype, t.shape, np.array(t.bits)) for k, t in base.items()}
        for v in (1, 2):
            state.update(apply_patch(*stored_patch(node, v), state))
        for k, t in want.items():
            assert np.array_equal(state[k].bits, t.bits), k


def test_fsdp2_ranks_publish_gathered_tensors(cluster, tmp_path):
    """Two FSDP2 ranks (gloo on the CPU) call publish each step; rank 0's daemon ends up with
    anchor 0 and patches 1 and 2 that rebuild every step's full weights, bit for bit."""
    import os
    import subprocess
    import sys

    from tests.daemon.harness import free_port

    trainer = cluster.trainer()
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = [subprocess.Popen([sys.executable, "-m", "tests.daemon.fsdp_rank", cluster.tracker,
                               str(cluster.token_file), str(tmp_path)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    for p in ranks:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
    manifest, chunks = stored_patch(trainer, 0, anchor=True)
    state = apply_patch(manifest, chunks, {})
    for v in (0, 1, 2):
        if v:
            state.update(rebuild(trainer, state, [v]))
        want = np.load(tmp_path / f"v{v}.npz")
        assert sorted(state) == sorted(want.files)
        for k in want.files:
            assert np.array_equal(state[k].bits, want[k].reshape(-1).view("<u2")), (v, k)


@pytest.mark.parametrize("compare", ["auto", "torch"])
def test_a_version_that_fails_half_way_leaves_no_trace_in_the_kept_copies(cluster, compare):
    """Both paths move kept state ahead while the version is built: the CPU compare updates the
    kept copies in its pass, the torch path moves each host mirror as it encodes. A chunk refused
    half way must put all of it back, or the next version would be diffed against weights that
    were never published (the node's rebuild below would fail its base or result check)."""
    model, opt = trained_setup(4)
    _, node = cluster.pair()
    base = served_bits(model)
    proxy = DropManifestReply(cluster.tracker)
    pub = Publisher(daemon=proxy.url, token_file=cluster.token_file, compare=compare, timeout=5)
    pub.start(model, version=0)
    train(model, opt)
    pub.publish(model, version=1)
    train(model, opt, steps=2)
    proxy.fail_chunk = True
    with pytest.raises(SparrowError, match="HTTP 503"):
        pub.publish(model, version=2)
    assert pub.version == 1
    train(model, opt)
    stats = pub.publish(model, version=3)
    assert (stats.version, stats.base_version) == (3, 1)
    wait_for(lambda: held_by(cluster).get("r1") == [1, 3], 30, "the node to hold versions 1 and 3")
    state = rebuild(node, base, [1, 3])  # apply_patch checks every result fingerprint
    for k, t in served_bits(model).items():
        assert np.array_equal(state[k].bits, t.bits), k
    pub.close()
    proxy.close()


@pytest.mark.parametrize("compare", ["auto", "torch"])
def test_an_interrupt_while_the_manifest_is_sent_leaves_the_chain_consistent(cluster, monkeypatch, compare):
    """Ctrl-C during the manifest's request: the daemon may or may not have it, and the kept state
    was moved ahead while the version was built. The next call finds out (here: not taken), puts
    the kept state back and diffs against the last version really published."""
    model, opt = trained_setup(5)
    _, node = cluster.pair()
    base = served_bits(model)
    pub = Publisher(daemon=cluster.tracker, token_file=cluster.token_file, compare=compare)
    pub.start(model, version=0)
    train(model, opt)
    post = Publisher._post

    def interrupted(self, path, data):
        if path == "/v1/publish/manifest":
            raise KeyboardInterrupt
        return post(self, path, data)

    monkeypatch.setattr(Publisher, "_post", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pub.publish(model, version=1)
    monkeypatch.setattr(Publisher, "_post", post)
    assert pub.version == 0
    train(model, opt)
    stats = pub.publish(model, version=2)
    assert (stats.version, stats.base_version) == (2, 0)
    wait_for(lambda: held_by(cluster).get("r1") == [2], 30, "the node to hold version 2")
    state = rebuild(node, base, [2])  # apply_patch checks the base and result fingerprints
    for k, t in served_bits(model).items():
        assert np.array_equal(state[k].bits, t.bits), k
    pub.close()



def test_a_background_anchor_that_fails_is_raised_once_and_tried_again(cluster, monkeypatch):
    """The next publish waits for the anchor and raises its failure, before touching anything;
    the one after goes on from the same version and starts the anchor again, which then lands."""
    model, opt = trained_setup(4)
    cluster.pair()
    pub = Publisher(daemon=cluster.tracker, token_file=cluster.token_file, anchor_every=2)
    pub.start(model, version=0)
    real = pub._publish_anchor
    monkeypatch.setattr(pub, "_publish_anchor", lambda version, tensors=None: (_ for _ in ()).throw(
        SparrowError("the daemon refused it")))
    train(model, opt)
    assert not pub.publish(model, version=1).anchor_started
    train(model, opt)
    assert pub.publish(model, version=2).anchor_started
    train(model, opt)
    with pytest.raises(SparrowError, match="the anchor published in the background failed: the daemon refused it"):
        pub.publish(model, version=3)
    assert pub.version == 2 and pub.anchor_version == 0
    monkeypatch.setattr(pub, "_publish_anchor", real)
    stats = pub.publish(model, version=3)  # the same step, again: no anchor recorded, so one follows
    assert stats.version == 3 and stats.anchor_started
    a = pub.wait_anchor()
    assert a.version == 3 and pub.anchor_version == 3
    pub.close()


def test_the_torch_extract_brings_a_tensors_changes_to_the_host():
    """The torch path's extract (positions and both sides' values, copied to the host without
    waiting): for tensors of four widths, what numpy finds; None for an unchanged tensor."""
    from sparrowd.snapshot import extract

    rng = np.random.default_rng(0)
    for dtype, n, k in [(np.int16, 5000, 37), (np.int32, 333, 1), (np.uint8, 77, 0), (np.int16, 4096, 4096),
                        (np.int64, 9, 3), (np.uint8, 1001, 13)]:
        old = rng.integers(0, 100, n).astype(dtype)
        new = old.copy()
        pos = np.sort(rng.choice(n, k, replace=False))
        new[pos] += 1
        found = extract(torch, torch.from_numpy(old), torch.from_numpy(new))
        if k == 0:
            assert found is None
            continue
        idx, new_vals, idx_h, ov_h, nv_h, arrived = found
        arrived()
        assert idx_h.dtype == np.int64 and np.array_equal(idx_h, pos) and np.array_equal(idx.numpy(), pos)
        assert ov_h.dtype.kind == "u" and ov_h.dtype.itemsize == old.itemsize
        assert np.array_equal(ov_h, old[pos].view(ov_h.dtype)) and np.array_equal(nv_h, new[pos].view(nv_h.dtype))
        assert np.array_equal(new_vals.numpy(), new[pos])


@pytest.mark.parametrize("values", ["ulp", "ulp2"])
def test_a_publish_lets_go_of_its_host_buffers_before_the_next_needs_its_own(cluster, monkeypatch, values):
    """The torch path's page-locked buffer is reused by the allocator only once it is free: nothing
    may keep one publish's buffers alive when the next publish allocates its own, or every step
    pays for a fresh one. Not a reference cycle through the encoder's futures (collection is off
    here), nor, for ulp2, the change-history merge that goes on after ``publish`` returns (the
    positions it merges are views of the buffer: the encoder lets go of them once merged)."""
    import gc
    import weakref

    import sparrowd.snapshot as snapshot

    cluster.trainer()
    steps: list[list] = []  # per publish, weak references to the host arrays its extracts returned
    alive_at_next: list[int] = []  # per publish after the first: the last one's arrays still alive then
    extract = snapshot.extract

    def spy(torch_, old, new):
        if not steps[-1] and len(steps) > 1:  # this publish's first allocation
            alive_at_next.append(sum(r() is not None for r in steps[-2]))
        found = extract(torch_, old, new)
        steps[-1].extend(weakref.ref(a) for a in (found or ())[2:5])
        return found

    monkeypatch.setattr(snapshot, "extract", spy)
    model = {f"t{i}": torch.randn(50_000).to(torch.bfloat16) for i in range(4)}
    pub = Publisher(daemon=cluster.tracker, token_file=cluster.token_file, compare="torch", values=values)
    pub.start(model, 0)
    gc.disable()
    try:
        for step in range(1, 5):
            for t in model.values():
                t.view(torch.int16)[step::97] += 1
            steps.append([])
            pub.publish(model, step)
            assert len(steps[-1]) == 12  # 4 tensors changed, 3 host arrays each
        assert alive_at_next == [0, 0, 0]
    finally:
        gc.enable()
        pub.close()
