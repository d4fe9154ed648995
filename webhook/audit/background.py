"""The audit in the background: PolicyReports kept current on an interval and soon after every policy
change, with metrics of each run. A runnable for a long-lived process (the controllers' Deployment):

    reports = ReportLoop.for_cluster(api, lambda: store.policy, stop=stop)
    reports.start()                 # on the leader only (`needs_leader`): reports are one per
                                    # namespace, and the writes of two replicas would only race
    store.on_loaded -> reports.policy_changed()
    /metrics      -> reports.metrics.render()
    reports.shutdown()

When to run is `schedule.Schedule`'s decision (pure), every `audit.reportIntervalSeconds` of the
current policy (0: never); what a run does is the function given, for a cluster `scan.ClusterReports`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from webhook.audit import findings, scan
from webhook.audit.schedule import AuditMetrics, Schedule
from webhook.kube.client import ApiClient
from webhook.kube.reports import Written
from webhook.policy.model import Policy

# One audit with a policy at a time (seconds since the epoch, for the reports): the findings, and what
# writing them did (created, updated, ... and how many of each).
AuditRun = Callable[[Policy, int], tuple[findings.Audit, Mapping[Written, int]]]

log = logging.getLogger("gpuguard.audit")


class ReportLoop:
    """Runs `audit_and_write` with the current policy when `schedule` says so, on a thread of its own,
    until `stop` is set or `shutdown()` is called. A failed run is logged, counted and retried."""

    needs_leader = True

    def __init__(
        self,
        audit_and_write: AuditRun,
        policy: Callable[[], Policy],
        *,
        stop: threading.Event,
        schedule: Schedule | None = None,
        metrics: AuditMetrics | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.audit_and_write = audit_and_write
        self.policy = policy
        self.stop = stop
        self.schedule = schedule or Schedule()
        self.metrics = metrics or AuditMetrics()
        self.clock = clock
        self.monotonic = monotonic
        self._lock = threading.Lock()  # the schedule is moved from the loop and from policy hooks
        self._wake = threading.Event()
        self._halt = threading.Event()
        self._threads: list[threading.Thread] = []

    @classmethod
    def for_cluster(cls, api: ApiClient, policy: Callable[[], Policy], **options: Any) -> ReportLoop:
        return cls(scan.ClusterReports(api), policy, **options)

    def policy_changed(self) -> None:
        """Asks for a run once the change settles: callable from any thread (a PolicyStore's on_loaded)."""
        with self._lock:
            self.schedule.policy_changed(self.monotonic())
        self._wake.set()

    def run_once(self) -> bool:
        """One audit, written as reports; False (logged and counted) when it could not be."""
        started = time.monotonic()
        try:
            policy = self.policy()
            audit, outcomes = self.audit_and_write(policy, int(self.clock()))
        except Exception:
            log.exception("audit run failed; trying again in %.0f s", self.schedule.retry)
            self.metrics.failed()
            return False
        seconds = time.monotonic() - started
        self.metrics.succeeded(audit, at=self.clock(), seconds=seconds)
        fields: dict[str, object] = {
            "policy": policy.hash,
            "seconds": round(seconds, 3),
            "reports": dict(outcomes),
        }
        log.info(
            "audit run: %d findings, reports %s",
            len(audit.findings),
            dict(outcomes),
            extra={"fields": fields},
        )
        return True

    def _loop(self) -> None:
        while not self._stopped():
            interval = self.policy().audit.reportIntervalSeconds
            if interval == 0:
                # Off by policy: nothing runs until a policy change (or a stop) wakes the loop.
                self._wake.wait()
                self._wake.clear()
                continue
            with self._lock:
                self.schedule.every(interval)
                wait = self.schedule.wait(self.monotonic())
            if wait > 0:
                # Woken early by a policy change or a stop; either way the schedule is read again.
                self._wake.wait(wait)
                self._wake.clear()
                continue
            started = self.monotonic()
            ok = self.run_once()
            with self._lock:
                self.schedule.ran(started, self.monotonic(), ok=ok)

    def _stopped(self) -> bool:
        return self.stop.is_set() or self._halt.is_set()

    def _wake_on_stop(self) -> None:
        while not self._halt.is_set():
            if self.stop.wait(1.0):
                break
        self._wake.set()

    def start(self) -> None:
        """Starts the loop's thread (and one that wakes it when `stop` is set); both daemons."""
        if self._threads:
            raise RuntimeError("the report loop is already started")
        self._threads = [
            threading.Thread(target=self._loop, name="audit-reports", daemon=True),
            threading.Thread(target=self._wake_on_stop, name="audit-reports-stop", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops the loop; a run in flight finishes first (within `timeout`)."""
        self._halt.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout)

    @property
    def running(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)
