"""Node identities, sealed tracker messages, credentials and peer proofs: the pure rules, and the
tracker service that applies them, without sockets."""

from __future__ import annotations

import stat
import time

import pytest

from sparrowd.daemon.leasedb import SqliteLeaseStore
from sparrowd.daemon.tracker import TICKET_LIFE, TrackerService
from sparrowd.errors import FormatError
from sparrowd.swarm.identity import (
    MAX_SKEW,
    PROOF_TTL,
    Credential,
    CredentialBook,
    Identities,
    NodeKey,
    Refused,
    SessionKey,
    SessionUnknown,
    Ticket,
    check_proof,
    default_node_id,
    key_id,
    make_proof,
    parse_duration,
    seal_session,
)
from sparrowd.swarm.leases import LeaseGone, LeaseTable
from sparrowd.swarm.signing import load_or_create_key
from tests import members
from tests.members import new_key


def tracker(tmp_path=None, *, ttl=15.0, clock=time.time):
    store = SqliteLeaseStore(tmp_path / "tracker.db") if tmp_path is not None else None
    signer = load_or_create_key(tmp_path / "trainer.key") if tmp_path is not None else new_key()
    return TrackerService(LeaseTable(ttl, now=clock(), store=store), tracker_id="t", peer_limit=32, clock=clock,
                          identities=Identities(store), credentials=CredentialBook(store),
                          sign=signer.sign_bytes if tmp_path is not None else signer.sign,
                          trainer_key=signer.public), store


def refused(reason, fn, *a, **kw):
    with pytest.raises(Refused) as e:
        fn(*a, **kw)
    assert e.value.reason == reason, (e.value.reason, str(e.value))
    return str(e.value)


def test_a_node_key_is_made_once_0600_and_names_the_node(tmp_path):
    k = NodeKey.load_or_create(tmp_path / "node.key")
    assert stat.S_IMODE((tmp_path / "node.key").stat().st_mode) == 0o600
    again = NodeKey.load_or_create(tmp_path / "node.key")
    assert again.public == k.public and len(k.public) == 32
    assert default_node_id("rollout", k.public) == f"rollout-{k.id}" and k.id == key_id(k.public)
    assert len(k.id) == 16 and k.id != new_key().id
    (tmp_path / "bad.key").write_text("not a key")
    with pytest.raises(Exception, match="node key .* cannot be read"):
        NodeKey.load_or_create(tmp_path / "bad.key")


def test_a_node_id_belongs_to_the_first_key_for_good(tmp_path):
    svc, store = tracker(tmp_path)
    a, mallory = new_key(), new_key()
    lease = svc.join(members.join(a, "r0", address="10.0.0.1:7070"))
    # Another key, under the same id: refused while the lease lives...
    assert "belongs to another key" in refused("impostor", svc.join, members.join(mallory, "r0", address="6.6.6.6:1"))
    assert svc.status()["nodes"][0]["address"] == "10.0.0.1:7070"
    # ... and after it ended, and after the tracker restarted: no lease is ever displaced by another key.
    svc.leave(members.leave(a, "r0", lease["epoch"]))
    refused("impostor", svc.join, members.join(mallory, "r0"))
    store.close()
    svc2, store2 = tracker(tmp_path)
    refused("impostor", svc2.join, members.join(mallory, "r0"))
    assert svc2.join(members.join(a, "r0"))["epoch"] > lease["epoch"]  # the owner comes back
    assert svc2.refused[("join", "impostor")] == 1
    store2.close()


def test_renewals_and_leaves_must_be_signed_by_the_lease_key_and_never_replayed():
    svc, _ = tracker()
    a, mallory = new_key(), new_key()
    epoch = svc.join(members.join(a, "r0"))["epoch"]
    refused("bad-signature", svc.renew, members.renew(mallory, "r0", epoch))
    refused("bad-signature", svc.leave, members.leave(mallory, "r0", epoch))
    ok = members.renew(a, "r0", epoch, versions=[1])
    svc.renew(ok)
    assert "not newer" in refused("replay", svc.renew, ok)  # the same message again
    refused("replay", svc.renew, members.renew(a, "r0", epoch, ts=time.time() - 60))  # an older one
    refused("clock", svc.renew, members.renew(a, "r0", epoch, ts=time.time() + 2 * MAX_SKEW))
    join = members.join(a, "r0")
    svc.join(join)
    refused("replay", svc.join, join)  # a captured join played again cannot fence the node out
    with pytest.raises(LeaseGone):  # an id no key was ever bound to holds no lease
        svc.renew(members.renew(mallory, "ghost", 1))
    assert [n["node_id"] for n in svc.status()["nodes"]] == ["r0"]
    assert "only the tracker" in refused("role", svc.join, members.join(mallory, "boss", role="trainer"))
    assert svc.refused[("renew", "bad-signature")] == 1 and svc.refused[("leave", "bad-signature")] == 1


