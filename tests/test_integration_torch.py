"""PatchApplier: a really trained model's steps applied in place to a bf16 copy, bit for bit,
and every refusal leaves the weights exactly as they were."""

from __future__ import annotations

import copy
import dataclasses
import mmap

import numpy as np
import pytest
import torch

import sparrowd.integrations.torch
from sparrowd.codec.bits import ulp_add
from sparrowd.codec.chunk import ABSOLUTE, ULP
from sparrowd.codec.patch import encode_patch
from sparrowd.errors import BaseMismatchError, FormatError, IntegrityError
from sparrowd.integrations.torch import PatchApplier, ulp_add_device
from tests.models import TinyLM, assert_serves, bf16_model, served_bits, train

pytestmark = pytest.mark.slow


def steps(n: int, seed: int = 0):
    """A model trained n AdamW steps: the bf16 bits served after each (index 0: the base)."""
    torch.manual_seed(seed)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    out = [served_bits(model)]
    for _ in range(n):
        train(model, opt)
        out.append(served_bits(model))
    return out


def patch(states, v, values=ULP):
    return encode_patch(states[v - 1], states[v], version=v, base_version=v - 1, values=values, chunk_size=4096)


@pytest.mark.parametrize("device_ulp", [False, True], ids=["host-ulp", "device-ulp"])
@pytest.mark.parametrize("values", [ULP, ABSOLUTE])
def test_each_trained_step_applies_in_place_bit_for_bit(values, device_ulp, monkeypatch):
    """device-ulp: ulp distances become bit patterns in torch, as on a GPU (here on the CPU)."""
    monkeypatch.setattr(sparrowd.integrations.torch, "_ulp_on_device", lambda bits: device_ulp)
    states = steps(3)
    model = bf16_model(states[0])
    storage = {k: t.data_ptr() for k, t in model.state_dict().items()}
    applier = PatchApplier(model, version=0)
    for v in (1, 2, 3):
        m, chunks = patch(states, v, values)
        stats = applier.apply(m, [c.data for c in chunks])
        assert applier.version == v and stats.elements == m.elements_changed > 0
        assert_serves(model, states[v])
    # In place: the parameters are the same storage the engine already uses.
    assert {k: t.data_ptr() for k, t in model.state_dict().items()} == storage


def test_versions_apply_strictly_in_order():
    states = steps(2)
    model = bf16_model(states[0])
    applier = PatchApplier(model, version=0)
    m2, c2 = patch(states, 2)
    with pytest.raises(BaseMismatchError, match="applies to 1, but these weights are version 0"):
        applier.apply(m2, [c.data for c in c2])
    assert_serves(model, states[0])


def test_an_anchor_of_the_same_tensors_loads_in_place_and_one_of_others_is_refused():
    states = steps(1)
    model = bf16_model(states[0])
    applier = PatchApplier(model, version=7)  # an anchor applies whatever the version held
    m, chunks = encode_patch({}, states[1], version=1, base_version=None)
    applier.apply(m, [c.data for c in chunks])
    assert applier.version == 1
    assert_serves(model, states[1])
    extra = dict(states[1])
    extra["extra.weight"] = states[1]["head.bias"]
    m, chunks = encode_patch({}, extra, version=2, base_version=None)
    with pytest.raises(BaseMismatchError, match="anchor 2 has other tensors than these weights"):
        applier.apply(m, [c.data for c in chunks])
    assert applier.version == 1


def test_weights_that_are_not_the_base_are_refused_untouched():
    states = steps(1)
    other = steps(1, seed=1)
    model = bf16_model(other[0])
    m, chunks = patch(states, 1)
    with pytest.raises(BaseMismatchError, match="fingerprint differs"):
        PatchApplier(model, version=0).apply(m, [c.data for c in chunks])
    assert_serves(model, other[0])


def test_a_corrupt_chunk_is_refused_before_any_weight_changes():
    states = steps(1)
    model = bf16_model(states[0])
    m, chunks = patch(states, 1)
    data = [c.data for c in chunks]
    data[-1] = data[-1][:-1] + bytes([data[-1][-1] ^ 1])
    with pytest.raises(IntegrityError, match="hash mismatch"):
        PatchApplier(model, version=0).apply(m, data)
    with pytest.raises(FormatError, match="fewer were given"):
        PatchApplier(model, version=0).apply(m, data[:-1])
    assert_serves(model, states[0])


def test_a_wrong_result_rolls_every_write_back():
    """The scatter happened, then the result's fingerprint disagrees: every overwritten value
    goes back, bit for bit, and the applier stays at the old version."""
    states = steps(1)
    model = bf16_model(states[0])
    m, chunks = patch(states, 1)
    last = m.tensors[-1]
    bad = dataclasses.replace(
        m, tensors=m.tensors[:-1] + (dataclasses.replace(last, result_fp=b"\0" * len(last.result_fp)),))
    applier = PatchApplier(model, version=0)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(IntegrityError, match="result fingerprint differs"):
        applier.apply(bad, [c.data for c in chunks])
    assert applier.version == 0
    for k, t in model.state_dict().items():
        assert torch.equal(t.view(torch.int16), before[k].view(torch.int16)), k
    applier.apply(m, [c.data for c in chunks])  # the real patch still applies
    assert_serves(model, states[1])


def test_a_tensor_of_another_shape_or_dtype_is_refused():
    states = steps(1)
    model = bf16_model(states[0]).to(torch.float32)
    m, chunks = patch(states, 1)
    with pytest.raises(BaseMismatchError, match="the weights hold torch.float32"):
        PatchApplier(model, version=0).apply(m, [c.data for c in chunks])


