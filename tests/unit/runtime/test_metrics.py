"""The Prometheus text gpuguard serves: well-formed, cumulative, escaped, and counting what it says."""

from __future__ import annotations

import re

from webhook.policy.engine import Decision, Outcome
from webhook.policy.model import Mode, RuleId
from webhook.runtime.metrics import LATENCY_BUCKETS, Metrics
from webhook.runtime.policy_store import PolicyStatus

STATUS = PolicyStatus(
    hash='ab"c\\d', source="embedded default", loaded_at=1700000000.5, last_error=None, errors=2
)
SAMPLE = re.compile(r'^[a-z_]+(\{([a-z_]+="([^"\\]|\\.)*",?)*\})? [0-9.e+-]+$')


def decision(rule: RuleId, mode: Mode, outcome: Outcome) -> Decision:
    return Decision(rule=rule, mode=mode, outcome=outcome, message="")


def samples(text: str) -> dict[str, float]:
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if not line.startswith("#")
    }


def test_every_line_is_a_comment_or_a_well_formed_sample() -> None:
    metrics = Metrics()
    metrics.observe("mutate", "allowed", 0.0003, [decision("priority", "enforce", "applied")])
    text = metrics.render(STATUS)
    assert text.endswith("\n")
    for line in text.splitlines():
        assert line.startswith(("# HELP ", "# TYPE ")) or SAMPLE.match(line), line


def test_the_histogram_is_cumulative_and_counts_every_observation() -> None:
    metrics = Metrics()
    for seconds in (0.0001, 0.0004, 0.003, 2.0):
        metrics.observe("validate", "allowed", seconds, [])
    found = samples(metrics.render(STATUS))
    buckets = [
        found[f'gpuguard_admission_duration_seconds_bucket{{endpoint="validate",le="{b!r}"}}']
        for b in LATENCY_BUCKETS
    ]
    assert buckets == sorted(buckets)
    assert found['gpuguard_admission_duration_seconds_bucket{endpoint="validate",le="0.00025"}'] == 1
    assert found['gpuguard_admission_duration_seconds_bucket{endpoint="validate",le="+Inf"}'] == 4
    assert found['gpuguard_admission_duration_seconds_count{endpoint="validate"}'] == 4
    assert abs(found['gpuguard_admission_duration_seconds_sum{endpoint="validate"}'] - 2.0035) < 1e-9


def test_requests_and_decisions_are_counted_by_their_labels() -> None:
    metrics = Metrics()
    metrics.observe("mutate", "allowed", 0.001, [decision("priority", "enforce", "applied")] * 2)
    metrics.observe("validate", "denied", 0.001, [decision("acceleratorNodeGuard", "enforce", "denied")])
    found = samples(metrics.render(STATUS))
    assert found['gpuguard_admission_requests_total{endpoint="mutate",result="allowed"}'] == 1
    assert found['gpuguard_admission_requests_total{endpoint="validate",result="denied"}'] == 1
    assert found['gpuguard_decisions_total{rule="priority",mode="enforce",outcome="applied"}'] == 2
    assert found['gpuguard_decisions_total{rule="acceleratorNodeGuard",mode="enforce",outcome="denied"}'] == 1


def test_the_policy_series_escape_their_labels() -> None:
    found = samples(Metrics().render(STATUS))
    assert found['gpuguard_policy_info{hash="ab\\"c\\\\d"}'] == 1
    assert found["gpuguard_policy_loaded_timestamp_seconds"] == 1700000000.5
    assert found["gpuguard_policy_errors_total"] == 2
