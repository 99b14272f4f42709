"""sparrowd: sparse, bit-exact RL weight distribution over ordinary links.

The daemon and the codec need no torch; ``sparrowd.integrations`` holds the
parts that do.
"""

from .errors import BaseMismatchError, FormatError, InputError, IntegrityError, SparrowError

__version__ = "0.1.0"

__all__ = ["SparrowError", "FormatError", "IntegrityError", "BaseMismatchError", "InputError", "__version__"]
