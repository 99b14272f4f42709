"""Settings: flags over environment over TOML over defaults, each value checked once."""

from pathlib import Path

import pytest

from sparrowd.client import read_token
from sparrowd.daemon.settings import default_data_dir, load_settings, parse_hostport
from sparrowd.errors import InputError
from tests.helpers import sparrowd

BASE = {"role": "rollout", "region": "eu", "token_file": "/t", "tracker": "http://10.0.0.1:7070"}


def test_precedence_flags_over_env_over_toml(tmp_path):
    cfg = tmp_path / "s.toml"
    cfg.write_text('role = "relay"\nregion = "toml-region"\nlease-ttl = 9\ntracker = "http://a:1"\n'
                   'token_file = "/from/toml"\nlog_format = "json"\n')
    env = {"SPARROWD_REGION": "env-region", "SPARROWD_LEASE_TTL": "7.5", "SPARROWD_CONFIG": str(cfg)}
    s = load_settings({"region": "flag-region", "listen": None}, env=env)
    assert s.role == "relay" and s.log_format == "json"  # only in the file
    assert s.region == "flag-region"  # flag beats env and file
    assert s.lease_ttl == 7.5  # env beats file
    assert s.token_file == Path("/from/toml") and s.tracker == "http://a:1"
    assert s.listen == ("0.0.0.0", 7070)  # default
    assert s.data_dir == default_data_dir(env)


def test_defaults_and_parsing():
    s = load_settings({**BASE, "listen": "[::1]:0", "advertise": "box.example:7071"}, env={})
    assert s.listen == ("::1", 0) and s.advertise == ("box.example", 7071)
    assert s.lease_ttl == 15.0 and s.peer_limit == 32 and s.log_level == "info" and s.rate_burst == 0.1
    assert load_settings({**BASE, "rate_burst": "0"}, env={}).rate_burst == 0.0
    assert default_data_dir({"STATE_DIRECTORY": "/var/lib/sparrowd"}) == Path("/var/lib/sparrowd")
    assert parse_hostport("127.0.0.1:80") == ("127.0.0.1", 80)


def test_the_engine_socket_lives_where_the_service_manager_says():
    from sparrowd.daemon.app import engine_socket_path

    s = load_settings({**BASE, "data_dir": "/d"}, env={})
    assert engine_socket_path(s, {}) == Path("/d/engine.sock")
    assert engine_socket_path(s, {"RUNTIME_DIRECTORY": "/run/sparrowd"}) == Path("/run/sparrowd/engine.sock")
    s = load_settings({**BASE, "engine_socket": "~/e.sock"}, env={})
    assert engine_socket_path(s, {"RUNTIME_DIRECTORY": "/run/sparrowd"}) == Path("~/e.sock").expanduser()
    assert load_settings({**BASE}, env={"SPARROWD_ENGINE_SOCKET": "off"}).engine_socket == "off"


@pytest.mark.parametrize(
    "flags, env, message",
    [
        ({**BASE, "listen": "nope"}, {}, "setting --listen: 'nope' is not HOST:PORT"),
        ({**BASE, "listen": "h:70000"}, {}, "is not HOST:PORT"),
        ({**BASE, "advertise": "127.0.0.1:0"}, {}, "setting --advertise: '127.0.0.1:0': port 0 is not one"),
        ({**BASE}, {"SPARROWD_LEASE_TTL": "soon"}, "setting SPARROWD_LEASE_TTL: 'soon' is not a number"),
        ({**BASE, "lease_ttl": "0"}, {}, "more than 0"),
        ({**BASE, "rate_burst": "-1"}, {}, "setting --rate-burst"),
        ({**BASE, "role": "boss"}, {}, "must be one of trainer, rollout, relay"),
        ({**BASE, "region": "eu west"}, {}, "setting --region: region 'eu west' must be"),
        ({**BASE, "tracker": "ftp://x"}, {}, "is not a tracker URL"),
        ({**BASE, "tracker": None}, {}, "a rollout needs the tracker's address"),
        ({**BASE, "role": "trainer"}, {}, "the trainer hosts the tracker itself"),
        ({"role": "rollout", "region": "eu", "tracker": "http://a:1"}, {}, "missing setting: give --token-file"),
        ({**BASE, "engine_socket": "/" + "s" * 120}, {}, "a Unix socket path must be under 108 bytes"),
    ],
)
def test_bad_settings_are_one_clear_error(flags, env, message):
    with pytest.raises(InputError) as e:
        load_settings(flags, env=env)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_config_files(tmp_path):
    cfg = tmp_path / "s.toml"
    cfg.write_text('regoin = "eu"\n')
    with pytest.raises(InputError, match="unknown setting 'regoin'"):
        load_settings(BASE, env={}, config=cfg)
    cfg.write_text("role = \n")
    with pytest.raises(InputError, match="not valid TOML"):
        load_settings(BASE, env={}, config=cfg)
    cfg.write_bytes(b"\xff\xfe\x00role = 1\n")  # not text: one line, not a UnicodeDecodeError
    with pytest.raises(InputError, match="not valid TOML \\(not UTF-8 text\\)"):
        load_settings(BASE, env={}, config=cfg)
    cfg.write_text('lease_ttl = "x"\n')
    with pytest.raises(InputError, match=f"setting lease_ttl in config {cfg}"):
        load_settings(BASE, env={}, config=cfg)
    with pytest.raises(InputError, match="No such file"):
        load_settings(BASE, env={}, config=tmp_path / "missing.toml")


