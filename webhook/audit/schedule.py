"""When the background audit runs next, and what its runs found: pure, on numbers a test chooses.

The reports are kept current on an interval and soon after a policy change. A policy change is often
several edits in a row, so a run waits until the edits settle; a stream of edits that never settles
still gets its run when the interval comes. A run that failed (no report CRD yet, the API away) is
tried again sooner than the interval, but not in a tight loop.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping

from webhook.audit import findings, reports
from webhook.policy.model import RULE_IDS

DEFAULT_INTERVAL_SECONDS = 3600.0  # Kyverno's background scan interval
# Wait this long after a policy edit before auditing: the next edit of a burst restarts the wait.
POLICY_SETTLE_SECONDS = 5.0
# After a failed run: soon enough that a CRD installed now is used within minutes, rare enough to log.
RETRY_SECONDS = 300.0
RESULTS = ("pass", "fail", "warn", "skip")


class Schedule:
    """The next run's time (`due`), moved by what happened: a run, a failure, a policy change.

    All times are seconds on one clock (the caller's); the first run is due at once.
    """

    def __init__(
        self,
        *,
        interval: float = DEFAULT_INTERVAL_SECONDS,
        settle: float = POLICY_SETTLE_SECONDS,
        retry: float = RETRY_SECONDS,
    ) -> None:
        if min(interval, settle, retry) < 0:
            raise ValueError("interval, settle and retry are seconds, not negative")
        self.interval = interval
        self.settle = settle
        self._retry = retry
        self.retry = min(retry, interval)
        self.due = 0.0
        self._regular = 0.0  # when the interval (or the retry) alone would run it
        self._changed_at: float | None = None  # the last policy change not yet audited

    def every(self, interval: float) -> None:
        """The interval from the next run on (the policy's, which may change); a run already due keeps
        its time (a policy change brings one within `settle` anyway)."""
        if interval < 0:
            raise ValueError("an interval is seconds, not negative")
        self.interval = interval
        self.retry = min(self._retry, interval)

    def ran(self, started: float, finished: float, *, ok: bool = True) -> None:
        """A run that began at `started` ended at `finished`; `ok` False: it failed."""
        self._regular = finished + (self.interval if ok else self.retry)
        changed = self._changed_at
        if changed is not None and changed >= started:
            # The policy changed while this run read the cluster: it may have judged with the old one.
            self.due = min(self._regular, max(finished, changed + self.settle))
        else:
            self._changed_at = None
            self.due = self._regular

    def policy_changed(self, at: float) -> None:
        # Each edit of a burst pushes the run out by `settle`, never past the regular run.
        self._changed_at = at
        self.due = min(self._regular, at + self.settle)

    def wait(self, now: float) -> float:
        """Seconds until the next run (0: now)."""
        return max(0.0, self.due - now)


class AuditMetrics:
    """The last successful run's results per rule, and how the runs went; rendered for /metrics."""

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

    def snapshot(self) -> tuple[Mapping[tuple[str, str], int], Mapping[str, int]]:
        with self._lock:
            return Counter(self.results), Counter(self.runs)

    def render(self) -> str:
        results, runs = self.snapshot()
        with self._lock:
            last_success, last_duration = self.last_success, self.last_duration
        lines = [
            "# HELP gpuguard_audit_results Results of the last audit run, by rule and result.",
            "# TYPE gpuguard_audit_results gauge",
            *(
                f'gpuguard_audit_results{{rule="{rule}",result="{result}"}} {results.get((rule, result), 0)}'
                for rule in RULE_IDS
                for result in RESULTS
            ),
            "# HELP gpuguard_audit_runs_total Audit runs, by outcome.",
            "# TYPE gpuguard_audit_runs_total counter",
            *(f'gpuguard_audit_runs_total{{result="{r}"}} {runs.get(r, 0)}' for r in ("success", "error")),
            "# HELP gpuguard_audit_last_success_timestamp_seconds When the last audit run succeeded.",
            "# TYPE gpuguard_audit_last_success_timestamp_seconds gauge",
            f"gpuguard_audit_last_success_timestamp_seconds {last_success}",
            "# HELP gpuguard_audit_duration_seconds How long the last successful audit run took.",
            "# TYPE gpuguard_audit_duration_seconds gauge",
            f"gpuguard_audit_duration_seconds {last_duration}",
        ]
        return "\n".join(lines) + "\n"
