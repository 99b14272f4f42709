"""`sparrowd delta` end to end, as a user runs it, including every kind of bad input."""

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .helpers import make_state, same_bits, save_folder, sparrowd, step

pytestmark = pytest.mark.slow


@pytest.fixture
def files(tmp_path):
    s0 = make_state()
    s1 = step(s0, 1)
    save_file(s0, str(tmp_path / "v0.safetensors"))
    save_file(s1, str(tmp_path / "v1.safetensors"))
    return tmp_path, s0, s1


def listing(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


@pytest.mark.parametrize("values", ["ulp2", "ulp", "absolute"])
def test_diff_apply_round_trip_single_file(files, values):
    d, s0, s1 = files
    r = sparrowd("delta", "diff", d / "v0.safetensors", d / "v1.safetensors", "-o", d / "p.sprw", "--values", values)
    assert r.returncode == 0, r.stderr
    assert "bits per changed element" in r.stdout
    r = sparrowd("delta", "apply", d / "v0.safetensors", d / "p.sprw", "-o", d / "out.safetensors")
    assert r.returncode == 0, r.stderr
    assert same_bits(load_file(str(d / "out.safetensors")), s1)


def test_diff_apply_round_trip_sharded_folder(tmp_path):
    s0 = make_state()
    s1 = step(s0, 2)
    s1["model.new.bias"] = s1["model.layers.0.norm.weight"].float()  # added
    del s1["step"]  # removed
    save_folder(s0, tmp_path / "m0")
    save_folder(s1, tmp_path / "m1")
    assert sparrowd("delta", "diff", tmp_path / "m0", tmp_path / "m1", "-o", tmp_path / "p.sprw",
                    "--version", "7", "--chunk-size", "4K").returncode == 0
    r = sparrowd("delta", "apply", tmp_path / "m0", tmp_path / "p.sprw", "-o", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out"
    assert listing(out) == listing(tmp_path / "m0")  # same shard names, config and index
    index = json.loads((out / "model.safetensors.index.json").read_text())
    merged = {}
    for f in set(index["weight_map"].values()):
        merged.update(load_file(str(out / f)))
    assert same_bits(merged, s1)
    assert (out / "config.json").read_text() == (tmp_path / "m0" / "config.json").read_text()
    # an existing output folder is not clobbered without --force
    r = sparrowd("delta", "apply", tmp_path / "m0", tmp_path / "p.sprw", "-o", out)
    assert r.returncode != 0 and "already exists" in r.stderr


def test_inspect_and_export(files):
    d, s0, s1 = files
    sparrowd("delta", "diff", d / "v0.safetensors", d / "v1.safetensors", "-o", d / "p.sprw",
             "--version", "5", "--base-version", "4")
    r = sparrowd("delta", "inspect", d / "p.sprw", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    # ulp2 by default, where the C extension is built (it is in the test environment)
    assert info["version"] == 5 and info["base_version"] == 4 and info["values"] == "ulp2"
    changed = sum(int((s0[k].view(-1).contiguous().view(torch_uint(s0[k]))
                       != s1[k].view(-1).contiguous().view(torch_uint(s1[k]))).sum()) for k in s0)
    assert info["elements_changed"] == changed
    assert info["elements_total"] == sum(t.numel() for t in s1.values())
    assert 0 < info["bits_per_changed_element"] < 32
    text = sparrowd("delta", "inspect", d / "p.sprw").stdout
    assert "density" in text and "hashes ok" in text
    r = sparrowd("delta", "export", d / "p.sprw", "-o", d / "dec.safetensors")
    assert r.returncode != 0 and "give --base" in r.stderr  # ulp2 positions decode against the base
    r = sparrowd("delta", "export", d / "p.sprw", "-o", d / "dec.safetensors", "--base", d / "v0.safetensors")
    assert r.returncode == 0, r.stderr
    with safe_open(str(d / "dec.safetensors"), "pt") as f:
        meta = f.metadata()
        assert meta["version"] == "5" and meta["base_version"] == "4"
        idx = f.get_tensor("model.embed.weight.indices")
        vals = f.get_tensor("model.embed.weight.values")
    a = s0["model.embed.weight"].reshape(-1).view(__import__("torch").int16)
    b = s1["model.embed.weight"].reshape(-1).view(__import__("torch").int16)
    assert idx.tolist() == (a != b).nonzero().reshape(-1).tolist()
    assert vals.shape == idx.shape


def torch_uint(t):
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]


def bad(r: subprocess.CompletedProcess) -> str:
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sparrowd: error: "), r.stderr
    return lines[0]


def test_bad_inputs_give_one_line_and_leave_nothing(files):
    d, s0, s1 = files
    v0, v1, p = d / "v0.safetensors", d / "v1.safetensors", d / "p.sprw"
    assert sparrowd("delta", "diff", v0, v1, "-o", p).returncode == 0
    data = p.read_bytes()
    before = listing(d)

    (d / "trunc.sprw").write_bytes(data[: len(data) - 7])
    assert "truncated" in bad(sparrowd("delta", "apply", v0, d / "trunc.sprw", "-o", d / "o1.safetensors"))
    corrupt = bytearray(data)
    corrupt[-20] ^= 0xFF
    (d / "corrupt.sprw").write_bytes(bytes(corrupt))
    assert "hash" in bad(sparrowd("delta", "apply", v0, d / "corrupt.sprw", "-o", d / "o2.safetensors"))
    assert "hash" in bad(sparrowd("delta", "inspect", d / "corrupt.sprw"))
    assert "fingerprint" in bad(sparrowd("delta", "apply", v1, p, "-o", d / "o3.safetensors"))
    (d / "text.safetensors").write_text("hello, I am not a safetensors file")
    assert "not a safetensors file" in bad(sparrowd("delta", "diff", d / "text.safetensors", v1, "-o", d / "o4.sprw"))
    assert "not a sparrowd patch" in bad(sparrowd("delta", "apply", v0, v0, "-o", d / "o5.safetensors"))
    missing = dict(s0)
    del missing["model.layers.1.mlp.weight"]
    save_file(missing, str(d / "missing.safetensors"))
    assert "missing from the base" in bad(
        sparrowd("delta", "apply", d / "missing.safetensors", p, "-o", d / "o6.safetensors"))
    assert "no such file" in bad(sparrowd("delta", "diff", d / "nope", v1, "-o", d / "o7.sprw"))
    # An output folder that is not there: the error names the output, not a temporary file.
    err = bad(sparrowd("delta", "diff", v0, v1, "-o", d / "nowhere" / "o9.sprw"))
    assert str(d / "nowhere" / "o9.sprw") in err and ".tmp" not in err, err
    r = sparrowd("delta", "diff", v0, v1, "-o", d / "o8.sprw", "--chunk-size", "lots")
    assert r.returncode == 2 and "not a size" in r.stderr
    after = listing(d)
    assert after - before == {"trunc.sprw", "corrupt.sprw", "text.safetensors", "missing.safetensors"}


@pytest.mark.parametrize("args, says", [
    (["diff", "v0.safetensors", "v1.safetensors", "-o", "new.sprw", "--version", "0"], "version 0: a patch on a base"),
    (["diff", "", "v1.safetensors", "-o", "new.sprw"], "OLD '': give a path"),
    (["diff", "v0.safetensors", "", "-o", "new.sprw"], "NEW '': give a path"),
    (["diff", "v0.safetensors", "v1.safetensors", "-o", ""], "-o '': give a path"),
    (["diff", "v0.safetensors", "v1.safetensors", "-o", "adir"], "adir: is a folder"),
    (["apply", "v0.safetensors", "p.sprw", "-o", "adir"], "adir: is a folder"),
    (["apply", "v0.safetensors", "p.sprw", "-o", ""], "-o '': give a path"),
    (["apply", "", "p.sprw", "-o", "new.safetensors"], "BASE '': give a path"),
    (["export", "p.sprw", "-o", "adir", "--base", "v0.safetensors"], "adir: is a folder"),
    (["export", "p.sprw", "-o", "nowhere/new.safetensors", "--base", "v0.safetensors"],
     "nowhere/new.safetensors: its folder nowhere does not exist"),
    (["export", "p.sprw", "-o", "new.safetensors", "--base", ""], "--base '': give a path"),
    (["inspect", ""], "PATCH '': give a path"),
])
def test_empty_paths_folders_as_files_and_version_0_are_one_line_and_write_nothing(files, args, says):
    d, *_ = files
    assert sparrowd("delta", "diff", "v0.safetensors", "v1.safetensors", "-o", "p.sprw", cwd=d).returncode == 0
    (d / "adir").mkdir()
    before = listing(d)
    err = bad(sparrowd("delta", *args, cwd=d, timeout=60))
    assert says in err and ".tmp" not in err and "Traceback" not in err, err
    assert listing(d) == before and not any((d / "adir").iterdir())  # nothing written, no temporary left


def _limit_file_size():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))


