"""``sparrowd install`` / ``uninstall`` into a temporary prefix, and the unit it writes verified by
``systemd-analyze verify``."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import tomllib

import pytest

from sparrowd.daemon.settings import load_settings
from tests.helpers import sparrowd

pytestmark = pytest.mark.slow


@pytest.fixture
def token(tmp_path):
    p = tmp_path / "swarm.token"
    p.write_text("ab" * 24 + "\n")
    p.chmod(0o600)
    return p


def test_install_writes_settings_token_and_a_unit_systemd_accepts(tmp_path, token):
    root = tmp_path / "root"
    args = ("install", "--tracker", "http://10.0.0.1:7070", "--token-file", token, "--region", "us-east",
            "--group", "video", "--prefix", root)
    r = sparrowd(*args)
    assert r.returncode == 0, r.stderr
    assert "systemctl daemon-reload && systemctl enable --now sparrowd" in r.stdout
    tok = root / "etc/sparrowd/swarm.token"
    assert tok.read_text().strip() == "ab" * 24 and (tok.stat().st_mode & 0o777) == 0o600
    cfg = tomllib.loads((root / "etc/sparrowd/sparrowd.toml").read_text())
    assert cfg == {"role": "rollout", "region": "us-east", "tracker": "http://10.0.0.1:7070",
                   "token_file": "/etc/sparrowd/swarm.token", "metrics_listen": "127.0.0.1:9464"}
    s = load_settings({}, env={"SPARROWD_CONFIG": str(root / "etc/sparrowd/sparrowd.toml")})
    assert (s.role, s.region, s.tracker) == ("rollout", "us-east", "http://10.0.0.1:7070")
    assert s.metrics_listen == ("127.0.0.1", 9464)  # a scraper reads metrics on loopback, holding no secret
    unit = (root / "etc/systemd/system/sparrowd.service").read_text()
    for line in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "RestartPreventExitStatus=78",
                 "StateDirectory=sparrowd",
                 "RuntimeDirectory=sparrowd", "LimitNOFILE=", "NoNewPrivileges=yes", "ProtectSystem=strict",
                 "ProtectHome=", "PrivateTmp=yes", "Group=video", "run --config /etc/sparrowd/sparrowd.toml"):
        assert line in unit, line
    exe = unit.split("ExecStart=")[1].split()[0]
    assert shutil.which(exe), exe
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail("systemd-analyze is needed (.ci/run installs systemd)")
    v = subprocess.run([analyze, "verify", str(root / "etc/systemd/system/sparrowd.service")],
                       capture_output=True, text=True)
    assert v.returncode == 0 and not v.stderr.strip(), v.stderr

    again = sparrowd(*args)  # safe to run again: nothing changes
    assert again.returncode == 0 and "nothing changed" in again.stdout
    moved = sparrowd(*args[:-4], "--region", "eu", "--prefix", root)
    assert moved.returncode == 0 and "sparrowd.toml" in moved.stdout and "swarm.token" not in moved.stdout

    (root / "var/lib/sparrowd/versions").mkdir(parents=True)
    out = sparrowd("uninstall", "--prefix", root)
    assert out.returncode == 0 and "sparrowd.service" in out.stdout
    assert not (root / "etc/sparrowd").exists() and not (root / "etc/systemd/system/sparrowd.service").exists()
    assert (root / "var/lib/sparrowd/versions").exists()  # the chunk store stays without --purge
    assert sparrowd("uninstall", "--prefix", root, "--purge").returncode == 0
    assert not (root / "var/lib/sparrowd").exists()


@pytest.mark.parametrize("extra, message", [
    (("--role", "rollout"), "a rollout needs the tracker's address"),
    (("--tracker", "ftp://x"), "is not a tracker URL"),
    (("--tracker", "http://a:1", "--now"), "--now starts the service on this box: it needs --prefix /"),
    (("--tracker", "http://a:1", "--group", "no such group!"), "--group 'no such group!': give a group name"),
    (("--tracker", "http://a:1", "--group", "wheel\nUser=root"), "--group 'wheel\\nUser=root'"),
    (("--tracker", "http://a:1", "--token-file", ""), "--token-file '': give a path"),
])
def test_bad_installs_are_one_clear_error_and_write_nothing(tmp_path, token, extra, message):
    root = tmp_path / "root"
    r = sparrowd("install", "--token-file", token, "--region", "eu", "--prefix", root, *extra)
    assert r.returncode != 0 and message in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not root.exists()


@pytest.mark.parametrize("command", [("install", "--tracker", "http://a:1", "--region", "eu"), ("uninstall",)])
def test_an_empty_prefix_is_refused_not_taken_as_the_current_folder(tmp_path, token, command):
    extra = ("--token-file", token) if command[0] == "install" else ()
    r = sparrowd(*command, *extra, "--prefix", "", cwd=tmp_path, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and lines == ["sparrowd: error: --prefix '': give a path"], r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["swarm.token"]  # no etc/ written here


def test_the_trainer_installs_without_a_tracker(tmp_path, token):
    r = sparrowd("install", "--role", "trainer", "--token-file", token, "--region", "eu", "--prefix", tmp_path / "r")
    assert r.returncode == 0, r.stderr
    assert tomllib.loads((tmp_path / "r/etc/sparrowd/sparrowd.toml").read_text())["role"] == "trainer"


def test_install_sets_up_follow_mode_and_refuses_an_address_off_loopback(tmp_path, token):
    root = tmp_path / "root"
    base = ("install", "--tracker", "http://10.0.0.1:7070", "--token-file", token, "--region", "eu", "--prefix", root)
    r = sparrowd(*base, "--follow-vllm", "http://127.0.0.1:8000", "--follow-every", "30")
    assert r.returncode == 0, r.stderr
    s = load_settings({}, env={"SPARROWD_CONFIG": str(root / "etc/sparrowd/sparrowd.toml")})
    assert (s.follow_vllm, s.follow_every, s.follow_vllm_remote) == ("http://127.0.0.1:8000", 30.0, False)
    # Refused while the operator is at the keyboard, and nothing is rewritten.
    before = (root / "etc/sparrowd/sparrowd.toml").read_text()
    r = sparrowd(*base, "--follow-vllm", "http://10.2.3.4:8000")
    assert r.returncode == 1 and "not a loopback address" in r.stderr
    assert (root / "etc/sparrowd/sparrowd.toml").read_text() == before
    r = sparrowd(*base, "--follow-vllm", "http://10.2.3.4:8000", "--follow-vllm-remote")
    assert r.returncode == 0, r.stderr
    s = load_settings({}, env={"SPARROWD_CONFIG": str(root / "etc/sparrowd/sparrowd.toml")})
    assert s.follow_vllm_remote and s.follow_vllm == "http://10.2.3.4:8000"


def test_the_token_is_never_readable_by_others_not_even_while_it_is_written(tmp_path, token, monkeypatch):
    """Each file install writes has its mode from its temporary's creation on: the token's is 0600
    when created, when written and when renamed into place, whatever the umask (here 022)."""
    import sparrowd.cli.install as install
    from sparrowd.cli.main import main

    seen: list[tuple[str, str, int]] = []  # (file, when, mode of its temporary)
    real_open, real_atomic = os.open, install.atomic_file

    def spy_open(path, flags, mode=0o777, *args, **kw):
        fd = real_open(path, flags, mode, *args, **kw)
        if flags & os.O_CREAT and os.path.basename(path).startswith(".swarm.token."):
            seen.append(("swarm.token", "created", stat.S_IMODE(os.fstat(fd).st_mode)))
        return fd

    @contextlib.contextmanager
    def watched(path, **kw):
        with real_atomic(path, **kw) as tmp:
            seen.append((path.name, "written", stat.S_IMODE(os.stat(tmp).st_mode)))
            yield tmp
            seen.append((path.name, "renamed", stat.S_IMODE(os.stat(tmp).st_mode)))

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(install, "atomic_file", watched)
    root = tmp_path / "root"
    old = os.umask(0o022)
    try:
        assert main(["install", "--tracker", "http://10.0.0.1:7070", "--token-file", str(token),
                     "--region", "eu", "--prefix", str(root)]) == 0
    finally:
        os.umask(old)
    token_modes = {(when, mode) for name, when, mode in seen if name == "swarm.token"}
    assert token_modes == {("created", 0o600), ("written", 0o600), ("renamed", 0o600)}, seen
    for name in ("sparrowd.toml", "sparrowd.service"):
        assert {(when, mode) for n, when, mode in seen if n == name} == {("written", 0o644), ("renamed", 0o644)}
    assert stat.S_IMODE((root / "etc/sparrowd/swarm.token").stat().st_mode) == 0o600


def test_the_unit_ships_once_and_the_repository_links_to_it():
    """The unit ``sparrowd install`` writes is package data (``sparrowd/systemd/``, listed in
    pyproject.toml and MANIFEST.in); ``systemd/sparrowd.service``, where users look, is a link to it."""
    from importlib import resources
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    shipped = resources.files("sparrowd").joinpath("systemd/sparrowd.service")
    assert shipped.is_file()
    link = root / "systemd/sparrowd.service"
    assert link.is_symlink() and link.resolve() == (root / "sparrowd/systemd/sparrowd.service").resolve()
    assert link.read_text() == shipped.read_text()
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    assert pyproject["tool"]["setuptools"]["package-data"]["sparrowd"] == ["systemd/*.service"]
    assert "include sparrowd/systemd/sparrowd.service" in (root / "MANIFEST.in").read_text().splitlines()
