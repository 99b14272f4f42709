"""How patches are cut into chunks by default."""

from sparrowd.codec.patch import DEFAULT_CHUNK_SIZE, LARGE_SWARM, auto_chunk_size


def test_a_patch_is_cut_into_about_sixteen_chunks_between_256_kib_and_2_mib():
    assert auto_chunk_size(6 << 20) == 384 << 10  # a few MiB: 16 chunks, so relaying pipelines
    assert auto_chunk_size(64 << 20) == DEFAULT_CHUNK_SIZE == 2 << 20  # large: requests stay few
    assert auto_chunk_size(1 << 20) == auto_chunk_size(0) == 256 << 10  # tiny: one or a few chunks
    sizes = [auto_chunk_size(n) for n in range(0, 64 << 20, 777_777)]
    assert sizes == sorted(sizes) and all(s % 4096 == 0 for s in sizes)


def test_a_swarm_of_more_than_16_rollouts_gets_chunks_half_as_large_from_128_kib():
    """The last chunk to leave the trainer must still spread through regions of many nodes, a few
    relays deep, each hop in time proportional to the chunk (``bench sim``: 2 MiB to 1,000 nodes
    1.31-1.35x the bound in 256 KiB chunks, 1.18-1.19x in 128 KiB)."""
    for n in (None, 1, 16, LARGE_SWARM):
        assert auto_chunk_size(2 << 20, n) == auto_chunk_size(2 << 20) == 256 << 10  # as before
    assert auto_chunk_size(2 << 20, LARGE_SWARM + 1) == auto_chunk_size(2 << 20, 10_000) == 128 << 10
    assert auto_chunk_size(6 << 20, 1000) == 192 << 10  # 32 chunks
    assert auto_chunk_size(0, 1000) == auto_chunk_size(256 << 10, 1000) == 256 << 10  # one chunk stays one
    assert auto_chunk_size((256 << 10) + 1, 1000) == 128 << 10  # the floor
    assert auto_chunk_size(64 << 20, 1000) == DEFAULT_CHUNK_SIZE  # the ceiling stays
    sizes = [auto_chunk_size(n, 1000) for n in range((256 << 10) + 1, 64 << 20, 777_777)]
    assert sizes == sorted(sizes) and all(s % 4096 == 0 for s in sizes)
