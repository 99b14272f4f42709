"""The swarm benchmark as a script: same as ``sparrowd bench swarm`` (see --help)."""

import sys

from sparrowd.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "swarm", *sys.argv[1:]]))
