"""How patches are cut into chunks by default."""

from sparrowd.codec.patch import DEFAULT_CHUNK_SIZE, auto_chunk_size


def test_a_patch_is_cut_into_about_sixteen_chunks_between_256_kib_and_2_mib():
    assert auto_chunk_size(6 << 20) == 384 << 10  # a few MiB: 16 chunks, so relaying pipelines
    assert auto_chunk_size(64 << 20) == DEFAULT_CHUNK_SIZE == 2 << 20  # large: requests stay few
    assert auto_chunk_size(1 << 20) == auto_chunk_size(0) == 256 << 10  # tiny: one or a few chunks
    sizes = [auto_chunk_size(n) for n in range(0, 64 << 20, 777_777)]
    assert sizes == sorted(sizes) and all(s % 4096 == 0 for s in sizes)
