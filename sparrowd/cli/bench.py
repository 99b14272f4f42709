"""``sparrowd bench``: measurements that print figures beside a baseline from the same run."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from .checks import at_least, out_file, positive, seconds


def json_file(value: str) -> str:
    """``--json FILE``: refused before a long run when its folder cannot take the file."""
    folder = Path(value).parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{value}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{value}: folder {folder} is not writable")
    if Path(value).is_dir():
        raise argparse.ArgumentTypeError(f"{value}: is a folder")
    return value


def register(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark and print its figures",
                       description="Benchmarks print what they measured beside a baseline measured in the same run.")
    bs = p.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    c = bs.add_parser("codec", help="bits per changed element and throughput of the patch codec",
                      description="Train a small transformer a few AdamW steps (needs torch) and measure the codec "
                                  "on its real deltas, plus synthetic ones; baselines computed in the same run.")
    c.add_argument("--steps", type=int, default=4, help="training steps for the real deltas (default 4)")
    c.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (default 1e-6)")
    c.add_argument("--size-mib", type=int, default=512,
                   help="bf16 bytes of each side of the throughput pair (default 512)")
    c.add_argument("--model", choices=("5m", "27m"), default="5m",
                   help="the transformer trained for the real deltas: a GPT-style decoder of 5.3M or 27.4M "
                        "parameters from a random init (default 5m; the pretrained all-MiniLM-L6-v2 of the "
                        "docs' ulp2 figure: python bench/minilm.py from a checkout)")
    c.add_argument("--json", metavar="FILE", type=json_file, help="also write the figures as JSON")
    c.set_defaults(func=cmd_codec)
    register_swarm(bs)
    register_sim(bs)
    register_publish(bs)
    register_apply(bs)
    register_serve(bs)
    register_rl(bs)
    register_coldstart(bs)
    register_tracker(bs)


def cmd_codec(args) -> int:
    from sparrowd.bench.codec import run

    at_least("--steps", args.steps)
    at_least("--size-mib", args.size_mib)
    positive("--lr", args.lr)
    return run(steps=args.steps, lr=args.lr, size_mib=args.size_mib, json_path=args.json, model=args.model)


def _link_options(s, link_help: str = "") -> None:
    """The emulated WAN's rates and RTT, shared by ``bench swarm`` and ``bench sim``."""
    s.add_argument("--trainer-rate", default="4M", help="trainer uplink, bytes/s (default 4M)")
    s.add_argument("--node-rate", default="8M", help="rollout uplinks, bytes/s (default 8M)")
    s.add_argument("--wan-rate", default="4M", help="per-node cross-region upload limit, bytes/s (default 4M)")
    s.add_argument("--rtt", type=float, default=0.08, help="round-trip time between regions, seconds (default 0.08)")
    s.add_argument("--link-rate", default="32M",
                   help=f"bandwidth of each ordered pair of regions, bytes/s (default 32M{link_help})")
    s.add_argument("--no-cut-through", action="store_true",
                   help="relays hand on whole chunks only (the daemons' --cut-through off), for comparison")
    s.add_argument("--push", metavar="LOCAL,CROSS", default="2,2",
                   help="relays push each chunk, unasked, to up to LOCAL peers of their region and CROSS other "
                        "regions' crossers (the daemons' --push; default 2,2; off to compare with pull alone)")


_RATES = ("trainer_rate", "node_rate", "wan_rate", "link_rate")


def _check_links(args, *, unlimited: tuple[str, ...] = ()) -> dict[str, int]:
    """The options ``bench swarm`` and ``bench sim`` share, checked (InputError, one line); returns
    the rates in bytes per second. A rate named in ``unlimited`` may be 0 (no limit)."""
    at_least("--regions", args.regions)
    at_least("--versions", args.versions)
    return _check_wan(args, _RATES, unlimited=unlimited)


