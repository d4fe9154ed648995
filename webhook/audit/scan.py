"""The audit against a cluster: its objects listed page by page into the pure core, its findings written
as one report per namespace plus a cluster-scoped one, stale reports of gpuguard's removed."""

from __future__ import annotations

import functools
from collections import Counter

from webhook.audit import findings, reports
from webhook.kube.client import ApiClient
from webhook.kube.listing import ClusterReader
from webhook.kube.reports import MISSING_REPORT_API, ReportWriter, Written, served_report_api
from webhook.policy.model import Policy


def scan(reader: ClusterReader, policy: Policy, *, namespace: str | None = None) -> findings.Audit:
    """Every workload (in `namespace`, or everywhere), judged with `policy` and the facts read first.
    Accelerator nodes are checked in a cluster-wide audit only."""
    auditor = findings.Auditor(policy, reader.facts())
    # Custom kinds first: they own the Jobs, StatefulSets and pods that fold into them.
    for custom in policy.workload_kinds.kinds:
        if not custom.core:
            for obj in reader.custom_workloads(custom, namespace):
                auditor.add(obj)
    for group, kind in findings.KIND_ORDER:
        for obj in reader.workloads(group, kind, namespace):
            auditor.add(obj)
    return auditor.result(check_nodes=namespace is None)


def write_reports(
    writer: ReportWriter, audit: findings.Audit, *, now: int, namespace: str | None = None
) -> Counter[Written]:
    """Writes `audit` (of `namespace`, or of the whole cluster) as reports; counts what each write did.

    A report gpuguard wrote earlier for a namespace that now has no findings is deleted; within
    `namespace` only, when the audit covered one.
    """
    outcomes: Counter[Written] = Counter()
    grouped = reports.by_namespace(audit)
    for where, members in sorted(grouped.items()):
        desired = functools.partial(reports.body, members, now=now, policy_hash=audit.policy_hash)
        outcomes[writer.write(where, desired)] += 1
    for where, resource_version in sorted(writer.managed_namespaces(namespace).items()):
        if where not in grouped and writer.delete(where, resource_version):
            outcomes["deleted"] += 1
    return outcomes


class ClusterReports:
    """The background audit's cluster side: the whole cluster audited with a policy and written as
    reports, in whichever report API is served (asked on every run: a CRD may come or go)."""

    def __init__(self, api: ApiClient) -> None:
        self.api = api

    def __call__(self, policy: Policy, now: int) -> tuple[findings.Audit, Counter[Written]]:
        report_api = served_report_api(self.api)
        if report_api is None:
            raise RuntimeError(MISSING_REPORT_API)
        audit = scan(ClusterReader(self.api), policy)
        return audit, write_reports(ReportWriter(self.api, report_api), audit, now=now)
