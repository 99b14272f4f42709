"""A rollout box that holds the base checkpoint itself (``sparrowd run --base``, or the folder its
engine loaded) decodes the default ``ulp2`` patches with no anchor published; a box that cannot
produce a version it holds says why at once. Real daemons, a really trained model, real files."""

from __future__ import annotations

import time

import pytest
import safetensors.torch

from sparrowd import Publisher
from tests.daemon.harness import node_row, wait_for
from tests.daemon.test_current import FILES, assert_folder, current
from tests.helpers import sparrowd
from tests.models import bf16_model, served_bits, train, trained_setup

pytestmark = pytest.mark.slow


def base_folder(path, bits):
    """A Hugging Face style model folder holding ``bits`` (what `vllm serve ./base` would load)."""
    path.mkdir()
    for name, text in FILES.items():
        (path / name).write_text(text)
    safetensors.torch.save_file(bf16_model(bits).state_dict(), str(path / "model.safetensors"))
    return path


def test_a_box_with_its_own_base_follows_an_ulp2_chain_with_no_anchor(cluster, tmp_path):
    from sparrowd.integrations.engine import EngineClient, sync
    from sparrowd.integrations.torch import PatchApplier
    from tests.models import assert_serves

    model, opt = trained_setup(7)
    base = base_folder(tmp_path / "base", served_bits(model))
    before = (base / "model.safetensors").read_bytes()
    other, _ = trained_setup(8)
    wrong = base_folder(tmp_path / "wrong", served_bits(other))
    cluster.trainer()
    node = cluster.rollout("r1", "us", extra=("--current", "on", "--base", str(base)))
    refused = cluster.rollout("r2", "us", extra=("--current", "on", "--base", str(wrong)))
    lacking = cluster.rollout("r3", "us", extra=("--current", "on"))
    wait_for(lambda: len(cluster.nodes()) == 4, 15, "four nodes")
    # `sparrowd delta diff`'s defaults: ulp2 values, and no anchor published.
    pub = Publisher(daemon=cluster.tracker, token_file=cluster.token_file, values="ulp2", model_files=base)
    pub.start(model, version=0, anchor=False)
    for v in (1, 2, 3):
        train(model, opt)
        pub.publish(model, version=v)
    wait_for(lambda: (current(node, cluster.token) or {}).get("version") == 3, 60, "r1's folder at 3",
             detail=lambda: node.log()[-1500:])
    assert_folder(node.data_dir / "current", served_bits(model), base)
    assert "base adopted" in node.log() and "version=0" in node.log()
    assert (base / "model.safetensors").read_bytes() == before  # the box's own checkpoint is never written
    # An engine on that node gets every version, bit for bit.
    engine = bf16_model(served_bits(trained_setup(7)[0]))
    client = EngineClient(node.data_dir / "engine.sock", token_file=cluster.token_file, engine="e", version=0)
    applier = PatchApplier(engine, version=0)
    assert sync(client, applier, target=3, wait=30, exact=True) == 3
    assert_serves(engine, served_bits(model))
    client.close()

    # A folder that is no base of these patches: refused, naming the first tensor that differs.
    wait_for(lambda: "base refused" in refused.log(), 30, "r2 to refuse its base")
    err = refused.node(cluster.token)["current"]["error"]
    assert "tensor '" in err and "differs from version 0's" in err, err
    assert wait_for(lambda: node_row(cluster.tracker, cluster.token, "r2").get("error"), 10, "r2's row error")

    # No base at all: it says why within a second or two of holding the version, and an engine's
    # update to it fails at once with that line.
    wait_for(lambda: 3 in lacking.node(cluster.token)["versions"], 30, "r3 to hold version 3")
    line = "v3: ulp2 needs base 0, which this node lacks: start it with --base or publish an anchor"
    assert wait_for(lambda: lacking.node(cluster.token)["error"] == line and True, 2, "r3 to say why",
                    detail=lambda: lacking.node(cluster.token))
    assert wait_for(lambda: node_row(cluster.tracker, cluster.token, "r3").get("error") == line, 5, "r3's row")
    r = sparrowd("status", "--tracker", cluster.tracker, "--token-file", cluster.token_file, timeout=30)
    assert line in r.stdout, r.stdout
    waiting = EngineClient(lacking.data_dir / "engine.sock", token_file=cluster.token_file, engine="e3", version=0)
    t0 = time.monotonic()
    with pytest.raises(Exception, match="ulp2 needs base 0"):
        sync(waiting, PatchApplier(bf16_model(served_bits(trained_setup(7)[0])), version=0), target=3, wait=60,
             exact=True)
    assert time.monotonic() - t0 < 5
    waiting.close()

    # Restarted, r1 keeps the base it adopted (the folder is checked, not adopted again).
    node.stop()
    node.start()
    wait_for(lambda: (current(node, cluster.token) or {}).get("state") == "ready", 30, "r1 back")
    assert current(node, cluster.token)["version"] == 3 and node.log().count("base adopted") == 1
    pub.close()


