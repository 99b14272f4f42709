"""Ray-held rollouts: a vLLM `LLM` actor (no pause: its generate is synchronous) and an `AsyncLLM`
actor (paused with `keep`, then resumed) side by side, moved together by vLLM's
`RayVLLMWeightSyncClient` and the sparrowd trainer-side engine through real AdamW steps of a tiny
Qwen3. The engine asks each actor what it supports. Every actor's weight version is the step's, its
greedy tokens equal those of a fresh engine on that step's checkpoint, and an actor whose weights
change behind the swarm's back is named by `verify`."""

from __future__ import annotations

import json

import pytest

from tests.daemon.harness import node_row, wait_for
from tests.engine.roles import role

pytestmark = pytest.mark.slow

STEPS = 2


KINDS = ["llm", "async"]


def test_ray_actors_of_both_kinds_follow_trained_steps(cluster, tmp_path):
    cluster.trainer()
    node = cluster.rollout("r1", "us")
    wait_for(lambda: len(cluster.nodes()) == 2, 15, "two nodes")
    out = tmp_path / "run"
    out.mkdir()
    role("ray", out, cluster.tracker, cluster.token_file, STEPS, node.data_dir / "engine.sock", ",".join(KINDS),
         timeout=600)
    report = json.loads((out / "ray.json").read_text())
    seen = report["steps"]
    # send_weights(verify=True) passed at every step; the actor changed afterwards is named.
    assert report["diverged"] and "servers disagree" in report["diverged"] and "actor 0" in report["diverged"], \
        report["diverged"]
    assert [s["versions"] for s in seen] == [[str(s["step"])] * len(KINDS) for s in seen]
    # Asked what it has: the AsyncLLM actor paused with keep and resumed once a step; the LLM has no pause.
    assert seen[-1]["pauses"] == [None, ["keep", "resume"] * STEPS], seen[-1]["pauses"]
    role("reference", out, *(out / f"step{v}" for v in range(STEPS + 1)))
    for s in seen:
        want = json.loads((out / f"reference-step{s['step']}.generate.json").read_text())
        for got in s["generate"]:
            assert [g["tokens"] for g in got] == [r["tokens"] for r in want], s["step"]
    assert json.loads((out / "reference-step0.generate.json").read_text()) != want  # the steps changed outputs
    assert "engine attached" in node.log() and node.log().count("engine applied") >= len(KINDS) * STEPS
    assert node_row(cluster.tracker, cluster.token, "r1") is not None
