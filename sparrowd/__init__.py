"""sparrowd: sparse, bit-exact RL weight distribution over ordinary links.

The daemon and the codec need no torch; ``sparrowd.integrations`` holds the
parts that do.
"""

from .errors import BaseMismatchError, FormatError, InputError, IntegrityError, SparrowError, StaleEnginesError

__version__ = "0.1.0"

__all__ = ["SparrowError", "FormatError", "IntegrityError", "BaseMismatchError", "InputError", "StaleEnginesError",
           "Publisher", "__version__"]


def __getattr__(name):
    if name == "Publisher":  # imported on first use: it needs torch, the daemon does not
        from .publisher import Publisher

        return Publisher
    raise AttributeError(f"module 'sparrowd' has no attribute {name!r}")
