"""An audit as people read it (a table grouped by namespace) and as programs read it (JSON data)."""

from __future__ import annotations

import itertools
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


def _counts(findings: Iterable[Finding]) -> str:
    counts = Counter(f.worst() for f in findings)
    return ", ".join(f"{counts[v]} {v}" for v in VERDICTS if counts[v])


def _rows(finding: Finding) -> list[tuple[str, str, str, str]]:
    subject = finding.subject
    pods = f" ({finding.pods} pod{'s' if finding.pods != 1 else ''})" if finding.pods else ""
    workload = f"{subject.kind}/{subject.name}{pods}"
    shown: list[RuleResult] = [r for r in finding.results if r.verdict in SHOWN]
    shown.sort(key=lambda r: VERDICTS.index(r.verdict))
    if not shown:
        verdict = finding.worst()
        detail = "" if verdict == "pass" else "; ".join(finding.results[0].messages)
        return [(workload, "", verdict, detail)]
    return [
        (workload if index == 0 else "", r.rule, r.verdict, "; ".join(r.messages))
        for index, r in enumerate(shown)
    ]


def table(audit: Audit) -> str:
    """One block per namespace (cluster-scoped objects last), the most serious findings first."""
    if not audit.findings:
        return f"no accelerator workloads found ({_read(audit)})\n"
    ordered = sorted(
        audit.findings,
        key=lambda f: (f.subject.namespace == "", f.subject.namespace, VERDICTS.index(f.worst()), f.subject),
    )
    rows = [row for finding in ordered for row in _rows(finding)]
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    lines: list[str] = []
    for namespace, group in itertools.groupby(ordered, key=lambda f: f.subject.namespace):
        members = list(group)
        title = f"namespace {namespace}" if namespace else "cluster"
        lines.append(
            f"{title}: {len(members)} finding{'s' if len(members) != 1 else ''} ({_counts(members)})"
        )
        for finding in members:
            for row in _rows(finding):
                cells = [cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)]
                lines.append(("  " + "  ".join([*cells, row[3]])).rstrip())
        lines.append("")
    lines.append(f"{len(audit.findings)} findings ({_counts(audit.findings)}); {_read(audit)}")
    return "\n".join(lines) + "\n"


def _read(audit: Audit) -> str:
    kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(audit.scanned.items()))
    return f"read {kinds or 'nothing'}; policy {audit.policy_hash}"
