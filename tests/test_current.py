"""The current-version folder (sparrowd.current): built from an anchor, updated in place from
patches, crash-safe at any kill point, and never changing bytes another process has mapped."""

from __future__ import annotations

import json
import mmap
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from sparrowd.checkpoint import open_checkpoint
from sparrowd.codec import encode_patch
from sparrowd.current import MARKER, CurrentFolder, FolderBusy, LayoutChange, model_files, read_marker, reading
from sparrowd.errors import IntegrityError
from tests.helpers import make_state, save_folder, step

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
FILES = {"tokenizer.json": b'{"model": {"type": "BPE"}}\n' * 50, "generation_config.json": b'{"temperature": 0.7}\n',
         "chat_template.jinja": b"{% for m in messages %}{{ m.content }}{% endfor %}\n"}


def big_state(seed: int) -> dict[str, torch.Tensor]:
    """About 24 MiB of bf16 and fp32: an update takes long enough to be killed in its middle."""
    g = torch.Generator().manual_seed(seed)
    s = {f"model.layers.{i}.weight": (torch.randn(1024, 1024, generator=g) * 0.02).to(torch.bfloat16)
         for i in range(10)}
    s["lm_head.weight"] = torch.randn(256, 1024, generator=g)
    s["model.layers.0.norm.weight"] = torch.ones(1024, dtype=torch.bfloat16)
    return s


def make_chain(tmp: Path, n: int, state=None) -> tuple[list[Path], list]:
    """Checkpoints 0..n (each an RL-like step on the last) and the objects the swarm would carry:
    anchor 0 (with the folder's files) and patches 1..n."""
    states = [state if state is not None else make_state()]
    for v in range(1, n + 1):
        states.append(step(states[-1], seed=v))
    folders = []
    for v, s in enumerate(states):
        f = save_folder(s, tmp / f"ckpt{v}")
        for name, data in FILES.items():
            (f / name).write_bytes(data)
        folders.append(f)
    objects = []
    with open_checkpoint(folders[0]) as c:
        objects.append(encode_patch({}, c, version=0, base_version=None, files=model_files(folders[0])))
    for v in range(1, n + 1):
        with open_checkpoint(folders[v - 1]) as a, open_checkpoint(folders[v]) as b:
            objects.append(encode_patch(a, b, version=v, base_version=v - 1, chunk_size=64 << 10))
    return folders, objects


def read(obj):
    _, chunks = obj
    return lambda i: chunks[i].data


def assert_is(folder: Path, checkpoint: Path) -> None:
    """Tensors bit for bit, and every carried file byte for byte."""
    with open_checkpoint(folder) as got, open_checkpoint(checkpoint) as want:
        assert sorted(got) == sorted(want)
        for name in want:
            assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape
            assert np.array_equal(got[name].bits, want[name].bits), name
    for name, data in model_files(checkpoint).items():
        assert (folder / name).read_bytes() == data, name


def test_built_from_an_anchor_then_moved_in_place_equals_each_checkpoint(tmp_path):
    folders, objects = make_chain(tmp_path, 3)
    cur = CurrentFolder(tmp_path / "data", shard_bytes=200_000)
    assert cur.version() is None and cur.recover() is None
    assert cur.build(objects[0][0], read(objects[0])) == 0
    assert_is(cur.link, folders[0])
    shards = sorted(p.name for p in cur.link.glob("*.safetensors"))
    assert len(shards) > 1 and (cur.link / "model.safetensors.index.json").exists()
    inodes = {p.name: p.stat().st_ino for p in cur.link.glob("*.safetensors")}
    for v in (1, 2, 3):
        assert cur.apply(objects[v][0], read(objects[v])) == v
        assert_is(cur.link, folders[v])
        assert read_marker(cur.link)["version"] == v
    # In place: the same files, not rewritten copies; no journal left.
    assert {p.name: p.stat().st_ino for p in cur.link.glob("*.safetensors")} == inodes
    assert not cur.journal.exists()
    assert cur.recover() == 3  # and it passes its own check


