"""``sparrowd demo`` end to end: daemons up, a model trained, every node bit-exact, all cleaned up."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_the_demo_runs_end_to_end_and_cleans_up():
    r = subprocess.run([sys.executable, "-m", "sparrowd.cli.main", "demo", "--nodes", "3", "--regions", "2",
                        "--steps", "3"], capture_output=True, text=True, timeout=120, env={**_env(), "COLUMNS": "200"})
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "a trainer and 3 rollout daemons in 2 regions" in out
    for v in (1, 2, 3):
        m = re.search(rf"version {v}: .* \(([\d.]+)%\).* every node bit-exact", out)
        assert m and 0 < float(m.group(1)) < 5, out  # about 1% of the elements per step
    assert "every engine equal to the trainer bit for bit" in out
    root = Path(re.search(r"on loopback \((/[^)]+)\)", out).group(1))
    assert not root.exists()  # cleaned up
    ps = subprocess.run(["pgrep", "-f", str(root)], capture_output=True, text=True)
    assert ps.stdout.strip() == ""  # no daemon left behind


def test_bad_demo_arguments_are_one_clear_error():
    r = subprocess.run([sys.executable, "-m", "sparrowd.cli.main", "demo", "--nodes", "0"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.strip() == "sparrowd: error: --nodes, --regions and --steps must be at " \
                                                     "least 1"


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("SPARROWD_")}
