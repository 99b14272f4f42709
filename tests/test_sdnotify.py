"""systemd's notify protocol: one datagram, and never a blocked event loop."""

import socket
import time

from sparrowd.daemon.sdnotify import notify, watchdog_interval


def test_notify_sends_and_never_blocks_on_a_reader_that_stopped_reading(tmp_path):
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        env = {"NOTIFY_SOCKET": str(path)}
        assert notify("READY=1", env)
        assert sock.recv(64) == b"READY=1"
        t0 = time.monotonic()
        sent = [notify("WATCHDOG=1", env) for _ in range(2000)]  # nobody reads: the queue fills
        assert time.monotonic() - t0 < 5 and sent[0] and not sent[-1]
    assert not notify("READY=1", {})  # outside systemd: a no-op
    assert watchdog_interval({"WATCHDOG_USEC": "400000"}) == 0.2 and watchdog_interval({}) is None
