"""How patches are cut into chunks by default."""

import math

from sparrowd.codec.patch import (
    DEFAULT_CHUNK_SIZE,
    LARGE_SWARM,
    MAX_ONE_CHUNK,
    ONE_CHUNK_BYTES,
    auto_chunk_size,
    one_chunk_size,
)

MB = 1 << 20


def _chunks(n: int, size: int) -> int:
    return max(1, math.ceil(n / size))


def test_a_patch_is_cut_into_about_sixteen_chunks_between_256_kib_and_2_mib():
    assert auto_chunk_size(6 << 20) == 384 << 10  # a few MiB: 16 chunks, so relaying pipelines
    assert auto_chunk_size(64 << 20) == DEFAULT_CHUNK_SIZE == 2 << 20  # large: requests stay few
    assert auto_chunk_size((1 << 20) + 1) == 256 << 10  # a little more than one chunk's worth: a few
    counts = [_chunks(n, auto_chunk_size(n)) for n in range(0, 64 << 20, 777_777)]
    assert counts == sorted(counts) and counts[0] == 1 and max(counts) <= 32
    assert all(auto_chunk_size(n) % 4096 == 0 for n in range(0, 64 << 20, 777_777))


def test_a_patch_the_trainer_sends_in_four_round_trips_goes_as_one_chunk():
    """One chunk crosses in stripes from its first block and is relayed block by block; cut in a few,
    the chunks leave the trainer side by side at a fraction of its rate (``bench sim``: 0.5 MiB to 8
    nodes in 8 regions 1.10x the bound whole, 1.32x in two chunks)."""
    default = dict(send_rate=4 * MB, round_trip=0.08)  # the WAN emulator's trainer: 1.28 MiB in 4 round trips
    assert one_chunk_size(**default) == 1308 << 10
    for n in (0, 1, 256 << 10, 512 << 10, MB, 1308 << 10):
        assert auto_chunk_size(n, **default) == 1308 << 10  # whole, with room for a patch that grew
        assert auto_chunk_size(n, 10_000, **default) == 1308 << 10  # whatever the swarm's size
    assert auto_chunk_size((1308 << 10) + 1, **default) == 256 << 10  # beyond: cut as before
    assert auto_chunk_size(2 * MB, 100, **default) == 128 << 10
    # A slower uplink sends less in 4 round trips: 0.5 MiB at 1 MiB/s is cut in two, as before.
    assert auto_chunk_size(MB // 2, send_rate=MB, round_trip=0.08) == 256 << 10
    # Links 25 times faster send 8 MiB in one round trip: whole, up to MAX_ONE_CHUNK.
    fast = dict(send_rate=100 * MB, round_trip=0.08)
    assert auto_chunk_size(8 * MB, 16, **fast) == MAX_ONE_CHUNK == 16 * MB
    assert auto_chunk_size(16 * MB + 1, 16, **fast) == DEFAULT_CHUNK_SIZE // 2
    # A round trip of none (loopback) leaves the cut as it was; where the uplink (unlimited) or the
    # round trip (one region, or no rollout measured one yet) is unknown, 1 MiB goes whole.
    assert auto_chunk_size(MB, send_rate=4 * MB, round_trip=0.0) == 256 << 10
    for rate, rtt in ((None, 0.08), (4 * MB, None), (0, 0.08), (None, None), (0, 0.0)):
        assert one_chunk_size(rate, rtt) == ONE_CHUNK_BYTES == MB
        assert auto_chunk_size(MB, send_rate=rate, round_trip=rtt) == MB
        assert auto_chunk_size(MB + 1, send_rate=rate, round_trip=rtt) == 256 << 10


def test_a_swarm_of_more_than_16_rollouts_gets_chunks_half_as_large_from_128_kib():
    """The last chunk to leave the trainer must still spread through regions of many nodes, a few
    relays deep, each hop in time proportional to the chunk (``bench sim``: 2 MiB to 1,000 nodes
    1.31-1.35x the bound in 256 KiB chunks, 1.18-1.19x in 128 KiB)."""
    for n in (None, 1, 16, LARGE_SWARM):
        assert auto_chunk_size(2 << 20, n) == auto_chunk_size(2 << 20) == 256 << 10  # as before
    assert auto_chunk_size(2 << 20, LARGE_SWARM + 1) == auto_chunk_size(2 << 20, 10_000) == 128 << 10
    assert auto_chunk_size(6 << 20, 1000) == 192 << 10  # 32 chunks
    assert auto_chunk_size(0, 1000) == auto_chunk_size(MB, 1000) == MB  # one chunk stays one
    assert auto_chunk_size(MB + 1, 1000) == 128 << 10  # the floor
    assert auto_chunk_size(64 << 20, 1000) == DEFAULT_CHUNK_SIZE  # the ceiling stays
    slow = dict(send_rate=MB // 2, round_trip=0.08)  # sends 160 KiB in 4 round trips: a chunk is 256 KiB
    assert auto_chunk_size(0, 1000, **slow) == auto_chunk_size(256 << 10, 1000, **slow) == 256 << 10
    assert auto_chunk_size((256 << 10) + 1, 1000, **slow) == 128 << 10
    sizes = [auto_chunk_size(n, 1000) for n in range(MB + 1, 64 << 20, 777_777)]
    assert sizes == sorted(sizes) and all(s % 4096 == 0 for s in sizes)
