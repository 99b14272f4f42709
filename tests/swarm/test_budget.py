"""A peer's budget of CPU and bytes (``swarm.budget``): the rules on a virtual clock."""

from __future__ import annotations

from sparrowd.swarm.budget import BAN, BYTE_BURST, CHOKE, CPU_BURST, CPU_RATE, STRIKES, Budgets, PeerBudget


def test_an_honest_peer_never_touches_its_budget():
    b = PeerBudget()
    now = 1000.0
    for _ in range(100_000):  # 1,000 exchanges a second for 100 s, 0.2 ms and 2 KiB each
        assert b.spend(now, 0.0002, 2048) is None
        now += 0.001
    assert b.refused(now) is None


def test_a_peer_over_its_budget_is_choked_then_banned():
    b = PeerBudget()
    now = 1000.0
    assert b.spend(now, CPU_BURST / 2, 100) is None
    assert b.spend(now, CPU_BURST, 100) == "choked"  # overdrawn
    assert b.refused(now) == "choked" and b.refused(now + CHOKE) is None
    verdicts = []
    for _ in range(STRIKES - 1):
        now += CHOKE + 0.1
        verdicts.append(b.spend(now, 10 * CPU_BURST, 100))
    assert verdicts[-1] == "banned" and set(verdicts[:-1]) <= {"choked"}
    assert b.refused(now + CHOKE + 1) == "banned" and b.refused(now + BAN) is None
    # Time refills the buckets: long after, the peer is a peer again.
    later = now + BAN + 10 * CPU_BURST / CPU_RATE
    assert b.spend(later, 0.001, 100) is None and b.refused(later) is None


def test_bytes_count_as_cpu_does():
    b = PeerBudget()
    assert b.spend(0.0, 0.0, BYTE_BURST + 1) == "choked"


def test_budgets_are_per_peer_and_bounded():
    bs = Budgets()
    bs.of("liar").spend(0.0, 10 * CPU_BURST, 0)
    assert bs.refused("liar", 0.1) == "choked" and bs.refused("honest", 0.1) is None
    for i in range(10_000):
        bs.of(f"n{i}")
    assert len(bs._by_peer) <= 8192