@pytest.mark.parametrize("values", [ULP, ABSOLUTE])
def test_a_decoded_patch_mapped_from_a_file_applies_the_same(tmp_path, values):
    """The daemon hands engines the decoded layout (sparrowd.decoded) in shared memory; mapped
    back, it applies exactly like the chunks."""
    from sparrowd.decoded import decode_patch, read_decoded, write_decoded

    states = steps(2)
    model = bf16_model(states[0])
    applier = PatchApplier(model, version=0)
    for v in (1, 2):
        m, chunks = patch(states, v, values)
        write_decoded(decode_patch(m, [c.data for c in chunks]), tmp_path / f"v{v}.safetensors")
        d = read_decoded(tmp_path / f"v{v}.safetensors")
        assert isinstance(d.keep, mmap.mmap) and d.elements == m.elements_changed
        applier.apply_decoded(d)
        assert_serves(model, states[v])


def test_a_decoded_file_with_positions_out_of_order_or_range_is_refused(tmp_path):
    """An engine maps what the daemon decoded: positions that do not rise strictly, or fall outside
    their tensor, are refused when it is read, before anything could be written."""
    from sparrowd.decoded import decode_patch, read_decoded, write_decoded

    states = steps(1)
    m, chunks = patch(states, 1)
    good = decode_patch(m, [c.data for c in chunks])
    w = max(good.writes, key=lambda w: w.indices.size)
    numel = next(t.numel for t in good.tensors if t.name == w.name)
    for what, indices in [("repeated", np.concatenate([w.indices[:1], w.indices[:-1]])),
                          ("swapped", w.indices[[1, 0, *range(2, w.indices.size)]]),
                          ("outside", np.concatenate([w.indices[:-1], [numel]]))]:
        bad = dataclasses.replace(good, writes=tuple(dataclasses.replace(x, indices=indices) if x is w else x
                                                     for x in good.writes))
        write_decoded(bad, tmp_path / f"{what}.safetensors")
        with pytest.raises(FormatError, match="positions must be sorted, distinct and inside it"):
            read_decoded(tmp_path / f"{what}.safetensors")
    write_decoded(good, tmp_path / "good.safetensors")
    assert read_decoded(tmp_path / "good.safetensors").elements == m.elements_changed
    # Handed to the applier directly (not read from the layout, so not known to rise), a position
    # outside its tensor is refused before any weight is touched, wherever it sits.
    model = bf16_model(states[0])
    inside = w.indices.copy()
    inside[inside.size // 2] = numel
    bad = dataclasses.replace(good, writes=[dataclasses.replace(x, indices=inside) if x is w else x
                                            for x in good.writes])
    with pytest.raises(FormatError, match="positions and values do not fit it"):
        PatchApplier(model, version=0).apply_decoded(bad)
    assert_serves(model, states[0])
    assert not good.ascending and read_decoded(tmp_path / "good.safetensors").ascending


def test_chunks_decoded_on_a_pool_are_the_patch_decoded_in_line(monkeypatch):
    """The daemon decodes an engine's patch on threads, chunk by chunk: the same writes as in line,
    however few chunks it keeps ahead; a corrupt or missing chunk is still refused."""
    from concurrent.futures import ThreadPoolExecutor

    import sparrowd.decoded
    from sparrowd.decoded import decode_patch

    states = steps(1)
    m, chunks = patch(states, 1)
    data = [c.data for c in chunks]
    assert len(data) > 4
    want = decode_patch(m, data)
    with ThreadPoolExecutor(3) as pool:
        for ahead in (1, 16):
            monkeypatch.setattr(sparrowd.decoded, "DECODE_AHEAD", ahead)
            got = decode_patch(m, iter(data), pool=pool)
            assert [w.name for w in got.writes] == [w.name for w in want.writes]
            for g, w in zip(got.writes, want.writes):
                assert np.array_equal(g.indices, w.indices) and np.array_equal(g.values, w.values) and g.ulp == w.ulp
        bad = list(data)
        bad[2] = bad[2][:-1] + bytes([bad[2][-1] ^ 1])
        with pytest.raises(IntegrityError):
            decode_patch(m, bad, pool=pool)
        with pytest.raises(FormatError, match="fewer were given"):
            decode_patch(m, data[:-1], pool=pool)


@pytest.mark.parametrize("width", [16, 32])
def test_ulp_distances_become_the_same_bits_in_torch_as_in_numpy(width):
    """ulp_add_device (a GPU's way) against codec.bits.ulp_add, bit for bit: random patterns and
    distances, and the edges: both zeros, the largest magnitudes, NaN patterns, steps across zero
    and keys that wrap around."""
    u, s = (np.uint16, np.int16) if width == 16 else (np.uint32, np.int32)
    top = 1 << (width - 1)
    rng = np.random.default_rng(width)
    edges = np.array([0, 1, top - 1, top, top + 1, (1 << width) - 1, (0x7F80 if width == 16 else 0x7F800000) + 1],
                     dtype=u)
    old = np.concatenate([rng.integers(0, 1 << width, 200_000, dtype=np.uint64).astype(u), np.repeat(edges, 7)])
    d = np.concatenate([rng.integers(-40, 41, 200_000).astype(s),
                        np.tile(np.array([0, 1, -1, 2, -2, top - 1, -top], s), edges.size)])
    want = ulp_add(old, d)
    got = ulp_add_device(torch.from_numpy(old.view(s)), torch.from_numpy(d))
    assert got.dtype == (torch.int16 if width == 16 else torch.int32)
    assert np.array_equal(got.numpy().view(u), want)
