"""``sparrowd run``, ``join``, ``leave`` and ``status``: the daemon and its swarm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from sparrowd.checkpoint import atomic_file
from sparrowd.client import check_url, http_call, publish_file, published_state, read_token, tracker_status
from sparrowd.daemon.settings import DEFAULT_LISTEN, default_data_dir, load_settings
from sparrowd.errors import InputError, SparrowError
from sparrowd.publishing import DEFAULT_ANCHOR_EVERY
from sparrowd.swarm.bucket import DEFAULT_BURST
from sparrowd.swarm.leases import ROLES, check_name

from .checks import path_arg, path_args, seconds
from .status import render_status

_SETTING_FLAGS = ("role", "listen", "data_dir", "region", "token_file", "tracker", "advertise", "lease_ttl",
                  "node_id", "peer_limit", "log_format", "log_level", "retain", "upload_rate", "download_rate",
                  "wan_upload_rate", "rate_burst", "engine_socket", "follow_vllm", "follow_every",
                  "follow_vllm_remote", "super_seed", "current", "cut_through", "push", "metrics_listen", "base",
                  "base_version")


def add_base_flags(p) -> None:
    """The box's own base checkpoint, shared by `run` and `install`."""
    p.add_argument("--base", metavar="DIR",
                   help="a local model folder (or .safetensors file) holding a version the swarm's patches build on, "
                        "e.g. the checkpoint this box's engine loads: the current folder starts from it, so ulp2 "
                        "patches decode here without an anchor (rollouts)")
    p.add_argument("--base-version", metavar="N",
                   help="the version --base holds (default: found from the patches' base fingerprints)")


def add_follow_flags(p) -> None:
    """Follow mode's flags, shared by `run` and `install`."""
    p.add_argument("--follow-vllm", metavar="URL",
                   help="keep the co-located vLLM server (vllm serve ... --weight-transfer-config "
                        "'{\"backend\": \"sparrowd\"}', VLLM_SERVER_DEV_MODE=1) on the newest version: pause, "
                        "update, resume as versions arrive. Loopback only, e.g. http://127.0.0.1:8000")
    p.add_argument("--follow-every", metavar="SECONDS",
                   help="with --follow-vllm: update the server at most once per SECONDS, to the newest version "
                        "(default 0: every version as soon as it is ready)")
    p.add_argument("--follow-vllm-remote", action="store_const", const=True,
                   help="allow a --follow-vllm address that is not loopback (vLLM's RL routes have no "
                        "authentication: only on a network nobody else reaches)")


def add_current_flag(p) -> None:
    """The current-version folder's flag, shared by `run` and `install`."""
    p.add_argument("--current", choices=("on", "off"),
                   help="keep the newest version as a model folder at DATA/current, for `vllm serve DATA/current` "
                        "(default: on for a rollout, off for the trainer and relays); costs one model's bytes on "
                        "disk, and each version writes its changed elements")