def test_a_patch_on_another_base_or_layout_is_refused_and_changes_nothing(tmp_path):
    folders, objects = make_chain(tmp_path, 2)
    cur = CurrentFolder(tmp_path / "data")
    cur.build(objects[0][0], read(objects[0]))
    with pytest.raises(Exception, match="applies to 1, the folder holds 0"):
        cur.apply(objects[2][0], read(objects[2]))
    grown = {**step(make_state(), seed=1), "extra.weight": torch.ones(3, dtype=torch.bfloat16)}
    f = save_folder(grown, tmp_path / "grown")
    with open_checkpoint(folders[0]) as a, open_checkpoint(f) as b:
        relayout = encode_patch(a, b, version=1, base_version=0)
    with pytest.raises(LayoutChange):
        cur.apply(relayout[0], read(relayout))
    assert cur.version() == 0
    assert_is(cur.link, folders[0])


def test_an_engine_loading_holds_the_update_off(tmp_path):
    folders, objects = make_chain(tmp_path, 1)
    cur = CurrentFolder(tmp_path / "data")
    cur.build(objects[0][0], read(objects[0]))
    with reading(cur.link) as version:
        assert version == 0
        with pytest.raises(FolderBusy):
            cur.apply(objects[1][0], read(objects[1]))
    assert cur.apply(objects[1][0], read(objects[1])) == 1


def test_a_process_that_maps_a_shard_keeps_its_bytes(tmp_path):
    folders, objects = make_chain(tmp_path, 1)
    cur = CurrentFolder(tmp_path / "data")
    cur.build(objects[0][0], read(objects[0]))
    shard = cur.link / "model.safetensors"
    before = shard.read_bytes()
    # Another reader (a separate open file, as another process has) maps the shard.
    old = signal.signal(signal.SIGIO, signal.SIG_IGN)
    f = open(shard, "rb")
    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        cur.guard = True
        assert cur.apply(objects[1][0], read(objects[1])) == 1
        assert bytes(m) == before  # what it mapped did not change under it
        assert_is(cur.link, folders[1])  # the folder moved all the same (a copy renamed over the shard)
        assert os.fstat(f.fileno()).st_ino != shard.stat().st_ino
    finally:
        m.close()
        f.close()
        signal.signal(signal.SIGIO, old)
    # Nobody holds it now: the next update is in place again.
    assert not list(cur.link.glob(".*.cow"))


def test_a_damaged_folder_fails_its_check_and_is_removed(tmp_path):
    folders, objects = make_chain(tmp_path, 1)
    cur = CurrentFolder(tmp_path / "data")
    cur.build(objects[0][0], read(objects[0]))
    shard = cur.link / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x40
    shard.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="differs from its fingerprint"):
        cur.recover()
    assert cur.version() is None and cur.folder is None


_KILLED = """
import sys
from pathlib import Path
sys.path.insert(0, {root!r})
from sparrowd.codec import Manifest
from sparrowd.current import CurrentFolder
cur = CurrentFolder(Path({data!r}))
objs = Path({objs!r})
print("go", flush=True)
for v in (1, 2, 3):
    m = Manifest.from_bytes((objs / f"{{v}}.manifest").read_bytes())
    cur.apply(m, lambda i, v=v: (objs / f"{{v}}.{{i}}").read_bytes())
print("done", flush=True)
"""


