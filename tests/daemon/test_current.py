"""Cold start through real daemons: a late box with an empty data dir gets the current policy as a
model folder (DATA/current) from the swarm, keeps it on the newest version, and `sparrowd checkout`
writes any version it can produce."""

from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest

from sparrowd import Publisher
from sparrowd.checkpoint import open_checkpoint
from sparrowd.current import read_marker
from tests.daemon.harness import node_row, wait_for
from tests.helpers import sparrowd
from tests.models import served_bits, train, trained_setup

pytestmark = pytest.mark.slow

FILES = {"config.json": '{"model_type": "tiny", "hidden_size": 64}\n',
         "tokenizer.json": json.dumps({"model": {"type": "BPE", "vocab": {f"t{i}": i for i in range(256)}}}),
         "tokenizer_config.json": '{"chat_template": "{{ messages }}"}\n', "generation_config.json": "{}\n",
         "chat_template.jinja": "{% for m in messages %}{{ m['content'] }}</s>{% endfor %}"}


def model_folder(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    for name, text in FILES.items():
        (src / name).write_text(text)
    (src / "model.safetensors").write_bytes(b"weights are not carried as files")
    return src


def current(node, token) -> dict:
    return node.node(token)["current"]


def assert_folder(folder, bits, src) -> None:
    with open_checkpoint(folder) as c:
        assert sorted(c) == sorted(bits)
        for name, t in bits.items():
            assert c[name].dtype == "BF16" and c[name].shape == t.shape
            assert np.array_equal(c[name].bits, t.bits), name
    for name in FILES:
        assert (folder / name).read_bytes() == (src / name).read_bytes(), name
    assert not (folder / "model.safetensors").read_bytes().startswith(b"weights are not")


def test_a_late_box_with_nothing_boots_the_current_policy_from_the_swarm(cluster, tmp_path):
    src = model_folder(tmp_path)
    cluster.trainer(extra=("--retain", "3"))
    early = cluster.rollout("early", "us", extra=("--retain", "3", "--current", "on"))
    wait_for(lambda: len(cluster.nodes()) == 2, 15, "two nodes")
    model, opt = trained_setup(0)
    pub = Publisher(daemon=cluster.tracker, token_file=cluster.token_file, anchor_every=3, model_files=src)
    pub.start(model, version=0)
    bits = {0: served_bits(model)}
    for v in range(1, 8):  # anchors at 0, 3 and 6
        train(model, opt)
        pub.publish(model, version=v)
        bits[v] = served_bits(model)
    wait_for(lambda: current(early, cluster.token) == {**current(early, cluster.token), "state": "ready",
                                                         "version": 7}, 30, "the early node's folder at 7")
    assert_folder(early.data_dir / "current", bits[7], src)

    late = cluster.rollout("late", "eu", extra=("--current", "on"))  # an empty data dir
    wait_for(lambda: (current(late, cluster.token) or {}).get("version") == 7, 30, "the late node's folder at 7",
             detail=lambda: current(late, cluster.token))
    c = current(late, cluster.token)
    assert c["state"] == "ready" and c["path"] == str(late.data_dir / "current")
    assert_folder(late.data_dir / "current", bits[7], src)
    assert read_marker(late.data_dir / "current")["version"] == 7
    # It started from the newest anchor (6) and the patch after it, not from the base.
    assert (late.data_dir / "anchors" / "6").is_dir() and not (late.data_dir / "anchors" / "0").exists()
    row = node_row(cluster.tracker, cluster.token, "late")
    ready = {"state": "ready", "version": 7}
    wait_for(lambda: node_row(cluster.tracker, cluster.token, "late").get("current") == ready, 10,
             "the folder in the tracker's status")
    assert row["role"] == "rollout"
    out = sparrowd("status", "--tracker", cluster.tracker, "--token-file", cluster.token_file)
    assert out.returncode == 0 and "7 ready" in out.stdout

    # A new version moves both folders in place.
    train(model, opt)
    pub.publish(model, version=8)
    bits[8] = served_bits(model)
    for node in (early, late):
        wait_for(lambda node=node: (current(node, cluster.token) or {}).get("version") == 8, 30, "version 8")
        assert_folder(node.data_dir / "current", bits[8], src)

    # checkout: any version the data dir can produce (anchor 6, patches 7 and 8), nothing else.
    out = sparrowd("checkout", "--data-dir", late.data_dir, "--version", "7", tmp_path / "v7")
    assert out.returncode == 0, out.stderr
    assert "version 7 written" in out.stdout
    assert_folder(tmp_path / "v7", bits[7], src)
    refused = sparrowd("checkout", "--data-dir", late.data_dir, "--version", "2", tmp_path / "v2")
    assert refused.returncode != 0 and not (tmp_path / "v2").exists()
    assert len(refused.stderr.strip().splitlines()) == 1
    assert "version 2 cannot be produced" in refused.stderr and "versions 6 to 8" in refused.stderr
    # The trainer keeps every anchor's chain it retains: from anchor 6 on (retain 3: patches 6..8).
    assert sparrowd("checkout", "--data-dir", tmp_path / "trainer", tmp_path / "t8").returncode == 0
    assert_folder(tmp_path / "t8", bits[8], src)

    # A stopped daemon's data dir; the newest version by default.
    late.stop()
    out = sparrowd("checkout", "--data-dir", late.data_dir, tmp_path / "latest")
    assert out.returncode == 0 and "version 8 written" in out.stdout
    assert_folder(tmp_path / "latest", bits[8], src)
    exists = sparrowd("checkout", "--data-dir", late.data_dir, tmp_path / "latest")
    assert exists.returncode != 0 and "already exists" in exists.stderr
    pub.close()


def test_a_daemon_killed_while_versions_arrive_restarts_on_a_whole_version(cluster, tmp_path):
    src = model_folder(tmp_path)
    cluster.trainer()
    node = cluster.rollout("r1", "us", extra=("--current", "on"))
    wait_for(lambda: len(cluster.nodes()) == 2, 15, "two nodes")
    model, opt = trained_setup(1)
    pub = Publisher(daemon=cluster.tracker, token_file=cluster.token_file, model_files=src)
    pub.start(model, version=0)
    bits = {0: served_bits(model)}
    rng = random.Random(3)
    v = 0
    for _ in range(4):
        for _ in range(3):
            v += 1
            train(model, opt)
            pub.publish(model, version=v)
            bits[v] = served_bits(model)
        time.sleep(rng.random() * 0.3)
        node.kill()  # SIGKILL, wherever its folder's update stands
        folder = node.data_dir / "current"
        node.start()
        wait_for(lambda: current(node, cluster.token)["state"] == "ready", 30, "the folder checked after a restart")
        at = current(node, cluster.token)["version"]
        assert_folder(folder, bits[at], src)  # whatever version it restarted on, it is that one whole
    wait_for(lambda: current(node, cluster.token)["version"] == v, 30, f"the folder at {v}")
    assert_folder(node.data_dir / "current", bits[v], src)
    pub.close()


@pytest.mark.parametrize("compare", ["auto", "torch"])
def test_an_ulp2_chain_reaches_the_folder_and_an_engine_bit_for_bit(cluster, tmp_path, compare):
    """ulp2 patches are coded against the base: the rollout node decodes them in its current folder
    (which holds that base) and hands its engine the decoded versions through the socket. Both of
    the Publisher's compares: the fused C pass, and the torch path a GPU takes (which ranks, and
    fingerprints, the host mirror in one read, and reads its history's classes from the mirror)."""
    from sparrowd.integrations.engine import EngineClient, sync
    from sparrowd.integrations.torch import PatchApplier
    from tests.models import assert_serves, bf16_model

    src = model_folder(tmp_path)
    cluster.trainer()
    node = cluster.rollout("r1", "us", extra=("--current", "on"))
    plain = cluster.rollout("r2", "us")  # no current folder: it relays ulp2, its engine cannot take it
    wait_for(lambda: len(cluster.nodes()) == 3, 15, "three nodes")
    model, opt = trained_setup(4)
    pub = Publisher(daemon=cluster.tracker, token_file=cluster.token_file, values="ulp2", model_files=src,
                    compare=compare)
    pub.start(model, version=0)
    engine = bf16_model(served_bits(model))
    client = EngineClient(node.data_dir / "engine.sock", token_file=cluster.token_file, engine="e", version=0)
    applier = PatchApplier(engine, version=0)
    for v in (1, 2, 3):
        train(model, opt)
        stats = pub.publish(model, version=v)
        assert stats.elements_changed > 0
    while applier.version < 3:
        sync(client, applier, wait=10)
    assert_serves(engine, served_bits(model))
    wait_for(lambda: (current(node, cluster.token) or {}).get("version") == 3, 30, "the folder at 3")
    assert_folder(node.data_dir / "current", served_bits(model), src)
    stored = (node.data_dir / "versions" / "3" / "statements")
    assert any(b"ulp2" in f.read_bytes() for f in stored.glob("*.sig"))
    client.close()
    # The node without a folder holds the chain (to relay it) but says why its engine cannot have it.
    wait_for(lambda: 3 in plain.node(cluster.token)["versions"], 30, "r2 to hold version 3")
    other = EngineClient(plain.data_dir / "engine.sock", token_file=cluster.token_file, engine="e2", version=0)
    with pytest.raises(Exception, match="--current on"):
        sync(other, PatchApplier(bf16_model(bits0 := served_bits(trained_setup(4)[0])), version=0), wait=5)
    other.close()
    pub.close()
    del bits0


def test_a_folder_that_lost_its_change_history_is_rebuilt_from_the_newest_anchor(cluster, tmp_path):
    """ulp2 patches after the first are coded against the change history of the ones before; a
    folder without it (an older sparrowd made it, or the file was lost) rebuilds from the anchor
    and the patches after it, which rebuild the history, and then follows the chain again."""
    src = model_folder(tmp_path)
    cluster.trainer()
    node = cluster.rollout("r1", "us", extra=("--current", "on"))
    wait_for(lambda: len(cluster.nodes()) == 2, 15, "two nodes")
    model, opt = trained_setup(5)
    pub = Publisher(daemon=cluster.tracker, token_file=cluster.token_file, values="ulp2", model_files=src)
    pub.start(model, version=0)
    train(model, opt)
    pub.publish(model, version=1)
    wait_for(lambda: (current(node, cluster.token) or {}).get("version") == 1, 30, "the folder at 1")
    folder = (node.data_dir / "current").resolve()
    (lost,) = folder.glob(".sparrowd.history.*")
    assert lost.name == ".sparrowd.history.1"
    lost.unlink()
    for v in (2, 3):
        train(model, opt)
        pub.publish(model, version=v)
    wait_for(lambda: (current(node, cluster.token) or {}).get("version") == 3, 60, "the folder at 3")
    assert_folder(node.data_dir / "current", served_bits(model), src)
    assert "rebuilding from the newest anchor" in node.log()
    pub.close()
