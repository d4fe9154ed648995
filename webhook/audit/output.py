"""An audit as people read it (the rows of a table grouped by namespace) and as programs read it (JSON
data); the command line prints them (webhook.cli.audit)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from webhook.audit.findings import VERDICTS, Audit, Finding, RuleResult

SHOWN = ("deny", "change", "warn")  # verdicts the table gives a row each; a workload without one gets one row


def finding_document(finding: Finding) -> dict[str, Any]:
    subject = finding.subject
    document: dict[str, Any] = {"apiVersion": subject.api_version, "kind": subject.kind, "name": subject.name}
    if subject.namespace:
        document["namespace"] = subject.namespace
    if subject.uid:
        document["uid"] = subject.uid
    document["verdict"] = finding.worst()
    if finding.pods:
        document["pods"] = finding.pods
    document["rules"] = [
        {"rule": r.rule, "verdict": r.verdict, "mode": r.mode, "messages": list(r.messages)}
        for r in finding.results
    ]
    return document


def document(audit: Audit) -> dict[str, Any]:
    """What `-o json` and `-o yaml` print."""
    return {
        "policy": audit.policy_hash,
        "scanned": dict(sorted(audit.scanned.items())),
        "summary": {verdict: audit.count(verdict) for verdict in VERDICTS},
        "findings": [finding_document(f) for f in audit.findings],
    }


HEADERS = ("namespace", "workload", "rule", "verdict", "message")
CLUSTER = "(cluster)"  # the namespace column of nodes


def counts(findings: Iterable[Finding]) -> list[tuple[str, int]]:
    """How many findings have each verdict as their worst, every verdict named, most serious first."""
    worst = Counter(f.worst() for f in findings)
    return [(verdict, worst[verdict]) for verdict in VERDICTS]


def _rows(finding: Finding) -> list[tuple[str, str, str, str, str]]:
    subject = finding.subject
    namespace = subject.namespace or CLUSTER
    pods = f" ({finding.pods} pod{'s' if finding.pods != 1 else ''})" if finding.pods else ""
    workload = f"{subject.kind}/{subject.name}{pods}"
    shown: list[RuleResult] = [r for r in finding.results if r.verdict in SHOWN]
    shown.sort(key=lambda r: VERDICTS.index(r.verdict))
    if not shown:
        verdict = finding.worst()
        detail = "" if verdict == "pass" else "; ".join(finding.results[0].messages)
        return [(namespace, workload, "", verdict, detail)]
    return [
        (namespace, workload if index == 0 else "", r.rule, r.verdict, "; ".join(r.messages))
        for index, r in enumerate(shown)
    ]


def rows(audit: Audit) -> list[tuple[str, str, str, str, str]]:
    """The table's rows (`HEADERS`): grouped by namespace (cluster-scoped objects last), the most serious
    findings first in each, one row per rule that would deny, change or warn (a workload with none of
    those gets one row); the workload is named on its first row only."""
    ordered = sorted(
        audit.findings,
        key=lambda f: (f.subject.namespace == "", f.subject.namespace, VERDICTS.index(f.worst()), f.subject),
    )
    return [row for finding in ordered for row in _rows(finding)]


def read(audit: Audit) -> str:
    """What the audit read and with which policy: `read Deployment 2, Pod 5; policy 1a2b...`."""
    kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(audit.scanned.items()))
    return f"read {kinds or 'nothing'}; policy {audit.policy_hash}"