def test_token_files(tmp_path):
    t = tmp_path / "token"
    t.write_text("short\n")
    with pytest.raises(InputError, match="at least 16"):
        read_token(t)
    t.write_text("a" * 32 + "\n")
    t.chmod(0o644)
    assert read_token(t) == ("a" * 32, True)
    t.chmod(0o600)
    assert read_token(t) == ("a" * 32, False)
    with pytest.raises(InputError, match="No such file"):
        read_token(tmp_path / "nope")


def test_run_refuses_bad_settings_with_one_line(tmp_path):
    r = sparrowd("run", "--role", "rollout", "--region", "eu", "--token-file", tmp_path / "none",
                 "--data-dir", tmp_path / "d")
    assert r.returncode == 1
    assert r.stderr.strip() == "sparrowd: error: a rollout needs the tracker's address: --tracker http://HOST:PORT"
    r = sparrowd("run", "--role", "trainer", "--region", "eu", "--token-file", tmp_path / "none",
                 "--data-dir", tmp_path / "d", "--listen", "127.0.0.1:0")
    assert r.returncode == 1 and r.stderr.strip().endswith(f"token file {tmp_path / 'none'}: No such file or directory")


def test_follow_vllm_must_be_loopback_unless_allowed(tmp_path):
    # Loopback in any spelling is taken; the staleness policy defaults to every version.
    for url in ("http://127.0.0.1:8000", "http://localhost:8000", "http://[::1]:8000", "http://127.0.0.5:1/"):
        s = load_settings({**BASE, "follow_vllm": url}, env={})
        assert s.follow_vllm == url.rstrip("/") and s.follow_every == 0.0 and not s.follow_vllm_remote
    # vLLM's RL routes have no authentication: another address is refused, with the way out named.
    with pytest.raises(InputError, match="not a loopback address.*--follow-vllm-remote"):
        load_settings({**BASE, "follow_vllm": "http://10.0.0.7:8000"}, env={})
    s = load_settings({**BASE, "follow_vllm": "http://10.0.0.7:8000"}, env={"SPARROWD_FOLLOW_VLLM_REMOTE": "true"})
    assert s.follow_vllm_remote
    # Bad values, and a node that has no engine socket to follow through.
    with pytest.raises(InputError, match="setting --follow-vllm: 'ftp://x' is not a server URL"):
        load_settings({**BASE, "follow_vllm": "ftp://x"}, env={})
    with pytest.raises(InputError, match="setting SPARROWD_FOLLOW_EVERY: must be 0 or more"):
        load_settings({**BASE, "follow_vllm": "http://127.0.0.1:1"}, env={"SPARROWD_FOLLOW_EVERY": "-1"})
    with pytest.raises(InputError, match="needs the engine socket"):
        load_settings({**BASE, "role": "relay", "follow_vllm": "http://127.0.0.1:1"}, env={})
    r = sparrowd("run", "--role", "rollout", "--region", "eu", "--token-file", tmp_path / "none", "--tracker",
                 "http://127.0.0.1:1", "--data-dir", tmp_path / "d", "--follow-vllm", "http://192.0.2.1:8000")
    assert r.returncode == 1 and "not a loopback address" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_super_seeding_is_on_unless_turned_off():
    assert load_settings(BASE, env={}).super_seed
    assert not load_settings({**BASE, "super_seed": "off"}, env={}).super_seed
    with pytest.raises(InputError, match="setting --super-seed: 'maybe' is not true or false"):
        load_settings({**BASE, "super_seed": "maybe"}, env={})
