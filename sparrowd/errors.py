"""The one error family of sparrowd.

Every error that sparrowd raises on purpose derives from :class:`SparrowError`,
carries a one-line message meant for a person, and is turned into a non-zero
exit status by the command line. Lower-level errors (OSError, zstd, msgpack)
are translated into these at the boundary of the layer that met them.
"""

from __future__ import annotations

__all__ = [
    "SparrowError",
    "FormatError",
    "IntegrityError",
    "BaseMismatchError",
    "InputError",
    "OutputPathError",
    "VersionUnavailableError",
    "StaleEnginesError",
]


class SparrowError(Exception):
    """Base class: something sparrowd refuses, with a message for a person."""


class FormatError(SparrowError):
    """Bytes that do not follow a format sparrowd reads (patch, chunk, safetensors)."""


class IntegrityError(SparrowError):
    """Bytes whose hash or fingerprint is not the one promised."""


class BaseMismatchError(IntegrityError):
    """A patch applied to weights that are not its base."""


class InputError(SparrowError):
    """Arguments or inputs that cannot be used as given (missing tensors, bad options)."""


class OutputPathError(InputError, OSError):
    """An output that cannot be put in place (a folder where a file goes, a folder that is not there),
    refused before anything is written; an OSError too, as the failed write it forestalls would be."""


class VersionUnavailableError(SparrowError):
    """A version asked for that the daemon could not give in time; nothing was changed."""


class StaleEnginesError(SparrowError):
    """Engines lag more than ``max_lag`` versions behind the one just published (bounded
    staleness, ``Publisher(max_lag=...)``); ``lagging``: node id -> versions behind."""

    def __init__(self, message: str, lagging: dict[str, int]):
        super().__init__(message)
        self.lagging = lagging
