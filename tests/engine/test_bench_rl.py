"""``sparrowd bench rl --quick --churn``: the RL loop across emulated regions, five ways, bit-exact.

Real `vllm serve` processes (CPU) in two regions other than the trainer's sample completions of a
tiny Qwen3; a GRPO-style update trains it; the weights reach the servers by full-checkpoint
broadcast, sparrowd from the trainer only, the sparrowd swarm, at no cost, and the swarm again
while boxes come and go (one killed, an empty one booting from the swarm and followed). Every
strategy is bit-exact, so the rewards and the servers' weights must be identical at every step:
the strongest end-to-end check the project has. The empty box is also this suite's check that a
box with nothing serves the current policy with `vllm serve DATA/current` and follow mode; what
DATA/current holds is checked file by file in tests/daemon/test_current.py. Its figures are not
judged here (they are the benchmark's, on a bigger run). The steps are paced while the empty box
boots (``--join-pace``): on two cores, steps run back to back leave its vLLM start a third of them.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.engine.roles import ONE_WORKER_IN_CORE, ROOT, engine_python

pytestmark = pytest.mark.slow


STEPS = 2
JOIN_PACE = 10.0  # s: a quick step takes 2 to 4 s on this VM


@pytest.mark.timeout(900)  # five runs and a box booting a vllm serve mid-run
def test_every_strategy_gives_identical_rewards_and_weights_while_boxes_come_and_go(tmp_path):
    out = tmp_path / "rl.json"
    r = subprocess.run([engine_python(), "-m", "sparrowd.cli.main", "bench", "rl", "--quick", "--steps", str(STEPS),
                        "--churn", "--join-pace", str(JOIN_PACE), "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ, **ONE_WORKER_IN_CORE})
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    figures = json.loads(out.read_text())
    assert figures["identical"] and figures["problems"] == []
    by = {s["name"]: s for s in figures["strategies"]}
    assert list(by) == ["full", "star", "swarm", "ideal", "churn"]
    churn = by.pop("churn")
    rewards = [s["rewards"] for s in by.values()]
    assert all(len(x) == STEPS for x in rewards) and all(x == rewards[0] for x in rewards)
    assert len(set(rewards[0])) > 1 or rewards[0][0] > 0  # the rewards are real numbers, not a constant stub
    ran = [max(0, k - 2) for k in range(1, STEPS + 1)]  # one-step off-policy: step k generates on version k-2
    for s in by.values():
        assert s["steps"] == STEPS and s["seconds_per_step"] > 0 and s["tokens_per_second"] > 0
        assert 0 <= s["rollout_idle_fraction"] < 1
        assert s["versions"] == {"s0": ran, "s1": ran}
    # What crossed the WAN: whole checkpoints for full, patches for sparrowd, nothing for ideal.
    assert by["ideal"]["wan_bytes_per_step"] == 0
    assert by["full"]["wan_bytes_per_step"] > 10 * by["swarm"]["wan_bytes_per_step"] > 0
    assert figures["speedup_vs_full"] > 0 and "gap_to_ideal" in figures
    assert "rewards and server weights identical across full, star, swarm, ideal" in r.stdout
    # Churn: the run went on until follow mode had moved the joiner while the steps ran; its first
    # steps' rewards equal the runs without churn, and the steady servers ran every step's version.
    n = churn["steps"]
    assert n > STEPS and churn["rewards"][:STEPS] == rewards[0]
    v = churn["versions"]
    assert v["s0"] == v["s1"] == [max(0, k - 2) for k in range(1, n + 1)]
    assert v["leaver"] == [0] + [None] * (n - 1)  # attached by follow mode, killed after step 1's publish
    assert v["joiner"][0] is None  # not there yet at step 1
    joined = [x for x in v["joiner"] if x is not None]
    assert len(set(joined)) >= 2 and joined == sorted(joined)  # follow mode moved it forward while steps ran
    # Only churn paces, and a paced step waits out less than the pace. (Whether any steady step was paced
    # depends on the load: on a busy machine a step can outlast the pace by itself.)
    assert all(s["split"]["paced"] == 0 for s in by.values()) and 0 <= churn["split"]["paced"] < JOIN_PACE
    a = churn["churn"]
    assert a["churn_step"] == 1 and a["joiner_folder_version"] >= 0  # booted from the swarm
    # The server started on DATA/current runs the folder's version or a later one, never an older one.
    assert joined[0] >= a["joiner_folder_version"]
    assert 0 < a["joiner_folder_seconds"] < a["joiner_serving_seconds"]
    assert a["joiner_weights_equal"] and a["joiner_caught_up_after_last_publish"] >= 0
    # On the last version the joiner's greedy tokens, logprobs and version labels equal the steady servers'.
    assert a["joiner_generates_equal"]
    assert "an empty box joined; the trainer side did nothing" in r.stdout