def register(sub) -> None:
    r = sub.add_parser(
        "run", help="run the daemon in the foreground (what systemd starts)",
        description="Run the sparrowd daemon in the foreground. Settings come from flags, then SPARROWD_* "
                    "environment variables, then the TOML file given by --config; flags win. SIGTERM or SIGINT "
                    "leaves the swarm and exits 0.")
    r.add_argument("--role", choices=ROLES, help="trainer (seed and tracker), rollout, or relay")
    r.add_argument("--listen", metavar="HOST:PORT", help=f"address to serve peers on (default {DEFAULT_LISTEN}; "
                                                         "port 0 picks a free one)")
    r.add_argument("--data-dir", metavar="DIR", help=f"state: lease database, chunks (default {default_data_dir()})")
    r.add_argument("--region", metavar="NAME", help="region of this node, e.g. us-east (peers prefer their region)")
    r.add_argument("--token-file", metavar="FILE", help="file holding the swarm token (mode 0600)")
    r.add_argument("--tracker", metavar="URL", help="the trainer's daemon, http://HOST:PORT (not for the trainer)")
    r.add_argument("--advertise", metavar="HOST:PORT",
                   help="address other nodes should use (default: the listen address, or the address that routes "
                        "to the tracker when listening on all interfaces)")
    r.add_argument("--lease-ttl", metavar="SECONDS", help="lease time-to-live the tracker grants (trainer; default 15)")
    r.add_argument("--node-id", metavar="ID", help="node id (default: generated once, kept in the data dir)")
    add_base_flags(r)
    r.add_argument("--metrics-listen", metavar="HOST:PORT",
                   help="serve /metrics alone on this address, without the swarm token, for Prometheus (e.g. "
                        "127.0.0.1:9464; default: only on the main port, with the token)")
    r.add_argument("--peer-limit", metavar="N", help="most peers handed out per list (trainer; default 32)")
    r.add_argument("--log-format", choices=("text", "json"), help="log format (default text)")
    r.add_argument("--log-level", choices=("debug", "info", "warning", "error"), help="log level (default info)")
    r.add_argument("--retain", metavar="K", help="complete versions kept on disk and served (default 8)")
    r.add_argument("--upload-rate", metavar="BYTES", help="upload limit per second, e.g. 4M = 4 MiB/s (default: none)")
    r.add_argument("--download-rate", metavar="BYTES", help="download limit per second (default: none)")
    r.add_argument("--wan-upload-rate", metavar="BYTES",
                   help="limit on uploads to other regions (cross-region egress costs money; default: none)")
    r.add_argument("--rate-burst", metavar="SECONDS",
                   help=f"how much of a second's rate limit may go at once, at least 16 KiB (default "
                        f"{DEFAULT_BURST:g}; 0 holds each limit to its steady rate, as a link's bottleneck does)")
    r.add_argument("--engine-socket", metavar="PATH",
                   help="Unix socket the co-located engine reads patches from (default $RUNTIME_DIRECTORY/engine.sock "
                        "under systemd, else DATA/engine.sock; 'off' for none)")
    r.add_argument("--super-seed", choices=("on", "off"),
                   help="trainer: hand distinct chunks to distinct peers before repeating any, so its uplink "
                        "carries each chunk about once (default on); off shows peers every chunk it holds, for "
                        "swarms whose rollout boxes cannot reach each other")
    r.add_argument("--cut-through", choices=("on", "off"),
                   help="relay the chunks this node is still fetching, each block as it arrives and checks out "
                        "against the trainer's signed block hashes (default on); off relays only whole chunks")
    r.add_argument("--push", metavar="LOCAL,CROSS",
                   help="relay: send each chunk, once a block of it checks out, unasked to up to LOCAL peers of "
                        "this region and CROSS other regions' designated crossers that lack it, saving each hop "
                        "the round trip of a request (default 2,2; off to only serve what is asked for)")
    add_follow_flags(r)
    add_current_flag(r)
    r.add_argument("--config", metavar="FILE", help="TOML settings file (keys as the flags, with underscores)")
    r.set_defaults(func=cmd_run)

    pb = sub.add_parser(
        "publish", help="hand a patch to the trainer's daemon, which signs and seeds it",
        description="Send every chunk of PATCH (from `sparrowd delta diff`) to the trainer's daemon, then its "
                    "manifest. The daemon signs each chunk's announcement as it arrives, so the swarm starts "
                    "moving chunks before the last is sent; the version is complete with the manifest. "
                    "Re-running after an interruption is safe: chunks the daemon already holds are acknowledged, "
                    "not stored twice.")
    pb.add_argument("patch", metavar="PATCH", nargs="?", help="a .sprw patch file (or use --checkpoint)")
    pb.add_argument("--checkpoint", metavar="DIR",
                    help="a Hugging Face checkpoint folder (or .safetensors file) to publish as --version: it is "
                         "diffed against the last one published from --state-dir, then kept there as the new base")
    pb.add_argument("--version", type=int, metavar="N", help="with --checkpoint: the version it is")
    pb.add_argument("--init", action="store_true",
                    help="with --checkpoint: record it as the base version N (what the nodes start from); a daemon "
                         "with nothing published yet also gets it as anchor N, for nodes that lack the base")
    pb.add_argument("--anchor", action="store_true",
                    help="with --checkpoint: publish it whole as anchor N (N the last published version, or a newer "
                         "one: the way to publish added, removed or reshaped tensors)")
    pb.add_argument("--anchor-every", type=int, metavar="K", default=DEFAULT_ANCHOR_EVERY,
                    help=f"with --checkpoint: after every K versions also publish an anchor, from which late nodes "
                         f"catch up (0: never; default {DEFAULT_ANCHOR_EVERY})")
    pb.add_argument("--state-dir", metavar="DIR",
                    help=f"with --checkpoint: where the last published checkpoint is kept "
                         f"(default {default_data_dir() / 'published'})")
    pb.add_argument("--values", choices=("ulp", "ulp2", "absolute"), default="ulp",
                    help="value mode (default ulp; ulp2, the smallest, needs rollout boxes that hold the base: an "
                         "anchor, --base, or their engine's own base folder, see docs/ROLLOUT.md)")
    pb.add_argument("--daemon", metavar="URL", default=os.environ.get("SPARROWD_DAEMON", "http://127.0.0.1:7070"),
                    help="the trainer's daemon (default $SPARROWD_DAEMON or http://127.0.0.1:7070)")
    pb.add_argument("--token-file", metavar="FILE", default=os.environ.get("SPARROWD_TOKEN_FILE"),
                    help="file holding the swarm token (default $SPARROWD_TOKEN_FILE)")
    pb.set_defaults(func=cmd_publish)

    j = sub.add_parser(
        "join", help="start a daemon in the background that joins the swarm at URL",
        description="Write the settings to DATA_DIR/sparrowd.toml, start `sparrowd run --config` on them in the "
                    "background (log in DATA_DIR/sparrowd.log) and wait until it holds a lease. Under systemd use "
                    "`sparrowd install` instead; `sparrowd leave` stops a daemon started this way.")
    j.add_argument("tracker", metavar="URL", help="the tracker (trainer's daemon), http://HOST:PORT")
    j.add_argument("--token-file", required=True, metavar="FILE", help="file holding the swarm token")
    j.add_argument("--region", required=True, metavar="NAME", help="region of this node")
    j.add_argument("--data-dir", metavar="DIR", help=f"state folder (default {default_data_dir()})")
    j.add_argument("--role", choices=("rollout", "relay"), default="rollout", help="default rollout")
    j.add_argument("--listen", metavar="HOST:PORT", help=f"default {DEFAULT_LISTEN}")
    j.add_argument("--advertise", metavar="HOST:PORT", help="address other nodes should use")
    j.add_argument("--node-id", metavar="ID", help="node id (default: generated once, kept in the data dir)")
    j.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                   help="how long to wait for the lease (default 30)")
    j.set_defaults(func=cmd_join)

    co = sub.add_parser(
        "checkout", help="write a version this node can produce as a model folder",
        description="Write VERSION (default: the newest this node can produce) as a Hugging Face model folder at "
                    "OUT: safetensors shards, config.json, the tokenizer, and sparrowd.json naming the version. It "
                    "reads the data dir's chunks (a running or a stopped daemon's; nothing there changes), starts "
                    "from an anchor and applies the patches after it, and checks every tensor against the "
                    "trainer's signed fingerprints before OUT appears.")
    co.add_argument("out", metavar="OUT", help="the folder to write (must not exist, unless --force)")
    co.add_argument("--data-dir", metavar="DIR", help=f"the node's state folder (default {default_data_dir()})")
    co.add_argument("--version", type=int, metavar="N", help="the version to write (default: the newest)")
    co.add_argument("--force", action="store_true", help="replace OUT if it exists")
    co.set_defaults(func=cmd_checkout)

    lv = sub.add_parser("leave", help="make the local daemon leave the swarm and stop",
                        description="Ask the daemon running on DATA_DIR to leave the swarm (its lease ends at once) "
                                    "and exit, and wait until it has.")
    lv.add_argument("--data-dir", metavar="DIR", help=f"the daemon's state folder (default {default_data_dir()})")
    lv.add_argument("--timeout", type=float, default=15.0, metavar="SECONDS", help="default 15")
    lv.set_defaults(func=cmd_leave)

    st = sub.add_parser("status", help="who is in the swarm: one row per node",
                        description="Print the tracker's status snapshot: one row per live node and the latest "
                                    "version. --json prints the snapshot itself (docs/STATUS.md).")
    add_tracker_args(st)
    st.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    st.set_defaults(func=cmd_status)

    w = sub.add_parser("wait", help="block until a version is held (or applied) across the swarm",
                       description="Wait until VERSION is held by every live node but the trainer (--applied: "
                                   "applied by every attached engine), as the tracker hears it: nodes report as "
                                   "soon as a version completes, so this returns when the transfer ends. Exits 0 "
                                   "then, 1 with the missing nodes after --timeout.")
    w.add_argument("version", type=int, metavar="VERSION")
    add_tracker_args(w)
    w.add_argument("--applied", action="store_true", help="wait for the engines to have applied it")
    w.add_argument("--engines", action="store_true", help="count only the nodes with an engine attached")
    w.add_argument("--nodes", metavar="ID,ID", help="only these nodes count (a node that is not live is missing)")
    w.add_argument("--fraction", type=float, metavar="F", help="settle for this share of the nodes (0 < F <= 1)")
    w.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS", help="default 60")
    w.set_defaults(func=cmd_wait)


