"""`vllm serve` with the sparrowd weight-transfer backend, next to real daemons (one server per module).

A real OpenAI-compatible vLLM server (CPU build, `python -m vllm.entrypoints.openai.api_server`,
`--weight-transfer-config '{"backend": "sparrowd"}'`) starts on a tiny Qwen3's base checkpoint
beside a trainer daemon and a rollout daemon. The tests then drive it the ways users do: vLLM's
own trainer-side API (`WeightTransferTrainerFactory`, `HTTPVLLMWeightSyncClient`) from a real
AdamW loop, the RL routes by hand with faults in between, and the daemon's follow mode under
continuous requests. They run in order and share the server, as an RL run would.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from sparrowd.bench.vllm_server import VllmServer
from tests.daemon.harness import Daemon, free_port, make_token, node_row, status, wait_for
from tests.engine.roles import ONE_WORKER_IN_CORE, engine_python, role
from tests.engine.vllm_roles import PROMPTS

pytestmark = pytest.mark.slow

STEPS = 2


class World:
    pass


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = World()
    w.root = root = tmp_path_factory.mktemp("server")
    w.token_file = make_token(root / "swarm.token")
    w.token = w.token_file.read_text().strip()
    port = free_port()
    w.tracker = f"http://127.0.0.1:{port}"
    w.daemons = []
    w.observed = {}  # version -> the server's greedy outputs, each time they were read
    w.trainer = Daemon(root, "trainer", "trainer", "eu", w.token_file, port=port, ttl=2).start()
    w.daemons.append(w.trainer)

    def rollout(*extra: str) -> Daemon:
        d = Daemon(root, "r1", "rollout", "us", w.token_file, tracker=w.tracker, ttl=2, extra=extra).start()
        w.daemons.append(d)
        return d

    w.rollout = rollout
    w.node = rollout()
    wait_for(lambda: len(status(w.tracker, w.token)["nodes"]) == 2, 15, "two nodes")
    w.out = root / "run"
    w.out.mkdir()
    role("base", w.out)
    w.server = VllmServer(engine_python(), w.out / "step0", free_port(), log_path=root / "server.log",
                          env=ONE_WORKER_IN_CORE).start()
    try:
        w.server.wait_ready()
        yield w
    finally:
        w.server.stop()
        for d in w.daemons:
            if d.proc and d.proc.poll() is None:
                d.proc.kill()
                d.proc.wait()


def r1_row(w) -> dict:
    return node_row(w.tracker, w.token, "r1")


def outputs(w) -> list[dict]:
    """Greedy outputs of the server now, kept to be compared with a fresh engine's at the end."""
    got = [w.server.generate(p) for p in PROMPTS]
    w.observed.setdefault(int(w.server.weight_version()), []).append(got)
    return got


def reference(w, version: int) -> list[dict]:
    return json.loads((w.out / f"reference-step{version}.generate.json").read_text())


def same_generation(got: list[dict], want: list[dict]) -> None:
    assert [g["tokens"] for g in got] == [r["tokens"] for r in want]
    assert [g["logprobs"] for g in got] == [r["logprobs"] for r in want]


def error_text(reply: dict) -> str:
    return json.dumps(reply)


def test_vllms_trainer_side_api_moves_the_server_bit_for_bit(world):
    w = world
    log = role("drive", w.out, w.tracker, w.token_file, STEPS, w.server.url, w.node.data_dir / "engine.sock",
               timeout=600)
    assert f"step {STEPS}: weight_version {STEPS}" in log
    seen = json.loads((w.out / "drive.json").read_text())
    # After each send_weights(), /weight_info reports that step's sparrowd version.
    assert [s["weight_version"] for s in seen] == [str(v) for v in range(1, STEPS + 1)]
    for v in range(1, STEPS + 1):
        got = json.loads((w.out / f"server-step{v}.generate.json").read_text())
        w.observed.setdefault(v, []).append(got)
        # Every token is labelled with the version that produced it.
        assert all(g["versions"] == [{"version": str(v), "start": 0, "end": len(g["tokens"])}] for g in got)
    # The node reports the server's version as its engine's.
    wait_for(lambda: r1_row(w).get("engine_version") == STEPS, 10, "the engine version in status")


