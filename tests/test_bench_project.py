"""``python bench/project.py``: the step-time model is what its docstring says, and the script checks input."""

import json

import pytest

from tests.helpers import bench_module, bench_script

_project = bench_module("project")
MODELS, Assumptions, project = _project.MODELS, _project.Assumptions, _project.project


def test_off_policy_overlaps_the_transfer_and_on_policy_adds_it():
    a = Assumptions(generate_seconds=10, train_seconds=5)
    for r in project(a):
        work = 15
        # Off-policy: the transfer overlaps generation + training; a patch adds the trainer's diff+encode.
        encode = 2 * r.params * 8 / (a.encode_gbps * 1e9)
        assert r.step["swarm"] == pytest.approx(encode + max(work, r.transfer["swarm"]))
        assert r.step["full"] == pytest.approx(max(work, r.transfer["full"]))  # full has no codec step
        assert r.step["full"] > r.step["swarm"] >= r.step["ideal"]
    on = project(Assumptions(generate_seconds=10, train_seconds=5, on_policy=True))
    for r in on:
        assert r.step["full"] == pytest.approx(15 + r.transfer["full"])


def test_a_patch_costs_the_rollout_its_decode_of_the_dense_model_and_the_scatter_of_the_changes():
    """Decode is rated like the codec benchmark rates it, in bytes of the dense model per second;
    the scatter in changed elements per second; both after the patch's transfer."""
    a = Assumptions(remote_regions=1, nodes_per_region=1, wan_gbps=8, decode_gbps=8, apply_elements_per_s=1e7,
                    rtt=0.1)
    [r] = project(a, {"m": 1e9})
    patch_s = r.patch_bytes * 8 / 8e9
    assert r.transfer["star"] == pytest.approx(patch_s + 0.1 + 2e9 * 8 / 8e9 + 0.01 * 1e9 / 1e7)


def test_the_patch_and_the_full_copy_scale_as_stated():
    a = Assumptions(remote_regions=2, wan_gbps=1, lan_gbps=10, load_gbps=1e12)
    [r] = project(a, {"m": 1e9})
    assert r.patch_bytes == pytest.approx(0.01 * 1e9 * a.bits_per_changed / 8)
    # Two remote regions over the WAN, then the region's LAN: 2 GB each time.
    assert r.transfer["full"] == pytest.approx(2 * 16 + 1.6, rel=1e-6)
    # Bigger models gain more over full broadcast (the transfer grows, the work per step does not).
    rows = project(Assumptions(), MODELS)
    assert [r.speedup_vs_full for r in rows] == sorted(r.speedup_vs_full for r in rows)
    assert all(r.gap_to_ideal > 0 for r in rows)


def test_the_command_prints_the_table_and_refuses_bad_input(tmp_path):
    out = tmp_path / "p.json"
    r = bench_script("project", "--generate-seconds", "20", "--json", out, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "Qwen3-8B" in r.stdout and "SparrowRL reports 2.4-9.5x" in r.stdout
    figures = json.loads(out.read_text())
    assert figures["assumptions"]["generate_seconds"] == 20 and len(figures["rows"]) == 3
    r = bench_script("project", "--wan-gbps", "0", timeout=60)
    says = "bench/project.py: error: --wan-gbps must be positive (density at most 1)"
    assert r.returncode != 0 and r.stderr.strip() == says


@pytest.mark.parametrize("bad", [("--wan-gbps", "nan"), ("--train-seconds", "inf"), ("--density", "nan"),
                                 ("--density", "1.5"), ("--nodes-per-region", "0")])
def test_non_finite_and_out_of_range_assumptions_are_one_line(tmp_path, bad):
    r = bench_script("project", *bad, cwd=tmp_path, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"bench/project.py: error: {bad[0]} must be"), r.stderr
    assert not r.stdout and "Traceback" not in r.stderr