# ---------------------------------------------------------------- run


def cmd_run(args) -> int:
    from sparrowd.daemon.app import run_daemon
    from sparrowd.daemon.logs import setup_logging

    settings = load_settings({k: getattr(args, k) for k in _SETTING_FLAGS}, config=args.config)
    setup_logging(settings.log_format, settings.log_level)
    return run_daemon(settings)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------- join and leave


def _toml_value(v) -> str:
    return json.dumps(v) if isinstance(v, str) else str(v)


def cmd_join(args) -> int:
    from sparrowd.daemon.app import RUNTIME_FILE, read_runtime

    seconds("--timeout", args.timeout)
    path_args(("--data-dir", args.data_dir), ("--token-file", args.token_file))
    data_dir = Path(args.data_dir or default_data_dir()).expanduser().absolute()
    flags = {"role": args.role, "tracker": args.tracker, "region": args.region, "data_dir": str(data_dir),
             "token_file": str(Path(args.token_file).expanduser().absolute()), "listen": args.listen,
             "advertise": args.advertise, "node_id": args.node_id}
    flags = {k: v for k, v in flags.items() if v is not None}
    settings = load_settings(flags, env={})  # check everything before writing anything
    read_token(settings.token_file)
    running = read_runtime(data_dir)
    if running and _alive(int(running.get("pid", 0))):
        raise InputError(f"a daemon already runs on {data_dir} (pid {running['pid']}); `sparrowd leave` first")
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    config = data_dir / "sparrowd.toml"
    with atomic_file(config) as tmp:
        Path(tmp).write_text("# written by `sparrowd join`\n" + "".join(f"{k} = {_toml_value(v)}\n"
                                                                       for k, v in flags.items()))
    log_path = data_dir / "sparrowd.log"
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "sparrowd.cli.main", "run", "--config", str(config)],
                                stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True,
                                env={k: v for k, v in os.environ.items() if not k.startswith("SPARROWD_")})
    token, _ = read_token(settings.token_file)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SparrowError(f"the daemon exited ({proc.returncode}): {_last_error(log_path)}")
        info = read_runtime(data_dir)
        if info and info.get("pid") == proc.pid:
            try:
                node = http_call(f"{info['url']}/v1/node", token, timeout=2.0)
            except SparrowError:
                node = {}
            if node.get("epoch") is not None:
                print(f"joined {args.tracker} as {node['node_id']} (region {node['region']}, epoch {node['epoch']}, "
                      f"{_count(len(node.get('peers', [])), 'peer')}); daemon pid {proc.pid}, log {log_path}")
                return 0
        time.sleep(0.1)
    raise SparrowError(f"no lease after {args.timeout:g} s (daemon pid {proc.pid} keeps trying; "
                       f"see {log_path}, or `sparrowd leave --data-dir {data_dir}`); {RUNTIME_FILE} "
                       f"{'written' if read_runtime(data_dir) else 'not written'}")