def test_no_space_left_leaves_no_partial_output(files):
    # A file-size limit makes writes fail the way a full disk does (EFBIG instead of ENOSPC).
    d, *_ = files
    assert sparrowd("delta", "diff", d / "v0.safetensors", d / "v1.safetensors", "-o", d / "p.sprw").returncode == 0
    before = listing(d)
    for args in (
        ["delta", "diff", d / "v0.safetensors", d / "v1.safetensors", "-o", d / "p2.sprw", "--values", "absolute"],
        ["delta", "apply", d / "v0.safetensors", d / "p.sprw", "-o", d / "never.safetensors"],
        ["delta", "export", d / "p.sprw", "-o", d / "never-decoded.safetensors", "--base", d / "v0.safetensors"],
    ):
        r = subprocess.run([sys.executable, "-m", "sparrowd.cli.main", *map(str, args)], capture_output=True, text=True,
                           preexec_fn=_limit_file_size)
        assert r.returncode != 0
        assert r.stderr.strip().splitlines() == ["sparrowd: error: File too large"], r.stderr
    assert listing(d) == before, "no output and no temporary file may be left behind"


def test_outputs_follow_the_umask(files):
    d, *_ = files
    assert sparrowd("delta", "diff", d / "v0.safetensors", d / "v1.safetensors", "-o", d / "p.sprw").returncode == 0
    mask = os.umask(0)
    os.umask(mask)
    assert (d / "p.sprw").stat().st_mode & 0o777 == 0o666 & ~mask


