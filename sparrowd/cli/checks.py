"""Checks of the values the commands share: each bad value is one InputError line naming its option,
raised before the command does anything."""

from __future__ import annotations

import math
from pathlib import Path
from typing import overload

from sparrowd.checkpoint import check_output
from sparrowd.errors import InputError


@overload
def path_arg(flag: str, text: str) -> str: ...
@overload
def path_arg(flag: str, text: None) -> None: ...
@overload
def path_arg(flag: str, text: str | None) -> str | None: ...
def path_arg(flag: str, text: str | None) -> str | None:
    """A path as given (None: not given); '' is refused, where it would quietly mean the current
    folder or the default."""
    if text is not None and not text.strip():
        raise InputError(f"{flag} {text!r}: give a path")
    return text


def path_args(*given: tuple[str, str | None]) -> None:
    """:func:`path_arg` for each (flag, path) given."""
    for flag, text in given:
        path_arg(flag, text)


def out_file(flag: str, text: str) -> Path:
    """A file to write: a path, not an existing folder, in a folder that exists."""
    out = Path(path_arg(flag, text)).expanduser()
    try:
        check_output(out)
    except InputError as e:
        raise InputError(f"{flag} {e}") from None
    return out


def seconds(flag: str, value: float, *, positive: bool = False) -> float:
    """A finite number of seconds, 0 or more (``positive``: above 0)."""
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise InputError(f"{flag} {value}: give seconds, {'above 0' if positive else '0 or more'}")
    return value


def at_least(flag: str, value: int, least: int = 1) -> int:
    """A count of at least ``least``."""
    if value < least:
        raise InputError(f"{flag} {value}: give {least} or more")
    return value


def positive(flag: str, value: float) -> float:
    """A finite number above 0."""
    if not (math.isfinite(value) and value > 0):
        raise InputError(f"{flag} {value}: give a number above 0")
    return value