def _last_error(log_path: Path) -> str:
    try:
        lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    for line in reversed(lines):
        if "error" in line.lower() or "stopping" in line:
            return line.split("sparrowd: error: ", 1)[-1].strip()
    return lines[-1] if lines else "no log"


def cmd_checkout(args) -> int:
    from sparrowd.daemon.checkout import checkout

    from .progress import Progress

    if args.version is not None and args.version < 0:
        raise InputError("--version must be 0 or more")
    path_args(("OUT", args.out), ("--data-dir", args.data_dir))
    data_dir = Path(args.data_dir).expanduser() if args.data_dir else default_data_dir()
    prog = Progress(0, "chunks")
    try:
        version = checkout(data_dir, Path(args.out), args.version, force=args.force,
                           progress=lambda done, total: prog.at(done, total=total))
    finally:
        prog.close()
    print(f"version {version} written to {args.out}")
    return 0


def local_daemon(data_dir: str | None, hint: str = "") -> tuple[Path, dict, str]:
    """The daemon running on this machine's data dir: (data dir, its daemon.json, its token)."""
    from sparrowd.daemon.app import read_runtime

    folder = Path(path_arg("--data-dir", data_dir) or default_data_dir()).expanduser().absolute()
    info = read_runtime(folder)
    if not info or not _alive(int(info.get("pid", 0))):
        raise InputError(f"no daemon runs on {folder}{hint}")
    token, _ = read_token(Path(info["token_file"]))
    return folder, info, token


