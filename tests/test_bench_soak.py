"""The soak (``python bench/soak.py``), small: real daemons, one killed with SIGKILL and restarted
mid-run, every version reaching every live node and every stored chunk checked against its manifest."""

from __future__ import annotations

import json

import pytest

from tests.helpers import bench_script


@pytest.mark.slow
def test_a_short_soak_kills_and_restarts_a_node_and_every_version_arrives(tmp_path):
    out = tmp_path / "soak.json"
    r = bench_script("soak", "--nodes", "3", "--regions", "1", "--versions", "3", "--kill-every", "2",
                     "--json", out, timeout=280)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert [r["version"] for r in doc["versions"]] == [1, 2, 3] and doc["killed"] == 1
    assert all(r["seconds_to_all"] > 0 for r in doc["versions"])
    assert [s["at"] for s in doc["samples"]] == ["start", "middle", "end"]
    # it says it is starting before the daemons' start-up, and when they have joined
    assert r.stdout.index("starting the daemons") < r.stdout.index("all 3 joined")


@pytest.mark.parametrize("args, says", [
    (["--regions", "0"], "--regions 0: give 1 or more"),
    (["--kill-every", "0"], "--kill-every 0: give 1 or more"),
    (["--versions", "0"], "--versions 0: give 1 or more"),
    (["--patch-kib", "0"], "--patch-kib 0: give 1 or more"),
    (["--nodes", "1"], "--nodes 1: give 2 or more"),
])
def test_bad_input_is_one_line_before_anything_starts(tmp_path, args, says):
    r = bench_script("soak", *args, cwd=tmp_path, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and lines == [f"bench/soak.py: error: {says}"], r.stderr
    assert not r.stdout and not any(tmp_path.iterdir())


def test_a_json_file_that_cannot_be_written_is_refused_before_the_run(tmp_path):
    r = bench_script("soak", "--json", tmp_path / "nowhere" / "f.json", timeout=60)
    assert r.returncode == 2 and "nowhere does not exist" in r.stderr.strip().splitlines()[-1], r.stderr