def _check_wan(args, names: tuple[str, ...], *, unlimited: tuple[str, ...] = ()) -> dict[str, int]:
    """The emulated WAN's --rtt and the rates ``names`` (of ``args``), checked (InputError, one line);
    returns the rates in bytes per second. A rate named in ``unlimited`` may be 0 (no limit)."""
    from sparrowd.errors import InputError
    from sparrowd.sizes import parse_size

    seconds("--rtt", args.rtt)
    rates = {}
    for k in names:
        flag = "--" + k.replace("_", "-")
        try:
            rates[k] = parse_size(getattr(args, k))
        except ValueError as e:
            raise InputError(f"{flag}: {e}") from None
        if rates[k] <= 0 and k not in unlimited:
            raise InputError(f"{flag} {getattr(args, k)}: give a rate above 0")
    return rates


def _chunk(text: str) -> int:
    """``--chunk``: a size the codec cuts chunks at and the daemons carry."""
    from sparrowd.codec.patch import MIN_CHUNK_SIZE
    from sparrowd.daemon.swarm import MAX_CHUNK
    from sparrowd.errors import InputError
    from sparrowd.sizes import format_bytes, parse_size

    try:
        size = parse_size(text)
    except ValueError as e:
        raise InputError(f"--chunk: {e}") from None
    if not MIN_CHUNK_SIZE <= size <= MAX_CHUNK:
        raise InputError(f"--chunk {text}: give a size from {format_bytes(MIN_CHUNK_SIZE)} to "
                         f"{format_bytes(MAX_CHUNK)}")
    return size


def _push(args) -> tuple[int, int]:
    from sparrowd.errors import InputError
    from sparrowd.swarm.push import parse_push

    try:
        return parse_push(args.push)
    except ValueError as e:
        raise InputError(f"--push: {e}") from None


def register_swarm(bs) -> None:
    s = bs.add_parser("swarm", help="a trainer and N rollout daemons on loopback, against star distribution",
                      description="Run a trainer and N rollout daemons as separate processes on loopback in R "
                                  "regions, with the WAN between regions emulated (RTT and per-link bandwidth by "
                                  "TCP proxies, uplinks by the daemons' rate limits), publish versions, "
                                  "and report time to all nodes, trainer upload and cross-region bytes; then "
                                  "measure star distribution (every node pulls from the trainer) in the same run.")
    s.add_argument("--nodes", type=int, default=16, help="rollout daemons (default 16)")
    s.add_argument("--regions", type=int, default=4, help="regions (default 4)")
    s.add_argument("--patch-mib", type=float, default=64, help="patch size in MiB (default 64)")
    s.add_argument("--versions", type=int, default=2, help="versions to publish (default 2)")
    s.add_argument("--interval", type=float, default=0.0, metavar="SECONDS",
                   help="seconds between one version held everywhere and the next publish, as an RL step's "
                        "length (default 0: back to back)")
    s.add_argument("--settle", type=float, default=0.0, metavar="SECONDS",
                   help="seconds between the tracker listing every node and the first publish (default 0: at "
                        "once, a swarm's first version as it forms)")
    s.add_argument("--chunk", default="auto",
                   help="chunk size, e.g. 512K (default auto: as the Publisher cuts a patch: whole where the "
                        "trainer sends it in 4 round trips, else a sixteenth of it between 256K and 2M, a "
                        "thirty-second from 128K past 16 rollouts)")
    _link_options(s, link_help="; 0: none")
    from sparrowd.swarm.bucket import DEFAULT_BURST

    s.add_argument("--rate-burst", type=float, default=DEFAULT_BURST, metavar="SECONDS",
                   help=f"the daemons' --rate-burst: how much of a second's upload limit may go at once (default "
                        f"{DEFAULT_BURST:g}, theirs; 0: uplinks held to their rate from the first byte, as "
                        "`bench sim`'s links)")
    s.add_argument("--time-scale", type=float, default=1.0, metavar="FACTOR",
                   help="run the same swarm FACTOR times slower: every rate divided by it, the RTT, bursts, "
                        "--settle and --interval multiplied, so the bound grows by FACTOR while the daemons' CPU "
                        "cost per hop does not (default 1; try 5 to tell a small box's CPUs from the design)")
    s.add_argument("--no-star", action="store_true", help="skip the star baseline")
    s.add_argument("--keep", action="store_true", help="keep the daemons' folders and logs")
    s.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"),
                   help="the daemons' log level (default warning; debug logs every chunk stored)")
    s.add_argument("--json", metavar="FILE", type=json_file, help="also write the figures as JSON")
    s.set_defaults(func=cmd_swarm)


