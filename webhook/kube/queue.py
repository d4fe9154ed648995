"""A rate-limited work queue of keys with client-go's semantics (`util/workqueue`).

- A key is queued at most once (`dirty`), however often it is added before a worker takes it.
- A key a worker is processing is never handed to a second worker: added meanwhile, it is queued again
  once, when the first calls `done`. So one key is reconciled by one worker at a time.
- `add_after` queues a key later (the earliest of several delays wins); `add_rate_limited` backs a
  failing key off exponentially (5 ms doubling to 1000 s) and the whole queue to 10 keys/s after a
  burst of 100, as `DefaultTypedControllerRateLimiter`; `forget` resets a key's failures.
- `shutdown` wakes every waiting `get` with None.

Time comes from `clock` (monotonic seconds), so tests drive delays without sleeping.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

BASE_DELAY_SECONDS = 0.005
MAX_DELAY_SECONDS = 1000.0
QUEUE_QPS = 10.0
QUEUE_BURST = 100


class TokenBucket:
    """The delay a caller must wait for its token: 0 within the burst, then 1/qps apart."""

    def __init__(self, qps: float, burst: int, clock: Callable[[], float]) -> None:
        self.qps = qps
        self.burst = burst
        self.clock = clock
        self._tokens = float(burst)
        self._last = clock()

    def reserve(self) -> float:
        now = self.clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.qps)
        self._last = now
        self._tokens -= 1
        return 0.0 if self._tokens >= 0 else -self._tokens / self.qps


class WorkQueue(Generic[K]):
    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        base_delay: float = BASE_DELAY_SECONDS,
        max_delay: float = MAX_DELAY_SECONDS,
        qps: float = QUEUE_QPS,
        burst: int = QUEUE_BURST,
    ) -> None:
        self.clock = clock
        self.base_delay = base_delay
        self.max_delay = max_delay
        self._bucket = TokenBucket(qps, burst, clock)
        self._queue: collections.deque[K] = collections.deque()
        self._dirty: set[K] = set()
        self._processing: set[K] = set()
        self._waiting: list[tuple[float, int, K]] = []
        self._due: dict[K, float] = {}
        self._failures: dict[K, int] = {}
        self._order = itertools.count()
        self._shutting_down = False
        self._cond = threading.Condition()

    def __len__(self) -> int:
        """Keys waiting for a worker (not those delayed or being processed)."""
        with self._cond:
            return len(self._queue)

    def add(self, key: K) -> None:
        with self._cond:
            self._add(key)

    def _add(self, key: K) -> None:
        if self._shutting_down or key in self._dirty:
            return
        self._dirty.add(key)
        if key in self._processing:
            return  # queued again by done()
        self._queue.append(key)
        self._cond.notify()

    def add_after(self, key: K, delay: float) -> None:
        if delay <= 0:
            self.add(key)
            return
        with self._cond:
            if self._shutting_down:
                return
            due = self.clock() + delay
            if key in self._due and self._due[key] <= due:
                return  # an earlier delay already holds the key
            self._due[key] = due
            heapq.heappush(self._waiting, (due, next(self._order), key))
            self._cond.notify()

    def add_rate_limited(self, key: K) -> None:
        with self._cond:
            failures = self._failures.get(key, 0)
            self._failures[key] = failures + 1
            item_delay = min(self.base_delay * 2**failures, self.max_delay)
            delay = max(item_delay, self._bucket.reserve())
        self.add_after(key, delay)

    def forget(self, key: K) -> None:
        with self._cond:
            self._failures.pop(key, None)

    def requeues(self, key: K) -> int:
        with self._cond:
            return self._failures.get(key, 0)

    def get(self, timeout: float | None = None) -> K | None:
        """The next key, marked as being processed (call `done`); None on shutdown or timeout."""
        deadline = None if timeout is None else self.clock() + timeout
        with self._cond:
            while True:
                self._release_due()
                if self._queue:
                    key = self._queue.popleft()
                    self._dirty.discard(key)
                    self._processing.add(key)
                    return key
                if self._shutting_down:
                    return None
                now = self.clock()
                waits = [self._waiting[0][0] - now] if self._waiting else []
                if deadline is not None:
                    if now >= deadline:
                        return None
                    waits.append(deadline - now)
                self._cond.wait(max(min(waits), 0.001) if waits else None)

    def _release_due(self) -> None:
        now = self.clock()
        while self._waiting and self._waiting[0][0] <= now:
            due, _, key = heapq.heappop(self._waiting)
            if self._due.get(key) == due:
                del self._due[key]
                self._add(key)

    def done(self, key: K) -> None:
        with self._cond:
            self._processing.discard(key)
            if key in self._dirty:
                self._queue.append(key)
                self._cond.notify()

    def shutdown(self) -> None:
        with self._cond:
            self._shutting_down = True
            self._cond.notify_all()
