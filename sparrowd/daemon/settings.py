"""One typed settings object for the daemon, from flags, environment and TOML.

Precedence, highest first: command-line flags, ``SPARROWD_<NAME>`` environment
variables, the TOML file (``--config`` or ``SPARROWD_CONFIG``), then defaults.
Every value is parsed and checked once, at start; a bad one is a single
:class:`InputError` naming the setting and where it came from.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..errors import InputError
from ..sizes import parse_size
from ..swarm.bucket import DEFAULT_BURST
from ..swarm.leases import DEFAULT_PEER_LIMIT, DEFAULT_TTL, ROLES, check_name
from ..swarm.push import DEFAULT_PUSH, parse_push

__all__ = ["Settings", "load_settings", "parse_hostport", "default_data_dir", "is_loopback"]

DEFAULT_LISTEN = "0.0.0.0:7070"
_HOSTPORT = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9.-]+)):(?P<port>\d{1,5})$")


def parse_hostport(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT``; port 0 asks the kernel for a free one."""
    m = _HOSTPORT.match(str(text).strip())
    if not m or int(m.group("port")) > 65535:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return m.group("v6") or m.group("host"), int(m.group("port"))


def _advertise(text: Any) -> tuple[str, int]:
    """The address other nodes reach this one on: a real port (0 only means "pick one" to --listen)."""
    host, port = parse_hostport(text)
    if port == 0:
        raise ValueError(f"{text!r}: port 0 is not one other nodes can reach; give the port they use")
    return host, port


def _http_url(example: str) -> Callable[[Any], str]:
    """A parser of ``http(s)://HOST[:PORT]`` URLs (no path), normalised; ``example`` goes in the error."""
    def parse(text: Any) -> str:
        u = urlsplit(str(text).strip())
        if u.scheme not in ("http", "https") or not u.hostname or u.path not in ("", "/") or u.query:
            raise ValueError(f"{text!r} is not a {example}")
        try:
            u.port
        except ValueError:
            raise ValueError(f"{text!r} has a bad port") from None
        return f"{u.scheme}://{u.netloc}"

    return parse


_tracker_url = _http_url("tracker URL like http://HOST:PORT")
_server_url = _http_url("server URL like http://127.0.0.1:8000")


def _positive_float(text: Any) -> float:
    try:
        v = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{text!r} is not a number") from None
    if not 0 < v < 86400:
        raise ValueError("must be more than 0 and less than a day")
    return v


def _int_from(least: int) -> Callable[[Any], int]:
    """A parser of integers of at least ``least``."""
    def parse(text: Any) -> int:
        try:
            v = int(text)
        except (TypeError, ValueError):
            raise ValueError(f"{text!r} is not an integer") from None
        if v < least:
            raise ValueError(f"must be at least {least}")
        return v
    return parse


_positive_int, _non_negative_int = _int_from(1), _int_from(0)


def _rate(text: Any) -> int | None:
    """Bytes per second with an optional K, M, G suffix (powers of 1024); 0 means unlimited."""
    v = parse_size(str(text))
    return v or None


def _choice(*options: str) -> Callable[[Any], str]:
    def parse(text: Any) -> str:
        v = str(text).strip().lower()
        if v not in options:
            raise ValueError(f"must be one of {', '.join(options)}, not {text!r}")
        return v

    return parse


def _name(kind: str) -> Callable[[Any], str]:
    def parse(text: Any) -> str:
        try:
            return check_name(kind, str(text).strip())
        except InputError as e:
            raise ValueError(str(e)) from None

    return parse


def _path(text: Any) -> Path:
    if not str(text).strip():
        raise ValueError("must not be empty")
    return Path(os.path.expanduser(str(text).strip())).absolute()


def _base(text: Any) -> Path:
    """A local model folder (safetensors shards) or one safetensors file: the base the swarm's
    patches build on, which this box already holds."""
    p = _path(text)
    if p.is_file() and p.suffix == ".safetensors":
        return p
    if not p.is_dir():
        raise ValueError(f"{p}: not a model folder or a .safetensors file")
    if not (p / "model.safetensors").is_file() and not (p / "model.safetensors.index.json").is_file():
        raise ValueError(f"{p}: no model.safetensors (or model.safetensors.index.json) in it")
    return p


def _non_negative_float(text: Any) -> float:
    try:
        v = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{text!r} is not a number") from None
    if not 0 <= v < 86400:
        raise ValueError("must be 0 or more and less than a day")
    return v


def _push(text: Any) -> tuple[int, int]:
    if isinstance(text, (list, tuple)):
        text = ",".join(str(t) for t in text)
    return parse_push(str(text))


def _bool(text: Any) -> bool:
    if isinstance(text, bool):
        return text
    v = str(text).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not true or false")


def is_loopback(url: str) -> bool:
    """Whether every address the URL's host names is a loopback address."""
    host = urlsplit(url).hostname or ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos)


def _engine_socket(text: Any) -> str:
    t = str(text).strip()
    if t in ("", "off"):
        return t
    p = Path(os.path.expanduser(t)).absolute()
    if len(str(p).encode()) > 107:
        raise ValueError("a Unix socket path must be under 108 bytes")
    return str(p)


def default_data_dir(env: Mapping[str, str] = os.environ) -> Path:
    """systemd's StateDirectory, else $XDG_STATE_HOME/sparrowd, else ~/.local/state/sparrowd."""
    if env.get("STATE_DIRECTORY"):
        return Path(env["STATE_DIRECTORY"].split(":")[0])
    base = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "sparrowd"


