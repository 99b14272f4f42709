"""The benchmark's WAN emulator really adds the round trip between regions, and only between them."""

import asyncio
import socket
import time

import pytest

from sparrowd.bench.wan import Wan, region_of


def test_region_of_reads_the_loopback_block():
    assert region_of("127.10.0.1") == 0 and region_of("127.13.1.7") == 3
    assert region_of("127.0.0.1") is None and region_of("::1") is None and region_of("nope") is None


def _port(host):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@pytest.mark.asyncio
async def test_proxy_adds_rtt_across_regions_only():
    async def echo(reader, writer):
        while data := await reader.read(1024):
            writer.write(data)
            await writer.drain()
        writer.close()

    target = ("127.10.0.1", _port("127.10.0.1"))
    server = await asyncio.start_server(echo, *target)
    wan = Wan(rtt=0.2, link_rate=0)
    listen = ("127.10.1.1", _port("127.10.1.1"))
    proxy = await wan.serve(listen, target, region=0)

    async def round_trip(source: str) -> float:
        reader, writer = await asyncio.open_connection(*listen, local_addr=(source, 0))
        t0 = time.monotonic()
        writer.write(b"ping")
        await writer.drain()
        assert await reader.readexactly(4) == b"ping"
        took = time.monotonic() - t0
        writer.close()
        return took

    try:
        assert await round_trip("127.11.0.9") >= 0.19  # region 1 -> region 0: one RTT
        assert await round_trip("127.10.0.9") < 0.05  # inside region 0: as it is
    finally:
        proxy.close()
        server.close()
