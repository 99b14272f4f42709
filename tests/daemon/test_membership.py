"""A trainer and rollout daemons as real processes on loopback: forming, deaths, restarts, tokens."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import msgpack
import pytest

from sparrowd.swarm.identity import seal
from tests.conftest import TTL
from tests.daemon.harness import Daemon, free_port, get, make_token, status, wait_for
from tests.helpers import sparrowd
from tests.members import new_key

pytestmark = pytest.mark.slow

SWEEP = 1.0


def _full_swarm(c):
    trainer = c.trainer()
    rollouts = [c.rollout("r1", "eu"), c.rollout("r2", "us"), c.rollout("r3", "us")]
    wait_for(lambda: c.nodes() == {"trainer", "r1", "r2", "r3"}, 15, "four nodes in the swarm")
    return trainer, rollouts


def test_swarm_forms_and_a_killed_node_drops_out_within_ttl_plus_one_renewal(cluster):
    trainer, (r1, r2, r3) = _full_swarm(cluster)
    snap = status(cluster.tracker, cluster.token)
    rows = {n["node_id"]: n for n in snap["nodes"]}
    assert rows["r2"]["region"] == "us" and rows["r2"]["role"] == "rollout"
    assert rows["r2"]["address"] == r2.runtime()["address"]
    # Renewals flow: every node turns from joining to up.
    wait_for(lambda: all(n["state"] == "up" for n in status(cluster.tracker, cluster.token)["nodes"]), 10,
             "every node renewed")
    # Peer lists name the trainer first, then are region-aware: r3 (us) hears of r2, then of r1 (eu).
    wait_for(lambda: len(r3.node(cluster.token)["peers"]) == 3, 10, "r3 to know three peers")
    peers = r3.node(cluster.token)["peers"]
    assert [p["node_id"] for p in peers] == ["trainer", "r2", "r1"]

    r2.kill()
    t0 = time.monotonic()
    wait_for(lambda: "r2" not in cluster.nodes(), TTL + TTL / 3 + SWEEP + 3, "r2 to drop out")
    gone_after = time.monotonic() - t0
    assert gone_after <= TTL + TTL / 3 + 0.3, gone_after  # peer lists skip a lapsed lease before any sweep
    wait_for(lambda: "lease expired node_id=r2" in trainer.log(), SWEEP + 1, "the expiry in the log")
    wait_for(lambda: [p["node_id"] for p in r3.node(cluster.token)["peers"]] in (["trainer", "r1"], ["r1", "trainer"]),
             5, "r3's peer list without r2")
    assert cluster.nodes() == {"trainer", "r1", "r3"}


def test_trainer_restart_keeps_the_swarm_without_rejoining(cluster):
    trainer, rollouts = _full_swarm(cluster)
    before = {n["node_id"]: n["epoch"] for n in status(cluster.tracker, cluster.token)["nodes"]}
    trainer.kill()  # no goodbye: the table must come back from disk
    time.sleep(TTL)  # longer than a renewal interval: renewals fail meanwhile
    trainer2 = cluster.trainer()
    snap = status(cluster.tracker, cluster.token)
    after = {n["node_id"]: n["epoch"] for n in snap["nodes"]}
    for r in ("r1", "r2", "r3"):
        assert after[r] == before[r]
    # The rollouts renew into the restored leases: same epochs, no re-join, for several TTLs.
    time.sleep(2.5 * TTL)
    snap = status(cluster.tracker, cluster.token)
    assert {n["node_id"]: n["epoch"] for n in snap["nodes"] if n["node_id"] != "trainer"} == {
        r: before[r] for r in ("r1", "r2", "r3")}
    assert all(n["state"] == "up" for n in snap["nodes"])
    for d in rollouts:
        assert "re-joining" not in d.log() and d.log().count("joined the swarm") == 1
        assert "tracker reachable again" in d.log()
        # Sessions live in the tracker's memory: each node renewed once signed, with a new exchange key.
        assert d.log().count("tracker session unknown; renewing signed") == 1
    assert "tracker restored its lease table nodes=4" in trainer2.log()


def test_sigterm_leaves_at_once_and_exits_zero(cluster):
    trainer, (r1, r2, r3) = _full_swarm(cluster)
    r1.signal(signal.SIGTERM)
    assert r1.wait() == 0
    assert "r1" not in cluster.nodes()  # ended now, not after a TTL
    assert not (r1.data_dir / "daemon.json").exists()
    assert "node left node_id=r1" in trainer.log()
    trainer.signal(signal.SIGINT)
    assert trainer.wait() == 0


def test_a_wrong_or_missing_token_is_refused_and_leaks_nothing(cluster, tmp_path):
    trainer = cluster.trainer()
    for token in (None, "x" * 48, cluster.token + "x"):
        for method, path in (("GET", "/v1/tracker/status"), ("POST", "/v1/tracker/join"), ("GET", "/metrics"),
                             ("GET", "/no/such/path"), ("POST", "/v1/node/leave")):
            code, body = get(f"{cluster.tracker}{path}", token, method=method,
                             data=b"" if method == "POST" else None)
            assert (code, json.loads(body)) == (401, {"error": "unauthorized"}), (token, path)
    assert "refused a request without the swarm token" in trainer.log()
    assert cluster.nodes() == {"trainer"}  # nothing changed; the leave above did not stop the trainer

    # A rollout with the wrong token says so and exits 78 (EX_CONFIG: systemd does not restart it)
    # rather than retrying forever.
    wrong = make_token(tmp_path / "wrong.token")
    bad = cluster.rollout("intruder", "eu", token_file=wrong, wait=False)
    assert bad.wait() == 78
    assert "refused the swarm token" in bad.log()
    assert cluster.nodes() == {"trainer"}

    r = sparrowd("status", "--tracker", cluster.tracker, "--token-file", wrong)
    assert r.returncode == 1 and r.stderr.strip() == (
        f"sparrowd: error: {cluster.tracker}/v1/tracker/status: the daemon refused the swarm token")


def test_malformed_messages_get_clear_errors_and_harm_nothing(cluster):
    cluster.trainer()
    url = f"{cluster.tracker}/v1/tracker/join"
    mp = {"Content-Type": "application/msgpack"}
    k = new_key()
    base = {"node_id": "a", "role": "rollout", "region": "eu", "address": "h:1", "key": k.public, "ts": time.time()}

    def sealed(op, msg):
        return msgpack.packb(seal(k, op, msg))

    cases = [
        (b"\xc1\xff\x00", mp, 400, "not valid msgpack"),
        (msgpack.packb([1, 2]), mp, 400, "expected a map"),
        (msgpack.packb({"msg": b"x"}), mp, 400, "missing field 'sig'"),
        (sealed("join", [1, 2]), mp, 400, "must be a map"),
        (sealed("join", {k: v for k, v in base.items() if k != "address"}), mp, 400, "missing field 'address'"),
        (sealed("join", {**base, "node_id": 7}), mp, 400, "'node_id' must be a string"),
        (sealed("join", {**base, "role": "king"}), mp, 400, "role"),
        (sealed("join", {**base, "key": new_key().public}), mp, 403, "not signed by the key it carries"),
        (sealed("renew", base), mp, 403, "not signed by the key it carries"),  # signed as another operation
        (b"{}", {"Content-Type": "application/json"}, 415, "application/msgpack"),
    ]
    for data, headers, code, text in cases:
        got, body = get(url, cluster.token, method="POST", data=data, headers=headers)
        assert got == code and text in json.loads(body)["error"], (got, body)
    for size in (300 << 10, 2 << 20):  # over the tracker's limit, and over the daemon's
        got, body = get(url, cluster.token, method="POST", data=b"\x00" * size, headers=mp)
        assert got == 413, body
    renew = sealed("renew", {"node_id": "trainer", "epoch": 1, "ts": time.time(), "versions": ["x"]})
    got, body = get(f"{cluster.tracker}/v1/tracker/renew", cluster.token, method="POST", data=renew, headers=mp)
    assert got == 400 and "versions" in json.loads(body)["error"]
    gone = sealed("renew", {"node_id": "ghost", "epoch": 1, "ts": time.time()})
    got, body = get(f"{cluster.tracker}/v1/tracker/renew", cluster.token, method="POST", data=gone, headers=mp)
    assert got == 410 and "no lease" in json.loads(body)["error"]
    assert cluster.nodes() == {"trainer"}


def test_metrics_readiness_and_the_data_dir_lock(cluster, tmp_path):
    notify = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify))
    sock.settimeout(1)
    seen: list[str] = []

    def read_like_systemd():  # systemd reads the notify socket at once, all the time
        while True:
            try:
                seen.append(sock.recv(4096).decode())
            except TimeoutError:
                continue
            except OSError:
                return

    threading.Thread(target=read_like_systemd, daemon=True).start()
    trainer = cluster.trainer(env={"NOTIFY_SOCKET": str(notify), "WATCHDOG_USEC": "400000"})
    wait_for(lambda: any(m.startswith("READY=1") for m in seen) and "WATCHDOG=1" in seen, 10,
             "READY and a watchdog ping")
    r1 = cluster.rollout("r1", "us")
    wait_for(lambda: cluster.nodes() == {"trainer", "r1"}, 10, "r1 to join")
    code, body = get(f"{cluster.tracker}/metrics", cluster.token)
    text = body.decode()
    assert code == 200
    assert 'sparrowd_tracker_nodes{region="us",role="rollout"} 1.0' in text
    assert 'sparrowd_info{node_id="trainer",region="eu",role="trainer"} 1.0' in text
    assert "sparrowd_unauthorized_requests_total 0.0" in text
    wait_for(lambda: 'sparrowd_peers{region_class="other"} 1.0' in get(f"{r1.url}/metrics", cluster.token)[1].decode(),
             5, "r1 to count the trainer as a peer in another region")

    twin = Daemon(tmp_path, "r1", "rollout", "us", cluster.token_file, tracker=cluster.tracker)
    twin.start(wait=False)
    assert twin.wait() == 1 and "is in use by another sparrowd" in twin.log()
    assert r1.proc.poll() is None and r1.runtime() is not None  # the twin did not touch r1's files

    trainer.signal(signal.SIGTERM)
    assert trainer.wait() == 0
    wait_for(lambda: "STOPPING=1" in seen, 2, "STOPPING=1")
    sock.close()


def test_join_and_leave_commands(cluster, tmp_path):
    cluster.trainer()
    data = tmp_path / "joined"
    r = sparrowd("join", cluster.tracker, "--token-file", cluster.token_file, "--region", "ap", "--data-dir", data,
                 "--listen", "127.0.0.1:0", "--node-id", "box7")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"joined {cluster.tracker} as box7 (region ap, epoch ")
    info = json.loads((data / "daemon.json").read_text())
    try:
        assert cluster.nodes() == {"trainer", "box7"}
        again = sparrowd("join", cluster.tracker, "--token-file", cluster.token_file, "--region", "ap",
                         "--data-dir", data, "--listen", "127.0.0.1:0")
        assert again.returncode == 1 and "already runs" in again.stderr
        r = sparrowd("leave", "--data-dir", data)
        assert r.returncode == 0, r.stderr
        assert "box7 left the swarm" in r.stdout
        assert cluster.nodes() == {"trainer"}
        assert not (data / "daemon.json").exists()
    finally:
        import os
        try:
            os.kill(info["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    r = sparrowd("leave", "--data-dir", data)
    assert r.returncode == 1 and r.stderr.strip() == f"sparrowd: error: no daemon runs on {data}"


def test_status_command_prints_a_row_per_node_and_a_stable_json_snapshot(cluster):
    _full_swarm(cluster)
    r = sparrowd("status", "--tracker", cluster.tracker, "--token-file", cluster.token_file, "--json")
    assert r.returncode == 0, r.stderr
    snap = json.loads(r.stdout)
    assert snap["schema"] == 1 and "latest_version" in snap
    assert {n["node_id"] for n in snap["nodes"]} == {"trainer", "r1", "r2", "r3"}
    for n in snap["nodes"]:
        assert {"node_id", "role", "region", "address", "lease_expires_in", "versions", "engine_version",
                "bytes_up", "bytes_down"} <= set(n)
        assert 0 < n["lease_expires_in"] <= TTL
    r = sparrowd("status", "--tracker", cluster.tracker, "--token-file", cluster.token_file)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("swarm: 4 nodes in 2 regions, latest version -")
    assert lines[2].split()[:5] == ["NODE", "ROLE", "REGION", "ADDRESS", "STATE"]
    assert sorted(line.split()[0] for line in lines[3:]) == ["r1", "r2", "r3", "trainer"]
    r = sparrowd("status", "--tracker", f"http://127.0.0.1:{free_port()}", "--token-file", cluster.token_file)
    assert r.returncode == 1 and "unreachable" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_node_frozen_past_its_lease_rejoins_with_a_new_epoch(cluster):
    trainer = cluster.trainer(extra=("--log-format", "json"))
    r1 = cluster.rollout("r1", "eu")
    wait_for(lambda: cluster.nodes() == {"trainer", "r1"}, 10, "r1 to join")
    first = {n["node_id"]: n["epoch"] for n in status(cluster.tracker, cluster.token)["nodes"]}["r1"]
    r1.signal(signal.SIGSTOP)  # a box that hangs: no renewals, no goodbye
    try:
        wait_for(lambda: "r1" not in cluster.nodes(), TTL + SWEEP + 3, "r1 to expire")
    finally:
        r1.signal(signal.SIGCONT)
    # Its next renewal finds the lease gone and re-joins as a new life.
    wait_for(lambda: "r1" in cluster.nodes(), 5, "r1 to re-join")
    again = {n["node_id"]: n["epoch"] for n in status(cluster.tracker, cluster.token)["nodes"]}["r1"]
    assert again > first
    assert "lease gone; re-joining" in r1.log()
    # --log-format json: one JSON object per line, fields included.
    events = [json.loads(line) for line in trainer.log().splitlines()]
    joins = [e for e in events if e["msg"] == "node joined" and e["node_id"] == "r1"]
    assert [e["epoch"] for e in joins] == [first, again] and all(e["level"] == "info" for e in joins)
    # The sweep or the refused renewal, whichever came first, logged the end of the old life.
    assert any(e["msg"] in ("lease expired", "renewal refused") and e["node_id"] == "r1" for e in events)


def test_publishing_is_refused_from_other_machines():
    from unittest import mock

    from aiohttp.test_utils import make_mocked_request

    from sparrowd.daemon.routes import local_only

    def request(peer):
        transport = mock.Mock()
        transport.get_extra_info.side_effect = lambda key, default=None: (peer, 1234) if key == "peername" else default
        return make_mocked_request("POST", "/v1/publish/manifest", transport=transport)

    for local in ("127.0.0.1", "127.8.9.10", "::1"):
        assert local_only(request(local)) is None
    for remote in ("10.0.0.5", "192.168.1.2", "2001:db8::1"):
        refused = local_only(request(remote))
        assert refused.status == 403 and b"own machine" in refused.body


def test_a_daemon_stops_promptly_while_peers_hold_long_polls_on_it(cluster):
    """Rollout nodes keep a long-polling exchange open with each peer at all times. A stopping
    daemon answers those at once and cuts what is left after a short grace, so SIGTERM never
    waits on its peers (here: several seconds per poll, renewed on the same connections)."""
    trainer = cluster.trainer()
    nodes = [cluster.rollout(f"r{i}", "us") for i in range(1, 3)]
    wait_for(lambda: cluster.nodes() == {"trainer", "r1", "r2"}, 10, "the nodes to join")
    for r in nodes:
        wait_for(lambda r=r: 'sparrowd_peers{region_class="other"} 1.0' in get(f"{r.url}/metrics", cluster.token)[1]
                 .decode(), 10, f"{r.name} to poll the trainer")
    time.sleep(1.0)  # the polls are in their wait now
    t0 = time.monotonic()
    trainer.signal(signal.SIGTERM)
    assert trainer.wait() == 0
    assert time.monotonic() - t0 < 2.5, trainer.log()
    assert "daemon stopped" in trainer.log()


def test_a_node_learns_of_a_later_joiner_when_it_first_asks_not_at_its_next_renewal(cluster):
    """With a 30 s TTL a node renews every 10 s. A node that joins later asks it for versions at
    once; the asked node renews early for a fresh peer list (the tracker's, not the stranger's
    word) and relays to it within a second or two, instead of up to a renewal interval later."""
    cluster.trainer(ttl=30)
    r1 = cluster.rollout("r1", "eu")
    wait_for(lambda: cluster.nodes() == {"trainer", "r1"}, 15, "r1 in the swarm")
    wait_for(lambda: "trainer" in {p["node_id"] for p in r1.node(cluster.token)["peers"]}, 15, "r1 to list the trainer")
    time.sleep(1.0)  # r1's next renewal is about 9 s away now
    start = time.monotonic()
    cluster.rollout("r2", "eu")
    wait_for(lambda: "r2" in {p["node_id"] for p in r1.node(cluster.token)["peers"]}, 5, "r1 to learn of r2")
    assert time.monotonic() - start < 4.0


def test_a_daemon_lifts_its_limit_on_open_files(tmp_path):
    """Started from a shell with a low soft limit on open files, the daemon lifts it (to 65,536, or the
    hard limit if lower), as the systemd unit's LimitNOFILE would: it holds two connections to each
    peer, and the trainer is every rollout's peer."""
    import resource

    from sparrowd.daemon.app import OPEN_FILES
    from tests.daemon.harness import Daemon, make_token

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES)
    if want <= 256:
        pytest.skip("the hard limit leaves nothing to lift")
    d = Daemon(tmp_path, "trainer", "trainer", "eu", make_token(tmp_path / "swarm.token"))
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # inherited by the daemon's process
    try:
        d.start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, old)
    try:
        line = next(ln for ln in open(f"/proc/{d.proc.pid}/limits") if ln.startswith("Max open files"))
        assert int(line.split()[3]) == want, line
    finally:
        d.stop()