def cmd_swarm(args) -> int:
    from sparrowd.bench.swarm import run
    from sparrowd.errors import InputError

    _check_links(args, unlimited=("node_rate", "wan_rate", "link_rate"))
    at_least("--nodes", args.nodes)
    positive("--patch-mib", args.patch_mib)
    if args.regions > args.nodes:
        raise InputError(f"--regions {args.regions} is more than --nodes {args.nodes}: every region needs a rollout")
    for name in ("interval", "settle", "rate_burst"):
        seconds(f"--{name.replace('_', '-')}", getattr(args, name))
    if not (math.isfinite(args.time_scale) and 1 <= args.time_scale <= 100):
        raise InputError(f"--time-scale {args.time_scale:g}: give a factor from 1 to 100")
    if args.chunk != "auto":
        _chunk(args.chunk)
    return run(nodes=args.nodes, regions=args.regions, patch_mib=args.patch_mib, versions=args.versions,
               chunk=args.chunk, trainer_rate=args.trainer_rate, node_rate=args.node_rate, wan_rate=args.wan_rate,
               rtt=args.rtt, link_rate=args.link_rate, cut_through=not args.no_cut_through, push=_push(args),
               star=not args.no_star, json_path=args.json, keep=args.keep, log_level=args.log_level,
               interval=args.interval, settle=args.settle, rate_burst=args.rate_burst, time_scale=args.time_scale)


def register_sim(bs) -> None:
    s = bs.add_parser("sim", help="the swarm's own decision code at any scale, on a virtual clock",
                      description="A discrete-event simulation that drives the real lease table, picker, choker and "
                                  "super-seeding with a virtual clock and a fluid link model (uplinks, per-node WAN "
                                  "limits, per-region-pair links and RTT), at 16 to 10,000 nodes. Reports time to "
                                  "all over the lower bound, trainer upload and cross-region bytes per version; "
                                  "star distribution's time is the baseline. Same defaults as `bench swarm`, whose "
                                  "figures it reproduces at 16 nodes.")
    s.add_argument("--nodes", default="16,100,1000",
                   help="rollout node counts, comma-separated (default 16,100,1000: about 5 minutes on 2 cores; "
                        "10000 takes 20-40 minutes a version)")
    s.add_argument("--regions", type=int, default=8, help="regions (default 8)")
    s.add_argument("--patch-mib", default="6", help="patch sizes in MiB, comma-separated (default 6)")
    s.add_argument("--versions", type=int, default=2, help="versions per run (default 2)")
    s.add_argument("--chunk", default="auto",
                   help="chunk size, e.g. 512K (default auto, as the Publisher cuts for each swarm size and trainer "
                        "uplink)")
    _link_options(s)
    s.add_argument("--rate-burst", type=float, default=0.0, metavar="SECONDS",
                   help="seconds of each upload limit's rate a node sends at once after a quiet spell, as the "
                        "daemons' token buckets do (default 0: links at their steady rate from the first byte; "
                        "0.1, the daemons' default, to compare with `bench swarm`)")
    s.add_argument("--churn", type=float, default=0.0,
                   help="fraction of the nodes that leave halfway through the last version (default 0; try 0.1)")
    s.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    s.add_argument("--plot", metavar="SVG", help="also plot time to all over the bound against N (an SVG file)")
    s.add_argument("--json", metavar="FILE", type=json_file, help="also write the figures as JSON")
    s.add_argument("--trace", metavar="FILE", type=json_file,
                   help="also write every chunk request's events (asked, pushed, refused, failed, cut, stored, "
                        "wasted: when, which node of which region asked which peer for which chunk) as JSON Lines, "
                        "to see where a version's time goes")
    s.set_defaults(func=cmd_sim)


