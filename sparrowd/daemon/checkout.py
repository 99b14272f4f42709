"""``sparrowd checkout``: any version a node's data dir can produce, written as a model folder.

It reads the chunk store as it is on disk (a stopped daemon's, or a running
one's: nothing there is created, changed or dropped), checks every statement
against the trainer's key the node pinned and every chunk against its signed
hash, then builds from an anchor and applies the patches after it
(``chain.producible`` says which). The folder is assembled beside OUT and
renamed into place only when every tensor matched its fingerprint.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..checkpoint import atomic_dir
from ..codec.manifest import Manifest
from ..current import build_folder, update_folder
from ..errors import InputError, SparrowError
from ..swarm.chain import Key, producible
from ..swarm.signing import Verifier, load_or_create_key
from ..swarm.versions import VersionState
from .store import ChunkStore

__all__ = ["checkout", "describe"]


def _verifier(data_dir: Path) -> Verifier:
    pub, key = data_dir / "trainer.pub", data_dir / "trainer.key"
    if pub.exists():
        try:
            return Verifier(bytes.fromhex(pub.read_text().strip()))
        except ValueError:
            raise InputError(f"{pub}: not a trainer key") from None
    if key.exists():  # the trainer's own data dir
        return Verifier(load_or_create_key(key).public)
    raise InputError(f"{data_dir}: no trainer key (trainer.pub); has this node ever joined a swarm?")


def _open(data_dir: Path) -> ChunkStore:
    data_dir = Path(data_dir)
    if not (data_dir / "versions").is_dir():
        raise InputError(f"{data_dir}: not a sparrowd data dir (no versions/ in it)")
    return ChunkStore(data_dir, readonly=True)


def _manifest(vs: VersionState) -> Manifest:
    """The manifest of a version a plan is made of: every such version is whole, so its manifest is in."""
    assert vs.manifest is not None, f"{vs.key} is in a plan without its manifest"
    return vs.manifest


def describe(plan: dict[int, tuple[int, list[int]]]) -> str:
    """``versions 8 to 12`` (or a list, when there are gaps)."""
    vs = sorted(plan)
    if not vs:
        return "no version"
    if vs == list(range(vs[0], vs[-1] + 1)):
        return f"version {vs[0]}" if len(vs) == 1 else f"versions {vs[0]} to {vs[-1]}"
    return "versions " + ", ".join(map(str, vs))


def checkout(data_dir: str | os.PathLike, out: str | os.PathLike, version: int | None = None, *,
             force: bool = False, progress=None) -> int:
    """Write ``version`` (default: the newest the data dir can produce) as a model folder at
    ``out``; returns the version written. InputError, in one line, for a version it cannot produce."""
    data_dir, out = Path(data_dir), Path(out)
    store = _open(data_dir)
    held = store.load(_verifier(data_dir))
    plan = producible({k: vs.obj for k, vs in held.items()})
    if not plan:
        raise InputError(f"{data_dir} holds no whole anchor, so it can produce no version yet")
    if version is None:
        version = max(plan)
    if version not in plan:
        raise InputError(f"version {version} cannot be produced from {data_dir}: it holds what makes "
                         f"{describe(plan)} (a version needs an anchor at or before it and every patch after that)")
    anchor, patches = plan[version]
    steps = [Key(anchor, True)] + [Key(v) for v in patches]
    manifests = {k: _manifest(held[k]) for k in steps}
    total = sum(len(manifests[k].chunks) for k in steps)
    done = 0

    def reader(key: Key):
        def read(i: int) -> bytes:
            try:
                return store.chunk_path(key, i).read_bytes()
            except FileNotFoundError:
                raise SparrowError(f"{key} was dropped from {data_dir} while being read (retention); "
                                   f"run checkout again") from None
        return read

    def step(n: int, _total: int) -> None:
        if progress is not None:
            progress(done + n, total)

    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(out, force=force) as tmp:
        build_folder(tmp, manifests[steps[0]], reader(steps[0]), progress=step)
        done += len(manifests[steps[0]].chunks)
        fd, journal = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".journal", dir=out.parent)
        os.close(fd)
        try:
            for key in steps[1:]:
                update_folder(tmp, manifests[key], reader(key), Path(journal), progress=step)
                done += len(manifests[key].chunks)
        finally:
            Path(journal).unlink(missing_ok=True)
    return version