def test_killed_at_any_point_the_folder_is_one_whole_version(tmp_path):
    """SIGKILL an updater (three versions in a row) at 24 points spread over its run: after
    recovery the folder is exactly one of the versions, bit for bit, every time."""
    folders, objects = make_chain(tmp_path, 3, big_state(0))
    template = tmp_path / "template"
    CurrentFolder(template).build(objects[0][0], read(objects[0]))
    objs = tmp_path / "objs"
    objs.mkdir()
    for v in (1, 2, 3):
        m, chunks = objects[v]
        (objs / f"{v}.manifest").write_bytes(m.to_bytes())
        for i, c in enumerate(chunks):
            (objs / f"{v}.{i}").write_bytes(c.data)

    def run(kill_after: float | None) -> float:
        data = tmp_path / "data"
        shutil.rmtree(data, ignore_errors=True)
        shutil.copytree(template, data, symlinks=True)
        p = subprocess.Popen([sys.executable, "-c", _KILLED.format(root=str(ROOT), data=str(data), objs=str(objs))],
                             stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "go"
        t0 = time.perf_counter()
        if kill_after is None:
            p.wait()
            return time.perf_counter() - t0
        time.sleep(kill_after)
        p.send_signal(signal.SIGKILL)
        p.wait()
        return p.returncode == 0

    span = run(None)  # the three updates' duration, unkilled
    rng = random.Random(7)
    seen = []
    for k in range(24):
        finished = run(span * (k + rng.random()) / 24)
        cur = CurrentFolder(tmp_path / "data")
        replayed = cur.journal.exists()
        v = cur.recover()  # replays a committed journal, checks every fingerprint
        assert v in (0, 1, 2, 3)
        assert_is(cur.link, folders[v])
        assert not cur.journal.exists() and not list(cur.link.glob(".*.cow"))
        seen.append((v, finished, replayed))
    # The kills landed inside the updates, not only before or after them, and some after a
    # journal was committed but before it was all written into the shards.
    assert len({v for v, _, _ in seen}) >= 3 and any(r for _, _, r in seen), seen


def test_the_commit_record_names_the_version_and_every_fingerprint(tmp_path):
    folders, objects = make_chain(tmp_path, 1)
    cur = CurrentFolder(tmp_path / "data")
    cur.build(objects[0][0], read(objects[0]))
    cur.apply(objects[1][0], read(objects[1]))
    m = json.loads((cur.link / MARKER).read_text())
    assert m["version"] == 1
    with open_checkpoint(folders[1]) as c:
        from sparrowd.codec import fingerprint

        assert m["tensors"] == {n: fingerprint(t.bits).hex() for n, t in c.items()}


def test_an_ulp2_chain_decodes_against_the_history_the_folder_keeps(tmp_path):
    """ulp2 patches coded against the change history of the patches before them: the folder keeps
    that history beside each version (through restarts), and a patch whose history it lacks is
    refused before anything is written, for a rebuild from the newest anchor."""
    from sparrowd.codec import History
    from sparrowd.codec.history import changes_between
    from sparrowd.current import HistoryMissing, read_history

    states = [make_state()]
    for seed in (1, 1, 2, 1, 1):  # the same seed moves the same elements again: what momentum does
        states.append(step(states[-1], seed=seed))
    ckpts = [save_folder(s, tmp_path / f"ckpt{v}") for v, s in enumerate(states)]
    objects, sent = [], History()
    with open_checkpoint(ckpts[0]) as c:
        objects.append(encode_patch({}, c, version=0, base_version=None, values="ulp2", files=model_files(ckpts[0])))
    for v in range(1, len(states)):
        with open_checkpoint(ckpts[v - 1]) as a, open_checkpoint(ckpts[v]) as b:
            objects.append(encode_patch(a, b, version=v, base_version=v - 1, values="ulp2", history=sent,
                                        chunk_size=4 << 10))
            sent = sent.after(v, changes_between(a, b))
    assert objects[2][0].history is not None and objects[3][0].history[0] == (2, 1)
    cf = CurrentFolder(tmp_path / "data")
    cf.build(*objects[0][:1], read(objects[0]))
    assert read_history(cf.folder, 0).versions == ()
    for v in (1, 2, 3):
        assert cf.apply(objects[v][0], read(objects[v])) == v
        assert_is(cf.folder, ckpts[v])
    assert [p.name for p in cf.folder.glob(".sparrowd.history.*")] == [".sparrowd.history.3"]
    cf = CurrentFolder(tmp_path / "data")  # a restart: the history is read back from the folder
    assert cf.recover() == 3
    assert cf.apply(objects[4][0], read(objects[4])) == 4
    assert_is(cf.folder, ckpts[4])
    (cf.folder / ".sparrowd.history.4").unlink()  # lost: patch 5 cannot be decoded here
    marker = (cf.folder / MARKER).read_bytes()
    with pytest.raises(HistoryMissing, match="history"):
        cf.apply(objects[5][0], read(objects[5]))
    assert (cf.folder / MARKER).read_bytes() == marker and not cf.journal.exists()
    assert_is(cf.folder, ckpts[4])
