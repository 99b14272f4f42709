"""Structured logs: one event per line, plain text by default or JSON.

Call sites pass fields as keyword arguments through :func:`event`, so both
formats carry them: ``... INFO tracker: node joined node_id=a region=eu`` or
``{"ts": ..., "level": "info", "logger": "tracker", "msg": "node joined",
"node_id": "a", "region": "eu"}``.
"""

from __future__ import annotations

import json
import logging
import sys
import time

__all__ = ["setup_logging", "event", "Throttle"]


def event(log: logging.Logger, level: int, msg: str, **fields) -> None:
    log.log(level, msg, extra={"fields": fields})


class Throttle:
    """At most one log line per key (an address, a refusal reason) every ``every`` seconds, so that a
    flood is reported without flooding the log; forgets every key past ``keys`` of them rather than
    grow without bound."""

    def __init__(self, every: float = 10.0, keys: int = 4096):
        self.every, self.keys = every, keys
        self._last: dict = {}

    def due(self, key, now: float) -> bool:
        if now - self._last.get(key, float("-inf")) < self.every:
            return False
        if len(self._last) >= self.keys:
            self._last.clear()
        self._last[key] = now
        return True


def _ts(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


def _short(name: str) -> str:
    return name.removeprefix("sparrowd.").removeprefix("daemon.")


class _Text(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", {}) or {}
        tail = "".join(f" {k}={_plain(v)}" for k, v in fields.items())
        line = f"{_ts(record)} {record.levelname} {_short(record.name)}: {record.getMessage()}{tail}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _plain(v) -> str:
    s = str(v)
    return json.dumps(s) if (not s or any(c.isspace() or c in "\"=" for c in s)) else s


class _Json(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": _ts(record), "level": record.levelname.lower(), "logger": _short(record.name),
               "msg": record.getMessage()}
        for k, v in (getattr(record, "fields", {}) or {}).items():
            out.setdefault(k, v)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(fmt: str = "text", level: str = "info", stream=None) -> None:
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(_Json() if fmt == "json" else _Text())
    root = logging.getLogger("sparrowd")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
