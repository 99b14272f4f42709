"""The daemon's port is on the internet: what a stranger, a scraper and a member that outlived its
credential can and cannot make a node do. Real daemons on loopback, attacked as a black box."""

from __future__ import annotations

import asyncio
import json
import resource
import socket
import threading
import time

import pytest

from sparrowd import Publisher
from sparrowd.daemon.connections import HEAD_TIMEOUT
from tests import members
from tests.daemon.harness import free_port, get, status, wait_for
from tests.daemon.test_trust import Mallory, create_credential
from tests.helpers import sparrowd
from tests.models import train, trained_setup

pytestmark = pytest.mark.slow

MP = {"Content-Type": "application/msgpack"}


def peak_rss(pid: int) -> int:
    """The process's peak resident memory so far, bytes (VmHWM)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def unauthenticated_exchange(port: int, headers: dict, size: int = 16 << 20) -> tuple[int, float]:
    """A 16 MiB exchange from a stranger: its status, and the seconds from its head to the answer."""
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"POST /v1/swarm/exchange HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\n"
                  f"Content-Length: {size}\r\n{head}\r\n".encode())
        t0 = time.monotonic()
        s.sendall(b"\x91" + b"\xc0" * (256 << 10))  # the start of a huge array of nils
        line = s.recv(64)
        took = time.monotonic() - t0
        try:  # the rest of the body: the node reads none of it (it may close the connection first)
            s.sendall(b"\xc0" * (size - (256 << 10) - 1))
        except OSError:
            pass
    return int(line.split()[1]), took


def test_a_stranger_makes_no_node_work_before_it_authenticates(cluster):
    trainer, node = cluster.pair()
    epochs = {n["node_id"]: n["epoch"] for n in status(cluster.tracker, cluster.token)["nodes"]}
    lies = ({"X-Sparrowd-Node": "r9", "X-Sparrowd-Proof": "1764000000000.AAAA"},
            {"X-Sparrowd-Node": "r9", "X-Sparrowd-Proof": "1.AAAA", "X-Sparrowd-Ticket": "e30.AAAA"},
            {"Authorization": "Bearer " + "x" * 48})
    for d in (node, trainer):
        port = int(d.url.rsplit(":", 1)[1])
        before = peak_rss(d.proc.pid)
        answers = [unauthenticated_exchange(port, h) for h in lies for _ in range(2)]
        assert {code for code, _ in answers} == {401}, answers
        assert min(t for _, t in answers) < 0.1, answers
        grew = peak_rss(d.proc.pid) - before
        assert grew < 8 << 20, f"{d.name}'s peak memory grew {grew / 2**20:.1f} MiB under 16 MiB exchanges"
    time.sleep(3 * 2.0)  # a TTL and more: no lease was lost meanwhile
    assert {n["node_id"]: n["epoch"] for n in status(cluster.tracker, cluster.token)["nodes"]} == epochs
    assert "refused a peer request" in node.log() and "no-ticket" in node.log()


class RecordingProxy(threading.Thread):
    """A TCP proxy in front of a member's port that keeps every byte sent to the member."""

    def __init__(self, to_port: int):
        super().__init__(daemon=True)
        self.port, self.to_port = free_port(), to_port
        self.received = bytearray()
        self.ready = threading.Event()

    def run(self) -> None:
        async def pipe(reader, writer, keep: bool) -> None:
            try:
                while data := await reader.read(65536):
                    if keep:
                        self.received += data
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        async def handle(reader, writer) -> None:
            try:
                up_r, up_w = await asyncio.open_connection("127.0.0.1", self.to_port)
            except OSError:
                writer.close()
                return
            await asyncio.gather(pipe(reader, up_w, True), pipe(up_r, writer, False))

        async def main() -> None:
            server = await asyncio.start_server(handle, "127.0.0.1", self.port)
            self.ready.set()
            async with server:
                await server.serve_forever()

        asyncio.run(main())