def cmd_leave(args) -> int:
    from sparrowd.daemon.app import read_runtime

    seconds("--timeout", args.timeout)
    data_dir, info, token = local_daemon(args.data_dir)
    http_call(f"{info['url']}/v1/node/leave", token, method="POST")
    deadline = time.monotonic() + args.timeout
    while _alive(int(info["pid"])) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(int(info["pid"])) and read_runtime(data_dir):
        raise SparrowError(f"daemon pid {info['pid']} is still running after {args.timeout:g} s")
    print(f"{info['node_id']} left the swarm; daemon pid {info['pid']} stopped")
    return 0


# ---------------------------------------------------------------- status


def add_tracker_args(p) -> None:
    """--tracker and --token-file, for the commands that read the tracker's status."""
    p.add_argument("--tracker", metavar="URL", default=os.environ.get("SPARROWD_TRACKER"),
                   help="the trainer's daemon, http://HOST:PORT (default $SPARROWD_TRACKER)")
    p.add_argument("--token-file", metavar="FILE", default=os.environ.get("SPARROWD_TOKEN_FILE"),
                   help="file holding the swarm token (default $SPARROWD_TOKEN_FILE)")


def fetch_status(tracker: str, token_file: str) -> dict:
    if not tracker:
        raise InputError("give --tracker http://HOST:PORT (or set SPARROWD_TRACKER)")
    check_url(tracker, "--tracker")
    if not token_file:
        raise InputError("give --token-file FILE (or set SPARROWD_TOKEN_FILE)")
    token, _ = read_token(Path(token_file).expanduser())
    return tracker_status(tracker, token)