def test_renewals_under_a_session_are_checked_by_hmac_and_rekeyed_after_a_tracker_restart(tmp_path):
    """A join carrying an exchange key sets up a session; renewals sealed with its secret pass the
    same clock and replay rules as signed ones, and nothing else passes. A restarted tracker knows
    no session: the node renews signed with a new exchange key, keeping its lease and epoch."""
    svc, store = tracker(tmp_path)
    a, mallory = new_key(), new_key()
    kx = SessionKey()
    reply = svc.join(members.seal(a, "join", {"node_id": "r0", "role": "rollout", "region": "eu",
                                             "address": "127.0.0.1:1", "key": a.public, "ts": members.clock(),
                                             "kx": kx.public}))
    epoch = reply["epoch"]
    secret = kx.secret(reply["kx"], "r0", epoch)

    def renew(secret_, *, op="renew", ts=None, **extra):
        return seal_session(secret_, op, {"node_id": "r0", "epoch": epoch,
                                          "ts": members.clock() if ts is None else ts, **extra})

    ok = renew(secret, versions=[3])
    assert svc.renew(ok)["epoch"] == epoch
    assert svc.status()["nodes"][0]["versions"] == [3]
    assert "not newer" in refused("replay", svc.renew, ok)
    refused("bad-signature", svc.renew, renew(bytes(32)))  # a secret nobody was given
    refused("bad-signature", svc.renew, renew(SessionKey().secret(reply["kx"], "r0", epoch)))  # mallory's own kx
    refused("bad-signature", svc.renew, renew(secret, op="leave"))  # sealed for another operation
    tampered = renew(secret)
    tampered["msg"] = tampered["msg"].replace(b"r0", b"r1")
    with pytest.raises((SessionUnknown, LeaseGone, Refused)):
        svc.renew(tampered)
    body_changed = renew(secret, versions=[4])
    body_changed["mac"] = renew(secret, versions=[5])["mac"]
    refused("bad-signature", svc.renew, body_changed)
    refused("clock", svc.renew, renew(secret, ts=time.time() + 2 * MAX_SKEW))
    with pytest.raises(FormatError, match="32 bytes"):
        svc.renew({"msg": renew(secret)["msg"], "mac": b"short"})
    # The tracker restarts (sessions live in memory): the lease is back from its store, the session is not.
    restarted, _ = tracker(tmp_path)
    with pytest.raises(SessionUnknown):
        restarted.renew(renew(secret))
    kx2 = SessionKey()
    again = restarted.renew(members.renew(a, "r0", epoch, kx=kx2.public))
    assert again["epoch"] == epoch and isinstance(again["kx"], bytes)
    secret2 = kx2.secret(again["kx"], "r0", epoch)
    assert secret2 != secret and restarted.renew(renew(secret2))["epoch"] == epoch
    refused("bad-signature", restarted.renew, members.renew(mallory, "r0", epoch, kx=SessionKey().public))
    # A node that sends no kx (an older one) keeps renewing signed; a leave ends the session.
    restarted.leave(members.leave(a, "r0", epoch))
    with pytest.raises(SessionUnknown):
        restarted.renew(renew(secret2))


def test_a_sealed_message_is_checked_before_anything_else():
    svc, _ = tracker()
    a = new_key()
    for bad, match in (([1], "expected a map"), ({"msg": b"\x91\x01", "sig": b"x" * 64}, "must be a map"),
                       ({"msg": b"", "sig": b"short"}, "64 bytes")):
        with pytest.raises(FormatError, match=match):
            svc.join(bad)
    forged = members.join(a, "r0")
    forged["sig"] = bytes(64)
    refused("bad-signature", svc.join, forged)
    assert svc.status()["nodes"] == []


