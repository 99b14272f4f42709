"""A real small model trained with AdamW, published every step through real daemons, rebuilt bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparrowd import Publisher
from sparrowd.codec.bits import RawTensor
from sparrowd.codec.manifest import Manifest
from sparrowd.codec.patch import apply_patch
from sparrowd.errors import InputError, SparrowError
from sparrowd.swarm.signing import MANIFEST, Signed
from tests.daemon.harness import status, wait_for

pytestmark = pytest.mark.slow


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(256, 64)
        self.block = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.norm = torch.nn.LayerNorm(64)
        self.head = torch.nn.Linear(64, 256)

    def forward(self, x):
        return self.head(self.norm(self.block(self.embed(x))))


def served_bits(model) -> dict[str, RawTensor]:
    """The bf16 bit patterns the engine would serve (floats cast, as the Publisher does)."""
    out = {}
    for k, v in model.state_dict().items():
        assert v.is_floating_point()
        a = v.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy()
        out[k] = RawTensor("BF16", tuple(v.shape), a.reshape(-1).view("<u2").copy())
    return out


def stored_patch(node, version: int) -> tuple[Manifest, list[bytes]]:
    """The patch as the rollout node holds it: its signed manifest and its verified chunks."""
    d = node.data_dir / "versions" / str(version)
    manifest = None
    for f in (d / "statements").glob("*.sig"):
        s = Signed.from_bytes(f.read_bytes())
        if s.kind == MANIFEST:
            manifest = Manifest.from_bytes(s.body)
    assert manifest is not None
    return manifest, [(d / "chunks" / f"{i}.chunk").read_bytes() for i in range(len(manifest.chunks))]


def test_each_adamw_step_reaches_a_rollout_node_bit_for_bit(cluster):
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cluster.trainer()
    node = cluster.rollout("r1", "us")
    wait_for(lambda: len(cluster.nodes()) == 2, 15, "two nodes")

    pub = Publisher(daemon=cluster.tracker, token_file=cluster.token_file)
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


def test_a_daemon_that_is_down_is_a_clear_error_and_nothing_counts_as_published(cluster, tmp_path):
    model = TinyLM()
    pub = Publisher(daemon="http://127.0.0.1:9", token_file=cluster.token_file, timeout=2)
    pub.start(model, version=0)
    with torch.no_grad():
        model.head.weight.add_(1.0)
    with pytest.raises(SparrowError, match="unreachable"):
        pub.publish(model, version=1)
    assert pub.version == 0  # the next publish still diffs against version 0
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
    cluster.trainer()
    node = cluster.rollout("r1", "eu")
    wait_for(lambda: len(cluster.nodes()) == 2, 15, "two nodes")
    common = ("--daemon", cluster.tracker, "--token-file", cluster.token_file, "--state-dir", tmp_path / "pubstate")

    r = sparrowd("publish", "--checkpoint", folders[1], "--version", "1", *common)
    assert r.returncode == 1 and "record the base first with --init" in r.stderr
    assert sparrowd("publish", "--checkpoint", folders[0], "--version", "0", "--init", *common).returncode == 0
    for v in (1, 2):
        r = sparrowd("publish", "--checkpoint", folders[v], "--version", str(v), *common)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith(f"version {v} (base {v - 1}) published from")
    r = sparrowd("publish", "--checkpoint", folders[2], "--version", "2", *common)
    assert r.returncode == 1 and "does not follow the last published version 2" in r.stderr

    wait_for(lambda: {n["node_id"]: n["versions"] for n in status(cluster.tracker, cluster.token)["nodes"]}
             .get("r1") == [1, 2], 30, "the node to hold versions 1 and 2")
    with open_checkpoint(folders[0]) as base, open_checkpoint(folders[2]) as want:
        state = {k: RawTensor(t.dtype, t.shape, np.array(t.bits)) for k, t in base.items()}
        for v in (1, 2):
            state.update(apply_patch(*stored_patch(node, v), state))
        for k, t in want.items():
            assert np.array_equal(state[k].bits, t.bits), k
