"""``sparrowd install`` and ``sparrowd uninstall``: the daemon as a systemd service on a rented box."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

from sparrowd.checkpoint import atomic_file
from sparrowd.client import read_tokens
from sparrowd.daemon.settings import load_settings
from sparrowd.errors import InputError, SparrowError
from sparrowd.swarm.leases import ROLES

from .checks import path_args
from .daemon import add_base_flags, add_current_flag, add_follow_flags

ETC = Path("etc/sparrowd")
UNIT = Path("etc/systemd/system/sparrowd.service")
STATE = Path("var/lib/sparrowd")
_POSIX_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")  # a user or group name systemd takes as given


def register(sub) -> None:
    i = sub.add_parser(
        "install", help="install the daemon as a systemd service on this box",
        description="Write /etc/sparrowd/sparrowd.toml and the swarm token (mode 0600), install the systemd unit "
                    "and print the systemctl line that starts it (or start it with --now). Running it again "
                    "updates what it wrote; `sparrowd uninstall` undoes it.")
    i.add_argument("--tracker", metavar="URL", help="the trainer's daemon, http://HOST:PORT (not for the trainer)")
    i.add_argument("--token-file", metavar="FILE", required=True,
                   help="the swarm token, or a join credential from `sparrowd token create`, to install")
    i.add_argument("--region", metavar="NAME", required=True, help="this box's region, e.g. us-east")
    i.add_argument("--role", choices=ROLES, default="rollout", help="trainer, rollout (default) or relay")
    i.add_argument("--listen", metavar="HOST:PORT", help="address to serve peers on (default 0.0.0.0:7070)")
    i.add_argument("--advertise", metavar="HOST:PORT", help="address other nodes reach this box on, behind NAT")
    i.add_argument("--metrics-listen", metavar="HOST:PORT", default=DEFAULT_METRICS_LISTEN,
                   help=f"serve /metrics alone there, with no token, for Prometheus (default "
                        f"{DEFAULT_METRICS_LISTEN}; 'off' for none)")
    i.add_argument("--group", metavar="NAME", help="run the daemon with this group, so an engine running as "
                                                   "another user in it can open the engine socket")
    add_follow_flags(i)
    add_base_flags(i)
    add_current_flag(i)
    i.add_argument("--prefix", metavar="DIR", default="/", help="install under DIR instead of / (images, tests)")
    i.add_argument("--now", action="store_true", help="also enable and start the service (needs --prefix /)")
    i.set_defaults(func=cmd_install)

    u = sub.add_parser("uninstall", help="remove what `sparrowd install` wrote",
                       description="Stop and disable the service (with --prefix /), then remove the unit, the "
                                   "settings and the token. The chunk store stays unless --purge.")
    u.add_argument("--prefix", metavar="DIR", default="/", help="the prefix given to install")
    u.add_argument("--purge", action="store_true", help="also delete /var/lib/sparrowd (chunks, keys, leases)")
    u.set_defaults(func=cmd_uninstall)


DEFAULT_METRICS_LISTEN = "127.0.0.1:9464"  # an installed box's scrape address: loopback, no token


def _toml(settings: dict) -> str:
    def value(v) -> str:
        return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'

    lines = ["# Written by `sparrowd install`; `sparrowd run --config` reads it. Flags and SPARROWD_* override it."]
    lines += [f"{k} = {value(v)}" for k, v in settings.items() if v is not None]
    return "\n".join(lines) + "\n"


def _executable() -> str:
    """The `sparrowd` command of this installation (what the unit's ExecStart runs)."""
    here = Path(sys.executable).parent / "sparrowd"
    if here.exists():
        return str(here)
    found = shutil.which("sparrowd")
    if found:
        return str(Path(found).resolve())
    raise SparrowError("cannot find the `sparrowd` executable to start from the unit; is sparrowd installed?")


def unit_text(exe: str, group: str | None = None) -> str:
    text = resources.files("sparrowd").joinpath("systemd/sparrowd.service").read_text()
    text = text.replace("ExecStart=/usr/local/bin/sparrowd ", f"ExecStart={exe} ")
    if group:
        text = text.replace("[Service]\n", f"[Service]\nGroup={group}\n")
    return text


def _write(path: Path, text: str, mode: int) -> bool:
    """Write atomically, the file ``mode`` from its creation on; False when it already held exactly this."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and path.read_text() == text and (path.stat().st_mode & 0o777) == mode:
        return False
    with atomic_file(path, mode=mode) as tmp:
        tmp.write_text(text)
    return True


def cmd_install(args) -> int:
    path_args(("--prefix", args.prefix), ("--token-file", args.token_file))
    if args.group is not None and not _POSIX_NAME.fullmatch(args.group):
        raise InputError(f"--group {args.group!r}: give a group name (letters, digits, '_', '.', '-', "
                         "starting with a letter or '_', at most 32)")
    prefix = Path(args.prefix)
    if args.now and prefix.resolve() != Path("/"):
        raise InputError("--now starts the service on this box: it needs --prefix /")
    tokens, _ = read_tokens(Path(args.token_file).expanduser())
    settings = {"role": args.role, "region": args.region, "tracker": args.tracker,
                "token_file": "/" + str(ETC / "swarm.token"), "listen": args.listen, "advertise": args.advertise,
                "follow_vllm": args.follow_vllm, "follow_every": args.follow_every,
                "follow_vllm_remote": args.follow_vllm_remote, "current": args.current,
                "metrics_listen": None if args.metrics_listen == "off" else args.metrics_listen,
                "base": str(Path(args.base).expanduser().absolute()) if args.base else None,
                "base_version": args.base_version}
    # The same checks `sparrowd run` will make, now, while the operator is at the keyboard.
    load_settings({k: v for k, v in settings.items()}, env={})
    written = []
    for rel, text, mode in ((ETC / "swarm.token", "\n".join(tokens) + "\n", 0o600),
                            (ETC / "sparrowd.toml", _toml(settings), 0o644),
                            (UNIT, unit_text(_executable(), args.group), 0o644)):
        if _write(prefix / rel, text, mode):
            written.append("/" + str(rel))
    print("wrote " + ", ".join(written) if written else "already installed as asked; nothing changed")
    start = "systemctl daemon-reload && systemctl enable --now sparrowd"
    if args.now:
        r = subprocess.run(["sh", "-c", start], capture_output=True, text=True)
        if r.returncode != 0:
            raise SparrowError(f"`{start}` failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
        print("sparrowd is running; `journalctl -u sparrowd -f` follows its log")
    else:
        print(f"start it with: {start}")
    return 0


def cmd_uninstall(args) -> int:
    path_args(("--prefix", args.prefix))
    prefix = Path(args.prefix)
    if prefix.resolve() == Path("/") and shutil.which("systemctl"):
        subprocess.run(["systemctl", "disable", "--now", "sparrowd"], capture_output=True)
    removed = []
    for rel in (UNIT, ETC / "sparrowd.toml", ETC / "swarm.token"):
        p = prefix / rel
        if p.exists():
            p.unlink()
            removed.append("/" + str(rel))
    etc = prefix / ETC
    if etc.is_dir() and not any(etc.iterdir()):
        etc.rmdir()
    if args.purge and (prefix / STATE).exists():
        shutil.rmtree(prefix / STATE)
        removed.append("/" + str(STATE))
    if prefix.resolve() == Path("/") and shutil.which("systemctl"):
        subprocess.run(["systemctl", "daemon-reload"], capture_output=True)
    print("removed " + ", ".join(removed) if removed else "nothing of sparrowd was installed there")
    return 0
