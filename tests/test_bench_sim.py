"""``sparrowd bench sim``: the real picker, choker, super-seeding and lease table on a virtual clock."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sparrowd.bench.sim import MB, Config, Sim, simulate


def test_sixteen_nodes_get_every_version_near_the_bound_and_the_same_run_twice():
    cfg = Config(nodes=16, regions=4, patch=6 * MB, versions=2, seed=1)
    rows = simulate(cfg)
    assert [r["version"] for r in rows] == [1, 2]
    for r in rows:
        assert r["all_done"] and r["nodes"] == 16 and r["chunks"] == 16
        assert r["seconds"] >= cfg.bound  # nothing beats the trainer's uplink
        assert r["time_over_bound"] < 2.0, r
        assert r["trainer_upload_over_patch"] <= 1.1, r  # super-seeding: one copy, then the peers trade
        assert 1.0 <= r["cross_region_over_r_minus_1"] <= 1.6, r
    assert simulate(cfg) == rows  # a seed fixes the run


def test_star_is_what_the_swarm_beats():
    """The same link model with one node per region-free swarm: a single node can only be as fast as
    the trainer's uplink (the bound); sixteen get their copies far faster than sixteen sent by the trainer."""
    one = simulate(Config(nodes=1, regions=1, patch=2 * MB, versions=1))[0]
    assert one["all_done"] and 1.0 <= one["time_over_bound"] < 1.3
    many = simulate(Config(nodes=16, regions=4, patch=2 * MB, versions=1))[0]
    star = 16 * 2 * MB / Config().trainer_rate
    assert many["seconds"] < star / 4


def test_regions_larger_than_a_peer_list_are_reached_and_cross_once():
    """200 nodes in 2 regions: each region is larger than a peer list shows of it. Lists filled
    region-first left the trainer's other region with nobody to fetch from (nothing arrived); with
    gateways named by the tracker each chunk crosses about once."""
    sim = Sim(Config(nodes=200, regions=2, patch=1 * MB, versions=1, seed=2))
    assert all(len(n.gateways) == 8 for n in sim.nodes[1:])
    r = sim.run()[0]
    assert r["all_done"], r
    assert r["cross_region_over_r_minus_1"] < 1.25, r
    assert r["trainer_upload_over_patch"] <= 1.1, r


def test_nodes_leaving_mid_version_do_not_stop_the_rest():
    r = simulate(Config(nodes=40, regions=4, patch=6 * MB, versions=1, churn=0.1, churn_at=0.5, seed=3))[0]
    assert r["left"] == 4 and r["nodes"] == 36
    assert r["all_done"], r
    assert r["time_over_bound"] < 4.0, r


def _cli(*args, tmp_path):
    return subprocess.run([sys.executable, "-m", "sparrowd_cli.main", "bench", "sim", *args],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)


@pytest.mark.parametrize("bad", [["--nodes", "x"], ["--nodes", "0"], ["--churn", "1.5"], ["--trainer-rate", "0"]])
def test_cli_refuses_bad_input_in_one_line(tmp_path, bad):
    p = _cli(*bad, tmp_path=tmp_path)
    assert p.returncode != 0
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


def test_cli_prints_writes_json_and_a_plot(tmp_path):
    out, svg = tmp_path / "sim.json", tmp_path / "sim.svg"
    p = _cli("--nodes", "4,8", "--regions", "2", "--patch-mib", "1", "--versions", "1", "--json", str(out),
             "--plot", str(svg), tmp_path=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "x the bound" in p.stdout and "star" in p.stdout
    runs = json.loads(out.read_text())["runs"]
    assert [r["rollouts"] for r in runs] == [4, 8] and all(r["all_done"] for r in runs)
    assert svg.read_text().startswith("<svg") and svg.read_text().count("<circle") == 2
