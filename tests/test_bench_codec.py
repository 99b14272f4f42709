"""The entropy bounds ``sparrowd bench codec`` prints beside the codec: the bound of a coder that
knows the previous patch falls when the previous patch tells something, and only then."""

import numpy as np
import pytest

from sparrowd.bench.codec import _baselines
from sparrowd.codec import RawTensor
from sparrowd.codec.bits import ulp_add
from tests.helpers import sparrowd

N = 1 << 17


def _step(bits: np.ndarray, where: np.ndarray, signs: np.ndarray) -> np.ndarray:
    out = bits.copy()
    out[where] = ulp_add(bits[where], signs)
    return out


def _snap(bits: np.ndarray) -> dict[str, RawTensor]:
    return {"w": RawTensor("BF16", (bits.size,), bits)}


def test_the_previous_patch_lowers_the_bound_only_when_it_predicts():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(N).astype(np.float32) * 0.02).view(np.uint32)
    base = ((w + 0x7FFF + ((w >> 16) & 1)) >> 16).astype(np.uint16)  # bf16, rounded to nearest even
    where = np.sort(rng.choice(N, N // 100, replace=False))
    signs = np.where(rng.random(where.size) < 0.5, 1, -1).astype(np.int16)
    one = _step(base, where, signs)

    repeat = _baselines(_snap(one), _snap(_step(one, where, signs)), prev=_snap(base))
    assert repeat["bound_prev_bits"] < 0.05 * (repeat["index_entropy_exp_bits"] + repeat["value_entropy_class_bits"])

    elsewhere = np.sort(rng.choice(N, N // 100, replace=False))
    fresh_signs = np.where(rng.random(elsewhere.size) < 0.5, 1, -1).astype(np.int16)
    fresh = _baselines(_snap(one), _snap(_step(one, elsewhere, fresh_signs)), prev=_snap(base))
    plain = fresh["index_entropy_exp_bits"] + fresh["value_entropy_class_bits"]
    assert 0.9 * plain < fresh["bound_prev_bits"] <= plain * 1.02
    assert _baselines(_snap(one), _snap(_step(one, elsewhere, fresh_signs)))["bound_prev_bits"] is None


@pytest.mark.parametrize("bad, says", [(("--steps", "0"), "--steps 0: give 1 or more"),
                                       (("--size-mib", "0"), "--size-mib 0: give 1 or more"),
                                       (("--lr", "-1"), "--lr -1.0: give a number above 0"),
                                       (("--lr", "nan"), "--lr nan: give a number above 0")])
def test_the_command_refuses_bad_input_in_one_line_before_training(tmp_path, bad, says):
    r = sparrowd("bench", "codec", *bad, cwd=tmp_path, timeout=60)
    assert r.returncode != 0 and r.stderr.strip().splitlines() == [f"sparrowd: error: {says}"], r.stderr
    assert not r.stdout
