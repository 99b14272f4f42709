"""``sparrowd bench coldstart``, small: two empty boxes boot the current policy from a real trainer
daemon, against the same boxes downloading the checkpoint (real daemons and the WAN emulator on
loopback)."""

from __future__ import annotations

import json

import pytest

from sparrowd.bench.coldstart import ColdstartConfig, run

pytestmark = pytest.mark.slow


def test_two_boxes_boot_from_the_swarm_and_the_star_is_timed_with_progress_lines(tmp_path, capsys):
    cfg = ColdstartConfig(model_mib=8, boxes=2, regions=1, versions=1)
    out = run(cfg, json_path=str(tmp_path / "cs.json"))
    printed = capsys.readouterr().out
    model, rate = out["model_bytes"], 4 << 20
    assert out["bound_seconds"] == model / rate
    # both boxes' folders hold the trainer's last version (run() compares them bit for bit) ...
    assert len(out["swarm"]["per_box"]) == 2 and out["swarm"]["seconds"] >= max(out["swarm"]["per_box"])
    # ... and the star pulled the model once a box, through the trainer's capped uplink
    assert out["star"]["trainer_upload"] >= 2 * model * 0.99
    assert out["star"]["seconds"] >= 0.9 * out["star"]["trainer_upload"] / rate
    # each phase says what it is doing before its silence, and the star how long it should take
    assert "swarm: 2 empty boxes joining" in printed and "star: 2 boxes each downloading" in printed
    assert json.loads((tmp_path / "cs.json").read_text())["targets"] == out["targets"]
