"""The background audit without a cluster: when it runs (the schedule, on numbers chosen here), what its
metrics say, and the loop's thread driven by a plain function in place of the cluster side. The cluster
side (`scan.ClusterReports`) is tested on the real API server (tests/e2e/test_audit.py)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping

import pytest

from tests.harness.manifests import job, make_policy
from webhook.audit import findings
from webhook.audit.background import ReportLoop
from webhook.audit.schedule import AuditMetrics, Schedule
from webhook.kube.reports import Written
from webhook.policy.facts import ClusterFacts
from webhook.policy.model import Policy

WAIT = 30.0  # generous: an event that should come at once, on a loaded machine


def one_job_audit(policy: Policy) -> findings.Audit:
    obj = job()
    obj["metadata"].update(namespace="team", uid="uid-train")
    return findings.audit([obj], policy, ClusterFacts(), check_nodes=False)


# --- the schedule ---------------------------------------------------------------------------------------


def test_the_first_run_is_due_at_once_then_every_interval() -> None:
    schedule = Schedule(interval=3600, settle=5, retry=300)
    assert schedule.wait(now=1000) == 0
    schedule.ran(1000, 1010)
    assert schedule.wait(now=1010) == 3600
    assert schedule.wait(now=4610) == 0


def test_a_policy_change_runs_once_its_edits_settle() -> None:
    schedule = Schedule(interval=3600, settle=5, retry=300)
    schedule.ran(0, 10)
    schedule.policy_changed(at=100)
    assert schedule.wait(now=100) == 5
    schedule.policy_changed(at=103)  # the next edit of a burst restarts the wait
    assert schedule.wait(now=103) == 5
    schedule.ran(108, 110)
    assert schedule.wait(now=110) == 3600  # audited: back to the interval


def test_edits_that_never_settle_still_get_the_regular_run() -> None:
    schedule = Schedule(interval=60, settle=5, retry=30)
    schedule.ran(0, 0)
    for at in range(0, 100, 2):
        schedule.policy_changed(at=at)
        assert schedule.due <= 60


def test_a_change_during_a_run_is_audited_again() -> None:
    # The run began before the edit: it may have judged with the old policy.
    schedule = Schedule(interval=3600, settle=5, retry=300)
    schedule.policy_changed(at=102)
    schedule.ran(100, 120)
    assert schedule.wait(now=120) == 0
    schedule.ran(120, 130)
    assert schedule.wait(now=130) == 3600


def test_a_failed_run_is_retried_sooner_than_the_interval_but_not_at_once() -> None:
    schedule = Schedule(interval=3600, settle=5, retry=300)
    schedule.ran(0, 10, ok=False)
    assert schedule.wait(now=10) == 300
    assert Schedule(interval=60, retry=300).retry == 60  # never later than the interval itself


def test_negative_times_are_refused() -> None:
    with pytest.raises(ValueError, match="not negative"):
        Schedule(interval=-1)


# --- the metrics ----------------------------------------------------------------------------------------


def test_metrics_count_results_per_rule_and_result(policy: Policy) -> None:
    metrics = AuditMetrics()
    metrics.succeeded(one_job_audit(policy), at=1000.0, seconds=0.5)
    metrics.failed()
    text = metrics.render()
    assert 'gpuguard_audit_results{rule="priority",result="fail"} 1' in text
    assert 'gpuguard_audit_results{rule="driverCompatibility",result="skip"} 1' in text
    assert 'gpuguard_audit_results{rule="acceleratorNodeGuard",result="pass"} 1' in text
    assert 'gpuguard_audit_results{rule="acceleratorNodeGuard",result="warn"} 0' in text
    assert 'gpuguard_audit_runs_total{result="error"} 1' in text
    assert "gpuguard_audit_last_success_timestamp_seconds 1000.0" in text


# --- the loop -------------------------------------------------------------------------------------------


class Runs:
    """What the loop runs in place of the cluster side: records each policy, signals each run."""

    def __init__(self, *, fail: bool = False) -> None:
        self.policies: list[str] = []
        self.fail = fail
        self.happened = threading.Semaphore(0)

    def __call__(self, policy: Policy, now: int) -> tuple[findings.Audit, Mapping[Written, int]]:
        self.policies.append(policy.hash)
        self.happened.release()
        if self.fail:
            raise RuntimeError("no PolicyReport CRD")
        written: Counter[Written] = Counter({"created": 1})
        return one_job_audit(policy), written

    def wait(self) -> None:
        assert self.happened.acquire(timeout=WAIT), "the loop did not run"


def test_the_loop_runs_at_once_again_on_a_policy_change_and_stops() -> None:
    policies = [make_policy({}), make_policy({"rules": {"priority": {"mode": "off"}}})]
    current = [policies[0]]
    runs = Runs()
    stop = threading.Event()
    loop = ReportLoop(runs, lambda: current[0], stop=stop, schedule=Schedule(interval=3600, settle=0))
    loop.start()
    try:
        runs.wait()
        current[0] = policies[1]
        loop.policy_changed()
        runs.wait()
    finally:
        stop.set()
        loop.shutdown(timeout=WAIT)
    assert not loop.running
    assert runs.policies == [policies[0].hash, policies[1].hash]
    assert loop.metrics.runs == {"success": 2}


def test_shutdown_stops_the_loop_without_the_stop_event() -> None:
    runs = Runs()
    loop = ReportLoop(runs, make_policy, stop=threading.Event(), schedule=Schedule(interval=3600))
    loop.start()
    runs.wait()
    loop.shutdown(timeout=WAIT)
    assert not loop.running
    with pytest.raises(RuntimeError, match="already started"):
        loop.start()


def test_a_failed_run_is_counted_and_retried_on_the_schedule() -> None:
    runs = Runs(fail=True)
    stop = threading.Event()
    loop = ReportLoop(runs, make_policy, stop=stop, schedule=Schedule(interval=3600, retry=0))
    loop.start()
    try:
        runs.wait()
        runs.wait()  # retry 0: tried again at once, and the loop lives on
    finally:
        stop.set()
        loop.shutdown(timeout=WAIT)
    assert loop.metrics.runs["error"] >= 2 and loop.metrics.runs["success"] == 0


def test_a_run_without_an_api_server_fails_and_does_not_raise(policy: Policy) -> None:
    loop = ReportLoop(Runs(fail=True), lambda: policy, stop=threading.Event())
    assert loop.run_once() is False
    assert loop.metrics.runs == {"error": 1}


def test_the_policy_sets_the_interval_and_zero_turns_the_reports_off() -> None:
    off, hourly = make_policy({"audit": {"reportIntervalSeconds": 0}}), make_policy({})
    current = [off]
    runs = Runs()
    stop = threading.Event()
    schedule = Schedule(interval=60, settle=0)
    loop = ReportLoop(runs, lambda: current[0], stop=stop, schedule=schedule)
    loop.start()
    try:
        loop.policy_changed()  # woken while off: still nothing runs
        assert not runs.happened.acquire(timeout=0.5)
        current[0] = hourly
        loop.policy_changed()  # on again: a run at once, then the policy's interval
        runs.wait()
    finally:
        stop.set()
        loop.shutdown(timeout=WAIT)
    assert runs.policies == [hourly.hash]
    assert schedule.interval == hourly.audit.reportIntervalSeconds == 3600


def test_a_negative_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="not negative"):
        Schedule().every(-1)
