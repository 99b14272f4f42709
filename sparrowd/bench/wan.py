"""A WAN emulator for the swarm benchmark: TCP proxies that add round-trip time and shape links.

The kernel here has no netem, so delay is added in user space. Every region
gets its own loopback block, ``127.(10+r).0.0/16``: node ``j`` of region ``r``
listens on ``127.(10+r).0.(j+1)`` and makes its outgoing connections from
there too (the daemon binds outgoing connections to its listen address), and
a proxy for it listens on ``127.(10+r).1.(j+1)``, the address it advertises.
The proxy tells the caller's region from the caller's source address: inside
a region it forwards as it is; across regions it holds every piece of data
for half the round-trip time in each direction and paces it through a token
bucket shared by every connection on that ordered pair of regions (the link).
A new connection across regions also pays TCP's handshake: what the caller
sends reaches the other side no sooner than a round trip and a half after
it connected (SYN, SYN-ACK, then its first bytes), as on a real WAN, where a
proxy on loopback would let them through half a round trip after connecting
(``handshake``, default true; TCP's slow start is not emulated).

Run as ``python -m sparrowd.bench.wan CONFIG.json``, where the config lists
``proxies`` (``listen`` and ``target`` as ``[host, port]``, and ``region``),
``rtt`` (seconds between regions) and ``link_rate`` (bytes per second per
ordered region pair; 0 for none), optionally ``handshake`` (false: a new
connection's first bytes go at once, as before 2026-11-26), ``blocked``: pairs of regions
between which no connection is let through (``bench rl``'s star: nodes reach
the trainer's region and no other), and optionally ``cut_file``: a file holding
a JSON list of regions cut off from the others. While a region is listed, no
connection crosses into or out of it (new ones are closed at once, open ones
are dropped): its traffic is lost, as when a cloud region's links fail. It
runs until killed.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import sys
import time

from ..swarm.bucket import TokenBucket

PIECE = 64 << 10
QUEUE = 64  # pieces held per direction: bounds the bytes in flight, like a TCP window


def region_of(host: str) -> int | None:
    """The region of a benchmark address (127.(10+r).x.y), or None for anything else."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    b = ip.packed
    return b[1] - 10 if ip.version == 4 and b[0] == 127 and b[1] >= 10 else None


class Wan:
    def __init__(self, rtt: float, link_rate: float, blocked=(), handshake: bool = True):
        self.rtt, self.link_rate, self.handshake = rtt, link_rate, handshake
        self.blocked = {frozenset(map(int, pair)) for pair in blocked}
        self.links: dict[tuple[int, int], TokenBucket] = {}
        self.cut: set[int] = set()
        self.crossing: dict[asyncio.Task, tuple[int, int]] = {}  # open cross-region connections

    def _severed(self, src: int, dst: int) -> bool:
        return src != dst and (src in self.cut or dst in self.cut or frozenset((src, dst)) in self.blocked)

    async def watch_cuts(self, path: str) -> None:
        while True:
            try:
                cut = {int(r) for r in json.loads(open(path).read() or "[]")}
            except (OSError, ValueError):
                cut = set()
            if cut != self.cut:
                self.cut = cut
                for task, (src, dst) in list(self.crossing.items()):
                    if self._severed(src, dst):
                        task.cancel()
            await asyncio.sleep(0.1)

    def link(self, src: int, dst: int) -> TokenBucket:
        b = self.links.get((src, dst))
        if b is None:
            b = self.links[(src, dst)] = TokenBucket(self.link_rate or None)
        return b

    async def pipe(self, reader, writer, delay: float, bucket: TokenBucket | None, not_before: float = 0.0) -> None:
        """Forward ``reader`` to ``writer``, each piece ``delay`` seconds after it came and no sooner than
        ``not_before`` (monotonic), paced by ``bucket``."""
        queue: asyncio.Queue = asyncio.Queue(QUEUE)

        async def pull():
            while data := await reader.read(PIECE):
                await queue.put((max(time.monotonic() + delay, not_before), data))
            await queue.put((0.0, b""))

        async def push():
            while True:
                due, data = await queue.get()
                if not data:
                    break
                wait = due - time.monotonic()
                if bucket is not None:
                    wait = max(wait, bucket.take(time.monotonic(), len(data)))
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        try:
            await asyncio.gather(pull(), push())
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def serve(self, listen: tuple[str, int], target: tuple[str, int], region: int):
        async def handle(reader, writer):
            opened = time.monotonic()
            src = region_of(writer.get_extra_info("peername")[0])
            if src is not None and self._severed(src, region):
                writer.close()
                return
            try:
                up_reader, up_writer = await asyncio.open_connection(*target)
            except OSError:
                writer.close()
                return
            if src is None or src == region:
                delay, there, back, first = 0.0, None, None, 0.0
            else:
                delay, there, back = self.rtt / 2, self.link(src, region), self.link(region, src)
                first = opened + self.rtt + delay if self.handshake else 0.0  # the handshake's round trip first
            task = asyncio.current_task()
            if src is not None and src != region:
                self.crossing[task] = (src, region)
            try:
                await asyncio.gather(self.pipe(reader, up_writer, delay, there, first),
                                     self.pipe(up_reader, writer, delay, back))
            except asyncio.CancelledError:  # cut: drop both sides
                for w in (writer, up_writer):
                    w.transport.abort()
            finally:
                self.crossing.pop(task, None)

        return await asyncio.start_server(handle, *listen)


async def _main(config: dict) -> None:
    wan = Wan(float(config["rtt"]), float(config.get("link_rate") or 0), config.get("blocked") or (),
              bool(config.get("handshake", True)))
    servers = [await wan.serve(tuple(p["listen"]), tuple(p["target"]), int(p["region"])) for p in config["proxies"]]
    extra = [wan.watch_cuts(config["cut_file"])] if config.get("cut_file") else []
    print("ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers), *extra)


if __name__ == "__main__":
    import uvloop

    try:
        uvloop.run(_main(json.loads(open(sys.argv[1]).read())))
    except KeyboardInterrupt:
        pass