def test_an_engine_that_loaded_the_base_from_a_folder_is_enough(cluster, tmp_path):
    """The README's standard box: a daemon with no flag, an engine started from ./base-checkpoint.
    The engine says where it loaded from; the daemon starts its folder from there."""
    from sparrowd.integrations.engine import EngineClient, sync
    from sparrowd.integrations.torch import PatchApplier
    from tests.models import assert_serves

    model, opt = trained_setup(9)
    base = base_folder(tmp_path / "base-checkpoint", served_bits(model))
    cluster.trainer()
    node = cluster.rollout("r1", "us", extra=("--current", "on"))
    wait_for(lambda: len(cluster.nodes()) == 2, 15, "two nodes")
    pub = Publisher(daemon=cluster.tracker, token_file=cluster.token_file, values="ulp2", model_files=base)
    pub.start(model, version=0, anchor=False)
    engine = bf16_model(served_bits(model))
    client = EngineClient(node.data_dir / "engine.sock", token_file=cluster.token_file, engine="e", version=0,
                          model=base)
    applier = PatchApplier(engine, version=0)
    for v in (1, 2):
        train(model, opt)
        pub.publish(model, version=v)
    assert sync(client, applier, target=2, wait=60, exact=True) == 2
    assert_serves(engine, served_bits(model))
    assert "base offered" in node.log() and "base adopted" in node.log()
    client.close()
    pub.close()


def test_a_bad_base_is_one_line_at_start(tmp_path):
    for arg, why in ((tmp_path / "nothing", "not a model folder"), (tmp_path, "no model.safetensors")):
        r = sparrowd("run", "--role", "rollout", "--region", "us", "--tracker", "http://127.0.0.1:9",
                     "--token-file", tmp_path / "t", "--data-dir", tmp_path / "d", "--base", arg, timeout=30)
        assert r.returncode != 0 and why in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_the_trainers_own_row_shows_what_it_published_and_sent_at_once(cluster, tmp_path):
    """Leases of 30 s here: a renewal every 10 s would leave the trainer's row behind that long. It
    renews early on its events, as the other nodes do."""
    cluster.trainer(ttl=30.0)
    cluster.rollout("r1", "us", ttl=30.0)
    wait_for(lambda: len(cluster.nodes()) == 2, 15, "two nodes")
    wait_for(lambda: node_row(cluster.tracker, cluster.token, "trainer").get("peers"), 15, "the trainer's peers")
    model, opt = trained_setup(3)
    pub = Publisher(daemon=cluster.tracker, token_file=cluster.token_file)
    pub.start(model, version=0)
    train(model, opt)
    pub.publish(model, version=1)
    assert pub.wait(timeout=30)["done"]
    t0 = time.monotonic()
    row = wait_for(lambda: (r := node_row(cluster.tracker, cluster.token, "trainer")).get("bytes_up") and
                   1 in (r.get("versions") or []) and r, 3, "the trainer's row",
                   detail=lambda: node_row(cluster.tracker, cluster.token, "trainer"))
    assert time.monotonic() - t0 < 3 and row["bytes_up"] > 0 and row["peers"] >= 1
    pub.close()


def test_publishing_an_ulp2_patch_whose_base_no_anchor_carries_says_what_boxes_need(cluster, tmp_path):
    from tests.helpers import make_state, save_folder, step

    states = [make_state(0)]
    for seed in (1, 2):
        states.append(step(states[-1], seed=seed))
    folders = [save_folder(st, tmp_path / f"ckpt{i}") for i, st in enumerate(states)]
    cluster.trainer()
    for v, values, warned in ((1, "ulp2", True), (2, "ulp", False)):
        patch = tmp_path / f"v{v}.sprw"
        r = sparrowd("delta", "diff", folders[v - 1], folders[v], "-o", patch, "--values", values,
                     "--version", str(v), timeout=60)
        assert r.returncode == 0, r.stderr
        r = sparrowd("publish", patch, "--daemon", cluster.tracker, "--token-file", cluster.token_file, timeout=60)
        assert r.returncode == 0, r.stderr
        lines = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
        assert len(lines) == (1 if warned else 0), r.stderr
        if warned:
            assert "version 1 is ulp2, coded against base 0" in lines[0] and "--base" in lines[0], lines