def test_faults_leave_the_server_on_its_last_complete_version(world):
    w, v = world, STEPS
    sock = str(w.node.data_dir / "engine.sock")
    before = outputs(w)

    # 1. A version the daemon does not have within the timeout: a clear error; nothing changes.
    w.server.post("start_weight_update")
    code, reply = w.server.call("POST", "update_weights", {"update_info": {"version": v + 1, "timeout": 1}})
    assert code == 500 and f"version {v + 1} is not ready" in error_text(reply)
    assert w.server.weight_version() == str(v)
    same_generation(outputs(w), before)

    # 2. A corrupt chunk is refused before any write. The engine detaches while version v+1
    # arrives, so nothing decodes it before one of its stored chunks is damaged on disk.
    w.server.post("shutdown_weight_transfer_engine")
    wait_for(lambda: r1_row(w).get("engine_version") is None, 10, "the engine to detach")
    role("more", w.out, w.tracker, w.token_file, v, 1)
    wait_for(lambda: v + 1 in r1_row(w).get("versions", ()), 30, f"r1 to hold version {v + 1}")
    chunk = w.node.data_dir / "versions" / str(v + 1) / "chunks" / "0.chunk"
    good = chunk.read_bytes()
    chunk.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))
    w.server.post("init_weight_transfer_engine", {"init_info": {"socket": sock, "token_file": str(w.token_file)}})
    w.server.post("start_weight_update")
    code, reply = w.server.call("POST", "update_weights", {"update_info": {"version": v + 1, "timeout": 5}})
    assert code == 500 and "hash" in error_text(reply), reply
    assert w.server.weight_version() == str(v)
    same_generation(outputs(w), before)
    chunk.write_bytes(good)  # mended: the same update now goes through
    w.server.post("start_weight_update")
    w.server.post("update_weights", {"update_info": {"version": v + 1, "timeout": 5}})
    w.server.post("finish_weight_update", {"weight_version": str(v + 1)})
    after = outputs(w)
    assert after != before

    # 3. The daemon killed while the server waits in an update: the update fails, the server keeps
    # its last complete version, and once the daemon is back the next update goes through (the
    # workers attach again by themselves).
    failed = {}

    def update():
        w.server.post("start_weight_update")
        failed["reply"] = w.server.call("POST", "update_weights", {"update_info": {"version": v + 2, "timeout": 20}})

    t = threading.Thread(target=update)
    t.start()
    time.sleep(1.5)
    w.node.kill()
    t.join(60)
    code, reply = failed["reply"]
    assert code == 500, reply
    assert w.server.weight_version() == str(v + 1)
    same_generation(outputs(w), after)
    w.node = w.rollout()
    role("more", w.out, w.tracker, w.token_file, v + 1, 1)
    wait_for(lambda: v + 2 in r1_row(w).get("versions", ()), 30, f"r1 to hold version {v + 2}")
    w.server.post("start_weight_update")
    w.server.post("update_weights", {"update_info": {"version": v + 2, "timeout": 10}})
    w.server.post("finish_weight_update", {"weight_version": str(v + 2)})
    assert outputs(w) != after


