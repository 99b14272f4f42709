"""``sparrowd bench``: measurements that print figures beside a baseline from the same run."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark and print its figures",
                       description="Benchmarks print what they measured beside a baseline measured in the same run.")
    bs = p.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    c = bs.add_parser("codec", help="bits per changed element and throughput of the patch codec",
                      description="Train a small transformer a few AdamW steps (needs torch) and measure the codec "
                                  "on its real deltas, plus synthetic ones; baselines computed in the same run.")
    c.add_argument("--steps", type=int, default=4, help="training steps for the real deltas (default 4)")
    c.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (default 1e-6)")
    c.add_argument("--size-mib", type=int, default=512, help="bf16 bytes of each side of the throughput pair (default 512)")
    c.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    c.set_defaults(func=cmd_codec)


def cmd_codec(args) -> int:
    from sparrowd.bench.codec import run

    return run(steps=args.steps, lr=args.lr, size_mib=args.size_mib, json_path=args.json)
