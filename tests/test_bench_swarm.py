"""``sparrowd bench swarm`` from the command line: bad input refused before anything starts, and
small runs that report what they measured (real daemons on loopback)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def _cli(*args, tmp_path, timeout=60):
    return subprocess.run([sys.executable, "-m", "sparrowd.cli.main", "bench", "swarm", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=tmp_path)


@pytest.mark.parametrize("bad, says", [
    (["--interval", "-1"], "--interval -1"),
    (["--settle", "-1"], "--settle -1"),
    (["--nodes", "0"], "--nodes 0"),
    (["--patch-mib", "0"], "--patch-mib 0"),
    (["--regions", "0"], "--regions 0"),
    (["--versions", "0"], "--versions 0"),
    (["--rtt", "-0.5"], "--rtt -0.5"),
    (["--rtt", "nan"], "--rtt nan"),
    (["--patch-mib", "nan"], "--patch-mib nan"),
    (["--interval", "inf"], "--interval inf"),
    (["--rate-burst", "-0.1"], "--rate-burst -0.1"),
    (["--nodes", "2", "--regions", "5"], "every region needs a rollout"),
    (["--trainer-rate", "0"], "--trainer-rate 0"),
    (["--node-rate", "4X"], "--node-rate: not a size"),
    (["--chunk", "1K"], "--chunk 1K"),
    (["--push", "2"], "--push"),
    (["--time-scale", "0.5"], "--time-scale 0.5"),
    (["--time-scale", "nan"], "--time-scale nan"),
])
def test_bad_input_is_refused_in_one_line_before_anything_starts(tmp_path, bad, says):
    p = _cli(*bad, tmp_path=tmp_path)
    lines = p.stderr.strip().splitlines()
    assert p.returncode != 0 and len(lines) == 1 and says in lines[0], p.stderr
    assert not p.stdout  # refused before the banner: no daemon was started


def test_one_region_has_no_round_trip_in_its_bound_and_no_cross_region_figure(tmp_path):
    """One region: the bound is the patch over the trainer's uplink alone, cross-region bytes are
    ``n/a`` (null in the JSON) and not among the targets (this run divided by zero before); and
    uplinks that never burst are held to their rate."""
    out = tmp_path / "r.json"
    p = _cli("--nodes", "2", "--regions", "1", "--patch-mib", "0.25", "--versions", "1", "--no-star",
             "--rate-burst", "0", "--json", str(out), tmp_path=tmp_path, timeout=180)
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    (v,) = doc["versions"]
    assert v["cross_region_over_r_minus_1"] is None
    assert v["lower_bound_seconds"] == pytest.approx(v["patch_bytes"] / (4 << 20))
    # Its uplink held to 4 MiB/s from the first byte (--rate-burst 0), the trainer takes the bound to
    # send the patch, and nobody can have it sooner (with the daemons' burst, 0.4 MiB, it went at once
    # and the version read about 0.45x).
    assert v["time_over_bound"] >= 0.9 and v["trainer_upload_over_patch"] >= 1.0, v
    assert doc["rate_burst"] == 0 and "limits never burst" in p.stdout
    assert "cross-region n/a" in p.stdout and "cross-region bytes" not in p.stdout


def test_two_regions_report_the_crossing_against_the_regions_that_hold_rollouts(tmp_path):
    """A rollout in each of two regions: the patch crosses once (1.00x (R-1) x patch), the bound counts
    the round trip, and a limit of 0 prints as none."""
    out = tmp_path / "r.json"
    p = _cli("--nodes", "2", "--regions", "2", "--patch-mib", "0.25", "--versions", "2", "--no-star",
             "--rtt", "0.02", "--link-rate", "0", "--json", str(out), tmp_path=tmp_path, timeout=180)
    assert p.returncode == 0, p.stderr
    versions = json.loads(out.read_text())["versions"]
    assert len(versions) == 2
    for v in versions:
        assert v["lower_bound_seconds"] == pytest.approx(v["patch_bytes"] / (4 << 20) + 0.02)
        # requests served per daemon in the version: the exchanges that told of it, and its chunk
        # (asked for, or pushed: the same path)
        served = v["requests_per_node"]
        assert served["/v1/swarm/exchange"] >= 1 and served["/v1/swarm/chunk/{key}/{index}"] > 0, served
        assert 0.99 <= v["cross_region_over_r_minus_1"] <= 1.1, v
        assert 0.99 <= v["trainer_upload_over_patch"] <= 1.1, v
    assert "no limit per direction" in p.stdout and "cross-region bytes" in p.stdout


def test_a_time_scaled_run_is_the_same_swarm_slower(tmp_path):
    """``--time-scale 4``: the daemons get a quarter of every rate (the trainer's 1 MiB/s sends the
    patch in a quarter second, four times the default's time), the round trip is four times longer,
    and the bound with them; the figures say so."""
    out = tmp_path / "r.json"
    p = _cli("--nodes", "2", "--regions", "2", "--patch-mib", "0.25", "--versions", "1", "--no-star",
             "--rtt", "0.02", "--rate-burst", "0", "--time-scale", "4", "--json", str(out), tmp_path=tmp_path,
             timeout=180)
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    assert doc["time_scale"] == 4 and doc["rtt"] == pytest.approx(0.08)
    assert doc["rates"] == {"trainer": 1 << 20, "node": 2 << 20, "wan": 1 << 20, "link": 8 << 20}
    (v,) = doc["versions"]
    assert v["lower_bound_seconds"] == pytest.approx(v["patch_bytes"] / (1 << 20) + 0.08)
    # held to 1 MiB/s from the first byte, the trainer's daemon takes a quarter second to send it
    assert v["seconds"] >= 0.9 * v["patch_bytes"] / (1 << 20), v
    assert "time scaled 4x" in p.stdout and "80 ms RTT" in p.stdout


def test_the_star_baseline_ends_though_it_outlasts_the_leases(tmp_path):
    """The star's clients renew their leases while they pull: unrenewed, the trainer refused each
    as no member once its lease ran out (2 s here; the star takes about 4 s at a 512 KiB/s
    uplink), and ``bench swarm``'s default run never ended."""
    from sparrowd.bench.swarm import run

    out = tmp_path / "r.json"
    assert run(nodes=2, regions=1, patch_mib=1, versions=1, trainer_rate="512K", rtt=0.0, link_rate="0",
               json_path=str(out), lease_ttl=2.0) == 0
    doc = json.loads(out.read_text())
    star, (v,) = doc["star"], doc["versions"]
    # every client pulled the whole patch through the trainer's uplink: no faster than the uplink allows
    assert star["seconds"] >= 0.8 * 2 * v["patch_bytes"] / (512 << 10), star
