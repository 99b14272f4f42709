"""Bad input to the daemon, token and benchmark commands that have no test file of their own (``run``,
``publish``, ``join``, ``leave``, ``checkout``, ``status``, ``wait``, ``token``, ``bench coldstart|rl``):
one line, a non-zero exit, and nothing started, issued or written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

LOOPBACK = "http://127.0.0.1:9"  # nothing is ever called there: every case is refused first


def _cli(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARROWD_")}
    env["XDG_STATE_HOME"] = str(cwd / "state")  # the default data dir, were one used
    return subprocess.run([sys.executable, "-m", "sparrowd.cli.main", *map(str, args)], capture_output=True,
                          text=True, timeout=60, cwd=cwd, env=env)


def _tree(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*")}


@pytest.fixture
def inputs(tmp_path) -> Path:
    """A token file, a text file, an empty folder and a folder, in the folder the command runs in."""
    (tmp_path / "tok").write_text("t" * 32 + "\n")
    (tmp_path / "tok").chmod(0o600)
    (tmp_path / "garbage.txt").write_text("hello, I am not a checkpoint\n")
    (tmp_path / "binary.toml").write_bytes(bytes(range(256)))
    (tmp_path / "empty").mkdir()
    (tmp_path / "adir").mkdir()
    return tmp_path


def refused(r: subprocess.CompletedProcess, says: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("sparrowd: error: ") and says in lines[0], r.stderr
    assert not r.stdout, r.stdout


JOIN = ["join", LOOPBACK, "--token-file", "tok", "--region", "eu", "--data-dir", "d"]
WAIT = ["wait", "5", "--tracker", LOOPBACK, "--token-file", "tok"]
INIT = ["publish", "--version", "1", "--init", "--state-dir", "S", "--token-file", "tok", "--daemon", LOOPBACK]


@pytest.mark.parametrize("args, says", [
    (["publish", "p.sprw", "--daemon", "notaurl", "--token-file", "tok"], "--daemon 'notaurl': give a URL like"),
    (["publish", "p.sprw", "--daemon", "", "--token-file", "tok"], "--daemon '': give a URL like"),
    (["publish", "p.sprw", "--daemon", "http://127.0.0.1:port", "--token-file", "tok"], "--daemon"),
    (["status", "--tracker", "notaurl", "--token-file", "tok"], "--tracker 'notaurl': give a URL like"),
    (["status", "--tracker", "ftp://127.0.0.1", "--token-file", "tok"], "--tracker 'ftp://127.0.0.1'"),
    (["publish", "--checkpoint", "", "--version", "1", "--init", "--token-file", "tok"], "--checkpoint '': give a"),
    ([*INIT, "--checkpoint", "garbage.txt"], "garbage.txt: not a safetensors file"),
    ([*INIT, "--checkpoint", "empty"], "empty: no *.safetensors files"),
    ([*INIT, "--checkpoint", "garbage.txt", "--state-dir", ""], "--state-dir '': give a path"),
    ([*JOIN, "--timeout", "-1"], "--timeout -1.0: give seconds, 0 or more"),
    ([*JOIN, "--timeout", "nan"], "--timeout nan"),
    ([*JOIN, "--data-dir", ""], "--data-dir '': give a path"),
    ([*JOIN, "--token-file", ""], "--token-file '': give a path"),
    (["leave", "--timeout", "-1"], "--timeout -1.0: give seconds, 0 or more"),
    (["leave", "--data-dir", ""], "--data-dir '': give a path"),
    (["checkout", "out", "--data-dir", ""], "--data-dir '': give a path"),
    (["checkout", ""], "OUT '': give a path"),
    ([*WAIT, "--nodes", ""], "--nodes '': give node ids"),
    ([*WAIT, "--nodes", ",,"], "--nodes ',,': give node ids"),
    ([*WAIT, "--nodes", "a b"], "--nodes: node id 'a b'"),
    ([*WAIT, "--timeout", "nan"], "--timeout nan"),
    ([*WAIT, "--timeout", "inf"], "--timeout inf"),
    ([*WAIT, "--tracker", "notaurl"], "--tracker 'notaurl'"),
    (["run", "--config", "binary.toml"], "binary.toml: not valid TOML (not UTF-8 text)"),
    (["run", "--role", "rollout", "--region", "eu", "--token-file", "tok", "--tracker", LOOPBACK, "--data-dir", "d",
      "--advertise", "127.0.0.1:0"], "setting --advertise: '127.0.0.1:0': port 0"),
])
def test_daemon_commands_refuse_bad_input_in_one_line_before_anything_starts(inputs, args, says):
    before = _tree(inputs)
    refused(_cli(*args, cwd=inputs), says)
    assert _tree(inputs) == before  # no daemon.json, no data dir, no state dir, no recorded checkpoint


@pytest.mark.parametrize("args, says", [
    (["create", "--out", "adir"], "--out adir: is a folder"),
    (["create", "--out", "nodir/cred"], "--out nodir/cred: its folder nodir does not exist"),
    (["create", "--out", ""], "--out '': give a path"),
    (["create", "--data-dir", ""], "--data-dir '': give a path"),
    (["revoke", ""], "'' is not a credential id"),
    (["revoke", "../../x"], "'../../x' is not a credential id"),
    (["revoke", "0123456789ABCDEF"], "is not a credential id"),
])
def test_token_commands_refuse_bad_input_in_one_line(inputs, args, says):
    before = _tree(inputs)
    refused(_cli("token", *args, cwd=inputs), says)
    assert _tree(inputs) == before


@pytest.mark.slow  # a real trainer daemon
def test_a_credential_that_cannot_be_written_is_not_issued(cluster, inputs):
    trainer = cluster.trainer()
    for out in ("adir", "nodir/cred", ""):
        refused(_cli("token", "create", "--data-dir", trainer.data_dir, "--out", out, cwd=inputs), "--out")
    r = _cli("token", "list", "--json", "--data-dir", trainer.data_dir, cwd=inputs)
    assert r.returncode == 0 and json.loads(r.stdout) == [], r.stderr  # no orphan credential on the trainer


@pytest.mark.parametrize("args, says", [
    (["coldstart", "--trainer-rate", "0"], "--trainer-rate 0: give a rate above 0"),
    (["coldstart", "--node-rate", "4X"], "--node-rate: not a size"),
    (["coldstart", "--link-rate", "fast"], "--link-rate: not a size"),
    (["coldstart", "--rtt", "-1"], "--rtt -1.0: give seconds, 0 or more"),
    (["coldstart", "--rtt", "nan"], "--rtt nan"),
    (["rl", "--trainer-rate", "0"], "--trainer-rate 0: give a rate above 0"),
    (["rl", "--link-rate", "4X"], "--link-rate: not a size"),
    (["rl", "--rtt", "-1"], "--rtt -1.0: give seconds, 0 or more"),
    (["rl", "--rtt", "inf"], "--rtt inf"),
    (["rl", "--churn", "--join-pace", "-1"], "--join-pace -1.0: give seconds from 0 to 600"),
    (["rl", "--churn", "--join-pace", "nan"], "--join-pace nan"),
    (["rl", "--join-pace", "10"], "--join-pace paces the steps while a box joins: give it with --churn"),
])
def test_benchmarks_refuse_bad_input_in_one_line_before_anything_starts(inputs, args, says):
    before = _tree(inputs)
    refused(_cli("bench", *args, cwd=inputs), says)
    assert _tree(inputs) == before
