"""The ``sparrowd`` command: one entry point, one subcommand module per area."""

from __future__ import annotations

import argparse
import sys

from sparrowd import __version__
from sparrowd.errors import SparrowError

from . import bench, daemon, delta, demo, install, token, top


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sparrowd",
        description="Sparse, bit-exact RL weight distribution: ship only the changed bf16 elements, swarm-style.",
    )
    p.add_argument("--version", action="version", version=f"sparrowd {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo.register(sub)
    daemon.register(sub)
    delta.register(sub)
    bench.register(sub)
    top.register(sub)
    install.register(sub)
    token.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except SparrowError as e:
        print(f"sparrowd: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        print(f"sparrowd: error: {e.strerror or e}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("sparrowd: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
