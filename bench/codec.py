#!/usr/bin/env python3
"""Codec benchmark: the same as ``sparrowd bench codec`` (see sparrowd/bench/codec.py)."""

from __future__ import annotations

import argparse
import sys

from sparrowd.bench.codec import run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Bits per changed element and throughput of the sparrowd patch codec, "
                                            "beside baselines measured in the same run (needs torch).")
    p.add_argument("--steps", type=int, default=4, help="training steps for the real deltas (default 4)")
    p.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (default 1e-6)")
    p.add_argument("--size-mib", type=int, default=512, help="bf16 MiB of each side of the throughput pair (default 512)")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = p.parse_args(argv)
    return run(steps=args.steps, lr=args.lr, size_mib=args.size_mib, json_path=args.json)


if __name__ == "__main__":
    sys.exit(main())
