"""``sparrowd top``: the view on canned snapshots, the live app headless (Textual's pilot),
``--once`` and the app in a real terminal (tmux) against a live three-node swarm."""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparrowd.cli.top import TopApp, render_once
from sparrowd.cli.topview import TopView, fit
from sparrowd.errors import SparrowError

SNAP = json.loads((Path(__file__).parent / "data" / "status_snapshot.json").read_text())


def view(**kw) -> TopView:
    v = TopView("http://10.0.0.1:7070", **kw)
    v.update(copy.deepcopy(SNAP))
    return v


def ids(v: TopView) -> list[str]:
    return [r.node_id for r in v.rows()]


def test_sorting_by_lag_region_and_rate():
    v = view()
    assert ids(v) == ["rollout-us-1", "rollout-us-2", "rollout-eu-a-very-long-node-name", "trainer-1"]
    v.next_sort()
    assert v.sort == "region" and ids(v) == ["rollout-eu-a-very-long-node-name", "trainer-1", "rollout-us-1",
                                             "rollout-us-2"]
    v.next_sort()
    # 4 MiB/s up; then 3 MiB/s in all each (names break the tie); then idle
    assert v.sort == "rate" and ids(v) == ["trainer-1", "rollout-eu-a-very-long-node-name", "rollout-us-1",
                                           "rollout-us-2"]
    v.next_sort()
    assert v.sort == "lag"


def test_filtering_by_region_cycles_through_all():
    v = view()
    v.next_region()
    assert v.region == "eu" and set(ids(v)) == {"rollout-eu-a-very-long-node-name", "trainer-1"}
    v.next_region()
    assert v.region == "us-east" and set(ids(v)) == {"rollout-us-1", "rollout-us-2"}
    v.next_region()
    assert v.region is None and len(ids(v)) == 4


def test_lag_stale_and_error_styles():
    rows = {r.node_id: r for r in view().rows()}
    assert rows["rollout-us-1"].style == "lagging" and rows["rollout-us-1"].cells[5] == "39 -3"
    assert rows["rollout-us-2"].style == "error"  # stale too, and reporting a full disk
    assert rows["trainer-1"].style == "trainer" and rows["rollout-eu-a-very-long-node-name"].style == ""
    assert "█" in rows["rollout-us-1"].cells[7] and "38%" in rows["rollout-us-1"].cells[7]
    out = render_once(view(), 100, time.time(), color=True)
    assert "\x1b[33m" in out and "\x1b[1;31m" in out  # yellow lagging, bold red error/stale


@pytest.mark.parametrize("width", [80, 60])
def test_narrow_terminals_fit(width):
    out = render_once(view(), width, time.time(), color=False)
    assert all(len(line) <= width for line in out.splitlines()), out
    assert "rollout-us-1" in out or width < 80
    widths, cells = fit([r.cells for r in view().rows()], width)
    assert all(len(c) <= w for row in cells for c, w in zip(row, widths))


def test_unreachable_tracker_keeps_the_last_snapshot_with_a_notice():
    v = view()
    v.failed("unreachable (Connection refused)", now=100.0)
    v.failed("unreachable (Connection refused)", now=103.0)
    head = v.header(now=107.0)
    assert head[0].startswith("! tracker unreachable for 7 s") and len(v.rows()) == 4
    v.update(copy.deepcopy(SNAP))
    assert not v.header(now=108.0)[0].startswith("!")


def test_cross_region_bytes_count_from_when_the_latest_version_appeared():
    v = view()
    later = copy.deepcopy(SNAP)
    later["nodes"][2]["bytes_down_wan"] += 3 << 20
    v.update(later)
    assert "cross-region since 42: 3.00 MiB" in v.header(0)[2]
    newer = copy.deepcopy(later)
    newer["latest_version"] = 43
    v.update(newer)
    assert "cross-region since 43: 0 B" in v.header(0)[2]


