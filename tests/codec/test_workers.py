"""The encoder's pool: urgent jobs (a chunk's chain of segments) before queued diffs."""

import threading

import pytest

from sparrowd.codec.workers import Workers, urgent


def test_urgent_jobs_run_before_queued_ones_each_kind_in_order():
    gate, ran = threading.Event(), []
    with Workers(1) as pool:
        first = pool.submit(gate.wait)  # holds the only worker while the rest queue up
        later = [pool.submit(ran.append, f"job{i}") for i in range(3)]
        ahead = [urgent(pool, ran.append, f"urgent{i}") for i in range(2)]
        gate.set()
        for f in [first, *later, *ahead]:
            f.result(timeout=10)
    assert ran == ["urgent0", "urgent1", "job0", "job1", "job2"]


def test_failures_reach_the_future_and_shutdown_lets_queued_jobs_finish():
    done = []
    pool = Workers(2)
    bad = pool.submit(lambda: 1 / 0)
    jobs = [pool.submit(done.append, i) for i in range(50)]
    pool.shutdown(wait=True)
    with pytest.raises(ZeroDivisionError):
        bad.result()
    assert sorted(done) == list(range(50)) and all(f.done() for f in jobs)
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(print)
    with pytest.raises(RuntimeError, match="after shutdown"):
        urgent(pool, print)


def test_cancelled_on_shutdown_when_asked_and_any_executor_takes_urgent_jobs():
    from concurrent.futures import ThreadPoolExecutor

    gate = threading.Event()
    pool = Workers(1)
    pool.submit(gate.wait)
    queued = pool.submit(print, "never")
    threading.Timer(0.2, gate.set).start()
    pool.shutdown(wait=True, cancel_futures=True)
    assert queued.cancelled()
    with ThreadPoolExecutor(1) as plain:  # no urgent lane: an ordinary job
        assert urgent(plain, sum, [1, 2]).result(timeout=10) == 3