def cmd_sim(args) -> int:
    from sparrowd.bench.sim import run
    from sparrowd.errors import InputError

    try:
        nodes = [int(x) for x in args.nodes.split(",") if x.strip()]
        patches = [float(x) for x in args.patch_mib.split(",") if x.strip()]
    except ValueError:
        raise InputError("--nodes takes comma-separated integers, --patch-mib comma-separated numbers") from None
    if not nodes or min(nodes) < 1 or not patches or not all(math.isfinite(p) and p > 0 for p in patches):
        raise InputError("--nodes must be at least 1 and --patch-mib positive")
    push = _push(args)
    rates = _check_links(args)
    if not 0 <= args.churn < 1:
        raise InputError(f"--churn {args.churn}: give a fraction in [0, 1)")
    seconds("--rate-burst", args.rate_burst)
    if args.plot is not None:
        folder = out_file("--plot", args.plot).parent
        if not os.access(folder, os.W_OK | os.X_OK):
            raise InputError(f"--plot {args.plot}: its folder {folder} is not writable")
    return run(nodes=nodes, regions=args.regions, patch_mib=patches, versions=args.versions,
               chunk=None if args.chunk == "auto" else _chunk(args.chunk), rtt=args.rtt, churn=args.churn,
               seed=args.seed, json_path=args.json, plot=args.plot, cut_through=not args.no_cut_through,
               trace_path=args.trace, push=push, burst=args.rate_burst, **rates)


def _register_sized(bs, name: str, help: str, description: str, size_mib: int, extra=(), module: str = ""):
    """A benchmark of a model of --size-mib over --steps steps: ``sparrowd.bench.<module>.run`` (``module``:
    ``name`` unless given); ``extra`` names further options passed on as keywords."""
    s = bs.add_parser(name, help=help, description=description)
    s.add_argument("--size-mib", type=int, default=size_mib, help=f"model size in MiB of bf16 (default {size_mib})")
    s.add_argument("--steps", type=int, default=3, help="steps to publish (default 3)")
    s.add_argument("--json", metavar="FILE", type=json_file, help="also write the figures as JSON")
    s.set_defaults(func=lambda args: _run_sized(module or name, args, extra))
    return s


def _run_sized(name: str, args, extra=()) -> int:
    import importlib

    at_least("--size-mib", args.size_mib)
    at_least("--steps", args.steps)
    run = importlib.import_module(f"sparrowd.bench.{name}").run
    return run(size_mib=args.size_mib, steps=args.steps, json_path=args.json, **{k: getattr(args, k) for k in extra})


def register_publish(bs) -> None:
    s = _register_sized(
        bs, "publish", "the Publisher on a synthetic bf16 model, against bare passes",
        "Start a trainer daemon on loopback and publish a synthetic bf16 model with about 1% of elements changed "
        "per step. On the CPU, report publish time against a numpy pass that only compares the same tensors "
        "(target: at most 1.5x); on a GPU (or with --compare torch), the bandwidth of compare-and-extract against "
        "the device's copy bandwidth (target: at least half). Also the time to the first chunk.",
        1024, extra=("device", "compare", "values"))
    s.add_argument("--device", default="cpu", help="where the model lives: cpu (default), cuda, cuda:1, ...")
    s.add_argument("--values", choices=("ulp", "ulp2"), default="ulp",
                   help="the patches' value mode (default ulp; ulp2 codes against the base and the change history, "
                        "docs/FORMAT.md)")
    s.add_argument("--compare", choices=("auto", "torch"), default="auto",
                   help="the Publisher's compare: auto (fused C pass on the CPU, torch on devices; default) or "
                        "torch (the device path, on the CPU too)")