def test_credentials_admit_one_key_in_their_role_region_and_node(tmp_path):
    svc, store = tracker(tmp_path)
    rec, text = svc.issue(role="rollout", region="us", lifetime=3600)
    c = Credential.parse(text, svc.trainer_key)
    assert (c.id, c.role, c.region, c.node) == (rec["id"], "rollout", "us", None)
    assert c.expires == pytest.approx(time.time() + 3600, abs=5)
    a, b = new_key(), new_key()
    refused("region", svc.join, members.join(a, "n1", region="eu"), credential=c)  # another region
    refused("role", svc.join, members.join(a, "n1", region="us", role="relay"), credential=c)
    svc.join(members.join(a, "n1", region="us"), credential=c)
    # The credential now belongs to that node: another box with a copy of it is refused.
    assert "in use by node n1" in refused("credential", svc.join, members.join(b, "n2", region="us"), credential=c)
    pinned_rec, pinned = svc.issue(node="n9")
    refused("credential", svc.join, members.join(b, "n8"), credential=Credential.parse(pinned, svc.trainer_key))
    # Tampered claims or another signer are not credentials of this swarm.
    head, claims, sig = text.split(".")
    other = Credential.issue(new_key().sign, role="rollout", region=None, node=None, now=time.time(),
                             lifetime=None)[1]
    # (One character in the middle changed: the claims' last two were sometimes "AA" already, a time
    # whose last bytes are zero, and the "tampered" credential was the real one.)
    mid = len(claims) // 2
    tampered = claims[:mid] + ("B" if claims[mid] == "A" else "A") + claims[mid + 1:]
    for bad in (f"{head}.{tampered}.{sig}", other):
        refused("bad-credential", Credential.parse, bad, svc.trainer_key)
    with pytest.raises(FormatError):
        Credential.parse("spw1.not-a-credential", svc.trainer_key)
    # Revoked: its node's lease ends now, renewals tell members, and it cannot join again.
    record, node = svc.revoke(c.id)
    assert node.node_id == "n1" and record["revoked_at"] is not None
    assert "n1" not in {n["node_id"] for n in svc.status()["nodes"]}
    refused("revoked", svc.join, members.join(a, "n1", region="us"), credential=c)
    x = new_key()
    reply = svc.join(members.join(x, "n3"))
    assert reply["revoked"] == [c.id]
    rows = {r["id"]: r for r in svc.credential_list()}
    assert rows[c.id]["node_id"] == "n1" and not rows[c.id]["live"] and rows[pinned_rec["id"]]["node_id"] is None
    store.close()
    svc2, store2 = tracker(tmp_path)  # issued and revoked credentials outlive a restart
    assert c.id in svc2.credentials and {r["id"] for r in svc2.credential_list()} == set(rows)
    store2.close()


