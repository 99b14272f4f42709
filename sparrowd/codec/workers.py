"""A thread pool that runs urgent jobs before the others.

An encoder's pool holds two kinds of work: diffs of whole tensors, queued a few tensors ahead so
that no worker idles, and the jobs that turn a diffed tensor into chunk bytes (a segment's
encoding, the coding of a chunk's ``ulp2`` streams, a chunk's closing). The second kind is a
chain: a chunk's segments are coded one after the other, each from the contexts the one before
left. In a first-in, first-out pool each link waits behind the diffs queued before it, so the
chain falls a few segments behind the diffs and its last links run alone, on one thread, after the
last diff (on the 512 MiB pair: 6 to 9 ms with the other core idle, in a 0.12 s encode).
:class:`Workers` takes urgent jobs first, so the chain keeps up and ends with the diffs.

Any :class:`~concurrent.futures.Executor` serves where a pool is asked for; :func:`urgent` submits
ahead where the pool can, and like any other job where it cannot.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, ParamSpec, TypeVar

__all__ = ["Workers", "urgent", "cpu_threads"]

P = ParamSpec("P")
T = TypeVar("T")
_Job = tuple["Future[Any]", Callable[..., Any], tuple[Any, ...], dict[str, Any]]

MAX_THREADS = 8  # threads a pool of sparrowd's takes by default, at most: memory-bound work gains little beyond


def cpu_threads(at_least: int = 1, at_most: int = MAX_THREADS) -> int:
    """A pool's default size: this machine's CPU count, within ``[at_least, at_most]``."""
    return max(at_least, min(at_most, os.cpu_count() or at_least))


class Workers(Executor):
    """``n`` worker threads; :meth:`submit_urgent` jobs run before :meth:`submit` jobs, each kind
    in the order it came. Shutting down lets queued jobs finish (none is cancelled)."""

    def __init__(self, n: int, name: str = "sparrowd-worker"):
        self._urgent: deque[_Job] = deque()
        self._jobs: deque[_Job] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
                         for i in range(max(1, n))]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        return self._put(self._jobs, fn, args, kwargs)

    def submit_urgent(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        return self._put(self._urgent, fn, args, kwargs)

    def _put(self, queue: deque[_Job], fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> Future[T]:
        f: Future[T] = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            queue.append((f, fn, args, kwargs))
            self._cv.notify()
        return f

    def _work(self) -> None:
        while True:
            with self._cv:
                while not (self._urgent or self._jobs or self._closed):
                    self._cv.wait()
                if not (self._urgent or self._jobs):
                    return  # closed, and nothing left
                f, fn, args, kwargs = (self._urgent or self._jobs).popleft()
            if not f.set_running_or_notify_cancel():
                continue
            try:
                f.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed on to whoever waits for the future
                f.set_exception(exc)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._cv:
            self._closed = True
            if cancel_futures:
                for q in (self._urgent, self._jobs):
                    while q:
                        q.popleft()[0].cancel()
            self._cv.notify_all()
        if wait:
            for t in self._threads:
                if t is not threading.current_thread():
                    t.join()


def urgent(pool: Executor, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
    """``fn(*args, **kwargs)`` on ``pool``, ahead of its queued jobs where it is :class:`Workers`."""
    submit = getattr(pool, "submit_urgent", None) or pool.submit
    return submit(fn, *args, **kwargs)
