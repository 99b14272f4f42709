"""``sparrowd bench publish`` runs both of its paths end to end, on a small model, and its
figures are what its own counters say (the torch path is the GPU's code, run on the CPU)."""

import json

import pytest

torch = pytest.importorskip("torch")

from sparrowd.bench.publish import run  # noqa: E402
from sparrowd.errors import InputError  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("compare", ["auto", "torch"])
def test_bench_publish_reports_its_target_against_a_baseline(tmp_path, capsys, compare):
    out = tmp_path / "publish.json"
    assert run(size_mib=128, steps=2, compare=compare, json_path=str(out)) == 0
    printed = capsys.readouterr().out
    figures = json.loads(out.read_text())
    assert figures["model_bytes"] == 128 << 20 and len(figures["steps"]) == 2
    for row in figures["steps"]:
        assert row["elements_changed"] > 0.009 * (64 << 20) and row["chunks"] >= 1
        assert 0 < row["first_chunk_seconds"] <= row["total_seconds"]
    if compare == "auto":
        assert figures["copy_seconds"] is None
        for row in figures["steps"]:
            assert row["publish_over_compare"] == pytest.approx(row["total_seconds"] / row["compare_only_seconds"])
        assert "publish / compare-only (worst step)" in printed
    else:
        for row in figures["steps"]:
            extract = row["compare_seconds"] + row["to_host_seconds"]
            assert row["extract_gb_per_s"] == pytest.approx((128 << 20) / extract / 1e9)
            assert row["extract_over_copy"] == pytest.approx(row["extract_gb_per_s"] / row["copy_gb_per_s"])
        assert "compare-and-extract / copy bandwidth (worst step)" in printed
    assert ("PASS" in printed) != ("MISS" in printed)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_bench_publish_refuses_a_device_torch_does_not_see():
    with pytest.raises(InputError, match="no CUDA device"):
        run(size_mib=64, steps=1, device="cuda")


def test_bench_publish_refuses_a_device_name_torch_does_not_know():
    with pytest.raises(InputError, match="device 'nonsense'"):
        run(size_mib=64, steps=1, device="nonsense")


@pytest.mark.parametrize("bad, says", [
    (("publish", "--size-mib", "-5", "--steps", "0"), "--size-mib -5: give 1 or more"),
    (("apply", "--size-mib", "0", "--steps", "0"), "--size-mib 0: give 1 or more"),
    (("apply", "--steps", "0"), "--steps 0: give 1 or more"),
    (("serve", "--steps", "-1"), "--steps -1: give 1 or more"),
])
def test_the_sized_benchmarks_refuse_a_size_or_steps_below_1_in_one_line(tmp_path, bad, says):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "sparrowd.cli.main", "bench", *bad], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert r.returncode != 0 and r.stderr.strip().splitlines() == [f"sparrowd: error: {says}"], r.stderr
    assert not r.stdout and not any(tmp_path.iterdir())


def test_a_json_file_that_cannot_be_written_is_refused_before_the_run(tmp_path):
    import subprocess
    import sys
    for bench in ("codec", "publish", "swarm", "apply"):
        r = subprocess.run([sys.executable, "-m", "sparrowd.cli.main", "bench", bench, "--json",
                            str(tmp_path / "nowhere" / "f.json")], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "nowhere does not exist" in r.stderr.strip().splitlines()[-1], (bench, r.stderr)
    r = subprocess.run([sys.executable, "-m", "sparrowd.cli.main", "bench", "codec", "--json", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "is a folder" in r.stderr, r.stderr
