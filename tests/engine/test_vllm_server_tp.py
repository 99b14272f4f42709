"""The sparrowd backend and the worker extension under tensor parallelism 2: two CPU workers each.

Each worker attaches to its node's engine socket as its own rank and learns its own shard's
placement from vLLM's loaders. One swarm serves both engines in turn: vLLM's trainer-side API
moves a `vllm serve` through a real AdamW step beside node r1, then an `LLM` with the worker
extension follows the same step beside node r2, to which no engine had offered a base before.
Both engines start from the base checkpoint's folder (`sparrowd delta diff`'s defaults: ulp2, no
anchor), and the greedy tokens of each equal those of a fresh single-worker engine on each
checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparrowd.bench.vllm_server import VllmServer
from tests.daemon.harness import Daemon, free_port, make_token, node_row, status, wait_for
from tests.engine.roles import engine_python, role

pytestmark = pytest.mark.slow

STEPS = 1  # one real AdamW step through both workers (the single-worker tests run more)


def rollout(tmp_path, name: str, token_file, tracker: str) -> Daemon:
    """A rollout node that keeps its current folder and holds nothing else: its engine's workers
    tell it where they loaded the base from (SPARROWD_TEST_BASE=own)."""
    return Daemon(tmp_path, name, "rollout", "us", token_file, tracker=tracker, ttl=2,
                  extra=("--current", "on")).start()


def same_greedy_tokens(got_file: Path, want_file: Path) -> None:
    # TP=2 sums partial products in another order than TP=1: the greedy tokens are the same and
    # their logprobs agree to rounding (the runner-up of a near tie may differ).
    got, want = json.loads(got_file.read_text()), json.loads(want_file.read_text())
    assert [g["tokens"] for g in got] == [r["tokens"] for r in want], got_file.name
    for g, r in zip(got, want):
        for t, a, b in zip(g["tokens"], g["logprobs"], r["logprobs"]):
            assert abs(a[str(t)] - b[str(t)]) < 1e-2


@pytest.mark.timeout(900)  # two tensor-parallel engines start, one after the other
def test_a_tensor_parallel_server_and_a_tensor_parallel_llm_follow_trained_steps_from_their_own_base(tmp_path):
    token_file = make_token(tmp_path / "swarm.token")
    token = token_file.read_text().strip()
    port = free_port()
    tracker = f"http://127.0.0.1:{port}"
    out = tmp_path / "run"
    out.mkdir()
    daemons, server = [Daemon(tmp_path, "trainer", "trainer", "eu", token_file, port=port, ttl=2).start()], None
    try:
        r1, r2 = rollout(tmp_path, "r1", token_file, tracker), rollout(tmp_path, "r2", token_file, tracker)
        daemons += [r1, r2]
        wait_for(lambda: len(status(tracker, token)["nodes"]) == 3, 15, "three nodes")

        # `vllm serve` with the backend, moved by vLLM's trainer-side API (send_weights).
        role("base", out)
        server = VllmServer(engine_python(), out / "step0", free_port(), tensor_parallel=2,
                            log_path=tmp_path / "server.log").start()
        server.wait_ready()
        role("drive", out, tracker, token_file, STEPS, server.url, r1.data_dir / "engine.sock", timeout=600,
             env={"SPARROWD_TEST_BASE": "own"})
        assert "base adopted" in r1.log()
        seen = json.loads((out / "drive.json").read_text())
        assert [s["weight_version"] for s in seen] == [str(v) for v in range(1, STEPS + 1)]
        # Both workers attached as ranks of one engine; the node reports the version they hold.
        wait_for(lambda: node_row(tracker, token, "r1").get("engine_version") == STEPS, 30,
                 "the tracker's row on the engine's version",
                 detail=lambda: node_row(tracker, token, "r1").get("engine_version"))
        server.stop()  # its two workers leave the cores to the next engine
        server = None

        # An `LLM` with the worker extension, beside node r2, whose folder no engine has started yet:
        # the node starts it from the folder the engine loaded, and both ranks reach every step.
        wait_for(lambda: STEPS in (node_row(tracker, token, "r2").get("versions") or ()), 60,
                 "r2 to hold the steps")
        role("engine_tp", out, r2.data_dir / "engine.sock", token_file, STEPS, timeout=600,
             env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
        log = r2.log()
        assert "base adopted" in log and "base offered" in log
        assert all(f"engine applied engine=vllm-tp rank={r} object=\"version {STEPS}\"" in log for r in (0, 1)), log
    finally:
        if server is not None:
            server.stop()
        for d in daemons:
            if d.proc.poll() is None:
                d.proc.kill()
                d.proc.wait()

    role("reference", out, *(out / f"step{v}" for v in range(STEPS + 1)))
    for v in range(1, STEPS + 1):
        want = out / f"reference-step{v}.generate.json"
        same_greedy_tokens(out / f"server-step{v}.generate.json", want)
        same_greedy_tokens(out / f"engine-tp{v}.generate.json", want)
    # The steps changed what the model says, so the comparisons are not vacuous.
    assert json.loads((out / "reference-step0.generate.json").read_text()) != json.loads(want.read_text())
