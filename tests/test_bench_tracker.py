"""`sparrowd bench tracker` as a user runs it: a real trainer daemon renewed over HTTP, figures out."""

import json

import pytest

from tests.helpers import sparrowd

pytestmark = pytest.mark.slow


def test_bench_tracker_measures_a_real_daemon_and_writes_its_figures(tmp_path):
    out = tmp_path / "tracker.json"
    r = sparrowd("bench", "tracker", "--sizes", "200", "--nodes", "200", "--concurrency", "8", "--seconds", "0.5",
                 "--json", out, timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    http = doc["http"]
    assert http["joins"] == 200 and http["renewals"] > 50 and 0 < http["daemon_cpu_share"] <= 1.5
    assert [(row["store"], row["signed"]) for row in doc["in_process"]] == [(False, False), (True, False),
                                                                              (True, True)]
    assert all(row["renewals_per_s"] > 0 and row["python_bytes_per_lease"] > 0 for row in doc["in_process"])
    # renewals under a session (an HMAC) cost the tracker less than signed ones (an Ed25519 check each)
    session, signed = doc["in_process"][1]["renewals_per_s"], doc["in_process"][2]["renewals_per_s"]
    assert session > 1.3 * signed, (session, signed)
    # the capacity is the measured rate, at half a core, over the renewal interval
    assert doc["capacity_nodes"] == int(http["renewals_per_cpu_s"] * 0.5 * doc["renew_interval"])
    assert "one tracker holds 10,000 nodes" in r.stdout


def test_bench_tracker_refuses_bad_flags_in_one_line():
    for args in (("--sizes", "ten"), ("--nodes", "0"), ("--seconds", "-1")):
        r = sparrowd("bench", "tracker", *args, timeout=60)
        assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
