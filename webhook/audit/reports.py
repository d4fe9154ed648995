"""Findings as the body of a PolicyReport: results, a summary, and nothing that changes between two runs
that found the same things, so that writing the same findings twice is no write at all.

The body is the same for `wgpolicyk8s.io/v1alpha2` (PolicyReport, ClusterPolicyReport) and
`openreports.io/v1alpha1` (Report, ClusterReport): their results share one schema. What differs (the
API group and kinds, openreports' top-level `source`) is the writer's business (`webhook.kube.reports`).
Verdicts map onto the report vocabulary as Kyverno's do: a change or a denial is a `fail`, a notice a
`warn`; a rule that is off or does not apply is a `skip`.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from webhook.audit.findings import Audit, Finding, RuleResult, Verdict

POLICY = "gpuguard"
SOURCE = "gpuguard"
# A report is one etcd object (1.5 MiB at most); a result is about 500 bytes.
MAX_RESULTS = 1000
OMITTED_ANNOTATION = "gpuguard.io/omitted-results"
POLICY_ANNOTATION = "gpuguard.io/policy"
REPORT_RESULT: dict[Verdict, str] = {
    "deny": "fail",
    "change": "fail",
    "warn": "warn",
    "pass": "pass",
    "skip": "skip",
}
# Only values every version of both schemas accepts (the first wgpolicy v1alpha2 CRDs lack critical and info).
SEVERITY: dict[Verdict, str] = {"deny": "high", "change": "medium", "warn": "low"}
SUMMARY_KEYS = ("pass", "fail", "warn", "error", "skip")
_RANK = {result: rank for rank, result in enumerate(("fail", "warn", "pass", "skip"))}


def by_namespace(audit: Audit) -> dict[str, list[Finding]]:
    """Findings by the namespace whose report holds them; "" is the cluster-scoped report."""
    grouped: dict[str, list[Finding]] = defaultdict(list)
    for finding in audit.findings:
        grouped[finding.subject.namespace].append(finding)
    return dict(grouped)


def _reference(finding: Finding) -> dict[str, str]:
    subject = finding.subject
    reference = {"apiVersion": subject.api_version, "kind": subject.kind, "name": subject.name}
    if subject.namespace:
        reference["namespace"] = subject.namespace
    if subject.uid:
        reference["uid"] = subject.uid
    return reference


def _result(finding: Finding, rule: RuleResult) -> dict[str, Any]:
    properties: dict[str, str] = {"verdict": rule.verdict, "mode": rule.mode}
    if finding.pods:
        properties["pods"] = str(finding.pods)
    result: dict[str, Any] = {
        "source": SOURCE,
        "policy": POLICY,
        "rule": rule.rule,
        "result": REPORT_RESULT[rule.verdict],
        "scored": True,
        "resources": [_reference(finding)],
        "properties": properties,
    }
    if rule.verdict in SEVERITY:
        result["severity"] = SEVERITY[rule.verdict]
    if rule.messages:
        result["message"] = "; ".join(rule.messages)
    return result


def _identity(result: Mapping[str, Any]) -> str:
    return json.dumps({k: v for k, v in result.items() if k != "timestamp"}, sort_keys=True)


def _sort_key(result: Mapping[str, Any]) -> tuple[int, str, str, str, str]:
    (resource,) = result["resources"]
    return (
        _RANK[result["result"]],
        resource.get("namespace", ""),
        resource["kind"],
        resource["name"],
        result["rule"],
    )


def body(
    findings: Iterable[Finding],
    previous: Mapping[str, Any] | None,
    *,
    now: int,
    policy_hash: str,
    limit: int = MAX_RESULTS,
) -> dict[str, Any]:
    """The report's content: `metadata` (annotations only), `results` and `summary`.

    Results are sorted failures first, then by resource and rule, and cut at `limit` (how many were left
    out is annotated). A result `previous` already held keeps its timestamp: the time it was first found.
    """
    results = sorted((_result(f, r) for f in findings for r in f.results), key=_sort_key)
    kept, omitted = results[:limit], len(results) - min(len(results), limit)
    first_seen = {
        _identity(old): old["timestamp"]
        for old in (previous or {}).get("results") or []
        if isinstance(old, dict) and isinstance(old.get("timestamp"), dict)
    }
    for result in kept:
        result["timestamp"] = first_seen.get(_identity(result), {"seconds": now, "nanos": 0})
    summary = dict.fromkeys(SUMMARY_KEYS, 0)
    for result in kept:
        summary[result["result"]] += 1
    annotations = {POLICY_ANNOTATION: policy_hash, OMITTED_ANNOTATION: str(omitted)}
    return {"metadata": {"annotations": annotations}, "results": kept, "summary": summary}
