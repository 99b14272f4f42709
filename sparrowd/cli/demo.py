"""``sparrowd demo``: the whole system on one machine, in about a minute."""

from __future__ import annotations


def register(sub) -> None:
    d = sub.add_parser(
        "demo", help="run a trainer and rollout daemons on this machine and watch trained weights spread",
        description="Start a trainer and several rollout daemons in two or more regions on loopback, train a "
                    "small model for a few AdamW steps, publish each step, show each version reaching every node "
                    "and check every node's weights against the trainer's, bit for bit. Cleans up after itself.")
    d.add_argument("--nodes", type=int, default=4, help="rollout daemons (default 4)")
    d.add_argument("--regions", type=int, default=2, help="regions they are spread over (default 2)")
    d.add_argument("--steps", type=int, default=5, help="training steps, each a version (default 5)")
    d.add_argument("--keep", action="store_true", help="keep the daemons' data dirs and logs")
    d.set_defaults(func=cmd_demo)


def cmd_demo(args) -> int:
    from sparrowd.demo import run

    return run(nodes=args.nodes, regions=args.regions, steps=args.steps, keep=args.keep)