def register_apply(bs) -> None:
    s = _register_sized(
        bs, "apply", "an engine's update pause against reloading the checkpoint",
        "Start a trainer daemon on loopback and an engine on a random Qwen3; publish steps that move about 1% of "
        "elements and report the pause of each update through the engine socket against reloading the whole "
        "checkpoint in the same engine. --engine vllm (default) runs a vLLM engine (CPU) and needs vLLM: run it "
        "from the engine environment. --engine torch needs only torch: a state dict on --device (cuda on a GPU box) "
        "updated by PatchApplier, the code the vLLM extension runs on each worker.", 512, extra=("engine", "device"))
    s.add_argument("--engine", choices=("vllm", "torch"), default="vllm",
                   help="vllm: a vLLM engine (default); torch: a PatchApplier over a state dict on --device")
    s.add_argument("--device", default="cpu", help="with --engine torch, where the weights live: cpu (default), "
                                                   "cuda, cuda:1, ...")


def register_serve(bs) -> None:
    s = _register_sized(
        bs, "serve", "a live vllm serve's request latency across updates, against requests with none",
        "Start a trainer daemon, a rollout daemon in follow mode and a real vllm serve with the sparrowd backend "
        "(CPU) on a random Qwen3; send greedy requests from client threads, first with no update, then while "
        "--steps versions (about 1%% of elements each) are published. Report the p50 and p99 latency of requests "
        "that straddle an update beside those with none, and each update's pause beside vLLM reloading the whole "
        "checkpoint in the same server. Needs vLLM: run it from the engine environment.", 256,
        extra=("clients", "max_tokens", "baseline_s", "gap_s"), module="vllm_latency")
    s.add_argument("--clients", type=int, default=4, help="client threads sending requests (default 4)")
    s.add_argument("--max-tokens", type=int, default=48, help="tokens per request (default 48)")
    s.add_argument("--baseline-s", type=float, default=20.0, help="seconds of requests with no update (default 20)")
    s.add_argument("--gap-s", type=float, default=6.0, help="seconds between published versions (default 6)")


_WAN_RATES = ("link_rate", "trainer_rate")  # add_wan_flags's rates; a link rate of 0 is no limit


def add_wan_flags(s, d) -> None:
    """The emulated WAN's flags (bench rl, bench coldstart, checked by ``_check_wan(args, _WAN_RATES)``);
    ``d`` is the benchmark's default config."""
    s.add_argument("--link-rate", default=d.link_rate,
                   help=f"each ordered pair of regions, bytes/s (default {d.link_rate})")
    s.add_argument("--trainer-rate", default=d.trainer_rate,
                   help=f"the trainer's uplink, bytes/s (default {d.trainer_rate})")
    s.add_argument("--rtt", type=float, default=d.rtt, help=f"round-trip time between regions, s (default {d.rtt})")


