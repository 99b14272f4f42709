"""systemd's notify protocol (``Type=notify``): a datagram to $NOTIFY_SOCKET.

No dependency needed: the protocol is one ``sendto``. Outside systemd (no
NOTIFY_SOCKET) every call is a no-op that returns False. The send never
blocks: it runs on the daemon's event loop, and a reader that stopped reading
(the socket's queue full) must not freeze the daemon; the message is dropped
and the call returns False (systemd reads at once; a lost watchdog ping is
followed by another within half the watchdog interval).
"""

from __future__ import annotations

import os
import socket

__all__ = ["notify", "watchdog_interval"]


def notify(state: str, env=os.environ) -> bool:
    """Send e.g. ``READY=1``, ``STOPPING=1``, ``STATUS=...``, ``WATCHDOG=1``."""
    path = env.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):  # abstract namespace
        path = "\0" + path[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK) as s:
            s.sendto(state.encode(), path)
        return True
    except OSError:  # BlockingIOError included: the reader's queue is full
        return False


def watchdog_interval(env=os.environ) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WatchdogSec), when the watchdog is on for us."""
    usec = env.get("WATCHDOG_USEC")
    pid = env.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None
