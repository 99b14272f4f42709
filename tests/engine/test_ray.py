"""Ray-held rollouts: two vLLM `LLM` actors (no pause: their generate is synchronous), and one
`AsyncLLM` actor (paused with `keep`, then resumed), moved by vLLM's `RayVLLMWeightSyncClient` and
the sparrowd trainer-side engine through real AdamW steps of a tiny Qwen3. Every actor's weight
version is the step's, and its greedy tokens equal those of a fresh engine on that step's checkpoint."""

from __future__ import annotations

import json

import pytest

from tests.daemon.harness import node_row, wait_for
from tests.engine.roles import role

pytestmark = pytest.mark.slow

STEPS = 2


@pytest.mark.parametrize("kind,actors", [("llm", 2), ("async", 1)])
def test_ray_actors_follow_trained_steps(cluster, tmp_path, kind, actors):
    cluster.trainer()
    node = cluster.rollout("r1", "us")
    wait_for(lambda: len(cluster.nodes()) == 2, 15, "two nodes")
    out = tmp_path / "run"
    out.mkdir()
    role("ray", out, cluster.tracker, cluster.token_file, STEPS, node.data_dir / "engine.sock", actors, kind,
         timeout=600)
    report = json.loads((out / "ray.json").read_text())
    seen = report["steps"]
    if actors > 1:  # send_weights(verify=True) passed at every step; a diverged actor is named
        assert report["diverged"] and "servers disagree" in report["diverged"] and "actor 1" in report["diverged"], \
            report["diverged"]
    assert [s["versions"] for s in seen] == [[str(s["step"])] * actors for s in seen]
    if kind == "async":  # asked what it has: paused with keep and resumed, once a step
        assert seen[-1]["pauses"] == [["keep", "resume"] * STEPS] * actors, seen[-1]["pauses"]
    role("reference", out, *(out / f"step{v}" for v in range(STEPS + 1)))
    for s in seen:
        want = json.loads((out / f"reference-step{s['step']}.generate.json").read_text())
        for got in s["generate"]:
            assert [g["tokens"] for g in got] == [r["tokens"] for r in want], s["step"]
    assert json.loads((out / "reference-step0.generate.json").read_text()) != want  # the steps changed outputs
    assert "engine attached" in node.log() and node.log().count("engine applied") >= actors * STEPS
    assert node_row(cluster.tracker, cluster.token, "r1") is not None
