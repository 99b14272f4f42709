"""Follow mode's policy, pure: when the daemon moves its vLLM server to a newer version."""

from sparrowd.swarm.follow import IDLE, decide, retry_pause


def test_nothing_to_do_without_a_server_or_a_newer_version():
    # Not attached, nothing ready, or the server already on the newest: look again later.
    assert decide(0.0, server=None, ready=3, every=0, last_update=None).target is None
    assert decide(0.0, server=3, ready=None, every=0, last_update=None).target is None
    assert decide(0.0, server=3, ready=3, every=0, last_update=None) == (decide(0.0, server=3, ready=2, every=0,
                                                                               last_update=None))
    assert decide(0.0, server=3, ready=3, every=0, last_update=None).wait == IDLE


def test_every_version_at_once_by_default():
    # every=0: straight to the newest ready version, however recent the last update.
    d = decide(100.0, server=1, ready=4, every=0, last_update=99.9)
    assert (d.target, d.wait) == (4, 0.0)


def test_at_most_every_t_seconds_and_then_to_the_newest():
    # every=10, last update at t=95: wait until t=105, then jump to the newest ready version.
    d = decide(100.0, server=1, ready=2, every=10, last_update=95.0)
    assert d.target is None and abs(d.wait - 5.0) < 1e-9
    assert decide(105.0, server=1, ready=6, every=10, last_update=95.0).target == 6
    # The first update never waits.
    assert decide(0.0, server=0, ready=1, every=10, last_update=None).target == 1


def test_failures_back_off_1_2_4_8_then_10_seconds():
    assert [retry_pause(n) for n in range(7)] == [0, 1, 2, 4, 8, 10, 10]
    d = decide(101.0, server=1, ready=2, every=0, last_update=None, failures=3, failed_at=100.0)
    assert d.target is None and abs(d.wait - 3.0) < 1e-9
    assert decide(104.0, server=1, ready=2, every=0, last_update=None, failures=3, failed_at=100.0).target == 2
