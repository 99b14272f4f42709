"""``sparrowd bench rl --quick``: the RL loop across emulated regions, four ways, bit-exact.

Real `vllm serve` processes (CPU) in two regions other than the trainer's sample completions of a
tiny Qwen3; a GRPO-style update trains it; the weights reach the servers by full-checkpoint
broadcast, sparrowd from the trainer only, the sparrowd swarm, and at no cost. Every strategy is
bit-exact, so the rewards and the servers' weights must be identical at every step: the
strongest end-to-end check the project has. Its figures are not judged here (they are the
benchmark's, on a bigger run).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.engine.roles import ROOT, engine_python

pytestmark = pytest.mark.slow


def test_every_strategy_gives_identical_rewards_and_weights(tmp_path):
    out = tmp_path / "rl.json"
    r = subprocess.run([engine_python(), "-m", "sparrowd_cli.main", "bench", "rl", "--quick", "--steps", "2",
                        "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    figures = json.loads(out.read_text())
    assert figures["identical"] and figures["problems"] == []
    by = {s["name"]: s for s in figures["strategies"]}
    assert list(by) == ["full", "star", "swarm", "ideal"]
    rewards = [s["rewards"] for s in by.values()]
    assert all(len(x) == 2 for x in rewards) and all(x == rewards[0] for x in rewards)
    assert len(set(rewards[0])) > 1 or rewards[0][0] > 0  # the rewards are real numbers, not a constant stub
    for s in by.values():
        assert s["steps"] == 2 and s["seconds_per_step"] > 0 and s["tokens_per_second"] > 0
        assert 0 <= s["rollout_idle_fraction"] < 1
    # What crossed the WAN: whole checkpoints for full, patches for sparrowd, nothing for ideal.
    assert by["ideal"]["wan_bytes_per_step"] == 0
    assert by["full"]["wan_bytes_per_step"] > 10 * by["swarm"]["wan_bytes_per_step"] > 0
    assert figures["speedup_vs_full"] > 0 and "gap_to_ideal" in figures
    assert "rewards and server weights identical across full, star, swarm, ideal" in r.stdout
