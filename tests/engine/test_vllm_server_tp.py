"""The sparrowd backend under tensor parallelism 2: a `vllm serve` with two CPU workers.

Each worker attaches to the node's engine socket as its own rank and learns its own shard's
placement from vLLM's loaders; vLLM's trainer-side API then moves the server through real AdamW
steps, and its greedy tokens equal those of a fresh single-worker engine on each checkpoint.
"""

from __future__ import annotations

import json

import pytest

from sparrowd.bench.vllm_server import VllmServer
from tests.daemon.harness import Daemon, free_port, make_token, node_row, status, wait_for
from tests.engine.roles import engine_python, role

pytestmark = pytest.mark.slow

STEPS = 1  # one real AdamW step through both workers (the single-worker tests run more)


def swarm(tmp_path) -> tuple:
    """A trainer and a rollout node r1 that keeps its current folder and holds nothing else: with
    `sparrowd delta diff`'s defaults (ulp2, no anchor; SPARROWD_TEST_BASE=own) its engine's workers
    tell the daemon where they loaded the base from. (token file, token, tracker URL, daemons)"""
    token_file = make_token(tmp_path / "swarm.token")
    port = free_port()
    tracker = f"http://127.0.0.1:{port}"
    daemons = [Daemon(tmp_path, "trainer", "trainer", "eu", token_file, port=port, ttl=2).start()]
    daemons.append(Daemon(tmp_path, "r1", "rollout", "us", token_file, tracker=tracker, ttl=2,
                          extra=("--current", "on")).start())
    return token_file, token_file.read_text().strip(), tracker, daemons


def test_tensor_parallel_server_follows_trained_steps(tmp_path):
    token_file, token, tracker, daemons = swarm(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    server = None
    try:
        wait_for(lambda: len(status(tracker, token)["nodes"]) == 2, 15, "two nodes")
        role("base", out)
        server = VllmServer(engine_python(), out / "step0", free_port(), tensor_parallel=2,
                            log_path=tmp_path / "server.log").start()
        server.wait_ready()
        role("drive", out, tracker, token_file, STEPS, server.url, daemons[1].data_dir / "engine.sock", timeout=600,
             env={"SPARROWD_TEST_BASE": "own"})
        assert "base adopted" in daemons[1].log()
        seen = json.loads((out / "drive.json").read_text())
        assert [s["weight_version"] for s in seen] == [str(v) for v in range(1, STEPS + 1)]
        # Both workers attached as ranks of one engine; the node reports the version they hold.
        wait_for(lambda: node_row(tracker, token, "r1").get("engine_version") == STEPS, 30,
                 "the tracker's row on the engine's version",
                 detail=lambda: node_row(tracker, token, "r1").get("engine_version"))
        role("reference", out, *(out / f"step{v}" for v in range(STEPS + 1)))
        for v in range(1, STEPS + 1):
            got = json.loads((out / f"server-step{v}.generate.json").read_text())
            want = json.loads((out / f"reference-step{v}.generate.json").read_text())
            # TP=2 sums partial products in another order than TP=1: the greedy tokens are the same
            # and their logprobs agree to rounding (the runner-up of a near tie may differ).
            assert [g["tokens"] for g in got] == [r["tokens"] for r in want], v
            for g, r in zip(got, want):
                for t, a, b in zip(g["tokens"], g["logprobs"], r["logprobs"]):
                    assert abs(a[str(t)] - b[str(t)]) < 1e-2
        assert json.loads((out / "reference-step0.generate.json").read_text()) != want
    finally:
        if server is not None:
            server.stop()
        for d in daemons:
            if d.proc.poll() is None:
                d.proc.kill()
                d.proc.wait()


def test_the_worker_extension_under_tensor_parallelism_starts_from_its_own_base(tmp_path):
    """`sparrowd delta diff`'s defaults (ulp2, no anchor) and an `LLM` with two CPU workers started
    from the base checkpoint's folder: the node starts its current folder from there, both ranks
    reach every step, and the greedy tokens equal a fresh single-worker engine's on each checkpoint."""
    token_file, token, tracker, daemons = swarm(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    try:
        wait_for(lambda: len(status(tracker, token)["nodes"]) == 2, 15, "two nodes")
        role("train", out, tracker, token_file, STEPS, env={"SPARROWD_TEST_BASE": "own"})
        role("engine_tp", out, daemons[1].data_dir / "engine.sock", token_file, STEPS, timeout=600,
             env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
        log = daemons[1].log()
        assert "base adopted" in log and "base offered" in log
        assert all(f"engine applied engine=vllm-tp rank={r} object=\"version {STEPS}\"" in log for r in (0, 1)), log
        role("reference", out, *(out / f"step{v}" for v in range(STEPS + 1)))
        for v in range(1, STEPS + 1):
            got = json.loads((out / f"engine-tp{v}.generate.json").read_text())
            want = json.loads((out / f"reference-step{v}.generate.json").read_text())
            assert [g["tokens"] for g in got] == [r["tokens"] for r in want], v
            for g, r in zip(got, want):
                for t, a, b in zip(g["tokens"], g["logprobs"], r["logprobs"]):
                    assert abs(a[str(t)] - b[str(t)]) < 1e-2
    finally:
        for d in daemons:
            if d.proc.poll() is None:
                d.proc.kill()
                d.proc.wait()
