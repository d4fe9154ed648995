"""The audit in the background: the PolicyReports kept current on an interval and soon after every
policy change, with metrics of each run. A runnable for a long-lived process (the controllers'
Deployment); one replica at a time should run it (`needs_leader`), since the reports are one per
namespace and the writes of two would only race.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

from webhook.audit import findings, reports, scan
from webhook.kube.client import ApiClient
from webhook.kube.listing import ClusterReader
from webhook.kube.reports import MISSING_REPORT_API, ReportWriter, served_report_api
from webhook.policy.model import RULE_IDS, Policy

DEFAULT_INTERVAL_SECONDS = 3600.0  # Kyverno's background scan interval
# A policy change is often several edits in a row: wait this long after one before auditing again.
POLICY_SETTLE_SECONDS = 5.0
RESULTS = ("pass", "fail", "warn", "skip")

log = logging.getLogger("gpuguard.audit")


class AuditMetrics:
    """The last successful run's results per rule, and how the runs went."""

    def __init__(self) -> None:
        self.results: Counter[tuple[str, str]] = Counter()
        self.runs: Counter[str] = Counter()
        self.last_success = 0.0
        self.last_duration = 0.0
        self._lock = threading.Lock()

    def succeeded(self, audit: findings.Audit, *, at: float, seconds: float) -> None:
        counts: Counter[tuple[str, str]] = Counter(
            (result.rule, reports.REPORT_RESULT[result.verdict])
            for finding in audit.findings
            for result in finding.results
        )
        with self._lock:
            self.results = counts
            self.runs["success"] += 1
            self.last_success, self.last_duration = at, seconds

    def failed(self) -> None:
        with self._lock:
            self.runs["error"] += 1

    def render(self) -> str:
        with self._lock:
            results, runs = Counter(self.results), Counter(self.runs)
            last_success, last_duration = self.last_success, self.last_duration
        lines = [
            "# HELP gpuguard_audit_results Results of the last audit run, by rule and result.",
            "# TYPE gpuguard_audit_results gauge",
            *(
                f'gpuguard_audit_results{{rule="{rule}",result="{result}"}} {results[(rule, result)]}'
                for rule in RULE_IDS
                for result in RESULTS
            ),
            "# HELP gpuguard_audit_runs_total Audit runs, by outcome.",
            "# TYPE gpuguard_audit_runs_total counter",
            *(f'gpuguard_audit_runs_total{{result="{r}"}} {runs[r]}' for r in ("success", "error")),
            "# HELP gpuguard_audit_last_success_timestamp_seconds When the last audit run succeeded.",
            "# TYPE gpuguard_audit_last_success_timestamp_seconds gauge",
            f"gpuguard_audit_last_success_timestamp_seconds {last_success}",
            "# HELP gpuguard_audit_duration_seconds How long the last successful audit run took.",
            "# TYPE gpuguard_audit_duration_seconds gauge",
            f"gpuguard_audit_duration_seconds {last_duration}",
        ]
        return "\n".join(lines) + "\n"


class ReportLoop:
    """Runs the audit and writes its reports every `interval` seconds, and once more shortly after
    `policy_changed()`. A run that fails (no report CRD, the API away) is logged, counted, and tried
    again at the next interval."""

    needs_leader = True

    def __init__(
        self,
        api: ApiClient,
        policy: Callable[[], Policy],
        *,
        interval: float = DEFAULT_INTERVAL_SECONDS,
        settle: float = POLICY_SETTLE_SECONDS,
        metrics: AuditMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.api = api
        self.policy = policy
        self.interval = interval
        self.settle = settle
        self.metrics = metrics or AuditMetrics()
        self.clock = clock
        self._wake = threading.Event()
        self._policy_changed = False

    def policy_changed(self) -> None:
        """Asks for a run soon: callable from any thread (a PolicyStore's on_loaded hook)."""
        self._policy_changed = True
        self._wake.set()

    def run_once(self) -> bool:
        """One audit, written as reports; False (logged and counted) when it could not be."""
        started = time.monotonic()
        try:
            report_api = served_report_api(self.api)
            if report_api is None:
                raise RuntimeError(MISSING_REPORT_API)
            policy = self.policy()
            audit = scan.scan(ClusterReader(self.api), policy)
            outcomes = scan.write_reports(ReportWriter(self.api, report_api), audit, now=int(self.clock()))
        except Exception:
            log.exception("audit run failed; next try in %.0f s", self.interval)
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

    def start(self, stop: threading.Event) -> list[threading.Thread]:
        """The loop's thread, and one that wakes it when `stop` is set; both daemons, both started."""

        def loop() -> None:
            while not stop.is_set():
                self.run_once()
                self._wake.wait(self.interval)
                self._wake.clear()
                while self._policy_changed and not stop.is_set():
                    # Let a burst of edits settle: each one restarts the wait; a stop ends it at once.
                    self._policy_changed = False
                    self._wake.wait(self.settle)
                    self._wake.clear()

        def bridge() -> None:
            stop.wait()
            self._wake.set()

        threads = [
            threading.Thread(target=loop, name="audit-reports", daemon=True),
            threading.Thread(target=bridge, name="audit-reports-stop", daemon=True),
        ]
        for thread in threads:
            thread.start()
        return threads