@pytest.mark.slow  # the live app run headless: several seconds
def test_the_live_app_headless_sorts_filters_and_survives_an_outage():
    state = {"fail": False}

    def fetch():
        if state["fail"]:
            raise SparrowError("http://10.0.0.1:7070/v1/tracker/status: unreachable (Connection refused)")
        return copy.deepcopy(SNAP)

    async def run():
        from textual.widgets import DataTable, Static

        app = TopApp(TopView("http://10.0.0.1:7070"), fetch, interval=0.1)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause(0.3)
            table = app.query_one(DataTable)
            first = [str(table.get_row_at(i)[0]) for i in range(table.row_count)]
            assert first[0] == "rollout-us-1" and table.row_count == 4
            await pilot.press("r")
            assert table.row_count == 2
            await pilot.press("r", "r", "s")
            assert table.row_count == 4 and app.view.sort == "region"
            state["fail"] = True
            await pilot.pause(0.4)
            head = str(app.query_one("#head", Static).render())
            assert "tracker unreachable" in head and table.row_count == 4
            state["fail"] = False
            await pilot.pause(0.4)
            assert "unreachable" not in str(app.query_one("#head", Static).render())
            await pilot.press("q")
        assert app.return_code in (0, None)

    asyncio.run(run())


@pytest.mark.parametrize("args, says", [
    (["--interval", "0"], "--interval 0.0: give seconds, above 0"),
    (["--interval", "-1"], "--interval -1.0: give seconds, above 0"),
    (["--interval", "nan"], "--interval nan"),
    (["--once", "--interval", "inf"], "--interval inf"),
    (["--once", "--tracker", "notaurl"], "--tracker 'notaurl': give a URL like http://HOST:PORT"),
    (["--once", "--tracker", ""], "give --tracker"),
])
def test_bad_input_is_one_line_before_the_screen_changes(tmp_path, args, says):
    r = subprocess.run([sys.executable, "-m", "sparrowd.cli.main", "top", "--tracker", "http://127.0.0.1:9",
                        "--token-file", str(make_bad_token(tmp_path)), *args],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and says in lines[0] and not r.stdout, r.stderr


@pytest.mark.slow
def test_top_against_a_live_swarm_once_and_in_a_real_terminal(cluster, tmp_path):
    cluster.trainer()
    for name, region in (("n-eu", "eu"), ("n-us", "us")):
        cluster.rollout(name, region)
    from tests.daemon.harness import wait_for

    wait_for(lambda: len(cluster.nodes()) == 3, 15, "three nodes")
    common = ["--tracker", cluster.tracker, "--token-file", str(cluster.token_file)]
    r = subprocess.run([sys.executable, "-m", "sparrowd.cli.main", "top", "--once", *common],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "nodes 3 up" in r.stdout or "joining" in r.stdout
    for node in ("trainer", "n-eu", "n-us"):
        assert node in r.stdout
    r = subprocess.run([sys.executable, "-m", "sparrowd.cli.main", "top", "--once", "--tracker", cluster.tracker,
                        "--token-file", str(make_bad_token(tmp_path))], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "refused the swarm token" in r.stderr

    tmux = shutil.which("tmux")
    if tmux is None:
        pytest.fail("tmux is needed for the real-terminal test (.ci/run installs it)")
    session = f"sparrowd-top-{tmp_path.name[-8:]}"
    cmd = " ".join([sys.executable, "-m", "sparrowd.cli.main", "top", *common])
    subprocess.run([tmux, "new-session", "-d", "-s", session, "-x", "80", "-y", "24", cmd], check=True)
    try:
        def screen() -> str:
            return subprocess.run([tmux, "capture-pane", "-p", "-t", session], capture_output=True,
                                  text=True).stdout

        wait_for(lambda: "n-us" in screen() and "n-eu" in screen(), 30, "top to draw the nodes")
        subprocess.run([tmux, "send-keys", "-t", session, "r"], check=True)
        wait_for(lambda: "region eu" in screen(), 10, "the region filter")
        assert "n-us" not in screen()
        subprocess.run([tmux, "send-keys", "-t", session, "q"], check=True)
        wait_for(lambda: subprocess.run([tmux, "has-session", "-t", session], capture_output=True).returncode != 0,
                 10, "top to quit")
    finally:
        subprocess.run([tmux, "kill-session", "-t", session], capture_output=True)


def make_bad_token(tmp_path: Path) -> Path:
    p = tmp_path / "bad.token"
    p.write_text("0" * 48 + "\n")
    p.chmod(0o600)
    return p
