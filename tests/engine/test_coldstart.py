"""A box with nothing boots the current policy from the swarm and serves it with a real `vllm serve`.

A trainer publishes a tiny Qwen3's AdamW steps with its tokenizer and config riding on the anchors.
A rollout daemon joins late with an empty data dir and follow mode on: it materializes DATA/current
from the newest anchor and the patches after it. `vllm serve DATA/current` (CPU build, sparrowd
backend) then reports that version as its weight_version and gives the same greedy tokens and
logprobs as a fresh engine on the trainer's checkpoint; one more step moves the folder in place and
the server with it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from sparrowd.bench.vllm_server import VllmServer
from sparrowd.checkpoint import open_checkpoint
from tests.daemon.harness import Daemon, free_port, make_token, node_row, wait_for
from tests.engine.roles import engine_python, role
from tests.engine.vllm_roles import PROMPTS

pytestmark = pytest.mark.slow

STEPS = 3


def same_folder(folder, checkpoint) -> None:
    with open_checkpoint(folder) as got, open_checkpoint(checkpoint) as want:
        assert sorted(got) == sorted(want)
        for name in want:
            assert np.array_equal(got[name].bits, want[name].bits), name
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):
        assert (folder / name).read_bytes() == (checkpoint / name).read_bytes(), name


def test_an_empty_box_serves_the_current_policy_with_vllm(tmp_path):
    token_file = make_token(tmp_path / "swarm.token")
    token = token_file.read_text().strip()
    port = free_port()
    tracker = f"http://127.0.0.1:{port}"
    out = tmp_path / "run"
    out.mkdir()
    vllm_port = free_port()
    daemons, server = [], None
    try:
        daemons.append(Daemon(tmp_path, "trainer", "trainer", "eu", token_file, port=port, ttl=2).start())
        role("coldtrain", out, tracker, token_file, STEPS)

        node = Daemon(tmp_path, "late", "rollout", "us", token_file, tracker=tracker, ttl=2,
                      extra=("--current", "on", "--follow-vllm", f"http://127.0.0.1:{vllm_port}")).start()
        daemons.append(node)
        current = node.data_dir / "current"
        wait_for(lambda: (node.node(token)["current"] or {}).get("version") == STEPS, 60, "DATA/current",
                 detail=lambda: node.node(token)["current"])
        same_folder(current, out / f"step{STEPS}")

        server = VllmServer(engine_python(), current, vllm_port, log_path=tmp_path / "server.log").start()
        server.wait_ready()
        # Follow mode attaches the server; its workers loaded the folder at version STEPS.
        wait_for(lambda: server.weight_version() == str(STEPS), 60, "the server's weight_version",
                 detail=lambda: (server.weight_version(), node.node(token)["error"]))
        got = {STEPS: [server.generate(p) for p in PROMPTS]}

        # One more step: the folder moves in place, follow mode moves the server.
        role("more", out, tracker, token_file, STEPS, 1)
        wait_for(lambda: server.weight_version() == str(STEPS + 1), 60, "the server on the next version")
        wait_for(lambda: node.node(token)["current"]["version"] == STEPS + 1, 30, "DATA/current on the next version")
        same_folder(current, out / f"step{STEPS + 1}")
        got[STEPS + 1] = [server.generate(p) for p in PROMPTS]
        # The tracker hears of the engine's version with the node's next renewal (nudged at once,
        # but a renewal already in flight on a loaded box carries the version before).
        wait_for(lambda: node_row(tracker, token, "late").get("engine_version") == STEPS + 1, 30,
                 "the tracker's row on the engine's version",
                 detail=lambda: node_row(tracker, token, "late").get("engine_version"))
    finally:
        if server is not None:
            server.stop()
        for d in daemons:
            if d.proc and d.proc.poll() is None:
                d.proc.kill()
                d.proc.wait()

    role("reference", out, out / f"step{STEPS}", out / f"step{STEPS + 1}")
    for v in (STEPS, STEPS + 1):
        want = json.loads((out / f"reference-step{v}.generate.json").read_text())
        assert [g["tokens"] for g in got[v]] == [r["tokens"] for r in want]
        assert [g["logprobs"] for g in got[v]] == [r["logprobs"] for r in want]