def cmd_status(args) -> int:
    snap = fetch_status(args.tracker, args.token_file)
    if args.json:
        print(json.dumps(snap, indent=2))
    else:
        print(render_status(snap))
    return 0


def cmd_wait(args) -> int:
    import time

    from sparrowd.client import wait_arrival

    if args.version < 0 or (args.fraction is not None and not 0 < args.fraction <= 1):
        raise InputError("VERSION must be 0 or more, --fraction in (0, 1]")
    seconds("--timeout", args.timeout)
    nodes = None
    if args.nodes is not None:
        nodes = [check_name("--nodes: node id", n.strip()) for n in args.nodes.split(",") if n.strip()]
        if not nodes:
            raise InputError(f"--nodes {args.nodes!r}: give node ids, comma-separated")
    fetch_status(args.tracker, args.token_file)  # the same checks and errors as status
    token, _ = read_token(Path(args.token_file).expanduser())
    t0 = time.monotonic()
    a = wait_arrival(args.tracker, token, args.version, applied=args.applied, engines=args.engines,
                     nodes=nodes, fraction=args.fraction, timeout=args.timeout)
    what = "applied on" if args.applied else "held by"
    print(f"version {args.version} {what} {_count(len(a['reached']), 'node')} "
          f"({a['needed']} needed) after {time.monotonic() - t0:.2f} s")
    return 0


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


# ---------------------------------------------------------------- publish


def _publish_checkpoint(args, token: str) -> int:
    """``--checkpoint``: the library's ``publish_checkpoint``, the state dir under the data dir by default."""
    from sparrowd.publishing import publish_checkpoint

    state = args.state_dir or default_data_dir() / "published"
    publish_checkpoint(args.checkpoint, args.version, daemon=args.daemon, token=token, state_dir=state,
                       values=args.values, init=args.init, anchor=args.anchor, anchor_every=args.anchor_every,
                       on_patch=_warn_base)
    return 0


def cmd_publish(args) -> int:
    path_args(("PATCH", args.patch), ("--checkpoint", args.checkpoint), ("--state-dir", args.state_dir))
    check_url(args.daemon, "--daemon")
    if not args.token_file:
        raise InputError("give --token-file FILE (or set SPARROWD_TOKEN_FILE)")
    token, _ = read_token(Path(args.token_file).expanduser())
    if (args.patch is None) == (args.checkpoint is None):
        raise InputError("give a PATCH file or --checkpoint DIR, one of the two")
    if args.checkpoint:
        return _publish_checkpoint(args, token)
    m, sent, new = publish_file(args.patch, args.daemon, token)
    state = "published" if new else "was already published"
    print(f"version {m.version} (base {m.base_version}) {state}: {_count(len(m.chunks), 'chunk')}, "
          f"{m.patch_bytes} bytes, {sent} sent now")
    _warn_base(m, published_state(args.daemon, token)["anchor"])
    return 0


def _warn_base(m, anchor: int | None) -> None:
    """An ``ulp2`` patch decodes only against its base's bits: say, in one line, what a rollout box
    needs when no anchor in the swarm carries that base."""
    from sparrowd.codec.chunk import ULP2

    if m.values == ULP2 and m.base_version is not None and (anchor is None or anchor > m.base_version):
        print(f"warning: version {m.version} is ulp2, coded against base {m.base_version}, and no anchor in the "
              f"swarm carries that base: each rollout box needs it locally (sparrowd run --base DIR, or an engine "
              f"started from that folder) or an anchor (sparrowd publish --checkpoint DIR --anchor, or --values "
              f"ulp)", file=sys.stderr)
