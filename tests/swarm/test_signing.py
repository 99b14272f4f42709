"""Only the trainer's key makes a version: signatures, pinning, key files."""

import os
import stat

import pytest

from sparrowd.errors import FormatError, IntegrityError
from sparrowd.swarm.signing import ANNOUNCE, MANIFEST, Signed, Verifier, load_or_create_key, pin_public_key


def test_sign_verify_and_every_tamper_is_refused(tmp_path):
    signer = load_or_create_key(tmp_path / "trainer.key")
    v = Verifier(signer.public)
    s = signer.sign(MANIFEST, 7, b"manifest bytes")
    assert v.verify(Signed.from_bytes(s.to_bytes())) == s
    for forged in (
        Signed(s.kind, s.version, b"manifest bytez", s.sig),  # other body
        Signed(s.kind, 8, s.body, s.sig),  # replayed for another version
        Signed(ANNOUNCE, s.version, s.body, s.sig),  # replayed as another kind
        Signed(s.kind, s.version, s.body, bytes(64)),
    ):
        with pytest.raises(IntegrityError, match="bad signature"):
            v.verify(forged)
    other = load_or_create_key(tmp_path / "other.key")
    with pytest.raises(IntegrityError):
        v.verify(other.sign(MANIFEST, 7, b"manifest bytes"))


def test_malformed_statements_are_format_errors():
    with pytest.raises(FormatError):
        Signed.from_bytes(b"\x93\x01\x02\x03")
    with pytest.raises(FormatError, match="unknown kind"):
        Signed.from_bytes(Signed("evil", 1, b"", bytes(64)).to_bytes())
    with pytest.raises(FormatError, match="64 bytes"):
        Signed.from_bytes(Signed(MANIFEST, 1, b"", b"short").to_bytes())
    with pytest.raises(FormatError, match="32 bytes"):
        Verifier(b"x")


def test_the_key_file_is_private_and_stable(tmp_path):
    path = tmp_path / "trainer.key"
    leftover = tmp_path / ".trainer.key.tmp"  # from a crash, world-readable: never reused for the secret
    leftover.write_text("old")
    leftover.chmod(0o644)
    a = load_or_create_key(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert leftover.read_text() == "old"
    assert load_or_create_key(path).public == a.public
    path.write_text("garbage")
    with pytest.raises(Exception, match="cannot be read"):
        load_or_create_key(path)


def test_nodes_pin_the_first_trainer_key_they_see(tmp_path):
    a, b = load_or_create_key(tmp_path / "a.key"), load_or_create_key(tmp_path / "b.key")
    pin = tmp_path / "trainer.pub"
    assert pin_public_key(pin, a.public).public == a.public
    assert pin_public_key(pin, a.public).public == a.public
    with pytest.raises(IntegrityError, match="pins"):
        pin_public_key(pin, b.public)
