#!/usr/bin/env python3
"""The codec benchmark as a script: same as ``sparrowd bench codec`` (see --help and sparrowd/bench/codec.py)."""

import sys

from sparrowd.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "codec", *sys.argv[1:]]))