def register_rl(bs) -> None:
    from sparrowd.bench.rl import RLConfig

    d = RLConfig()
    s = bs.add_parser(
        "rl", help="an RL loop across emulated regions: full broadcast, star, swarm and ideal, in one run",
        description="Train a tiny Qwen3 with a GRPO-style update on a verifiable reward, sampling on real vllm "
                    "serve processes (CPU) in regions other than the trainer's, four times with the same seeds: "
                    "weights handed over by full-checkpoint broadcast (vLLM's own reload), sparrowd patches from "
                    "the trainer only (star), the sparrowd swarm, and at no cost (ideal). Reports step time, "
                    "tokens per second, the rollout servers' idle fraction and WAN bytes per step, and fails if "
                    "rewards or weights differ between strategies at any step. Needs vLLM: run it from the engine "
                    "environment.")
    s.add_argument("--quick", action="store_true", help="a small run (3 steps, a smaller model): the suite's check")
    s.add_argument("--servers", type=int, default=d.servers, help=f"vllm serve processes, 2 to 4 (default {d.servers})")
    s.add_argument("--steps", type=int, help=f"RL steps per strategy (default {d.steps}; --quick 3)")
    s.add_argument("--on-policy", action="store_true",
                   help="generation k waits for version k-1 (default: one-step off-policy, as SparrowRL)")
    add_wan_flags(s, d)
    s.add_argument("--strategies", default=",".join(d.strategies),
                   help="which of full, star, swarm, ideal to run, in order (default all)")
    s.add_argument("--churn", action="store_true",
                   help="then the swarm again while boxes come and go: after a third of the steps one box (daemon "
                        "and vllm serve) is killed and an empty one joins, boots from the swarm and is kept current "
                        "by follow mode; the trainer side is unchanged. Reports each server's version per step")
    s.add_argument("--join-pace", type=float, default=d.join_pace, metavar="SECONDS",
                   help="with --churn: while the empty box boots, each step lasts at least SECONDS (default 0). The "
                        "emulated boxes share this machine's CPUs, so steps run back to back slow the joiner's vLLM "
                        "start; a real box boots on its own")
    s.add_argument("--json", metavar="FILE", type=json_file, help="also write the figures as JSON")
    s.add_argument("--plot", metavar="PNG", type=json_file, help="also draw tokens/s and the step split (matplotlib)")
    s.add_argument("--keep", action="store_true", help="keep the run's folders and logs")
    s.set_defaults(func=cmd_rl)


def cmd_rl(args) -> int:
    from sparrowd.bench.rl import RLConfig, run
    from sparrowd.errors import InputError

    names = tuple(n.strip() for n in args.strategies.split(",") if n.strip())
    if not names or set(names) - {"full", "star", "swarm", "ideal"}:
        raise InputError(f"--strategies {args.strategies!r}: name some of full, star, swarm, ideal")
    if not 2 <= args.servers <= 4:
        raise InputError("--servers must be 2 to 4")
    _check_wan(args, _WAN_RATES, unlimited=("link_rate",))
    if not 0 <= args.join_pace <= 600:
        raise InputError(f"--join-pace {args.join_pace}: give seconds from 0 to 600")
    if args.join_pace and not args.churn:
        raise InputError("--join-pace paces the steps while a box joins: give it with --churn")
    kw = {"servers": args.servers, "on_policy": args.on_policy, "join_pace": args.join_pace,
          "link_rate": args.link_rate, "trainer_rate": args.trainer_rate, "rtt": args.rtt,
          "strategies": names + ("churn",) * args.churn}
    if args.steps is not None:
        if args.steps < 1:
            raise InputError("--steps must be at least 1")
        kw["steps"] = args.steps
    cfg = RLConfig.quick(**kw) if args.quick else RLConfig(**kw)
    return run(cfg, json_path=args.json, plot_path=args.plot, keep=args.keep)