def test_expired_credentials_and_durations():
    c = Credential("c1", "rollout", None, None, 0.0, 100.0)
    c.check(99.0, ())
    refused("expired", c.check, 100.0, ())
    refused("revoked", c.check, 50.0, {"c1"})
    assert [parse_duration(t) for t in ("30d", "12h", "90m", "45s", "2w", "60")] == [
        30 * 86400, 12 * 3600, 90 * 60, 45, 14 * 86400, 60]
    for bad in ("", "d", "-1d", "0", "nan", "1y"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_a_peer_proof_is_for_one_receiver_one_key_and_a_short_while():
    a = new_key()
    now = time.time()
    p = make_proof(a, "r0", "r1", now, 7)
    assert check_proof(p, a.public, "r0", "r1", now + 1, 7)
    assert not check_proof(p, a.public, "r0", "r2", now, 7)  # r1 cannot pass r0's proof on to r2
    assert not check_proof(p, a.public, "r9", "r1", now, 7)  # nor claim to be another node with it
    assert not check_proof(p, a.public, "r0", "r1", now, 8)  # nor is it good for another lease
    assert not check_proof(p, new_key().public, "r0", "r1", now, 7)
    assert not check_proof(p, a.public, "r0", "r1", now + PROOF_TTL + 1, 7)
    for junk in ("", "x.y", "1.", ".AAAA", "1e400." + "A" * 86):
        assert not check_proof(junk, a.public, "r0", "r1", now, 7)


def test_a_ticket_carries_the_lease_and_ends_with_the_ttl_or_its_credential():
    t = [1_000_000.0]
    svc, _ = tracker(ttl=15.0, clock=lambda: t[0])
    rec, text = svc.issue(role="rollout", region="us", lifetime=10.0)
    c = Credential.parse(text, svc.trainer_key)
    a = new_key()
    reply = svc.join(members.join(a, "n1", region="us", ts=t[0]), credential=c)
    ticket = Ticket.parse(reply["ticket"], svc.trainer_key)
    assert (ticket.node_id, ticket.role, ticket.region, ticket.key, ticket.epoch, ticket.credential) == (
        "n1", "rollout", "us", a.public, reply["epoch"], c.id)
    assert ticket.expires == t[0] + 10.0  # the credential ends before the ticket would
    ticket.check(t[0] + 9.9, ())
    refused("expired", ticket.check, t[0] + 10.0, ())
    refused("revoked", ticket.check, t[0], {c.id})
    # A node that joined with the shared token: a ticket for TICKET_LIFE (or a TTL, if longer).
    b = new_key()
    plain = Ticket.parse(svc.join(members.join(b, "n2", ts=t[0]))["ticket"], svc.trainer_key)
    assert plain.expires == t[0] + max(15.0, TICKET_LIFE) and plain.credential is None
    # Another trainer's ticket, or a tampered one, is not this swarm's.
    claims, sig = reply["ticket"].split(".")
    mid = len(claims) // 2
    tampered = claims[:mid] + ("B" if claims[mid] == "A" else "A") + claims[mid + 1:] + "." + sig
    for bad in (tampered, Ticket("n1", "rollout", "us", a.public, 1, None, t[0] + 99).text(new_key().sign)):
        refused("bad-ticket", Ticket.parse, bad, svc.trainer_key)
    for junk in ("", "x", "a.b.c", "!!.??", "A" * 2000 + ".A"):
        with pytest.raises((FormatError, Refused)):
            Ticket.parse(junk, svc.trainer_key)


def test_a_lease_is_bound_to_its_credential_for_its_whole_life():
    """Renewals presenting another credential are refused; the credential's expiry or revocation
    ends the lease at the tracker (at its next renewal, or at the sweep after it expires)."""
    t = [1_000_000.0]
    svc, _ = tracker(ttl=15.0, clock=lambda: t[0])
    _, text1 = svc.issue(role="rollout", region="us", lifetime=20.0)
    _, text2 = svc.issue(role="rollout", region="us", lifetime=3600.0)
    c1, c2 = (Credential.parse(x, svc.trainer_key) for x in (text1, text2))
    a, b = new_key(), new_key()
    e1 = svc.join(members.join(a, "n1", region="us", ts=t[0]), credential=c1)["epoch"]
    e2 = svc.join(members.join(b, "n2", region="us", ts=t[0]), credential=c2)["epoch"]
    t[0] += 5
    assert "joined with credential" in refused("credential", svc.renew, members.renew(a, "n1", e1, ts=t[0]),
                                                credential=c2)
    svc.renew(members.renew(a, "n1", e1, ts=t[0] + 0.1), credential=c1)
    svc.renew(members.renew(a, "n1", e1, ts=t[0] + 0.2))  # the shared token (credential None) is the operator's
    svc.renew(members.renew(b, "n2", e2, ts=t[0] + 0.3), credential=c2)
    # c1 expires at +20 s: the sweep right after ends n1's lease, though its TTL has time left.
    t[0] += 14.9
    svc.renew(members.renew(a, "n1", e1, ts=t[0]), credential=c1)
    svc.renew(members.renew(b, "n2", e2, ts=t[0]), credential=c2)
    t[0] += 0.2
    assert [n.node_id for n in svc.sweep()] == ["n1"]
    assert {n["node_id"] for n in svc.status()["nodes"]} == {"n2"}
    refused("expired", svc.join, members.join(a, "n1", region="us", ts=t[0]), credential=c1)
    # A renewal under an expired credential (no sweep yet) is refused and ends the lease too.
    svc2, _ = tracker(ttl=15.0, clock=lambda: t[0])
    _, text3 = svc2.issue(role="rollout", region="us", lifetime=5.0)
    c3 = Credential.parse(text3, svc2.trainer_key)
    e3 = svc2.join(members.join(a, "n3", region="us", ts=t[0]), credential=c3)["epoch"]
    t[0] += 6
    refused("expired", svc2.renew, members.renew(a, "n3", e3, ts=t[0]))
    assert svc2.status()["nodes"] == []
    # Revoked: the next renewal finds the lease gone.
    svc.revoke(c2.id)
    with pytest.raises((LeaseGone, Refused)):
        svc.renew(members.renew(b, "n2", e2, ts=t[0] + 1), credential=c2)


def test_a_signed_renewal_captured_before_a_tracker_restart_is_refused_after_it(tmp_path):
    svc, store = tracker(tmp_path)
    a = new_key()
    reply = svc.join(members.join(a, "r0"))
    captured = members.renew(a, "r0", reply["epoch"], boot=reply["boot"])
    assert svc.renew(captured)["epoch"] == reply["epoch"]
    captured_leave = members.leave(a, "r0", reply["epoch"])  # one without a boot, made before the restart
    store.close()
    restarted, _ = tracker(tmp_path)  # the lease table and bindings come back; the last times do not
    with pytest.raises(SessionUnknown) as e:
        restarted.renew(captured)
    assert e.value.boot == restarted.boot != reply["boot"]
    with pytest.raises(SessionUnknown):  # nor a captured leave
        restarted.leave(captured_leave)
    assert restarted.renew(members.renew(a, "r0", reply["epoch"], boot=restarted.boot))["epoch"] == reply["epoch"]
