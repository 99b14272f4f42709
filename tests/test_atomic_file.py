"""``atomic_file``: a temporary beside the target, renamed over it, with its final mode from its
creation on (a secret is never readable by others, not even while it is written)."""

from __future__ import annotations

import contextlib
import os
import stat

import pytest

from sparrowd.checkpoint import atomic_file
from sparrowd.swarm.signing import load_or_create_key


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def created(monkeypatch) -> dict[str, int]:
    """The mode of each file the moment ``os.open`` created it, by path."""
    seen: dict[str, int] = {}
    real = os.open

    def spy(path, flags, mode=0o777, *args, **kw):
        fd = real(path, flags, mode, *args, **kw)
        if flags & os.O_CREAT:
            seen[os.fspath(path)] = stat.S_IMODE(os.fstat(fd).st_mode)
        return fd

    monkeypatch.setattr(os, "open", spy)
    return seen


def mode_of(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("kw", [{"private": True}, {"mode": 0o600}])
@pytest.mark.parametrize("mask", [0o000, 0o022])
def test_a_secret_is_0600_from_its_creation_before_a_byte_is_written(tmp_path, created, kw, mask):
    path = tmp_path / "swarm.token"
    with umask(mask), atomic_file(path, **kw) as tmp:
        assert created[str(tmp)] & 0o077 == 0  # never group or other readable, not even empty
        assert mode_of(tmp) == 0o600  # as it is handed out to be written
        tmp.write_text("secret\n")
    assert mode_of(path) == 0o600 and path.read_text() == "secret\n"
    assert [p.name for p in tmp_path.iterdir()] == ["swarm.token"]


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_a_mode_given_is_the_file_s_whatever_the_umask_and_set_before_writing(tmp_path, mask):
    path = tmp_path / "sparrowd.toml"
    with umask(mask), atomic_file(path, mode=0o644) as tmp:
        assert mode_of(tmp) == 0o644
        tmp.write_text("role = \"trainer\"\n")
    assert mode_of(path) == 0o644


def test_without_a_mode_a_file_gets_what_the_umask_gives(tmp_path):
    with umask(0o027), atomic_file(tmp_path / "out") as tmp:
        assert mode_of(tmp) == 0o640
        tmp.write_text("x")
    assert mode_of(tmp_path / "out") == 0o640


def test_a_failed_write_leaves_neither_target_nor_temporary(tmp_path):
    with pytest.raises(RuntimeError), atomic_file(tmp_path / "key", private=True) as tmp:
        tmp.write_text("half")
        raise RuntimeError
    assert list(tmp_path.iterdir()) == []


def test_the_trainer_key_is_created_0600(tmp_path, created):
    with umask(0o000):
        load_or_create_key(tmp_path / "trainer.key")
    temps = [m for p, m in created.items() if os.path.basename(p).startswith(".trainer.key.")]
    assert temps and all(m == 0o600 for m in temps), created
    assert mode_of(tmp_path / "trainer.key") == 0o600