def test_no_request_to_a_member_that_holds_a_credential_carries_a_secret(cluster, tmp_path):
    """A box that joined with a credential learns no shared token from its peers, nor anyone's
    credential: every peer request it receives is admitted by a ticket and a proof alone."""
    trainer = cluster.trainer()
    cred_file = tmp_path / "r1.credential"
    r = sparrowd("token", "create", "--data-dir", trainer.data_dir, "--region", "eu", "--out", cred_file, timeout=30)
    assert r.returncode == 0, r.stderr
    other_id, other_cred = create_credential(trainer, "--region", "eu")
    r0 = cluster.rollout("r0", "eu")
    r2 = cluster.rollout("r2", "eu", token_file=_write(tmp_path / "r2.credential", other_cred))
    port = free_port()
    proxy = RecordingProxy(port)
    proxy.start()
    proxy.ready.wait(10)
    r1 = cluster.rollout("r1", "eu", token_file=cred_file, port=port,
                         extra=("--advertise", f"127.0.0.1:{proxy.port}"))
    wait_for(lambda: cluster.nodes() == {"trainer", "r0", "r1", "r2"}, 15, "every node")
    model, opt = trained_setup(5)
    pub = Publisher(daemon=cluster.tracker, token_file=cluster.token_file, chunk_size=4 << 10)
    pub.start(model, version=0, anchor=False)
    for v in (1, 2):
        train(model, opt)
        pub.publish(model, version=v)
        assert pub.wait(nodes=["r0", "r1", "r2"], timeout=30)["done"]
    seen = bytes(proxy.received)
    assert seen.count(b"X-Sparrowd-Ticket") >= 3, "no peer request reached r1 through its advertised address"
    secrets = {"the swarm token": cluster.token, "r1's credential": cred_file.read_text().strip(),
               "r2's credential": other_cred}
    for what, secret in secrets.items():
        assert secret.encode() not in seen, f"{what} was sent to r1"
    assert b"spw1." not in seen and b"authorization" not in seen.lower()
    assert r0.proc.poll() is None and r1.proc.poll() is None and r2.proc.poll() is None and other_id


def _write(path, text: str):
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


def test_an_expired_credential_ends_its_lease_at_the_tracker_and_at_every_peer_within_a_third_of_the_ttl(
        cluster, tmp_path):
    ttl = 6.0
    trainer = cluster.trainer(ttl=ttl)
    r0 = cluster.rollout("r0", "us", ttl=ttl)
    wait_for(lambda: cluster.nodes() == {"trainer", "r0"}, 15, "both nodes")
    # A member speaking the protocol by hand, with a credential that expires in a few seconds.
    _, cred = create_credential(trainer, "--region", "us", "--expires", "8s")
    expires = time.time() + 8.0
    m = Mallory(cluster.tracker, cred, "127.0.0.1:9")
    code, reply = m.call("join", members.join(m.key, "mallory", region="us", address=m.address))
    assert code == 200, reply
    m.epoch = reply["epoch"]
    # A real daemon with another short credential: it exits with one line when it is refused for good.
    _, short = create_credential(trainer, "--region", "us", "--expires", "8s")
    r1 = cluster.rollout("r1", "us", ttl=ttl, token_file=_write(tmp_path / "r1.credential", short))
    wait_for(lambda: {"mallory", "r1"} <= cluster.nodes(), 10, "the members with credentials")

    def renewals() -> None:  # as a daemon would: it keeps renewing, with its own credential as bearer
        while time.time() < expires + ttl:
            m.call("renew", members.renew(m.key, "mallory", m.epoch))
            time.sleep(0.5)

    threading.Thread(target=renewals, daemon=True).start()
    ask = lambda: m.peer(r0.url, "/v1/swarm/chunk/1/0", to="r0", method="GET")  # noqa: E731
    assert ask() != 401
    # Renewing under another box's credential is refused (403), whoever holds the lease.
    assert m.call("renew", members.renew(m.key, "mallory", m.epoch))[0] == 200
    m_cred = m.cred
    m.cred = short
    assert m.call("renew", members.renew(m.key, "mallory", m.epoch))[0] == 403
    m.cred = m_cred
    wait_for(lambda: time.time() >= expires, 15, "the credential to expire")
    at_tracker = wait_for(lambda: "mallory" not in cluster.nodes() and time.time(), ttl, "the tracker to end the lease")
    at_peer = wait_for(lambda: ask() == 401 and time.time(), ttl, "r0 to refuse the member")
    assert at_tracker - expires <= ttl / 3 and at_peer - expires <= ttl / 3, (at_tracker - expires, at_peer - expires)
    assert r1.wait(timeout=ttl + 10) == 78
    lines = [line for line in r1.log().splitlines() if "stopping" in line]
    assert len(lines) == 1 and "expired" in lines[0], r1.log()[-2000:]
    assert "lease ended: its credential expired" in trainer.log()
    # Revoked: the same, at once.
    revoked_id, long = create_credential(trainer, "--region", "us")
    r2 = cluster.rollout("r2", "us", ttl=ttl, token_file=_write(tmp_path / "r2.credential", long))
    wait_for(lambda: "r2" in cluster.nodes(), 10, "r2 to join")
    assert sparrowd("token", "revoke", revoked_id, "--data-dir", trainer.data_dir, timeout=30).returncode == 0
    assert r2.wait(timeout=ttl + 10) == 78
    lines = [line for line in r2.log().splitlines() if "stopping" in line]
    assert len(lines) == 1 and "revoked" in lines[0], r2.log()[-2000:]