def test_an_ulp2_patch_is_exported_against_its_base_only(files):
    d, s0, s1 = files
    assert sparrowd("delta", "diff", d / "v0.safetensors", d / "v1.safetensors", "-o", d / "p.sprw",
                    "--values", "ulp2").returncode == 0
    r = sparrowd("delta", "export", d / "p.sprw", "-o", d / "dec.safetensors")
    assert r.returncode != 0 and "give --base" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (d / "dec.safetensors").exists()
    r = sparrowd("delta", "export", d / "p.sprw", "-o", d / "dec.safetensors", "--base", d / "v1.safetensors")
    assert r.returncode != 0 and "base" in r.stderr  # the wrong base: refused by fingerprint
    r = sparrowd("delta", "export", d / "p.sprw", "-o", d / "dec.safetensors", "--base", d / "v0.safetensors")
    assert r.returncode == 0, r.stderr
    with safe_open(str(d / "dec.safetensors"), "np") as f:
        assert json.loads(f.metadata()["tensors"])
    r = sparrowd("delta", "inspect", d / "p.sprw")
    assert r.returncode == 0 and "ulp2" in r.stdout


def test_a_patch_coded_against_a_change_history_is_refused_in_one_line(files):
    """Only a chain's folders keep the change history an ulp2 patch from the Publisher may be coded
    against: `delta apply` and `delta export` on a checkpoint say so and write nothing."""
    from sparrowd.checkpoint import open_checkpoint
    from sparrowd.codec import History, encode_patch, patch_parts
    from sparrowd.codec.history import changes_between

    d, s0, s1 = files
    with open_checkpoint(d / "v0.safetensors") as a, open_checkpoint(d / "v1.safetensors") as b:
        h = History().after(1, changes_between(a, b))
        m, chunks = encode_patch(b, a, version=2, base_version=1, values="ulp2", history=h)  # v1 back to v0
    (d / "h.sprw").write_bytes(b"".join(patch_parts(m, (c.data for c in chunks))))
    for args in (("apply", d / "v1.safetensors", d / "h.sprw", "-o", d / "out.safetensors"),
                 ("export", d / "h.sprw", "-o", d / "dec.safetensors", "--base", d / "v1.safetensors")):
        r = sparrowd("delta", *args)
        assert r.returncode != 0 and "change history" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (d / "out.safetensors").exists() and not (d / "dec.safetensors").exists()
    r = sparrowd("delta", "inspect", d / "h.sprw")
    assert r.returncode == 0 and "the change history of versions 1" in r.stdout, r.stdout
    r = sparrowd("delta", "inspect", d / "h.sprw", "--json")
    assert json.loads(r.stdout)["history"] == [1]
