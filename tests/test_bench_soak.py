"""``sparrowd bench soak``, small: real daemons, one killed with SIGKILL and restarted mid-run, every
version reaching every live node and every stored chunk checked against its manifest."""

from __future__ import annotations

import json

import pytest

from sparrowd.bench.soak import run

pytestmark = pytest.mark.slow


def test_a_short_soak_kills_and_restarts_a_node_and_every_version_arrives(tmp_path, capsys):
    out = tmp_path / "soak.json"
    assert run(nodes=3, regions=1, versions=3, kill_every=2, json_path=str(out)) == 0
    doc = json.loads(out.read_text())
    assert [r["version"] for r in doc["versions"]] == [1, 2, 3] and doc["killed"] == 1
    assert all(r["seconds_to_all"] > 0 for r in doc["versions"])
    assert [s["at"] for s in doc["samples"]] == ["start", "middle", "end"]
    printed = capsys.readouterr().out
    # it says it is starting before the daemons' start-up, and when they have joined
    assert printed.index("starting the daemons") < printed.index("all 3 joined")
