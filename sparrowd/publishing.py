"""The trainer's chain rules, and publishing a checkpoint folder without torch.

A trainer publishes a chain of versions: a base (an anchor), then patches,
each on the last version published, and an anchor of the same version every
``anchor_every`` versions so a late node catches up from it. The rules of
that chain live here, once, for both publishers:

- ``check_follows``: a patch's version follows the last version published;
- ``check_anchor``: an anchor is of the last version published or a newer one;
- ``anchor_due``: a patch of this version is followed by an anchor.

``sparrowd.Publisher`` (a live model, torch) applies them in memory;
``publish_checkpoint`` (a checkpoint on disk, no torch; ``sparrowd publish
--checkpoint`` calls it) applies them to a state dir that keeps a copy of
the last checkpoint published and its version (``published.json``).

Imports ``sparrowd.client`` to talk to the daemon, the codec and checkpoint
modules, never ``sparrowd.daemon`` nor torch.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from .checkpoint import atomic_dir, atomic_file, open_checkpoint
from .client import check_start, publish_file, published_state
from .errors import InputError

__all__ = ["DEFAULT_ANCHOR_EVERY", "check_follows", "check_anchor", "anchor_due", "publish_checkpoint"]

DEFAULT_ANCHOR_EVERY = 20  # versions between anchors; the trainer keeps the patches since the newest


def check_follows(version: int, last: int) -> None:
    """A patch's ``version`` comes after ``last``, the last version published."""
    if version <= last:
        raise InputError(f"version {version} does not follow the last published version {last}")


def check_anchor(version: int, last: int) -> None:
    """An anchor is of ``last``, the last version published, or of a newer version."""
    if version < last:
        raise InputError(f"anchor {version} is older than the last published version {last}")


def anchor_due(version: int, anchor: int | None, every: int) -> bool:
    """A patch of ``version`` is followed by an anchor: ``every`` versions or more since the newest
    anchor ``anchor`` (None: none yet, counted from 0); never when ``every`` is 0."""
    return bool(every) and version - (anchor or 0) >= every


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


class _Folder:
    """One checkpoint published from a state dir: its source, the kept copy and the record."""

    def __init__(self, src: Path, state: Path, daemon: str, token: str, values: str,
                 say: Callable[[str], None]):
        self.src, self.state, self.daemon, self.token, self.values, self.say = src, state, daemon, token, values, say
        self.kept, self.record = state / "checkpoint", state / "published.json"

    def last(self) -> int:
        """The version recorded as last published from the state dir."""
        try:
            return json.loads(self.record.read_text())["version"]
        except (OSError, ValueError, KeyError):
            raise InputError(f"nothing published from {self.state} yet: record the base first with --init") from None

    def keep(self, version: int) -> None:
        """Record ``src`` as version ``version``, the base of the next patch."""
        src = self.src
        self.state.mkdir(parents=True, exist_ok=True)
        with atomic_dir(self.kept, force=True) as tmp:
            if src.is_dir():
                shutil.copytree(src, tmp, dirs_exist_ok=True)
            else:
                shutil.copy2(src, tmp / src.name)
        with atomic_file(self.record) as tmp:
            Path(tmp).write_text(json.dumps({"version": version, "source": str(src.absolute())}) + "\n")

    def anchor(self, version: int) -> None:
        """Publish ``src`` whole as anchor ``version``, with its model files."""
        from .current import model_files
        from .delta import diff_files

        path = self.state / f"a{version}.sprw"
        try:
            diff_files(None, self.src, path, values=self.values, version=version,
                       files=model_files(self.src) if self.src.is_dir() else None)
            m, _, _ = publish_file(path, self.daemon, self.token)
        finally:
            path.unlink(missing_ok=True)
        self.say(f"anchor {version} published from {self.src}: {_count(len(m.chunks), 'chunk')}, {m.patch_bytes} bytes")

    def patch(self, version: int, last: int):
        """Publish the diff of ``src`` against the kept copy as ``version``; returns its manifest."""
        from .delta import diff_files

        old = self.kept if self.src.is_dir() else self.kept / self.src.name
        path = self.state / f"v{version}.sprw"
        try:
            diff_files(old, self.src, path, values=self.values, version=version, base_version=last)
            m, _, _ = publish_file(path, self.daemon, self.token)
        finally:
            path.unlink(missing_ok=True)
        return m


def publish_checkpoint(checkpoint: str | Path, version: int, *, daemon: str, token: str, state_dir: str | Path,
                       values: str, init: bool = False, anchor: bool = False,
                       anchor_every: int = DEFAULT_ANCHOR_EVERY, say: Callable[[str], None] = print,
                       on_patch: Callable[[object, int | None], None] | None = None) -> None:
    """Publish the checkpoint (a safetensors file or a model folder) as ``version``.

    ``init``: record it as the base (published as anchor ``version`` when the daemon has nothing;
    a daemon whose chain ends elsewhere is an error). ``anchor``: publish it whole as anchor
    ``version``. Else: a patch against the last checkpoint published from ``state_dir``, followed
    by an anchor when one is due. The state dir keeps the checkpoint only once the daemon took its
    manifest, so a failed publish leaves the base as it was. ``say`` gets one line per version
    published; ``on_patch(manifest, newest anchor)`` runs after a patch is published."""
    if version is None or version < 0:
        raise InputError("--checkpoint needs --version N (0 or more)")
    if anchor_every < 0:
        raise InputError("--anchor-every must be 0 (never) or more")
    if init and anchor:
        raise InputError("--init already publishes the base as an anchor when the daemon has nothing; "
                         "give one of --init and --anchor")
    src = Path(checkpoint)
    if not src.exists():
        raise InputError(f"{src}: no such checkpoint")
    with open_checkpoint(src):  # a text file or a folder without weights is refused before anything is recorded
        pass
    f = _Folder(src, Path(state_dir).expanduser(), daemon, token, values, say)
    if init:
        chain = published_state(daemon, token)
        check_start(chain, version)
        f.state.mkdir(parents=True, exist_ok=True)
        if chain["latest"] is None:
            f.anchor(version)
        f.keep(version)
        say(f"{src} recorded as base version {version} in {f.state}")
        return
    last = f.last()
    if anchor:
        check_anchor(version, last)
        f.anchor(version)
        f.keep(version)
        return
    check_follows(version, last)
    m = f.patch(version, last)
    f.keep(version)  # only once the daemon took the manifest
    say(f"version {m.version} (base {m.base_version}) published from {src}: {_count(len(m.chunks), 'chunk')}, "
        f"{m.patch_bytes} bytes, {m.elements_changed} elements changed")
    newest = published_state(daemon, token)["anchor"]
    if on_patch is not None:
        on_patch(m, newest)
    if anchor_due(version, newest, anchor_every):
        f.anchor(version)
