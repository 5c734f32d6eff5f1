"""A queue of background jobs run one at a time, each retried until it succeeds or is dropped.

The S3 tier's work (rebuilding from S3, uploads, removals) runs here because S3 is the slowest
tier and must never delay the faster ones. A job that raises runs again after an exponential,
capped and jittered wait; a job that no longer has anything to do simply returns. The queue
itself is not persistent: the catalog is (see `ckptd.catalog`), and a restart queues again
whatever it still owes.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

log = logging.getLogger(__name__)

Job = Callable[[], None]
OnError = Callable[[Hashable, BaseException, float], None]


class BackgroundQueue:
    """Jobs keyed by an id (a job already queued under the same id is not queued twice)."""

    def __init__(
        self,
        name: str,
        on_error: OnError,
        backoff_s: float,
        backoff_max_s: float,
    ) -> None:
        self._on_error = on_error
        self._backoff_s = backoff_s
        self._backoff_max_s = backoff_max_s
        self._cond = threading.Condition()
        self._ready: OrderedDict[Hashable, Job] = OrderedDict()
        self._delayed: list[tuple[float, int, Hashable, Job]] = []
        self._failures: dict[Hashable, int] = {}
        self._order = itertools.count()
        self._running: Hashable | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs waiting or running."""
        with self._cond:
            return len(self._ready) + len(self._delayed) + (self._running is not None)

    def submit(self, job_id: Hashable, job: Job) -> None:
        with self._cond:
            waiting = job_id in self._ready or any(d[2] == job_id for d in self._delayed)
            if waiting or job_id == self._running:
                return  # a job waiting for its retry keeps its backoff
            self._ready[job_id] = job
            self._cond.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no job is queued, delayed or running; False if `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._ready or self._delayed or self._running is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout_s: float) -> None:
        """Let the job in flight finish for up to `timeout_s`, then stop; the rest is dropped."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def _next(self) -> tuple[Hashable, Job] | None:
        with self._cond:
            while not self._stop:
                now = time.monotonic()
                while self._delayed and self._delayed[0][0] <= now:
                    _, _, job_id, job = heapq.heappop(self._delayed)
                    self._ready.setdefault(job_id, job)
                if self._ready:
                    job_id, job = self._ready.popitem(last=False)
                    self._running = job_id
                    return job_id, job
                wait = self._delayed[0][0] - now if self._delayed else None
                self._cond.wait(wait)
            return None

    def _run(self) -> None:
        while (item := self._next()) is not None:
            job_id, job = item
            try:
                job()
            except Exception as exc:  # any failure is retried later
                failures = self._failures.get(job_id, 0) + 1
                cap = min(self._backoff_max_s, self._backoff_s * 2 ** (failures - 1))
                delay = random.uniform(cap / 2, cap)
                try:
                    self._on_error(job_id, exc, delay)
                except Exception:
                    log.exception("error handler of background job %s failed", job_id)
                with self._cond:
                    self._failures[job_id] = failures
                    if job_id not in self._ready:
                        due = time.monotonic() + delay
                        heapq.heappush(self._delayed, (due, next(self._order), job_id, job))
            else:
                self._failures.pop(job_id, None)
            finally:
                with self._cond:
                    self._running = None
                    self._cond.notify_all()
