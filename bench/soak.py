"""The soak as a script: same as ``sparrowd bench soak`` (see --help). Figures go to docs/RELIABILITY.md."""

import sys

from sparrowd.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "soak", *sys.argv[1:]]))