def register_coldstart(bs) -> None:
    from sparrowd.bench.coldstart import ColdstartConfig

    d = ColdstartConfig()
    s = bs.add_parser(
        "coldstart", help="empty boxes in several regions boot the current policy from the swarm at once",
        description="A trainer (uplink capped) publishes a model with its config and tokenizer and a few RL-like "
                    "versions; then empty rollout boxes in several emulated regions join at once and each writes "
                    "DATA/current from the newest anchor and the patches after it. Reports the time until every "
                    "box's folder is ready against the bound (model size over the trainer's uplink) and the "
                    "trainer's upload over the model's size, then the same for every box downloading the "
                    "checkpoint from the trainer over HTTP (star). Needs torch.")
    s.add_argument("--model-mib", type=int, default=d.model_mib, help=f"model size (default {d.model_mib})")
    s.add_argument("--boxes", type=int, default=d.boxes, help=f"empty boxes that join (default {d.boxes})")
    s.add_argument("--regions", type=int, default=d.regions, help=f"the boxes' regions (default {d.regions})")
    s.add_argument("--versions", type=int, default=d.versions, help=f"versions published (default {d.versions})")
    s.add_argument("--anchor-every", type=int, default=d.anchor_every,
                   help=f"the trainer's anchor cadence (default {d.anchor_every})")
    s.add_argument("--node-rate", default=d.node_rate, help=f"each box's uplink (default {d.node_rate})")
    add_wan_flags(s, d)
    s.add_argument("--no-star", action="store_true", help="skip the plain-download comparison (it takes "
                                                          "boxes x model / uplink)")
    s.add_argument("--json", metavar="FILE", type=json_file, help="also write the figures as JSON")
    s.set_defaults(func=cmd_coldstart)


def cmd_coldstart(args) -> int:
    from sparrowd.bench.coldstart import ColdstartConfig, run
    from sparrowd.errors import InputError

    if args.model_mib < 8 or args.boxes < 1 or args.regions < 1 or args.versions < 1 or args.anchor_every < 1:
        raise InputError("--model-mib must be at least 8, and --boxes, --regions, --versions, --anchor-every at "
                         "least 1")
    _check_wan(args, ("node_rate", *_WAN_RATES), unlimited=("node_rate", "link_rate"))
    cfg = ColdstartConfig(model_mib=args.model_mib, boxes=args.boxes, regions=args.regions, versions=args.versions,
                          anchor_every=args.anchor_every, trainer_rate=args.trainer_rate, node_rate=args.node_rate,
                          link_rate=args.link_rate, rtt=args.rtt, star=not args.no_star)
    run(cfg, json_path=args.json)
    return 0


def register_tracker(bs) -> None:
    from sparrowd.bench.tracker import TrackerConfig

    d = TrackerConfig()
    s = bs.add_parser(
        "tracker", help="joins and renewals per second one tracker takes, and the largest swarm it holds",
        description="The lease table in process on one core (with its SQLite store, and without it as the "
                    "baseline) for each swarm size, then a real trainer daemon on loopback joined and renewed by "
                    "fake nodes over HTTP, its CPU time read from /proc. Reports memory per lease and the largest "
                    "swarm one tracker holds at the default TTL.")
    sizes = ",".join(str(n) for n in d.sizes)
    s.add_argument("--sizes", default=sizes,
                   help=f"swarm sizes for the in-process table, comma-separated (default {sizes})")
    s.add_argument("--nodes", type=int, default=d.nodes, help=f"fake nodes over HTTP (default {d.nodes})")
    s.add_argument("--concurrency", type=int, default=d.concurrency,
                   help=f"connections the HTTP load uses (default {d.concurrency})")
    s.add_argument("--seconds", type=float, default=d.seconds,
                   help=f"how long the HTTP renewals run (default {d.seconds:g})")
    s.add_argument("--json", metavar="FILE", type=json_file, help="also write the figures as JSON")
    s.set_defaults(func=cmd_tracker)


def cmd_tracker(args) -> int:
    from sparrowd.bench.tracker import TrackerConfig, run
    from sparrowd.errors import InputError

    try:
        sizes = tuple(int(x) for x in args.sizes.split(",") if x.strip())
    except ValueError:
        raise InputError(f"--sizes takes comma-separated integers, not {args.sizes!r}") from None
    if not sizes or min(sizes) < 1 or args.nodes < 1 or args.concurrency < 1 or not args.seconds > 0:
        raise InputError("--sizes, --nodes and --concurrency must be at least 1, and --seconds positive")
    run(TrackerConfig(sizes=sizes, nodes=args.nodes, concurrency=args.concurrency, seconds=args.seconds),
        json_path=args.json)
    return 0
