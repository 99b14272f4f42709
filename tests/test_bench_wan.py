"""The benchmark's WAN emulator really adds the round trip between regions, and only between them."""

import asyncio
import socket
import time

import pytest

from sparrowd.bench.wan import Wan, region_of


def test_region_of_reads_the_loopback_block():
    assert region_of("127.10.0.1") == 0 and region_of("127.13.1.7") == 3
    assert region_of("127.0.0.1") is None and region_of("::1") is None and region_of("nope") is None


RTT = 0.5  # long enough that a loaded machine's delays (tenths of a second) cannot pass for a round trip


def _port(host):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@pytest.mark.slow  # real sockets timed against the wall clock
@pytest.mark.asyncio
async def test_proxy_adds_rtt_across_regions_only_and_a_handshake_to_new_connections():
    target = ("127.10.0.1", _port("127.10.0.1"))
    server = await asyncio.start_server(_echo, *target)
    wan = Wan(rtt=RTT, link_rate=0)
    listen = ("127.10.1.1", _port("127.10.1.1"))
    proxy = await wan.serve(listen, target, region=0)

    try:
        # region 1 -> region 0: a new connection's first exchange pays the handshake's round trip too
        first, second = await _round_trips(listen, "127.11.0.9")
        assert first >= 2 * RTT - 0.01 and RTT - 0.01 <= second < 1.8 * RTT, (first, second)
        assert max(await _round_trips(listen, "127.10.0.9")) < 0.5 * RTT  # inside region 0: as it is
    finally:
        proxy.close()
        server.close()


async def _round_trips(listen, source: str) -> tuple[float, float]:
    """Two pings on one new connection from ``source``: the seconds each took, the first counted from
    the connect."""
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection(*listen, local_addr=(source, 0))
    took = []
    for _ in range(2):
        writer.write(b"ping")
        await writer.drain()
        assert await reader.readexactly(4) == b"ping"
        took.append(time.monotonic() - t0)
        t0 = time.monotonic()
    writer.close()
    return took[0], took[1]


async def _echo(reader, writer):
    while data := await reader.read(1024):
        writer.write(data)
        await writer.drain()
    writer.close()


@pytest.mark.slow  # real sockets timed against the wall clock
@pytest.mark.asyncio
async def test_without_the_handshake_a_new_connection_pays_one_round_trip():
    target = ("127.12.0.1", _port("127.12.0.1"))
    server = await asyncio.start_server(_echo, *target)
    wan = Wan(rtt=RTT, link_rate=0, handshake=False)
    listen = ("127.12.1.1", _port("127.12.1.1"))
    proxy = await wan.serve(listen, target, region=2)
    try:
        first, second = await _round_trips(listen, "127.11.0.9")
        assert RTT - 0.01 <= first < 1.8 * RTT and RTT - 0.01 <= second < 1.8 * RTT, (first, second)
    finally:
        proxy.close()
        server.close()