@dataclass(frozen=True)
class Settings:
    role: str
    listen: tuple[str, int]
    data_dir: Path
    region: str
    token_file: Path
    tracker: str | None = None
    advertise: tuple[str, int] | None = None
    lease_ttl: float = DEFAULT_TTL
    node_id: str | None = None
    peer_limit: int = DEFAULT_PEER_LIMIT
    log_format: str = "text"
    log_level: str = "info"
    retain: int = 8
    upload_rate: int | None = None
    download_rate: int | None = None
    wan_upload_rate: int | None = None
    rate_burst: float = DEFAULT_BURST  # seconds of a rate limit that may go at once (at least 16 KiB)
    engine_socket: str = ""  # "": DATA/engine.sock; "off": no engine socket; else its path
    follow_vllm: str | None = None  # the co-located vLLM server this daemon moves to each new version
    follow_every: float = 0.0  # at most one update per this many seconds (0: every version)
    follow_vllm_remote: bool = False  # allow a follow_vllm address that is not loopback
    super_seed: bool = True  # the trainer hands distinct chunks to distinct peers first (off: shows all it holds)
    cut_through: bool = True  # relays serve chunks they are fetching, block by block as the blocks check out
    push: tuple[int, int] = DEFAULT_PUSH  # a relay sends what it can serve, unasked, to (local, cross) peers a chunk
    current: bool | None = None  # keep DATA/current, the newest version as a model folder (default: rollouts do)
    metrics_listen: tuple[str, int] | None = None  # a second listener serving /metrics alone, no token asked
    base: Path | None = None  # a local model folder holding a version the patches build on (the current folder's start)
    base_version: int | None = None  # the version ``base`` holds (default: found from the patches' base fingerprints)

    @property
    def is_tracker(self) -> bool:
        return self.role == "trainer"

    @property
    def keeps_current(self) -> bool:
        return self.role == "rollout" if self.current is None else self.current


# name -> parser; every setting of Settings appears here, nothing else is accepted
_PARSERS: dict[str, Callable[[Any], Any]] = {
    "role": _choice(*ROLES),
    "listen": parse_hostport,
    "data_dir": _path,
    "region": _name("region"),
    "token_file": _path,
    "tracker": _tracker_url,
    "advertise": _advertise,
    "lease_ttl": _positive_float,
    "node_id": _name("node id"),
    "peer_limit": _positive_int,
    "log_format": _choice("text", "json"),
    "log_level": _choice("debug", "info", "warning", "error"),
    "retain": _positive_int,
    "upload_rate": _rate,
    "download_rate": _rate,
    "wan_upload_rate": _rate,
    "rate_burst": _non_negative_float,
    "engine_socket": _engine_socket,
    "follow_vllm": _server_url,
    "follow_every": _non_negative_float,
    "follow_vllm_remote": _bool,
    "super_seed": _bool,
    "cut_through": _bool,
    "push": _push,
    "current": _bool,
    "metrics_listen": parse_hostport,
    "base": _base,
    "base_version": _non_negative_int,
}
assert set(_PARSERS) == {f.name for f in fields(Settings)}


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as e:
        raise InputError(f"config {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"config {path}: not valid TOML ({e})") from None
    except UnicodeDecodeError:
        raise InputError(f"config {path}: not valid TOML (not UTF-8 text)") from None
    out = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in _PARSERS:
            raise InputError(f"config {path}: unknown setting {key!r} (known: {', '.join(sorted(_PARSERS))})")
        if isinstance(value, dict | list):
            raise InputError(f"config {path}: setting {key!r} must be a single value")
        out[name] = value
    return out


def load_settings(
    flags: Mapping[str, Any], env: Mapping[str, str] = os.environ, config: str | Path | None = None
) -> Settings:
    """Merge the sources and check every value. ``flags`` holds only what was given (None = not given)."""
    config = config or env.get("SPARROWD_CONFIG")
    layers: list[tuple[str, dict[str, Any]]] = []
    if config:
        layers.append((f"config {config}", _read_toml(Path(config))))
    layers.append(("environment",
                   {n: env[f"SPARROWD_{n.upper()}"] for n in _PARSERS if f"SPARROWD_{n.upper()}" in env}))
    layers.append(("flag", {n: v for n, v in flags.items() if n in _PARSERS and v is not None}))

    values: dict[str, Any] = {}
    for where, layer in layers:
        for name, raw in layer.items():
            label = f"--{name.replace('_', '-')}" if where == "flag" else (
                f"SPARROWD_{name.upper()}" if where == "environment" else f"{name} in {where}")
            try:
                values[name] = _PARSERS[name](raw)
            except ValueError as e:
                raise InputError(f"setting {label}: {e}") from None

    values.setdefault("listen", parse_hostport(DEFAULT_LISTEN))
    values.setdefault("data_dir", default_data_dir(env))
    for required in ("role", "region", "token_file"):
        if required not in values:
            flag = required.replace("_", "-")
            raise InputError(f"missing setting: give --{flag}, SPARROWD_{required.upper()} or {required} in the config")
    if values["role"] != "trainer" and "tracker" not in values:
        raise InputError(f"a {values['role']} needs the tracker's address: --tracker http://HOST:PORT")
    if values["role"] == "trainer" and "tracker" in values:
        raise InputError("the trainer hosts the tracker itself; leave --tracker out")
    if values.get("follow_vllm"):
        if values["role"] == "relay" or values.get("engine_socket") == "off":
            raise InputError("--follow-vllm needs the engine socket: a relay, or --engine-socket off, has none")
        if not values.get("follow_vllm_remote") and not is_loopback(values["follow_vllm"]):
            raise InputError(f"--follow-vllm {values['follow_vllm']}: not a loopback address. vLLM's RL routes have "
                             f"no authentication, so the server must listen on loopback (--host 127.0.0.1); "
                             f"--follow-vllm-remote allows another address")
    return Settings(**values)