def test_follow_mode_moves_the_server_while_requests_run(world):
    w = world
    start = int(w.server.weight_version())
    w.node.stop()
    w.node = w.rollout("--follow-vllm", w.server.url)
    wait_for(lambda: r1_row(w).get("engine_version") == start, 30, "the follower to attach the server")
    done = threading.Event()
    seen: list[tuple[float, object]] = []

    def client():
        i = 0
        while not done.is_set():
            try:
                seen.append((time.monotonic(), w.server.generate(PROMPTS[i % len(PROMPTS)], max_tokens=24)))
            except Exception as e:  # noqa: BLE001 - every failure is a finding here
                seen.append((time.monotonic(), e))
            i += 1

    t = threading.Thread(target=client)
    t.start()
    try:
        role("more", w.out, w.tracker, w.token_file, start, 3, env={"SPARROWD_TEST_STEP_PAUSE": "1.5"})
        last = start + 3
        wait_for(lambda: w.server.weight_version() == str(last), 60, f"the server to reach version {last}")
        time.sleep(1.0)
    finally:
        done.set()
        t.join(120)
    errors = [r for _, r in seen if isinstance(r, Exception)]
    assert not errors, errors[:3]
    published = {str(k) for k in range(start, last + 1)}
    order = []
    for _, r in seen:
        versions = [int(s["version"]) for s in r["versions"]]
        assert {s["version"] for s in r["versions"]} <= published, r["versions"]
        assert versions == sorted(versions), r["versions"]  # within a response, never decreasing
        order += versions
    assert order == sorted(order)  # and from one response to the next
    assert len(set(order)) >= 3, "the client saw too few versions for the test to mean anything"
    wait_for(lambda: r1_row(w).get("engine_version") == last, 10, "the engine version in status")
    outputs(w)


def test_follow_mode_moves_a_server_at_once_when_it_attaches_after_failing_to(world):
    """A follower started before its server (as a new user does: the daemon first, then `vllm serve`)
    backs off while the server cannot be reached; once it attaches, the versions it already holds go
    to the server at once, not after the back-off of the failed attempts."""
    from tests.daemon.test_open_port import RecordingProxy

    w = world
    start = int(w.server.weight_version())
    w.node.stop()
    proxy = RecordingProxy(int(w.server.url.rsplit(":", 1)[1]))  # not listening yet: "cannot connect"
    w.node = w.rollout("--follow-vllm", f"http://127.0.0.1:{proxy.port}")
    role("more", w.out, w.tracker, w.token_file, start, 2)
    last = start + 2
    wait_for(lambda: last in (r1_row(w).get("versions") or []), 60, "the node to hold the new versions")
    time.sleep(12.0)  # failed attempts in a row: the back-off reaches 8 s
    assert "cannot move the vLLM server" in w.node.log()
    proxy.start()
    proxy.ready.wait(10)
    attached = wait_for(lambda: "following the vLLM server" in w.node.log() and time.monotonic(), 30,
                        "the follower to attach the server")
    moved = wait_for(lambda: w.server.weight_version() == str(last) and time.monotonic(), 30,
                     f"the server to reach version {last}")
    assert moved - attached < 3.0, f"the server moved {moved - attached:.1f} s after the follower attached it"
    w.node.stop()
    w.node = w.rollout("--follow-vllm", w.server.url)  # the next tests' follower, straight to the server
    wait_for(lambda: r1_row(w).get("engine_version") == last, 30, "the follower to attach the server")


def test_every_version_served_equals_a_fresh_engine_on_its_checkpoint(world):
    # Whatever path moved the server (vLLM's trainer-side API, the RL routes by hand after
    # faults, follow mode under load), its greedy tokens and logprobs at each version equal
    # those of a fresh engine started on that version's checkpoint.
    w = world
    if not w.observed:
        pytest.skip("checks what the module's other tests observed; run the module whole")
    assert len(w.observed) >= STEPS + 3, sorted(w.observed)
    role("reference", w.out, *(w.out / f"step{v}" for v in [0, *sorted(w.observed)]))
    for v, seen in sorted(w.observed.items()):
        for got in seen:
            same_generation(got, reference(w, v))
    # The steps changed what the model says, so the comparison is not vacuous.
    assert reference(w, 0) != reference(w, max(w.observed))
    # The references were built with the backend selected: vLLM kept them on plain F.linear.
    assert json.loads((w.out / "reference-origins.json").read_text()) == ["sparrowd.integrations.vllm_plugin"]


def test_vllm_without_the_backend_keeps_its_own_cpu_dispatch(world):
    role("dispatch", world.out)
    seen = json.loads((world.out / "dispatch.json").read_text())
    assert seen["registered"]  # the entry point registered the backend in this vLLM
    # The plugin is loaded in every vLLM process, but a model that does not select the backend
    # keeps vLLM's own linear dispatch.
    assert seen["origins"] and not any(m.startswith("sparrowd") for m in seen["origins"]), seen