def test_stalled_request_heads_are_shed_while_the_cli_is_answered(cluster):
    """1,100 connections that send half a request head, to a daemon limited to 1,024 open files:
    the node keeps answering its operator, and sheds them within the head timeout."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1300:
        pytest.skip(f"this process may open {hard} files; the test opens 1,100 connections")
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard) if hard != resource.RLIM_INFINITY else 4096, hard))
    try:
        trainer = cluster.trainer(open_files=1024)
        node = cluster.rollout("r1", "eu")
        wait_for(lambda: cluster.nodes() == {"trainer", "r1"}, 15, "both nodes")
        conns = []
        for _ in range(1100):
            try:
                s = socket.create_connection(("127.0.0.1", cluster.port), timeout=5)
                s.sendall(b"POST /v1/tracker/renew HTTP/1.1\r\nHost: x\r\nContent-Le")
                conns.append(s)
            except OSError:
                pass  # refused or reset: shed at once
        t0 = time.monotonic()
        code, body = get(f"{cluster.tracker}/v1/tracker/status", cluster.token, timeout=5)
        took = time.monotonic() - t0
        assert code == 200 and took < 1.0, (code, took)
        r = sparrowd("status", "--tracker", cluster.tracker, "--token-file", cluster.token_file, timeout=30)
        assert r.returncode == 0 and "r1" in r.stdout, r.stderr
        time.sleep(HEAD_TIMEOUT + 2.5)
        still = 0
        for s in conns:
            s.setblocking(False)
            try:
                still += s.recv(1) != b""
            except BlockingIOError:
                still += 1
            except OSError:
                pass
            s.close()
        assert still == 0, f"{still} of {len(conns)} stalled connections still open after {HEAD_TIMEOUT + 2.5} s"
        assert cluster.nodes() == {"trainer", "r1"} and trainer.proc.poll() is None and node.proc.poll() is None
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_bad_numbers_and_deep_bodies_get_a_400_with_one_line(cluster):
    trainer = cluster.trainer()
    for q in ("timeout=nan", "timeout=inf", "timeout=-inf", "fraction=nan", "timeout=1e999"):
        code, body = get(f"{cluster.tracker}/v1/tracker/wait?version=1&{q}", cluster.token)
        assert code == 400 and "\n" not in json.loads(body)["error"], (q, code, body)
    deep_json = b"[" * 200_000 + b"]" * 200_000
    code, body = get(f"{cluster.tracker}/v1/tracker/credentials", cluster.token, method="POST", data=deep_json,
                     headers={"Content-Type": "application/json"})
    assert code == 400, (code, body)
    deep_msgpack = b"\x91" * 200_000 + b"\xc0"
    for path in ("/v1/tracker/join", "/v1/tracker/renew"):
        code, body = get(f"{cluster.tracker}{path}", cluster.token, method="POST", data=deep_msgpack, headers=MP)
        assert code == 400, (path, code, body)
    assert get(f"{cluster.tracker}/v1/tracker/status", cluster.token)[0] == 200 and trainer.proc.poll() is None


def test_a_scraper_reads_metrics_on_their_own_listener_without_any_secret(cluster):
    trainer = cluster.trainer(extra=("--metrics-listen", "127.0.0.1:0"))
    url = trainer.runtime()["metrics_url"]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
    code, body = get(url, None)
    assert code == 200 and b"sparrowd_" in body
    base = url[: -len("/metrics")]
    for path in ("/v1/tracker/status", "/v1/node", "/v1/swarm/ping"):
        assert get(base + path, None)[0] == 404  # nothing but metrics there
        assert get(base + path, cluster.token)[0] == 404
    assert get(f"{cluster.tracker}/metrics", None)[0] == 401  # the main port still asks for the token
