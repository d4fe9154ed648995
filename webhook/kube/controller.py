"""The reconcile loop: workers take keys from a work queue and converge each one.

The contract (controller-runtime's): a key names an object, never an event or its contents; the
reconcile reads the current state from a cache and works out what to do, so it is level-based and may
run any number of times. It returns a `Result` (`requeue_after`: look again then, as for a timer that
no object change would trigger), raises to be retried with backoff, or raises `TerminalError` to give
up on the key until it is added again.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from webhook.kube.queue import WorkQueue

K = TypeVar("K", bound=Hashable)
Outcome = Literal["success", "requeue_after", "error", "terminal"]
# How long an idle worker waits for a key before it looks at the stop flag again.
IDLE_WAIT_SECONDS = 1.0

log = logging.getLogger("gpuguard.controller")


@dataclass(frozen=True)
class Result:
    requeue_after: float | None = None


class TerminalError(Exception):
    """Retrying cannot help (the object is invalid, say): logged and counted, not requeued."""


class Controller(Generic[K]):
    def __init__(
        self,
        name: str,
        reconcile: Callable[[K], Result],
        *,
        stop: threading.Event,
        queue: WorkQueue[K] | None = None,
        workers: int = 1,
        observe: Callable[[Outcome, float], None] = lambda outcome, seconds: None,
    ) -> None:
        self.name = name
        self.reconcile = reconcile
        self.stop = stop
        self.queue: WorkQueue[K] = queue if queue is not None else WorkQueue()
        self.workers = workers
        self.observe = observe
        self._threads: list[threading.Thread] = []

    def enqueue(self, key: K) -> None:
        self.queue.add(key)

    def start(self) -> None:
        for index in range(self.workers):
            thread = threading.Thread(target=self._work, name=f"{self.name}-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops taking keys; waits for the reconciles in flight to finish."""
        self.queue.shutdown()
        for thread in self._threads:
            thread.join(timeout)

    def _work(self) -> None:
        while not self.stop.is_set():
            self.process_next(IDLE_WAIT_SECONDS)

    def process_next(self, timeout: float | None = None) -> bool:
        """Reconciles one key; False when none came within `timeout` (or the queue shut down)."""
        key = self.queue.get(timeout)
        if key is None:
            return False
        reconcile_id = uuid.uuid4().hex[:12]
        start = time.monotonic()
        outcome: Outcome
        try:
            result = self.reconcile(key)
        except TerminalError as exc:
            outcome = "terminal"
            self.queue.forget(key)
            self._log_failure(key, reconcile_id, exc, retrying=False)
        except Exception as exc:
            outcome = "error"
            self.queue.add_rate_limited(key)
            self._log_failure(key, reconcile_id, exc, retrying=True)
        else:
            self.queue.forget(key)
            if result.requeue_after is not None:
                outcome = "requeue_after"
                self.queue.add_after(key, result.requeue_after)
            else:
                outcome = "success"
        finally:
            self.queue.done(key)
        self.observe(outcome, time.monotonic() - start)
        return True

    def _log_failure(self, key: K, reconcile_id: str, exc: Exception, *, retrying: bool) -> None:
        fields = {"controller": self.name, "key": str(key), "reconcileID": reconcile_id}
        # An ApiException's text carries every response header: its first lines say enough.
        why = " ".join(str(exc).splitlines()[:2]) or type(exc).__name__
        log.warning(
            "%s: reconcile of %s failed%s: %s",
            self.name,
            key,
            ", retrying" if retrying else "",
            why,
            extra={"fields": {**fields, "error": why}},
            exc_info=not isinstance(exc, TerminalError) and log.isEnabledFor(logging.DEBUG),
        )
